// The CPU backend: kiln's reference implementation of model::Ops (the oracle the CUDA backend is checked
// against). fp32 activations and accumulation; weights read as stored (BF16 / F16 / F32, per-tensor FP8,
// NVFP4 decoded per 16-element block inside the matmul loop: no dequantised copy). Parallel over
// kiln::ThreadPool::global(); the matmul inner loops use GCC vector extensions, compiled twice (baseline
// x86-64 and x86-64-v3 with AVX2/FMA) and picked at run time.
#pragma once
#include <memory>
#include <vector>

#include "backend/backend.h"
#include "core/tensor.h"
#include "model/ops.h"

namespace kiln::backend::cpu {

class CpuOps final : public model::Ops {
 public:
  CpuOps();
  ~CpuOps() override;

  std::string name() const override { return "cpu"; }
  std::string describe() const override;

  TensorView allocate(DType dtype, Shape shape) override;
  TensorView place_weight(const TensorView& host) override { return host; }
  TensorView scratch(DType dtype, Shape shape) override;
  void reset_scratch() override;
  ScratchMark scratch_mark() override;
  void scratch_release(const ScratchMark& mark) override;
  size_t scratch_peak_bytes() const override { return scratch_high_water_; }
  TensorView upload(const void* host, DType dtype, Shape shape) override;
  void download(const TensorView& src, void* host) override;
  void fill_zero(TensorView t) override;
  void copy(const TensorView& src, TensorView dst) override;
  float max_abs(const TensorView& x) override;

  void embedding(const TensorView& table, const TensorView& ids, TensorView out) override;
  void embedding_shard(const TensorView& table, const TensorView& ids, int64_t vocab_begin, TensorView out) override;
  void all_reduce(TensorView x) override;  // over the rank's communicator (host memory)
  void linear(const TensorView& x, const LinearWeight& w, TensorView out) override;
  void rms_norm(const TensorView& x, const TensorView& weight, float eps, NormKind kind, TensorView out) override;
  void gated_rms_norm(const TensorView& x, const TensorView& z, const TensorView& weight, float eps,
                      TensorView out) override;
  void rope(TensorView x, const TensorView& positions, int rotary_dim, double theta) override;
  void mrope(TensorView x, const TensorView& positions, int rotary_dim, double theta,
             const model::MRopeAxes& axes) override;
  void scatter_rows(const TensorView& src, const TensorView& rows, TensorView dst) override;
  void add(const TensorView& a, const TensorView& b, TensorView out) override;
  void silu_mul(const TensorView& gate, const TensorView& up, TensorView out) override;
  void sigmoid_mul(const TensorView& x, const TensorView& g, TensorView out) override;
  void gather_rows(const TensorView& x, const TensorView& rows, TensorView out) override;

  void kv_store(const TensorView& k, const TensorView& v, KvLayerView cache, const StepLayout& step) override;
  void attention(const TensorView& q, KvLayerView cache, const StepLayout& step, float scale,
                 TensorView out) override;

  void causal_conv1d_silu(const TensorView& x, const TensorView& weight, TensorView conv_state,
                          const StepLayout& step, TensorView out) override;
  void delta_rule_gates(const TensorView& a, const TensorView& b, const TensorView& A_log,
                        const TensorView& dt_bias, TensorView g, TensorView beta) override;
  void gated_delta_rule(const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& g,
                        const TensorView& beta, TensorView state, const StepLayout& step, DeltaRuleMode mode,
                        TensorView out) override;

  // The vision encoder's ops (cpu_vision.cpp).
  void layer_norm(const TensorView& x, const TensorView& weight, const TensorView& bias, float eps,
                  TensorView out) override;
  void gelu(const TensorView& x, GeluKind kind, TensorView out) override;
  void rope_cos_sin(TensorView x, const TensorView& cos, const TensorView& sin) override;
  void attention_segments(const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& cu_seqlens,
                          int64_t max_seqlen, float scale, TensorView out) override;
  void weighted_embedding(const TensorView& table, const TensorView& ids, const TensorView& weights,
                          TensorView out) override;

  void moe_route(const TensorView& logits, int top_k, bool renormalise, TensorView expert_ids,
                 TensorView weights) override;
  void moe_experts(const TensorView& x, const TensorView& expert_ids, const TensorView& weights,
                   std::span<const ExpertWeights> experts, TensorView out) override;

  // The argmax_rows rule (model::host_argmax) straight into ids: no copy (host memory is the device's).
  void argmax_rows_into(const TensorView& logits, TensorView ids, int32_t id_offset) override;

 private:
  std::vector<Buffer> persistent_;
  std::vector<Buffer> scratch_blocks_;
  size_t scratch_used_ = 0;      // bytes used in the last block
  size_t scratch_in_use_ = 0;      // bytes of live scratch views (all blocks)
  size_t scratch_high_water_ = 0;  // the most scratch_in_use_ since the last reset
};

// ---- kernels shared by the ops (cpu_linear.cpp, cpu_delta_rule.cpp), exposed for tests
// out[t, n] = sum_k x[t, k] * W[n, k] (+ bias[n]); x [T, K] contiguous, out [T, N] contiguous.
void linear_f32(const float* x, int64_t T, const LinearWeight& w, float* out);
// Decodes W's row `row`, columns [k0, k0 + n) into dst (fp32), exactly as the matmul reads it.
void decode_weight_row(const LinearWeight& w, int64_t row, int64_t k0, int64_t n, float* dst);
// Name of the matmul code path picked at run time ("x86-64-v3 (AVX2+FMA)" or "baseline x86-64").
const char* linear_kernel_name();

// Element of a float-typed view at flat contiguous index i, as f32.
float load_f32(const TensorView& t, int64_t i);

}  // namespace kiln::backend::cpu
