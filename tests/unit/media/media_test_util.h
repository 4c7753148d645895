// Helpers of the media tests: small images encoded with the codecs' own encoders (libpng, libjpeg, libwebp),
// so the decoders are checked against inputs whose pixels the test chose, and the transformers fixtures of
// tools/reference/make_image_fixtures.py.
#pragma once
#include <gtest/gtest.h>

// clang-format off
#include <cstdio>
#include <jpeglib.h>
// clang-format on
#include <png.h>
#include <webp/encode.h>

#include <algorithm>
#include <csetjmp>
#include <cstdlib>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "format/safetensors.h"

namespace kiln::media::test {

// ---- PNG ----

struct PngSpec {
  int width = 0, height = 0;
  int color_type = PNG_COLOR_TYPE_RGB;
  int bit_depth = 8;
  std::vector<uint8_t> rows;  // packed as PNG stores them (16-bit samples big-endian), height * row bytes
  std::vector<png_color> palette;
  std::vector<uint8_t> trns_alpha;  // palette alphas (may be shorter than the palette)
  std::optional<png_color_16> trns_color;
  bool interlace = false;
};

inline void png_write_to_vector(png_structp png, png_bytep data, size_t n) {
  auto* out = static_cast<std::vector<uint8_t>*>(png_get_io_ptr(png));
  out->insert(out->end(), data, data + n);
}

inline bool png_write_all(png_structp png, png_infop info, const PngSpec& s, png_bytepp rows) {
  if (setjmp(png_jmpbuf(png))) return false;
  png_set_IHDR(png, info, s.width, s.height, s.bit_depth, s.color_type,
               s.interlace ? PNG_INTERLACE_ADAM7 : PNG_INTERLACE_NONE, PNG_COMPRESSION_TYPE_DEFAULT,
               PNG_FILTER_TYPE_DEFAULT);
  if (!s.palette.empty()) png_set_PLTE(png, info, s.palette.data(), static_cast<int>(s.palette.size()));
  if (!s.trns_alpha.empty())
    png_set_tRNS(png, info, s.trns_alpha.data(), static_cast<int>(s.trns_alpha.size()), nullptr);
  if (s.trns_color) png_set_tRNS(png, info, nullptr, 0, &*s.trns_color);
  png_write_info(png, info);
  png_write_image(png, rows);
  png_write_end(png, nullptr);
  return true;
}

inline std::vector<uint8_t> encode_png(const PngSpec& s) {
  std::vector<uint8_t> out;
  png_structp png = png_create_write_struct(PNG_LIBPNG_VER_STRING, nullptr, nullptr, nullptr);
  png_infop info = png_create_info_struct(png);
  png_set_write_fn(png, &out, png_write_to_vector, nullptr);
  const size_t row_bytes = s.rows.size() / s.height;
  std::vector<png_bytep> rows(s.height);
  for (int y = 0; y < s.height; ++y) rows[y] = const_cast<uint8_t*>(s.rows.data()) + y * row_bytes;
  const bool ok = png_write_all(png, info, s, rows.data());
  png_destroy_write_struct(&png, &info);
  if (!ok) throw std::runtime_error("libpng could not encode the test image");
  return out;
}

// ---- JPEG ----

inline void jpeg_throw(j_common_ptr cinfo) {
  char msg[JMSG_LENGTH_MAX];
  (*cinfo->err->format_message)(cinfo, msg);
  throw std::runtime_error(std::string("libjpeg could not encode the test image: ") + msg);
}

// pixels: [height][width][components]; color: JCS_RGB, JCS_GRAYSCALE or JCS_CMYK.
inline std::vector<uint8_t> encode_jpeg(int width, int height, J_COLOR_SPACE color, const std::vector<uint8_t>& pixels,
                                        int quality, bool progressive = false) {
  jpeg_compress_struct c;
  jpeg_error_mgr err;
  c.err = jpeg_std_error(&err);
  err.error_exit = jpeg_throw;
  jpeg_create_compress(&c);
  unsigned char* buf = nullptr;
  unsigned long size = 0;
  jpeg_mem_dest(&c, &buf, &size);
  c.image_width = width;
  c.image_height = height;
  c.input_components = color == JCS_GRAYSCALE ? 1 : color == JCS_CMYK ? 4 : 3;
  c.in_color_space = color;
  jpeg_set_defaults(&c);
  jpeg_set_quality(&c, quality, TRUE);
  if (progressive) jpeg_simple_progression(&c);
  jpeg_start_compress(&c, TRUE);
  const size_t row_bytes = static_cast<size_t>(width) * c.input_components;
  while (c.next_scanline < c.image_height) {
    JSAMPROW row = const_cast<uint8_t*>(pixels.data()) + c.next_scanline * row_bytes;
    jpeg_write_scanlines(&c, &row, 1);
  }
  jpeg_finish_compress(&c);
  std::vector<uint8_t> out(buf, buf + size);
  jpeg_destroy_compress(&c);
  std::free(buf);
  return out;
}

// ---- WebP ----

inline std::vector<uint8_t> webp_result(uint8_t* data, size_t size) {
  if (size == 0 || !data) throw std::runtime_error("libwebp could not encode the test image");
  std::vector<uint8_t> out(data, data + size);
  WebPFree(data);
  return out;
}
inline std::vector<uint8_t> encode_webp_lossless_rgb(int w, int h, const std::vector<uint8_t>& rgb) {
  uint8_t* data = nullptr;
  const size_t n = WebPEncodeLosslessRGB(rgb.data(), w, h, w * 3, &data);
  return webp_result(data, n);
}
inline std::vector<uint8_t> encode_webp_lossless_rgba(int w, int h, const std::vector<uint8_t>& rgba) {
  uint8_t* data = nullptr;
  const size_t n = WebPEncodeLosslessRGBA(rgba.data(), w, h, w * 4, &data);
  return webp_result(data, n);
}
inline std::vector<uint8_t> encode_webp_lossy_rgb(int w, int h, const std::vector<uint8_t>& rgb, float quality) {
  uint8_t* data = nullptr;
  const size_t n = WebPEncodeRGB(rgb.data(), w, h, w * 3, quality, &data);
  return webp_result(data, n);
}

// ---- pixels ----

inline std::vector<uint8_t> random_bytes(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<uint8_t> out(n);
  for (auto& b : out) b = static_cast<uint8_t>(rng() & 0xff);
  return out;
}

// A smooth picture (gradients and a soft disc): lossy codecs keep it within a few levels.
inline std::vector<uint8_t> smooth_rgb(int w, int h) {
  std::vector<uint8_t> out(static_cast<size_t>(w) * h * 3);
  for (int y = 0; y < h; ++y)
    for (int x = 0; x < w; ++x) {
      const double dx = x - w / 2.0, dy = y - h / 2.0;
      const double disc = std::max(0.0, 1.0 - (dx * dx + dy * dy) / (0.3 * w * h));
      uint8_t* p = &out[(static_cast<size_t>(y) * w + x) * 3];
      p[0] = static_cast<uint8_t>(40 + 150.0 * x / w);
      p[1] = static_cast<uint8_t>(30 + 160.0 * y / h);
      p[2] = static_cast<uint8_t>(60 + 120.0 * disc);
    }
  return out;
}

// round(X / 255) for X >= 0, in integers (no ties: 255 is odd).
inline int round_div255(int x) { return (2 * x + 255) / 510; }

// ---- transformers fixtures ----

inline const char* kFixtureScript = "tools/reference/make_image_fixtures.py";

struct MediaFixtures {
  std::string dir;
  nlohmann::json manifest;
  std::vector<uint8_t> expected_bytes;
  std::unique_ptr<format::SafetensorsFile> expected;

  std::vector<uint8_t> read(const std::string& name) const {
    std::ifstream in(dir + "/" + name, std::ios::binary);
    if (!in) throw std::runtime_error("cannot read fixture file " + dir + "/" + name);
    return std::vector<uint8_t>((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  }
  const format::TensorInfo* tensor(const std::string& name) const { return expected->find(name); }
};

// nullptr while tests/fixtures/media has not been generated.
inline const MediaFixtures* media_fixtures() {
  static const std::unique_ptr<MediaFixtures> fixtures = [] {
    auto f = std::make_unique<MediaFixtures>();
    f->dir = std::string(KILN_SOURCE_DIR) + "/tests/fixtures/media";
    std::ifstream in(f->dir + "/manifest.json");
    if (!in) return std::unique_ptr<MediaFixtures>();
    f->manifest = nlohmann::json::parse(in);
    f->expected_bytes = f->read(f->manifest.at("expected").get<std::string>());
    f->expected = std::make_unique<format::SafetensorsFile>(f->expected_bytes, "expected.safetensors");
    return f;
  }();
  return fixtures.get();
}

#define KILN_REQUIRE_MEDIA_FIXTURES(var)                                                                       \
  const ::kiln::media::test::MediaFixtures* var = ::kiln::media::test::media_fixtures();                     \
  if (!var)                                                                                                  \
  GTEST_SKIP() << "tests/fixtures/media is absent: generate it with python3 "                                \
               << ::kiln::media::test::kFixtureScript << " (torch, transformers 5.17, Pillow)"

}  // namespace kiln::media::test
