#include "format/shard_plan.h"

#include <algorithm>
#include <cstring>
#include <string_view>

#include <fmt/format.h>

#include "core/error.h"

namespace kiln::format {
namespace {

std::string sizes_hint(int tp, int ep) {
  return ep > 1 ? fmt::format("--tp-size {} --ep-size {}", tp, ep) : fmt::format("--tp-size {}", tp);
}

// Heads split evenly over tp ranks, or (fewer heads than ranks) one head per rank shared by tp / heads ranks.
Range heads_of(int64_t heads, int tp, int rank, bool may_replicate, const char* what, int ep) {
  if (heads <= 0) return {};
  if (heads % tp == 0) return {rank * (heads / tp), heads / tp};
  if (may_replicate && tp % heads == 0) return {rank / (tp / heads), 1};
  fail("{}: {} {} do not split over {} ranks{} (use a size that divides {})", sizes_hint(tp, ep), heads, what, tp,
       may_replicate ? fmt::format(" and {} is not a multiple of {}", tp, heads) : std::string(), heads);
}

Range even_part(int64_t total, int parts, int part, const char* what, int tp, int ep) {
  if (total <= 0) return {};
  if (total % parts)
    fail("{}: {} {} do not split over {} ranks (use a size that divides {})", sizes_hint(tp, ep), total, what, parts,
         total);
  return {part * (total / parts), total / parts};
}

// Vocabulary rows over tp ranks for any vocabulary size: the first V % tp ranks hold one row more. No rank holds a
// padding row, so no padding id can ever be sampled; the logits of a row are the ranks' slices side by side.
Range vocab_part(int64_t vocab, int tp, int rank, int ep) {
  if (vocab < tp)
    fail("{}: {} vocabulary rows cannot be spread over {} ranks (every rank needs at least one)", sizes_hint(tp, ep),
         vocab, tp);
  const int64_t base = vocab / tp, extra = vocab % tp;
  return {rank * base + std::min<int64_t>(rank, extra), base + (rank < extra ? 1 : 0)};
}

const char* const kSuffixes[] = {".weight_scale_2", ".input_scale", ".weight_scale", ".weight", ".bias", ".k_scale",
                                 ".v_scale"};

}  // namespace

ShardPlan plan_shards(const ModelConfig& c, const QuantConfig& quant, int tp, int ep) {
  return plan_shards(c, tp > 1 ? expected_tensors(c, quant) : std::vector<ExpectedTensor>{}, tp, ep);
}

ShardPlan plan_shards(const ModelConfig& c, const std::vector<ExpectedTensor>& tensors, int tp, int ep) {
  if (tp < 1) fail("--tp-size must be at least 1 (got {})", tp);
  if (ep < 1) fail("--ep-size must be at least 1 (got {})", ep);
  if (tp % ep) fail("--ep-size {} must divide --tp-size {} (expert-parallel groups are made of tensor-parallel ranks)",
                    ep, tp);
  if (ep > 1 && !c.is_moe()) fail("--ep-size {}: this model has no routed experts (use --ep-size 1)", ep);
  ShardPlan p;
  p.tp = tp;
  p.ep = ep;
  bool has_dense = false;
  for (int l = 0; l < c.num_layers; ++l) has_dense |= !c.layer_is_moe(l);
  const bool has_full = c.num_full_attention_layers() > 0, has_linear = c.num_linear_attention_layers() > 0;
  for (int r = 0; r < tp; ++r) {
    RankShard s;
    s.rank = r;
    s.tp = tp;
    s.ep = ep;
    s.moe_tp = tp / ep;
    s.ep_rank = r / s.moe_tp;
    s.moe_tp_rank = r % s.moe_tp;
    if (has_full) {
      s.q_heads = heads_of(c.num_attention_heads, tp, r, false, "query heads", ep);
      s.kv_heads = heads_of(c.num_kv_heads, tp, r, true, "KV heads", ep);
      if (c.num_kv_heads > 0 && c.num_attention_heads % c.num_kv_heads)
        fail("{} query heads are not a multiple of {} KV heads", c.num_attention_heads, c.num_kv_heads);
    }
    if (has_linear) {
      s.value_heads = heads_of(c.linear_num_value_heads, tp, r, false, "linear-attention value heads", ep);
      s.key_heads = heads_of(c.linear_num_key_heads, tp, r, true, "linear-attention key heads", ep);
    }
    if (c.is_moe()) {
      s.experts = even_part(c.num_experts, ep, s.ep_rank, "routed experts (over the EP ranks)", tp, ep);
      s.expert_inter = even_part(c.moe_intermediate_size, s.moe_tp, s.moe_tp_rank,
                                 "moe_intermediate_size (over the ranks of one EP group)", tp, ep);
      if (c.shared_expert_intermediate_size > 0)
        s.shared_inter = even_part(c.shared_expert_intermediate_size, tp, r, "shared_expert_intermediate_size", tp, ep);
    }
    if (has_dense) s.dense_inter = even_part(c.intermediate_size, tp, r, "intermediate_size (dense MLP)", tp, ep);
    s.vocab = vocab_part(c.vocab_size, tp, r, ep);
    p.ranks.push_back(s);
  }
  if (has_full && c.num_kv_heads < tp) {
    p.kv_replicas = tp / c.num_kv_heads;
    p.notes.push_back(fmt::format("KV heads: {} KV heads < tp {}: each GPU keeps a replica of one KV head "
                                  "(k_proj/v_proj and the KV cache replicated {}x)",
                                  c.num_kv_heads, tp, p.kv_replicas));
  }
  if (has_linear && c.linear_num_key_heads < tp) {
    p.key_head_replicas = tp / c.linear_num_key_heads;
    p.notes.push_back(fmt::format("linear attention: {} key heads < tp {}: each GPU keeps a replica of one key head "
                                  "(its q/k rows of in_proj_qkv and conv1d, replicated {}x)",
                                  c.linear_num_key_heads, tp, p.key_head_replicas));
  }
  if (tp > 1) {
    if (c.is_moe())
      p.notes.push_back(ep > 1 ? fmt::format("routed experts: {} per EP group ({} groups), {}", c.num_experts / ep, ep,
                                             tp == ep ? std::string("whole")
                                                      : fmt::format("each expert's intermediate split over the "
                                                                    "group's {} GPUs", tp / ep))
                               : fmt::format("routed experts: all {} on every GPU, each expert's intermediate split "
                                             "over {} GPUs", c.num_experts, tp));
    p.notes.push_back("replicated on every GPU: norms, routers (mlp.gate, shared_expert_gate)" +
                      std::string(has_linear ? ", linear-attention norm" : "") + ", scalar scales");
  }
  // Every kind of tensor of the checkpoint layout must slice cleanly on every rank (an NVFP4 block cut is found
  // here, before any weight is read). The cut does not depend on the layer (among layers of one kind) or the
  // expert, so one layer of each kind and expert 0 stand for the rest.
  if (tp > 1) {
    std::vector<int> first_of_kind;
    std::vector<std::pair<bool, bool>> kinds;
    for (int l = 0; l < c.num_layers; ++l) {
      const std::pair<bool, bool> k{c.layer_is_full_attention(l), c.layer_is_moe(l)};
      if (std::find(kinds.begin(), kinds.end(), k) == kinds.end()) {
        kinds.push_back(k);
        first_of_kind.push_back(l);
      }
    }
    for (const ExpectedTensor& t : tensors) {
      if (t.layer >= 0 && std::find(first_of_kind.begin(), first_of_kind.end(), t.layer) == first_of_kind.end())
        continue;
      if (t.expert > 0) continue;
      for (const RankShard& s : p.ranks) {
        RankShard all = s;  // expert 0 as if every rank held it
        all.experts = {0, c.num_experts};
        slice_tensor(c, all, t, t.shape);
      }
    }
  }
  return p;
}

ModelConfig rank_config(const ModelConfig& full, const RankShard& r) {
  ModelConfig c = full;
  if (r.tp == 1) return c;
  if (r.q_heads.count) c.num_attention_heads = static_cast<int>(r.q_heads.count);
  if (r.kv_heads.count) c.num_kv_heads = static_cast<int>(r.kv_heads.count);
  if (r.key_heads.count) c.linear_num_key_heads = static_cast<int>(r.key_heads.count);
  if (r.value_heads.count) c.linear_num_value_heads = static_cast<int>(r.value_heads.count);
  if (r.expert_inter.count) c.moe_intermediate_size = r.expert_inter.count;
  if (r.shared_inter.count) c.shared_expert_intermediate_size = r.shared_inter.count;
  if (r.dense_inter.count) c.intermediate_size = r.dense_inter.count;
  return c;
}

TensorSlice slice_tensor(const ModelConfig& c, const RankShard& r, const ExpectedTensor& t, const Shape& stored) {
  TensorSlice s;
  s.shape = stored;
  if (r.tp == 1) return s;
  std::string_view suffix;
  for (const char* x : kSuffixes)
    if (t.name.ends_with(x)) {
      suffix = x;
      break;
    }
  const std::string_view module = std::string_view(t.name).substr(0, t.name.size() - suffix.size());
  const bool scalar = suffix == ".weight_scale_2" || suffix == ".input_scale" || suffix == ".k_scale" ||
                      suffix == ".v_scale" || (suffix == ".weight_scale" && stored.ndim < 2) || stored.ndim == 0;
  const std::string& role = t.role;
  if (role == role::kRoutedExpert && t.expert >= 0 && (t.expert < r.experts.begin || t.expert >= r.experts.end())) {
    s.held = false;  // another EP rank's expert
    s.shape = Shape{0};
    return s;
  }
  if (scalar) return s;
  auto rows = [&](std::initializer_list<Range> rs) {
    for (const Range& x : rs) s.rows.push_back(x);
  };
  auto cols = [&](int parts, int part) {
    s.col_parts = parts;
    s.col_part = part;
  };
  auto is = [&](const char* m) { return module.ends_with(m); };
  // A row-parallel linear (o_proj, out_proj, down_proj): the ranks hold column parts of its inputs and their outputs
  // are summed, so its bias is held by rank 0 alone (added once to the sum).
  auto row_parallel = [&] {
    if (suffix == ".bias") s.held = r.rank == 0;
    else cols(r.tp, r.rank);
  };

  if (role == role::kEmbedding || role == role::kLmHead) {
    rows({r.vocab});
  } else if (role == role::kNorm || role == role::kRouter || role == role::kKvScale || role == role::kMtpFc) {
    return s;
  } else if (role == role::kAttention) {
    const int64_t D = c.head_dim;
    if (is(".q_proj")) {
      const int64_t per = D * (c.attn_output_gate ? 2 : 1);
      rows({{r.q_heads.begin * per, r.q_heads.count * per}});
    } else if (is(".k_proj") || is(".v_proj")) {
      rows({{r.kv_heads.begin * D, r.kv_heads.count * D}});
    } else if (is(".o_proj")) {
      row_parallel();
    } else {
      fail("{}: no tensor-parallel rule for this attention tensor", t.name);
    }
  } else if (role == role::kLinearAttention) {
    const int64_t Hk = c.linear_num_key_heads, Hv = c.linear_num_value_heads;
    const int64_t Dk = c.linear_key_head_dim, Dv = c.linear_value_head_dim;
    const Range& k = r.key_heads;
    const Range& v = r.value_heads;
    if (is(".in_proj_qkv") || module.ends_with(".conv1d")) {
      rows({{k.begin * Dk, k.count * Dk}, {Hk * Dk + k.begin * Dk, k.count * Dk}, {2 * Hk * Dk + v.begin * Dv, v.count * Dv}});
    } else if (is(".in_proj_z")) {
      rows({{v.begin * Dv, v.count * Dv}});
    } else if (is(".in_proj_b") || is(".in_proj_a") || is(".A_log") || is(".dt_bias")) {
      rows({v});
    } else if (is(".in_proj_qkvz") || is(".in_proj_ba")) {
      // Per key-head group g: qkvz [q_g (Dk) | k_g (Dk) | v_g (rv Dv) | z_g (rv Dv)], ba [b_g (rv) | a_g (rv)];
      // the rank keeps its key heads' groups, within each only its value heads.
      const int64_t rv = Hv / Hk;
      const bool qkvz = is(".in_proj_qkvz");
      const int64_t group = qkvz ? 2 * Dk + 2 * rv * Dv : 2 * rv;
      const int64_t vd = qkvz ? Dv : 1;
      for (int64_t g = k.begin; g < k.end(); ++g) {
        const int64_t vb = std::max(v.begin, g * rv), ve = std::min(v.end(), (g + 1) * rv);
        const int64_t base = g * group + (qkvz ? 2 * Dk : 0);
        if (qkvz) rows({{g * group, 2 * Dk}});
        rows({{base + (vb - g * rv) * vd, (ve - vb) * vd}, {base + rv * vd + (vb - g * rv) * vd, (ve - vb) * vd}});
      }
    } else if (is(".out_proj")) {
      row_parallel();
    } else {
      fail("{}: no tensor-parallel rule for this linear-attention tensor", t.name);
    }
  } else if (role == role::kSharedExpert || role == role::kDenseMlp) {
    const Range& inter = role == role::kSharedExpert ? r.shared_inter : r.dense_inter;
    if (is(".gate_proj") || is(".up_proj")) {
      rows({inter});
    } else if (is(".down_proj")) {
      row_parallel();
    } else {
      fail("{}: no tensor-parallel rule for this MLP tensor", t.name);
    }
  } else if (role == role::kRoutedExpert) {
    const Range& x = r.expert_inter;
    if (t.expert >= 0) {
      if (is(".gate_proj") || is(".up_proj")) rows({x});
      else if (is(".down_proj")) cols(r.moe_tp, r.moe_tp_rank);
      else fail("{}: no tensor-parallel rule for this expert tensor", t.name);
    } else if (module.ends_with("experts.gate_up_proj")) {
      s.split_dim = 1;
      s.outer = r.experts;
      rows({x, {c.moe_intermediate_size + x.begin, x.count}});
    } else if (module.ends_with("experts.down_proj")) {
      s.split_dim = 1;
      s.outer = r.experts;
      cols(r.moe_tp, r.moe_tp_rank);
    } else {
      fail("{}: no tensor-parallel rule for this expert tensor", t.name);
    }
  } else {
    fail("{}: no tensor-parallel rule for role '{}'", t.name, role);
  }

  // The local shape, and the checks that the cut is clean.
  KILN_CHECK(stored.ndim > s.split_dim, "{}: shape {} has no dim {}", t.name, stored.str(), s.split_dim);
  Shape local = stored;
  if (s.outer.count) local[0] = s.outer.count;
  if (!s.rows.empty()) {
    int64_t n = 0;
    for (const Range& x : s.rows) {
      KILN_CHECK(x.begin >= 0 && x.end() <= stored[s.split_dim], "{}: rows [{}, {}) outside {}", t.name, x.begin,
                 x.end(), stored.str());
      n += x.count;
    }
    local[s.split_dim] = n;
  }
  if (s.col_parts > 1) {
    KILN_CHECK(stored.ndim - 1 > s.split_dim || s.rows.empty(), "{}: column split of the row dim", t.name);
    const int64_t last = stored[stored.ndim - 1];
    const bool fp4 = t.dtypes.front() == DType::U8;
    const bool block_scale = suffix == ".weight_scale";
    const int64_t inputs = fp4 ? last * 2 : block_scale ? last * 16 : last;
    const int64_t per = inputs / s.col_parts;
    if (inputs % s.col_parts || ((fp4 || block_scale) && per % 16))
      fail("{}: its {} inputs do not split into {} parts{} ({}): use a size for which each rank keeps a multiple of "
           "{} inputs", module, inputs, s.col_parts,
           (fp4 || block_scale) ? fmt::format(" of whole 16-element NVFP4 blocks ({} inputs each would cut a block)",
                                              static_cast<double>(inputs) / s.col_parts)
                                : std::string(),
           sizes_hint(r.tp, r.ep), (fp4 || block_scale) ? 16 : 1);
    local[local.ndim - 1] = last / s.col_parts;
  }
  s.shape = local;
  return s;
}

namespace {

// The slice's loop sizes (SliceLoops without its rows).
SliceLoops loop_sizes(const TensorSlice& s, const Shape& stored) {
  SliceLoops L;
  if (stored.ndim == 0) return L;
  const int sd = s.split_dim;
  if (sd == 1) {
    L.outer_local = s.outer.count ? s.outer.count : stored.dims[0];
    L.outer_begin = s.outer.count ? s.outer.begin : 0;
  }
  L.split_full = stored.dims[sd];
  L.split_local = s.shape.dims[sd];
  const int last = stored.ndim - 1;
  if (last > sd && last < kMaxDims) {
    for (int d = sd + 1; d < last; ++d) L.mid *= stored.dims[d];
    L.last_full = stored.dims[last];
    L.last_local = s.shape.dims[last];
    L.last_begin = s.col_part * L.last_local;
  }
  return L;
}

// Full index of local split-dim row j.
int64_t split_source(const TensorSlice& s, int64_t j) {
  if (s.rows.empty()) return j;
  for (const Range& r : s.rows) {
    if (j < r.count) return r.begin + j;
    j -= r.count;
  }
  KILN_CHECK(false, "slice row out of range");
  return 0;
}

}  // namespace

SliceLoops slice_loops(const TensorSlice& s, const Shape& stored) {
  SliceLoops L = loop_sizes(s, stored);
  L.rows = s.rows;
  return L;
}

int64_t slice_source_index(const TensorSlice& s, const Shape& stored, int64_t i) {
  if (s.whole()) return i;
  const SliceLoops L = loop_sizes(s, stored);
  const int64_t c = i % L.last_local;
  int64_t rest = i / L.last_local;
  const int64_t m = rest % L.mid;
  rest /= L.mid;
  const int64_t j = rest % L.split_local;
  const int64_t o = rest / L.split_local;
  return (((L.outer_begin + o) * L.split_full + split_source(s, j)) * L.mid + m) * L.last_full + L.last_begin + c;
}

void copy_slice(const TensorSlice& s, const Shape& stored, size_t elem, const void* full, void* out) {
  const auto* src = static_cast<const char*>(full);
  auto* dst = static_cast<char*>(out);
  if (s.whole()) {
    std::memcpy(dst, src, static_cast<size_t>(stored.numel()) * elem);
    return;
  }
  const SliceLoops L = loop_sizes(s, stored);
  const size_t run = static_cast<size_t>(L.last_local) * elem;
  for (int64_t o = 0; o < L.outer_local; ++o)
    for (int64_t j = 0; j < L.split_local; ++j) {
      const int64_t row = ((L.outer_begin + o) * L.split_full + split_source(s, j)) * L.mid;
      for (int64_t m = 0; m < L.mid; ++m) {
        std::memcpy(dst, src + static_cast<size_t>((row + m) * L.last_full + L.last_begin) * elem, run);
        dst += run;
      }
    }
}

}  // namespace kiln::format
