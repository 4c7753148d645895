// The Qwen2-VL image processor: smart_resize against sizes worked out by hand from transformers' definition,
// the patch layout against the inverse map (where each source pixel must land), the normalisation against
// double-precision arithmetic, the resize against a direct double-precision bicubic, the config files, and
// transformers' own outputs on the fixtures of tools/reference/make_image_fixtures.py.
#include "media/image_processor.h"

#include <gtest/gtest.h>

#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>

#include "core/error.h"
#include "format/model_dir.h"
#include "media_test_util.h"

namespace kiln::media {
namespace {

namespace fs = std::filesystem;
using namespace test;

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const InternalError& e) {
    ADD_FAILURE() << "internal error: " << e.what();
    return e.what();
  } catch (const Error& e) {
    return e.what();
  }
  ADD_FAILURE() << "no error";
  return "";
}

std::string read_text(const std::string& path) {
  std::ifstream in(path);
  EXPECT_TRUE(in) << path;
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

RgbImage make_image(int w, int h, const std::function<uint8_t(int c, int y, int x)>& value) {
  RgbImage img;
  img.width = w, img.height = h;
  img.rgb.resize(static_cast<size_t>(w) * h * 3);
  for (int y = 0; y < h; ++y)
    for (int x = 0; x < w; ++x)
      for (int c = 0; c < 3; ++c) img.rgb[(static_cast<size_t>(y) * w + x) * 3 + c] = value(c, y, x);
  return img;
}

// ---- smart_resize ----

TEST(SmartResize, HandWorkedCases) {
  // factor 32 (Qwen3.5: patch 16 x merge 2) throughout.
  // 479 x 641 (h x w), Qwen3.5's budget [65536, 16777216]: 479/32 = 14.97 -> 15 -> 480; 641/32 = 20.03 -> 20
  // -> 640; 480 * 640 = 307200 is inside the budget.
  EXPECT_EQ(smart_resize(479, 641, 32, 65536, 16777216).height, 480);
  EXPECT_EQ(smart_resize(479, 641, 32, 65536, 16777216).width, 640);
  // Python's round() ties to even: 80/32 = 2.5 -> 2 -> 64 (not 96); 48/32 = 1.5 -> 2 -> 64; 112/32 = 3.5 -> 4.
  ResizedSize s = smart_resize(80, 48, 32, 1024, 1000000000);
  EXPECT_EQ(s.height, 64);
  EXPECT_EQ(s.width, 64);
  EXPECT_EQ(smart_resize(112, 48, 32, 1024, 1000000000).height, 128);
  // Above the budget: 1000 x 3000, max 1e6. Rounded 992 x 3008 = 2983936 > 1e6, so beta = sqrt(3e6 / 1e6)
  // = 1.7320508; 1000 / beta / 32 = 18.04 -> floor 18 -> 576; 3000 / beta / 32 = 54.13 -> 54 -> 1728.
  s = smart_resize(1000, 3000, 32, 65536, 1000000);
  EXPECT_EQ(s.height, 576);
  EXPECT_EQ(s.width, 1728);
  // Below the budget: 23 x 17, min 65536. Rounded 32 x 32 = 1024 < 65536, so beta = sqrt(65536 / 391)
  // = 12.9465; 23 * beta / 32 = 9.31 -> ceil 10 -> 320; 17 * beta / 32 = 6.88 -> 7 -> 224.
  s = smart_resize(23, 17, 32, 65536, 16777216);
  EXPECT_EQ(s.height, 320);
  EXPECT_EQ(s.width, 224);
  // A side that floors to 0 is held at one factor: 40 x 7000, max 65536. Rounded 32 x 7008 = 224256 > max;
  // beta = sqrt(280000 / 65536) = 2.0670; 40 / beta / 32 = 0.60 -> 0 -> max(32, 0) = 32; 7000 / beta / 32
  // = 105.83 -> 105 -> 3360.
  s = smart_resize(40, 7000, 32, 1024, 65536);
  EXPECT_EQ(s.height, 32);
  EXPECT_EQ(s.width, 3360);
  // A side that rounds to 0 goes through the minimum branch: 12 x 20, min 1024. round(0.375) = 0 -> 0 < min;
  // beta = sqrt(1024 / 240) = 2.0656; 12 * beta / 32 = 0.77 -> 1 -> 32; 20 * beta / 32 = 1.29 -> 2 -> 64.
  s = smart_resize(12, 20, 32, 1024, 2048);
  EXPECT_EQ(s.height, 32);
  EXPECT_EQ(s.width, 64);
  // Exactly on the budget: untouched. 4000 x 3000: 125 * 32 = 4000; 93.75 -> 94 -> 3008; 12032000 <= 16777216.
  s = smart_resize(4000, 3000, 32, 65536, 16777216);
  EXPECT_EQ(s.height, 4000);
  EXPECT_EQ(s.width, 3008);
  // Qwen2-VL's factor 28: 224 x 224 stays (8 * 28).
  EXPECT_EQ(smart_resize(224, 224, 28, 3136, 1003520).height, 224);
}

TEST(SmartResize, RefusesExtremeAspectRatios) {
  // max / min > 200 is refused (transformers raises ValueError); exactly 200 is accepted.
  EXPECT_NE(error_of([] { smart_resize(1, 201, 32, 65536, 16777216); }).find("aspect ratio"), std::string::npos);
  EXPECT_NO_THROW(smart_resize(1, 200, 32, 65536, 16777216));
  EXPECT_NE(error_of([] { smart_resize(0, 10, 32, 1, 2); }).find("zero-size"), std::string::npos);
}

// ---- config ----

TEST(ImageProcessorConfig, CommittedQwen35ConfigsParse) {
  for (const char* dir : {"configs/qwen3.5-397b-a17b-nvfp4", "configs/qwen3.5-35b-a3b-nvfp4"}) {
    const std::string path = std::string(KILN_SOURCE_DIR) + "/" + dir + "/preprocessor_config.json";
    const ImageProcessorConfig c = ImageProcessorConfig::parse(read_text(path), path);
    EXPECT_EQ(c.patch_size, 16);
    EXPECT_EQ(c.temporal_patch_size, 2);
    EXPECT_EQ(c.merge_size, 2);
    EXPECT_EQ(c.min_pixels, 65536);
    EXPECT_EQ(c.max_pixels, 16777216);
    EXPECT_EQ(c.image_mean, (std::array<double, 3>{0.5, 0.5, 0.5}));
    EXPECT_EQ(c.image_std, (std::array<double, 3>{0.5, 0.5, 0.5}));
    EXPECT_DOUBLE_EQ(c.rescale_factor, 1.0 / 255);
    EXPECT_TRUE(c.do_resize && c.do_rescale && c.do_normalize);
    EXPECT_EQ(c.backend, ProcessorBackend::torchvision);  // "Qwen2VLImageProcessorFast"
    const ImageProcessorConfig d = ImageProcessorConfig::qwen3_5();
    EXPECT_EQ(d.patch_size, c.patch_size);
    EXPECT_EQ(d.min_pixels, c.min_pixels);
    EXPECT_EQ(d.max_pixels, c.max_pixels);
    EXPECT_EQ(d.image_mean, c.image_mean);
  }
}

TEST(ImageProcessorConfig, MissingKeysTakeTheClassDefaultsAndOverridesApply) {
  ImageProcessorConfig c = ImageProcessorConfig::parse("{}", "test");
  EXPECT_EQ(c.patch_size, 14);
  EXPECT_EQ(c.min_pixels, 56 * 56);
  EXPECT_EQ(c.max_pixels, 28 * 28 * 1280);
  EXPECT_DOUBLE_EQ(c.image_mean[0], 0.48145466);
  EXPECT_DOUBLE_EQ(c.image_std[2], 0.27577711);
  // Qwen2.5-VL's file carries both spellings; top-level min_pixels / max_pixels win over size.
  c = ImageProcessorConfig::parse(
      R"({"size": {"shortest_edge": 100, "longest_edge": 200}, "min_pixels": 3136, "max_pixels": 12845056,
          "image_processor_type": "Qwen2VLImageProcessor", "resample": 3, "rescale_factor": 0.00392156862745098,
          "image_mean": 0.5, "do_normalize": false})",
      "test");
  EXPECT_EQ(c.min_pixels, 3136);
  EXPECT_EQ(c.max_pixels, 12845056);
  EXPECT_EQ(c.image_mean, (std::array<double, 3>{0.5, 0.5, 0.5}));
  EXPECT_FALSE(c.do_normalize);
  EXPECT_EQ(ImageProcessorConfig::parse(R"({"image_processor_type": "Qwen2VLImageProcessorPil"})", "t").backend,
            ProcessorBackend::pil);
}

TEST(ImageProcessorConfig, BadFilesAreErrorsNamingTheFile) {
  auto err = [](const char* text) { return error_of([&] { ImageProcessorConfig::parse(text, "dir/pp.json"); }); };
  EXPECT_NE(err("{").find("dir/pp.json: not valid JSON"), std::string::npos);
  EXPECT_NE(err(R"({"size": {"height": 224, "width": 224}})").find("shortest_edge"), std::string::npos);
  EXPECT_NE(err(R"({"resample": 2})").find("resample 2 is not supported"), std::string::npos);
  EXPECT_NE(err(R"({"image_processor_type": "SiglipImageProcessor"})").find("not the Qwen2-VL"), std::string::npos);
  EXPECT_NE(err(R"({"patch_size": 0})").find("patch_size"), std::string::npos);
  EXPECT_NE(err(R"({"image_mean": [0.5, 0.5]})").find("3 numbers"), std::string::npos);
  EXPECT_NE(err(R"({"do_resize": "yes"})").find("true or false"), std::string::npos);
}

TEST(ImageProcessorConfig, LoadsFromAModelFolderOrFallsBackToQwen35) {
  const fs::path dir = fs::temp_directory_path() / ("kiln_media_pp_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir);
  std::ofstream(dir / "config.json") << "{}";
  ImageProcessorConfig c = ImageProcessorConfig::load(format::ModelDir::open(dir.string()));
  EXPECT_EQ(c.patch_size, 16);
  EXPECT_NE(c.source.find("Qwen3.5 defaults"), std::string::npos) << c.source;
  std::ofstream(dir / "preprocessor_config.json") << R"({"patch_size": 14, "merge_size": 2})";
  c = ImageProcessorConfig::load(format::ModelDir::open(dir.string()));
  EXPECT_EQ(c.patch_size, 14);
  EXPECT_NE(c.source.find("preprocessor_config.json"), std::string::npos) << c.source;
  fs::remove_all(dir);
}

// ---- layout, normalisation, tokens ----

TEST(ImageProcessor, PatchLayoutPutsEveryPixelWhereTransformersDoes) {
  // No resize / rescale / normalise: pixel_values are the pixels. Channel 0 holds x, channel 1 holds y,
  // channel 2 a mix, on a 64 x 96 image (grid 6 x 4 patches of 16, merged 2 x 2).
  ImageProcessorConfig cfg = ImageProcessorConfig::qwen3_5();
  cfg.do_resize = cfg.do_rescale = cfg.do_normalize = false;
  const int W = 64, H = 96, P = 16, M = 2, T = 2;
  auto value = [](int c, int y, int x) {
    return static_cast<uint8_t>(c == 0 ? x : c == 1 ? y : (x + 3 * y) % 256);
  };
  const ProcessedImage out = ImageProcessor(cfg).process(make_image(W, H, value));
  ASSERT_EQ(out.grid_t, 1);
  ASSERT_EQ(out.grid_h, H / P);
  ASSERT_EQ(out.grid_w, W / P);
  ASSERT_EQ(out.patch_dim, 3 * T * P * P);
  ASSERT_EQ(out.pixel_values.size(), static_cast<size_t>(H / P * W / P * 3 * T * P * P));
  EXPECT_EQ(out.num_image_tokens(), (H / P) * (W / P) / 4);

  // Where pixel (c, t, y, x) lands: its patch (ph, pw) = (y / P, x / P) splits into merge block
  // (ph / M, pw / M) and position (ph % M, pw % M); rows run over (block row, block column, merge row,
  // merge column); columns over (c, t, y % P, x % P).
  std::vector<int> hits(out.pixel_values.size(), 0);
  const int gw = W / P;
  for (int y = 0; y < H; ++y)
    for (int x = 0; x < W; ++x)
      for (int c = 0; c < 3; ++c)
        for (int t = 0; t < T; ++t) {
          const int ph = y / P, pw = x / P;
          const int row = ((ph / M) * (gw / M) + pw / M) * M * M + (ph % M) * M + pw % M;
          const int col = ((c * T + t) * P + y % P) * P + x % P;
          const size_t at = static_cast<size_t>(row) * out.patch_dim + col;
          ASSERT_EQ(out.pixel_values[at], value(c, y, x)) << "c " << c << " t " << t << " y " << y << " x " << x;
          ++hits[at];
        }
  for (int h : hits) ASSERT_EQ(h, 1);  // a bijection: every slot filled once
}

TEST(ImageProcessor, NormalisationMatchesDoubleArithmetic) {
  for (ProcessorBackend backend : {ProcessorBackend::torchvision, ProcessorBackend::pil}) {
    ImageProcessorConfig cfg = ImageProcessorConfig::qwen3_5();
    cfg.do_resize = false;
    cfg.image_mean = {0.1, 0.45, 0.8};
    cfg.image_std = {0.9, 0.3, 0.2};
    cfg.backend = backend;
    const ImageProcessor proc(cfg);
    for (int v = 0; v < 256; ++v) {
      auto value = [v](int c, int, int) { return static_cast<uint8_t>(c == 0 ? v : c == 1 ? 255 - v : (v * 7) % 256); };
      const ProcessedImage out = proc.process(make_image(32, 32, value));
      const int64_t per_channel = out.patch_dim / 3;
      for (int64_t i = 0; i < static_cast<int64_t>(out.pixel_values.size()); i += 97) {
        const int c = static_cast<int>((i % out.patch_dim) / per_channel);
        const double expected = (value(c, 0, 0) / 255.0 - cfg.image_mean[c]) / cfg.image_std[c];
        ASSERT_NEAR(out.pixel_values[i], expected, 4e-6 * std::max(1.0, std::abs(expected)))
            << processor_backend_name(backend) << " value " << v << " channel " << c;
      }
    }
  }
}

TEST(ImageProcessor, TokenCountsFollowTheGrid) {
  const ImageProcessor proc(ImageProcessorConfig::qwen3_5());
  // 479 x 641 -> 480 x 640 -> grid 30 x 40 = 1200 patches -> 1200 / 4 = 300 tokens.
  EXPECT_EQ(proc.num_image_tokens(479, 641), 300);
  // 17 x 23 -> 320 x 224 (above) -> 20 x 14 = 280 patches -> 70 tokens.
  EXPECT_EQ(proc.num_image_tokens(23, 17), 70);
  const ProcessedImage out = proc.process(make_image(17, 23, [](int, int y, int x) { return uint8_t(x * y); }));
  EXPECT_EQ(out.resized_height, 320);
  EXPECT_EQ(out.resized_width, 224);
  EXPECT_EQ(out.num_image_tokens(), 70);
  ImageProcessorConfig fixed = ImageProcessorConfig::qwen3_5();
  fixed.do_resize = false;
  EXPECT_NE(error_of([&] { ImageProcessor(fixed).num_image_tokens(40, 64); }).find("not a multiple of 32"),
            std::string::npos);
}

// ---- resize ----

// Keys' cubic, a = -0.5, in expanded form.
double keys_cubic(double x) {
  x = std::abs(x);
  if (x < 1) return 1.5 * x * x * x - 2.5 * x * x + 1;
  if (x < 2) return -0.5 * x * x * x + 2.5 * x * x - 4 * x + 2;
  return 0;
}

// Direct double-precision antialiased bicubic, rows then columns, no rounding: output i samples the input
// around its centre (i + 0.5) * in / out with the kernel stretched by max(in / out, 1), the weights
// renormalised over the pixels inside the image.
std::vector<double> reference_resize(const RgbImage& img, int out_h, int out_w) {
  auto weights = [](int n, int m, int i) {
    const double scale = static_cast<double>(n) / m, fs = std::max(scale, 1.0);
    const double center = (i + 0.5) * scale;
    std::vector<double> w(n);
    double sum = 0;
    for (int j = 0; j < n; ++j) sum += w[j] = keys_cubic((j + 0.5 - center) / fs);
    for (double& v : w) v /= sum;
    return w;
  };
  std::vector<double> mid(static_cast<size_t>(img.height) * out_w * 3, 0.0);
  for (int x = 0; x < out_w; ++x) {
    const std::vector<double> w = weights(img.width, out_w, x);
    for (int y = 0; y < img.height; ++y)
      for (int c = 0; c < 3; ++c) {
        double acc = 0;
        for (int j = 0; j < img.width; ++j) acc += w[j] * img.rgb[(static_cast<size_t>(y) * img.width + j) * 3 + c];
        mid[(static_cast<size_t>(y) * out_w + x) * 3 + c] = acc;
      }
  }
  std::vector<double> out(static_cast<size_t>(out_h) * out_w * 3, 0.0);
  for (int y = 0; y < out_h; ++y) {
    const std::vector<double> w = weights(img.height, out_h, y);
    for (int x = 0; x < out_w; ++x)
      for (int c = 0; c < 3; ++c) {
        double acc = 0;
        for (int j = 0; j < img.height; ++j) acc += w[j] * mid[(static_cast<size_t>(j) * out_w + x) * 3 + c];
        out[(static_cast<size_t>(y) * out_w + x) * 3 + c] = acc;
      }
  }
  return out;
}

TEST(ResizeBicubic, CloseToADirectDoublePrecisionBicubic) {
  // Values in [40, 215]: the kernel's overshoot (< 10% of a step) never reaches 0 or 255, so clamping plays no
  // part. kiln rounds after each pass: at most 0.5 after the first, carried through the second pass's weights
  // (|w| sums to < 1.3), plus 0.5 at the end: within 2 levels of the unrounded result.
  const RgbImage img = make_image(53, 37, [](int c, int y, int x) {
    return static_cast<uint8_t>(40 + (std::hash<int>()(c * 10007 + y * 131 + x) * 2654435761u >> 7) % 176);
  });
  for (ProcessorBackend backend : {ProcessorBackend::torchvision, ProcessorBackend::pil})
    for (auto [h, w] : {std::pair{32, 64}, std::pair{96, 32}, std::pair{13, 11}, std::pair{37, 100}, std::pair{64, 53}}) {
      const RgbImage out = resize_bicubic(img, h, w, backend);
      const std::vector<double> ref = reference_resize(img, h, w);
      double sum = 0, worst = 0;
      for (size_t i = 0; i < ref.size(); ++i) {
        const double d = std::abs(out.rgb[i] - ref[i]);
        sum += d;
        worst = std::max(worst, d);
      }
      EXPECT_LE(worst, 2.0) << processor_backend_name(backend) << " " << h << " x " << w;
      EXPECT_LT(sum / ref.size(), 0.5) << processor_backend_name(backend) << " " << h << " x " << w;
    }
}

TEST(ResizeBicubic, UniformStaysUniformAndSameSizeIsACopy) {
  const RgbImage flat = make_image(41, 29, [](int c, int, int) { return static_cast<uint8_t>(60 + 70 * c); });
  for (ProcessorBackend backend : {ProcessorBackend::torchvision, ProcessorBackend::pil}) {
    const RgbImage out = resize_bicubic(flat, 64, 32, backend);
    for (size_t i = 0; i < out.rgb.size(); ++i) ASSERT_EQ(out.rgb[i], 60 + 70 * (i % 3)) << i;
    const RgbImage same = resize_bicubic(flat, 29, 41, backend);
    EXPECT_EQ(same.rgb, flat.rgb);
  }
}

TEST(ResizeBicubic, TheTwoArithmeticsDifferByRoundingOnly) {
  const RgbImage img = make_image(200, 150, [](int c, int y, int x) { return static_cast<uint8_t>((x * x + 7 * y + 50 * c) % 256); });
  const RgbImage a = resize_bicubic(img, 64, 96, ProcessorBackend::torchvision);
  const RgbImage b = resize_bicubic(img, 64, 96, ProcessorBackend::pil);
  int worst = 0;
  for (size_t i = 0; i < a.rgb.size(); ++i) worst = std::max(worst, std::abs(int{a.rgb[i]} - int{b.rgb[i]}));
  EXPECT_LE(worst, 2);
}

// ---- hash ----

TEST(ImageHash, DependsOnPixelsAndDimensions) {
  const RgbImage a = make_image(3, 2, [](int c, int y, int x) { return static_cast<uint8_t>(c + 3 * x + 9 * y); });
  RgbImage b = a;
  EXPECT_EQ(image_content_hash(a), image_content_hash(b));
  b.rgb[7] ^= 1;
  EXPECT_NE(image_content_hash(a), image_content_hash(b));
  RgbImage t = a;  // the same bytes as a 2 x 3 image
  t.width = 2, t.height = 3;
  EXPECT_NE(image_content_hash(a), image_content_hash(t));
  EXPECT_EQ(image_content_hash(a).hex().size(), 32u);
  const ImageProcessor proc(ImageProcessorConfig::qwen3_5());
  EXPECT_EQ(proc.process(a).hash, image_content_hash(a));
}

// ---- transformers fixtures ----

struct Stats {
  double worst = 0;
  int64_t differing = 0;
  int64_t total = 0;
};

// pixel_values (ours: [N, 3, T, P, P]) against expected values laid out [N, 3, T_expected, P, P], where
// T_expected is T (the full tensor) or 1 (the time-0 slice the fixtures keep for the second processor).
Stats compare(const ProcessedImage& ours, const format::TensorInfo& expected, int T, int P, int t_expected) {
  Stats s;
  const float* e = reinterpret_cast<const float*>(expected.data);
  const int64_t n = ours.num_patches();
  for (int64_t r = 0; r < n; ++r)
    for (int c = 0; c < 3; ++c)
      for (int t = 0; t < T; ++t)
        for (int i = 0; i < P * P; ++i) {
          const float o = ours.pixel_values[((r * 3 + c) * T + t) * P * P + i];
          const float x = e[((r * 3 + c) * t_expected + (t_expected == 1 ? 0 : t)) * P * P + i];
          const double d = std::abs(double{o} - double{x});
          s.worst = std::max(s.worst, d);
          s.differing += d > 1e-6;
          ++s.total;
        }
  return s;
}

// kiln against both transformers processors, each with the matching arithmetic. The resize is the same
// integer algorithm on both sides and the normalisation the same float32 operations, so the outputs should be
// equal; a difference of one uint8 level in the resized image (1 / (255 * std) after normalising) is accepted
// in at most 1% of the values, for a fixed-point weight whose rounding the libraries' floating-point order could
// flip. The input is Pillow's decoded image where the fixtures keep it (so decoder differences do not count
// here), else kiln's decoding of the PNG (exact, see image_decode_test).
TEST(ImageProcessor, MatchesTransformersOnTheFixtures) {
  KILN_REQUIRE_MEDIA_FIXTURES(fx);
  const std::string cfg_name = fx->manifest.at("processor_config");
  const ImageProcessorConfig base = ImageProcessorConfig::parse(read_text(fx->dir + "/" + cfg_name), cfg_name);
  const int T = base.temporal_patch_size, P = base.patch_size;
  const double lsb = 1.0 / (255.0 * std::min({base.image_std[0], base.image_std[1], base.image_std[2]}));

  struct Run {
    const char* key;      // manifest entry
    const char* prefix;   // tensor name prefix
    int t_expected;
  };
  int compared = 0;
  for (const Run run : {Run{"default_processor", "", 2}, Run{"alt_processor", "alt_", 1}}) {
    const auto& entry = fx->manifest.at(run.key);
    if (entry.is_null()) continue;
    const std::string cls = entry.at("class"), backend_name = entry.at("backend");
    const ProcessorBackend backend = backend_name == "pil" ? ProcessorBackend::pil : ProcessorBackend::torchvision;
    std::printf("  transformers %s (%s backend), %s:\n", cls.c_str(), backend_name.c_str(), run.key);
    for (ProcessorBackend arithmetic : {backend, backend == ProcessorBackend::pil ? ProcessorBackend::torchvision
                                                                                  : ProcessorBackend::pil}) {
      ImageProcessorConfig cfg = base;
      cfg.backend = arithmetic;
      const ImageProcessor proc(cfg);
      for (const auto& c : fx->manifest.at("cases")) {
        const std::string name = c.at("name");
        const format::TensorInfo* decoded = fx->tensor(name + ".decoded");
        RgbImage input;
        if (decoded) {
          input.height = static_cast<int>(decoded->shape[0]);
          input.width = static_cast<int>(decoded->shape[1]);
          input.rgb.assign(decoded->data, decoded->data + decoded->nbytes);
        } else {
          input = decode_image(fx->read(c.at("file")), int64_t{1} << 26);
        }
        const ProcessedImage ours = proc.process(input);
        const format::TensorInfo* grid = fx->tensor(name + "." + run.prefix + "grid_thw");
        const format::TensorInfo* pv = fx->tensor(name + "." + run.prefix + (run.t_expected == 1 ? "pixel_values_t0" : "pixel_values"));
        ASSERT_TRUE(grid && pv) << name;
        const int64_t* g = reinterpret_cast<const int64_t*>(grid->data);
        ASSERT_EQ((std::array<int64_t, 3>{g[0], g[1], g[2]}), (std::array<int64_t, 3>{ours.grid_t, ours.grid_h, ours.grid_w}))
            << name;
        ASSERT_EQ(pv->nbytes, ours.pixel_values.size() * sizeof(float) / (run.t_expected == 1 ? T : 1)) << name;
        const Stats s = compare(ours, *pv, T, P, run.t_expected);
        const bool matching = arithmetic == backend;
        std::printf("    kiln %-11s %-28s max |diff| %.3g (%.2f levels), %lld of %lld values differ\n",
                    processor_backend_name(arithmetic), name.c_str(), s.worst, s.worst / lsb,
                    static_cast<long long>(s.differing), static_cast<long long>(s.total));
        if (matching) {
          EXPECT_LE(s.worst, lsb * 1.001 + 1e-6) << name << " against " << cls;
          EXPECT_LE(s.differing, s.total / 100) << name << " against " << cls;
          ++compared;
        }
      }
    }
  }
  EXPECT_GT(compared, 0);
}

}  // namespace
}  // namespace kiln::media
