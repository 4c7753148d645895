// Tensor / expert parallelism as host arithmetic: for a model config, a TP size N and an EP size M (M divides N),
// which heads, rows, columns and experts each of the N ranks holds. One code path for the planner (`kiln inspect
// --tp N`, capacity.h) and the loader (model::WeightBinder slices each tensor by slice_tensor()), so what inspect
// prints is what a rank allocates.
//
// The split (SGLang / vLLM's for Qwen3-Next / Qwen3.5, REFERENCE.md section 8):
//  - full attention: q_proj (q and gate rows per head) by query head; k_proj / v_proj by KV head, or one KV head per
//    rank replicated over N / kv_heads ranks when there are fewer KV heads than ranks; o_proj by input column
//    (row-parallel; its bias on rank 0 only); q_norm / k_norm replicated.
//  - Gated DeltaNet: in_proj_qkv and conv1d rows by head, the q, k and v sections each split (key heads like KV
//    heads: replicated when fewer than ranks); in_proj_z / b / a, A_log, dt_bias by value head; qwen3_next's fused
//    in_proj_qkvz / in_proj_ba per key-head group; out_proj by input column; the norm replicated. Conv and recurrent
//    state follow the heads (the rank's config has its local head counts).
//  - MoE: router and shared_expert_gate replicated; shared expert by intermediate over all N ranks; routed experts
//    whole over the M EP ranks (E / M each) and, within an EP rank's N / M ranks, by intermediate (down_proj by
//    input column: a slice keeps whole 16-element NVFP4 blocks). Rank r is EP rank r / (N / M) and MoE-TP rank
//    r % (N / M) (SGLang's order). Dense MLP by intermediate.
//  - embed_tokens and lm_head by vocabulary row, any vocabulary size: the first V % N ranks hold one row more (no
//    padding rows, so no padding id exists to sample); norms and KV scales replicated; scalar scales replicated.
//  - the MTP head: mtp.fc [H, 2H] replicated (small, read once per draft token); its decoder layer like a main
//    full-attention layer.
// Every block's partial outputs are summed by one all-reduce (model::Ops::all_reduce), the embedding's too.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "core/tensor.h"
#include "format/model_config.h"
#include "format/quant_config.h"
#include "format/weight_map.h"

namespace kiln::format {

struct Range {
  int64_t begin = 0;
  int64_t count = 0;
  int64_t end() const { return begin + count; }
  bool operator==(const Range&) const = default;
};

// What one rank holds, as ranges of the full model's heads / experts / rows.
struct RankShard {
  int rank = 0, tp = 1, ep = 1;
  int ep_rank = 0;      // rank / moe_tp
  int moe_tp = 1;       // tp / ep: ranks one routed expert's intermediate is split over
  int moe_tp_rank = 0;  // rank % moe_tp
  Range q_heads, kv_heads;         // full attention
  Range key_heads, value_heads;    // linear attention
  Range experts;                   // routed experts held (whole or sliced)
  Range expert_inter;              // the slice of each held expert's intermediate
  Range shared_inter, dense_inter; // shared expert / dense MLP intermediate
  Range vocab;                     // embedding and lm_head rows
};

struct ShardPlan {
  int tp = 1, ep = 1;
  std::vector<RankShard> ranks;
  int kv_replicas = 1;        // ranks holding the same KV head (N / kv_heads when kv_heads < N)
  int key_head_replicas = 1;  // the same for linear-attention key heads
  std::vector<std::string> notes;  // what is replicated, for the startup summary and inspect
};

// Plans the shards of `config` (and checks every expected tensor of `quant`'s layout slices cleanly) for tp ranks
// with ep expert-parallel groups. kiln::Error naming the numbers when tp or ep does not divide the heads, experts or
// intermediate sizes, or when a column split would cut an NVFP4 block.
ShardPlan plan_shards(const ModelConfig& config, const QuantConfig& quant, int tp, int ep = 1);
// The same over a given tensor list (expected_tensors(config, quant)).
ShardPlan plan_shards(const ModelConfig& config, const std::vector<ExpectedTensor>& tensors, int tp, int ep = 1);

// The config a rank runs with: its local head counts and intermediate sizes (the runner sizes the KV cache and the
// recurrent / conv state from them). vocab_size and num_experts stay the full model's (token ids and router).
ModelConfig rank_config(const ModelConfig& full, const RankShard& rank);

// How one stored tensor is cut for one rank. The tensor is seen as [outer..., split dim, inner...] with
// split_dim 0 (most tensors) or 1 (BF16 fused experts [E, R, K], where `outer` is the experts range on dim 0).
struct TensorSlice {
  bool held = true;        // false: the rank holds none of it (another EP rank's expert; a row-parallel bias off rank 0)
  int split_dim = 0;
  Range outer;             // split_dim 1: the dim-0 range (count 0 with split_dim 0)
  std::vector<Range> rows; // ranges of split_dim, concatenated in this order; empty: all of it
  int col_parts = 1;       // the last dim cut into col_parts equal parts, of which the rank keeps col_part
  int col_part = 0;
  Shape shape;             // the rank's shape (the stored shape when whole)
  bool whole() const { return held && rows.empty() && col_parts == 1 && outer.count == 0; }
};

// The slice of `t` (as listed by expected_tensors of the full config) that `rank` holds; `stored` is its shape as
// stored (scalars may be [] or [1]). kiln::Error when a column split does not divide (an NVFP4 block would be cut).
TensorSlice slice_tensor(const ModelConfig& full, const RankShard& rank, const ExpectedTensor& t, const Shape& stored);

// Element index in the full tensor (row-major over `stored`) of the slice's element `i` (row-major over
// slice.shape). For synthetic (dummy) weights: a rank's slice is the slice of the same full random tensor.
int64_t slice_source_index(const TensorSlice& slice, const Shape& stored, int64_t i);

// The same index map as loops, for filling a synthetic slice on a device: local element
// i = (((o * split_local + j) * mid + m) * last_local + c) comes from full element
// (((outer_begin + o) * split_full + split_source(j)) * mid + m) * last_full + last_begin + c, where split_source(j)
// walks `rows` (empty: j itself).
struct SliceLoops {
  int64_t outer_begin = 0, split_full = 1, split_local = 1, mid = 1, last_full = 1, last_local = 1, last_begin = 0;
  int64_t outer_local = 1;  // o's range (the slice's own loops; a device fill takes o from i)
  std::vector<Range> rows;
};
SliceLoops slice_loops(const TensorSlice& slice, const Shape& stored);

// Copies the slice's elements from `full` (row-major `stored`, elem_size bytes each) into `out`
// (slice.shape.numel() * elem_size bytes). elem_size 1 for NVFP4 packed bytes / E4M3 scales: a column part of a
// packed [N, K/2] tensor is whole bytes.
void copy_slice(const TensorSlice& slice, const Shape& stored, size_t elem_size, const void* full, void* out);

}  // namespace kiln::format
