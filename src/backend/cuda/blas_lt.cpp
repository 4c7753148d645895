// BlasLt (blas_lt.h). Row-major out[m, n] = x[m, k] . w[n, k]^T is computed as the column-major
// product out^T[n, m] = op_T(w)[n, k] . x^T[k, m]. One heuristic query per distinct shape, cached.
#include "backend/cuda/blas_lt.h"

#include <cublasLt.h>

#include <memory>

#include "backend/cuda/cuda_check.h"
#include "core/error.h"

namespace kiln::cuda {

struct BlasLt::Plan {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
  cublasLtMatmulAlgo_t algo{};
  ~Plan() {
    if (c) cublasLtMatrixLayoutDestroy(c);
    if (b) cublasLtMatrixLayoutDestroy(b);
    if (a) cublasLtMatrixLayoutDestroy(a);
    if (op) cublasLtMatmulDescDestroy(op);
  }
};

BlasLt::BlasLt(size_t workspace_bytes) : workspace_bytes_(workspace_bytes) {
  cublasLtHandle_t h = nullptr;
  KILN_CUBLAS_CHECK(cublasLtCreate(&h));
  handle_ = h;
  if (workspace_bytes_) KILN_CUDA_CHECK(cudaMalloc(&workspace_, workspace_bytes_));
}

BlasLt::~BlasLt() {
  for (auto& [key, plan] : plans_) delete plan;
  if (workspace_) cudaFree(workspace_);
  if (handle_) cublasLtDestroy(static_cast<cublasLtHandle_t>(handle_));
}

BlasLt::Plan* BlasLt::plan_for(bool out_f32, int m, int n, int k, int64_t ldx, int64_t ldw, int64_t ldo,
                               Align align) {
  const auto key = std::make_tuple(out_f32, m, n, k, ldx, ldw, ldo, align.w, align.x, align.out);
  if (auto it = plans_.find(key); it != plans_.end()) return it->second;
  auto plan = std::make_unique<Plan>();
  KILN_CUBLAS_CHECK(cublasLtMatmulDescCreate(&plan->op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  const cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
  KILN_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan->op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta)));
  KILN_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan->op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb)));
  KILN_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&plan->a, CUDA_R_16BF, k, n, ldw));
  KILN_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&plan->b, CUDA_R_16BF, k, m, ldx));
  KILN_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&plan->c, out_f32 ? CUDA_R_32F : CUDA_R_16BF, n, m, ldo));

  cublasLtMatmulPreference_t pref = nullptr;
  KILN_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
  const size_t ws = workspace_bytes_;
  KILN_CUBLAS_CHECK(
      cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws)));
  const cublasLtMatmulPreferenceAttributes_t align_attr[4] = {
      CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
      CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES};
  const uint32_t align_bytes[4] = {align.w, align.x, align.out, align.out};
  for (int i = 0; i < 4; ++i)
    KILN_CUBLAS_CHECK(
        cublasLtMatmulPreferenceSetAttribute(pref, align_attr[i], &align_bytes[i], sizeof(align_bytes[i])));
  cublasLtMatmulHeuristicResult_t result{};
  int found = 0;
  const cublasStatus_t st = cublasLtMatmulAlgoGetHeuristic(static_cast<cublasLtHandle_t>(handle_), plan->op, plan->a,
                                                           plan->b, plan->c, plan->c, pref, 1, &result, &found);
  cublasLtMatmulPreferenceDestroy(pref);
  if (st != CUBLAS_STATUS_SUCCESS || found == 0)
    fail("cuBLASLt has no bf16 GEMM for m={} n={} k={} (ld x={} w={} out={})", m, n, k, ldx, ldw, ldo);
  plan->algo = result.algo;
  Plan* raw = plan.release();
  plans_.emplace(key, raw);
  return raw;
}

void BlasLt::gemm(const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t ldw, void* out, int64_t ldo,
                  bool out_f32, int m, int n, int k, cudaStream_t stream, float alpha, float beta) {
  if (m <= 0 || n <= 0) return;
  auto align_of = [](const void* p) {
    const uintptr_t a = reinterpret_cast<uintptr_t>(p);
    return static_cast<uint32_t>(a % 256 == 0 ? 256 : a & (~a + 1));  // the lowest set bit, at most 256
  };
  Plan* plan = plan_for(out_f32, m, n, k, ldx, ldw, ldo, Align{align_of(w), align_of(x), align_of(out)});
  KILN_CUBLAS_CHECK(cublasLtMatmul(static_cast<cublasLtHandle_t>(handle_), plan->op, &alpha, w, plan->a, x, plan->b,
                                   &beta, out, plan->c, out, plan->c, &plan->algo, workspace_, workspace_bytes_,
                                   stream));
}

}  // namespace kiln::cuda
