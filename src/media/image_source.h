// Image references of a request, turned into encoded bytes (decode_image takes it from there).
//
//   OpenAI chat  {"type": "image_url", "image_url": {"url": U}}   -> load_image_url(U, options)
//   Responses    {"type": "input_image", "image_url": U}           -> load_image_url(U, options)
//   Anthropic    {"type": "image", "source": {"type": "base64", "media_type": M, "data": D}}
//                                                                  -> load_image_base64(M, D, options)
//                {"type": "image", "source": {"type": "url", "url": U}} -> load_image_url(U, options)
//
// U may be
//   - data:image/<type>[;params];base64,<data>   always accepted (strict base64, white space skipped);
//   - file:///abs/path or /abs/path              only when the path resolves (symlinks and ".." followed)
//                                                to a regular file under MediaOptions::allowed_local_path;
//   - http:// or https://                        only with MediaOptions::allow_url_fetch, within
//                                                max_image_bytes and fetch_timeout_s, at most max_redirects
//                                                redirects (https needs cpp-httplib built with OpenSSL).
// Every refusal is a kiln::Error that says what was wrong and which flag changes the policy; long URLs are
// shortened in messages (a data URL can be megabytes). The claimed media type is kept for logs only: the
// decoder detects the format from the bytes.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "media/media_options.h"

namespace kiln::media {

struct EncodedImage {
  std::vector<uint8_t> bytes;
  std::string media_type;  // as claimed (data URL, Anthropic media_type, HTTP Content-Type); may be empty
  std::string source;      // for messages and logs: "data URL", "base64 data", "file /x/y.png", the URL fetched
};

EncodedImage load_image_url(std::string_view url, const MediaOptions& options);
EncodedImage load_image_base64(std::string_view media_type, std::string_view data, const MediaOptions& options);

// ---- the pieces, exposed for tests and for other callers ----

// RFC 4648 section 4 base64: the standard alphabet, '=' padding to a multiple of 4 characters, zero unused
// bits in the last group (the canonical encoding). ASCII white space (space, tab, CR, LF) is skipped
// anywhere. kiln::Error naming the offending character and its offset otherwise.
std::vector<uint8_t> base64_decode(std::string_view text);
// The decoded length, from the length of the text alone (white space skipped): lets a caller refuse an
// oversized payload before decoding it. kiln::Error when no base64 text has that length.
size_t base64_decoded_size(std::string_view text);

// RFC 2397: data:[<media type>][;<param>=<value>]*[;base64],<data>. The scheme and "base64" are matched
// case-insensitively; `data` views into the URL.
struct DataUrl {
  std::string media_type;  // lower case; "" when absent
  bool base64 = false;
  std::string_view data;
};
DataUrl parse_data_url(std::string_view url);

// Whether https:// URLs can be fetched (cpp-httplib built with OpenSSL).
bool https_supported();

}  // namespace kiln::media
