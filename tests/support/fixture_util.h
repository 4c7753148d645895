// Tiny model folders for tests: config.json (+ hf_quant_config.json) of each supported family and
// random weights written with SafetensorsWriter, plus helpers to corrupt them.
//
//   TempDir tmp;
//   write_fixture_model(tmp.path(), Family::qwen3_5_moe, Layout::nvfp4);
//   auto dir = kiln::format::ModelDir::open(tmp.path());
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "format/model_config.h"
#include "format/quant_config.h"
#include "format/safetensors.h"

namespace kiln::test {

// A fresh folder under the system temp dir, removed (recursively) on destruction.
class TempDir {
 public:
  TempDir();
  ~TempDir();
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const std::string& path() const { return path_; }
  std::string file(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

enum class Family { qwen3_5_moe, qwen3_5_moe_text, qwen3_5, qwen3_next, qwen3_moe, qwen3 };
enum class Layout { bf16, nvfp4, fp8_mixed };  // fp8_mixed: NVFP4 experts + FP8 attention ("V2")

const char* family_name(Family f);
std::vector<Family> all_families();

// config.json text of a tiny model of `family` (hidden 64, 4 layers, small heads / experts).
std::string tiny_config_json(Family family);
// hf_quant_config.json text for `layout` (empty for bf16).
std::string tiny_quant_json(Family family, Layout layout);

struct FixtureOptions {
  uint64_t max_shard_bytes = 0;  // 0: one model.safetensors; else write_sharded with this limit
  bool with_vision = false;      // add a few model.visual.* tensors
  bool with_mtp = false;         // add a few mtp.* tensors
  uint32_t seed = 1;
};

// Writes config.json, hf_quant_config.json (quantised layouts) and random weights matching
// expected_tensors() into `dir`. Returns the config used.
format::ModelConfig write_fixture_model(const std::string& dir, Family family, Layout layout,
                                        const FixtureOptions& options = {});

// Raw bytes of a safetensors file from a header JSON text and a data blob (no validation: for crafting
// corrupt files). The 8-byte length is the header's size unless `header_len_override` is set.
std::vector<uint8_t> raw_safetensors(const std::string& header_json, const std::vector<uint8_t>& data,
                                     std::optional<uint64_t> header_len_override = std::nullopt);

void write_file(const std::string& path, const std::vector<uint8_t>& bytes);
void write_text(const std::string& path, const std::string& text);
std::vector<uint8_t> read_file(const std::string& path);

}  // namespace kiln::test
