#include "format/capacity.h"

#include <cmath>

#include "core/error.h"

namespace kiln::format {
namespace {

bool ends_with_any(const std::string& name, std::initializer_list<const char*> parts) {
  for (const char* p : parts)
    if (name.find(p) != std::string::npos) return true;
  return false;
}

// How the tensors of one role split over tp GPUs; collects notes about what is replicated.
class Splitter {
 public:
  Splitter(const ModelConfig& c, int tp) : c_(c), tp_(tp) {
    if (tp_ <= 1) return;
    // KV heads: split while tp <= kv heads; beyond, each GPU keeps (a replica of) one KV head.
    if (c.num_kv_heads % tp == 0) kv_div_ = tp;
    else if (tp % c.num_kv_heads == 0) {
      kv_div_ = c.num_kv_heads;
      notes.push_back(fmt::format("KV heads: {} KV heads < tp {}: each GPU keeps a replica of one KV head "
                                  "(k_proj/v_proj and the KV cache replicated {}x)",
                                  c.num_kv_heads, tp, tp / c.num_kv_heads));
    } else {
      kv_div_ = 1;
      notes.push_back(fmt::format("KV heads: {} KV heads do not split over tp {}: k_proj/v_proj and the KV cache are "
                                  "replicated on every GPU", c.num_kv_heads, tp));
    }
    q_split_ = c.num_attention_heads % tp == 0;
    if (!q_split_)
      notes.push_back(fmt::format("attention: {} query heads do not split over tp {}: q_proj/o_proj replicated",
                                  c.num_attention_heads, tp));
    const bool has_linear = c.num_linear_attention_layers() > 0;
    linear_split_ = !has_linear || (c.linear_num_key_heads % tp == 0 && c.linear_num_value_heads % tp == 0);
    if (!linear_split_)
      notes.push_back(fmt::format("linear attention: {} key / {} value heads do not split over tp {}: replicated "
                                  "(weights and recurrent state)", c.linear_num_key_heads, c.linear_num_value_heads, tp));
    shared_split_ = c.shared_expert_intermediate_size % tp == 0;
    if (!shared_split_ && c.shared_expert_intermediate_size > 0)
      notes.push_back(fmt::format("shared expert: intermediate size {} does not split over tp {}: replicated",
                                  c.shared_expert_intermediate_size, tp));
    dense_split_ = c.intermediate_size % tp == 0;
    bool has_dense = false;
    for (int l = 0; l < c.num_layers; ++l) has_dense |= !c.layer_is_moe(l);
    if (!dense_split_ && has_dense)
      notes.push_back(fmt::format("dense MLP: intermediate size {} does not split over tp {}: replicated",
                                  c.intermediate_size, tp));
    if (c.num_experts > 0 && c.num_experts % tp != 0)
      notes.push_back(fmt::format("routed experts: {} experts do not divide evenly over {} GPUs (the busiest GPU "
                                  "holds {})", c.num_experts, tp, (c.num_experts + tp - 1) / tp));
    notes.push_back("replicated on every GPU: norms, routers (mlp.gate, shared_expert_gate)" +
                    std::string(c.num_linear_attention_layers() ? ", linear-attention norm" : ""));
  }

  // Share of `t` that one GPU holds (the busiest one).
  double share(const ExpectedTensor& t) const {
    if (tp_ <= 1) return 1.0;
    const std::string& r = t.role;
    if (r == role::kRoutedExpert) return std::ceil(static_cast<double>(c_.num_experts) / tp_) / c_.num_experts;
    if (r == role::kEmbedding || r == role::kLmHead) return 1.0 / tp_;
    if (r == role::kAttention) {
      if (ends_with_any(t.name, {".k_proj.", ".v_proj."})) return 1.0 / kv_div_;
      return q_split_ ? 1.0 / tp_ : 1.0;
    }
    if (r == role::kLinearAttention) return linear_split_ ? 1.0 / tp_ : 1.0;
    if (r == role::kSharedExpert) return shared_split_ ? 1.0 / tp_ : 1.0;
    if (r == role::kDenseMlp) return dense_split_ ? 1.0 / tp_ : 1.0;
    return 1.0;  // norms, routers, kv scales
  }
  int kv_div() const { return kv_div_; }
  bool linear_split() const { return linear_split_; }

  std::vector<std::string> notes;

 private:
  const ModelConfig& c_;
  int tp_;
  int kv_div_ = 1;
  bool q_split_ = true, linear_split_ = true, shared_split_ = true, dense_split_ = true;
};

}  // namespace

CapacityPlan plan_capacity(const ModelConfig& c, const std::vector<ExpectedTensor>& tensors,
                           const CapacityOptions& opt, const Checkpoint* ckpt) {
  if (opt.tp < 1) fail("--tp must be at least 1, got {}", opt.tp);
  if (opt.gpu_mem_gib < 0) fail("--gpu-mem-gib must not be negative, got {}", opt.gpu_mem_gib);
  if (!(opt.mem_fraction_static > 0 && opt.mem_fraction_static <= 1))
    fail("--mem-fraction-static must be in (0, 1], got {}", opt.mem_fraction_static);
  if (opt.kv_dtype != DType::BF16 && opt.kv_dtype != DType::F8_E4M3 && opt.kv_dtype != DType::F16)
    fail("KV cache dtype {} is not supported (bf16 or fp8_e4m3)", dtype_name(opt.kv_dtype));

  CapacityPlan p;
  p.tp = opt.tp;
  p.sizes_from_checkpoint = ckpt != nullptr;
  Splitter split(c, opt.tp);
  const double expert_active_share = c.num_experts > 0 ? static_cast<double>(c.experts_per_tok) / c.num_experts : 0.0;

  double per_gpu = 0, decode = 0, decode_per_gpu = 0, active = 0;
  std::map<std::string, double> decode_by_role;
  for (const auto& t : tensors) {
    uint64_t bytes = t.nbytes();
    DType dtype = t.dtypes.front();
    if (ckpt)
      if (const TensorInfo* info = ckpt->find(t.name)) {
        bytes = info->nbytes;
        dtype = info->dtype;
      }
    p.params_total += t.params;
    p.weight_bytes += bytes;
    p.weight_bytes_by_dtype[dtype] += bytes;
    p.weight_bytes_by_role[t.role] += bytes;
    const double share = split.share(t);
    per_gpu += bytes * share;

    // One decode token reads: k of E routed experts, one embedding row, everything else whole.
    double read_share = 1.0;
    if (t.role == role::kRoutedExpert) {
      read_share = expert_active_share;
      active += t.params * expert_active_share;
    } else {
      active += t.params;
      if (t.role == role::kEmbedding) read_share = 1.0 / c.vocab_size;
    }
    decode += bytes * read_share;
    decode_by_role[t.role] += bytes * read_share;
    // Per GPU: its slice of what is read (routed experts assumed spread evenly: k/E of its share).
    decode_per_gpu += bytes * read_share * share;
  }
  p.params_active = std::llround(active);
  p.decode_bytes_per_token = std::llround(decode);
  p.decode_bytes_per_token_per_gpu = std::llround(decode_per_gpu);
  for (auto& [r, v] : decode_by_role) p.decode_bytes_by_role[r] = std::llround(v);
  p.weight_bytes_per_gpu = std::llround(per_gpu);

  // KV cache and recurrent state.
  const uint64_t kv_elem = dtype_size(opt.kv_dtype);
  const uint64_t full_layers = c.num_full_attention_layers();
  p.kv_bytes_per_token = full_layers * 2 * c.num_kv_heads * c.head_dim * kv_elem;
  p.kv_bytes_per_token_per_gpu = full_layers * 2 * (c.num_kv_heads / split.kv_div()) * c.head_dim * kv_elem;
  const uint64_t linear_layers = c.num_linear_attention_layers();
  if (linear_layers) {
    const uint64_t key_dim = uint64_t(c.linear_num_key_heads) * c.linear_key_head_dim;
    const uint64_t conv_dim = 2 * key_dim + uint64_t(c.linear_num_value_heads) * c.linear_value_head_dim;
    p.recurrent_state_bytes_per_layer =
        uint64_t(c.linear_num_value_heads) * c.linear_key_head_dim * c.linear_value_head_dim * 4;
    p.conv_state_bytes_per_layer = conv_dim * (c.linear_conv_kernel - 1) * opt.conv_state_bytes;
  }
  p.state_bytes_per_sequence = linear_layers * (p.recurrent_state_bytes_per_layer + p.conv_state_bytes_per_layer);
  p.state_bytes_per_sequence_per_gpu = split.linear_split() ? p.state_bytes_per_sequence / opt.tp : p.state_bytes_per_sequence;

  p.notes = split.notes;
  if (opt.gpu_mem_gib > 0) {
    const double gib = 1024.0 * 1024.0 * 1024.0;
    p.gpu_bytes = std::llround(opt.gpu_mem_gib * gib);
    p.static_budget_bytes = std::llround(opt.gpu_mem_gib * gib * opt.mem_fraction_static);
    p.activation_reserve_bytes = std::llround(opt.activation_reserve_gib * gib);
    p.kv_budget_bytes = static_cast<int64_t>(p.static_budget_bytes) - static_cast<int64_t>(p.weight_bytes_per_gpu) -
                        static_cast<int64_t>(p.activation_reserve_bytes);
    p.max_kv_tokens = p.kv_budget_bytes > 0 && p.kv_bytes_per_token_per_gpu > 0
                          ? p.kv_budget_bytes / static_cast<int64_t>(p.kv_bytes_per_token_per_gpu)
                          : 0;
  }
  return p;
}

}  // namespace kiln::format
