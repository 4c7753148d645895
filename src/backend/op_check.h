// Op-by-op comparison of two model::Ops implementations on random inputs (the CUDA backend against the CPU
// oracle), used at startup (startup_op_check: refuse to serve on a GPU whose kernels disagree) and by the GPU tests
// (tests/unit/backend/cuda/, at several shapes). Only the Ops interface is used, so any backend pair works.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "model/ops.h"

namespace kiln::backend {

// One step's layout on the host (the op checks and the GPU tests build steps with it); layout_on() uploads it to a
// backend as a model::StepLayout (device tensors plus the host mirrors).
struct HostStep {
  std::vector<int32_t> token_pos, seq_begin{0}, seq_start, slot, page_table;
  int max_pages = 1, page_size = 4, max_seq_tokens = 0;
  // Position checkpoints (model::StepLayout::host_token_checkpoint_slot): per token, the slot that receives the state
  // after it, -1 for none; empty when the step keeps none.
  std::vector<int32_t> checkpoint_slot;
  // Sequence tokens [start, start + n) in state slot `state_slot`; `pages`: its page-table row (max_pages entries).
  void add_seq(int32_t start, int32_t n, int32_t state_slot, const std::vector<int32_t>& pages = {});
  int num_seqs() const { return static_cast<int>(seq_start.size()); }
  int64_t num_tokens() const { return static_cast<int64_t>(token_pos.size()); }
};
model::StepLayout layout_on(model::Ops& ops, const HostStep& h);

struct OpCheck {
  std::string op;          // "linear nvfp4 T=37 K=64 N=96"
  double rel_err = 0;      // ||test - ref|| / ||ref|| (absolute norm when ref is all zeros)
  double max_abs_err = 0;
  double tol = 0;          // rel_err must stay <= tol
  bool finite = true;      // no NaN / inf in the output under test
  int64_t mismatches = 0;  // integer outputs (expert ids) that differ
  bool passed() const { return finite && mismatches == 0 && rel_err <= tol; }
  std::string str() const;
};

struct OpCheckConfig {
  uint64_t seed = 1;
  int64_t hidden = 64;                          // K of the linears, H of the norms / experts (multiple of 16)
  int64_t out_features = 96;                    // N of the linears
  std::vector<int64_t> linear_rows = {1, 5, 37};  // T of the linear checks (<= 16: gemv path, above: gemm)
  std::vector<int> prefill_lens = {1, 6, 19};   // tokens per sequence in the first attention / delta-rule step
  int64_t q_heads = 4, kv_heads = 2, head_dim = 32;
  int rotary_dim = 16;
  int64_t k_heads = 2, v_heads = 4, k_dim = 16, v_dim = 32, conv_kernel = 4;
  int64_t experts = 8, top_k = 2, expert_inter = 32;
  // > 0: the routed experts also at a step of this many tokens, where a GPU backend takes its large-step expert path
  // (CUDA on sm_90 with --dtype bfloat16: the wgmma grouped GEMMs from 1024 tokens). The startup check sets 1024.
  int64_t large_step_rows = 0;
  int64_t vocab = 300;
  int page_size = 4;
  // The vision encoder's ops (layer_norm, gelu, rope_cos_sin, attention_segments, weighted_embedding) run at the
  // shapes above (rows [T, hidden], heads [T, q_heads, head_dim], prefill_lens plus an empty one as the attention's
  // segments); with vision_tower_shapes also at the Qwen3.5 vision tower's (hidden 1152, head_dim 72, segments of 1,
  // 0, 17, 300 and 1024 tokens, a 2304-row position table): slower (the reference's attention over 1024 keys), for
  // the GPU tests; the startup check keeps the small shapes.
  bool vision_tower_shapes = false;
  // The reference runs the chunked delta rule for multi-token sequences (the CPU runner's prefill default), the
  // test always the recurrence: equal up to rounding, checked at delta_rule_tol.
  bool chunked_reference = false;
  double tol = 1e-5;             // fp32 paths: summation order is the only difference
  double delta_rule_tol = 1e-5;  // with chunked_reference: ~1e-4
  // The ops a CUDA backend may run on tensor cores: dense BF16 and NVFP4 linears (tensor_core_linear_tol), NVFP4
  // routed experts, attention over bf16 / fp8 pools and attention within segments (tensor_core_tol). With --dtype float32 (x split into 3 bf16
  // parts) they are fp32 paths like the rest; with --dtype bfloat16 use_bf16_input_budgets() sets the budgets below.
  double tensor_core_linear_tol = 1e-5;
  double tensor_core_tol = 1e-5;
};

// rel-L2 budgets of the tensor-core ops when their activation inputs are rounded once to bf16 (--dtype bfloat16).
// Rounding to bf16 (8 significant bits) changes a value by at most 2^-8 relative and by ~2^-9 RMS (1.6e-3 for values
// spread over octaves). A dot product sum_k x_k w_k whose x_k are rounded is off by sum_k d_k x_k w_k with
// independent d_k, so its error relative to the product's size is that RMS again, whatever K: rel-L2 ~1.7e-3 over
// a layer's outputs (the weights are exact in bf16; accumulation is fp32). A CPU emulation of the harness's random
// inputs gives 1.63-1.69e-3 for K = 64 .. 4096 and NVFP4-shaped weights. The routed experts round twice in series
// (x, then silu(gate) * up): ~3.0e-3; attention rounds q and the softmax weights p: 1.9-3.1e-3 (19 to 4096 keys,
// head_dim 32 .. 256); attention within segments rounds k and v too (their fp32 values are the op's inputs). The budgets leave ~3x of that for the spread of small shapes; a wrong layout, a skipped tile
// or a missing scale is off by O(1) and still fails.
constexpr double kBf16InputLinearTol = 5e-3;
constexpr double kBf16InputTol = 1e-2;  // experts (two roundings in series), attention (q and p; segments: q, k, p, v)
// config with the tensor-core budgets of bf16 inputs (the other ops keep config.tol).
OpCheckConfig use_bf16_input_budgets(OpCheckConfig config);

// Runs every op of `test` and `reference` on the same random inputs; one OpCheck per op and variant. Resets both
// Ops' scratch; allocates (and keeps) a little persistent memory on each.
std::vector<OpCheck> compare_ops(model::Ops& test, model::Ops& reference, const OpCheckConfig& config);

// The harness's verdict on a list of checks: "" when there is at least one check and every one passed; otherwise
// what failed ("no op was checked" for an empty list, else "N of M op checks disagree (the first few)").
std::string op_check_failures(const std::vector<OpCheck>& results);

// The startup check: compare_ops at a small shape (a few ms). Logs one summary line; throws kiln::Error naming the
// failing ops (op_check_failures) when any disagrees with the reference or produces NaN / inf. bf16_inputs: the
// test backend runs --dtype bfloat16 (the tensor-core ops get use_bf16_input_budgets' tolerances; every other op
// keeps 1e-5).
void startup_op_check(model::Ops& test, model::Ops& reference, bool bf16_inputs = false);
// The configuration startup_op_check runs.
OpCheckConfig startup_op_check_config(bool bf16_inputs);

}  // namespace kiln::backend
