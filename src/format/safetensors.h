// safetensors: reader (zero-copy views into mapped files) and writer.
//
// File layout: 8-byte little-endian header length N, N bytes of JSON header
// {"name": {"dtype": "BF16", "shape": [..], "data_offsets": [begin, end]}, ..., "__metadata__": {..}},
// then the data; offsets are relative to the start of the data. Files are untrusted input: every
// malformed case (header length, JSON, dtype, offsets, overlaps, dtype x shape vs bytes, duplicate names)
// is a kiln::Error naming the file (and tensor), never an out-of-bounds read.
#pragma once
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "core/dtype.h"
#include "core/tensor.h"
#include "format/model_dir.h"

namespace kiln::format {

// Largest accepted JSON header (real checkpoints have headers of a few MB at most).
inline constexpr uint64_t kMaxSafetensorsHeaderBytes = 100ull << 20;

struct TensorInfo {
  std::string name;
  DType dtype = DType::F32;
  Shape shape;
  // Points into the mapped file (valid while the owner lives). 8-byte aligned when the writer padded the
  // header as Hugging Face's library does (and kiln's writer does); not guaranteed for arbitrary files.
  const uint8_t* data = nullptr;
  size_t nbytes = 0;
  std::string file;               // display name of the file holding it

  // A (read-only in practice) view of the bytes; valid while the SafetensorsFile/Checkpoint lives.
  TensorView view() const { return TensorView(const_cast<uint8_t*>(data), dtype, shape); }
  std::span<const uint8_t> bytes() const { return {data, nbytes}; }
};

// One parsed .safetensors file. Does not own the bytes: the caller keeps them alive.
class SafetensorsFile {
 public:
  // Parses and validates the header. `display_name` is used in error messages and TensorInfo::file.
  SafetensorsFile(std::span<const uint8_t> bytes, std::string display_name);

  const std::string& name() const { return name_; }
  // Tensors in file order (ascending data offset).
  const std::vector<TensorInfo>& tensors() const { return tensors_; }
  const TensorInfo* find(std::string_view tensor_name) const;
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  uint64_t header_bytes() const { return header_bytes_; }

 private:
  std::string name_;
  std::vector<TensorInfo> tensors_;
  std::map<std::string, size_t, std::less<>> index_;
  std::map<std::string, std::string> metadata_;
  uint64_t header_bytes_ = 0;
};

// All weights of a model directory: model.safetensors, or model.safetensors.index.json + its shards,
// or (no index) every *.safetensors file in the folder. Names are unique across files.
class Checkpoint {
 public:
  static Checkpoint open(const ModelDir& dir);
  // A checkpoint with names, dtypes and shapes but no bytes (TensorInfo::data == nullptr): what
  // `--load-format dummy` binds, the backend then fills each tensor with random values of the right kind.
  static Checkpoint synthetic(const ModelDir& dir, std::vector<TensorInfo> tensors);
  bool is_synthetic() const { return synthetic_; }

  const TensorInfo* find(std::string_view name) const;  // nullptr if absent
  const TensorInfo& get(std::string_view name) const;   // kiln::Error naming the tensor if absent
  bool has(std::string_view name) const { return find(name) != nullptr; }
  std::vector<std::string> names() const;              // sorted
  size_t size() const { return tensors_.size(); }
  uint64_t total_bytes() const;
  std::map<DType, uint64_t> bytes_by_dtype() const;
  const std::vector<std::string>& files() const { return file_names_; }  // shard file names
  const ModelDir& dir() const { return dir_; }
  // All tensors, sorted by name.
  const std::map<std::string, TensorInfo, std::less<>>& tensors() const { return tensors_; }

 private:
  ModelDir dir_;  // keeps the mappings alive
  std::vector<std::string> file_names_;
  std::map<std::string, TensorInfo, std::less<>> tensors_;
  bool synthetic_ = false;
};

// Writes safetensors files the way Hugging Face's library does: header keys in data order,
// "__metadata__" first, data sorted by (element size descending, name), header padded with spaces so
// the data starts 8-byte aligned.
class SafetensorsWriter {
 public:
  // Copies `bytes` (must be dtype x shape bytes).
  void add(const std::string& name, DType dtype, Shape shape, std::span<const uint8_t> bytes);
  // No copy: `bytes` must stay alive until write()/write_sharded() returns.
  void add_view(const std::string& name, DType dtype, Shape shape, std::span<const uint8_t> bytes);
  // Bytes produced at write time by `fill(out)` (out has dtype x shape bytes): lets a quantiser stream
  // a huge model with bounded memory. `fill` may be called once per write.
  void add_generated(const std::string& name, DType dtype, Shape shape,
                     std::function<void(std::span<uint8_t> out)> fill);
  void set_metadata(const std::string& key, const std::string& value);

  size_t size() const { return entries_.size(); }
  uint64_t total_bytes() const;

  // One file. kiln::Error if it cannot be written.
  void write(const std::string& path) const;
  // Into folder `dir`: if everything fits in max_shard_bytes, one model.safetensors; otherwise
  // model-0000K-of-0000N.safetensors shards (tensors in name order, a tensor larger than the limit gets
  // a shard of its own) plus model.safetensors.index.json ({"metadata": {"total_size": ..},
  // "weight_map": {name: file}}). Returns the file names written.
  std::vector<std::string> write_sharded(const std::string& dir, uint64_t max_shard_bytes) const;

 private:
  struct Entry {
    std::string name;
    DType dtype;
    Shape shape;
    uint64_t nbytes = 0;
    std::shared_ptr<std::vector<uint8_t>> owned;
    std::span<const uint8_t> view;
    std::function<void(std::span<uint8_t>)> fill;
  };
  void write_entries(const std::string& path, std::vector<const Entry*> entries) const;
  std::vector<Entry> entries_;
  std::map<std::string, std::string> metadata_;
};

}  // namespace kiln::format
