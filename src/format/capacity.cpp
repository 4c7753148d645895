#include "format/capacity.h"

#include <algorithm>
#include <cmath>

#include "core/error.h"
#include "format/shard_plan.h"

namespace kiln::format {

CapacityPlan plan_capacity(const ModelConfig& c, const std::vector<ExpectedTensor>& tensors,
                           const CapacityOptions& opt, const Checkpoint* ckpt) {
  if (opt.tp < 1) fail("--tp must be at least 1, got {}", opt.tp);
  if (opt.ep < 1 || opt.tp % opt.ep) fail("--ep {} must be at least 1 and divide --tp {}", opt.ep, opt.tp);
  if (opt.gpu_mem_gib < 0) fail("--gpu-mem-gib must not be negative, got {}", opt.gpu_mem_gib);
  if (!(opt.mem_fraction_static > 0 && opt.mem_fraction_static <= 1))
    fail("--mem-fraction-static must be in (0, 1], got {}", opt.mem_fraction_static);
  if (opt.kv_dtype != DType::BF16 && opt.kv_dtype != DType::F8_E4M3 && opt.kv_dtype != DType::F16)
    fail("KV cache dtype {} is not supported (bf16 or fp8_e4m3)", dtype_name(opt.kv_dtype));

  CapacityPlan p;
  p.tp = opt.tp;
  p.ep = opt.ep;
  p.sizes_from_checkpoint = ckpt != nullptr;
  // The same shard plan the loader slices by (format/shard_plan.h): kiln::Error when tp / ep do not divide.
  const ShardPlan plan = plan_shards(c, tensors, opt.tp, opt.ep);
  std::vector<double> rank_bytes(opt.tp, 0.0);
  std::map<std::string, std::vector<double>> parts_cache;
  auto rank_parts = [&](const ExpectedTensor& t, const Checkpoint* ck) -> const std::vector<double>& {
    std::string key = t.role + ":";
    for (char ch : t.name) {
      if (ch >= '0' && ch <= '9') {
        if (key.back() != '#') key += '#';
      } else {
        key += ch;
      }
    }
    const TensorInfo* info = ck ? ck->find(t.name) : nullptr;
    const Shape stored = info ? info->shape : t.shape;
    key += stored.str();
    auto it = parts_cache.find(key);
    if (it != parts_cache.end()) return it->second;
    std::vector<double> parts(opt.tp, 0.0);
    for (const RankShard& r : plan.ranks) {
      RankShard holds = r;  // whether the rank holds an expert is decided by the caller
      holds.experts = {0, c.num_experts};
      const TensorSlice sl = slice_tensor(c, holds, t, stored);
      parts[r.rank] = sl.held ? static_cast<double>(sl.shape.numel()) / std::max<int64_t>(1, stored.numel()) : 0.0;
    }
    return parts_cache.emplace(key, std::move(parts)).first->second;
  };
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
    // Each rank's slice of it (bytes in proportion to the elements it keeps); the average share for the decode
    // figure below.
    // The fractions do not depend on the layer index or the expert (beyond whether the rank holds it): cached by
    // the name with its numbers blanked.
    double share = 0;
    const std::vector<double>& parts = rank_parts(t, ckpt);
    for (const RankShard& r : plan.ranks) {
      const bool held = t.expert < 0 || (t.expert >= r.experts.begin && t.expert < r.experts.end());
      const double part = held ? parts[r.rank] : 0.0;
      rank_bytes[r.rank] += bytes * part;
      share += part / opt.tp;
    }

    // The MTP head is memory, not part of a (non-speculative) decode token's reads or active parameters.
    if (t.layer >= c.num_layers) {
      p.mtp_params += t.params;
      p.mtp_weight_bytes += bytes;
      continue;
    }
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
    // Per GPU, averaged over the ranks: its slice of what is read (routed experts: k/E of its share).
    decode_per_gpu += bytes * read_share * share;
  }
  p.params_active = std::llround(active);
  p.decode_bytes_per_token = std::llround(decode);
  p.decode_bytes_per_token_per_gpu = std::llround(decode_per_gpu);
  for (auto& [r, v] : decode_by_role) p.decode_bytes_by_role[r] = std::llround(v);
  for (double b : rank_bytes) per_gpu = std::max(per_gpu, b);
  p.weight_bytes_per_gpu = std::llround(per_gpu);  // the busiest rank

  // KV cache and recurrent state.
  const uint64_t kv_elem = dtype_size(opt.kv_dtype);
  // The MTP head's layers keep a KV cache in the same pages (model::Runner).
  const uint64_t full_layers = c.num_full_attention_layers() + c.mtp_num_layers;
  p.kv_bytes_per_token = full_layers * 2 * c.num_kv_heads * c.head_dim * kv_elem;
  const ModelConfig local = rank_config(c, plan.ranks[0]);  // every rank holds as many heads
  p.kv_bytes_per_token_per_gpu = full_layers * 2 * local.num_kv_heads * c.head_dim * kv_elem;
  const uint64_t linear_layers = c.num_linear_attention_layers();
  if (linear_layers) {
    const uint64_t key_dim = uint64_t(c.linear_num_key_heads) * c.linear_key_head_dim;
    const uint64_t conv_dim = 2 * key_dim + uint64_t(c.linear_num_value_heads) * c.linear_value_head_dim;
    p.recurrent_state_bytes_per_layer = uint64_t(c.linear_num_value_heads) * c.linear_key_head_dim *
                                        c.linear_value_head_dim * opt.recurrent_state_bytes;
    p.conv_state_bytes_per_layer = conv_dim * (c.linear_conv_kernel - 1) * opt.conv_state_bytes;
  }
  // With an MTP head the runner keeps a checkpoint of each slot's state for speculative verification: twice the state.
  const uint64_t state_copies = c.mtp_num_layers > 0 ? 2 : 1;
  p.state_bytes_per_sequence =
      state_copies * linear_layers * (p.recurrent_state_bytes_per_layer + p.conv_state_bytes_per_layer);
  if (linear_layers) {
    const uint64_t conv_local = (2 * uint64_t(local.linear_num_key_heads) * c.linear_key_head_dim +
                                 uint64_t(local.linear_num_value_heads) * c.linear_value_head_dim) *
                                (c.linear_conv_kernel - 1) * opt.conv_state_bytes;
    const uint64_t rec_local = uint64_t(local.linear_num_value_heads) * c.linear_key_head_dim *
                               c.linear_value_head_dim * opt.recurrent_state_bytes;
    p.state_bytes_per_sequence_per_gpu = state_copies * linear_layers * (conv_local + rec_local);
  }

  p.notes = plan.notes;
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
