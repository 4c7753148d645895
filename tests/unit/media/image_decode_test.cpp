// Decoding: inputs encoded here with libpng / libjpeg / libwebp from pixels the test chose (expected values by
// independent arithmetic: compositing onto white is round((c * a + 255 * (255 - a)) / 255)), hand-made
// malformed inputs (truncated, corrupt, zero-size, decompression bombs, formats kiln refuses), and Pillow's
// decoding of the transformers fixtures.
#include "media/image_decode.h"

#include <gtest/gtest.h>

#include <cmath>

#include "core/error.h"
#include "media/media_options.h"
#include "media_test_util.h"

namespace kiln::media {
namespace {

using namespace test;

constexpr int64_t kLimit = int64_t{1} << 26;

// The message of the kiln::Error (never an InternalError) that decoding `bytes` raises.
std::string decode_error(const std::vector<uint8_t>& bytes, int64_t max_pixels = kLimit) {
  try {
    decode_image(bytes, max_pixels);
  } catch (const InternalError& e) {
    ADD_FAILURE() << "internal error instead of a user error: " << e.what();
    return e.what();
  } catch (const Error& e) {
    return e.what();
  }
  ADD_FAILURE() << "decoding succeeded";
  return "";
}

std::vector<uint8_t> bytes_of(std::string_view s) { return std::vector<uint8_t>(s.begin(), s.end()); }

uint32_t crc32(const uint8_t* p, size_t n) {
  uint32_t c = 0xffffffffu;
  for (size_t i = 0; i < n; ++i) {
    c ^= p[i];
    for (int k = 0; k < 8; ++k) c = (c >> 1) ^ (0xedb88320u & (0u - (c & 1u)));
  }
  return ~c;
}

void put_be32(uint8_t* p, uint32_t v) {
  p[0] = static_cast<uint8_t>(v >> 24), p[1] = static_cast<uint8_t>(v >> 16), p[2] = static_cast<uint8_t>(v >> 8),
  p[3] = static_cast<uint8_t>(v);
}

// A PNG whose IHDR declares width x height (CRC fixed up) followed by the rest of a real small PNG.
std::vector<uint8_t> png_with_declared_size(uint32_t width, uint32_t height) {
  PngSpec s;
  s.width = 4, s.height = 4;
  s.rows = random_bytes(4 * 4 * 3, 1);
  std::vector<uint8_t> png = encode_png(s);
  put_be32(&png[16], width);
  put_be32(&png[20], height);
  put_be32(&png[29], crc32(&png[12], 17));  // the CRC covers "IHDR" and its 13 data bytes
  return png;
}

PngSpec rgb_spec(int w, int h, uint32_t seed) {
  PngSpec s;
  s.width = w, s.height = h;
  s.rows = random_bytes(static_cast<size_t>(w) * h * 3, seed);
  return s;
}

// Offset of the SOF marker's height field (FFC0 baseline / FFC2 progressive: length, precision, height, width).
size_t jpeg_sof_dims(const std::vector<uint8_t>& jpg) {
  for (size_t i = 2; i + 9 < jpg.size(); ++i)
    if (jpg[i] == 0xff && (jpg[i + 1] == 0xc0 || jpg[i + 1] == 0xc2)) return i + 5;
  ADD_FAILURE() << "no SOF marker";
  return 0;
}

TEST(ImageDecode, DetectsFormatsFromLeadingBytes) {
  PngSpec s = rgb_spec(2, 2, 3);
  EXPECT_EQ(detect_image_format(encode_png(s)), ImageFormat::png);
  EXPECT_EQ(detect_image_format(encode_jpeg(2, 2, JCS_RGB, s.rows, 90)), ImageFormat::jpeg);
  EXPECT_EQ(detect_image_format(encode_webp_lossless_rgb(2, 2, s.rows)), ImageFormat::webp);
  EXPECT_EQ(detect_image_format(bytes_of("GIF89a....")), ImageFormat::gif);
  EXPECT_EQ(detect_image_format(bytes_of("GIF87a....")), ImageFormat::gif);
  EXPECT_EQ(detect_image_format(bytes_of("BM......")), ImageFormat::bmp);
  EXPECT_EQ(detect_image_format(bytes_of(std::string("II*\0....", 8))), ImageFormat::tiff);
  EXPECT_EQ(detect_image_format(bytes_of("%PDF-1.7")), ImageFormat::pdf);
  EXPECT_EQ(detect_image_format(bytes_of("\n  <svg xmlns=")), ImageFormat::svg);
  EXPECT_EQ(detect_image_format(bytes_of(std::string("\0\0\0\x18" "ftypheic", 12))), ImageFormat::heif);
  EXPECT_EQ(detect_image_format(bytes_of(std::string("\0\0\0\x18" "ftypavif", 12))), ImageFormat::avif);
  EXPECT_EQ(detect_image_format(bytes_of("hello")), ImageFormat::unknown);
  EXPECT_EQ(detect_image_format({}), ImageFormat::unknown);
}

TEST(ImageDecode, PngRgbRoundTripsExactly) {
  for (bool interlace : {false, true}) {
    PngSpec s = rgb_spec(37, 23, 7);
    s.interlace = interlace;
    const RgbImage img = decode_image(encode_png(s), kLimit);
    EXPECT_EQ(img.width, 37);
    EXPECT_EQ(img.height, 23);
    EXPECT_EQ(img.rgb, s.rows) << (interlace ? "interlaced" : "progressive rows");
  }
}

TEST(ImageDecode, PngRgbaDropsOrCompositesAlpha) {
  PngSpec s;
  s.width = 256, s.height = 4;  // every alpha value, four colours
  s.color_type = PNG_COLOR_TYPE_RGB_ALPHA;
  s.rows = random_bytes(256 * 4 * 4, 11);
  for (int y = 0; y < 4; ++y)
    for (int x = 0; x < 256; ++x) s.rows[(y * 256 + x) * 4 + 3] = static_cast<uint8_t>(x);
  const std::vector<uint8_t> png = encode_png(s);
  // Default: Pillow's convert("RGB"), the colour samples as stored.
  const RgbImage dropped = decode_image(png, kLimit);
  for (size_t i = 0; i < 256 * 4; ++i)
    for (int c = 0; c < 3; ++c) ASSERT_EQ(dropped.rgb[i * 3 + c], s.rows[i * 4 + c]) << "pixel " << i;
  const RgbImage img = decode_image(png, kLimit, AlphaMode::composite_on_white);
  for (size_t i = 0; i < 256 * 4; ++i)
    for (int c = 0; c < 3; ++c) {
      const int v = s.rows[i * 4 + c], a = s.rows[i * 4 + 3];
      ASSERT_EQ(img.rgb[i * 3 + c], round_div255(v * a + 255 * (255 - a))) << "pixel " << i << " alpha " << a;
    }
  // Fully transparent is white, opaque is unchanged.
  EXPECT_EQ(img.rgb[0], 255);
  EXPECT_EQ(img.rgb[255 * 3], s.rows[255 * 4]);
}

TEST(ImageDecode, PngGrayIsReplicatedAndGrayAlphaHandled) {
  PngSpec g;
  g.width = 16, g.height = 16;
  g.color_type = PNG_COLOR_TYPE_GRAY;
  g.rows = random_bytes(256, 5);
  RgbImage img = decode_image(encode_png(g), kLimit);
  for (size_t i = 0; i < 256; ++i)
    for (int c = 0; c < 3; ++c) ASSERT_EQ(img.rgb[i * 3 + c], g.rows[i]);

  PngSpec ga = g;
  ga.color_type = PNG_COLOR_TYPE_GRAY_ALPHA;
  ga.rows = random_bytes(512, 6);
  const std::vector<uint8_t> png = encode_png(ga);
  img = decode_image(png, kLimit);
  for (size_t i = 0; i < 256; ++i)
    for (int c = 0; c < 3; ++c) ASSERT_EQ(img.rgb[i * 3 + c], ga.rows[i * 2]);
  img = decode_image(png, kLimit, AlphaMode::composite_on_white);
  for (size_t i = 0; i < 256; ++i) {
    const int v = ga.rows[i * 2], a = ga.rows[i * 2 + 1];
    for (int c = 0; c < 3; ++c) ASSERT_EQ(img.rgb[i * 3 + c], round_div255(v * a + 255 * (255 - a)));
  }
}

TEST(ImageDecode, PngLowBitDepthGrayIsScaled) {
  // 1-bit: 0 -> 0, 1 -> 255. 4-bit: v -> 17 v.
  PngSpec s;
  s.width = 8, s.height = 1;
  s.color_type = PNG_COLOR_TYPE_GRAY;
  s.bit_depth = 1;
  s.rows = {0b10110001};
  RgbImage img = decode_image(encode_png(s), kLimit);
  const int bits[8] = {1, 0, 1, 1, 0, 0, 0, 1};
  for (int x = 0; x < 8; ++x) EXPECT_EQ(img.rgb[x * 3], bits[x] * 255) << x;

  s.bit_depth = 4;
  s.width = 4;
  s.rows = {0x0f, 0x85};  // 0, 15, 8, 5
  img = decode_image(encode_png(s), kLimit);
  const int v[4] = {0, 15, 8, 5};
  for (int x = 0; x < 4; ++x) EXPECT_EQ(img.rgb[x * 3 + 1], v[x] * 17) << x;
}

TEST(ImageDecode, PngPaletteIsExpandedAndItsTransparencyHandled) {
  PngSpec s;
  s.width = 6, s.height = 1;
  s.color_type = PNG_COLOR_TYPE_PALETTE;
  s.palette = {{10, 20, 30}, {200, 100, 50}, {0, 0, 0}, {90, 180, 45}};
  s.rows = {0, 1, 2, 3, 1, 0};
  auto expect_palette_colours = [&](const RgbImage& img) {
    for (int x = 0; x < 6; ++x) {
      const png_color& p = s.palette[s.rows[x]];
      EXPECT_EQ(img.rgb[x * 3 + 0], p.red) << x;
      EXPECT_EQ(img.rgb[x * 3 + 1], p.green) << x;
      EXPECT_EQ(img.rgb[x * 3 + 2], p.blue) << x;
    }
  };
  expect_palette_colours(decode_image(encode_png(s), kLimit));
  // tRNS shorter than the palette: entries without an alpha are opaque. Dropped by default.
  s.trns_alpha = {0, 128};
  expect_palette_colours(decode_image(encode_png(s), kLimit));
  const RgbImage img = decode_image(encode_png(s), kLimit, AlphaMode::composite_on_white);
  const int alpha[4] = {0, 128, 255, 255};
  for (int x = 0; x < 6; ++x) {
    const png_color& p = s.palette[s.rows[x]];
    const int a = alpha[s.rows[x]];
    EXPECT_EQ(img.rgb[x * 3 + 0], round_div255(p.red * a + 255 * (255 - a))) << x;
    EXPECT_EQ(img.rgb[x * 3 + 2], round_div255(p.blue * a + 255 * (255 - a))) << x;
  }
}

TEST(ImageDecode, PngTransparentColourCountsForGrayButNotForRgb) {
  // Pillow: a gray image's tRNS value becomes alpha 0 in convert("RGBA") (white once composited) and is
  // ignored by convert("RGB"); an RGB image's tRNS colour is ignored either way (convert_to_rgb returns mode
  // "RGB" images unchanged).
  PngSpec g;
  g.width = 4, g.height = 1;
  g.color_type = PNG_COLOR_TYPE_GRAY;
  g.rows = {7, 8, 7, 0};
  png_color_16 key{};
  key.gray = 7;
  g.trns_color = key;
  RgbImage img = decode_image(encode_png(g), kLimit);
  EXPECT_EQ((std::vector<int>{img.rgb[0], img.rgb[3], img.rgb[6], img.rgb[9]}), (std::vector<int>{7, 8, 7, 0}));
  img = decode_image(encode_png(g), kLimit, AlphaMode::composite_on_white);
  EXPECT_EQ((std::vector<int>{img.rgb[0], img.rgb[3], img.rgb[6], img.rgb[9]}), (std::vector<int>{255, 8, 255, 0}));

  PngSpec c;
  c.width = 2, c.height = 1;
  c.rows = {10, 20, 30, 40, 50, 60};
  png_color_16 rgb_key{};
  rgb_key.red = 10, rgb_key.green = 20, rgb_key.blue = 30;
  c.trns_color = rgb_key;
  EXPECT_EQ(decode_image(encode_png(c), kLimit).rgb, c.rows);
  EXPECT_EQ(decode_image(encode_png(c), kLimit, AlphaMode::composite_on_white).rgb, c.rows);
}

TEST(ImageDecode, Png16BitKeepsTheHighByte) {
  PngSpec s;
  s.width = 3, s.height = 1;
  s.bit_depth = 16;
  // Big-endian samples: (0x12, 0xff), (0xab, 0x01), ... -> 0x12, 0xab, ...
  s.rows = {0x12, 0xff, 0xab, 0x01, 0x00, 0x80, 0xff, 0xff, 0x7f, 0x80, 0x01, 0x00, 0x40, 0x00, 0x80, 0x00, 0xc0, 0x7f};
  const RgbImage img = decode_image(encode_png(s), kLimit);
  EXPECT_EQ(img.rgb, (std::vector<uint8_t>{0x12, 0xab, 0x00, 0xff, 0x7f, 0x01, 0x40, 0x80, 0xc0}));
}

TEST(ImageDecode, TruncatedPngIsAnErrorAtEveryLength) {
  PngSpec s = rgb_spec(19, 11, 13);
  s.interlace = true;
  const std::vector<uint8_t> png = encode_png(s);
  // The last 12 bytes are the IEND chunk, which kiln does not read: the image is whole without it.
  for (size_t cut = 0; cut + 12 < png.size(); ++cut) {
    const std::vector<uint8_t> part(png.begin(), png.begin() + cut);
    const std::string msg = decode_error(part);
    if (cut >= 8) EXPECT_NE(msg.find("PNG"), std::string::npos) << cut << ": " << msg;
  }
  EXPECT_NE(decode_error(std::vector<uint8_t>(png.begin(), png.begin() + png.size() / 2)).find("truncated PNG"),
            std::string::npos);
}

TEST(ImageDecode, CorruptPngIsAnError) {
  std::vector<uint8_t> png = encode_png(rgb_spec(16, 16, 17));
  png[png.size() - 20] ^= 0x5a;  // inside the IDAT data: its CRC no longer matches
  const std::string msg = decode_error(png);
  EXPECT_NE(msg.find("corrupt PNG"), std::string::npos) << msg;
}

TEST(ImageDecode, ZeroSizeIsAnError) {
  for (auto [w, h] : {std::pair{0u, 5u}, std::pair{5u, 0u}}) {
    const std::string msg = decode_error(png_with_declared_size(w, h));
    EXPECT_NE(msg.find("zero-size"), std::string::npos) << msg;
  }
  std::vector<uint8_t> jpg = encode_jpeg(8, 8, JCS_RGB, random_bytes(8 * 8 * 3, 2), 90);
  const size_t dims = jpeg_sof_dims(jpg);
  jpg[dims] = 0, jpg[dims + 1] = 0;  // height 0
  const std::string msg = decode_error(jpg);
  EXPECT_NE(msg.find("zero-size"), std::string::npos) << msg;
}

TEST(ImageDecode, DecompressionBombsAreRefusedOnTheHeader) {
  // 50000 x 50000 declared in 100-odd bytes: refused before a pixel buffer exists, naming limit and flag.
  std::string msg = decode_error(png_with_declared_size(50000, 50000));
  EXPECT_NE(msg.find("2500000000"), std::string::npos) << msg;
  EXPECT_NE(msg.find(std::to_string(kLimit)), std::string::npos) << msg;
  EXPECT_NE(msg.find(kFlagMaxImagePixels), std::string::npos) << msg;
  EXPECT_THROW(probe_image(png_with_declared_size(50000, 50000), kLimit), Error);

  std::vector<uint8_t> jpg = encode_jpeg(8, 8, JCS_RGB, random_bytes(8 * 8 * 3, 2), 90);
  const size_t dims = jpeg_sof_dims(jpg);
  jpg[dims] = 0xea, jpg[dims + 1] = 0x60;      // height 60000
  jpg[dims + 2] = 0xea, jpg[dims + 3] = 0x60;  // width 60000
  msg = decode_error(jpg);
  EXPECT_NE(msg.find("3600000000"), std::string::npos) << msg;

  // The limit is the caller's: a small one refuses a small image.
  msg = decode_error(encode_png(rgb_spec(20, 10, 1)), 199);
  EXPECT_NE(msg.find("20 x 10 = 200 pixels, more than the 199 allowed"), std::string::npos) << msg;
}

TEST(ImageDecode, JpegDecodesCloseToItsSource) {
  const int w = 48, h = 40;
  const std::vector<uint8_t> src = smooth_rgb(w, h);
  const RgbImage img = decode_image(encode_jpeg(w, h, JCS_RGB, src, 95), kLimit);
  ASSERT_EQ(img.width, w);
  ASSERT_EQ(img.height, h);
  double sum = 0;
  int worst = 0;
  for (size_t i = 0; i < src.size(); ++i) {
    const int d = std::abs(int{img.rgb[i]} - int{src[i]});
    sum += d;
    worst = std::max(worst, d);
  }
  EXPECT_LT(sum / src.size(), 2.0);
  EXPECT_LE(worst, 12);
}

TEST(ImageDecode, ProgressiveJpegDecodesLikeBaseline) {
  // The same quantised coefficients, entropy-coded differently: identical pixels.
  const int w = 33, h = 21;
  const std::vector<uint8_t> src = random_bytes(static_cast<size_t>(w) * h * 3, 21);
  const RgbImage base = decode_image(encode_jpeg(w, h, JCS_RGB, src, 85), kLimit);
  const RgbImage prog = decode_image(encode_jpeg(w, h, JCS_RGB, src, 85, /*progressive=*/true), kLimit);
  EXPECT_EQ(base.rgb, prog.rgb);
}

TEST(ImageDecode, GrayJpegIsReplicated) {
  const std::vector<uint8_t> gray = random_bytes(24 * 16, 4);
  const RgbImage img = decode_image(encode_jpeg(24, 16, JCS_GRAYSCALE, gray, 90), kLimit);
  for (size_t i = 0; i < gray.size(); ++i) {
    ASSERT_EQ(img.rgb[i * 3], img.rgb[i * 3 + 1]);
    ASSERT_EQ(img.rgb[i * 3], img.rgb[i * 3 + 2]);
  }
}

TEST(ImageDecode, CmykJpegUsesPillowsConversion) {
  // Stored (Adobe-inverted) samples s_c, s_k: Pillow reads c = 255 - s_c, k = 255 - s_k and gives
  // r = (255 - k) * (255 - c) / 255 = s_k * s_c / 255. A flat colour survives JPEG within a level or two.
  const uint8_t stored[4] = {200, 120, 40, 180};
  std::vector<uint8_t> px;
  for (int i = 0; i < 16 * 16; ++i) px.insert(px.end(), stored, stored + 4);
  const RgbImage img = decode_image(encode_jpeg(16, 16, JCS_CMYK, px, 100), kLimit);
  for (int c = 0; c < 3; ++c)
    EXPECT_NEAR(img.rgb[(8 * 16 + 8) * 3 + c], round_div255(stored[c] * stored[3]), 2) << c;
}

TEST(ImageDecode, TruncatedOrCorruptJpegIsAnError) {
  const std::vector<uint8_t> jpg = encode_jpeg(40, 40, JCS_RGB, random_bytes(40 * 40 * 3, 8), 90);
  std::string msg = decode_error(std::vector<uint8_t>(jpg.begin(), jpg.begin() + jpg.size() / 2));
  EXPECT_NE(msg.find("truncated JPEG"), std::string::npos) << msg;
  msg = decode_error(std::vector<uint8_t>(jpg.begin(), jpg.begin() + 40));
  EXPECT_NE(msg.find("JPEG"), std::string::npos) << msg;
  // Every cut length: an error, never a crash.
  for (size_t cut = 3; cut + 2 < jpg.size(); cut += 7) decode_error(std::vector<uint8_t>(jpg.begin(), jpg.begin() + cut));
  // Garbage in the entropy-coded data: libjpeg may decode it to garbage pixels or refuse; either way no crash,
  // and any error is a kiln::Error.
  std::vector<uint8_t> bad = jpg;
  for (size_t i = bad.size() / 2; i < bad.size() / 2 + 64; ++i) bad[i] = static_cast<uint8_t>(i * 37);
  try {
    decode_image(bad, kLimit);
  } catch (const InternalError& e) {
    ADD_FAILURE() << e.what();
  } catch (const Error&) {
  }
  // Markers broken in the header.
  std::vector<uint8_t> header = jpg;
  header[3] ^= 0xff;
  decode_error(header);
}

TEST(ImageDecode, WebpLosslessRoundTripsAndHandlesAlpha) {
  const int w = 29, h = 17;
  const std::vector<uint8_t> rgb = random_bytes(static_cast<size_t>(w) * h * 3, 31);
  RgbImage img = decode_image(encode_webp_lossless_rgb(w, h, rgb), kLimit);
  EXPECT_EQ(img.rgb, rgb);

  // Alpha at least 1 everywhere: the lossless encoder keeps every colour sample (it may rewrite the colour
  // of fully transparent pixels, which then only the compositing check sees).
  std::vector<uint8_t> rgba = random_bytes(static_cast<size_t>(w) * h * 4, 32);
  for (size_t i = 0; i < static_cast<size_t>(w) * h; ++i) rgba[i * 4 + 3] = std::max<uint8_t>(rgba[i * 4 + 3], 1);
  rgba[3] = 0;  // one fully transparent pixel
  const std::vector<uint8_t> webp = encode_webp_lossless_rgba(w, h, rgba);
  img = decode_image(webp, kLimit);
  for (size_t i = 1; i < static_cast<size_t>(w) * h; ++i)
    for (int c = 0; c < 3; ++c) ASSERT_EQ(img.rgb[i * 3 + c], rgba[i * 4 + c]) << i;
  img = decode_image(webp, kLimit, AlphaMode::composite_on_white);
  for (size_t i = 0; i < static_cast<size_t>(w) * h; ++i) {
    const int a = rgba[i * 4 + 3];
    for (int c = 0; c < 3; ++c)
      ASSERT_EQ(img.rgb[i * 3 + c], a == 0 ? 255 : round_div255(rgba[i * 4 + c] * a + 255 * (255 - a))) << i;
  }
}

TEST(ImageDecode, WebpLossyDecodesCloseToItsSource) {
  const int w = 64, h = 48;
  const std::vector<uint8_t> src = smooth_rgb(w, h);
  const RgbImage img = decode_image(encode_webp_lossy_rgb(w, h, src, 95), kLimit);
  double sum = 0;
  for (size_t i = 0; i < src.size(); ++i) sum += std::abs(int{img.rgb[i]} - int{src[i]});
  EXPECT_LT(sum / src.size(), 3.0);
}

TEST(ImageDecode, TruncatedWebpIsAnError) {
  const std::vector<uint8_t> webp = encode_webp_lossless_rgb(32, 32, random_bytes(32 * 32 * 3, 9));
  for (size_t cut = 12; cut < webp.size(); cut += 5) {
    const std::string msg = decode_error(std::vector<uint8_t>(webp.begin(), webp.begin() + cut));
    EXPECT_NE(msg.find("WebP"), std::string::npos) << cut << ": " << msg;
  }
}

TEST(ImageDecode, AnimatedWebpIsRefused) {
  // RIFF, "WEBP", a VP8X chunk with the animation flag (0x02) and a 16 x 16 canvas: the header says
  // "animated" before any frame.
  std::vector<uint8_t> webp = bytes_of("RIFF");
  const uint8_t riff_size[4] = {22, 0, 0, 0};  // "WEBP" + the 18-byte VP8X chunk
  webp.insert(webp.end(), riff_size, riff_size + 4);
  for (char c : std::string("WEBPVP8X")) webp.push_back(static_cast<uint8_t>(c));
  const uint8_t vp8x[14] = {10, 0, 0, 0, 0x02, 0, 0, 0, 15, 0, 0, 15, 0, 0};
  webp.insert(webp.end(), vp8x, vp8x + 14);
  const std::string msg = decode_error(webp);
  EXPECT_NE(msg.find("animated WebP is not supported"), std::string::npos) << msg;
}

TEST(ImageDecode, OtherFormatsAreRefusedByName) {
  std::string msg = decode_error(bytes_of("GIF89a\x01\0\x01\0\0\0\0"));
  EXPECT_NE(msg.find("GIF images are not supported"), std::string::npos) << msg;
  EXPECT_NE(msg.find("PNG, JPEG and WebP"), std::string::npos) << msg;
  msg = decode_error(bytes_of("BM\x36\0\0\0"));
  EXPECT_NE(msg.find("BMP images are not supported"), std::string::npos) << msg;
  msg = decode_error(bytes_of("<html>not an image</html>"));
  EXPECT_NE(msg.find("unrecognised format (first bytes 3c 68 74 6d"), std::string::npos) << msg;
  EXPECT_NE(msg.find("PNG, JPEG and WebP"), std::string::npos) << msg;
  msg = decode_error({});
  EXPECT_NE(msg.find("no data"), std::string::npos) << msg;
}

TEST(ImageDecode, ProbeReadsTheHeaderOnly) {
  PngSpec s = rgb_spec(21, 13, 40);
  std::vector<uint8_t> png = encode_png(s);
  ImageInfo info = probe_image(png, kLimit);
  EXPECT_EQ(info.format, ImageFormat::png);
  EXPECT_EQ(info.width, 21);
  EXPECT_EQ(info.height, 13);
  png.resize(40);  // no pixel data at all
  EXPECT_EQ(probe_image(png, kLimit).width, 21);

  info = probe_image(encode_jpeg(30, 10, JCS_RGB, random_bytes(30 * 10 * 3, 2), 80), kLimit);
  EXPECT_EQ(info.format, ImageFormat::jpeg);
  EXPECT_EQ(info.width, 30);
  EXPECT_EQ(info.height, 10);
  info = probe_image(encode_webp_lossless_rgb(7, 9, random_bytes(7 * 9 * 3, 3)), kLimit);
  EXPECT_EQ(info.format, ImageFormat::webp);
  EXPECT_EQ(info.width, 7);
  EXPECT_EQ(info.height, 9);
}

// Pillow's decoding (Image.open + transformers' convert_to_rgb) of the fixture files. Lossless formats must
// match exactly. JPEG and lossy WebP decode through libjpeg-turbo / libwebp on both sides (Pillow's bundled
// builds, Debian's here): the same algorithms (islow IDCT, fancy upsampling), so equal in practice; up to 3
// levels are tolerated for version differences in colour conversion / upsampling rounding.
TEST(ImageDecode, MatchesPillowOnTheTransformersFixtures) {
  KILN_REQUIRE_MEDIA_FIXTURES(fx);
  // What the processor's convert_to_rgb did with alpha, as the script observed it; kiln's default is "drop".
  const std::string observed = fx->manifest.at("convert_to_rgb");
  const AlphaMode alpha = observed == "composite_on_white" ? AlphaMode::composite_on_white : AlphaMode::drop;
  std::printf("  transformers' convert_to_rgb: %s (kiln's default: %s)\n", observed.c_str(),
              alpha_mode_name(AlphaMode::drop));
  EXPECT_EQ(observed, alpha_mode_name(AlphaMode::drop)) << "kiln's default alpha handling differs from transformers'";
  int compared = 0;
  for (const auto& c : fx->manifest.at("cases")) {
    const std::string name = c.at("name");
    const format::TensorInfo* expected = fx->tensor(name + ".decoded");
    if (!expected) continue;  // large cases store no decoded pixels
    const RgbImage img = decode_image(fx->read(c.at("file")), kLimit, alpha);
    ASSERT_EQ(expected->shape, (Shape{img.height, img.width, 3})) << name;
    ASSERT_EQ(expected->nbytes, img.rgb.size()) << name;
    int worst = 0;
    int64_t differing = 0;
    for (size_t i = 0; i < img.rgb.size(); ++i) {
      const int d = std::abs(int{img.rgb[i]} - int{expected->data[i]});
      worst = std::max(worst, d);
      differing += d != 0;
    }
    const bool lossless = c.at("lossless").get<bool>();
    std::printf("  decode %-28s %-5s max |diff| %d, %lld of %zu samples differ\n", name.c_str(),
                c.at("format").get<std::string>().c_str(), worst, static_cast<long long>(differing), img.rgb.size());
    if (lossless) EXPECT_EQ(worst, 0) << name;
    else EXPECT_LE(worst, 3) << name;
    ++compared;
  }
  EXPECT_GT(compared, 0);
}

}  // namespace
}  // namespace kiln::media
