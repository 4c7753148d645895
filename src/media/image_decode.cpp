#include "media/image_decode.h"

#include <csetjmp>
#include <cstdio>
#include <cstring>
#include <string_view>

// clang-format off: jpeglib.h needs <cstdio> (FILE) first.
#include <jpeglib.h>
#include <jerror.h>
// clang-format on
#include <png.h>
#include <webp/decode.h>

#include "core/error.h"
#include "media/media_options.h"

namespace kiln::media {
namespace {

constexpr const char* kAccepted = "kiln accepts PNG, JPEG and WebP";
constexpr uint8_t kPngSignature[8] = {0x89, 'P', 'N', 'G', '\r', '\n', 0x1a, '\n'};
// A progressive JPEG decodes every scan over the whole image; real files have ~10, crafted ones can have
// thousands (a CPU bomb). libjpeg-turbo's own tools cap it the same way (djpeg -maxscans).
constexpr int kMaxJpegScans = 1000;

bool starts_with(std::span<const uint8_t> b, std::string_view s, size_t at = 0) {
  return b.size() >= at + s.size() && std::memcmp(b.data() + at, s.data(), s.size()) == 0;
}

uint32_t be32(const uint8_t* p) {
  return (uint32_t{p[0]} << 24) | (uint32_t{p[1]} << 16) | (uint32_t{p[2]} << 8) | uint32_t{p[3]};
}

std::string first_bytes_hex(std::span<const uint8_t> b) {
  std::string out;
  for (size_t i = 0; i < b.size() && i < 8; ++i) out += fmt::format("{}{:02x}", i ? " " : "", b[i]);
  return out;
}

// Zero size and the decompression-bomb guard, on what the header declares.
void check_dimensions(const char* format, uint64_t width, uint64_t height, int64_t max_pixels) {
  if (width == 0 || height == 0)
    fail("image: the {} declares a zero-size image ({} x {} pixels)", format, width, height);
  const uint64_t pixels = width * height;  // both < 2^32: no overflow
  if (max_pixels <= 0 || pixels > static_cast<uint64_t>(max_pixels))
    fail("image: the {} is {} x {} = {} pixels, more than the {} allowed (raise {} to accept it)", format, width,
         height, pixels, max_pixels, kFlagMaxImagePixels);
}

// Pillow's Image.alpha_composite(background, image) (libImaging/AlphaComposite.c) with an opaque white
// background, for one colour sample c of alpha a: the integer arithmetic Pillow uses (7 extra bits, rounded
// divisions by 255). It equals round((c * a + 255 * (255 - a)) / 255).
uint8_t over_white(uint32_t c, uint32_t a) {
  constexpr uint32_t kPrecisionBits = 7;
  constexpr uint32_t dst = 255, dst_a = 255;
  if (a == 0) return static_cast<uint8_t>(dst);
  const uint32_t blend = dst_a * (255 - a);
  const uint32_t outa255 = a * 255 + blend;
  const uint32_t coef1 = a * 255 * 255 * (1u << kPrecisionBits) / outa255;
  const uint32_t coef2 = 255 * (1u << kPrecisionBits) - coef1;
  const uint32_t tmp = c * coef1 + dst * coef2 + (0x80u << kPrecisionBits);
  return static_cast<uint8_t>(((((tmp >> 8) + tmp) >> 8)) >> kPrecisionBits);
}

// [pixels][4] RGBA -> [pixels][3] RGB composited onto white.
void composite_onto_white(const uint8_t* rgba, size_t pixels, uint8_t* rgb) {
  for (size_t i = 0; i < pixels; ++i, rgba += 4, rgb += 3) {
    const uint32_t a = rgba[3];
    if (a == 255) {
      rgb[0] = rgba[0], rgb[1] = rgba[1], rgb[2] = rgba[2];  // Pillow's formula is the identity here
    } else {
      for (int c = 0; c < 3; ++c) rgb[c] = over_white(rgba[c], a);
    }
  }
}

// A decoded buffer of `channels` (3 or 4) per pixel into the RGB image.
RgbImage finish(int width, int height, int channels, std::vector<uint8_t> pixels, AlphaMode alpha) {
  RgbImage img;
  img.width = width;
  img.height = height;
  const size_t count = static_cast<size_t>(width) * static_cast<size_t>(height);
  if (channels == 3) {
    img.rgb = std::move(pixels);
  } else {
    KILN_CHECK(channels == 4, "decoder produced {} channels", channels);
    img.rgb.resize(count * 3);
    if (alpha == AlphaMode::composite_on_white) {
      composite_onto_white(pixels.data(), count, img.rgb.data());
    } else {
      for (size_t i = 0; i < count; ++i)  // Pillow's rgba2rgb: the colour samples, alpha dropped
        for (int c = 0; c < 3; ++c) img.rgb[i * 3 + c] = pixels[i * 4 + c];
    }
  }
  KILN_CHECK(img.rgb.size() == count * 3);
  return img;
}

// ---- PNG (libpng) ------------------------------------------------------------------------------------------
// libpng reports errors by calling our error function, which must not return: it records the message and
// longjmps to the setjmp of the png_* step that was running. Each step is a function whose locals are all
// trivially destructible, so the jump skips no destructor; buffers are owned by the caller.

struct PngState {
  std::span<const uint8_t> data;
  size_t pos = 0;
  bool truncated = false;
  char message[256] = {};
};

void png_on_error(png_structp png, png_const_charp msg) {
  auto* st = static_cast<PngState*>(png_get_error_ptr(png));
  std::snprintf(st->message, sizeof(st->message), "%s", msg ? msg : "unknown error");
  png_longjmp(png, 1);
}

void png_on_warning(png_structp, png_const_charp) {}

void png_on_read(png_structp png, png_bytep out, size_t n) {
  auto* st = static_cast<PngState*>(png_get_io_ptr(png));
  if (n > st->data.size() - st->pos) {
    st->truncated = true;
    png_error(png, "unexpected end of data");
  }
  std::memcpy(out, st->data.data() + st->pos, n);
  st->pos += n;
}

struct PngLayout {
  uint32_t width = 0, height = 0;
  int channels = 0;
  size_t row_bytes = 0;
};

// Reads the header chunks and sets the transforms that give 8-bit RGB or RGBA rows.
bool png_read_layout(png_structp png, png_infop info, PngLayout* out) {
  if (setjmp(png_jmpbuf(png))) return false;
  png_read_info(png, info);
  const int color = png_get_color_type(png, info);
  const int depth = png_get_bit_depth(png, info);
  if (depth == 16) png_set_strip_16(png);  // high byte, as Pillow's 16-bit unpackers
  if (color == PNG_COLOR_TYPE_PALETTE) png_set_palette_to_rgb(png);
  if (color == PNG_COLOR_TYPE_GRAY && depth < 8) png_set_expand_gray_1_2_4_to_8(png);
  // A palette's or a gray image's tRNS becomes alpha (what Pillow's convert("RGBA") does, used when compositing;
  // dropped otherwise). An RGB image's tRNS colour is ignored either way: Pillow opens it as mode "RGB", which
  // convert_to_rgb returns unchanged.
  if (png_get_valid(png, info, PNG_INFO_tRNS) && color != PNG_COLOR_TYPE_RGB) png_set_tRNS_to_alpha(png);
  if (color == PNG_COLOR_TYPE_GRAY || color == PNG_COLOR_TYPE_GRAY_ALPHA) png_set_gray_to_rgb(png);
  png_set_interlace_handling(png);
  png_read_update_info(png, info);
  out->width = png_get_image_width(png, info);
  out->height = png_get_image_height(png, info);
  out->channels = png_get_channels(png, info);
  out->row_bytes = png_get_rowbytes(png, info);
  return true;
}

bool png_read_pixels(png_structp png, png_bytepp rows) {
  if (setjmp(png_jmpbuf(png))) return false;
  png_read_image(png, rows);
  return true;
}

struct PngReader {
  png_structp png = nullptr;
  png_infop info = nullptr;
  ~PngReader() { png_destroy_read_struct(&png, info ? &info : nullptr, nullptr); }
};

[[noreturn]] void png_fail(const PngState& st) {
  if (st.truncated) fail("image: truncated PNG data (the file ends before the image data does)");
  fail("image: corrupt PNG data ({})", st.message);
}

// From the IHDR bytes themselves, so zero sizes and bombs get their own messages before libpng runs.
ImageInfo png_probe(std::span<const uint8_t> b, int64_t max_pixels) {
  // signature (8) + IHDR length (4) + "IHDR" (4) + width (4) + height (4)
  if (b.size() < 24) fail("image: truncated PNG data ({} bytes, shorter than the PNG header)", b.size());
  if (!starts_with(b, "IHDR", 12)) fail("image: corrupt PNG data (the first chunk is not IHDR)");
  const uint32_t width = be32(b.data() + 16), height = be32(b.data() + 20);
  check_dimensions("PNG", width, height, max_pixels);
  if (width > 0x7fffffffu || height > 0x7fffffffu) fail("image: corrupt PNG data (dimensions above 2^31 - 1)");
  return {ImageFormat::png, static_cast<int>(width), static_cast<int>(height)};
}

RgbImage png_decode(std::span<const uint8_t> b, int64_t max_pixels, AlphaMode alpha) {
  const ImageInfo declared = png_probe(b, max_pixels);
  PngState st;
  st.data = b;
  PngReader r;
  r.png = png_create_read_struct(PNG_LIBPNG_VER_STRING, &st, png_on_error, png_on_warning);
  if (!r.png) fail("image: cannot start the PNG decoder (out of memory?)");
  r.info = png_create_info_struct(r.png);
  if (!r.info) fail("image: cannot start the PNG decoder (out of memory?)");
  png_set_read_fn(r.png, &st, png_on_read);
  // Our own pixel limit is the guard; libpng's default 1,000,000-pixel side limit would reject long strips.
  png_set_user_limits(r.png, 0x7fffffff, 0x7fffffff);
  png_set_chunk_malloc_max(r.png, 8u << 20);  // ancillary chunks (iCCP, zTXt): no decompression bombs there

  PngLayout layout;
  if (!png_read_layout(r.png, r.info, &layout)) png_fail(st);
  KILN_CHECK(layout.width == static_cast<uint32_t>(declared.width) &&
             layout.height == static_cast<uint32_t>(declared.height));
  if (layout.channels != 3 && layout.channels != 4)
    fail("image: unsupported PNG layout ({} channels after conversion)", layout.channels);
  KILN_CHECK(layout.row_bytes == static_cast<size_t>(layout.width) * layout.channels, "PNG row of {} bytes",
             layout.row_bytes);

  std::vector<uint8_t> pixels(layout.row_bytes * layout.height);
  std::vector<png_bytep> rows(layout.height);
  for (uint32_t y = 0; y < layout.height; ++y) rows[y] = pixels.data() + y * layout.row_bytes;
  if (!png_read_pixels(r.png, rows.data())) png_fail(st);
  return finish(declared.width, declared.height, layout.channels, std::move(pixels), alpha);
}

// ---- JPEG (libjpeg-turbo) ----------------------------------------------------------------------------------
// Same pattern: error_exit longjmps to the running step's setjmp.

struct JpegState {
  jpeg_error_mgr mgr;  // first member: libjpeg hands &mgr back to the callbacks
  jmp_buf jump;
  char message[JMSG_LENGTH_MAX] = {};
  bool truncated = false;
  bool too_many_scans = false;
};

void jpeg_on_error_exit(j_common_ptr cinfo) {
  auto* st = reinterpret_cast<JpegState*>(cinfo->err);
  (*cinfo->err->format_message)(cinfo, st->message);
  std::longjmp(st->jump, 1);
}

void jpeg_on_message(j_common_ptr cinfo, int level) {
  if (level >= 0) return;  // trace messages
  auto* st = reinterpret_cast<JpegState*>(cinfo->err);
  // libjpeg pads a file that ends early with gray and only warns; Pillow raises "image file is truncated".
  if (cinfo->err->msg_code == JWRN_JPEG_EOF) st->truncated = true;
  cinfo->err->num_warnings++;
}

void jpeg_on_progress(j_common_ptr cinfo) {
  if (!cinfo->is_decompressor) return;
  auto* d = reinterpret_cast<j_decompress_ptr>(cinfo);
  if (d->input_scan_number > kMaxJpegScans) {
    auto* st = reinterpret_cast<JpegState*>(cinfo->err);
    st->too_many_scans = true;
    std::longjmp(st->jump, 1);
  }
}

struct JpegReader {
  jpeg_decompress_struct cinfo;
  JpegState st;
  jpeg_progress_mgr progress;
  bool created = false;
  ~JpegReader() {
    if (created) jpeg_destroy_decompress(&cinfo);
  }
};

bool jpeg_open(JpegReader* r, std::span<const uint8_t> b) {
  if (setjmp(r->st.jump)) return false;
  jpeg_create_decompress(&r->cinfo);
  r->created = true;
  r->progress.progress_monitor = jpeg_on_progress;
  r->cinfo.progress = &r->progress;
  jpeg_mem_src(&r->cinfo, b.data(), static_cast<unsigned long>(b.size()));
  jpeg_read_header(&r->cinfo, TRUE);
  return true;
}

bool jpeg_read_pixels(JpegReader* r, uint8_t* out, size_t row_bytes) {
  if (setjmp(r->st.jump)) return false;
  jpeg_start_decompress(&r->cinfo);
  while (r->cinfo.output_scanline < r->cinfo.output_height) {
    JSAMPROW row = out + static_cast<size_t>(r->cinfo.output_scanline) * row_bytes;
    jpeg_read_scanlines(&r->cinfo, &row, 1);
  }
  jpeg_finish_decompress(&r->cinfo);
  return true;
}

[[noreturn]] void jpeg_fail(const JpegReader& r) {
  if (r.st.too_many_scans)
    fail("image: corrupt JPEG data (more than {} progressive scans)", kMaxJpegScans);
  if (r.st.mgr.msg_code == JERR_EMPTY_IMAGE)
    fail("image: the JPEG declares a zero-size image ({} x {} pixels)", r.cinfo.image_width, r.cinfo.image_height);
  if (r.st.truncated || r.st.mgr.msg_code == JWRN_JPEG_EOF)
    fail("image: truncated JPEG data (the file ends before the image data does)");
  switch (r.st.mgr.msg_code) {
    case JERR_BAD_PRECISION:       // 12-bit samples
    case JERR_ARITH_NOTIMPL:
    case JERR_NOT_COMPILED:
    case JERR_CONVERSION_NOTIMPL:
      fail("image: unsupported JPEG variant ({}); {}", r.st.message, kAccepted);
    default:
      fail("image: corrupt JPEG data ({})", r.st.message);
  }
}

void jpeg_init(JpegReader* r) {
  r->cinfo.err = jpeg_std_error(&r->st.mgr);
  r->st.mgr.error_exit = jpeg_on_error_exit;
  r->st.mgr.emit_message = jpeg_on_message;
}

ImageInfo jpeg_header(JpegReader* r, std::span<const uint8_t> b, int64_t max_pixels) {
  jpeg_init(r);
  if (!jpeg_open(r, b)) jpeg_fail(*r);
  if (r->st.truncated) fail("image: truncated JPEG data (the file ends inside its header)");
  check_dimensions("JPEG", r->cinfo.image_width, r->cinfo.image_height, max_pixels);
  return {ImageFormat::jpeg, static_cast<int>(r->cinfo.image_width), static_cast<int>(r->cinfo.image_height)};
}

// Pillow's cmyk2rgb (libImaging/Convert.c) on Pillow's "CMYK;I" samples (JPEG CMYK is stored inverted, the
// Adobe convention Pillow assumes for every CMYK JPEG): MULDIV255 is a rounded division by 255.
uint8_t cmyk_channel(uint32_t inverted_c, uint32_t inverted_k) {
  const uint32_t c = 255 - inverted_c, nk = inverted_k;  // nk = 255 - k with k = 255 - inverted_k
  const uint32_t tmp = c * nk + 128;
  const uint32_t muldiv = ((tmp >> 8) + tmp) >> 8;
  return static_cast<uint8_t>(nk - muldiv);  // muldiv <= nk: no clipping needed
}

RgbImage jpeg_decode(std::span<const uint8_t> b, int64_t max_pixels) {
  JpegReader r;
  const ImageInfo declared = jpeg_header(&r, b, max_pixels);
  const bool cmyk = r.cinfo.jpeg_color_space == JCS_CMYK || r.cinfo.jpeg_color_space == JCS_YCCK;
  r.cinfo.out_color_space = cmyk ? JCS_CMYK : JCS_RGB;  // gray is replicated to RGB by libjpeg-turbo
  const int channels = cmyk ? 4 : 3;
  const size_t row_bytes = static_cast<size_t>(declared.width) * channels;
  std::vector<uint8_t> pixels(row_bytes * declared.height);
  if (!jpeg_read_pixels(&r, pixels.data(), row_bytes)) jpeg_fail(r);
  if (r.st.truncated) fail("image: truncated JPEG data (the file ends before the image data does)");
  KILN_CHECK(static_cast<int>(r.cinfo.output_width) == declared.width &&
             r.cinfo.output_components == channels);
  if (!cmyk) return finish(declared.width, declared.height, 3, std::move(pixels), AlphaMode::drop);

  RgbImage img;
  img.width = declared.width;
  img.height = declared.height;
  const size_t count = static_cast<size_t>(img.width) * img.height;
  img.rgb.resize(count * 3);
  for (size_t i = 0; i < count; ++i) {
    const uint8_t* p = &pixels[i * 4];
    for (int c = 0; c < 3; ++c) img.rgb[i * 3 + c] = cmyk_channel(p[c], p[3]);
  }
  return img;
}

// ---- WebP (libwebp) ----------------------------------------------------------------------------------------

std::string webp_status(VP8StatusCode s) {
  switch (s) {
    case VP8_STATUS_OUT_OF_MEMORY: return "out of memory";
    case VP8_STATUS_INVALID_PARAM: return "invalid parameter";
    case VP8_STATUS_BITSTREAM_ERROR: return "bitstream error";
    case VP8_STATUS_UNSUPPORTED_FEATURE: return "unsupported feature";
    case VP8_STATUS_SUSPENDED: return "suspended";
    case VP8_STATUS_USER_ABORT: return "aborted";
    case VP8_STATUS_NOT_ENOUGH_DATA: return "not enough data";
    default: return fmt::format("status {}", static_cast<int>(s));
  }
}

[[noreturn]] void webp_fail(VP8StatusCode s) {
  if (s == VP8_STATUS_NOT_ENOUGH_DATA) fail("image: truncated WebP data (the file ends before the image data does)");
  if (s == VP8_STATUS_UNSUPPORTED_FEATURE) fail("image: unsupported WebP feature; {}", kAccepted);
  if (s == VP8_STATUS_OUT_OF_MEMORY) fail("image: out of memory decoding the WebP image");
  fail("image: corrupt WebP data ({})", webp_status(s));
}

ImageInfo webp_header(std::span<const uint8_t> b, int64_t max_pixels, WebPBitstreamFeatures* f) {
  const VP8StatusCode s = WebPGetFeatures(b.data(), b.size(), f);
  if (s != VP8_STATUS_OK) webp_fail(s);
  if (f->has_animation)
    fail("image: animated WebP is not supported; send a single frame (a still PNG, JPEG or WebP)");
  check_dimensions("WebP", static_cast<uint64_t>(f->width), static_cast<uint64_t>(f->height), max_pixels);
  return {ImageFormat::webp, f->width, f->height};
}

RgbImage webp_decode(std::span<const uint8_t> b, int64_t max_pixels, AlphaMode alpha) {
  WebPDecoderConfig config;
  if (!WebPInitDecoderConfig(&config)) fail("image: cannot start the WebP decoder (library version mismatch)");
  const ImageInfo declared = webp_header(b, max_pixels, &config.input);
  const int channels = config.input.has_alpha ? 4 : 3;
  const size_t stride = static_cast<size_t>(declared.width) * channels;
  std::vector<uint8_t> pixels(stride * declared.height);
  config.output.colorspace = channels == 4 ? MODE_RGBA : MODE_RGB;  // straight (not premultiplied) alpha
  config.output.is_external_memory = 1;
  config.output.u.RGBA.rgba = pixels.data();
  config.output.u.RGBA.stride = static_cast<int>(stride);
  config.output.u.RGBA.size = pixels.size();
  const VP8StatusCode s = WebPDecode(b.data(), b.size(), &config);
  WebPFreeDecBuffer(&config.output);  // external memory: frees nothing of ours
  if (s != VP8_STATUS_OK) webp_fail(s);
  return finish(declared.width, declared.height, channels, std::move(pixels), alpha);
}

[[noreturn]] void refuse_format(ImageFormat f, std::span<const uint8_t> b) {
  if (b.empty()) fail("image: no data (0 bytes); {}", kAccepted);
  if (f == ImageFormat::gif) fail("image: GIF images are not supported; {} (convert the image, e.g. to PNG)", kAccepted);
  if (f != ImageFormat::unknown) fail("image: {} images are not supported; {}", image_format_name(f), kAccepted);
  fail("image: unrecognised format (first bytes {}); {}", first_bytes_hex(b), kAccepted);
}

}  // namespace

const char* alpha_mode_name(AlphaMode alpha) {
  return alpha == AlphaMode::composite_on_white ? "composite_on_white" : "drop";
}

const char* image_format_name(ImageFormat format) {
  switch (format) {
    case ImageFormat::png: return "PNG";
    case ImageFormat::jpeg: return "JPEG";
    case ImageFormat::webp: return "WebP";
    case ImageFormat::gif: return "GIF";
    case ImageFormat::bmp: return "BMP";
    case ImageFormat::tiff: return "TIFF";
    case ImageFormat::ico: return "ICO";
    case ImageFormat::heif: return "HEIF";
    case ImageFormat::avif: return "AVIF";
    case ImageFormat::svg: return "SVG";
    case ImageFormat::pdf: return "PDF";
    case ImageFormat::unknown: break;
  }
  return "unknown";
}

ImageFormat detect_image_format(std::span<const uint8_t> b) {
  if (b.size() >= 8 && std::memcmp(b.data(), kPngSignature, 8) == 0) return ImageFormat::png;
  if (b.size() >= 3 && b[0] == 0xff && b[1] == 0xd8 && b[2] == 0xff) return ImageFormat::jpeg;
  if (starts_with(b, "RIFF") && starts_with(b, "WEBP", 8)) return ImageFormat::webp;
  if (starts_with(b, "GIF87a") || starts_with(b, "GIF89a")) return ImageFormat::gif;
  if (starts_with(b, "BM")) return ImageFormat::bmp;
  if (starts_with(b, std::string_view("II*\0", 4)) || starts_with(b, std::string_view("MM\0*", 4)))
    return ImageFormat::tiff;
  if (starts_with(b, std::string_view("\0\0\1\0", 4))) return ImageFormat::ico;
  if (starts_with(b, "%PDF")) return ImageFormat::pdf;
  if (starts_with(b, "ftyp", 4)) {
    if (starts_with(b, "avif", 8) || starts_with(b, "avis", 8)) return ImageFormat::avif;
    for (const char* brand : {"heic", "heix", "hevc", "hevx", "heim", "heis", "mif1", "msf1"})
      if (starts_with(b, brand, 8)) return ImageFormat::heif;
  }
  // SVG: XML text, possibly after a byte-order mark and white space.
  size_t i = starts_with(b, "\xef\xbb\xbf") ? 3 : 0;
  while (i < b.size() && i < 64 && (b[i] == ' ' || b[i] == '\t' || b[i] == '\r' || b[i] == '\n')) ++i;
  if (starts_with(b, "<svg", i) || starts_with(b, "<?xml", i)) return ImageFormat::svg;
  return ImageFormat::unknown;
}

ImageInfo probe_image(std::span<const uint8_t> bytes, int64_t max_pixels) {
  const ImageFormat f = detect_image_format(bytes);
  switch (f) {
    case ImageFormat::png: return png_probe(bytes, max_pixels);
    case ImageFormat::jpeg: {
      JpegReader r;
      return jpeg_header(&r, bytes, max_pixels);
    }
    case ImageFormat::webp: {
      WebPBitstreamFeatures features;
      return webp_header(bytes, max_pixels, &features);
    }
    default: refuse_format(f, bytes);
  }
}

RgbImage decode_image(std::span<const uint8_t> bytes, int64_t max_pixels, AlphaMode alpha) {
  const ImageFormat f = detect_image_format(bytes);
  switch (f) {
    case ImageFormat::png: return png_decode(bytes, max_pixels, alpha);
    case ImageFormat::jpeg: return jpeg_decode(bytes, max_pixels);
    case ImageFormat::webp: return webp_decode(bytes, max_pixels, alpha);
    default: refuse_format(f, bytes);
  }
}

}  // namespace kiln::media
