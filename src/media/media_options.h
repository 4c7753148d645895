// The knobs of image input, in one struct the server fills from its flags. Every limit is checked before the
// work it bounds (bytes before decoding base64 or reading a file, declared pixels before decoding an image),
// and an error that a limit causes names the flag that raises it: the flag names below are the ones kiln's
// messages cite, so the CLI must register exactly these.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>

namespace kiln::media {

inline constexpr const char* kFlagMaxImageBytes = "--max-image-bytes";
inline constexpr const char* kFlagMaxImagePixels = "--max-image-pixels";
// vLLM's name for the same policy.
inline constexpr const char* kFlagAllowedLocalMediaPath = "--allowed-local-media-path";
inline constexpr const char* kFlagAllowImageUrlFetch = "--allow-image-url-fetch";
inline constexpr const char* kFlagImageFetchTimeout = "--image-fetch-timeout";

struct MediaOptions {
  // Encoded bytes of one image: after base64 decoding, as read from a file, or as fetched.
  size_t max_image_bytes = size_t{20} << 20;
  // Pixels (width x height) a file may declare; checked on the header, before any pixel is decoded (a
  // decompression-bomb guard: decoding holds up to 4 bytes per pixel). Not the processor's resize budget
  // (preprocessor_config.json's longest_edge), which applies after decoding.
  int64_t max_pixels = int64_t{1} << 26;  // 8192 x 8192
  // file:// URLs and absolute paths are read only when they resolve (symlinks and ".." followed) to a file
  // under this directory. Empty: local files are refused.
  std::string allowed_local_path;
  // http(s):// image URLs are fetched only when this is on (a server that fetches URLs its clients name can
  // be pointed at internal addresses).
  bool allow_url_fetch = false;
  // Whole fetch, redirects included.
  double fetch_timeout_s = 10.0;
  int max_redirects = 3;
};

}  // namespace kiln::media
