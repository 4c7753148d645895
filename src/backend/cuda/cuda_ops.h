// The CUDA backend's model::Ops: the same interface as the CPU oracle (cpu/cpu_ops.h), with every tensor in
// device memory and F32 activations on the device. Weights are copied to the device once (place_weight) and read
// as stored (BF16 / F16 / F32, per-tensor FP8, NVFP4) by kernels that decode them in registers; accumulation is
// fp32 everywhere. With --dtype float32 (CudaOptions::dtype) results match the CPU backend to rounding (rel ~1e-6),
// not to a BF16 tolerance; with --dtype bfloat16 the tensor-core paths round their activation inputs to bf16 once
// (rel ~2^-9 per op; the op checks' budgets: op_check.h).
// CudaOps is the binding: it validates views, picks a kernel (by shape and CudaOptions) and launches it (the
// launchers: kernels.h, one .cu file per family). Device, stream, memory, graphs and the profiler are the
// CudaRuntime's (runtime.h). All work runs on its one stream; download() and max_abs() synchronise it, and CUDA
// errors surface there (or at the launch) as kiln::Error with the CUDA error string.
#pragma once
#include <memory>
#include <string>

#include "backend/cuda/cuda_options.h"
#include "backend/cuda/runtime.h"
#include "model/ops.h"

namespace kiln::cuda::ops {
struct DeltaGateArgs;  // kernels.h
struct DeltaNormArgs;
}  // namespace kiln::cuda::ops

namespace kiln::backend::cuda {

class WeightUploader;
struct UploadOptions;

class CudaOps final : public model::Ops {
 public:
  // Runs on options.device (< 0: probe_cuda_device()'s first supported one); throws kiln::Error with the probe's reason when there is none.
  explicit CudaOps(const CudaOptions& options = {});
  ~CudaOps() override;
  CudaOps(const CudaOps&) = delete;
  CudaOps& operator=(const CudaOps&) = delete;

  std::string name() const override { return "cuda"; }
  std::string describe() const override;

  TensorView allocate(DType dtype, Shape shape) override;
  TensorView place_weight(const TensorView& host) override;
  TensorView place_random(DType dtype, Shape shape, const model::RandomFill& fill) override;
  TensorView place_random_slice(DType dtype, const Shape& stored, const format::TensorSlice& slice,
                                const model::RandomFill& fill) override;
  // place_weight queues its copy (weight_upload.h); this waits for all of them.
  void finish_weights() override;
  // Staging buffers / threads of the weight copies (tests use small ones); finishes the copies queued so far.
  void set_weight_upload(const UploadOptions& options);
  TensorView scratch(DType dtype, Shape shape) override;
  void reset_scratch() override;
  ScratchMark scratch_mark() override;
  void scratch_release(const ScratchMark& mark) override;
  size_t scratch_peak_bytes() const override;
  TensorView upload(const void* host, DType dtype, Shape shape) override;
  void download(const TensorView& src, void* host) override;
  void fill_zero(TensorView t) override;
  void copy(const TensorView& src, TensorView dst) override;
  void copy_spans(std::span<const CopySpan> spans) override;
  float max_abs(const TensorView& x) override;

  bool graph_capture_begin() override;
  int graph_capture_end() override;
  bool graph_launch(int handle) override;
  void graph_reset() override;
  bool profile_begin() override;
  std::vector<model::OpTime> profile_end() override;
  void argmax_rows(const TensorView& logits, std::span<int32_t> ids) override;
  void argmax_rows_best(const TensorView& logits, std::span<int32_t> ids, std::span<float> values) override;
  // The same kernels, the ids left in device memory (its workspace from the step's scratch: capturable).
  void argmax_rows_into(const TensorView& logits, TensorView ids, int32_t id_offset) override;
  void sample_rows(const TensorView& logits, std::span<const model::RowSampling> rows,
                   std::span<int32_t> ids) override;

  void embedding(const TensorView& table, const TensorView& ids, TensorView out) override;
  void embedding_shard(const TensorView& table, const TensorView& ids, int64_t vocab_begin, TensorView out) override;
  // Over the rank's communicator (comm_cuda.h), enqueued on this Ops' stream.
  void all_reduce(TensorView x) override;
  void linear(const TensorView& x, const model::LinearWeight& w, TensorView out) override;
  void linear_multi(const TensorView& x, std::span<const model::LinearWeight* const> ws,
                    std::span<const TensorView> outs) override;
  void rms_norm(const TensorView& x, const TensorView& weight, float eps, model::NormKind kind,
                TensorView out) override;
  void add_rms_norm(TensorView hidden, const TensorView& y, const TensorView& weight, float eps, model::NormKind kind,
                    TensorView out) override;
  void gated_rms_norm(const TensorView& x, const TensorView& z, const TensorView& weight, float eps,
                      TensorView out) override;
  void rope(TensorView x, const TensorView& positions, int rotary_dim, double theta) override;
  void mrope(TensorView x, const TensorView& positions, int rotary_dim, double theta,
             const model::MRopeAxes& axes) override;
  void linear_gated_input(const TensorView& x, const TensorView& x2, model::InputAct act, const model::LinearWeight& w,
                          TensorView out) override;
  void qk_norm_rope(const TensorView& q_proj, const TensorView& k, bool gated, const TensorView& q_norm,
                    const TensorView& k_norm, float eps, model::NormKind kind, const TensorView& positions,
                    int rotary_dim, double theta, const model::MRopeAxes* axes, TensorView q_out, TensorView gate_out,
                    TensorView k_out) override;
  void scatter_rows(const TensorView& src, const TensorView& rows, TensorView dst) override;
  void add(const TensorView& a, const TensorView& b, TensorView out) override;
  void silu_mul(const TensorView& gate, const TensorView& up, TensorView out) override;
  void sigmoid_mul(const TensorView& x, const TensorView& g, TensorView out) override;
  void gather_rows(const TensorView& x, const TensorView& rows, TensorView out) override;

  // The vision encoder's ops (vision.h): attention_segments on tensor cores in mma_parts() bf16 parts where the
  // head size allows (any D % 4 == 0 up to 256), else (and with prefill_attention_tensor_cores off) on the CUDA cores.
  void layer_norm(const TensorView& x, const TensorView& weight, const TensorView& bias, float eps,
                  TensorView out) override;
  void gelu(const TensorView& x, model::GeluKind kind, TensorView out) override;
  void rope_cos_sin(TensorView x, const TensorView& cos, const TensorView& sin) override;
  void attention_segments(const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& cu_seqlens,
                          int64_t max_seqlen, float scale, TensorView out) override;
  void weighted_embedding(const TensorView& table, const TensorView& ids, const TensorView& weights,
                          TensorView out) override;

  void kv_store(const TensorView& k, const TensorView& v, model::KvLayerView cache,
                const model::StepLayout& step) override;
  void attention(const TensorView& q, model::KvLayerView cache, const model::StepLayout& step, float scale,
                 TensorView out) override;

  void causal_conv1d_silu(const TensorView& x, const TensorView& weight, TensorView conv_state,
                          const model::StepLayout& step, TensorView out) override;
  void delta_rule_gates(const TensorView& a, const TensorView& b, const TensorView& A_log,
                        const TensorView& dt_bias, TensorView g, TensorView beta) override;
  void gated_delta_rule_with_gates(const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& a,
                                   const TensorView& b, const TensorView& A_log, const TensorView& dt_bias,
                                   TensorView g, TensorView beta, TensorView state, const model::StepLayout& step,
                                   model::DeltaRuleMode mode, TensorView out) override;
  // Fused decode ops (the default), recurrent steps of <= 8 sequences, Dk and Dv <= 128: the norm inside the delta
  // rule's kernel (one block per head); otherwise the two ops.
  void gated_delta_rule_norm(const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& a,
                             const TensorView& b, const TensorView& A_log, const TensorView& dt_bias, TensorView g,
                             TensorView beta, TensorView state, const model::StepLayout& step, model::DeltaRuleMode mode,
                             const TensorView& z, const TensorView& norm_weight, float eps, TensorView core,
                             TensorView out) override;
  void gated_delta_rule(const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& g,
                        const TensorView& beta, TensorView state, const model::StepLayout& step,
                        model::DeltaRuleMode mode, TensorView out) override;
  // BF16 with CudaOptions::recurrent_state_bf16, else F32; the delta rule ops take a state of either.
  DType recurrent_state_dtype() const override;

  void moe_route(const TensorView& logits, int top_k, bool renormalise, TensorView expert_ids,
                 TensorView weights) override;
  void moe_experts_shared(const TensorView& x, const TensorView& expert_ids, const TensorView& weights,
                          std::span<const model::ExpertWeights> experts, TensorView shared,
                          const TensorView& shared_gate, TensorView out) override;
  void moe_experts(const TensorView& x, const TensorView& expert_ids, const TensorView& weights,
                   std::span<const model::ExpertWeights> experts, TensorView out) override;
  // Decode-sized steps (CudaOptions::moe_decode_fused, NVFP4 experts): routing and experts in two kernels; else
  // moe_route then moe_experts(_shared).
  void moe_route_experts(const TensorView& x, const TensorView& logits, int top_k, bool renormalise,
                         std::span<const model::ExpertWeights> experts, TensorView shared,
                         const TensorView& shared_gate, TensorView expert_ids, TensorView weights,
                         TensorView out) override;
  // Steps of 1-4 tokens (CudaOptions::moe_block_persistent, BF16 router and shared expert, NVFP4 experts): the whole
  // block in one persistent kernel (moe_block_decode.cu), with the residual step `pre` folded in when given; else
  // false.
  bool moe_block(const TensorView& x, const model::ResidualNorm* pre, const model::LinearWeight& router,
                 const model::LinearWeight& shared_gate_proj, const model::LinearWeight& shared_up_proj,
                 const model::LinearWeight& shared_down_proj, const model::LinearWeight& shared_expert_gate,
                 std::span<const model::ExpertWeights> experts, int top_k, bool renormalise, TensorView out) override;

  // Decode steps of 1-4 sequences of one token (CudaOptions::deltanet_block_persistent, dense BF16 projections, Dk =
  // Dv = 64 or 128, conv kernel 4): the whole mixer in one persistent kernel (deltanet_block_decode.cu); else false.
  bool deltanet_block(const model::ResidualNorm& in, const DeltaNetBlockWeights& w, TensorView conv_state,
                      TensorView state, const model::StepLayout& step, float eps, TensorView out) override;

  // Waits for all queued work (and reports any CUDA error it raised).
  void synchronize();
  const CudaDeviceProbe& device() const;
  size_t weight_bytes() const;  // device memory held by placed weights
  size_t persistent_bytes() const;  // device memory from allocate() (KV pool, state slots)
  size_t scratch_bytes() const;     // the per-step scratch arena
  int graphs() const;               // captured step graphs alive
  // The device (index, name, memory) with the weight and scratch bytes held; the runner adds KV and state.
  std::optional<model::DeviceMemory> device_memory() const override;

 private:
  struct Impl;
  // gated_delta_rule with g / beta computed in the recurrent kernel when raw_gates is given, and each head's gated
  // output norm written by the same kernel when norm is.
  void run_delta_rule(const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& g,
                      const TensorView& beta, TensorView state, const model::StepLayout& step, model::DeltaRuleMode mode,
                      TensorView out, const ::kiln::cuda::ops::DeltaGateArgs* raw_gates,
                      const ::kiln::cuda::ops::DeltaNormArgs* norm = nullptr);
  // The raw gate inputs of gated_delta_rule_with_gates, checked, for the recurrent kernel.
  static ::kiln::cuda::ops::DeltaGateArgs delta_gate_args(const TensorView& a, const TensorView& b,
                                                          const TensorView& A_log, const TensorView& dt_bias,
                                                          const TensorView& g, const TensorView& beta);
  bool delta_rule_chunked(const model::StepLayout& step, model::DeltaRuleMode mode) const;
  // moe_experts with an optional gated shared-expert output folded into the combine (both pointers or neither).
  void run_moe_experts(const TensorView& x, const TensorView& expert_ids, const TensorView& weights,
                       std::span<const model::ExpertWeights> experts, const float* shared, const float* shared_gate,
                       TensorView out);
  std::unique_ptr<Impl> impl_;
  std::unique_ptr<WeightUploader> uploader_;  // after impl_: gone before the memory it copies into
};

}  // namespace kiln::backend::cuda
