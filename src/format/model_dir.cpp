#include "format/model_dir.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <map>
#include <mutex>

#include "core/error.h"
#include "format/embedded_model.h"

namespace kiln::format {
namespace {

namespace fs = std::filesystem;

// A read-only mapping of one file, unmapped when the last user goes away.
struct Mapping {
  const uint8_t* data = nullptr;
  size_t size = 0;
  ~Mapping() {
    if (data && size) munmap(const_cast<uint8_t*>(data), size);
  }
};

// File names come from untrusted places (index.json): only plain relative paths inside the folder.
void check_relative_name(const std::string& file, const std::string& where) {
  if (file.empty() || file.front() == '/' || file.find('\0') != std::string::npos)
    fail("{}: invalid file name '{}'", where, file);
  for (const auto& part : fs::path(file))
    if (part == "..") fail("{}: file name '{}' points outside the model directory", where, file);
}

}  // namespace

struct ModelDir::Impl {
  bool embedded = false;
  std::string path;  // folder path as given (real folders)
  std::map<std::string, std::span<const uint8_t>> embedded_files;
  std::mutex mu;
  std::map<std::string, std::shared_ptr<Mapping>> mappings;  // real folders, made on first map()
};

const char* ModelDir::embedded_name() { return "kiln-tiny"; }

bool ModelDir::has_embedded() { return embedded::kNumFiles > 0; }

ModelDir ModelDir::open_or_embedded(const std::string& path) { return path.empty() ? embedded() : open(path); }

ModelDir ModelDir::embedded() {
  if (!has_embedded())
    fail("this kiln binary has no embedded model (it was built without models/kiln-tiny); pass --model-path");
  ModelDir dir;
  dir.impl_ = std::make_shared<Impl>();
  dir.impl_->embedded = true;
  for (size_t i = 0; i < embedded::kNumFiles; ++i) {
    const auto& f = embedded::kFiles[i];
    dir.impl_->embedded_files[f.name] = {f.begin, static_cast<size_t>(f.end - f.begin)};
  }
  return dir;
}

ModelDir ModelDir::open(const std::string& path) {
  std::error_code ec;
  if (path.empty()) fail("model path is empty: pass --model-path DIR");
  if (!fs::exists(path, ec)) fail("model path '{}' does not exist", path);
  if (!fs::is_directory(path, ec))
    fail("model path '{}' is not a directory (pass the folder that holds config.json)", path);
  if (!fs::is_regular_file(fs::path(path) / "config.json", ec))
    fail("model directory '{}' has no config.json (is this a Hugging Face model folder?)", path);
  ModelDir dir;
  dir.impl_ = std::make_shared<Impl>();
  dir.impl_->path = path;
  return dir;
}

bool ModelDir::is_embedded() const { return impl_ && impl_->embedded; }

std::string ModelDir::display_path() const {
  if (!impl_) return "(no model)";
  return impl_->embedded ? std::string("embedded:") + embedded_name() : impl_->path;
}

std::vector<std::string> ModelDir::files() const {
  std::vector<std::string> out;
  if (!impl_) return out;
  if (impl_->embedded) {
    for (auto& [name, bytes] : impl_->embedded_files) out.push_back(name);
    return out;
  }
  std::error_code ec;
  for (auto it = fs::directory_iterator(impl_->path, ec); !ec && it != fs::directory_iterator(); it.increment(ec))
    if (it->is_regular_file(ec)) out.push_back(it->path().filename().string());
  std::sort(out.begin(), out.end());
  return out;
}

bool ModelDir::has(const std::string& file) const {
  if (!impl_) return false;
  if (impl_->embedded) return impl_->embedded_files.count(file) > 0;
  if (file.empty() || file.front() == '/') return false;
  std::error_code ec;
  return fs::is_regular_file(fs::path(impl_->path) / file, ec);
}

std::string ModelDir::read_text(const std::string& file) const {
  auto bytes = map(file);
  return std::string(reinterpret_cast<const char*>(bytes.data()), bytes.size());
}

std::span<const uint8_t> ModelDir::map(const std::string& file) const {
  KILN_CHECK(impl_, "ModelDir used before open()");
  check_relative_name(file, display_path());
  if (impl_->embedded) {
    auto it = impl_->embedded_files.find(file);
    if (it == impl_->embedded_files.end()) fail("{}: no file '{}' in the embedded model", display_path(), file);
    return it->second;
  }
  std::lock_guard lock(impl_->mu);
  auto it = impl_->mappings.find(file);
  if (it != impl_->mappings.end()) return {it->second->data, it->second->size};

  const std::string full = (fs::path(impl_->path) / file).string();
  int fd = ::open(full.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) fail("cannot open '{}': {}", full, std::strerror(errno));
  struct stat st {};
  if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    fail("'{}' is not a regular file", full);
  }
  auto mapping = std::make_shared<Mapping>();
  mapping->size = static_cast<size_t>(st.st_size);
  if (mapping->size > 0) {
    void* p = mmap(nullptr, mapping->size, PROT_READ, MAP_PRIVATE, fd, 0);
    if (p == MAP_FAILED) {
      int err = errno;
      ::close(fd);
      mapping->size = 0;
      fail("cannot map '{}' ({} bytes): {}", full, st.st_size, std::strerror(err));
    }
    mapping->data = static_cast<const uint8_t*>(p);
  }
  ::close(fd);
  impl_->mappings[file] = mapping;
  return {mapping->data, mapping->size};
}

}  // namespace kiln::format
