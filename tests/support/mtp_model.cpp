#include "mtp_model.h"

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>

#include "core/dtype.h"
#include "core/error.h"
#include "format/model_config.h"
#include "format/model_dir.h"
#include "format/quant_config.h"
#include "format/safetensors.h"
#include "format/weight_map.h"

namespace kiln::test {

namespace fs = std::filesystem;

void write_model_with_mtp(const std::string& src_dir, const std::string& out_dir, uint64_t seed) {
  fs::create_directories(out_dir);
  nlohmann::json cfg = nlohmann::json::parse(std::ifstream(src_dir + "/config.json"));
  (cfg.contains("text_config") ? cfg["text_config"] : cfg)["mtp_num_hidden_layers"] = 1;
  std::ofstream(out_dir + "/config.json") << cfg.dump(2);
  for (const char* f : {"generation_config.json", "hf_quant_config.json"})
    if (fs::exists(src_dir + "/" + f)) fs::copy_file(src_dir + "/" + f, out_dir + "/" + f);

  const format::ModelDir src = format::ModelDir::open(src_dir);
  const format::Checkpoint ckpt = format::Checkpoint::open(src);
  format::SafetensorsWriter w;
  for (const auto& [name, t] : ckpt.tensors())
    w.add_view(name, t.dtype, t.shape, t.bytes());

  format::ModelConfig c = format::load_model_config(format::ModelDir::open(out_dir));
  const format::QuantConfig quant = format::load_quant_config(src);
  format::verify_checkpoint(ckpt, c, quant);  // prefix and expert layout from the checkpoint (the head is left off)
  c.mtp_num_layers = 1;
  c.mtp_expert_layout = c.expert_layout;
  std::mt19937_64 rng(seed);
  for (const format::ExpectedTensor& t : format::expected_tensors(c, quant)) {
    if (t.layer < c.num_layers || t.optional) continue;
    KILN_CHECK(t.dtypes.front() == DType::BF16 || t.dtypes.front() == DType::F32, "write_model_with_mtp: {} is {}",
               t.name, dtype_name(t.dtypes.front()));
    // Linear weights ~ U(-1/sqrt(in), 1/sqrt(in)) (inputs of unit scale keep unit scale); norms and 1-D
    // parameters small around 0 (zero-centred norms: weight 1 + w).
    const int64_t in = t.shape.ndim >= 2 ? t.shape.dims[t.shape.ndim - 1] : 1;
    const float a = t.shape.ndim >= 2 ? 1.0f / std::sqrt(static_cast<float>(in)) : 0.1f;
    std::uniform_real_distribution<float> u(-a, a);
    std::vector<uint8_t> bytes(static_cast<size_t>(t.shape.numel()) * 2);
    for (int64_t i = 0; i < t.shape.numel(); ++i) {
      const uint16_t h = f32_to_bf16(u(rng));
      std::memcpy(bytes.data() + i * 2, &h, 2);
    }
    w.add(t.name, DType::BF16, t.shape, bytes);
  }
  w.set_metadata("format", "pt");
  w.write(out_dir + "/model.safetensors");
}

}  // namespace kiln::test
