// CudaOps: shape checks, the kernel choice and the translation of TensorViews into the kernel launchers of
// kernels.h; memory, graphs and profiling go to the CudaRuntime. Compiled by the host compiler (it needs kiln's
// fmt-based headers; nvcc sees only the kernels).
#include "backend/cuda/cuda_ops.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <unordered_map>
#include <vector>

#include "backend/backend.h"
#include "backend/cuda/cuda_check.h"
#include "backend/cuda/blas_lt.h"
#include "backend/cuda/kernels.h"
#include "backend/cuda/deltanet_block_decode.h"
#include "backend/cuda/moe_block_decode.h"
#include "backend/cuda/moe_decode_fused.h"
#include "backend/cuda/moe_prefill_blas.h"
#include "backend/cuda/moe_prefill_wgmma.h"
#include "backend/cuda/step_args.h"
#include "backend/cuda/vision.h"
#include "backend/cuda/weight_upload.h"
#include "core/error.h"
#include "core/log.h"
#include "core/progress.h"
#include "format/shard_plan.h"

namespace kiln::backend::cuda {
namespace {

namespace kops = ::kiln::cuda::ops;
using ::kiln::cuda::DeviceBuffer;

// Dense BF16 linears with at least this many rows run on tensor cores (cuBLASLt, bf16 activations): below it
// the 8-row-tile gemv is faster (docs/perf/cuda-ops.md).
constexpr int64_t kBlasMinRows = 16;
constexpr int kDeltaGatesFusedMaxSeqs = 8;  // gated_delta_rule_with_gates: gates in the recurrent kernel up to here
// A step's sequence of fewer than kAttentionPrefillMinTokens tokens with more keys than this keeps the step's
// attention on the split-over-keys kernel (the prefill kernel would walk its context in one block).
constexpr int32_t kAttnPrefillMaxShortContext = 2048;
constexpr int32_t kChunkedDeltaMinTokens = 32;  // the chunked delta rule from this many tokens in one sequence
// Between 16 and 32 rows only large dense weights go to cuBLASLt: the split / GEMM / sum launches cost more than the
// bandwidth gemv (8-row tiles, later tiles' weights from L2) for the small ones (routers, gates, 2048 x 512); above
// 32 rows the gemv is the slower one.
constexpr int64_t kGemvMaxRowsSmallW = 32;
constexpr int64_t kBlasMinElemsFewRows = int64_t(4) << 20;
// A biased cuBLASLt linear runs in row blocks of at most this many rows: the vision tower of a large image (up to
// 65536 patches) would otherwise want 3 x 65536 x 4304 fp32 partial outputs (3.4 GB) at once. Text passes
// (--max-pass-tokens, 512 by default) stay below it.
constexpr int64_t kBlasBiasedMaxRows = 8192;
// --dtype bfloat16 (x rounded once to bf16, no split / sum around the GEMM): large weights go to cuBLASLt from this
// many rows. The gemv's time grows with the rows (it re-reads x per row from L1) while cuBLASLt's stays flat: bench_gemv
// on an H100 (docs/perf/decode-latency.md), 35B DeltaNet in-projection at 1 / 2 / 4 / 8 rows 20.9 / 23.9 / 35.7 /
// 54.9 us on the gemv, 21.3 / 22.2 / 21.9 / 22.2 us on cuBLASLt (the rounding included). In the engine 4 rows gained
// nothing (the weights that stay on the gemv cost one more launch) and 8 rows did: 35B batch-8 decode step 8.96 ->
// 7.64 ms.
constexpr int64_t kBlasMinRowsBf16 = 8;
bool blas_rows(int64_t T, int64_t N, int64_t K, bool bf16) {
  if (bf16 && T >= kBlasMinRowsBf16 && T < kBlasMinRows) return N * K >= kBlasMinElemsFewRows;
  return T >= kBlasMinRows && (T > kGemvMaxRowsSmallW || N * K >= kBlasMinElemsFewRows);
}

// A bias the cuBLASLt path adds after the GEMM (sum3_rows / add_row_bias): none, or [N] in F32, BF16 or F16 (any
// other bias stays on the fp32 kernels, whose desc_of checks it).
bool blas_bias_ok(const model::LinearWeight& w) {
  if (!w.bias.data) return true;
  return (w.bias.dtype == DType::F32 || w.bias.dtype == DType::BF16 || w.bias.dtype == DType::F16) &&
         w.bias.numel() == w.out_features;
}

// A linear that takes cuBLASLt (x in CudaOptions::mma_parts() bf16 parts) at T rows, with or without a bias.
bool blas_dense(const model::LinearWeight& w, int64_t T, bool bf16) {
  return w.format == model::WeightFormat::dense && w.weight.dtype == DType::BF16 && blas_bias_ok(w) &&
         blas_rows(T, w.out_features, w.in_features, bf16) && w.in_features % 8 == 0 && w.out_features % 4 == 0 &&
         reinterpret_cast<uintptr_t>(w.weight.data) % 16 == 0;
}

size_t align_up(size_t n) { return CudaRuntime::align_up(n); }

kops::ElemType elem_of(DType t, const char* what) {
  switch (t) {
    case DType::F32: return kops::ElemType::f32;
    case DType::BF16: return kops::ElemType::bf16;
    case DType::F16: return kops::ElemType::f16;
    case DType::F8_E4M3: return kops::ElemType::e4m3;
    default: fail("cuda backend: {} has dtype {} (F32, BF16, F16 or F8_E4M3 expected)", what, dtype_name(t));
  }
}

void expect_f32(const TensorView& t, const char* what) {
  KILN_CHECK(t.dtype == DType::F32, "{}: expected F32, got {}", what, dtype_name(t.dtype));
}
void expect_i32(const TensorView& t, const char* what) {
  KILN_CHECK(t.dtype == DType::I32, "{}: expected I32, got {}", what, dtype_name(t.dtype));
}
const float* f32(const TensorView& t) { return static_cast<const float*>(t.data); }
float* f32_mut(const TensorView& t) { return static_cast<float*>(t.data); }
const int32_t* i32(const TensorView& t) { return static_cast<const int32_t*>(t.data); }
// The element type of a bias blas_bias_ok accepted (F32 when there is none: not read).
kops::ElemType blas_bias_elem(const model::LinearWeight& w) {
  return w.bias.data ? elem_of(w.bias.dtype, "linear bias") : kops::ElemType::f32;
}

kops::WeightDesc desc_of(const LinearWeight& w) {
  KILN_CHECK(w.present(), "linear weight missing");
  KILN_CHECK(w.out_features <= INT32_MAX && w.in_features <= INT32_MAX, "linear weight [{}, {}] too large",
             w.out_features, w.in_features);
  kops::WeightDesc d;
  d.data = w.weight.data;
  d.scale = w.scale;
  d.n = static_cast<int32_t>(w.out_features);
  d.k = static_cast<int32_t>(w.in_features);
  switch (w.format) {
    case WeightFormat::dense:
      d.kind = kops::WeightKind::dense;
      d.elem = elem_of(w.weight.dtype, "dense linear weight");
      KILN_CHECK(d.elem != kops::ElemType::e4m3, "dense weight stored as F8_E4M3");
      KILN_CHECK(w.weight.numel() == w.out_features * w.in_features, "dense weight {} for [{}, {}]",
                 w.weight.shape.str(), w.out_features, w.in_features);
      break;
    case WeightFormat::fp8_tensor:
      KILN_CHECK(w.weight.dtype == DType::F8_E4M3, "fp8 weight dtype {}", dtype_name(w.weight.dtype));
      d.kind = kops::WeightKind::fp8_tensor;
      break;
    case WeightFormat::nvfp4:
      KILN_CHECK(w.weight.dtype == DType::U8 && w.block_scale.data && w.block_scale.dtype == DType::F8_E4M3 &&
                     w.in_features % 16 == 0,
                 "nvfp4 weight: codes {} scales {} K {}", dtype_name(w.weight.dtype), dtype_name(w.block_scale.dtype),
                 w.in_features);
      d.kind = kops::WeightKind::nvfp4;
      d.block_scale = static_cast<const uint8_t*>(w.block_scale.data);
      break;
  }
  if (w.bias.data) {
    KILN_CHECK(w.bias.numel() == w.out_features, "bias {} for N {}", w.bias.numel(), w.out_features);
    d.bias = w.bias.data;
    d.bias_elem = elem_of(w.bias.dtype, "linear bias");
  }
  return d;
}

bool desc_vec_ok(const kops::WeightDesc& d) {
  return d.k % 8 == 0 && reinterpret_cast<uintptr_t>(d.data) % 16 == 0;
}

}  // namespace

kops::StepArgs step_args(const StepLayout& step) {
  kops::StepArgs a;
  a.token_pos = i32(step.token_pos);
  a.seq_token_begin = i32(step.seq_token_begin);
  a.seq_state_slot = i32(step.seq_state_slot);
  a.page_table = i32(step.page_table);
  a.num_tokens = static_cast<int32_t>(step.num_tokens);
  a.num_seqs = step.num_seqs;
  a.max_pages = step.max_pages_per_seq;
  a.page_size = step.page_size;
  a.token_checkpoint_slot = step.host_token_checkpoint_slot.empty() ? nullptr : i32(step.token_checkpoint_slot);
  for (int s = 0; s + 1 < static_cast<int>(step.host_seq_token_begin.size()); ++s)
    a.max_seq_tokens = std::max(a.max_seq_tokens, step.host_seq_token_begin[s + 1] - step.host_seq_token_begin[s]);
  KILN_CHECK(static_cast<int>(step.host_seq_token_begin.size()) == step.num_seqs + 1, "step layout: {} sequences, {} offsets",
             step.num_seqs, step.host_seq_token_begin.size());
  return a;
}

kops::KvPoolArgs pool_args(const KvLayerView& cache) {
  KILN_CHECK(cache.k.ndim() == 4 && cache.v.shape == cache.k.shape && cache.v.dtype == cache.k.dtype,
             "KV pool k {} v {}", cache.k.shape.str(), cache.v.shape.str());
  kops::KvPoolArgs p;
  p.k = cache.k.data;
  p.v = cache.v.data;
  p.elem = elem_of(cache.k.dtype, "KV pool");
  KILN_CHECK(p.elem != kops::ElemType::f16, "KV pool dtype F16 (F32, BF16 or F8_E4M3)");
  p.k_scale = cache.k_scale;
  p.v_scale = cache.v_scale;
  p.kv_heads = static_cast<int32_t>(cache.k.dim(2));
  p.head_dim = static_cast<int32_t>(cache.k.dim(3));
  return p;
}


// ---------------------------------------------------------------------------------------------------
// State

struct CudaOps::Impl {
  CudaRuntime rt;  // first: destroyed last, after the buffers below
  CudaOptions options;
  DeviceBuffer max_abs_result;
  // Per MoE layer (keyed by the host span): the device table of expert weight descriptors.
  struct ExpertTable {
    size_t count = 0;
    const void* first_gate = nullptr;
    const void* last_down = nullptr;
    DeviceBuffer table;  // [E][3] WeightDesc
    std::vector<kops::WeightDesc> host;  // the same on the host (the dequantised cuBLAS path's GEMM alphas)
    bool vec_ok = false;
    int gemv2_kind = -1;
    int64_t inter = 0;
    // Whether the large-step paths serve these experts (moe_prefill_wgmma_supported / moe_prefill_blas_supported walk
    // the whole table): -1 until a step first asks.
    int wgmma_ok = -1, blas_ok = -1;
  };
  std::unordered_map<const void*, ExpertTable> expert_tables;
  // The device table of a layer's held experts (built on first use; `held` non-empty, every expert present).
  ExpertTable& expert_table(std::span<const model::ExpertWeights> held, int64_t H);
  // The held experts' table for the decode kernels that read NVFP4 codes in 16-byte vectors (moe_decode_fused,
  // moe_block_decode): null unless some expert is held, the held ones are NVFP4 (an expert-parallel rank's first held
  // expert tells the format) and their codes are 16-byte aligned. held: the held range.
  const ExpertTable* held_nvfp4_table(std::span<const model::ExpertWeights> experts, int64_t H,
                                      std::pair<int64_t, int64_t>& held);
  DeviceBuffer argmax_ids;
  DeviceBuffer argmax_work;  // per-chunk keys of argmax_rows
  DeviceBuffer sample_args;  // sample_rows' per-row parameters
  // Dense BF16 linears of many rows: cuBLASLt over the 3-way bf16 split of x (fp32-class accuracy).
  std::unique_ptr<::kiln::cuda::BlasLt> blas;
  DeviceBuffer blas_x, blas_out;  // reused by every such linear (one stream: calls never overlap)
  // NVFP4 routed experts of large steps, dequantised + cuBLAS (moe_prefill_blas.h): its handle and the bf16 weight
  // scratch, reused by every layer (counted by the memory plan: backend/device.cpp).
  std::unique_ptr<kops::MoePrefillBlas> moe_blas;
  DeviceBuffer moe_blas_weights;
  // The persistent decode kernels (moe_block_decode.h, deltanet_block_decode.h): their grid (0: neither is taken),
  // which of them are, and the grid barrier's words (zeroed once; each launch leaves them ready for the next).
  int persistent_grid = 0;
  bool moe_block = false, deltanet_block = false;
  int moe_block_max_tokens = 0;       // CudaOptions::moe_block_max_tokens
  int deltanet_block_max_tokens = 0;  // CudaOptions::deltanet_block_max_tokens
  unsigned* persistent_barrier = nullptr;

  explicit Impl(const CudaOptions& o) : rt(o.device), options(o) {
    rt.set_scratch_plan(o.scratch_plan_bytes);
    rt.set_pdl(o.pdl);
    rt.set_weight_prefetch(o.weight_prefetch);
  }
  bool bf16() const { return options.dtype == CudaOptions::ActivationDtype::bfloat16; }
};

namespace {
using OpScope = CudaRuntime::OpScope;
}  // namespace

CudaOps::CudaOps(const CudaOptions& options) : impl_(std::make_unique<Impl>(options)) {
  impl_->max_abs_result = DeviceBuffer(CudaRuntime::kAlign);
  if (options.moe_block_persistent || options.deltanet_block_persistent) {
    // One block per multiprocessor; the kernels' shared memory limits are set here, outside any capture.
    const int grid = kops::moe_block_decode_grid(impl_->rt.device().index);
    const bool delta_fits = kops::deltanet_block_decode_prepare(impl_->rt.device().index);
    impl_->moe_block = options.moe_block_persistent && grid > 0;
    impl_->deltanet_block = options.deltanet_block_persistent && grid > 0 && delta_fits;
    impl_->moe_block_max_tokens = options.moe_block_max_tokens;
    impl_->deltanet_block_max_tokens = options.deltanet_block_max_tokens;
    if (impl_->moe_block || impl_->deltanet_block) {
      impl_->persistent_grid = grid;
      impl_->persistent_barrier = static_cast<unsigned*>(impl_->rt.persistent(2 * sizeof(unsigned)));
    }
  }
}

CudaOps::~CudaOps() {
  if (!impl_) return;
  cudaStreamSynchronize(impl_->rt.stream());
  impl_->blas.reset();
  impl_->moe_blas.reset();
}

std::string CudaOps::describe() const {
  const CudaDeviceProbe& d = impl_->rt.device();
  const CudaOptions& o = impl_->options;
  // How activations enter the tensor cores (--dtype): the phrase every tensor-core path below names.
  const bool bf16 = o.dtype == CudaOptions::ActivationDtype::bfloat16;
  const char* x_in = bf16 ? "x rounded once to bf16" : "x split into 3 bf16 parts";
  const std::string dense =
      !o.dense_bf16_blas ? std::string("dense BF16 on the fp32 kernels")
                         : fmt::format("dense BF16 with > {} rows (>= {} rows for >= 4M weights) on tensor cores "
                                       "(cuBLASLt, {}; with or without a bias, added {})",
                                       kGemvMaxRowsSmallW, bf16 ? kBlasMinRowsBf16 : kBlasMinRows, x_in,
                                       bf16 ? "after the GEMM" : "where the 3 parts are summed");
  // The wgmma GEMMs' experimental forms, where a flag asked for one.
  std::string wg_form;
  if (o.moe_wgmma_tile_rows) wg_form += fmt::format(", {}-row tiles [--moe-wgmma-tile-rows]", o.moe_wgmma_tile_rows);
  if (o.moe_wgmma_producer) wg_form += ", a producer warp per block [--enable-wgmma-producer]";
  if (o.moe_wgmma_narrow) wg_form += ", MMAs as wide as each tile's rows [--enable-wgmma-narrow-tiles]";
  if (o.moe_group_wide) wg_form += ", pairs grouped over many blocks [--enable-wide-moe-grouping]";
  if (o.moe_wgmma_down_walk >= 2)
    wg_form += fmt::format(", down blocks walking {} feature blocks where they fit [--moe-wgmma-down-walk]",
                           o.moe_wgmma_down_walk);
  return fmt::format(
      "cuda backend: {} (device {}, compute capability {}.{}, {} SMs, {:.1f} GiB); dtype {} (fp32 activations{}, "
      "fp32 accumulation); linear: {}, else {} (<= 128 rows); more rows: {}, others on an fp32 gemm (64x64 smem "
      "tiles); weights decoded in-kernel (bf16/f16/f32, fp8 per-tensor, nvfp4); MoE: experts grouped on the device, "
      "{}; attention: paged, split-KV, online softmax (f32/bf16/fp8 KV){}; vision attention within segments: {}; delta "
      "rule: {}, {} recurrent state; decode steps as CUDA graphs",
      d.name, d.index, d.major, d.minor, d.multiprocessors, static_cast<double>(d.memory_bytes) / (1 << 30),
      bf16 ? "bfloat16" : "float32",
      bf16 ? ", rounded to bf16 at each tensor-core input" : ", split into 3 bf16 parts at each tensor-core input",
      dense, kops::linear_path_name(1),
      o.fp4_linear_tensor_cores ? fmt::format("NVFP4 on tensor cores (the expert kernel, {})", x_in)
                                : std::string("NVFP4 on the fp32 gemm [--fp4-gemm-backend kiln-fp32]"),
      fmt::format("{}{}",
                  o.moe_decode_fused ? fmt::format("steps of <= {} tokens with NVFP4 experts: routing + experts in 2 "
                                                   "fused kernels (CUDA cores, {}); other steps: ",
                                                   kops::kMoeDecodeMaxTokens,
                                                   bf16 ? "x rounded once to bf16" : "fp32 x")
                                     : std::string(),
                  o.moe_tensor_cores
                      ? fmt::format("NVFP4 experts on tensor cores (FP4 decoded to bf16 in registers, {}; prefill "
                                    "tiles stage x in shared memory{}), others on the fp32 kernels{}",
                                    x_in,
                                    !bf16 || o.moe_prefill == MoePrefill::mma
                                        ? std::string()
                                    : o.moe_prefill == MoePrefill::blas
                                        ? std::string("; every step outside graphs: experts dequantised to bf16, "
                                                      "cuBLAS grouped GEMMs [--moe-runner-backend kiln-blas]")
                                    : o.moe_prefill == MoePrefill::wgmma
                                        ? fmt::format("; every step: wgmma grouped GEMMs, FP4 decoded in registers "
                                                      "(sm_90){} [--moe-runner-backend kiln-wgmma]",
                                                      wg_form)
                                    : d.major == 9 && d.minor == 0
                                        ? fmt::format("; steps of >= {} tokens outside graphs: wgmma grouped GEMMs, "
                                                      "FP4 decoded in registers{}",
                                                      kMoePrefillWgmmaMinTokens, wg_form)
                                        : fmt::format("; steps of >= {} tokens: experts dequantised to bf16, "
                                                      "cuBLAS grouped GEMMs",
                                                      kMoePrefillBlasMinTokens),
                                    o.moe_decode_fused ? "" : " [--moe-runner-backend kiln-grouped]")
                      : std::string("fp32 kernels, tile height from the rows per expert [--moe-runner-backend "
                                    "kiln-grouped-fp32]")),
      o.prefill_attention_tensor_cores
          ? fmt::format(", prefill (>= 16 tokens in a sequence) flash-style on tensor cores ({})",
                        bf16 ? "q and p rounded once to bf16" : "q and p in 3 bf16 parts")
          : std::string(", prefill on the split-KV kernel too [--attention-backend kiln-paged-fp32]"),
      o.prefill_attention_tensor_cores
          ? fmt::format("flash-style on tensor cores ({}; head_dim % 4 != 0: fp32 CUDA cores)",
                        bf16 ? "q, k, p, v rounded to bf16" : "q, k, p, v in 3 bf16 parts")
          : std::string("fp32 CUDA cores"),
      fmt::format("{}; {}; the chunks' matrix products {}",
                  o.delta_rule == CudaOptions::DeltaRule::chunked
                      ? "chunks of 64 tokens wherever supported [every step]"
                      : "chunks of 64 tokens for prefill sequences of >= 32 tokens, recurrent for decode",
                  o.delta_rule_split_active()
                      ? "split form: a per-chunk preparation kernel parallel over chunks and heads, then the scan over "
                        "chunks (where the device's shared memory fits it, else the single kernel)"
                  : o.delta_rule_split
                      ? "single-kernel form (the split form needs the tensor cores)"
                      : "single-kernel form, a block walking each sequence's chunks [--disable-delta-rule-split]",
                  !o.delta_rule_tensor_cores ? "on fp32 CUDA cores [--disable-delta-rule-tensor-cores]"
                  : bf16                     ? "on tensor cores (tf32 mma, inputs rounded once to tf32)"
                                             : "on tensor cores (tf32 mma, inputs in 2 tf32 parts, 3 mmas)"),
      o.recurrent_state_bf16 ? "bf16 (fp32 maths, rounded to nearest even on store)" : "fp32");
}

DType CudaOps::recurrent_state_dtype() const {
  return impl_->options.recurrent_state_bf16 ? DType::BF16 : DType::F32;
}

void CudaOps::synchronize() { impl_->rt.synchronize(); }
size_t CudaOps::persistent_bytes() const { return impl_->rt.persistent_bytes(); }
size_t CudaOps::scratch_bytes() const { return impl_->rt.scratch_bytes(); }
int CudaOps::graphs() const { return impl_->rt.graphs(); }
const CudaDeviceProbe& CudaOps::device() const { return impl_->rt.device(); }
size_t CudaOps::weight_bytes() const { return impl_->rt.weight_bytes(); }

bool CudaOps::graph_capture_begin() {
  // A tensor-parallel rank whose all-reduce meets its peers on the host (ranks sharing a GPU) runs eagerly.
  if (comm_ && comm_->size() > 1 && !comm_->capturable()) return false;
  return impl_->rt.graph_capture_begin();
}
int CudaOps::graph_capture_end() { return impl_->rt.graph_capture_end(); }
bool CudaOps::graph_launch(int handle) { return impl_->rt.graph_launch(handle); }
void CudaOps::graph_reset() { impl_->rt.graph_reset(); }
bool CudaOps::profile_begin() { return impl_->rt.profile_begin(); }
std::vector<model::OpTime> CudaOps::profile_end() { return impl_->rt.profile_end(); }

// ---------------------------------------------------------------------------------------------------
// Sampling

void CudaOps::argmax_rows(const TensorView& logits, std::span<int32_t> ids) { argmax_rows_best(logits, ids, {}); }

void CudaOps::argmax_rows_best(const TensorView& logits, std::span<int32_t> ids, std::span<float> values) {
  KILN_CHECK(logits.ndim() == 2 && logits.is_contiguous() && static_cast<int64_t>(ids.size()) == logits.dim(0) &&
                 (values.empty() || values.size() == ids.size()),
             "argmax_rows: logits {} for {} ids, {} values", logits.shape.str(), ids.size(), values.size());
  expect_f32(logits, "argmax_rows logits");
  const int64_t R = logits.dim(0), V = logits.dim(1);
  if (R == 0) return;
  KILN_CHECK(R <= INT32_MAX, "argmax_rows: {} rows", R);
  OpScope prof(impl_->rt, [&] { return std::string("argmax"); });
  // ids, then (with values) the values, in one device buffer.
  const size_t need = static_cast<size_t>(R) * (values.empty() ? 4 : 8);
  if (impl_->argmax_ids.size() < need) impl_->argmax_ids = DeviceBuffer(align_up(need));
  const size_t work = kops::argmax_workspace_bytes(R, V);
  if (impl_->argmax_work.size() < work) impl_->argmax_work = DeviceBuffer(align_up(work));
  int32_t* d_ids = impl_->argmax_ids.as<int32_t>();
  float* d_values = values.empty() ? nullptr : reinterpret_cast<float*>(d_ids + R);
  kops::argmax_rows(f32(logits), V, R, V, d_ids, impl_->argmax_work.data(), impl_->rt.stream(), d_values);
  KILN_CUDA_CHECK(cudaMemcpyAsync(ids.data(), d_ids, static_cast<size_t>(R) * 4, cudaMemcpyDeviceToHost,
                                  impl_->rt.stream()));
  if (d_values)
    KILN_CUDA_CHECK(cudaMemcpyAsync(values.data(), d_values, static_cast<size_t>(R) * 4, cudaMemcpyDeviceToHost,
                                    impl_->rt.stream()));
  synchronize();
}
void CudaOps::argmax_rows_into(const TensorView& logits, TensorView ids, int32_t id_offset) {
  KILN_CHECK(logits.ndim() == 2 && logits.is_contiguous() && ids.dtype == DType::I32 && ids.is_contiguous() &&
                 ids.numel() == logits.dim(0),
             "argmax_rows_into: logits {} for ids {} {}", logits.shape.str(), ids.shape.str(), dtype_name(ids.dtype));
  expect_f32(logits, "argmax_rows_into logits");
  const int64_t R = logits.dim(0), V = logits.dim(1);
  if (R == 0) return;
  KILN_CHECK(R <= INT32_MAX, "argmax_rows_into: {} rows", R);
  OpScope prof(impl_->rt, [&] { return std::string("argmax_into"); });
  // The chunk keys in the step's scratch (not argmax_work, which a later, larger argmax may move): a captured draft
  // chain replays with them where it found them.
  void* work = impl_->rt.scratch(kops::argmax_workspace_bytes(R, V));
  kops::argmax_rows(f32(logits), V, R, V, static_cast<int32_t*>(ids.data), work, impl_->rt.stream(), nullptr,
                    id_offset);
}

void CudaOps::sample_rows(const TensorView& logits, std::span<const model::RowSampling> rows,
                          std::span<int32_t> ids) {
  KILN_CHECK(logits.ndim() == 2 && logits.is_contiguous() && static_cast<int64_t>(ids.size()) == logits.dim(0) &&
                 rows.size() == ids.size(),
             "sample_rows: logits {} for {} ids, {} rows", logits.shape.str(), ids.size(), rows.size());
  expect_f32(logits, "sample_rows logits");
  const int64_t R = logits.dim(0), V = logits.dim(1);
  if (R == 0) return;
  KILN_CHECK(R <= INT32_MAX, "sample_rows: {} rows", R);
  OpScope prof(impl_->rt, [&] { return std::string("sample"); });
  std::vector<kops::SampleRowArgs> args(static_cast<size_t>(R));
  for (size_t r = 0; r < args.size(); ++r) {
    args[r].temperature = rows[r].temperature;
    args[r].top_k = rows[r].top_k;
    args[r].top_p = rows[r].top_p;
    args[r].min_p = rows[r].min_p;
    args[r].u = rows[r].u;
  }
  const size_t arg_bytes = args.size() * sizeof(kops::SampleRowArgs);
  if (impl_->sample_args.size() < arg_bytes) impl_->sample_args = DeviceBuffer(align_up(arg_bytes));
  if (impl_->argmax_ids.size() < static_cast<size_t>(R) * 4) impl_->argmax_ids = DeviceBuffer(align_up(R * 4));
  // From pageable memory: returns once `args` is staged, so it may go out of scope.
  KILN_CUDA_CHECK(cudaMemcpyAsync(impl_->sample_args.data(), args.data(), arg_bytes, cudaMemcpyHostToDevice,
                                  impl_->rt.stream()));
  kops::sample_rows(f32(logits), V, R, V, impl_->sample_args.as<kops::SampleRowArgs>(),
                    impl_->argmax_ids.as<int32_t>(), impl_->rt.stream());
  KILN_CUDA_CHECK(cudaMemcpyAsync(ids.data(), impl_->argmax_ids.data(), static_cast<size_t>(R) * 4,
                                  cudaMemcpyDeviceToHost, impl_->rt.stream()));
  synchronize();
}

// ---------------------------------------------------------------------------------------------------
// Memory

TensorView CudaOps::allocate(DType dtype, Shape shape) {
  return TensorView(impl_->rt.persistent(static_cast<size_t>(shape.numel()) * dtype_size(dtype)), dtype, shape);
}

TensorView CudaOps::place_weight(const TensorView& host) {
  KILN_CHECK(host.is_contiguous(), "place_weight of a strided view {}", host.shape.str());
  const size_t bytes = host.nbytes();
  void* d = impl_->rt.weight(bytes);
  if (bytes) {  // the address is final now; the copy runs in the background until finish_weights()
    if (!uploader_) uploader_ = std::make_unique<WeightUploader>(impl_->rt.device().index);
    uploader_->enqueue(d, host.data, bytes);
  }
  TensorView v = host;
  v.data = d;
  return v;
}

void CudaOps::finish_weights() {
  if (uploader_) uploader_->finish();
}

void CudaOps::set_weight_upload(const UploadOptions& options) {
  finish_weights();
  uploader_ = std::make_unique<WeightUploader>(impl_->rt.device().index, options);
}

namespace {
void fill_random_device(void* d, DType dtype, int64_t n, const model::RandomFill& fill, cudaStream_t stream,
                        const kops::FillSlice* slice) {
  if (fill.kind == model::RandomFill::Kind::bytes) {
    KILN_CHECK(dtype_size(dtype) == 1 && fill.byte_hi > fill.byte_lo && fill.byte_hi <= 256,
               "random bytes for {} in [{}, {})", dtype_name(dtype), fill.byte_lo, fill.byte_hi);
    kops::fill_random_bytes(static_cast<uint8_t*>(d), n, fill.seed, fill.byte_lo, fill.byte_hi, fill.random_sign,
                            stream, slice);
  } else {
    kops::fill_random_uniform(d, elem_of(dtype, "random weight"), n, fill.seed, fill.lo, fill.hi, stream, slice);
  }
}
}  // namespace

TensorView CudaOps::place_random(DType dtype, Shape shape, const model::RandomFill& fill) {
  const size_t bytes = static_cast<size_t>(shape.numel()) * dtype_size(dtype);
  void* d = impl_->rt.weight(bytes);
  fill_random_device(d, dtype, shape.numel(), fill, impl_->rt.stream(), nullptr);
  weight_progress().add(bytes);  // filled on the compute stream, ahead of any op that reads it
  return TensorView(d, dtype, shape);
}

TensorView CudaOps::place_random_slice(DType dtype, const Shape& stored, const format::TensorSlice& slice,
                                       const model::RandomFill& fill) {
  const format::SliceLoops L = format::slice_loops(slice, stored);
  if (L.rows.size() > static_cast<size_t>(kops::FillSlice::kMaxRows))
    return Ops::place_random_slice(dtype, stored, slice, fill);  // rare: filled on the host
  kops::FillSlice s;
  s.outer_begin = L.outer_begin;
  s.split_full = L.split_full;
  s.split_local = L.split_local;
  s.mid = L.mid;
  s.last_full = L.last_full;
  s.last_local = L.last_local;
  s.last_begin = L.last_begin;
  s.num_rows = static_cast<int>(L.rows.size());
  for (size_t r = 0; r < L.rows.size(); ++r) {
    s.row_begin[r] = L.rows[r].begin;
    s.row_count[r] = L.rows[r].count;
  }
  const int64_t n = slice.shape.numel();
  const size_t bytes = static_cast<size_t>(n) * dtype_size(dtype);
  void* d = impl_->rt.weight(bytes);
  fill_random_device(d, dtype, n, fill, impl_->rt.stream(), slice.whole() ? nullptr : &s);
  weight_progress().add(bytes);
  return TensorView(d, dtype, slice.shape);
}

TensorView CudaOps::scratch(DType dtype, Shape shape) {
  return TensorView(impl_->rt.scratch(static_cast<size_t>(shape.numel()) * dtype_size(dtype)), dtype, shape);
}

void CudaOps::reset_scratch() { impl_->rt.reset_scratch(); }

model::Ops::ScratchMark CudaOps::scratch_mark() {
  ScratchMark m;
  impl_->rt.scratch_mark(m.blocks, m.used, m.in_use);
  return m;
}

void CudaOps::scratch_release(const ScratchMark& mark) { impl_->rt.scratch_release(mark.blocks, mark.used, mark.in_use); }

size_t CudaOps::scratch_peak_bytes() const { return impl_->rt.scratch_peak_bytes(); }

TensorView CudaOps::upload(const void* host, DType dtype, Shape shape) {
  TensorView t = scratch(dtype, shape);
  // Pageable source: the call returns once the bytes are staged, so the caller may reuse its buffer.
  if (t.nbytes()) KILN_CUDA_CHECK(cudaMemcpyAsync(t.data, host, t.nbytes(), cudaMemcpyHostToDevice, impl_->rt.stream()));
  return t;
}

void CudaOps::download(const TensorView& src, void* host) {
  KILN_CHECK(src.is_contiguous(), "download of a strided view");
  if (src.nbytes()) KILN_CUDA_CHECK(cudaMemcpyAsync(host, src.data, src.nbytes(), cudaMemcpyDeviceToHost, impl_->rt.stream()));
  synchronize();
}

void CudaOps::fill_zero(TensorView t) {
  OpScope prof(impl_->rt, [&] { return std::string("fill_zero"); });
  KILN_CHECK(t.is_contiguous(), "fill_zero of a strided view");
  if (t.nbytes()) KILN_CUDA_CHECK(cudaMemsetAsync(t.data, 0, t.nbytes(), impl_->rt.stream()));
}

void CudaOps::copy_spans(std::span<const CopySpan> spans) {
  OpScope prof(impl_->rt, [&] { return fmt::format("copy_spans x{}", spans.size()); });
  constexpr size_t kMaxPerLaunch = 65535;
  for (size_t b = 0; b < spans.size(); b += kMaxPerLaunch) {
    const size_t n = std::min(kMaxPerLaunch, spans.size() - b);
    std::vector<kops::ByteSpan> table;
    table.reserve(n);
    uint64_t most = 0;
    for (size_t i = b; i < b + n; ++i) {
      if (spans[i].bytes == 0) continue;
      table.push_back({spans[i].src, spans[i].dst, static_cast<uint64_t>(spans[i].bytes)});
      most = std::max<uint64_t>(most, spans[i].bytes);
    }
    if (table.empty()) continue;
    const TensorView dev = upload(table.data(), DType::U8,
                                  Shape{static_cast<int64_t>(table.size() * sizeof(kops::ByteSpan))});
    kops::copy_spans(static_cast<const kops::ByteSpan*>(dev.data), static_cast<int>(table.size()), most,
                     impl_->rt.stream());
  }
}

void CudaOps::copy(const TensorView& src, TensorView dst) {
  OpScope prof(impl_->rt, [&] { return std::string("copy"); });
  KILN_CHECK(src.shape == dst.shape && src.dtype == dst.dtype, "copy {} {} -> {} {}", src.shape.str(),
             dtype_name(src.dtype), dst.shape.str(), dtype_name(dst.dtype));
  const int nd = src.ndim();
  KILN_CHECK(nd >= 1 && nd <= 4, "copy of {} dims", nd);
  int64_t shape[4] = {1, 1, 1, 1}, ss[4] = {0, 0, 0, 0}, ds[4] = {0, 0, 0, 0};
  for (int i = 0; i < nd; ++i) {
    shape[4 - nd + i] = src.shape[i];
    ss[4 - nd + i] = src.strides[i];
    ds[4 - nd + i] = dst.strides[i];
  }
  kops::copy_strided(src.data, dst.data, static_cast<int>(dtype_size(src.dtype)), shape, ss, ds, impl_->rt.stream());
}

float CudaOps::max_abs(const TensorView& x) {
  KILN_CHECK(x.is_contiguous(), "max_abs of a strided view");
  expect_f32(x, "max_abs");
  float* result = impl_->max_abs_result.as<float>();
  kops::max_abs(f32(x), x.numel(), result, impl_->rt.stream());
  float host = 0.0f;
  KILN_CUDA_CHECK(cudaMemcpyAsync(&host, result, sizeof(float), cudaMemcpyDeviceToHost, impl_->rt.stream()));
  synchronize();
  return host;
}

// ---------------------------------------------------------------------------------------------------
// Dense maths

void CudaOps::embedding(const TensorView& table, const TensorView& ids, TensorView out) {
  OpScope prof(impl_->rt, [&] { return std::string("embedding"); });
  KILN_CHECK(table.ndim() == 2 && table.is_contiguous(), "embedding table {}", table.shape.str());
  expect_i32(ids, "embedding ids");
  expect_f32(out, "embedding out");
  const int64_t T = ids.numel(), H = table.dim(1);
  KILN_CHECK(out.numel() == T * H && out.is_contiguous(), "embedding out {} for {} ids x {}", out.shape.str(), T, H);
  kops::embedding(table.data, elem_of(table.dtype, "embedding table"), table.dim(0), H, i32(ids), 0, T, f32_mut(out),
                  impl_->rt.stream());
}

void CudaOps::embedding_shard(const TensorView& table, const TensorView& ids, int64_t vocab_begin, TensorView out) {
  OpScope prof(impl_->rt, [&] { return std::string("embedding (vocabulary shard)"); });
  KILN_CHECK(table.ndim() == 2 && table.is_contiguous(), "embedding table {}", table.shape.str());
  expect_i32(ids, "embedding ids");
  expect_f32(out, "embedding out");
  const int64_t T = ids.numel(), H = table.dim(1);
  KILN_CHECK(out.numel() == T * H && out.is_contiguous(), "embedding out {} for {} ids x {}", out.shape.str(), T, H);
  kops::embedding(table.data, elem_of(table.dtype, "embedding table"), table.dim(0), H, i32(ids), vocab_begin, T,
                  f32_mut(out), impl_->rt.stream());
}

void CudaOps::all_reduce(TensorView x) {
  if (!comm_ || comm_->size() == 1) return;
  KILN_CHECK(x.is_contiguous() && x.dtype == DType::F32, "all_reduce of a strided or non-F32 view {}", x.shape.str());
  OpScope prof(impl_->rt, [&] { return fmt::format("all-reduce {} floats", x.numel()); });
  comm_->all_reduce_sum(f32_mut(x), x.numel(), impl_->rt.stream());
}

void CudaOps::linear(const TensorView& x, const LinearWeight& w, TensorView out) {
  OpScope prof(impl_->rt, [&] { return std::string(fmt::format("linear {} {}x{}", model::weight_format_name(w.format), w.out_features, w.in_features)); });
  KILN_CHECK(x.ndim() == 2 && x.dim(1) == w.in_features && x.strides[1] == 1, "linear: x {} for W [{}, {}]",
             x.shape.str(), w.out_features, w.in_features);
  KILN_CHECK(out.ndim() == 2 && out.dim(0) == x.dim(0) && out.dim(1) == w.out_features && out.is_contiguous(),
             "linear: out {} for x {} and N {}", out.shape.str(), x.shape.str(), w.out_features);
  expect_f32(x, "linear x");
  expect_f32(out, "linear out");
  const int64_t ldx = x.dim(0) > 1 ? x.strides[0] : w.in_features;
  const int64_t T = x.dim(0), N = w.out_features, K = w.in_features;
  // Dense BF16 weights and many rows (prefill, large decode batches): tensor cores through cuBLASLt.
  //  --dtype float32: x is split into three bf16 parts (hi + mid + lo carry x's 24 bits), the 3T rows go through one
  //  GEMM (W read once), and the three partial outputs are summed: products are exact in fp32, so the result matches
  //  the fp32 kernels to summation order.
  //  --dtype bfloat16: x rounded once to bf16, one GEMM of the T rows writes out itself (fp32 accumulate).
  // A bias is added after the whole sum, as the fp32 kernels add it: by the sum of the three parts (float32), by
  // add_row_bias after the GEMM (bfloat16). A biased linear of more than kBlasBiasedMaxRows rows runs in row blocks
  // of that many (one large image's vision tower: bounds the split / partial-output buffers); unbiased ones are one
  // GEMM at any T. (The profiler's nested rows name the stages.)
  if (blas_dense(w, T, impl_->bf16()) && impl_->options.dense_bf16_blas) {
    if (!impl_->blas) impl_->blas = std::make_unique<::kiln::cuda::BlasLt>();
    const int parts = impl_->options.mma_parts();
    const int64_t rows = w.bias.data ? std::min(T, kBlasBiasedMaxRows) : T;
    auto* xs = static_cast<uint16_t*>(impl_->rt.reusable(impl_->blas_x, static_cast<size_t>(parts * rows * K) * 2));
    auto* part = parts == kops::kMmaPartsBf16
                     ? nullptr
                     : static_cast<float*>(impl_->rt.reusable(impl_->blas_out, static_cast<size_t>(3 * rows * N) * 4));
    for (int64_t r0 = 0; r0 < T; r0 += rows) {
      const int64_t Tb = std::min(rows, T - r0);
      const float* xb = f32(x) + r0 * ldx;
      float* ob = f32_mut(out) + r0 * N;
      if (parts == kops::kMmaPartsBf16) {
        kops::round_bf16(xb, ldx, Tb, K, xs, impl_->rt.stream());
        kops::profile_mark("cuBLASLt: x to bf16");
        impl_->blas->gemm(xs, K, static_cast<const uint16_t*>(w.weight.data), K, ob, N, true, static_cast<int>(Tb),
                          static_cast<int>(N), static_cast<int>(K), impl_->rt.stream());
        kops::profile_mark("cuBLASLt: GEMM");
        if (w.bias.data) {
          kops::add_row_bias(ob, N, Tb, N, w.bias.data, blas_bias_elem(w), impl_->rt.stream());
          kops::profile_mark("cuBLASLt: + bias");
        }
        continue;
      }
      kops::split_bf16x3(xb, ldx, Tb, K, xs, impl_->rt.stream());
      kops::profile_mark("cuBLASLt: x split in 3 bf16 parts");
      impl_->blas->gemm(xs, K, static_cast<const uint16_t*>(w.weight.data), K, part, N, true,
                        static_cast<int>(3 * Tb), static_cast<int>(N), static_cast<int>(K), impl_->rt.stream());
      kops::profile_mark("cuBLASLt: GEMM");
      kops::sum3_rows(part, Tb, N, ob, N, impl_->rt.stream(), w.bias.data, blas_bias_elem(w));
      kops::profile_mark(w.bias.data ? "cuBLASLt: sum of the 3 parts + bias" : "cuBLASLt: sum of the 3 parts");
    }
    return;
  }
  // NVFP4 weights and more rows than the gemv takes: the routed-expert tensor-core kernel with this weight as its
  // only expert (W4A16, x in mma_parts() bf16 parts), instead of the fp32 gemm (which --fp4-gemm-backend kiln-fp32
  // keeps).
  const kops::WeightDesc desc = desc_of(w);
  // (Not while a graph is being captured: the tile table and descriptor travel by a host copy, which a capture
  // cannot hold; a decode step of > 128 sequences then records the fp32 gemm.)
  cudaStreamCaptureStatus capturing = cudaStreamCaptureStatusNone;
  if (T > kops::kGemvMaxRows) KILN_CUDA_CHECK(cudaStreamIsCapturing(impl_->rt.stream(), &capturing));
  if (T > kops::kGemvMaxRows && impl_->options.fp4_linear_tensor_cores && capturing == cudaStreamCaptureStatusNone &&
      kops::linear_nvfp4_mma_supported(desc)) {
    const int64_t tiles = (T + kops::kLinearTileRows - 1) / kops::kLinearTileRows;
    std::vector<int32_t> info(static_cast<size_t>(tiles) * 4);
    for (int64_t i = 0; i < tiles; ++i) {
      info[static_cast<size_t>(4 * i)] = 0;
      info[static_cast<size_t>(4 * i + 1)] = static_cast<int32_t>(i * kops::kLinearTileRows);
      info[static_cast<size_t>(4 * i + 2)] = static_cast<int32_t>(std::min(T, (i + 1) * kops::kLinearTileRows));
      info[static_cast<size_t>(4 * i + 3)] = 0;
    }
    TensorView d_info = upload(info.data(), DType::I32, Shape{tiles * 4});
    TensorView d_desc = upload(&desc, DType::U8, Shape{static_cast<int64_t>(sizeof desc)});
    const int parts = impl_->options.mma_parts();
    auto* xs = static_cast<uint16_t*>(impl_->rt.scratch(static_cast<size_t>(parts * T * K) * 2));
    kops::linear_nvfp4_mma(static_cast<const kops::WeightDesc*>(d_desc.data), static_cast<const int4*>(d_info.data),
                           tiles, K, N, f32(x), ldx, T, xs, f32_mut(out), impl_->rt.stream(), parts);
    return;
  }
  kops::linear(desc, f32(x), ldx, x.dim(0), f32_mut(out), w.out_features, impl_->rt.stream());
}

void CudaOps::linear_multi(const TensorView& x, std::span<const LinearWeight* const> ws,
                           std::span<const TensorView> outs) {
  KILN_CHECK(ws.size() == outs.size(), "linear_multi: {} weights, {} outputs", ws.size(), outs.size());
  const int64_t T = x.dim(0);
  const bool simple = ws.size() <= 4 && x.ndim() == 2 && x.strides[1] == 1 && x.dtype == DType::F32;
  auto plain_out = [&](size_t i) {
    const TensorView& o = outs[i];
    return ws[i]->in_features == x.dim(1) && o.dtype == DType::F32 && o.ndim() == 2 && o.dim(0) == T &&
           o.dim(1) == ws[i]->out_features && o.is_contiguous();
  };
  // Weights that take cuBLASLt share one split of x. --dtype float32: weights placed back to back (the arena keeps
  // the binder's order) run as one GEMM whose columns are summed into their outputs by one launch, each weight's bias
  // (if any) added to its own columns there. --dtype bfloat16: one GEMM per weight writes its output itself (nothing
  // to sum; a bias is added after it by add_row_bias).
  size_t blas[4], n_blas = 0, rest[4], n_rest = 0;
  for (size_t i = 0; i < ws.size(); ++i) {
    if (simple && impl_->options.dense_bf16_blas && blas_dense(*ws[i], T, impl_->bf16()) && plain_out(i) &&
        (!ws[i]->bias.data || T <= kBlasBiasedMaxRows))  // (longer: linear's row blocks)
      blas[n_blas++] = i;
    else if (simple) rest[n_rest++] = i;
    else linear(x, *ws[i], outs[i]);
  }
  if (n_blas == 1) linear(x, *ws[blas[0]], outs[blas[0]]);
  if (n_blas >= 2) {
    OpScope prof(impl_->rt, [&] {
      std::string l = "linear_blas";
      for (size_t r = 0; r < n_blas; ++r) l += fmt::format(" {}x{}", ws[blas[r]]->out_features, ws[blas[r]]->in_features);
      return l;
    });
    std::sort(blas, blas + n_blas, [&](size_t a, size_t b) { return ws[a]->weight.data < ws[b]->weight.data; });
    const int64_t K = x.dim(1), ldx = T > 1 ? x.strides[0] : K;
    if (!impl_->blas) impl_->blas = std::make_unique<::kiln::cuda::BlasLt>();
    const int parts = impl_->options.mma_parts();
    auto* xs = static_cast<uint16_t*>(impl_->rt.reusable(impl_->blas_x, static_cast<size_t>(parts * T * K) * 2));
    if (parts == kops::kMmaPartsBf16) {
      kops::round_bf16(f32(x), ldx, T, K, xs, impl_->rt.stream());
      for (size_t r = 0; r < n_blas; ++r) {
        const LinearWeight& w = *ws[blas[r]];
        impl_->blas->gemm(xs, K, static_cast<const uint16_t*>(w.weight.data), K, f32_mut(outs[blas[r]]),
                          w.out_features, true, static_cast<int>(T), static_cast<int>(w.out_features),
                          static_cast<int>(K), impl_->rt.stream());
        if (w.bias.data)
          kops::add_row_bias(f32_mut(outs[blas[r]]), w.out_features, T, w.out_features, w.bias.data,
                             blas_bias_elem(w), impl_->rt.stream());
      }
      n_blas = 0;  // done
    } else {
      kops::split_bf16x3(f32(x), ldx, T, K, xs, impl_->rt.stream());
    }
    for (size_t r0 = 0; r0 < n_blas;) {
      // The run of weights adjacent in memory starting at r0.
      size_t r1 = r0 + 1;
      int64_t N = ws[blas[r0]]->out_features;
      while (r1 < n_blas && static_cast<const char*>(ws[blas[r1 - 1]]->weight.data) +
                                    ws[blas[r1 - 1]]->out_features * K * 2 ==
                                static_cast<const char*>(ws[blas[r1]]->weight.data))
        N += ws[blas[r1++]]->out_features;
      auto* part = static_cast<float*>(impl_->rt.reusable(impl_->blas_out, static_cast<size_t>(3 * T * N) * 4));
      impl_->blas->gemm(xs, K, static_cast<const uint16_t*>(ws[blas[r0]]->weight.data), K, part, N, true,
                        static_cast<int>(3 * T), static_cast<int>(N), static_cast<int>(K), impl_->rt.stream());
      kops::Sum3Segments segs;
      int64_t col = 0;
      for (size_t r = r0; r < r1; ++r) {
        segs.out[segs.count] = f32_mut(outs[blas[r]]);
        segs.ldo[segs.count] = ws[blas[r]]->out_features;
        segs.col0[segs.count] = col;
        segs.bias[segs.count] = ws[blas[r]]->bias.data;
        segs.bias_elem[segs.count] = blas_bias_elem(*ws[blas[r]]);
        col += ws[blas[r]]->out_features;
        ++segs.count;
      }
      kops::sum3_rows_segments(part, T, N, segs, impl_->rt.stream());
      r0 = r1;
    }
  }
  // The others: one gemv launch for several when they fit it.
  bool fused = n_rest >= 2 && T >= 1 && T <= kGemvMaxRowsSmallW;
  kops::WeightDesc descs[4];
  float* out_ptrs[4] = {};
  int64_t ldos[4] = {};
  for (size_t r = 0; fused && r < n_rest; ++r) {
    const size_t i = rest[r];
    fused = plain_out(i) && !ws[i]->bias.data;
    if (!fused) break;
    descs[r] = desc_of(*ws[i]);
    out_ptrs[r] = f32_mut(outs[i]);
    ldos[r] = outs[i].dim(1);
  }
  if (fused) {
    OpScope prof(impl_->rt, [&] {
      std::string l = "linear_multi";
      for (size_t r = 0; r < n_rest; ++r) l += fmt::format(" {}x{}", ws[rest[r]]->out_features, ws[rest[r]]->in_features);
      return l;
    });
    const int64_t ldx = T > 1 ? x.strides[0] : x.dim(1);
    if (kops::linear_multi(descs, static_cast<int>(n_rest), f32(x), ldx, T, out_ptrs, ldos, impl_->rt.stream())) return;
  }
  for (size_t r = 0; r < n_rest; ++r) linear(x, *ws[rest[r]], outs[rest[r]]);
}

void CudaOps::rms_norm(const TensorView& x, const TensorView& weight, float eps, NormKind kind, TensorView out) {
  OpScope prof(impl_->rt, [&] { return std::string(fmt::format("rms_norm D={}", weight.numel())); });
  KILN_CHECK(x.ndim() == 2 && x.strides[1] == 1 && out.is_contiguous() && out.shape == x.shape,
             "rms_norm shapes {} {}", x.shape.str(), out.shape.str());
  expect_f32(x, "rms_norm x");
  expect_f32(out, "rms_norm out");
  const int64_t R = x.dim(0), D = x.dim(1);
  KILN_CHECK(weight.numel() == D, "rms_norm weight {} for D {}", weight.numel(), D);
  const int64_t ldx = R > 1 ? x.strides[0] : D;
  kops::rms_norm(f32(x), ldx, R, D, weight.data, elem_of(weight.dtype, "norm weight"), eps,
                 kind == NormKind::zero_centred, f32_mut(out), impl_->rt.stream());
}

void CudaOps::add_rms_norm(TensorView hidden, const TensorView& y, const TensorView& weight, float eps, NormKind kind,
                           TensorView out) {
  OpScope prof(impl_->rt, [&] { return std::string(fmt::format("add_rms_norm D={}", weight.numel())); });
  KILN_CHECK(hidden.ndim() == 2 && hidden.is_contiguous() && y.shape == hidden.shape && y.is_contiguous() &&
                 out.shape == hidden.shape && out.is_contiguous(),
             "add_rms_norm shapes {} {} {}", hidden.shape.str(), y.shape.str(), out.shape.str());
  expect_f32(hidden, "add_rms_norm hidden");
  expect_f32(y, "add_rms_norm y");
  expect_f32(out, "add_rms_norm out");
  const int64_t R = hidden.dim(0), D = hidden.dim(1);
  KILN_CHECK(weight.numel() == D, "add_rms_norm weight {} for D {}", weight.numel(), D);
  kops::add_rms_norm(f32_mut(hidden), f32(y), R, D, weight.data, elem_of(weight.dtype, "norm weight"), eps,
                     kind == NormKind::zero_centred, f32_mut(out), impl_->rt.stream());
}

void CudaOps::gated_rms_norm(const TensorView& x, const TensorView& z, const TensorView& weight, float eps,
                             TensorView out) {
  OpScope prof(impl_->rt, [&] { return std::string("gated_rms_norm"); });
  KILN_CHECK(x.ndim() == 2 && x.is_contiguous() && z.is_contiguous() && x.shape == z.shape && out.shape == x.shape &&
                 out.is_contiguous(),
             "gated_rms_norm {} {} {}", x.shape.str(), z.shape.str(), out.shape.str());
  expect_f32(x, "gated_rms_norm x");
  expect_f32(z, "gated_rms_norm z");
  expect_f32(out, "gated_rms_norm out");
  KILN_CHECK(weight.numel() == x.dim(1), "gated_rms_norm weight {} for D {}", weight.numel(), x.dim(1));
  kops::gated_rms_norm(f32(x), f32(z), x.dim(0), x.dim(1), weight.data, elem_of(weight.dtype, "norm weight"), eps,
                       f32_mut(out), impl_->rt.stream());
}

void CudaOps::rope(TensorView x, const TensorView& positions, int rotary_dim, double theta) {
  OpScope prof(impl_->rt, [&] { return std::string("rope"); });
  KILN_CHECK(x.ndim() == 3 && x.is_contiguous(), "rope expects [T, heads, head_dim], got {}", x.shape.str());
  expect_f32(x, "rope x");
  expect_i32(positions, "rope positions");
  KILN_CHECK(rotary_dim % 2 == 0 && rotary_dim <= x.dim(2), "rotary dim {} for head dim {}", rotary_dim, x.dim(2));
  KILN_CHECK(positions.numel() == x.dim(0), "rope: {} positions for {} tokens", positions.numel(), x.dim(0));
  kops::rope(f32_mut(x), x.dim(0), x.dim(1), x.dim(2), i32(positions), rotary_dim, theta, impl_->rt.stream());
}

void CudaOps::linear_gated_input(const TensorView& x, const TensorView& x2, model::InputAct act,
                                 const LinearWeight& w, TensorView out) {
  const int64_t T = x.ndim() == 2 ? x.dim(0) : 0;
  // One row (decode at batch 1) of a weight the bandwidth gemv streams: the activation applied as x is read.
  // Otherwise (more rows, a bias, other formats, the tensor-core paths) the composed ops. Every warp of the gemv
  // computes the activation of the whole input again, so its cost grows with the rows: a K = 3 verify pass (4 rows)
  // at batch 1 measured 6.11 / 6.19 ms with the fused ops against 5.59 / 5.71 ms without them (35B-A3B, H100).
  if (impl_->options.fused_decode_ops && T == 1 && !w.bias.data && x.shape == x2.shape && x.is_contiguous() && x2.is_contiguous() &&
      x.dim(1) == w.in_features && out.ndim() == 2 && out.is_contiguous() && out.dim(0) == T &&
      out.dim(1) == w.out_features && x.dtype == DType::F32 && x2.dtype == DType::F32 && out.dtype == DType::F32 &&
      !blas_dense(w, T, impl_->bf16())) {
    OpScope prof(impl_->rt, [&] {
      return fmt::format("linear+{} {} {}x{}", act == model::InputAct::silu_mul ? "silu_mul" : "sigmoid_mul",
                         model::weight_format_name(w.format), w.out_features, w.in_features);
    });
    if (kops::linear_gated_input(desc_of(w), f32(x), w.in_features, f32(x2), w.in_features,
                                 act == model::InputAct::silu_mul ? 1 : 2, T, f32_mut(out), w.out_features,
                                 impl_->rt.stream()))
      return;
  }
  Ops::linear_gated_input(x, x2, act, w, out);
}

void CudaOps::qk_norm_rope(const TensorView& q_proj, const TensorView& k, bool gated, const TensorView& q_norm,
                           const TensorView& k_norm, float eps, NormKind kind, const TensorView& positions,
                           int rotary_dim, double theta, const model::MRopeAxes* axes, TensorView q_out,
                           TensorView gate_out, TensorView k_out) {
  const int64_t D = q_out.ndim() == 3 ? q_out.dim(2) : 0;
  // Head dims of 512 and more take the composed ops (rms_norm's block-per-row kernel sums in another order).
  if (!impl_->options.fused_decode_ops || !kops::qk_norm_rope_fits(D) || (axes && rotary_dim > 128)) {
    Ops::qk_norm_rope(q_proj, k, gated, q_norm, k_norm, eps, kind, positions, rotary_dim, theta, axes, q_out, gate_out,
                      k_out);
    return;
  }
  OpScope prof(impl_->rt, [&] { return std::string("qk_norm_rope"); });
  model::check_qk_norm_rope(q_proj, k, gated, q_out, gate_out, k_out);
  KILN_CHECK(q_out.is_contiguous() && k_out.is_contiguous(), "qk_norm_rope: q_out {} k_out {} must be contiguous",
             q_out.shape.str(), k_out.shape.str());
  const int64_t T = q_out.dim(0), Hq = q_out.dim(1), Hkv = k_out.dim(1);
  KILN_CHECK(q_norm.numel() == D && k_norm.numel() == D, "qk_norm_rope: norm weights {} / {} for head dim {}",
             q_norm.numel(), k_norm.numel(), D);
  KILN_CHECK(rotary_dim % 2 == 0 && rotary_dim <= D, "rotary dim {} for head dim {}", rotary_dim, D);
  KILN_CHECK(positions.numel() == (axes ? 3 : 1) * T, "qk_norm_rope: {} positions for {} tokens", positions.numel(),
             T);
  expect_f32(q_proj, "qk_norm_rope q");
  expect_f32(k, "qk_norm_rope k");
  expect_f32(q_out, "qk_norm_rope q_out");
  expect_f32(k_out, "qk_norm_rope k_out");
  if (gated) expect_f32(gate_out, "qk_norm_rope gate");
  expect_i32(positions, "qk_norm_rope positions");
  kops::qk_norm_rope(f32(q_proj), q_proj.dim(1), gated ? 2 * D : D, f32(k), k.dim(1), T, Hq, Hkv, D, q_norm.data,
                     elem_of(q_norm.dtype, "q norm weight"), k_norm.data, elem_of(k_norm.dtype, "k norm weight"), eps,
                     kind == NormKind::zero_centred, i32(positions), axes ? 3 : 1, axes ? axes->bits[0] : 0,
                     axes ? axes->bits[1] : 0, rotary_dim, theta, f32_mut(q_out), gated ? f32_mut(gate_out) : nullptr,
                     f32_mut(k_out), impl_->rt.stream());
}

void CudaOps::mrope(TensorView x, const TensorView& positions, int rotary_dim, double theta,
                    const model::MRopeAxes& axes) {
  OpScope prof(impl_->rt, [&] { return std::string("mrope"); });
  KILN_CHECK(x.ndim() == 3 && x.is_contiguous(), "mrope expects [T, heads, head_dim], got {}", x.shape.str());
  expect_f32(x, "mrope x");
  expect_i32(positions, "mrope positions");
  KILN_CHECK(rotary_dim % 2 == 0 && rotary_dim <= x.dim(2) && rotary_dim <= 128, "rotary dim {} for head dim {}",
             rotary_dim, x.dim(2));
  KILN_CHECK(positions.numel() == 3 * x.dim(0), "mrope: {} positions for {} tokens (3 each)", positions.numel(),
             x.dim(0));
  kops::mrope(f32_mut(x), x.dim(0), x.dim(1), x.dim(2), i32(positions), axes.bits[0], axes.bits[1], rotary_dim,
              theta, impl_->rt.stream());
}

void CudaOps::scatter_rows(const TensorView& src, const TensorView& rows, TensorView dst) {
  OpScope prof(impl_->rt, [&] { return std::string("scatter_rows"); });
  KILN_CHECK(src.ndim() == 2 && dst.ndim() == 2 && src.is_contiguous() && dst.is_contiguous() &&
                 src.dim(0) == rows.numel() && src.dim(1) == dst.dim(1),
             "scatter_rows src {} rows {} dst {}", src.shape.str(), rows.shape.str(), dst.shape.str());
  KILN_CHECK(src.dtype == dst.dtype && (src.dtype == DType::F32 || src.dtype == DType::I32),
             "scatter_rows: src {} and dst {} (both F32 or both I32)", dtype_name(src.dtype), dtype_name(dst.dtype));
  expect_i32(rows, "scatter_rows rows");
  // I32 rows (ids) move through the same kernel: it loads and stores 4-byte words without arithmetic.
  kops::scatter_rows(static_cast<const float*>(src.data), i32(rows), rows.numel(), src.dim(1),
                     static_cast<float*>(dst.data), dst.dim(0), impl_->rt.stream());
}

void CudaOps::add(const TensorView& a, const TensorView& b, TensorView out) {
  OpScope prof(impl_->rt, [&] { return std::string("add"); });
  KILN_CHECK(a.shape == b.shape && a.shape == out.shape && a.is_contiguous() && b.is_contiguous() &&
                 out.is_contiguous(),
             "add {} {} {}", a.shape.str(), b.shape.str(), out.shape.str());
  expect_f32(a, "add a");
  expect_f32(b, "add b");
  expect_f32(out, "add out");
  kops::add(f32(a), f32(b), f32_mut(out), a.numel(), impl_->rt.stream());
}

void CudaOps::silu_mul(const TensorView& gate, const TensorView& up, TensorView out) {
  OpScope prof(impl_->rt, [&] { return std::string("silu_mul"); });
  KILN_CHECK(gate.shape == up.shape && gate.shape == out.shape && gate.is_contiguous() && up.is_contiguous() &&
                 out.is_contiguous(),
             "silu_mul shapes");
  expect_f32(gate, "silu_mul gate");
  expect_f32(up, "silu_mul up");
  expect_f32(out, "silu_mul out");
  kops::silu_mul(f32(gate), f32(up), f32_mut(out), gate.numel(), impl_->rt.stream());
}

void CudaOps::sigmoid_mul(const TensorView& x, const TensorView& g, TensorView out) {
  OpScope prof(impl_->rt, [&] { return std::string("sigmoid_mul"); });
  const int64_t T = x.dim(0), N = x.numel() / std::max<int64_t>(T, 1);
  const int64_t gn = g.numel() / std::max<int64_t>(T, 1);
  KILN_CHECK(g.dim(0) == T && (gn == N || gn == 1) && out.shape == x.shape && x.is_contiguous() &&
                 g.is_contiguous() && out.is_contiguous(),
             "sigmoid_mul {} {}", x.shape.str(), g.shape.str());
  expect_f32(x, "sigmoid_mul x");
  expect_f32(g, "sigmoid_mul g");
  expect_f32(out, "sigmoid_mul out");
  kops::sigmoid_mul(f32(x), f32(g), f32_mut(out), T, N, gn, impl_->rt.stream());
}

void CudaOps::gather_rows(const TensorView& x, const TensorView& rows, TensorView out) {
  OpScope prof(impl_->rt, [&] { return std::string("gather_rows"); });
  KILN_CHECK(x.ndim() == 2 && x.is_contiguous() && out.is_contiguous() && out.dim(0) == rows.numel() &&
                 out.numel() == rows.numel() * x.dim(1),
             "gather_rows x {} rows {} out {}", x.shape.str(), rows.shape.str(), out.shape.str());
  KILN_CHECK(x.dtype == out.dtype && (x.dtype == DType::F32 || x.dtype == DType::I32),
             "gather_rows: x {} and out {} (both F32 or both I32)", dtype_name(x.dtype), dtype_name(out.dtype));
  expect_i32(rows, "gather_rows rows");
  // I32 rows (ids) move through the same kernel: it loads and stores 4-byte words without arithmetic.
  kops::gather_rows(static_cast<const float*>(x.data), x.dim(0), x.dim(1), i32(rows), rows.numel(),
                    static_cast<float*>(out.data), impl_->rt.stream());
}

// ---------------------------------------------------------------------------------------------------
// Vision encoder (vision.h)

void CudaOps::layer_norm(const TensorView& x, const TensorView& weight, const TensorView& bias, float eps,
                         TensorView out) {
  OpScope prof(impl_->rt, [&] { return fmt::format("layer_norm D={}", weight.numel()); });
  KILN_CHECK(x.ndim() == 2 && x.is_contiguous() && out.shape == x.shape && out.is_contiguous(),
             "layer_norm: x {} out {} (contiguous [R, D] each)", x.shape.str(), out.shape.str());
  expect_f32(x, "layer_norm x");
  expect_f32(out, "layer_norm out");
  const int64_t R = x.dim(0), D = x.dim(1);
  KILN_CHECK(weight.numel() == D && bias.numel() == D && weight.is_contiguous() && bias.is_contiguous(),
             "layer_norm: weight {} bias {} for D {}", weight.shape.str(), bias.shape.str(), D);
  kops::layer_norm(f32(x), R, D, weight.data, elem_of(weight.dtype, "layer_norm weight"), bias.data,
                   elem_of(bias.dtype, "layer_norm bias"), eps, f32_mut(out), impl_->rt.stream());
}

void CudaOps::gelu(const TensorView& x, model::GeluKind kind, TensorView out) {
  OpScope prof(impl_->rt, [&] { return std::string(kind == model::GeluKind::tanh ? "gelu tanh" : "gelu erf"); });
  KILN_CHECK(x.is_contiguous() && out.is_contiguous() && out.numel() == x.numel(), "gelu: x {} out {}",
             x.shape.str(), out.shape.str());
  expect_f32(x, "gelu x");
  expect_f32(out, "gelu out");
  kops::gelu(f32(x), x.numel(), kind == model::GeluKind::tanh, f32_mut(out), impl_->rt.stream());
}

void CudaOps::rope_cos_sin(TensorView x, const TensorView& cos, const TensorView& sin) {
  OpScope prof(impl_->rt, [&] { return std::string("rope_cos_sin"); });
  KILN_CHECK(x.ndim() == 3 && x.is_contiguous(), "rope_cos_sin: x {} (contiguous [T, heads, D])", x.shape.str());
  const int64_t T = x.dim(0), heads = x.dim(1), D = x.dim(2);
  KILN_CHECK(D % 2 == 0 && cos.ndim() == 2 && cos.shape == sin.shape && cos.dim(0) == T && cos.dim(1) == D / 2 &&
                 cos.is_contiguous() && sin.is_contiguous(),
             "rope_cos_sin: x {} with cos {} sin {}", x.shape.str(), cos.shape.str(), sin.shape.str());
  expect_f32(x, "rope_cos_sin x");
  expect_f32(cos, "rope_cos_sin cos");
  expect_f32(sin, "rope_cos_sin sin");
  kops::rope_cos_sin(f32_mut(x), T, heads, D, f32(cos), f32(sin), impl_->rt.stream());
}

void CudaOps::attention_segments(const TensorView& q, const TensorView& k, const TensorView& v,
                                 const TensorView& cu_seqlens, int64_t max_seqlen, float scale, TensorView out) {
  KILN_CHECK(q.ndim() == 3 && k.shape == q.shape && v.shape == q.shape && out.shape == q.shape && q.is_contiguous() &&
                 k.is_contiguous() && v.is_contiguous() && out.is_contiguous(),
             "attention_segments: q {} k {} v {} out {} (contiguous [T, heads, D] each)", q.shape.str(),
             k.shape.str(), v.shape.str(), out.shape.str());
  for (const TensorView* t : std::initializer_list<const TensorView*>{&q, &k, &v, &out})
    expect_f32(*t, "attention_segments");
  expect_i32(cu_seqlens, "attention_segments cu_seqlens");
  KILN_CHECK(cu_seqlens.ndim() == 1 && cu_seqlens.dim(0) >= 2 && cu_seqlens.is_contiguous(),
             "attention_segments: cu_seqlens {} (I32 [S + 1])", cu_seqlens.shape.str());
  const int64_t T = q.dim(0), H = q.dim(1), D = q.dim(2), S = cu_seqlens.dim(0) - 1;
  KILN_CHECK(D >= 1 && D <= kops::kSegmentAttentionMaxHeadDim,
             "attention_segments: head_dim {} (the cuda backend takes 1 to {})", D,
             kops::kSegmentAttentionMaxHeadDim);
  KILN_CHECK(max_seqlen >= 0 && max_seqlen <= T && (T == 0 || max_seqlen >= 1),
             "attention_segments: max_seqlen {} for {} tokens", max_seqlen, T);
  // The tensor-core kernel where it serves the head size (vision.h), else, and with --attention-backend
  // kiln-paged-fp32, the CUDA-core one.
  const int parts = impl_->options.prefill_attention_tensor_cores ? impl_->options.mma_parts() : 0;
  const bool mma = parts && kops::attention_segments_mma_supported(D, parts, q.data, k.data, v.data, out.data);
  OpScope prof(impl_->rt, [&] {
    return fmt::format("attention_segments D={} {}", D,
                       !mma ? "fp32" : (parts == kops::kMmaPartsBf16 ? "mma bf16" : "mma bf16x3"));
  });
  kops::attention_segments(f32(q), f32(k), f32(v), i32(cu_seqlens), S, max_seqlen, T, H, D, scale, f32_mut(out),
                           mma ? parts : kops::kSegmentAttentionFp32, impl_->rt.stream());
}

void CudaOps::weighted_embedding(const TensorView& table, const TensorView& ids, const TensorView& weights,
                                 TensorView out) {
  OpScope prof(impl_->rt, [&] { return std::string("weighted_embedding"); });
  KILN_CHECK(table.ndim() == 2 && table.is_contiguous(), "weighted_embedding: table {}", table.shape.str());
  expect_i32(ids, "weighted_embedding ids");
  expect_f32(weights, "weighted_embedding weights");
  expect_f32(out, "weighted_embedding out");
  KILN_CHECK(ids.ndim() == 2 && ids.is_contiguous() && weights.shape == ids.shape && weights.is_contiguous() &&
                 out.ndim() == 2 && out.is_contiguous() && out.dim(0) == ids.dim(0) && out.dim(1) == table.dim(1),
             "weighted_embedding: ids {} weights {} out {} for table {}", ids.shape.str(), weights.shape.str(),
             out.shape.str(), table.shape.str());
  kops::weighted_embedding(table.data, elem_of(table.dtype, "weighted_embedding table"), table.dim(0), table.dim(1),
                           i32(ids), f32(weights), ids.dim(0), ids.dim(1), f32_mut(out), impl_->rt.stream());
}

// ---------------------------------------------------------------------------------------------------
// Attention

void CudaOps::kv_store(const TensorView& k, const TensorView& v, KvLayerView cache, const StepLayout& step) {
  OpScope prof(impl_->rt, [&] { return std::string("kv_store"); });
  const kops::KvPoolArgs pool = pool_args(cache);
  KILN_CHECK(k.ndim() == 3 && k.shape == v.shape && k.is_contiguous() && v.is_contiguous() &&
                 k.dim(0) == step.num_tokens && k.dim(1) == pool.kv_heads && k.dim(2) == pool.head_dim,
             "kv_store: k {} v {} for pool {}", k.shape.str(), v.shape.str(), cache.k.shape.str());
  expect_f32(k, "kv_store k");
  expect_f32(v, "kv_store v");
  KILN_CHECK(cache.k.dim(1) == step.page_size, "kv_store: pool pages of {} rows, step pages of {}", cache.k.dim(1),
             step.page_size);
  kops::kv_store(f32(k), f32(v), pool, step_args(step), impl_->rt.stream());
}

void CudaOps::attention(const TensorView& q, KvLayerView cache, const StepLayout& step, float scale, TensorView out) {
  OpScope prof(impl_->rt, [&] { return std::string("attention"); });
  const kops::KvPoolArgs pool = pool_args(cache);
  KILN_CHECK(q.ndim() == 3 && q.is_contiguous() && out.shape == q.shape && out.is_contiguous() &&
                 q.dim(0) == step.num_tokens && q.dim(2) == pool.head_dim && q.dim(1) % pool.kv_heads == 0,
             "attention: q {} for pool {}", q.shape.str(), cache.k.shape.str());
  expect_f32(q, "attention q");
  expect_f32(out, "attention out");
  const kops::StepArgs sa = step_args(step);
  // Prefill-shaped steps: the flash-style kernel (query tiles share each K / V tile; tensor cores, q and p in
  // mma_parts() bf16 parts), unless a short sequence of the step has a long context (one block would walk all of it:
  // the split-over-keys kernel serves that better). It declines shapes it does not serve (f32 pools, head_dim not
  // 64 / 128 / 256).
  if (impl_->options.prefill_attention_tensor_cores && sa.max_seq_tokens >= kops::kAttentionPrefillMinTokens) {
    bool long_decode = false;
    for (int s = 0; s < step.num_seqs && !long_decode; ++s) {
      const int32_t n = step.host_seq_token_begin[s + 1] - step.host_seq_token_begin[s];
      long_decode = n < kops::kAttentionPrefillMinTokens && step.host_seq_start_pos[s] + n > kAttnPrefillMaxShortContext;
    }
    if (!long_decode && kops::attention_prefill(f32(q), q.dim(1), pool, sa, scale, f32_mut(out), impl_->rt.stream(),
                                                impl_->options.mma_parts()))
      return;
  }
  const size_t ws_bytes = kops::attention_workspace_bytes(q.dim(0), q.dim(1), pool.head_dim, sa);
  void* ws = ws_bytes ? impl_->rt.scratch(ws_bytes) : nullptr;
  kops::attention(f32(q), q.dim(1), pool, sa, scale, f32_mut(out), ws, impl_->rt.stream());
}

// ---------------------------------------------------------------------------------------------------
// Gated DeltaNet

void CudaOps::causal_conv1d_silu(const TensorView& x, const TensorView& weight, TensorView conv_state,
                                 const StepLayout& step, TensorView out) {
  OpScope prof(impl_->rt, [&] { return std::string("conv1d"); });
  KILN_CHECK(x.ndim() == 2 && weight.ndim() == 2 && conv_state.ndim() == 3, "conv1d: x {} w {} state {}",
             x.shape.str(), weight.shape.str(), conv_state.shape.str());
  const int64_t C = x.dim(1), Kc = weight.dim(1);
  KILN_CHECK(weight.dim(0) == C && conv_state.dim(1) == C && conv_state.dim(2) == Kc - 1 && x.is_contiguous() &&
                 out.shape == x.shape && out.is_contiguous() && conv_state.is_contiguous() &&
                 x.dim(0) == step.num_tokens,
             "conv1d: x {} w {} state {}", x.shape.str(), weight.shape.str(), conv_state.shape.str());
  expect_f32(x, "conv1d x");
  expect_f32(conv_state, "conv1d state");
  expect_f32(out, "conv1d out");
  kops::causal_conv1d_silu(f32(x), C, weight.data, elem_of(weight.dtype, "conv1d weight"), static_cast<int>(Kc),
                           f32_mut(conv_state), step_args(step), f32_mut(out), impl_->rt.stream());
}

void CudaOps::delta_rule_gates(const TensorView& a, const TensorView& b, const TensorView& A_log,
                               const TensorView& dt_bias, TensorView g, TensorView beta) {
  OpScope prof(impl_->rt, [&] { return std::string("delta_rule_gates"); });
  KILN_CHECK(a.ndim() == 2 && a.shape == b.shape && a.shape == g.shape && a.shape == beta.shape &&
                 A_log.numel() == a.dim(1) && dt_bias.numel() == a.dim(1) && a.is_contiguous() &&
                 b.is_contiguous() && g.is_contiguous() && beta.is_contiguous(),
             "delta_rule_gates: a {} b {} A_log {}", a.shape.str(), b.shape.str(), A_log.shape.str());
  expect_f32(a, "gates a");
  expect_f32(b, "gates b");
  expect_f32(g, "gates g");
  expect_f32(beta, "gates beta");
  kops::delta_rule_gates(f32(a), f32(b), A_log.data, elem_of(A_log.dtype, "A_log"), dt_bias.data,
                         elem_of(dt_bias.dtype, "dt_bias"), a.dim(0), a.dim(1), f32_mut(g), f32_mut(beta),
                         impl_->rt.stream());
}

void CudaOps::gated_delta_rule_with_gates(const TensorView& q, const TensorView& k, const TensorView& v,
                                          const TensorView& a, const TensorView& b, const TensorView& A_log,
                                          const TensorView& dt_bias, TensorView g, TensorView beta, TensorView state,
                                          const StepLayout& step, DeltaRuleMode mode, TensorView out) {
  // The gates inside the recurrent kernel pay off for a few sequences only: each of the kernel's threads recomputes
  // them, which costs more than the launch it saves once the grid is large. The chunked kernel reads computed gates.
  if (delta_rule_chunked(step, mode) || step.num_seqs > kDeltaGatesFusedMaxSeqs) {
    delta_rule_gates(a, b, A_log, dt_bias, g, beta);
    gated_delta_rule(q, k, v, g, beta, state, step, mode, out);
    return;
  }
  const kops::DeltaGateArgs gates = delta_gate_args(a, b, A_log, dt_bias, g, beta);
  run_delta_rule(q, k, v, g, beta, state, step, mode, out, &gates);
}

void CudaOps::gated_delta_rule_norm(const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& a,
                                    const TensorView& b, const TensorView& A_log, const TensorView& dt_bias,
                                    TensorView g, TensorView beta, TensorView state, const StepLayout& step,
                                    DeltaRuleMode mode, const TensorView& z, const TensorView& norm_weight, float eps,
                                    TensorView core, TensorView out) {
  // Fused where the gates are (a few sequences, the recurrence), one block can hold a head's row, and every sequence
  // has one token: the fused kernel runs a head's tokens in one block of 32 warps (4 column groups), which is a launch
  // fewer for a decode step, but a verify pass's K + 1 tokens per sequence then run 4x the work per block in series
  // where the separate kernels spread the column groups over 4 blocks.
  if (!impl_->options.fused_decode_ops || delta_rule_chunked(step, mode) || step.num_seqs > kDeltaGatesFusedMaxSeqs ||
      step.num_tokens != step.num_seqs ||
      q.ndim() != 3 || v.ndim() != 3 || !kops::delta_rule_norm_supported(q.dim(2), v.dim(2))) {
    Ops::gated_delta_rule_norm(q, k, v, a, b, A_log, dt_bias, g, beta, state, step, mode, z, norm_weight, eps, core,
                               out);
    return;
  }
  const int64_t Dv = v.dim(2);
  const Shape rows{core.numel() / std::max<int64_t>(Dv, 1), Dv};
  KILN_CHECK(core.shape == v.shape && z.shape == rows && out.shape == rows && z.is_contiguous() && out.is_contiguous() &&
                 norm_weight.numel() == Dv,
             "gated_delta_rule_norm: core {} z {} out {} norm weight {}", core.shape.str(), z.shape.str(),
             out.shape.str(), norm_weight.shape.str());
  expect_f32(z, "gated_delta_rule_norm z");
  expect_f32(out, "gated_delta_rule_norm out");
  const kops::DeltaGateArgs gates = delta_gate_args(a, b, A_log, dt_bias, g, beta);
  const kops::DeltaNormArgs norm{f32(z), norm_weight.data, elem_of(norm_weight.dtype, "norm weight"), eps, f32_mut(out)};
  run_delta_rule(q, k, v, g, beta, state, step, mode, core, &gates, &norm);
}

kops::DeltaGateArgs CudaOps::delta_gate_args(const TensorView& a, const TensorView& b, const TensorView& A_log,
                                             const TensorView& dt_bias, const TensorView& g, const TensorView& beta) {
  KILN_CHECK(a.ndim() == 2 && a.shape == b.shape && a.shape == g.shape && a.shape == beta.shape &&
                 A_log.numel() == a.dim(1) && dt_bias.numel() == a.dim(1) && a.is_contiguous() && b.is_contiguous(),
             "gated_delta_rule gates: a {} b {} A_log {}", a.shape.str(), b.shape.str(), A_log.shape.str());
  expect_f32(a, "gates a");
  expect_f32(b, "gates b");
  kops::DeltaGateArgs gates;
  gates.a = f32(a);
  gates.b = f32(b);
  gates.A_log = A_log.data;
  gates.A_log_elem = elem_of(A_log.dtype, "A_log");
  gates.dt_bias = dt_bias.data;
  gates.dt_bias_elem = elem_of(dt_bias.dtype, "dt_bias");
  return gates;
}

bool CudaOps::delta_rule_chunked(const StepLayout& step, DeltaRuleMode mode) const {
  // Chunks of 64 tokens (the UT-transform form, parallel over a chunk's tokens) when the step has a sequence of >= 32
  // tokens and the caller asks for the chunked mode (prefill); the recurrence otherwise (decode). The tests can ask
  // for the chunked form on every step (CudaOptions::delta_rule).
  if (!step.host_token_checkpoint_slot.empty()) return false;  // position checkpoints: only the recurrence keeps them
  if (impl_->options.delta_rule == CudaOptions::DeltaRule::chunked) return true;
  return mode == DeltaRuleMode::chunked && step_args(step).max_seq_tokens >= kChunkedDeltaMinTokens;
}

void CudaOps::gated_delta_rule(const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& g,
                               const TensorView& beta, TensorView state, const StepLayout& step, DeltaRuleMode mode,
                               TensorView out) {
  run_delta_rule(q, k, v, g, beta, state, step, mode, out, nullptr);
}

void CudaOps::run_delta_rule(const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& g,
                             const TensorView& beta, TensorView state, const StepLayout& step, DeltaRuleMode mode,
                             TensorView out, const kops::DeltaGateArgs* raw_gates, const kops::DeltaNormArgs* norm) {
  OpScope prof(impl_->rt, [&] {
    return std::string(norm ? "gated_delta_rule+gates+norm" : raw_gates ? "gated_delta_rule+gates" : "gated_delta_rule");
  });
  KILN_CHECK(q.ndim() == 3 && k.shape == q.shape && v.ndim() == 3 && state.ndim() == 4, "gated_delta_rule: q {} v {}",
             q.shape.str(), v.shape.str());
  const int64_t T = q.dim(0), Hk = q.dim(1), Dk = q.dim(2), Hv = v.dim(1), Dv = v.dim(2);
  auto rows_ok = [](const TensorView& x) {  // [T, heads, D], heads contiguous, any row stride
    return x.strides[2] == 1 && x.strides[1] == x.dim(2) && (x.dim(0) <= 1 || x.strides[0] >= x.dim(1) * x.dim(2));
  };
  KILN_CHECK(Hv % Hk == 0 && v.dim(0) == T && T == step.num_tokens && state.dim(1) == Hv && state.dim(2) == Dk &&
                 state.dim(3) == Dv && g.numel() == T * Hv && beta.numel() == T * Hv && out.shape == v.shape &&
                 rows_ok(q) && rows_ok(k) && rows_ok(v) && g.is_contiguous() && beta.is_contiguous() &&
                 state.is_contiguous() && out.is_contiguous(),
             "gated_delta_rule: q {} v {} state {}", q.shape.str(), v.shape.str(), state.shape.str());
  const int64_t ldq = T > 1 ? q.strides[0] : Hk * Dk, ldk = T > 1 ? k.strides[0] : Hk * Dk,
                ldv = T > 1 ? v.strides[0] : Hv * Dv;
  for (const TensorView* t : std::initializer_list<const TensorView*>{&q, &k, &v, &g, &beta, &out})
    expect_f32(*t, "gated_delta_rule");
  KILN_CHECK(state.dtype == DType::F32 || state.dtype == DType::BF16, "gated_delta_rule: a {} state (F32 or BF16)",
             dtype_name(state.dtype));
  const kops::DeltaStateRef state_ref{state.data, state.dtype == DType::BF16};
  float* work = static_cast<float*>(impl_->rt.scratch(static_cast<size_t>(2 * T * Hk * Dk) * sizeof(float)));
  const bool chunked = delta_rule_chunked(step, mode);
  KILN_CHECK(!(chunked && (raw_gates || norm)),
             "gated_delta_rule: the chunked form reads computed gates and has no fused output norm");
  // The split form's workspace (W, U, P per chunk row: kernels.h gated_delta_rule_chunked_workspace_bytes, ~41 KiB
  // per token at the 35B-A3B's heads) from the scratch arena, which the memory plan counts (backend/device.cpp).
  const kops::StepArgs sa = step_args(step);
  const int parts = impl_->options.delta_rule_tf32_parts();
  void* split_ws = nullptr;
  if (chunked && impl_->options.delta_rule_split_active() &&
      kops::gated_delta_rule_chunked_split_supported(Hv, Dk, Dv, sa, parts))
    split_ws = impl_->rt.scratch(kops::gated_delta_rule_chunked_workspace_bytes(T, Hv, Dk, Dv, sa));
  kops::gated_delta_rule(f32(q), f32(k), f32(v), f32(g), f32(beta), state_ref, Hk, Hv, Dk, Dv, ldq, ldk, ldv, sa,
                         f32_mut(out), work, impl_->rt.stream(), chunked, raw_gates, norm, parts, split_ws);
}

// ---------------------------------------------------------------------------------------------------
// MoE

namespace {
// The range [begin, end) of a layer's experts this rank holds (an expert-parallel rank: one contiguous range; the
// others' weights are absent).
std::pair<int64_t, int64_t> held_experts(std::span<const model::ExpertWeights> experts) {
  KILN_CHECK(!experts.empty(), "moe_experts without experts");
  const int64_t n = static_cast<int64_t>(experts.size());
  int64_t begin = 0;
  while (begin < n && !experts[begin].gate.present()) ++begin;
  int64_t end = begin;
  while (end < n && experts[end].gate.present()) ++end;
  for (int64_t e = end; e < n; ++e)
    KILN_CHECK(!experts[e].gate.present(), "moe_experts: the held experts are not one range ({} after [{}, {}))", e,
               begin, end);
  KILN_CHECK(end > begin, "moe_experts: this rank holds none of the {} experts", n);
  return {begin, end};
}
}  // namespace

const CudaOps::Impl::ExpertTable* CudaOps::Impl::held_nvfp4_table(std::span<const model::ExpertWeights> experts,
                                                                  int64_t H, std::pair<int64_t, int64_t>& held) {
  held = held_experts(experts);
  if (held.second <= held.first || experts[static_cast<size_t>(held.first)].gate.format != WeightFormat::nvfp4)
    return nullptr;
  const ExpertTable& tab = expert_table(
      experts.subspan(static_cast<size_t>(held.first), static_cast<size_t>(held.second - held.first)), H);
  return tab.vec_ok ? &tab : nullptr;
}

void CudaOps::moe_route(const TensorView& logits, int top_k, bool renormalise, TensorView expert_ids,
                        TensorView weights) {
  OpScope prof(impl_->rt, [&] { return std::string("moe_route"); });
  KILN_CHECK(logits.ndim() == 2 && logits.is_contiguous(), "moe_route logits {}", logits.shape.str());
  const int64_t T = logits.dim(0), E = logits.dim(1);
  KILN_CHECK(top_k > 0 && top_k <= E, "top_k {} of {} experts", top_k, E);
  KILN_CHECK(expert_ids.numel() == T * top_k && weights.numel() == T * top_k, "moe_route outputs {} {}",
             expert_ids.shape.str(), weights.shape.str());
  expect_f32(logits, "moe_route logits");
  expect_i32(expert_ids, "moe_route ids");
  expect_f32(weights, "moe_route weights");
  kops::moe_route(f32(logits), T, E, top_k, renormalise, static_cast<int32_t*>(expert_ids.data), f32_mut(weights),
                  impl_->rt.stream());
}

void CudaOps::moe_experts(const TensorView& x, const TensorView& expert_ids, const TensorView& weights,
                          std::span<const model::ExpertWeights> experts, TensorView out) {
  OpScope prof(impl_->rt, [&] { return std::string(fmt::format("moe_experts {} x{}", model::weight_format_name(experts.front().gate.format), experts.size())); });
  run_moe_experts(x, expert_ids, weights, experts, nullptr, nullptr, out);
}

void CudaOps::moe_experts_shared(const TensorView& x, const TensorView& expert_ids, const TensorView& weights,
                                 std::span<const model::ExpertWeights> experts, TensorView shared,
                                 const TensorView& shared_gate, TensorView out) {
  OpScope prof(impl_->rt, [&] { return std::string(fmt::format("moe_experts+shared {} x{}", model::weight_format_name(experts.front().gate.format), experts.size())); });
  KILN_CHECK(shared.shape == x.shape && shared.is_contiguous() && shared_gate.numel() == x.dim(0) &&
                 shared_gate.is_contiguous(),
             "moe_experts_shared: shared {} gate {} for x {}", shared.shape.str(), shared_gate.shape.str(),
             x.shape.str());
  expect_f32(shared, "moe_experts shared");
  expect_f32(shared_gate, "moe_experts shared gate");
  run_moe_experts(x, expert_ids, weights, experts, f32(shared), f32(shared_gate), out);
}

CudaOps::Impl::ExpertTable& CudaOps::Impl::expert_table(std::span<const model::ExpertWeights> held, int64_t H) {
  // The device table of this layer's expert descriptors, built on first use. Placed weights are never freed while
  // the Ops lives, so the weight pointers identify the layer.
  ExpertTable& tab = expert_tables[held.data()];
  if (tab.count != held.size() || tab.first_gate != held.front().gate.weight.data ||
      tab.last_down != held.back().down.weight.data) {
    std::vector<kops::WeightDesc> descs;
    descs.reserve(3 * held.size());
    bool vec = true;
    int g2 = -2;  // -2: none seen yet
    const int64_t I = held.front().gate.out_features;
    for (const model::ExpertWeights& e : held) {
      KILN_CHECK(e.gate.out_features == I && e.up.out_features == I && e.down.in_features == I &&
                     e.gate.in_features == H && e.up.in_features == H && e.down.out_features == H,
                 "moe_experts: expert shapes gate [{}, {}] up [{}, {}] down [{}, {}] for hidden {}", e.gate.out_features,
                 e.gate.in_features, e.up.out_features, e.up.in_features, e.down.out_features, e.down.in_features, H);
      for (const LinearWeight* w : {&e.gate, &e.up, &e.down}) {
        descs.push_back(desc_of(*w));
        vec = vec && desc_vec_ok(descs.back());
        const int k = kops::gemv2_kind_host(descs.back());
        g2 = g2 == -2 ? k : (g2 == k ? g2 : -1);
      }
    }
    tab.table = DeviceBuffer(descs.size() * sizeof(kops::WeightDesc));
    KILN_CUDA_CHECK(cudaMemcpy(tab.table.data(), descs.data(), descs.size() * sizeof(kops::WeightDesc),
                               cudaMemcpyHostToDevice));
    tab.host = std::move(descs);
    tab.count = held.size();
    tab.first_gate = held.front().gate.weight.data;
    tab.last_down = held.back().down.weight.data;
    tab.vec_ok = vec;
    tab.wgmma_ok = tab.blas_ok = -1;
    tab.gemv2_kind = g2 < 0 ? -1 : g2;
    tab.inter = I;
  }
  return tab;
}

void CudaOps::moe_route_experts(const TensorView& x, const TensorView& logits, int top_k, bool renormalise,
                                std::span<const model::ExpertWeights> experts, TensorView shared,
                                const TensorView& shared_gate, TensorView expert_ids, TensorView weights,
                                TensorView out) {
  // Decode-sized steps with NVFP4 experts: routing and experts in two kernels (moe_decode_fused.cu). Anything else
  // (or --moe-runner-backend kiln-grouped): the ops one by one, each with its own profile row.
  const int64_t T = x.ndim() == 2 ? x.dim(0) : 0, H = x.ndim() == 2 ? x.dim(1) : 0;
  auto aligned = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; };  // null counts as aligned
  bool fused = impl_->options.moe_decode_fused && T >= 1 && T <= kops::kMoeDecodeMaxTokens && !experts.empty() &&
               aligned(x.data) && aligned(out.data) && aligned(shared.data);
  std::pair<int64_t, int64_t> held{0, 0};
  const Impl::ExpertTable* tab = fused ? impl_->held_nvfp4_table(experts, H, held) : nullptr;
  fused = tab && kops::moe_decode_fused_supported(T, H, tab->inter, static_cast<int64_t>(experts.size()), top_k,
                                                  tab->gemv2_kind);
  if (!fused) return model::Ops::moe_route_experts(x, logits, top_k, renormalise, experts, shared, shared_gate,
                                                   expert_ids, weights, out);
  OpScope prof(impl_->rt, [&] {
    return fmt::format("moe_route+experts{} nvfp4 x{} fused", shared.data ? "+shared" : "", experts.size());
  });
  const int64_t E = static_cast<int64_t>(experts.size());
  KILN_CHECK(x.ndim() == 2 && x.is_contiguous() && out.shape == x.shape && out.is_contiguous() &&
                 logits.ndim() == 2 && logits.is_contiguous() && logits.dim(0) == T && logits.dim(1) == E &&
                 expert_ids.numel() == T * top_k && weights.numel() == T * top_k && expert_ids.is_contiguous() &&
                 weights.is_contiguous(),
             "moe_route_experts: x {} logits {} ids {} weights {} out {} for {} experts", x.shape.str(),
             logits.shape.str(), expert_ids.shape.str(), weights.shape.str(), out.shape.str(), E);
  for (const TensorView* t : std::initializer_list<const TensorView*>{&x, &logits, &weights, &out})
    expect_f32(*t, "moe_route_experts");
  expect_i32(expert_ids, "moe_route_experts ids");
  if (shared.data) {
    KILN_CHECK(shared.shape == x.shape && shared.is_contiguous() && shared_gate.numel() == T &&
                   shared_gate.is_contiguous(),
               "moe_route_experts: shared {} gate {} for x {}", shared.shape.str(), shared_gate.shape.str(),
               x.shape.str());
    expect_f32(shared, "moe_route_experts shared");
    expect_f32(shared_gate, "moe_route_experts shared gate");
  }
  void* ws = impl_->rt.scratch(kops::moe_decode_fused_workspace_bytes(T, top_k, tab->inter));
  kops::moe_decode_fused(f32(logits), f32(x), T, H, E, top_k, renormalise, static_cast<int32_t*>(expert_ids.data),
                         f32_mut(weights), tab->table.as<kops::WeightDesc>(), static_cast<int32_t>(held.first),
                         held.second - held.first, tab->inter, ws, f32_mut(out),
                         shared.data ? f32(shared) : nullptr, shared.data ? f32(shared_gate) : nullptr,
                         impl_->options.mma_parts(), impl_->rt.stream());
}

namespace {
// What the persistent decode kernels read: 16-byte aligned pointers, F32 rows of a shape, dense BF16 [n, k] weights
// without a bias, and small F32 / BF16 parameter vectors of n.
bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }
bool f32_rows_of(const TensorView& t, const Shape& shape) {
  return t.dtype == DType::F32 && t.shape == shape && t.is_contiguous() && aligned16(t.data);
}
bool bf16_dense_of(const model::LinearWeight& w, int64_t n, int64_t k) {
  return w.format == WeightFormat::dense && w.weight.dtype == DType::BF16 && w.out_features == n &&
         w.in_features == k && !w.bias.data && w.weight.is_contiguous() && aligned16(w.weight.data);
}
bool small_param_of(const TensorView& t, int64_t n) {
  return t.data && t.numel() == n && t.is_contiguous() && (t.dtype == DType::F32 || t.dtype == DType::BF16);
}
}  // namespace

bool CudaOps::moe_block(const TensorView& x, const model::ResidualNorm* pre, const model::LinearWeight& router,
                        const model::LinearWeight& shared_gate_proj, const model::LinearWeight& shared_up_proj,
                        const model::LinearWeight& shared_down_proj, const model::LinearWeight& shared_expert_gate,
                        std::span<const model::ExpertWeights> experts, int top_k, bool renormalise, TensorView out) {
  // The block's input: x, or (pre) the residual stream the kernel adds y to and normalises itself.
  const TensorView& in = pre ? pre->hidden : x;
  if (!impl_->moe_block || in.ndim() != 2 || in.dim(0) < 1 || in.dim(0) > impl_->moe_block_max_tokens ||
      experts.empty())
    return false;
  const int64_t T = in.dim(0), H = in.dim(1), E = static_cast<int64_t>(experts.size()), Is = shared_gate_proj.out_features;
  auto f32_rows = [&](const TensorView& t) { return f32_rows_of(t, in.shape); };
  auto bf16_dense = bf16_dense_of;
  if (pre && (!f32_rows(pre->y) || pre->y.data == pre->hidden.data || !small_param_of(pre->weight, H) ||
              out.data == pre->hidden.data || out.data == pre->y.data))
    return false;
  if (!f32_rows(in) || !f32_rows(out) || !bf16_dense(router, E, H) ||
      !bf16_dense(shared_gate_proj, Is, H) || !bf16_dense(shared_up_proj, Is, H) ||
      !bf16_dense(shared_expert_gate, 1, H) || !bf16_dense(shared_down_proj, H, Is))
    return false;
  std::pair<int64_t, int64_t> held;
  const Impl::ExpertTable* table = impl_->held_nvfp4_table(experts, H, held);
  if (!table || table->gemv2_kind != 1 || !kops::moe_block_decode_supported(T, H, E, Is, table->inter, top_k))
    return false;
  const Impl::ExpertTable& tab = *table;
  OpScope prof(impl_->rt,
               [&] {
                 return fmt::format("moe_block {}router+shared+experts nvfp4 x{} T={} (one kernel)",
                                    pre ? "add_rms_norm+" : "", E, T);
               });
  kops::MoeBlockArgs a;
  if (pre) {
    a.residual = f32_mut(pre->hidden);
    a.residual_y = f32(pre->y);
    a.norm_w = pre->weight.data;
    a.norm_w_elem = elem_of(pre->weight.dtype, "norm weight");
    a.norm_eps = pre->eps;
    a.norm_zero_centred = pre->kind == NormKind::zero_centred;
  } else {
    a.x = f32(x);
  }
  a.T = static_cast<int>(T);
  a.H = static_cast<int>(H);
  a.router = router.weight.data;
  a.shared_gate_proj = shared_gate_proj.weight.data;
  a.shared_up_proj = shared_up_proj.weight.data;
  a.shared_expert_gate = shared_expert_gate.weight.data;
  a.shared_down_proj = shared_down_proj.weight.data;
  a.E = static_cast<int>(E);
  a.Is = static_cast<int>(Is);
  a.top_k = top_k;
  a.renormalise = renormalise;
  a.experts = tab.table.as<kops::WeightDesc>();
  a.held_begin = static_cast<int>(held.first);
  a.E_held = static_cast<int>(held.second - held.first);
  a.I = static_cast<int>(tab.inter);
  a.bf16_expert_inputs = impl_->bf16();
  a.workspace = impl_->rt.scratch(kops::moe_block_decode_workspace_bytes(T, E, Is, top_k, tab.inter));
  a.barrier = impl_->persistent_barrier;
  a.out = f32_mut(out);
  a.prefetch = impl_->options.persistent_prefetch;
  kops::moe_block_decode(a, impl_->persistent_grid, impl_->rt.stream());
  return true;
}

bool CudaOps::deltanet_block(const model::ResidualNorm& in, const DeltaNetBlockWeights& w, TensorView conv_state,
                             TensorView state, const StepLayout& step, float eps, TensorView out) {
  // Decode steps only: one token per sequence, no position checkpoints (those take the unfused ops).
  const int64_t T = step.num_tokens;
  if (!impl_->deltanet_block || T < 1 || T > impl_->deltanet_block_max_tokens || T != step.num_seqs ||
      !step.host_token_checkpoint_slot.empty() || in.hidden.ndim() != 2 || in.hidden.dim(0) != T)
    return false;
  const int64_t H = in.hidden.dim(1), Hk = w.Hk, Hv = w.Hv, Dk = w.Dk, Dv = w.Dv;
  if (!kops::deltanet_block_decode_supported(T, H, Hk, Hv, Dk, Dv)) return false;
  const int64_t C = 2 * Hk * Dk + Hv * Dv, Kc = 4;
  auto f32_rows = [&](const TensorView& t) { return f32_rows_of(t, in.hidden.shape); };
  auto bf16_dense = [](const LinearWeight* lw, int64_t n, int64_t k) { return lw && bf16_dense_of(*lw, n, k); };
  auto small = small_param_of;
  if (!f32_rows(in.hidden) || (in.y.data && (!f32_rows(in.y) || in.y.data == in.hidden.data)) ||
      !small(in.weight, H) || !f32_rows(out) || out.data == in.hidden.data || (in.y.data && out.data == in.y.data) ||
      !bf16_dense(w.in_proj_qkv, C, H) || !bf16_dense(w.in_proj_z, Hv * Dv, H) || !bf16_dense(w.in_proj_b, Hv, H) ||
      !bf16_dense(w.in_proj_a, Hv, H) || !bf16_dense(w.out_proj, H, Hv * Dv) || !small(w.conv1d, C * Kc) ||
      !small(w.A_log, Hv) || !small(w.dt_bias, Hv) || !small(w.norm, Dv))
    return false;
  if (conv_state.dtype != DType::F32 || conv_state.ndim() != 3 || conv_state.dim(1) != C ||
      conv_state.dim(2) != Kc - 1 || !conv_state.is_contiguous() ||
      (state.dtype != DType::F32 && state.dtype != DType::BF16) || state.ndim() != 4 || state.dim(1) != Hv ||
      state.dim(2) != Dk || state.dim(3) != Dv || !state.is_contiguous())
    return false;
  OpScope prof(impl_->rt, [&] {
    return fmt::format("deltanet_block {}rms_norm+in_proj+conv+delta_rule+norm+out_proj T={} (one kernel)",
                       in.y.data ? "add_" : "", T);
  });
  kops::DeltaNetBlockArgs a;
  a.T = static_cast<int>(T);
  a.H = static_cast<int>(H);
  a.residual = f32_mut(in.hidden);
  a.residual_y = in.y.data ? f32(in.y) : nullptr;
  a.in_norm_w = in.weight.data;
  a.in_norm_elem = elem_of(in.weight.dtype, "norm weight");
  a.in_norm_eps = in.eps;
  a.in_norm_zero_centred = in.kind == NormKind::zero_centred;
  a.w_qkv = w.in_proj_qkv->weight.data;
  a.w_z = w.in_proj_z->weight.data;
  a.w_b = w.in_proj_b->weight.data;
  a.w_a = w.in_proj_a->weight.data;
  a.Hk = static_cast<int>(Hk);
  a.Hv = static_cast<int>(Hv);
  a.Dk = static_cast<int>(Dk);
  a.Dv = static_cast<int>(Dv);
  a.conv_w = w.conv1d.data;
  a.conv_elem = elem_of(w.conv1d.dtype, "conv1d weight");
  a.conv_state = static_cast<float*>(conv_state.data);
  a.A_log = w.A_log.data;
  a.A_log_elem = elem_of(w.A_log.dtype, "A_log");
  a.dt_bias = w.dt_bias.data;
  a.dt_bias_elem = elem_of(w.dt_bias.dtype, "dt_bias");
  a.state = kops::DeltaStateRef{state.data, state.dtype == DType::BF16};
  a.state_slot = static_cast<const int32_t*>(step.seq_state_slot.data);
  a.out_norm_w = w.norm.data;
  a.out_norm_elem = elem_of(w.norm.dtype, "norm weight");
  a.out_norm_eps = eps;
  a.w_out = w.out_proj->weight.data;
  a.workspace = impl_->rt.scratch(kops::deltanet_block_decode_workspace_bytes(T, Hk, Hv, Dk, Dv));
  a.barrier = impl_->persistent_barrier;
  a.out = f32_mut(out);
  a.prefetch = impl_->options.persistent_prefetch;
  kops::deltanet_block_decode(a, impl_->persistent_grid, impl_->rt.stream());
  return true;
}

void CudaOps::run_moe_experts(const TensorView& x, const TensorView& expert_ids, const TensorView& weights,
                              std::span<const model::ExpertWeights> experts, const float* shared,
                              const float* shared_gate, TensorView out) {
  KILN_CHECK(x.ndim() == 2 && x.is_contiguous() && out.shape == x.shape && out.is_contiguous() &&
                 expert_ids.ndim() == 2 && expert_ids.dim(0) == x.dim(0) && weights.shape == expert_ids.shape,
             "moe_experts x {} ids {} weights {}", x.shape.str(), expert_ids.shape.str(), weights.shape.str());
  expect_f32(x, "moe_experts x");
  expect_i32(expert_ids, "moe_experts ids");
  expect_f32(weights, "moe_experts weights");
  expect_f32(out, "moe_experts out");
  KILN_CHECK(!experts.empty(), "moe_experts without experts");
  const int64_t T = x.dim(0), H = x.dim(1), k = expert_ids.dim(1);
  // An expert-parallel rank holds one contiguous range of the layer's experts (format/shard_plan.h); the others'
  // are absent. Its pairs are renumbered into that range, the rest skipped (their share comes from other ranks
  // through the all-reduce after the block).
  const auto [held_begin, held_end] = held_experts(experts);
  const int32_t* ids = i32(expert_ids);
  if (held_begin > 0 || held_end < static_cast<int64_t>(experts.size())) {
    auto* local = static_cast<int32_t*>(impl_->rt.scratch(static_cast<size_t>(expert_ids.numel()) * 4));
    kops::moe_local_ids(ids, expert_ids.numel(), static_cast<int32_t>(held_begin),
                        static_cast<int32_t>(held_end - held_begin), local, impl_->rt.stream());
    ids = local;
    experts = experts.subspan(static_cast<size_t>(held_begin), static_cast<size_t>(held_end - held_begin));
  }
  const int64_t E = static_cast<int64_t>(experts.size());

  Impl::ExpertTable& tab = impl_->expert_table(experts, H);
  // Prefill-sized steps (cuda_options.h, moe_prefill_path: bf16 inputs): on sm_90 the wgmma grouped GEMMs (FP4
  // decoded in registers), else from kMoePrefillBlasMinTokens the experts that received tokens dequantised to bf16 +
  // cuBLAS grouped GEMMs (not under graph capture). Their per-pass buffers come from the scratch arena (no more than
  // moe_workspace_bytes, which the plan sizes); the dequantised path's weight scratch is one reusable buffer the plan
  // adds.
  const CudaOptions& o = impl_->options;
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  KILN_CUDA_CHECK(cudaStreamIsCapturing(impl_->rt.stream(), &capture));
  const CudaDeviceProbe& dev = impl_->rt.device();
  const bool bf16 = o.dtype == CudaOptions::ActivationDtype::bfloat16;
  // The paths' shape checks walk the expert table: once per table, and only when a step would take the path.
  const bool capturing = capture != cudaStreamCaptureStatusNone;
  MoePrefillPath path = o.moe_tensor_cores && reinterpret_cast<uintptr_t>(x.data) % 16 == 0
                            ? moe_prefill_path(o.moe_prefill, T, bf16, dev.major, true, capturing)
                            : MoePrefillPath::mma;
  if (path == MoePrefillPath::wgmma && tab.wgmma_ok < 0)
    tab.wgmma_ok = kops::moe_prefill_wgmma_supported(dev.major, dev.minor, H, tab.inter, tab.gemv2_kind, tab.vec_ok,
                                                     tab.host.data(), E);
  if (path == MoePrefillPath::wgmma && !tab.wgmma_ok)
    path = moe_prefill_path(o.moe_prefill, T, bf16, dev.major, false, capturing);
  if (path == MoePrefillPath::blas && tab.blas_ok < 0)
    tab.blas_ok = kops::moe_prefill_blas_supported(H, tab.inter, tab.gemv2_kind, tab.vec_ok, tab.host.data(), E);
  if (path == MoePrefillPath::wgmma) {
    void* ws = impl_->rt.scratch(kops::moe_prefill_wgmma_workspace_bytes(T, static_cast<int>(k), E, H, tab.inter,
                                                                         o.moe_wgmma_tile_rows));
    kops::moe_prefill_wgmma(f32(x), T, H, ids, f32(weights), static_cast<int>(k), tab.table.as<kops::WeightDesc>(), E,
                            tab.inter, ws, f32_mut(out), shared, shared_gate, impl_->rt.stream(),
                            kops::MoeWgmmaForm{o.moe_wgmma_tile_rows, o.moe_wgmma_producer, o.moe_wgmma_down_walk,
                                               o.moe_wgmma_narrow, o.moe_group_wide});
    return;
  }
  if (path == MoePrefillPath::blas && tab.blas_ok) {
    if (!impl_->moe_blas) impl_->moe_blas = std::make_unique<kops::MoePrefillBlas>();
    const size_t expert_bytes = kops::moe_prefill_blas_expert_bytes(H, tab.inter);
    const size_t wbytes =
        std::max(expert_bytes, std::min(kMoePrefillWeightScratchBytes, expert_bytes * static_cast<size_t>(E)));
    void* wbuf = impl_->rt.reusable(impl_->moe_blas_weights, wbytes);
    void* ws = impl_->rt.scratch(kops::moe_prefill_blas_workspace_bytes(T, static_cast<int>(k), E, H, tab.inter));
    impl_->moe_blas->run(f32(x), T, H, ids, f32(weights), static_cast<int>(k), tab.table.as<kops::WeightDesc>(),
                         tab.host.data(), E, tab.inter, ws, wbuf, wbytes, f32_mut(out), shared, shared_gate,
                         impl_->rt.stream());
    return;
  }
  const size_t ws_bytes = kops::moe_workspace_bytes(T, static_cast<int>(k), E, H, tab.inter);
  void* ws = impl_->rt.scratch(ws_bytes);
  kops::moe_experts(f32(x), T, H, ids, f32(weights), static_cast<int>(k),
                    tab.table.as<kops::WeightDesc>(), tab.vec_ok, tab.gemv2_kind, E, tab.inter, ws, f32_mut(out),
                    impl_->rt.stream(), impl_->options.moe_tensor_cores, shared, shared_gate,
                    impl_->options.mma_parts());
}

std::optional<model::DeviceMemory> CudaOps::device_memory() const {
  model::DeviceMemory d;
  const CudaDeviceProbe& dev = device();
  d.device = dev.index;
  d.name = dev.name;
  d.total_bytes = static_cast<int64_t>(dev.memory_bytes);
  d.weight_bytes = static_cast<int64_t>(weight_bytes());
  d.scratch_bytes = static_cast<int64_t>(scratch_bytes());
  return d;
}

}  // namespace kiln::backend::cuda
