// A model directory: a real folder on disk, or the default model embedded in the kiln binary
// (models/kiln-tiny at build time, when that folder exists).
//
//   ModelDir dir = ModelDir::open("/models/Qwen3.5-397B-A17B-NVFP4");   // or ModelDir::embedded()
//   std::string cfg = dir.read_text("config.json");
//   std::span<const uint8_t> bytes = dir.map("model-00001-of-00042.safetensors");  // zero-copy
//
// A ModelDir is a cheap, copyable handle: copies share the same mappings, and every span returned by
// map() stays valid as long as any copy of the ModelDir (or of a Checkpoint made from it) is alive.
#pragma once
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

namespace kiln::format {

class ModelDir {
 public:
  // Opens a folder. kiln::Error if it is not a directory or has no config.json.
  static ModelDir open(const std::string& path);
  // The model compiled into the binary (models/kiln-tiny), if the build had one.
  static bool has_embedded();
  static ModelDir embedded();  // kiln::Error if !has_embedded()
  // `--model-path` as the commands take it: the folder, or the embedded model when the path is empty.
  static ModelDir open_or_embedded(const std::string& path);
  // The embedded model's name ("kiln-tiny").
  static const char* embedded_name();

  bool is_embedded() const;
  // "embedded:kiln-tiny" or the folder path as given.
  std::string display_path() const;
  // Regular files at the top level of the model directory, sorted by name.
  std::vector<std::string> files() const;
  bool has(const std::string& file) const;
  // Whole file as text. kiln::Error naming the file and the directory if missing/unreadable.
  std::string read_text(const std::string& file) const;
  // The file's bytes: mmap (read-only) for real folders, the embedded bytes otherwise. The mapping is
  // made once per file and shared. kiln::Error if missing/unreadable.
  std::span<const uint8_t> map(const std::string& file) const;

 private:
  struct Impl;
  std::shared_ptr<Impl> impl_;
};

}  // namespace kiln::format
