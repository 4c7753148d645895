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
  int64_t vocab = 300;
  int page_size = 4;
  // The reference runs the chunked delta rule for multi-token sequences (the CPU runner's prefill default), the
  // test always the recurrence: equal up to rounding, checked at delta_rule_tol.
  bool chunked_reference = false;
  double tol = 1e-5;             // fp32 paths: summation order is the only difference
  double delta_rule_tol = 1e-5;  // with chunked_reference: ~1e-4
};

// Runs every op of `test` and `reference` on the same random inputs; one OpCheck per op and variant. Resets both
// Ops' scratch; allocates (and keeps) a little persistent memory on each.
std::vector<OpCheck> compare_ops(model::Ops& test, model::Ops& reference, const OpCheckConfig& config);

// The startup check: compare_ops at a small shape (a few ms). Logs one summary line; throws kiln::Error naming the
// failing ops when any disagrees with the reference or produces NaN / inf.
void startup_op_check(model::Ops& test, model::Ops& reference);

}  // namespace kiln::backend
