#include "media/image_processor.h"

#include <xxhash.h>

#include <algorithm>
#include <cmath>
#include <nlohmann/json.hpp>

#include "core/error.h"

namespace kiln::media {
namespace {

using json = nlohmann::json;

// ---- resize weights ----------------------------------------------------------------------------------------

// Keys' cubic convolution kernel with a = -0.5, as each library writes it (the same function; the
// floating-point evaluation order is kept per library so weights match to the last bit).
double cubic_torch(double x) {  // UpSample.h: cubic_convolution1 / cubic_convolution2
  constexpr double a = -0.5;
  x = std::abs(x);
  if (x < 1.0) return ((a + 2) * x - (a + 3)) * x * x + 1;
  if (x < 2.0) return ((a * x - 5 * a) * x + 8 * a) * x - 4 * a;
  return 0.0;
}

double cubic_pillow(double x) {  // Resample.c: bicubic_filter
  constexpr double a = -0.5;
  if (x < 0.0) x = -x;
  if (x < 1.0) return ((a + 2.0) * x - (a + 3.0)) * x * x + 1;
  if (x < 2.0) return (((x - 5) * x + 8) * x - 4) * a;
  return 0.0;
}

// One axis of the separable resize: for output i, input samples start[i] .. start[i] + count[i] - 1 with
// fixed-point weights w[i * ksize + k] (scaled by 2^precision).
struct AxisFilter {
  int ksize = 0;
  int precision = 0;
  std::vector<int> start, count;
  std::vector<int32_t> weights;
};

// Both libraries compute the antialiased weights the same way (torch's comment: "Bounds approach as in PIL"):
//   scale = in / out, filterscale = max(scale, 1), support = 2 * filterscale (bicubic's support is 2),
//   center = (i + 0.5) * scale, xmin = max(int(center - support + 0.5), 0),
//   xmax = min(int(center + support + 0.5), in), w_j = cubic((xmin + j - center + 0.5) / filterscale),
//   normalised by their sum. They differ in the fixed point: Pillow scales by 2^22; torch finds the largest
//   precision (< 22) at which round(wt_max * 2^(precision + 1)) still fits below 2^15, wt_max the largest
//   weight of the whole axis, and stores int16.
AxisFilter make_filter(int in_size, int out_size, ProcessorBackend arith) {
  const bool torch = arith == ProcessorBackend::torchvision;
  const double scale = static_cast<double>(in_size) / out_size;
  const double filterscale = scale >= 1.0 ? scale : 1.0;
  const double support = 2.0 * filterscale;
  const double invscale = 1.0 / filterscale;
  AxisFilter f;
  f.ksize = static_cast<int>(std::ceil(support)) * 2 + 1;
  f.start.resize(out_size);
  f.count.resize(out_size);
  std::vector<double> w(static_cast<size_t>(out_size) * f.ksize, 0.0);
  double wt_max = 0.0;
  for (int i = 0; i < out_size; ++i) {
    const double center = (i + 0.5) * scale;
    const int64_t xmin = std::max<int64_t>(static_cast<int64_t>(center - support + 0.5), 0);
    const int64_t xmax = std::min<int64_t>(static_cast<int64_t>(center + support + 0.5), in_size);
    const int64_t xsize = std::clamp<int64_t>(xmax - xmin, 0, f.ksize);
    double* wi = &w[static_cast<size_t>(i) * f.ksize];
    double total = 0.0;
    for (int64_t j = 0; j < xsize; ++j) {
      const double x = (static_cast<double>(j + xmin) - center + 0.5) * invscale;
      wi[j] = torch ? cubic_torch(x) : cubic_pillow(x);
      total += wi[j];
    }
    if (total != 0.0)
      for (int64_t j = 0; j < xsize; ++j) {
        wi[j] /= total;
        wt_max = std::max(wt_max, wi[j]);
      }
    f.start[i] = static_cast<int>(xmin);
    f.count[i] = static_cast<int>(xsize);
  }
  if (torch) {
    // _compute_index_ranges_int16_weights
    unsigned precision = 0;
    for (precision = 0; precision < 22; ++precision) {
      const int next = static_cast<int>(0.5 + wt_max * (1 << (precision + 1)));
      if (next >= (1 << 15)) break;
    }
    f.precision = static_cast<int>(precision);
  } else {
    f.precision = 22;  // Resample.c: PRECISION_BITS = 32 - 8 - 2
  }
  f.weights.resize(w.size());
  for (size_t k = 0; k < w.size(); ++k) {
    const double v = w[k] * (1 << f.precision);
    const int q = v < 0 ? static_cast<int>(-0.5 + v) : static_cast<int>(0.5 + v);
    f.weights[k] = torch ? static_cast<int16_t>(q) : q;
  }
  return f;
}

uint8_t round_clip(int32_t acc, int precision) {
  // acc already holds the + 2^(precision - 1) of the rounding; >> is arithmetic (floor) in C++20.
  return static_cast<uint8_t>(std::clamp(acc >> precision, 0, 255));
}

// [h][in_w][3] -> [h][out_w][3]
void resample_rows(const uint8_t* src, int h, int in_w, int out_w, const AxisFilter& f, uint8_t* dst) {
  const int32_t half = 1 << (f.precision - 1);
  for (int y = 0; y < h; ++y) {
    const uint8_t* row = src + static_cast<size_t>(y) * in_w * 3;
    uint8_t* out = dst + static_cast<size_t>(y) * out_w * 3;
    for (int x = 0; x < out_w; ++x) {
      const int32_t* wx = &f.weights[static_cast<size_t>(x) * f.ksize];
      const uint8_t* px = row + static_cast<size_t>(f.start[x]) * 3;
      int32_t a0 = half, a1 = half, a2 = half;
      for (int k = 0; k < f.count[x]; ++k, px += 3) {
        a0 += px[0] * wx[k];
        a1 += px[1] * wx[k];
        a2 += px[2] * wx[k];
      }
      out[x * 3 + 0] = round_clip(a0, f.precision);
      out[x * 3 + 1] = round_clip(a1, f.precision);
      out[x * 3 + 2] = round_clip(a2, f.precision);
    }
  }
}

// [in_h][w][3] -> [out_h][w][3]
void resample_columns(const uint8_t* src, int w, int out_h, const AxisFilter& f, uint8_t* dst) {
  const size_t row = static_cast<size_t>(w) * 3;
  const int32_t half = 1 << (f.precision - 1);
  std::vector<int32_t> acc(row);
  for (int y = 0; y < out_h; ++y) {
    std::fill(acc.begin(), acc.end(), half);
    const int32_t* wy = &f.weights[static_cast<size_t>(y) * f.ksize];
    for (int k = 0; k < f.count[y]; ++k) {
      const uint8_t* in = src + static_cast<size_t>(f.start[y] + k) * row;
      const int32_t wk = wy[k];
      for (size_t i = 0; i < row; ++i) acc[i] += in[i] * wk;
    }
    uint8_t* out = dst + static_cast<size_t>(y) * row;
    for (size_t i = 0; i < row; ++i) out[i] = round_clip(acc[i], f.precision);
  }
}

// Python's round() on a float: to nearest, ties to even (the default rounding mode of nearbyint).
int64_t py_round(double x) { return static_cast<int64_t>(std::nearbyint(x)); }

// ---- preprocessor_config.json ------------------------------------------------------------------------------

int positive_int(const json& j, const char* key, int fallback, std::string_view source) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return fallback;
  if (!it->is_number_integer() || it->get<int64_t>() <= 0 || it->get<int64_t>() > (1 << 20))
    fail("{}: \"{}\" must be a positive integer", source, key);
  return it->get<int>();
}

int64_t pixel_count(const json& v, std::string_view key, std::string_view source) {
  if (!v.is_number_integer() || v.get<int64_t>() < 0 || v.get<int64_t>() > (int64_t{1} << 40))
    fail("{}: \"{}\" must be a non-negative integer number of pixels", source, key);
  return v.get<int64_t>();
}

bool boolean(const json& j, const char* key, bool fallback, std::string_view source) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return fallback;
  if (!it->is_boolean()) fail("{}: \"{}\" must be true or false", source, key);
  return it->get<bool>();
}

std::array<double, 3> per_channel(const json& j, const char* key, std::array<double, 3> fallback,
                                  std::string_view source) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return fallback;
  if (it->is_number()) return {it->get<double>(), it->get<double>(), it->get<double>()};
  if (!it->is_array() || it->size() != 3)
    fail("{}: \"{}\" must be a number or a list of 3 numbers (R, G, B)", source, key);
  std::array<double, 3> out{};
  for (int c = 0; c < 3; ++c) {
    if (!(*it)[c].is_number()) fail("{}: \"{}\" must hold numbers", source, key);
    out[c] = (*it)[c].get<double>();
  }
  return out;
}

}  // namespace

const char* processor_backend_name(ProcessorBackend backend) {
  return backend == ProcessorBackend::pil ? "pil" : "torchvision";
}

ImageProcessorConfig ImageProcessorConfig::qwen3_5() {
  ImageProcessorConfig c;
  c.patch_size = 16;
  c.temporal_patch_size = 2;
  c.merge_size = 2;
  c.min_pixels = 65536;
  c.max_pixels = 16777216;
  c.image_mean = {0.5, 0.5, 0.5};
  c.image_std = {0.5, 0.5, 0.5};
  c.source = "Qwen3.5 defaults";
  return c;
}

ImageProcessorConfig ImageProcessorConfig::parse(std::string_view text, std::string_view source) {
  const json j = json::parse(text.begin(), text.end(), nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) fail("{}: not valid JSON", source);
  if (!j.is_object()) fail("{}: expected a JSON object", source);

  ImageProcessorConfig c;
  c.source = std::string(source);
  if (auto it = j.find("image_processor_type"); it != j.end() && !it->is_null()) {
    const std::string type = it->is_string() ? it->get<std::string>() : it->dump();
    if (type == "Qwen2VLImageProcessorPil") c.backend = ProcessorBackend::pil;
    else if (type != "Qwen2VLImageProcessor" && type != "Qwen2VLImageProcessorFast")
      fail("{}: image_processor_type '{}' is not the Qwen2-VL image processor kiln implements "
           "(Qwen2VLImageProcessor, Qwen2VLImageProcessorFast, Qwen2VLImageProcessorPil)",
           source, type);
  }
  c.patch_size = positive_int(j, "patch_size", c.patch_size, source);
  c.temporal_patch_size = positive_int(j, "temporal_patch_size", c.temporal_patch_size, source);
  c.merge_size = positive_int(j, "merge_size", c.merge_size, source);
  c.do_resize = boolean(j, "do_resize", c.do_resize, source);
  c.do_rescale = boolean(j, "do_rescale", c.do_rescale, source);
  c.do_normalize = boolean(j, "do_normalize", c.do_normalize, source);
  c.image_mean = per_channel(j, "image_mean", c.image_mean, source);
  c.image_std = per_channel(j, "image_std", c.image_std, source);
  if (auto it = j.find("rescale_factor"); it != j.end() && !it->is_null()) {
    if (!it->is_number() || it->get<double>() <= 0) fail("{}: \"rescale_factor\" must be a positive number", source);
    c.rescale_factor = it->get<double>();
  }
  if (auto it = j.find("resample"); it != j.end() && !it->is_null()) {
    // PIL's numbering: 0 nearest, 1 lanczos, 2 bilinear, 3 bicubic, 4 box, 5 hamming.
    if (!it->is_number_integer() || it->get<int>() != 3)
      fail("{}: resample {} is not supported (kiln implements bicubic, 3, the Qwen2-VL default)", source,
           it->dump());
  }
  // size {"shortest_edge", "longest_edge"}; top-level min_pixels / max_pixels override it (transformers'
  // backward compatibility, in that order).
  if (auto it = j.find("size"); it != j.end() && !it->is_null()) {
    if (!it->is_object() || !it->contains("shortest_edge") || !it->contains("longest_edge"))
      fail("{}: \"size\" must contain 'shortest_edge' and 'longest_edge' keys (the pixel budget)", source);
    c.min_pixels = pixel_count((*it)["shortest_edge"], "size.shortest_edge", source);
    c.max_pixels = pixel_count((*it)["longest_edge"], "size.longest_edge", source);
  }
  if (auto it = j.find("min_pixels"); it != j.end() && !it->is_null()) c.min_pixels = pixel_count(*it, "min_pixels", source);
  if (auto it = j.find("max_pixels"); it != j.end() && !it->is_null()) c.max_pixels = pixel_count(*it, "max_pixels", source);
  return c;
}

ImageProcessorConfig ImageProcessorConfig::load(const format::ModelDir& dir) {
  constexpr const char* kFile = "preprocessor_config.json";
  if (!dir.has(kFile)) {
    ImageProcessorConfig c = qwen3_5();
    c.source = fmt::format("Qwen3.5 defaults ({} has no {})", dir.display_path(), kFile);
    return c;
  }
  return parse(dir.read_text(kFile), fmt::format("{}/{}", dir.display_path(), kFile));
}

ResizedSize smart_resize(int height, int width, int factor, int64_t min_pixels, int64_t max_pixels) {
  if (height <= 0 || width <= 0) fail("image: zero-size image ({} x {})", width, height);
  KILN_CHECK(factor > 0);
  const double ratio = static_cast<double>(std::max(height, width)) / std::min(height, width);
  if (ratio > 200)
    fail("image: {} x {} has an aspect ratio of {:.1f}, above the 200 the Qwen2-VL processor accepts", width, height,
         ratio);
  const double h = height, w = width, f = factor;
  // Python divides the exact integer h * w; the product is below 2^53 here (decode limits), so the double is
  // exact too and both divisions round once, the same way.
  const double area = static_cast<double>(int64_t{height} * width);
  int64_t h_bar = py_round(h / f) * factor;
  int64_t w_bar = py_round(w / f) * factor;
  if (h_bar * w_bar > max_pixels) {
    const double beta = std::sqrt(area / static_cast<double>(max_pixels));
    h_bar = std::max<int64_t>(factor, static_cast<int64_t>(std::floor(h / beta / f)) * factor);
    w_bar = std::max<int64_t>(factor, static_cast<int64_t>(std::floor(w / beta / f)) * factor);
  } else if (h_bar * w_bar < min_pixels) {
    const double beta = std::sqrt(static_cast<double>(min_pixels) / area);
    h_bar = static_cast<int64_t>(std::ceil(h * beta / f)) * factor;
    w_bar = static_cast<int64_t>(std::ceil(w * beta / f)) * factor;
  }
  if (h_bar <= 0 || w_bar <= 0)
    fail("image: {} x {} is too small: it resizes to {} x {} (raise the processor's min_pixels)", width, height,
         w_bar, h_bar);
  if (h_bar > (1 << 20) || w_bar > (1 << 20))
    fail("image: {} x {} resizes to {} x {}, beyond what kiln processes", width, height, w_bar, h_bar);
  return {static_cast<int>(h_bar), static_cast<int>(w_bar)};
}

RgbImage resize_bicubic(const RgbImage& image, int height, int width, ProcessorBackend arithmetic) {
  KILN_CHECK(image.width > 0 && image.height > 0 && height > 0 && width > 0);
  KILN_CHECK(image.rgb.size() == static_cast<size_t>(image.width) * image.height * 3);
  RgbImage out;
  out.width = width;
  out.height = height;
  if (width == image.width && height == image.height) {
    out.rgb = image.rgb;
    return out;
  }
  // Horizontal pass first, then vertical, each only when its size changes (torch and Pillow alike).
  const RgbImage* src = &image;
  RgbImage horizontal;
  if (width != image.width) {
    horizontal.width = width;
    horizontal.height = image.height;
    horizontal.rgb.resize(static_cast<size_t>(width) * image.height * 3);
    resample_rows(image.rgb.data(), image.height, image.width, width, make_filter(image.width, width, arithmetic),
                  horizontal.rgb.data());
    src = &horizontal;
  }
  if (height != image.height) {
    out.rgb.resize(static_cast<size_t>(width) * height * 3);
    resample_columns(src->rgb.data(), width, height, make_filter(image.height, height, arithmetic), out.rgb.data());
  } else {
    out.rgb = std::move(horizontal.rgb);
  }
  return out;
}

std::string ImageHash::hex() const { return fmt::format("{:016x}{:016x}", high, low); }

ImageHash image_content_hash(const RgbImage& image) {
  XXH3_state_t* state = XXH3_createState();
  KILN_CHECK(state != nullptr);
  XXH3_128bits_reset(state);
  // "RGB8", then width and height as little-endian uint32: a 2 x 3 and a 3 x 2 image of the same bytes differ.
  uint8_t header[12] = {'R', 'G', 'B', '8'};
  for (int i = 0; i < 4; ++i) {
    header[4 + i] = static_cast<uint8_t>(static_cast<uint32_t>(image.width) >> (8 * i));
    header[8 + i] = static_cast<uint8_t>(static_cast<uint32_t>(image.height) >> (8 * i));
  }
  XXH3_128bits_update(state, header, sizeof(header));
  XXH3_128bits_update(state, image.rgb.data(), image.rgb.size());
  const XXH128_hash_t h = XXH3_128bits_digest(state);
  XXH3_freeState(state);
  return {h.high64, h.low64};
}

ImageProcessor::ImageProcessor(ImageProcessorConfig config) : config_(std::move(config)) {
  const auto& c = config_;
  if (c.patch_size <= 0 || c.merge_size <= 0 || c.temporal_patch_size <= 0)
    fail("{}: patch_size, merge_size and temporal_patch_size must be positive", c.source);
  if (c.do_resize && c.min_pixels > c.max_pixels)
    fail("{}: the pixel budget is empty (min_pixels {} > max_pixels {})", c.source, c.min_pixels, c.max_pixels);
  for (int ch = 0; ch < 3; ++ch)
    if (c.do_normalize && !(std::isfinite(c.image_std[ch]) && c.image_std[ch] != 0.0 && std::isfinite(c.image_mean[ch])))
      fail("{}: image_std must be non-zero and image_mean / image_std finite", c.source);

  // Step 3 depends only on (channel, uint8 value): one table, computed in each backend's float32 arithmetic.
  for (int ch = 0; ch < 3; ++ch) {
    const float mean = static_cast<float>(c.image_mean[ch]);
    const float std = static_cast<float>(c.image_std[ch]);
    for (int v = 0; v < 256; ++v) {
      float out;
      if (c.backend == ProcessorBackend::torchvision) {
        // TorchvisionBackend._rescale_and_normalize: with both on, mean and std become float32 tensors times
        // float32(1 / rescale_factor) and tvF.normalize computes (x - mean) / std on the float32 image.
        const float x = static_cast<float>(v);
        if (c.do_normalize) {
          const float inv = static_cast<float>(1.0 / c.rescale_factor);
          const float m = c.do_rescale ? mean * inv : mean;
          const float s = c.do_rescale ? std * inv : std;
          out = (x - m) / s;
        } else if (c.do_rescale) {
          out = x * static_cast<float>(c.rescale_factor);
        } else {
          out = x;
        }
      } else {
        // image_transforms.rescale: float64 product, then float32; normalize: float32 (x - mean) / std.
        float x = c.do_rescale ? static_cast<float>(static_cast<double>(v) * c.rescale_factor) : static_cast<float>(v);
        if (c.do_normalize) x = (x - mean) / std;
        out = x;
      }
      value_table_[ch][v] = out;
    }
  }
}

ResizedSize ImageProcessor::target_size(int height, int width) const {
  const int factor = config_.patch_size * config_.merge_size;
  if (config_.do_resize) return smart_resize(height, width, factor, config_.min_pixels, config_.max_pixels);
  if (height % factor != 0 || width % factor != 0)
    fail("image: {} x {} is not a multiple of {} pixels and the processor's do_resize is off", width, height, factor);
  return {height, width};
}

int64_t ImageProcessor::num_image_tokens(int height, int width) const {
  const ResizedSize s = target_size(height, width);
  const int64_t patches = int64_t{s.height / config_.patch_size} * (s.width / config_.patch_size);
  return patches / (int64_t{config_.merge_size} * config_.merge_size);
}

ProcessedImage ImageProcessor::process(const RgbImage& image) const {
  KILN_CHECK(image.rgb.size() == static_cast<size_t>(image.width) * image.height * 3, "RGB image of {} bytes",
             image.rgb.size());
  const int P = config_.patch_size, M = config_.merge_size, T = config_.temporal_patch_size;
  const ResizedSize size = target_size(image.height, image.width);
  const RgbImage resized = resize_bicubic(image, size.height, size.width, config_.backend);

  ProcessedImage out;
  out.hash = image_content_hash(image);
  out.merge_size = M;
  out.resized_height = size.height;
  out.resized_width = size.width;
  out.grid_t = 1;  // one frame, repeated T times along time
  out.grid_h = size.height / P;
  out.grid_w = size.width / P;
  out.patch_dim = int64_t{3} * T * P * P;
  out.pixel_values.resize(static_cast<size_t>(out.num_patches() * out.patch_dim));

  // Rows in (t, h / merge, w / merge, merge_h, merge_w) order; each row (c, t, y, x) within its patch.
  const int W = size.width;
  float* dst = out.pixel_values.data();
  for (int64_t bh = 0; bh < out.grid_h / M; ++bh)
    for (int64_t bw = 0; bw < out.grid_w / M; ++bw)
      for (int mh = 0; mh < M; ++mh)
        for (int mw = 0; mw < M; ++mw) {
          const int64_t y0 = (bh * M + mh) * P, x0 = (bw * M + mw) * P;
          for (int c = 0; c < 3; ++c) {
            const std::array<float, 256>& table = value_table_[c];
            for (int t = 0; t < T; ++t)
              for (int py = 0; py < P; ++py) {
                const uint8_t* src = &resized.rgb[((y0 + py) * W + x0) * 3 + c];
                for (int px = 0; px < P; ++px) *dst++ = table[src[px * 3]];
              }
          }
        }
  KILN_CHECK(dst == out.pixel_values.data() + out.pixel_values.size());
  return out;
}

}  // namespace kiln::media
