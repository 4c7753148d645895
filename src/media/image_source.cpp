#include "media/image_source.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <httplib.h>
#include <vector>

#include "core/error.h"

namespace kiln::media {
namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

bool is_space(char c) { return c == ' ' || c == '\t' || c == '\r' || c == '\n'; }

char lower(char c) { return static_cast<char>(std::tolower(static_cast<unsigned char>(c))); }

bool istarts_with(std::string_view s, std::string_view prefix) {
  if (s.size() < prefix.size()) return false;
  for (size_t i = 0; i < prefix.size(); ++i)
    if (lower(s[i]) != lower(prefix[i])) return false;
  return true;
}

std::string_view trim(std::string_view s) {
  while (!s.empty() && is_space(s.front())) s.remove_prefix(1);
  while (!s.empty() && is_space(s.back())) s.remove_suffix(1);
  return s;
}

// A URL as messages show it: at most ~80 characters (a data URL can be megabytes of base64).
std::string shorten(std::string_view s) {
  constexpr size_t kMax = 80;
  if (s.size() <= kMax) return std::string(s);
  return fmt::format("{}... ({} characters)", s.substr(0, kMax), s.size());
}

// -1 for characters outside the standard alphabet.
int base64_value(unsigned char c) {
  if (c >= 'A' && c <= 'Z') return c - 'A';
  if (c >= 'a' && c <= 'z') return c - 'a' + 26;
  if (c >= '0' && c <= '9') return c - '0' + 52;
  if (c == '+') return 62;
  if (c == '/') return 63;
  return -1;
}

std::string describe_char(char c) {
  const auto u = static_cast<unsigned char>(c);
  if (u >= 0x21 && u < 0x7f) return fmt::format("'{}'", c);
  return fmt::format("byte 0x{:02x}", u);
}

void check_size(size_t bytes, const MediaOptions& o, std::string_view what) {
  if (bytes > o.max_image_bytes)
    fail("image: {} is {} bytes, more than the {} allowed (raise {} to accept it)", what, bytes, o.max_image_bytes,
         kFlagMaxImageBytes);
}

// ---- local files ----

std::string percent_decode(std::string_view s, std::string_view url) {
  std::string out;
  out.reserve(s.size());
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] != '%') {
      out += s[i];
      continue;
    }
    auto hex = [](char c) {
      if (c >= '0' && c <= '9') return c - '0';
      if (c >= 'a' && c <= 'f') return c - 'a' + 10;
      if (c >= 'A' && c <= 'F') return c - 'A' + 10;
      return -1;
    };
    const int hi = i + 2 < s.size() ? hex(s[i + 1]) : -1, lo = i + 2 < s.size() ? hex(s[i + 2]) : -1;
    if (hi < 0 || lo < 0) fail("image: bad percent escape in file URL '{}'", shorten(url));
    const char c = static_cast<char>(hi * 16 + lo);
    if (c == '\0') fail("image: file URL '{}' contains %00", shorten(url));
    out += c;
    i += 2;
  }
  return out;
}

// Whether `path` is `root` or below it, comparing whole components ("/a/bc" is not under "/a/b").
bool is_under(const fs::path& path, const fs::path& root) {
  auto p = path.begin();
  for (auto r = root.begin(); r != root.end(); ++r, ++p) {
    if (r->empty()) continue;  // a trailing separator of root
    if (p == path.end() || *p != *r) return false;
  }
  return true;
}

EncodedImage read_local_file(const std::string& requested, const MediaOptions& o) {
  if (o.allowed_local_path.empty())
    fail("image: local files are not allowed ('{}'); send the image as a data URL, or start kiln with {} DIR to "
         "read images under DIR",
         shorten(requested), kFlagAllowedLocalMediaPath);
  const fs::path path(requested);
  if (!path.is_absolute()) fail("image: local image path '{}' is not absolute", shorten(requested));

  std::error_code ec;
  const fs::path configured = fs::path(o.allowed_local_path).lexically_normal();
  const fs::path root = fs::canonical(o.allowed_local_path, ec);
  if (ec)
    fail("image: the allowed local media directory '{}' ({}) cannot be opened: {}", o.allowed_local_path,
         kFlagAllowedLocalMediaPath, ec.message());
  // First by name, so a path outside the directory is refused without touching the file system (no
  // existence probes outside it); then by the resolved path, so no symlink or ".." leads out of it.
  const fs::path lexical = path.lexically_normal();
  if (!is_under(lexical, configured) && !is_under(lexical, root))
    fail("image: local image '{}' is outside the allowed directory {} ({})", shorten(requested),
         o.allowed_local_path, kFlagAllowedLocalMediaPath);
  const fs::path resolved = fs::canonical(path, ec);
  if (ec) fail("image: cannot open local image '{}': {}", shorten(requested), ec.message());
  if (!is_under(resolved, root))
    fail("image: local image '{}' resolves to {}, outside the allowed directory {} ({})", shorten(requested),
         resolved.string(), o.allowed_local_path, kFlagAllowedLocalMediaPath);

  // The resolved path has no symlink left; O_NOFOLLOW refuses one swapped in for the last component since.
  const int fd = ::open(resolved.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK);
  if (fd < 0) fail("image: cannot open local image '{}': {}", shorten(requested), std::strerror(errno));
  struct FdCloser {
    int fd;
    ~FdCloser() { ::close(fd); }
  } closer{fd};
  struct stat st{};
  if (::fstat(fd, &st) != 0) fail("image: cannot read local image '{}': {}", shorten(requested), std::strerror(errno));
  if (!S_ISREG(st.st_mode)) fail("image: local image '{}' is not a regular file", shorten(requested));
  check_size(static_cast<size_t>(st.st_size), o, fmt::format("local image '{}'", shorten(requested)));

  EncodedImage out;
  out.source = "file " + resolved.string();
  out.bytes.resize(static_cast<size_t>(st.st_size));
  size_t done = 0;
  while (done < out.bytes.size()) {
    const ssize_t n = ::read(fd, out.bytes.data() + done, out.bytes.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) fail("image: cannot read local image '{}': {}", shorten(requested), std::strerror(errno));
    if (n == 0) break;  // the file shrank: decode what is there (the decoder reports truncation)
    done += static_cast<size_t>(n);
  }
  out.bytes.resize(done);
  return out;
}

EncodedImage load_file_url(std::string_view url, const MediaOptions& o) {
  std::string_view rest = url.substr(7);  // after "file://"
  // Authority: empty or "localhost" (RFC 8089); a remote host is not a local file.
  const size_t slash = rest.find('/');
  const std::string_view host = rest.substr(0, slash == std::string_view::npos ? rest.size() : slash);
  if (!host.empty() && !(host.size() == 9 && istarts_with(host, "localhost")))
    fail("image: file URL '{}' names host '{}'; only local files (file:///path) are read", shorten(url),
         shorten(host));
  if (slash == std::string_view::npos) fail("image: file URL '{}' has no path", shorten(url));
  std::string_view path = rest.substr(slash);
  path = path.substr(0, std::min(path.find('?'), path.find('#')));  // query and fragment are not part of it
  return read_local_file(percent_decode(path, url), o);
}

// ---- http(s) ----

struct UrlParts {
  std::string scheme;     // "http" or "https"
  std::string authority;  // host[:port]
  std::string target;     // path[?query], at least "/"
};

UrlParts split_http_url(std::string_view url) {
  UrlParts p;
  const size_t colon = url.find("://");
  p.scheme = std::string(url.substr(0, colon));
  std::transform(p.scheme.begin(), p.scheme.end(), p.scheme.begin(), lower);
  std::string_view rest = url.substr(colon + 3);
  rest = rest.substr(0, rest.find('#'));
  const size_t path_start = rest.find_first_of("/?");
  p.authority = std::string(rest.substr(0, path_start));
  p.target = path_start == std::string_view::npos ? "/" : std::string(rest.substr(path_start));
  if (!p.target.empty() && p.target[0] == '?') p.target = "/" + p.target;
  if (p.authority.empty()) fail("image: URL '{}' has no host", shorten(url));
  if (p.authority.find('@') != std::string::npos)
    fail("image: URL '{}' carries credentials (user@host); they are not supported", shorten(url));
  for (char c : p.authority)
    if (static_cast<unsigned char>(c) <= 0x20 || c == '\\')
      fail("image: URL '{}' has an invalid host", shorten(url));
  return p;
}

// RFC 3986 section 5.2.4 on a path[?query]: "." and ".." segments removed.
std::string remove_dot_segments(std::string_view target) {
  const size_t q = target.find('?');
  const std::string_view path = target.substr(0, q), query = q == std::string_view::npos ? "" : target.substr(q);
  std::vector<std::string_view> out;
  size_t start = 1;  // paths here start with '/'
  while (start <= path.size()) {
    const size_t end = std::min(path.find('/', start), path.size());
    const std::string_view seg = path.substr(start, end - start);
    const bool last = end == path.size();
    if (seg == "..") {
      if (!out.empty()) out.pop_back();
      if (last) out.emplace_back("");
    } else if (seg == ".") {
      if (last) out.emplace_back("");
    } else {
      out.push_back(seg);
    }
    start = end + 1;
  }
  std::string result;
  for (auto seg : out) result += "/" + std::string(seg);
  if (result.empty()) result = "/";
  return result + std::string(query);
}

// Resolves a Location header against the URL that answered with it.
std::string resolve_location(const UrlParts& base, std::string_view location) {
  if (istarts_with(location, "http://") || istarts_with(location, "https://")) return std::string(location);
  if (location.find("://") != std::string_view::npos || istarts_with(location, "data:") ||
      istarts_with(location, "file:"))
    fail("image: redirect to '{}', which is not an http(s) URL", shorten(location));
  if (location.substr(0, 2) == "//") return base.scheme + ":" + std::string(location);
  const std::string prefix = base.scheme + "://" + base.authority;
  if (!location.empty() && location[0] == '/') return prefix + remove_dot_segments(location);
  // Relative to the directory of the current path.
  std::string dir = base.target.substr(0, base.target.find('?'));
  dir = dir.substr(0, dir.rfind('/') + 1);
  return prefix + remove_dot_segments(dir + std::string(location));
}

EncodedImage fetch_url(std::string_view first_url, const MediaOptions& o) {
  if (!o.allow_url_fetch)
    fail("image: fetching image URLs is off ('{}'); send the image as a data URL, or start kiln with {}",
         shorten(first_url), kFlagAllowImageUrlFetch);
  const auto budget = std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(o.fetch_timeout_s));
  const auto deadline = Clock::now() + budget;
  auto timed_out = [&](std::string_view url) {
    fail("image: fetching '{}' took longer than {} s (raise {})", shorten(url), o.fetch_timeout_s,
         kFlagImageFetchTimeout);
  };

  std::string url(first_url);
  for (int redirects = 0;; ++redirects) {
    const UrlParts parts = split_http_url(url);
    if (parts.scheme == "https" && !https_supported())
      fail("image: cannot fetch '{}': this kiln was built without TLS support (cpp-httplib without OpenSSL); use "
           "an http:// URL or a data URL",
           shorten(url));
    const auto remaining = deadline - Clock::now();
    if (remaining <= Clock::duration::zero()) timed_out(url);
    const auto remaining_us = std::chrono::duration_cast<std::chrono::microseconds>(remaining).count();

    httplib::Client client(parts.scheme + "://" + parts.authority);
    if (!client.is_valid()) fail("image: cannot fetch '{}': not a valid http(s) URL", shorten(url));
    client.set_follow_location(false);  // redirects are counted and checked here
    client.set_connection_timeout(remaining_us / 1000000, remaining_us % 1000000);
    client.set_read_timeout(remaining_us / 1000000, remaining_us % 1000000);
    client.set_write_timeout(remaining_us / 1000000, remaining_us % 1000000);

    std::vector<uint8_t> body;
    bool too_large = false, late = false;
    const httplib::Headers headers = {{"Accept", "image/*"}, {"User-Agent", "kiln"}};
    auto on_response = [&](const httplib::Response& res) {
      if (res.has_header("Content-Length")) {
        const std::string& len = res.get_header_value("Content-Length");
        char* end = nullptr;
        const unsigned long long n = std::strtoull(len.c_str(), &end, 10);
        if (end != len.c_str() && n > o.max_image_bytes) {
          too_large = true;
          return false;  // cancels the request before the body
        }
      }
      return true;
    };
    auto on_data = [&](const char* data, size_t n) {
      if (Clock::now() > deadline) {
        late = true;
        return false;
      }
      if (body.size() + n > o.max_image_bytes) {
        too_large = true;
        return false;
      }
      body.insert(body.end(), data, data + n);
      return true;
    };
    httplib::Result res = client.Get(parts.target, headers, on_response, on_data);
    if (too_large)
      fail("image: '{}' is larger than the {} bytes allowed (raise {} to accept it)", shorten(url),
           o.max_image_bytes, kFlagMaxImageBytes);
    if (late) timed_out(url);
    if (!res) {
      const httplib::Error e = res.error();
      // The socket timeouts were set to the time left, measured before connecting: a read that fails that
      // close to the deadline timed out.
      const bool near_deadline = Clock::now() + std::chrono::milliseconds(100) >= deadline;
      if (e == httplib::Error::ConnectionTimeout || (e == httplib::Error::Read && near_deadline)) timed_out(url);
      fail("image: cannot fetch '{}': {}", shorten(url), httplib::to_string(e));
    }
    const int status = res->status;
    if (status >= 300 && status < 400 && res->has_header("Location")) {
      if (redirects >= o.max_redirects)
        fail("image: fetching '{}' was redirected more than {} times", shorten(first_url), o.max_redirects);
      url = resolve_location(parts, res->get_header_value("Location"));
      continue;
    }
    if (status != 200) fail("image: fetching '{}' answered HTTP {}", shorten(url), status);
    EncodedImage out;
    out.bytes = std::move(body);
    out.media_type = res->get_header_value("Content-Type");
    out.source = url;
    return out;
  }
}

// ---- base64 payloads ----

void check_image_media_type(std::string_view media_type, std::string_view what) {
  if (media_type.empty()) fail("image: {} has no media type; expected image/png, image/jpeg or image/webp", what);
  if (!istarts_with(media_type, "image/"))
    fail("image: {} has media type '{}', not an image (expected image/png, image/jpeg or image/webp)", what,
         shorten(media_type));
}

std::vector<uint8_t> decode_payload(std::string_view data, const MediaOptions& o, std::string_view what) {
  try {
    check_size(base64_decoded_size(data), o, what);
    return base64_decode(data);
  } catch (const InternalError&) {
    throw;
  } catch (const Error& e) {
    fail("image: {}: {}", what, e.what());
  }
}

}  // namespace

bool https_supported() {
#ifdef CPPHTTPLIB_OPENSSL_SUPPORT
  return true;
#else
  return false;
#endif
}

size_t base64_decoded_size(std::string_view text) {
  size_t chars = 0, padding = 0;
  for (char c : text) {
    if (is_space(c)) continue;
    ++chars;
    padding = c == '=' ? padding + 1 : 0;
  }
  if (chars % 4 != 0)
    fail("invalid base64: {} characters (white space not counted), not a multiple of 4 (missing '=' padding?)",
         chars);
  if (padding > 2) fail("invalid base64: {} '=' padding characters at the end (at most 2)", padding);
  return chars / 4 * 3 - padding;
}

std::vector<uint8_t> base64_decode(std::string_view text) {
  const size_t size = base64_decoded_size(text);
  std::vector<uint8_t> out;
  out.reserve(size);
  uint32_t group = 0;  // up to four 6-bit values
  int in_group = 0;
  int padding = 0;     // '=' seen so far (only at the end)
  for (size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (is_space(c)) continue;
    if (c == '=') {
      // Padding fills the last group from its third character on.
      if (in_group < 2) fail("invalid base64: '=' at offset {} (padding only ends the text)", i);
      ++padding;
      ++in_group;
    } else {
      const int v = base64_value(static_cast<unsigned char>(c));
      if (v < 0) fail("invalid base64: {} at offset {} (not in the base64 alphabet)", describe_char(c), i);
      if (padding > 0) fail("invalid base64: {} at offset {} after '=' padding", describe_char(c), i);
      group = (group << 6) | static_cast<uint32_t>(v);
      ++in_group;
    }
    if (in_group == 4) {
      // 4 characters, of which `padding` are '=': 3 - padding bytes, the unused low bits must be zero.
      const int data_chars = 4 - padding;
      const uint32_t bits = group << (6 * padding);  // align the 24-bit group
      if (padding > 0 && (group & ((1u << (data_chars * 6 - (3 - padding) * 8)) - 1)) != 0)
        fail("invalid base64: the last group at offset {} has non-zero unused bits (not a canonical encoding)", i);
      out.push_back(static_cast<uint8_t>(bits >> 16));
      if (padding < 2) out.push_back(static_cast<uint8_t>(bits >> 8));
      if (padding < 1) out.push_back(static_cast<uint8_t>(bits));
      group = 0;
      in_group = 0;
    }
  }
  KILN_CHECK(in_group == 0 && out.size() == size, "base64 group of {} left, {} of {} bytes", in_group, out.size(),
             size);
  return out;
}

DataUrl parse_data_url(std::string_view url) {
  if (!istarts_with(url, "data:")) fail("not a data URL (it does not start with 'data:')");
  const size_t comma = url.find(',');
  if (comma == std::string_view::npos) fail("data URL without ',' before its data");
  const std::string_view header = url.substr(5, comma - 5);
  DataUrl out;
  out.data = url.substr(comma + 1);
  size_t start = 0;
  bool first = true;
  while (start <= header.size()) {
    const size_t end = std::min(header.find(';', start), header.size());
    const std::string_view token = trim(header.substr(start, end - start));
    if (first) {
      for (char c : token) out.media_type += lower(c);
      first = false;
    } else if (token.size() == 6 && istarts_with(token, "base64")) {
      if (end != header.size()) fail("data URL: ';base64' must be the last parameter, before ','");
      out.base64 = true;
    } else if (token.find('=') == std::string_view::npos) {
      fail("data URL: parameter '{}' is not of the form name=value", shorten(token));
    }
    start = end + 1;
  }
  return out;
}

EncodedImage load_image_base64(std::string_view media_type, std::string_view data, const MediaOptions& options) {
  check_image_media_type(media_type, "the base64 image source");
  EncodedImage out;
  out.bytes = decode_payload(data, options, "base64 image data");
  out.media_type = std::string(media_type);
  out.source = "base64 data";
  return out;
}

EncodedImage load_image_url(std::string_view url_in, const MediaOptions& options) {
  const std::string_view url = trim(url_in);
  if (url.empty()) fail("image: empty image URL");
  if (istarts_with(url, "data:")) {
    DataUrl d;
    try {
      d = parse_data_url(url);
    } catch (const InternalError&) {
      throw;
    } catch (const Error& e) {
      fail("image: {}", e.what());
    }
    check_image_media_type(d.media_type, "the data URL");
    if (!d.base64) fail("image: the data URL is not base64-encoded (expected data:{};base64,...)", d.media_type);
    EncodedImage out;
    out.bytes = decode_payload(d.data, options, "data URL");
    out.media_type = d.media_type;
    out.source = "data URL";
    return out;
  }
  if (istarts_with(url, "http://") || istarts_with(url, "https://")) return fetch_url(url, options);
  if (istarts_with(url, "file://")) return load_file_url(url, options);
  if (url[0] == '/') return read_local_file(std::string(url), options);
  fail("image: unsupported image URL '{}'; kiln accepts data:image/...;base64 URLs, http(s):// URLs (with {}) and "
       "file:// URLs or absolute paths under {}",
       shorten(url), kFlagAllowImageUrlFetch, kFlagAllowedLocalMediaPath);
}

}  // namespace kiln::media
