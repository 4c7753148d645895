// Image decoding: PNG (libpng), JPEG (libjpeg-turbo) and WebP (libwebp) from memory into 8-bit RGB, the
// pixels the Hugging Face processor sees after `convert_to_rgb`.
//
//   RgbImage img = decode_image(bytes, options.max_pixels);   // kiln::Error on anything a user can send
//
// The format is detected from the leading bytes, never from a claimed media type. Conversion to RGB is
// Pillow's, as transformers' Qwen2-VL processor calls it (image_transforms.convert_to_rgb: image.convert("RGB")
// for any mode but "RGB"), bit for bit:
//   - alpha (RGBA, gray + alpha, a palette's or a gray image's tRNS transparency) is dropped: the colour
//     samples are kept as stored (AlphaMode::drop, the default). AlphaMode::composite_on_white composites onto
//     opaque white instead, with Pillow's alpha_composite arithmetic (round((c * a + 255 * (255 - a)) / 255)):
//     what vLLM's loader and transformers' idefics2 / mllama / chameleon processors do;
//   - an RGB PNG's tRNS colour is ignored (Pillow keeps mode "RGB");
//   - gray is replicated, palettes expanded, 1/2/4-bit gray scaled to 0..255;
//   - 16-bit samples keep their high byte (Pillow's "RGB;16B" / "RGBA;16B" / "LA;16B" unpackers). 16-bit
//     gray differs: Pillow opens it as mode "I;16" and clamps values to 255; kiln keeps the high byte;
//   - CMYK / YCCK JPEGs are read as Adobe-inverted CMYK and converted with Pillow's cmyk2rgb:
//     r = round((255 - k) * (255 - c) / 255), where c, k are the inverted samples;
//   - colour profiles (iCCP, gAMA, sRGB, ICC in JPEG/WebP) and EXIF orientation are ignored, as Pillow's
//     convert and transformers' processor ignore them.
// Refused with a clear message: GIF (not supported), animated WebP, other formats, empty / zero-size images,
// more than max_pixels declared pixels (checked on the header, before decoding), truncated or corrupt data.
// An animated PNG decodes as its default image (the IDAT frame), as Pillow's first frame.
// Thread-safe: every call has its own decoder state; decoder errors (libpng / libjpeg longjmp) are caught
// inside this file and become kiln::Error.
#pragma once
#include <cstdint>
#include <span>
#include <string>
#include <vector>

namespace kiln::media {

enum class ImageFormat { unknown, png, jpeg, webp, gif, bmp, tiff, ico, heif, avif, svg, pdf };

// What becomes of transparency (see above).
enum class AlphaMode { drop, composite_on_white };
const char* alpha_mode_name(AlphaMode alpha);  // "drop" / "composite_on_white"

// "PNG", "JPEG", ... ("unknown" for unknown).
const char* image_format_name(ImageFormat format);

// From the leading bytes only.
ImageFormat detect_image_format(std::span<const uint8_t> bytes);

// Interleaved 8-bit RGB, rows top to bottom: rgb[(y * width + x) * 3 + c].
struct RgbImage {
  int width = 0;
  int height = 0;
  std::vector<uint8_t> rgb;
};

// What the header declares (no pixel is decoded): lets a server count an image's tokens and check limits
// before decoding.
struct ImageInfo {
  ImageFormat format = ImageFormat::unknown;
  int width = 0;
  int height = 0;
};

// kiln::Error for an unsupported / unknown format, truncated or corrupt headers, a zero-size image, an animated
// WebP, or more than max_pixels pixels.
ImageInfo probe_image(std::span<const uint8_t> bytes, int64_t max_pixels);

// Decodes a PNG, JPEG or WebP. kiln::Error (one line: what is wrong and what is accepted) for everything
// probe_image refuses and for truncated or corrupt pixel data.
RgbImage decode_image(std::span<const uint8_t> bytes, int64_t max_pixels, AlphaMode alpha = AlphaMode::drop);

}  // namespace kiln::media
