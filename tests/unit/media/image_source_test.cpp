// Image references -> bytes: RFC 4648 base64 (its test vectors), data URLs, Anthropic base64 sources, the
// local-path policy on real temporary directories (symlinks out, "..", prefix look-alikes), and fetching from
// a local cpp-httplib server (redirects, size and time limits).
#include "media/image_source.h"

#include <gtest/gtest.h>
#include <httplib.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <thread>

#include "core/error.h"

namespace kiln::media {
namespace {

namespace fs = std::filesystem;

std::string as_string(const std::vector<uint8_t>& b) { return std::string(b.begin(), b.end()); }

template <typename F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const InternalError& e) {
    ADD_FAILURE() << "internal error instead of a user error: " << e.what();
    return e.what();
  } catch (const Error& e) {
    return e.what();
  }
  ADD_FAILURE() << "no error";
  return "";
}

#define EXPECT_ERROR_HAS(expr, text)                                   \
  do {                                                                 \
    const std::string msg_ = error_of([&] { (void)(expr); });          \
    EXPECT_NE(msg_.find(text), std::string::npos) << "message: " << msg_; \
  } while (0)

TEST(Base64, Rfc4648TestVectors) {
  // RFC 4648 section 10.
  const std::pair<const char*, const char*> vectors[] = {{"", ""},         {"f", "Zg=="},         {"fo", "Zm8="},
                                                         {"foo", "Zm9v"}, {"foob", "Zm9vYg=="}, {"fooba", "Zm9vYmE="},
                                                         {"foobar", "Zm9vYmFy"}};
  for (auto [plain, encoded] : vectors) {
    EXPECT_EQ(as_string(base64_decode(encoded)), plain) << encoded;
    EXPECT_EQ(base64_decoded_size(encoded), std::string(plain).size()) << encoded;
  }
}

TEST(Base64, AllByteValuesAndWhiteSpace) {
  // '+' = 62 = 111110, '/' = 63 = 111111: "+/+/" = 11111011 11111111 10111111.
  EXPECT_EQ(base64_decode("+/+/"), (std::vector<uint8_t>{0xfb, 0xff, 0xbf}));
  EXPECT_EQ(base64_decode("AAEC"), (std::vector<uint8_t>{0, 1, 2}));
  // Line breaks (MIME), spaces and tabs anywhere are skipped.
  EXPECT_EQ(as_string(base64_decode(" Zm9v\r\nYmFy\n")), "foobar");
  EXPECT_EQ(as_string(base64_decode("Zm\t9vY g=\n=")), "foob");
}

TEST(Base64, MalformedInputIsAnErrorThatSaysWhere) {
  EXPECT_ERROR_HAS(base64_decode("Zm9v!mFy"), "'!' at offset 4");
  EXPECT_ERROR_HAS(base64_decode("Zm9-YmFy"), "'-' at offset 3");  // base64url is not accepted
  EXPECT_ERROR_HAS(base64_decode("Zm9vY"), "not a multiple of 4");
  EXPECT_ERROR_HAS(base64_decode("Zm9vYg"), "missing '=' padding");
  EXPECT_ERROR_HAS(base64_decode("Zg=a"), "after '=' padding");
  EXPECT_ERROR_HAS(base64_decode("Z==="), "padding");
  EXPECT_ERROR_HAS(base64_decode("Zm9v===="), "at most 2");
  EXPECT_ERROR_HAS(base64_decode("Zg==Zg=="), "after '=' padding");
  EXPECT_ERROR_HAS(base64_decode("Zh=="), "non-zero unused bits");  // 'h' = 33: low 4 bits set
  EXPECT_ERROR_HAS(base64_decode("Zm9="), "non-zero unused bits");  // '9' = 61: low 2 bits set
  EXPECT_ERROR_HAS(base64_decode(std::string("Zm9v\0YmF", 8)), "byte 0x00 at offset 4");
}

TEST(DataUrl, ParsesMediaTypeParametersAndData) {
  DataUrl d = parse_data_url("data:image/png;base64,iVBORw0K");
  EXPECT_EQ(d.media_type, "image/png");
  EXPECT_TRUE(d.base64);
  EXPECT_EQ(d.data, "iVBORw0K");
  d = parse_data_url("DATA:Image/JPEG;name=x.jpg;BASE64,/9j/");
  EXPECT_EQ(d.media_type, "image/jpeg");
  EXPECT_TRUE(d.base64);
  EXPECT_EQ(d.data, "/9j/");
  d = parse_data_url("data:,hello");
  EXPECT_EQ(d.media_type, "");
  EXPECT_FALSE(d.base64);
  EXPECT_ERROR_HAS(parse_data_url("data:image/png;base64"), "without ','");
  EXPECT_ERROR_HAS(parse_data_url("data:image/png;base64;x=1,AAAA"), "must be the last");
  EXPECT_ERROR_HAS(parse_data_url("data:image/png;charset,AAAA"), "name=value");
}

TEST(ImageSource, DataUrlGivesTheDecodedBytes) {
  MediaOptions o;
  EncodedImage img = load_image_url("data:image/png;base64,Zm9vYmFy", o);
  EXPECT_EQ(as_string(img.bytes), "foobar");
  EXPECT_EQ(img.media_type, "image/png");
  EXPECT_EQ(img.source, "data URL");
  img = load_image_url("  data:image/webp;base64,Zm9v\nYmFy  ", o);  // surrounding white space is trimmed
  EXPECT_EQ(as_string(img.bytes), "foobar");

  EXPECT_ERROR_HAS(load_image_url("data:text/plain;base64,Zm9v", o), "'text/plain', not an image");
  EXPECT_ERROR_HAS(load_image_url("data:;base64,Zm9v", o), "no media type");
  EXPECT_ERROR_HAS(load_image_url("data:image/png,Zm9v", o), "not base64-encoded");
  EXPECT_ERROR_HAS(load_image_url("data:image/png;base64,Zm9v!", o), "data URL: invalid base64");
}

TEST(ImageSource, SizeLimitIsCheckedBeforeDecoding) {
  MediaOptions o;
  o.max_image_bytes = 5;
  EXPECT_EQ(load_image_url("data:image/png;base64,Zm9vYmE=", o).bytes.size(), 5u);
  const std::string msg = error_of([&] { load_image_url("data:image/png;base64,Zm9vYmFy", o); });
  EXPECT_NE(msg.find("6 bytes, more than the 5 allowed"), std::string::npos) << msg;
  EXPECT_NE(msg.find(kFlagMaxImageBytes), std::string::npos) << msg;
  EXPECT_ERROR_HAS(load_image_base64("image/png", "Zm9vYmFy", o), kFlagMaxImageBytes);
}

TEST(ImageSource, AnthropicBase64Source) {
  MediaOptions o;
  const EncodedImage img = load_image_base64("image/jpeg", "Zm9v", o);
  EXPECT_EQ(as_string(img.bytes), "foo");
  EXPECT_EQ(img.media_type, "image/jpeg");
  EXPECT_EQ(img.source, "base64 data");
  EXPECT_ERROR_HAS(load_image_base64("application/pdf", "Zm9v", o), "'application/pdf', not an image");
  EXPECT_ERROR_HAS(load_image_base64("image/png", "Zm9", o), "base64 image data: invalid base64");
}

TEST(ImageSource, UnsupportedReferencesSayWhatIsAccepted) {
  MediaOptions o;
  EXPECT_ERROR_HAS(load_image_url("", o), "empty image URL");
  EXPECT_ERROR_HAS(load_image_url("ftp://example.com/a.png", o), "unsupported image URL");
  EXPECT_ERROR_HAS(load_image_url("images/a.png", o), kFlagAllowedLocalMediaPath);
  const std::string long_url = "gopher://" + std::string(5000, 'x');
  const std::string msg = error_of([&] { load_image_url(long_url, o); });
  EXPECT_LT(msg.size(), 400u) << "long URLs are shortened in messages";
  EXPECT_NE(msg.find("(5009 characters)"), std::string::npos) << msg;
}

// ---- local files ----

class LocalFiles : public ::testing::Test {
 protected:
  void SetUp() override {
    base_ = fs::temp_directory_path() / ("kiln_media_test_" + std::to_string(::getpid()) + "_" +
                                         ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(base_);
    fs::create_directories(base_ / "allowed" / "sub");
    fs::create_directories(base_ / "allowed2");
    fs::create_directories(base_ / "outside");
    write(base_ / "allowed" / "a.png", "inside");
    write(base_ / "allowed" / "sub" / "b c.png", "spaced");
    write(base_ / "allowed2" / "x.png", "lookalike");
    write(base_ / "outside" / "secret.png", "secret");
    fs::create_symlink(base_ / "outside" / "secret.png", base_ / "allowed" / "escape.png");
    fs::create_symlink(base_ / "outside", base_ / "allowed" / "escape_dir");
    fs::create_symlink(base_ / "allowed" / "a.png", base_ / "allowed" / "inner_link.png");
    options_.allowed_local_path = (base_ / "allowed").string();
  }
  void TearDown() override { fs::remove_all(base_); }
  static void write(const fs::path& p, const std::string& text) { std::ofstream(p, std::ios::binary) << text; }
  std::string path(const std::string& rel) const { return (base_ / rel).string(); }

  fs::path base_;
  MediaOptions options_;
};

TEST_F(LocalFiles, RefusedUnlessADirectoryIsAllowed) {
  MediaOptions none;
  const std::string msg = error_of([&] { load_image_url(path("allowed/a.png"), none); });
  EXPECT_NE(msg.find("local files are not allowed"), std::string::npos) << msg;
  EXPECT_NE(msg.find(kFlagAllowedLocalMediaPath), std::string::npos) << msg;
}

TEST_F(LocalFiles, ReadsFilesUnderTheAllowedDirectory) {
  EXPECT_EQ(as_string(load_image_url(path("allowed/a.png"), options_).bytes), "inside");
  EXPECT_EQ(as_string(load_image_url("file://" + path("allowed/a.png"), options_).bytes), "inside");
  EXPECT_EQ(as_string(load_image_url("file://localhost" + path("allowed/a.png"), options_).bytes), "inside");
  EXPECT_EQ(as_string(load_image_url("file://" + path("allowed/sub/b%20c.png"), options_).bytes), "spaced");
  EXPECT_EQ(as_string(load_image_url(path("allowed/sub/../a.png"), options_).bytes), "inside");
  EXPECT_EQ(as_string(load_image_url(path("allowed/inner_link.png"), options_).bytes), "inside");
  const EncodedImage img = load_image_url(path("allowed/a.png"), options_);
  EXPECT_EQ(img.source, "file " + fs::canonical(path("allowed/a.png")).string());
  // The allowed directory given with a trailing separator or through a symlink works the same.
  MediaOptions slash = options_;
  slash.allowed_local_path += "/";
  EXPECT_EQ(as_string(load_image_url(path("allowed/a.png"), slash).bytes), "inside");
}

TEST_F(LocalFiles, NothingLeadsOutOfTheAllowedDirectory) {
  EXPECT_ERROR_HAS(load_image_url(path("outside/secret.png"), options_), "outside the allowed directory");
  EXPECT_ERROR_HAS(load_image_url(path("allowed/../outside/secret.png"), options_), "outside the allowed directory");
  EXPECT_ERROR_HAS(load_image_url(path("allowed/escape.png"), options_), "resolves to");
  EXPECT_ERROR_HAS(load_image_url(path("allowed/escape_dir/secret.png"), options_), "resolves to");
  EXPECT_ERROR_HAS(load_image_url("file://" + path("allowed/%2e%2e/outside/secret.png"), options_), "outside");
  EXPECT_ERROR_HAS(load_image_url(path("allowed2/x.png"), options_), "outside the allowed directory");
  EXPECT_ERROR_HAS(load_image_url("file://evil.example.com" + path("allowed/a.png"), options_), "names host");
  // A file outside is refused by name, before the file system is asked: no existence probe.
  EXPECT_ERROR_HAS(load_image_url(path("outside/missing.png"), options_), "outside the allowed directory");
}

TEST_F(LocalFiles, MissingFilesDirectoriesAndSizeLimit) {
  EXPECT_ERROR_HAS(load_image_url(path("allowed/missing.png"), options_), "cannot open local image");
  EXPECT_ERROR_HAS(load_image_url(path("allowed/sub"), options_), "not a regular file");
  MediaOptions small = options_;
  small.max_image_bytes = 3;
  EXPECT_ERROR_HAS(load_image_url(path("allowed/a.png"), small), kFlagMaxImageBytes);
  EXPECT_ERROR_HAS(load_image_url("file://" + path("allowed/a%zz.png"), options_), "bad percent escape");
  MediaOptions bad_root = options_;
  bad_root.allowed_local_path = path("no_such_dir");
  EXPECT_ERROR_HAS(load_image_url(path("no_such_dir/a.png"), bad_root), "cannot be opened");
}

// ---- http(s) ----

class Fetch : public ::testing::Test {
 protected:
  void SetUp() override {
    server_.Get("/img.png", [](const httplib::Request&, httplib::Response& res) {
      res.set_content("PNGDATA", "image/png");
    });
    server_.Get("/redirect", [](const httplib::Request&, httplib::Response& res) {
      res.status = 302;
      res.set_header("Location", "/img.png");
    });
    server_.Get("/relative/redirect", [](const httplib::Request&, httplib::Response& res) {
      res.status = 301;
      res.set_header("Location", "../img.png");
    });
    server_.Get("/loop", [](const httplib::Request&, httplib::Response& res) {
      res.status = 302;
      res.set_header("Location", "/loop");
    });
    server_.Get("/to_file", [](const httplib::Request&, httplib::Response& res) {
      res.status = 302;
      res.set_header("Location", "file:///etc/passwd");
    });
    server_.Get("/big", [](const httplib::Request&, httplib::Response& res) {
      res.set_content(std::string(100000, 'x'), "image/png");
    });
    server_.Get("/big_chunked", [](const httplib::Request&, httplib::Response& res) {
      res.set_chunked_content_provider("image/png", [](size_t, httplib::DataSink& sink) {
        const std::string chunk(10000, 'y');
        for (int i = 0; i < 10; ++i) sink.write(chunk.data(), chunk.size());
        sink.done();
        return true;
      });
    });
    server_.Get("/slow", [](const httplib::Request&, httplib::Response& res) {
      std::this_thread::sleep_for(std::chrono::milliseconds(2500));
      res.set_content("late", "image/png");
    });
    server_.Get("/missing", [](const httplib::Request&, httplib::Response& res) { res.status = 404; });
    port_ = server_.bind_to_any_port("127.0.0.1");
    ASSERT_GT(port_, 0);
    thread_ = std::thread([this] { server_.listen_after_bind(); });
    while (!server_.is_running()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    options_.allow_url_fetch = true;
    options_.max_image_bytes = 50000;
    options_.fetch_timeout_s = 5;
  }
  void TearDown() override {
    server_.stop();
    thread_.join();
  }
  std::string url(const std::string& path) const { return "http://127.0.0.1:" + std::to_string(port_) + path; }

  httplib::Server server_;
  std::thread thread_;
  int port_ = 0;
  MediaOptions options_;
};

TEST_F(Fetch, RefusedUnlessEnabled) {
  MediaOptions off;
  const std::string msg = error_of([&] { load_image_url(url("/img.png"), off); });
  EXPECT_NE(msg.find("fetching image URLs is off"), std::string::npos) << msg;
  EXPECT_NE(msg.find(kFlagAllowImageUrlFetch), std::string::npos) << msg;
}

TEST_F(Fetch, FetchesAndFollowsRedirects) {
  EncodedImage img = load_image_url(url("/img.png"), options_);
  EXPECT_EQ(as_string(img.bytes), "PNGDATA");
  EXPECT_EQ(img.media_type, "image/png");
  EXPECT_EQ(img.source, url("/img.png"));
  img = load_image_url(url("/redirect"), options_);
  EXPECT_EQ(as_string(img.bytes), "PNGDATA");
  EXPECT_EQ(img.source, url("/img.png"));
  EXPECT_EQ(as_string(load_image_url(url("/relative/redirect"), options_).bytes), "PNGDATA");
}

TEST_F(Fetch, LimitsRedirectsSizeAndTime) {
  EXPECT_ERROR_HAS(load_image_url(url("/loop"), options_), "redirected more than 3 times");
  EXPECT_ERROR_HAS(load_image_url(url("/to_file"), options_), "not an http(s) URL");
  EXPECT_ERROR_HAS(load_image_url(url("/big"), options_), kFlagMaxImageBytes);
  EXPECT_ERROR_HAS(load_image_url(url("/big_chunked"), options_), "larger than the 50000 bytes allowed");
  EXPECT_ERROR_HAS(load_image_url(url("/missing"), options_), "HTTP 404");
  MediaOptions quick = options_;
  quick.fetch_timeout_s = 0.5;
  const auto start = std::chrono::steady_clock::now();
  EXPECT_ERROR_HAS(load_image_url(url("/slow"), quick), kFlagImageFetchTimeout);
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::milliseconds(2000));
  // Nothing listens on port 1.
  EXPECT_ERROR_HAS(load_image_url("http://127.0.0.1:1/img.png", options_), "cannot fetch");
  EXPECT_ERROR_HAS(load_image_url("http://user:pw@127.0.0.1/img.png", options_), "credentials");
}

TEST(ImageSourceTls, HttpsNeedsOpenSsl) {
  MediaOptions o;
  o.allow_url_fetch = true;
  o.fetch_timeout_s = 2;
  if (https_supported()) {
    // Port 1 on the loop-back interface: a connection error, not a "no TLS" error.
    const std::string msg = error_of([&] { load_image_url("https://127.0.0.1:1/a.png", o); });
    EXPECT_EQ(msg.find("without TLS support"), std::string::npos) << msg;
  } else {
    EXPECT_ERROR_HAS(load_image_url("https://127.0.0.1:1/a.png", o), "without TLS support");
  }
}

}  // namespace
}  // namespace kiln::media
