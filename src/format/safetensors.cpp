#include "format/safetensors.h"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <set>
#include <unordered_set>

#include "core/error.h"
#include "core/log.h"

namespace kiln::format {
namespace {

using json = nlohmann::json;
using ordered_json = nlohmann::ordered_json;

uint64_t read_le64(const uint8_t* p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

// A JSON value that must be a non-negative integer that fits in uint64.
bool as_u64(const json& v, uint64_t* out) {
  if (v.is_number_unsigned()) {
    *out = v.get<uint64_t>();
    return true;
  }
  if (v.is_number_integer() && v.get<int64_t>() >= 0) {
    *out = static_cast<uint64_t>(v.get<int64_t>());
    return true;
  }
  return false;
}

std::string shape_str(const std::vector<uint64_t>& dims) {
  std::string s = "[";
  for (size_t i = 0; i < dims.size(); ++i) s += (i ? ", " : "") + std::to_string(dims[i]);
  return s + "]";
}

// The first key of the top-level object that appears twice ("" when none, or when the text is not valid JSON: the
// DOM parse reports that). Linear in the header's size.
std::string first_duplicate_top_level_key(const char* begin, const char* end) {
  struct Keys : nlohmann::json_sax<json> {
    int depth = 0;
    std::unordered_set<std::string> seen;
    std::string duplicate;
    bool null() override { return true; }
    bool boolean(bool) override { return true; }
    bool number_integer(number_integer_t) override { return true; }
    bool number_unsigned(number_unsigned_t) override { return true; }
    bool number_float(number_float_t, const string_t&) override { return true; }
    bool string(string_t&) override { return true; }
    bool binary(binary_t&) override { return true; }
    bool start_object(std::size_t) override {
      ++depth;
      return true;
    }
    bool key(string_t& k) override {
      if (depth == 1 && duplicate.empty() && !seen.insert(k).second) duplicate = k;
      return true;
    }
    bool end_object() override {
      --depth;
      return true;
    }
    bool start_array(std::size_t) override {
      ++depth;
      return true;
    }
    bool end_array() override {
      --depth;
      return true;
    }
    bool parse_error(std::size_t, const std::string&, const nlohmann::detail::exception&) override { return false; }
  } keys;
  json::sax_parse(begin, end, &keys, nlohmann::detail::input_format_t::json, /*strict=*/true);
  return keys.duplicate;
}

}  // namespace

// ---------------------------------------------------------------------------------------------------
// Reader

SafetensorsFile::SafetensorsFile(std::span<const uint8_t> bytes, std::string display_name)
    : name_(std::move(display_name)) {
  const std::string& file = name_;
  if (bytes.size() < 8)
    fail("{}: not a safetensors file: {} bytes, too short for the 8-byte header length", file, bytes.size());
  const uint64_t header_len = read_le64(bytes.data());
  if (header_len > kMaxSafetensorsHeaderBytes)
    fail("{}: safetensors header length {} is larger than the {} MB limit (corrupt or not a safetensors file)",
         file, header_len, kMaxSafetensorsHeaderBytes >> 20);
  if (header_len > bytes.size() - 8)
    fail("{}: safetensors header length {} runs past the end of the file ({} bytes): file truncated?", file,
         header_len, bytes.size());
  header_bytes_ = header_len;
  const char* header_begin = reinterpret_cast<const char*>(bytes.data() + 8);
  const uint8_t* data_begin = bytes.data() + 8 + header_len;
  const uint64_t data_size = bytes.size() - 8 - header_len;

  // The JSON object keeps only the last of duplicate keys: a SAX pass over the header finds them first. (A parse
  // callback would do it in one pass, but nlohmann's callback parser rescans the enclosing object at the end of each
  // tensor's entry: quadratic, 69 s for the 123,493 tensors of a 35B-A3B checkpoint.)
  const std::string duplicate = first_duplicate_top_level_key(header_begin, header_begin + header_len);
  json header = json::parse(header_begin, header_begin + header_len, nullptr, /*allow_exceptions=*/false);
  if (header.is_discarded()) fail("{}: safetensors header is not valid JSON", file);
  if (!header.is_object()) fail("{}: safetensors header is not a JSON object", file);
  if (!duplicate.empty()) fail("{}: tensor '{}' appears more than once in the header", file, duplicate);

  struct Range {
    uint64_t begin, end;
    size_t index;
  };
  std::vector<Range> ranges;
  for (auto& [key, value] : header.items()) {
    if (key == "__metadata__") {
      if (!value.is_object()) fail("{}: __metadata__ must be a JSON object of strings", file);
      for (auto& [mk, mv] : value.items()) {
        if (!mv.is_string()) fail("{}: __metadata__ value for '{}' must be a string", file, mk);
        metadata_[mk] = mv.get<std::string>();
      }
      continue;
    }
    const std::string& tensor = key;
    if (!value.is_object()) fail("{}: tensor '{}': header entry must be an object", file, tensor);
    auto dt = value.find("dtype");
    auto sh = value.find("shape");
    auto off = value.find("data_offsets");
    if (dt == value.end() || !dt->is_string()) fail("{}: tensor '{}': missing or non-string \"dtype\"", file, tensor);
    if (sh == value.end() || !sh->is_array()) fail("{}: tensor '{}': missing or non-array \"shape\"", file, tensor);
    if (off == value.end() || !off->is_array() || off->size() != 2)
      fail("{}: tensor '{}': \"data_offsets\" must be an array [begin, end]", file, tensor);

    TensorInfo info;
    info.name = tensor;
    info.file = file;
    const std::string dtype_str = dt->get<std::string>();
    if (!parse_dtype(dtype_str, &info.dtype)) fail("{}: tensor '{}': unknown dtype '{}'", file, tensor, dtype_str);
    if (sh->size() > static_cast<size_t>(kMaxDims))
      fail("{}: tensor '{}': {} dimensions, at most {} supported", file, tensor, sh->size(), kMaxDims);
    std::vector<uint64_t> dims;
    uint64_t numel = 1;
    bool overflow = false;
    for (const auto& d : *sh) {
      uint64_t v;
      if (!as_u64(d, &v)) fail("{}: tensor '{}': shape entries must be non-negative integers", file, tensor);
      dims.push_back(v);
      overflow |= __builtin_mul_overflow(numel, v, &numel);
    }
    uint64_t expected_bytes = 0;
    overflow |= __builtin_mul_overflow(numel, static_cast<uint64_t>(dtype_size(info.dtype)), &expected_bytes);
    if (overflow || numel > static_cast<uint64_t>(INT64_MAX))
      fail("{}: tensor '{}': shape {} is too large", file, tensor, shape_str(dims));
    uint64_t begin, end;
    if (!as_u64((*off)[0], &begin) || !as_u64((*off)[1], &end))
      fail("{}: tensor '{}': data_offsets must be non-negative integers", file, tensor);
    if (begin > end) fail("{}: tensor '{}': data_offsets [{}, {}] has begin > end", file, tensor, begin, end);
    if (end > data_size)
      fail("{}: tensor '{}': data_offsets [{}, {}] run past the end of the data ({} bytes): file truncated?", file,
           tensor, begin, end, data_size);
    if (end - begin != expected_bytes)
      fail("{}: tensor '{}': {} x {} needs {} bytes but data_offsets [{}, {}] hold {}", file, tensor,
           dtype_str, shape_str(dims), expected_bytes, begin, end, end - begin);
    for (uint64_t d : dims) info.shape.dims[info.shape.ndim++] = static_cast<int64_t>(d);
    info.data = data_begin + begin;
    info.nbytes = static_cast<size_t>(expected_bytes);
    ranges.push_back({begin, end, tensors_.size()});
    tensors_.push_back(std::move(info));
  }

  // No two tensors may share bytes (empty tensors take no bytes).
  std::sort(ranges.begin(), ranges.end(), [](const Range& a, const Range& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
  });
  const Range* prev = nullptr;
  for (const Range& r : ranges) {
    if (r.begin == r.end) continue;
    if (prev && r.begin < prev->end)
      fail("{}: tensors '{}' [{}, {}] and '{}' [{}, {}] overlap", file, tensors_[prev->index].name, prev->begin,
           prev->end, tensors_[r.index].name, r.begin, r.end);
    prev = &r;
  }
  std::vector<TensorInfo> ordered;
  ordered.reserve(tensors_.size());
  for (const Range& r : ranges) ordered.push_back(std::move(tensors_[r.index]));
  tensors_ = std::move(ordered);
  for (size_t i = 0; i < tensors_.size(); ++i) index_.emplace(tensors_[i].name, i);
}

const TensorInfo* SafetensorsFile::find(std::string_view tensor_name) const {
  auto it = index_.find(tensor_name);
  return it == index_.end() ? nullptr : &tensors_[it->second];
}

// ---------------------------------------------------------------------------------------------------
// Checkpoint

Checkpoint Checkpoint::open(const ModelDir& dir) {
  Checkpoint ckpt;
  ckpt.dir_ = dir;
  const std::string where = dir.display_path();
  const std::string index_name = "model.safetensors.index.json";

  std::map<std::string, std::string> indexed;  // tensor -> shard, from the index
  if (dir.has(index_name)) {
    json index = json::parse(dir.read_text(index_name), nullptr, false);
    if (index.is_discarded() || !index.is_object()) fail("{}/{}: not valid JSON", where, index_name);
    auto wm = index.find("weight_map");
    if (wm == index.end() || !wm->is_object()) fail("{}/{}: missing \"weight_map\" object", where, index_name);
    std::set<std::string> shards;
    for (auto& [tensor, file] : wm->items()) {
      if (!file.is_string()) fail("{}/{}: weight_map entry for '{}' is not a file name", where, index_name, tensor);
      indexed[tensor] = file.get<std::string>();
      shards.insert(file.get<std::string>());
    }
    for (const auto& shard : shards) {
      if (shard.find('/') != std::string::npos || shard == ".." || shard == ".")
        fail("{}/{}: shard name '{}' is not a plain file name", where, index_name, shard);
      if (!dir.has(shard)) {
        std::string example;
        for (auto& [t, f] : indexed)
          if (f == shard) {
            example = t;
            break;
          }
        fail("{}: shard '{}' listed in {} (for tensor '{}' and others) is missing", where, shard, index_name,
             example);
      }
      ckpt.file_names_.push_back(shard);
    }
  } else if (dir.has("model.safetensors")) {
    ckpt.file_names_.push_back("model.safetensors");
  } else {
    for (const auto& f : dir.files())
      if (f.size() > 12 && f.ends_with(".safetensors")) ckpt.file_names_.push_back(f);
    if (ckpt.file_names_.empty()) fail("{}: no *.safetensors weight files found", where);
  }

  int64_t unindexed = 0;
  std::string first_unindexed;
  for (const auto& file : ckpt.file_names_) {
    SafetensorsFile sf(dir.map(file), file);
    for (const auto& t : sf.tensors()) {
      auto [it, inserted] = ckpt.tensors_.emplace(t.name, t);
      if (!inserted) fail("{}: tensor '{}' is stored twice (in '{}' and '{}')", where, t.name, it->second.file, file);
      if (!indexed.empty()) {
        auto ix = indexed.find(t.name);
        if (ix == indexed.end()) {
          if (unindexed++ == 0) first_unindexed = t.name + "' in '" + file;
        } else if (ix->second != file)
          fail("{}: tensor '{}' is indexed to '{}' but stored in '{}'", where, t.name, ix->second, file);
      }
    }
  }
  if (unindexed)
    KILN_LOG_WARN("{}: {} tensors are not listed in {} (loaded anyway), e.g. '{}'", where, unindexed, index_name,
                  first_unindexed);
  for (const auto& [tensor, file] : indexed)
    if (!ckpt.tensors_.count(tensor))
      fail("{}: tensor '{}' is indexed to shard '{}' but that shard does not contain it", where, tensor, file);
  return ckpt;
}

Checkpoint Checkpoint::synthetic(const ModelDir& dir, std::vector<TensorInfo> tensors) {
  Checkpoint ckpt;
  ckpt.dir_ = dir;
  ckpt.synthetic_ = true;
  for (auto& t : tensors) {
    t.data = nullptr;
    t.nbytes = static_cast<size_t>(t.shape.numel()) * dtype_size(t.dtype);
    t.file = "(dummy)";
    std::string name = t.name;
    if (!ckpt.tensors_.emplace(std::move(name), std::move(t)).second) fail("synthetic checkpoint: a tensor is listed twice");
  }
  return ckpt;
}

const TensorInfo* Checkpoint::find(std::string_view name) const {
  auto it = tensors_.find(name);
  return it == tensors_.end() ? nullptr : &it->second;
}

const TensorInfo& Checkpoint::get(std::string_view name) const {
  const TensorInfo* t = find(name);
  if (!t) fail("{}: checkpoint has no tensor '{}'", dir_.display_path(), name);
  return *t;
}

std::vector<std::string> Checkpoint::names() const {
  std::vector<std::string> out;
  out.reserve(tensors_.size());
  for (const auto& [name, t] : tensors_) out.push_back(name);
  return out;
}

uint64_t Checkpoint::total_bytes() const {
  uint64_t n = 0;
  for (const auto& [name, t] : tensors_) n += t.nbytes;
  return n;
}

std::map<DType, uint64_t> Checkpoint::bytes_by_dtype() const {
  std::map<DType, uint64_t> out;
  for (const auto& [name, t] : tensors_) out[t.dtype] += t.nbytes;
  return out;
}

// ---------------------------------------------------------------------------------------------------
// Writer

namespace {
uint64_t expected_nbytes(const std::string& name, DType dtype, const Shape& shape) {
  for (int i = 0; i < shape.ndim; ++i)
    if (shape.dims[i] < 0) fail("safetensors writer: tensor '{}' has a negative dimension {}", name, shape.str());
  return static_cast<uint64_t>(shape.numel()) * dtype_size(dtype);
}
}  // namespace

void SafetensorsWriter::add(const std::string& name, DType dtype, Shape shape, std::span<const uint8_t> bytes) {
  Entry e{name, dtype, shape, expected_nbytes(name, dtype, shape)};
  if (bytes.size() != e.nbytes)
    fail("safetensors writer: tensor '{}' {} {} needs {} bytes, got {}", name, dtype_name(dtype), shape.str(),
         e.nbytes, bytes.size());
  e.owned = std::make_shared<std::vector<uint8_t>>(bytes.begin(), bytes.end());
  e.view = {e.owned->data(), e.owned->size()};
  for (const auto& x : entries_)
    if (x.name == name) fail("safetensors writer: tensor '{}' added twice", name);
  entries_.push_back(std::move(e));
}

void SafetensorsWriter::add_view(const std::string& name, DType dtype, Shape shape, std::span<const uint8_t> bytes) {
  Entry e{name, dtype, shape, expected_nbytes(name, dtype, shape)};
  if (bytes.size() != e.nbytes)
    fail("safetensors writer: tensor '{}' {} {} needs {} bytes, got {}", name, dtype_name(dtype), shape.str(),
         e.nbytes, bytes.size());
  e.view = bytes;
  for (const auto& x : entries_)
    if (x.name == name) fail("safetensors writer: tensor '{}' added twice", name);
  entries_.push_back(std::move(e));
}

void SafetensorsWriter::add_generated(const std::string& name, DType dtype, Shape shape,
                                      std::function<void(std::span<uint8_t>)> fill) {
  Entry e{name, dtype, shape, expected_nbytes(name, dtype, shape)};
  KILN_CHECK(fill, "add_generated needs a fill function");
  e.fill = std::move(fill);
  for (const auto& x : entries_)
    if (x.name == name) fail("safetensors writer: tensor '{}' added twice", name);
  entries_.push_back(std::move(e));
}

void SafetensorsWriter::set_metadata(const std::string& key, const std::string& value) { metadata_[key] = value; }

uint64_t SafetensorsWriter::total_bytes() const {
  uint64_t n = 0;
  for (const auto& e : entries_) n += e.nbytes;
  return n;
}

void SafetensorsWriter::write_entries(const std::string& path, std::vector<const Entry*> entries) const {
  // Data order as the reference library writes it: larger elements first (keeps them aligned), then name.
  std::sort(entries.begin(), entries.end(), [](const Entry* a, const Entry* b) {
    size_t sa = dtype_size(a->dtype), sb = dtype_size(b->dtype);
    return sa != sb ? sa > sb : a->name < b->name;
  });
  ordered_json header = ordered_json::object();
  if (!metadata_.empty()) {
    ordered_json meta = ordered_json::object();
    for (const auto& [k, v] : metadata_) meta[k] = v;
    header["__metadata__"] = meta;
  }
  uint64_t offset = 0;
  for (const Entry* e : entries) {
    ordered_json t = ordered_json::object();
    t["dtype"] = dtype_name(e->dtype);
    t["shape"] = e->shape.vec();
    t["data_offsets"] = {offset, offset + e->nbytes};
    header[e->name] = t;
    offset += e->nbytes;
  }
  std::string text = header.dump();
  text.append((8 - (8 + text.size()) % 8) % 8, ' ');  // data starts 8-byte aligned

  const std::string tmp = path + ".tmp";
  FILE* f = std::fopen(tmp.c_str(), "wb");
  if (!f) fail("cannot write '{}': {}", tmp, std::strerror(errno));
  auto put = [&](const void* p, size_t n) {
    if (n && std::fwrite(p, 1, n, f) != n) {
      int err = errno;
      std::fclose(f);
      std::remove(tmp.c_str());
      fail("writing '{}' failed: {}", tmp, std::strerror(err));
    }
  };
  uint8_t len[8];
  for (int i = 0; i < 8; ++i) len[i] = static_cast<uint8_t>(static_cast<uint64_t>(text.size()) >> (8 * i));
  put(len, 8);
  put(text.data(), text.size());
  std::vector<uint8_t> scratch;
  for (const Entry* e : entries) {
    if (e->fill) {
      scratch.assign(e->nbytes, 0);
      e->fill({scratch.data(), scratch.size()});
      put(scratch.data(), scratch.size());
    } else {
      put(e->view.data(), e->view.size());
    }
  }
  if (std::fclose(f) != 0) {
    std::remove(tmp.c_str());
    fail("writing '{}' failed: {}", tmp, std::strerror(errno));
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) fail("cannot rename '{}' to '{}': {}", tmp, path, std::strerror(errno));
}

void SafetensorsWriter::write(const std::string& path) const {
  std::vector<const Entry*> all;
  for (const auto& e : entries_) all.push_back(&e);
  write_entries(path, std::move(all));
}

std::vector<std::string> SafetensorsWriter::write_sharded(const std::string& dir, uint64_t max_shard_bytes) const {
  namespace fs = std::filesystem;
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (!fs::is_directory(dir)) fail("cannot create output folder '{}'", dir);
  std::vector<const Entry*> sorted;
  for (const auto& e : entries_) sorted.push_back(&e);
  std::sort(sorted.begin(), sorted.end(), [](const Entry* a, const Entry* b) { return a->name < b->name; });

  std::vector<std::vector<const Entry*>> shards;
  uint64_t current = 0;
  for (const Entry* e : sorted) {
    if (shards.empty() || (current > 0 && current + e->nbytes > max_shard_bytes)) {
      shards.emplace_back();
      current = 0;
    }
    shards.back().push_back(e);
    current += e->nbytes;
  }
  if (shards.size() <= 1) {
    write((fs::path(dir) / "model.safetensors").string());
    return {"model.safetensors"};
  }
  std::vector<std::string> names;
  ordered_json weight_map = ordered_json::object();
  std::map<std::string, std::string> by_tensor;
  for (size_t i = 0; i < shards.size(); ++i) {
    std::string name = fmt::format("model-{:05d}-of-{:05d}.safetensors", i + 1, shards.size());
    write_entries((fs::path(dir) / name).string(), shards[i]);
    for (const Entry* e : shards[i]) by_tensor[e->name] = name;
    names.push_back(name);
  }
  for (const auto& [t, f] : by_tensor) weight_map[t] = f;
  ordered_json index = ordered_json::object();
  index["metadata"] = {{"total_size", total_bytes()}};
  index["weight_map"] = weight_map;
  const std::string index_path = (fs::path(dir) / "model.safetensors.index.json").string();
  FILE* f = std::fopen(index_path.c_str(), "wb");
  if (!f) fail("cannot write '{}': {}", index_path, std::strerror(errno));
  std::string text = index.dump(2) + "\n";
  bool ok = std::fwrite(text.data(), 1, text.size(), f) == text.size();
  ok &= std::fclose(f) == 0;
  if (!ok) fail("writing '{}' failed", index_path);
  names.push_back("model.safetensors.index.json");
  return names;
}

}  // namespace kiln::format
