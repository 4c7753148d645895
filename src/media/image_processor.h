// The Qwen2-VL image processor, as Qwen2-VL, Qwen2.5-VL, Qwen3-VL and Qwen3.5 use it (transformers 5.17,
// models/qwen2_vl/image_processing_qwen2_vl.py): the decoded RGB image -> the pixel tensor the vision tower
// eats.
//
//   ImageProcessor proc(ImageProcessorConfig::load(model_dir));   // preprocessor_config.json
//   ProcessedImage out = proc.process(decode_image(bytes, options.max_pixels));
//   out.pixel_values   // [grid_t * grid_h * grid_w, 3 * T * P * P] float32, transformers' layout
//   out.num_image_tokens()   // placeholder tokens in the prompt: grid_t * grid_h * grid_w / merge^2
//
// Steps, each as transformers does them:
//   1. smart_resize: the target size, multiples of factor = patch_size * merge_size with
//      min_pixels <= h * w <= max_pixels (size.shortest_edge / size.longest_edge), aspect kept;
//   2. resize: bicubic (Keys a = -0.5), antialiased (support scaled by the downscale factor), separable,
//      horizontal pass then vertical pass, each skipped when its size is unchanged, weights quantised to
//      fixed point and every pass rounded to uint8. Two arithmetics, matching transformers' two backends:
//        torchvision: Qwen2VLImageProcessor, the default in transformers 5.x when torchvision is
//          installed. Its CPU path resizes uint8 tensors with torch's native antialiased bicubic kernel
//          (aten/src/ATen/native/cpu/UpSampleKernel.cpp): int16 weights whose precision depends on the
//          largest weight of the axis. (On a GPU device torch resizes in float32 and rounds once: not this.)
//        pil: Qwen2VLImageProcessorPil, Pillow's Image.resize(BICUBIC) (libImaging/Resample.c):
//          22-bit fixed-point weights.
//      Both round to nearest between and after passes; they differ by 1 in a few pixels.
//   3. rescale and normalise, in each backend's float32 arithmetic:
//        torchvision: (x - mean * (1 / rescale)) / (std * (1 / rescale))   (mean, std fused with the rescale)
//        pil:         (float32(x * rescale) - mean) / std
//   (do_convert_rgb is implied: decode_image always gives RGB.)
//   4. patches: the image repeated temporal_patch_size times along time; rows ordered
//      (t, h / merge, w / merge, merge_h, merge_w), each row flattened (C, T, P, P).
#pragma once
#include <array>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "format/model_dir.h"
#include "media/image_decode.h"

namespace kiln::media {

enum class ProcessorBackend { torchvision, pil };
const char* processor_backend_name(ProcessorBackend backend);  // "torchvision" / "pil"

struct ImageProcessorConfig {
  // Defaults: the Qwen2VLImageProcessor class defaults, which transformers uses for keys a
  // preprocessor_config.json leaves out.
  int patch_size = 14;
  int temporal_patch_size = 2;
  int merge_size = 2;
  int64_t min_pixels = 56 * 56;         // size.shortest_edge (or "min_pixels")
  int64_t max_pixels = 28 * 28 * 1280;  // size.longest_edge (or "max_pixels")
  bool do_resize = true;
  bool do_rescale = true;
  bool do_normalize = true;
  double rescale_factor = 1.0 / 255.0;
  std::array<double, 3> image_mean = {0.48145466, 0.4578275, 0.40821073};  // OPENAI_CLIP_MEAN
  std::array<double, 3> image_std = {0.26862954, 0.26130258, 0.27577711};  // OPENAI_CLIP_STD
  ProcessorBackend backend = ProcessorBackend::torchvision;
  std::string source = "Qwen2VLImageProcessor defaults";  // where the values came from (startup summary)

  // Qwen3.5's preprocessor_config.json (configs/qwen3.5-*/preprocessor_config.json): patch 16, merge 2,
  // temporal 2, 65536 <= pixels <= 16777216, mean = std = 0.5.
  static ImageProcessorConfig qwen3_5();
  // A preprocessor_config.json's text. kiln::Error (naming `source`) for invalid JSON or values, a size without
  // shortest_edge / longest_edge, a resample other than bicubic (3), or another processor type.
  static ImageProcessorConfig parse(std::string_view json_text, std::string_view source);
  // The model folder's preprocessor_config.json; Qwen3.5's values when the folder has none.
  static ImageProcessorConfig load(const format::ModelDir& dir);
};

struct ResizedSize {
  int height = 0;
  int width = 0;
};

// transformers' smart_resize, to the bit (Python's round-half-to-even, floor and ceil on the same doubles):
//   h_bar = round(h / factor) * factor, w_bar likewise;
//   if h_bar * w_bar > max_pixels: beta = sqrt(h * w / max_pixels),
//       h_bar = max(factor, floor(h / beta / factor) * factor), w_bar likewise;
//   elif h_bar * w_bar < min_pixels: beta = sqrt(min_pixels / (h * w)),
//       h_bar = ceil(h * beta / factor) * factor, w_bar likewise.
// kiln::Error for an aspect ratio above 200 (transformers raises too) or a zero-size result.
ResizedSize smart_resize(int height, int width, int factor, int64_t min_pixels, int64_t max_pixels);

// The resize of step 2 alone (to any size >= 1).
RgbImage resize_bicubic(const RgbImage& image, int height, int width, ProcessorBackend arithmetic);

// 128-bit XXH3 of (width, height, pixels): equal images, equal hashes; the key for prefix caching of image
// tokens (the processor's output is a function of the image and the server's fixed processor config).
struct ImageHash {
  uint64_t high = 0;
  uint64_t low = 0;
  std::string hex() const;  // 32 hex digits
  bool operator==(const ImageHash&) const = default;
};
ImageHash image_content_hash(const RgbImage& image);

struct ProcessedImage {
  int64_t grid_t = 0, grid_h = 0, grid_w = 0;  // image_grid_thw (in patches)
  int merge_size = 0;
  int resized_height = 0, resized_width = 0;
  int64_t patch_dim = 0;             // 3 * temporal_patch_size * patch_size^2
  std::vector<float> pixel_values;  // [num_patches(), patch_dim]
  ImageHash hash;                    // of the decoded image

  int64_t num_patches() const { return grid_t * grid_h * grid_w; }
  int64_t num_image_tokens() const { return num_patches() / (int64_t{merge_size} * merge_size); }
};

class ImageProcessor {
 public:
  // kiln::Error for sizes that cannot work (a non-positive patch size, a zero std, min above max...).
  explicit ImageProcessor(ImageProcessorConfig config);
  const ImageProcessorConfig& config() const { return config_; }

  // The size process() resizes an image of this size to (the same size when do_resize is off).
  ResizedSize target_size(int height, int width) const;
  // Tokens an image of this size becomes, before decoding it (from probe_image's size).
  int64_t num_image_tokens(int height, int width) const;

  ProcessedImage process(const RgbImage& image) const;

 private:
  ImageProcessorConfig config_;
  std::array<std::array<float, 256>, 3> value_table_;  // step 3 for every uint8 value, per channel
};

}  // namespace kiln::media
