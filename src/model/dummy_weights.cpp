#include "model/dummy_weights.h"

#include <cmath>

#include "core/error.h"
#include "format/weight_map.h"

namespace kiln::model {
namespace {

uint64_t fnv1a(const std::string& s) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (unsigned char c : s) h = (h ^ c) * 0x100000001b3ull;
  return h;
}

bool ends_with(const std::string& s, const char* suffix) { return s.ends_with(suffix); }

// Root mean square of the E2M1 magnitudes {0, .5, 1, 1.5, 2, 3, 4, 6} (codes uniform over all 16).
constexpr double kE2m1Rms = 2.9262;
// Root mean square of E4M3 values with a uniform byte in [0x28, 0x48) (exponents 2^-2 .. 2^1).
constexpr double kFp8WeightRms = 1.3650;

}  // namespace

format::Checkpoint dummy_checkpoint(const format::ModelDir& dir, const format::ModelConfig& config,
                                    const format::QuantConfig& quant, bool vision) {
  // config.tensor_prefix and expert_layout keep the defaults the architecture implies (a real checkpoint of it).
  std::vector<format::TensorInfo> tensors;
  for (const format::ExpectedTensor& e : format::expected_tensors(config, quant)) {
    if (e.optional) continue;
    format::TensorInfo t;
    t.name = e.name;
    t.dtype = e.dtypes.front();
    t.shape = e.shape;
    tensors.push_back(std::move(t));
  }
  if (vision && config.has_vision)
    for (const format::ExpectedTensor& e : format::expected_vision_tensors(config, "model.visual.")) {
      format::TensorInfo t;
      t.name = e.name;
      t.dtype = DType::BF16;
      t.shape = e.shape;
      tensors.push_back(std::move(t));
    }
  return format::Checkpoint::synthetic(dir, std::move(tensors));
}

RandomFill dummy_fill(const format::TensorInfo& t, NormKind norm_kind) {
  RandomFill f;
  f.seed = fnv1a(t.name);
  const std::string& n = t.name;
  if (dtype_size(t.dtype) == 1) {
    f.kind = RandomFill::Kind::bytes;
    if (t.dtype == DType::U8) {  // NVFP4 code pairs: any byte is two valid E2M1 codes
      f.byte_lo = 0;
      f.byte_hi = 256;
    } else if (ends_with(n, ".weight_scale")) {  // NVFP4 block scales: E4M3 in [0.5, 2)
      f.byte_lo = 0x30;
      f.byte_hi = 0x40;
    } else {  // FP8 weights: E4M3 magnitudes in [0.25, 4), random sign
      f.byte_lo = 0x28;
      f.byte_hi = 0x48;
      f.random_sign = true;
    }
    return f;
  }
  f.kind = RandomFill::Kind::uniform;
  if (ends_with(n, "linear_attn.norm.weight")) {  // gated RMSNorm: plain w
    f.lo = 0.9f;
    f.hi = 1.1f;
  } else if (ends_with(n, "norm.weight") || ends_with(n, "layernorm.weight")) {
    if (norm_kind == NormKind::zero_centred) {
      f.lo = -0.1f;
      f.hi = 0.1f;
    } else {
      f.lo = 0.9f;
      f.hi = 1.1f;
    }
  } else if (ends_with(n, "A_log")) {
    f.lo = 0.0f;
    f.hi = 2.0f;
  } else if (ends_with(n, "dt_bias")) {
    f.lo = -1.0f;
    f.hi = 1.0f;
  } else if (ends_with(n, "conv1d.weight")) {
    f.lo = -0.5f;
    f.hi = 0.5f;
  } else if (ends_with(n, "embed_tokens.weight") || t.shape.ndim < 2) {
    f.lo = -1.0f;
    f.hi = 1.0f;
  } else {  // a linear weight [N, K] (or fused experts [E, N, K]): variance 1 / K
    const double k = static_cast<double>(t.shape[t.shape.ndim - 1]);
    const float a = static_cast<float>(std::sqrt(3.0 / k));
    f.lo = -a;
    f.hi = a;
  }
  return f;
}

float dummy_scalar(const std::string& name, const format::Checkpoint& ckpt) {
  auto weight_k = [&](const std::string& module, bool fp4) {
    const format::TensorInfo* w = ckpt.find(module + ".weight");
    KILN_CHECK(w && w->shape.ndim == 2, "dummy weights: no 2-D {}.weight for {}", module, name);
    return static_cast<double>(w->shape[1]) * (fp4 ? 2.0 : 1.0);
  };
  if (name.ends_with(".weight_scale_2")) {
    const std::string module = name.substr(0, name.size() - std::string(".weight_scale_2").size());
    return static_cast<float>(1.0 / (kE2m1Rms * std::sqrt(weight_k(module, true))));
  }
  if (name.ends_with(".weight_scale")) {  // FP8 per-tensor
    const std::string module = name.substr(0, name.size() - std::string(".weight_scale").size());
    return static_cast<float>(1.0 / (kFp8WeightRms * std::sqrt(weight_k(module, false))));
  }
  return 1.0f;  // input_scale, k_scale, v_scale
}

}  // namespace kiln::model
