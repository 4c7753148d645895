#include "format/weight_map.h"

#include <algorithm>
#include <atomic>
#include <mutex>
#include <set>
#include <unordered_map>

#include "core/error.h"
#include "core/log.h"

namespace kiln::format {
namespace {

const std::vector<DType> kFloat = {DType::BF16, DType::F16, DType::F32};
const std::vector<DType> kF32 = {DType::F32};

bool is_router(const std::string& module) {
  return module.ends_with(".mlp.gate") || module.ends_with(".mlp.shared_expert_gate");
}

class Builder {
 public:
  Builder(const ModelConfig& c, const QuantConfig& q) : c_(c), q_(q) {}

  void plain(const std::string& name, Shape shape, const char* role, int layer, const std::vector<DType>& dtypes = kFloat) {
    out.push_back(
        {.name = name, .dtypes = dtypes, .shape = shape, .role = role, .layer = layer, .params = shape.numel()});
  }

  // A linear `module` with weight [n_out, k_in], stored per its quantisation scheme.
  void linear(const std::string& module, int64_t n_out, int64_t k_in, const char* role, int layer, int expert = -1,
              bool bias = false) {
    const QuantScheme s = effective_scheme(c_, q_, module);
    auto add = [&](std::string suffix, std::vector<DType> dtypes, Shape shape, int64_t params) {
      out.push_back({.name = module + suffix,
                     .dtypes = std::move(dtypes),
                     .shape = shape,
                     .role = role,
                     .layer = layer,
                     .expert = expert,
                     .params = params});
    };
    switch (s) {
      case QuantScheme::none:
        add(".weight", kFloat, Shape{n_out, k_in}, n_out * k_in);
        break;
      case QuantScheme::nvfp4:
        if (k_in % q_.group_size)
          fail("{} has {} inputs, not a multiple of the NVFP4 group size {}: it cannot be NVFP4", module, k_in, q_.group_size);
        add(".weight", {DType::U8}, Shape{n_out, k_in / 2}, n_out * k_in);
        add(".weight_scale", {DType::F8_E4M3}, Shape{n_out, k_in / q_.group_size}, 0);
        add(".weight_scale_2", kF32, Shape{}, 0);
        add(".input_scale", kF32, Shape{}, 0);
        break;
      case QuantScheme::fp8:
        add(".weight", {DType::F8_E4M3}, Shape{n_out, k_in}, n_out * k_in);
        add(".weight_scale", kF32, Shape{}, 0);
        add(".input_scale", kF32, Shape{}, 0);
        break;
    }
    if (bias) add(".bias", kFloat, Shape{n_out}, n_out);
  }

  std::vector<ExpectedTensor> out;

 private:
  const ModelConfig& c_;
  const QuantConfig& q_;
};

}  // namespace

uint64_t ExpectedTensor::nbytes() const {
  return static_cast<uint64_t>(shape.numel()) * dtype_size(dtypes.front());
}

std::string layer_prefix(const ModelConfig& config, int layer) {
  if (layer >= config.num_layers) return "mtp.layers." + std::to_string(layer - config.num_layers) + ".";
  return config.tensor_prefix + "layers." + std::to_string(layer) + ".";
}

QuantScheme effective_scheme(const ModelConfig& config, const QuantConfig& quant, const std::string& module) {
  if (module == "mtp.fc") return QuantScheme::none;  // BF16 in every release (vLLM PR 38650)
  const QuantScheme s = quant.scheme_for(module);
  if (s != QuantScheme::none && is_router(module)) {
    static std::once_flag noted;
    std::call_once(noted, [&] {
      KILN_LOG_INFO("note: the quantisation config would quantise router '{}' ({}); routers are kept BF16 "
                    "(the exclude list probably forgot mlp.gate)", module, quant_scheme_name(s));
    });
    return QuantScheme::none;
  }
  return s;
}

std::vector<ExpectedTensor> expected_tensors(const ModelConfig& c, const QuantConfig& q) {
  Builder b(c, q);
  const std::string& P = c.tensor_prefix;
  const int64_t H = c.hidden_size;
  b.plain(P + "embed_tokens.weight", Shape{c.vocab_size, H}, role::kEmbedding, -1);

  // The main layers, then the MTP head's (full attention, the main layers' FFN).
  for (int l = 0; l < c.num_layers + c.mtp_num_layers; ++l) {
    const std::string L = layer_prefix(c, l);
    const bool mtp = l >= c.num_layers;
    if (mtp && l == c.num_layers) {
      b.linear("mtp.fc", H, 2 * H, role::kMtpFc, l);
      b.plain("mtp.pre_fc_norm_embedding.weight", Shape{H}, role::kNorm, l);
      b.plain("mtp.pre_fc_norm_hidden.weight", Shape{H}, role::kNorm, l);
      b.plain("mtp.norm.weight", Shape{H}, role::kNorm, l);
    }
    b.plain(L + "input_layernorm.weight", Shape{H}, role::kNorm, l);
    b.plain(L + "post_attention_layernorm.weight", Shape{H}, role::kNorm, l);

    if (mtp || c.layer_types[l] == LayerType::full_attention) {
      const int64_t D = c.head_dim, nq = c.num_attention_heads, nkv = c.num_kv_heads;
      const std::string A = L + "self_attn.";
      b.linear(A + "q_proj", nq * D * (c.attn_output_gate ? 2 : 1), H, role::kAttention, l, -1, c.attention_bias);
      b.linear(A + "k_proj", nkv * D, H, role::kAttention, l, -1, c.attention_bias);
      b.linear(A + "v_proj", nkv * D, H, role::kAttention, l, -1, c.attention_bias);
      b.linear(A + "o_proj", H, nq * D, role::kAttention, l, -1, c.attention_bias);
      b.plain(A + "q_norm.weight", Shape{D}, role::kNorm, l);
      b.plain(A + "k_norm.weight", Shape{D}, role::kNorm, l);
      if (q.kv_cache_fp8()) {
        b.plain(A + "k_proj.k_scale", Shape{}, role::kKvScale, l, kF32);
        b.out.back().optional = true;
        b.out.back().params = 0;
        b.plain(A + "v_proj.v_scale", Shape{}, role::kKvScale, l, kF32);
        b.out.back().optional = true;
        b.out.back().params = 0;
      }
    } else {
      const int64_t hk = c.linear_num_key_heads, hv = c.linear_num_value_heads;
      const int64_t key_dim = hk * c.linear_key_head_dim, value_dim = hv * c.linear_value_head_dim;
      const int64_t conv_dim = 2 * key_dim + value_dim;
      const std::string G = L + "linear_attn.";
      if (c.arch == Arch::qwen3_next) {
        // Fused projections, rows interleaved per key-head group: [q | k | v(group) | z(group)] and [b | a].
        b.linear(G + "in_proj_qkvz", 2 * key_dim + 2 * value_dim, H, role::kLinearAttention, l);
        b.linear(G + "in_proj_ba", 2 * hv, H, role::kLinearAttention, l);
      } else {
        b.linear(G + "in_proj_qkv", conv_dim, H, role::kLinearAttention, l);
        b.linear(G + "in_proj_z", value_dim, H, role::kLinearAttention, l);
        b.linear(G + "in_proj_b", hv, H, role::kLinearAttention, l);
        b.linear(G + "in_proj_a", hv, H, role::kLinearAttention, l);
      }
      b.plain(G + "conv1d.weight", Shape{conv_dim, 1, c.linear_conv_kernel}, role::kLinearAttention, l);
      b.plain(G + "A_log", Shape{hv}, role::kLinearAttention, l);
      b.plain(G + "dt_bias", Shape{hv}, role::kLinearAttention, l);
      b.plain(G + "norm.weight", Shape{c.linear_value_head_dim}, role::kNorm, l);
      b.linear(G + "out_proj", H, value_dim, role::kLinearAttention, l);
    }

    const std::string M = L + "mlp.";
    if (c.layer_is_moe(l)) {
      const int64_t E = c.num_experts, I = c.moe_intermediate_size;
      b.linear(M + "gate", E, H, role::kRouter, l);
      // Quantised experts are stored per expert whatever the BF16 layout would be.
      const bool experts_quantised = effective_scheme(c, q, M + "experts.0.gate_proj") != QuantScheme::none;
      const ExpertLayout layout = mtp ? c.mtp_expert_layout : c.expert_layout;
      if (experts_quantised || layout == ExpertLayout::per_expert) {
        for (int e = 0; e < E; ++e) {
          const std::string X = M + "experts." + std::to_string(e) + ".";
          b.linear(X + "gate_proj", I, H, role::kRoutedExpert, l, e);
          b.linear(X + "up_proj", I, H, role::kRoutedExpert, l, e);
          b.linear(X + "down_proj", H, I, role::kRoutedExpert, l, e);
        }
      } else {
        b.plain(M + "experts.gate_up_proj", Shape{E, 2 * I, H}, role::kRoutedExpert, l);
        b.plain(M + "experts.down_proj", Shape{E, H, I}, role::kRoutedExpert, l);
      }
      if (c.shared_expert_intermediate_size > 0) {
        const int64_t S = c.shared_expert_intermediate_size;
        b.linear(M + "shared_expert.gate_proj", S, H, role::kSharedExpert, l);
        b.linear(M + "shared_expert.up_proj", S, H, role::kSharedExpert, l);
        b.linear(M + "shared_expert.down_proj", H, S, role::kSharedExpert, l);
        b.linear(M + "shared_expert_gate", 1, H, role::kRouter, l);
      }
    } else {
      const int64_t I = c.intermediate_size;
      b.linear(M + "gate_proj", I, H, role::kDenseMlp, l);
      b.linear(M + "up_proj", I, H, role::kDenseMlp, l);
      b.linear(M + "down_proj", H, I, role::kDenseMlp, l);
    }
  }
  b.plain(P + "norm.weight", Shape{H}, role::kNorm, -1);
  if (!c.tie_word_embeddings) b.linear("lm_head", c.vocab_size, H, role::kLmHead, -1);
  return std::move(b.out);
}

std::string detect_tensor_prefix(const Checkpoint& ckpt) {
  for (const char* p : {"model.language_model.", "model."})
    if (ckpt.has(std::string(p) + "embed_tokens.weight")) return p;
  for (const char* p : {"model.language_model.", "model."}) {
    const std::string layers = std::string(p) + "layers.";
    auto it = ckpt.tensors().lower_bound(layers);
    if (it != ckpt.tensors().end() && it->first.starts_with(layers)) return p;
  }
  fail("{}: cannot tell the tensor prefix: no model.language_model.embed_tokens.weight or "
       "model.embed_tokens.weight (is this a Qwen checkpoint?)", ckpt.dir().display_path());
}

namespace {

// The problems of `ckpt` against `expected` (missing, wrong dtype, wrong shape); counts matches into `report`.
std::vector<std::string> check_tensors(const Checkpoint& ckpt, const std::vector<ExpectedTensor>& expected,
                                       VerifyReport& report) {
  std::vector<std::string> problems;
  auto shape_matches = [](const Shape& want, const Shape& got) {
    if (want.ndim == 0) return got.numel() == 1 && got.ndim <= 1;  // scalar: [] or [1]
    return want == got;
  };
  for (const auto& t : expected) {
    const TensorInfo* got = ckpt.find(t.name);
    if (!got) {
      if (t.optional) ++report.optional_missing;
      else problems.push_back(fmt::format("missing {} ({} {})", t.name, dtype_name(t.dtypes[0]), t.shape.str()));
      continue;
    }
    bool ok = true;
    if (std::find(t.dtypes.begin(), t.dtypes.end(), got->dtype) == t.dtypes.end()) {
      std::string want;
      for (DType d : t.dtypes) want += (want.empty() ? "" : " or ") + std::string(dtype_name(d));
      problems.push_back(fmt::format("{}: dtype {}, expected {}", t.name, dtype_name(got->dtype), want));
      ok = false;
    }
    if (!shape_matches(t.shape, got->shape)) {
      problems.push_back(fmt::format("{}: shape {}, expected {}", t.name, got->shape.str(), t.shape.str()));
      ok = false;
    }
    if (ok) ++report.matched;
  }
  return problems;
}

}  // namespace

std::vector<ExpectedTensor> expected_vision_tensors(const ModelConfig& config, const std::string& prefix) {
  const VisionConfig& v = config.vision;
  const int64_t h = v.hidden_size, inter = v.intermediate_size, merged = v.merged_hidden();
  std::vector<ExpectedTensor> out;
  auto add = [&](const std::string& name, Shape shape, int layer) {
    out.push_back({.name = prefix + name, .dtypes = kFloat, .shape = shape, .role = role::kVision, .layer = layer,
                   .params = shape.numel()});
  };
  auto linear = [&](const std::string& module, int64_t n_out, int64_t k_in, int layer) {
    add(module + ".weight", Shape{n_out, k_in}, layer);
    add(module + ".bias", Shape{n_out}, layer);
  };
  add("patch_embed.proj.weight", Shape{h, v.in_channels, v.temporal_patch_size, v.patch_size, v.patch_size}, -1);
  add("patch_embed.proj.bias", Shape{h}, -1);
  add("pos_embed.weight", Shape{v.num_position_embeddings, h}, -1);
  for (int i = 0; i < v.depth; ++i) {
    const std::string b = "blocks." + std::to_string(i) + ".";
    for (const char* norm : {"norm1", "norm2"}) {
      add(b + norm + ".weight", Shape{h}, i);
      add(b + norm + ".bias", Shape{h}, i);
    }
    linear(b + "attn.qkv", 3 * h, h, i);
    linear(b + "attn.proj", h, h, i);
    linear(b + "mlp.linear_fc1", inter, h, i);
    linear(b + "mlp.linear_fc2", h, inter, i);
  }
  add("merger.norm.weight", Shape{h}, -1);
  add("merger.norm.bias", Shape{h}, -1);
  linear("merger.linear_fc1", merged, merged, -1);
  linear("merger.linear_fc2", v.out_hidden_size, merged, -1);
  return out;
}

std::string detect_vision_prefix(const Checkpoint& ckpt) {
  for (const char* p : {"model.visual.", "visual."})
    if (ckpt.has(std::string(p) + "patch_embed.proj.weight")) return p;
  return "";
}

std::string verify_vision_tensors(const Checkpoint& ckpt, const ModelConfig& config) {
  const std::string where = ckpt.dir().display_path();
  if (!config.has_vision) {
    if (!config.vision_problem.empty())
      fail("{}: images are not supported with this checkpoint: config.json vision_config: {}", where,
           config.vision_problem);
    fail("{}: images are not supported with this checkpoint: config.json has no vision_config (model_type {})", where,
         config.model_type);
  }
  const std::string prefix = detect_vision_prefix(ckpt);
  if (prefix.empty())
    fail("{}: config.json describes a vision tower but the checkpoint holds none (no model.visual.patch_embed.proj."
         "weight): use the full multimodal checkpoint, or serve text only", where);
  VerifyReport report;
  const std::vector<std::string> problems = check_tensors(ckpt, expected_vision_tensors(config, prefix), report);
  if (!problems.empty()) {
    std::string msg = fmt::format("{}: the vision tower does not match config.json's vision_config: {} problem{}",
                                  where, problems.size(), problems.size() == 1 ? "" : "s");
    const size_t shown = std::min<size_t>(problems.size(), 20);
    for (size_t i = 0; i < shown; ++i) msg += "\n  - " + problems[i];
    if (problems.size() > shown) msg += fmt::format("\n  ... and {} more", problems.size() - shown);
    throw Error(msg);
  }
  return prefix;
}

VerifyReport verify_checkpoint(const Checkpoint& ckpt, ModelConfig& config, const QuantConfig& quant) {
  config.tensor_prefix = detect_tensor_prefix(ckpt);
  std::string mtp_problem;
  if (config.mtp_num_layers > 0) {
    if (!ckpt.has("mtp.fc.weight")) {
      mtp_problem = fmt::format("config.json names {} MTP layer(s) (mtp_num_hidden_layers) but the checkpoint has no "
                                "mtp.fc.weight", config.mtp_num_layers);
    } else {
      const std::string M = layer_prefix(config, config.num_layers) + "mlp.experts.";
      if (ckpt.has(M + "gate_up_proj")) config.mtp_expert_layout = ExpertLayout::fused;
      else if (ckpt.has(M + "0.gate_proj.weight")) config.mtp_expert_layout = ExpertLayout::per_expert;
    }
  }
  for (int l = 0; l < config.num_layers; ++l) {
    if (!config.layer_is_moe(l)) continue;
    const std::string M = layer_prefix(config, l) + "mlp.experts.";
    if (ckpt.has(M + "gate_up_proj")) config.expert_layout = ExpertLayout::fused;
    else if (ckpt.has(M + "0.gate_proj.weight")) config.expert_layout = ExpertLayout::per_expert;
    break;
  }

  // The MTP head first, on its own: a head that does not match is left off (speculative decoding off), never a
  // reason to refuse the main model.
  VerifyReport report;
  if (config.mtp_num_layers > 0 && mtp_problem.empty()) {
    std::vector<ExpectedTensor> mtp_expected;
    for (auto& t : expected_tensors(config, quant))
      if (t.layer >= config.num_layers) mtp_expected.push_back(std::move(t));
    VerifyReport mtp_report;
    const std::vector<std::string> mtp_problems = check_tensors(ckpt, mtp_expected, mtp_report);
    if (!mtp_problems.empty())
      mtp_problem = fmt::format("the MTP head does not match config.json ({} problem{}; first: {})",
                                mtp_problems.size(), mtp_problems.size() == 1 ? "" : "s", mtp_problems.front());
  }
  if (!mtp_problem.empty()) {
    KILN_LOG_WARN("{}: {}; loading without it (no speculative decoding)", ckpt.dir().display_path(), mtp_problem);
    config.mtp_num_layers = 0;
    report.mtp_problem = mtp_problem;
  }

  const std::vector<ExpectedTensor> expected = expected_tensors(config, quant);
  std::vector<std::string> problems = check_tensors(ckpt, expected, report);
  std::unordered_map<std::string_view, const ExpectedTensor*> by_name;
  by_name.reserve(expected.size());
  for (const auto& t : expected) by_name.emplace(t.name, &t);

  std::vector<std::string> unexpected;
  const std::string layers = config.tensor_prefix + "layers.";
  for (const auto& [name, info] : ckpt.tensors()) {
    if (by_name.count(name)) continue;
    if (name.starts_with("model.visual.") || name.starts_with("visual.")) {
      ++report.ignored_vision;
    } else if (name.starts_with("mtp.") || name.starts_with("model.mtp.")) {
      ++report.ignored_mtp;
    } else {
      ++report.unexpected;
      if (name.starts_with(layers)) {
        const long layer = std::strtol(name.c_str() + layers.size(), nullptr, 10);
        if (layer >= config.num_layers) {
          problems.push_back(fmt::format("{}: layer {} but the config has {} layers (num_hidden_layers)", name, layer,
                                         config.num_layers));
          continue;
        }
      }
      unexpected.push_back(name);
    }
  }
  if (report.ignored_vision) KILN_LOG_INFO("ignoring {} vision-tower tensors (model.visual.*)", report.ignored_vision);
  if (report.ignored_mtp) KILN_LOG_INFO("ignoring {} MTP-head tensors (mtp.*)", report.ignored_mtp);
  for (size_t i = 0; i < unexpected.size() && i < 5; ++i) KILN_LOG_WARN("unused tensor in checkpoint: {}", unexpected[i]);
  if (unexpected.size() > 5) KILN_LOG_WARN("... and {} more unused tensors", unexpected.size() - 5);

  if (!problems.empty()) {
    std::string msg = fmt::format("{}: checkpoint does not match config.json ({}{}{}): {} problem{}",
                                  ckpt.dir().display_path(), arch_name(config.arch),
                                  quant.is_quantized() ? ", " : "", quant.quant_algo, problems.size(),
                                  problems.size() == 1 ? "" : "s");
    const size_t shown = std::min<size_t>(problems.size(), 20);
    for (size_t i = 0; i < shown; ++i) msg += "\n  - " + problems[i];
    if (problems.size() > shown) msg += fmt::format("\n  ... and {} more", problems.size() - shown);
    throw Error(msg);
  }
  return report;
}

}  // namespace kiln::format
