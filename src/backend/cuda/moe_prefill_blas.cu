// The NVFP4 routed experts of large steps: dequantised bf16 weights + cuBLAS grouped GEMMs (moe_prefill_blas.h).
// Row-major out[r, n] = x[r, k] . W[n, k]^T is the column-major product out^T[n, r] = op_T(W)[n, k] . x^T[k, r]
// (as in blas_lt.cpp): transa T, transb N, m = out features, n = the expert's rows, k = in features.
#include <cublas_v2.h>
#include <cuda_bf16.h>

#include <algorithm>

#include "backend/cuda/cuda_check.h"
#include "backend/cuda/device.cuh"
#include "backend/cuda/launch.cuh"
#include "backend/cuda/moe_prefill_blas.h"

namespace kiln::cuda::ops {
namespace {

using namespace dev;

static_assert(sizeof(cublasOperation_t) == sizeof(int), "the host arrays hold cublasOperation_t as int");


// xs[r, :] = bf16(x[row_token[r], :]) for the first `rows` sorted rows; 8 columns a thread (H % 8 == 0, x 16-byte
// aligned).
__global__ void gather_rows_bf16_kernel(const float* __restrict__ x, int64_t H, const int32_t* __restrict__ row_token,
                                        int64_t rows, uint16_t* __restrict__ xs) {
  dev::pdl_enter();  // first statement: see launch.cuh
  const int64_t per_row = H / 8, n = rows * per_row;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = i / per_row, c = i - r * per_row;
    const float4* src = reinterpret_cast<const float4*>(x + int64_t(row_token[r]) * H + c * 8);
    const float4 a = src[0], b = src[1];
    *reinterpret_cast<uint4*>(xs + r * H + c * 8) =
        make_uint4(pack_bf16x2(a.x, a.y), pack_bf16x2(a.z, a.w), pack_bf16x2(b.x, b.y), pack_bf16x2(b.z, b.w));
  }
}

// The weights of experts batch[0 .. gridDim.y) into slot s = blockIdx.y of wbuf: [2I, H] gate rows then up rows,
// then [H, I] down, each element e2m1 * e4m3 block scale (exact in bf16: 2 x 4 significant bits); the per-tensor
// scale_2 is the GEMM's alpha. A thread decodes one 16-element scale block: 8 bytes of codes (low nibble first, as
// weight_at reads them) into 32 bytes of bf16.
__global__ void dequant_experts_kernel(const WeightDesc* __restrict__ experts, const int32_t* __restrict__ batch,
                                       int64_t H, int64_t I, uint16_t* __restrict__ wbuf) {
  dev::pdl_enter();  // first statement: see launch.cuh
  const int64_t s = blockIdx.y;
  const int64_t e = batch[s];
  const int64_t hb = H / 16, ib = I / 16;
  const int64_t chunks_gu = 2 * I * hb, chunks = chunks_gu + H * ib;
  uint16_t* base = wbuf + s * 3 * I * H;
  for (int64_t j = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; j < chunks; j += int64_t(gridDim.x) * blockDim.x) {
    const WeightDesc* w;
    int64_t row, c, kdim;
    uint16_t* dst;
    if (j < chunks_gu) {
      const int64_t r = j / hb;
      c = j - r * hb;
      w = &experts[3 * e + (r < I ? 0 : 1)];
      row = r < I ? r : r - I;
      kdim = H;
      dst = base + r * H + c * 16;
    } else {
      const int64_t j2 = j - chunks_gu;
      row = j2 / ib;
      c = j2 - row * ib;
      w = &experts[3 * e + 2];
      kdim = I;
      dst = base + 2 * I * H + row * I + c * 16;
    }
    const uint2 codes = *reinterpret_cast<const uint2*>(static_cast<const uint8_t*>(w->data) + row * (kdim / 2) + c * 8);
    const float bs = e4m3_to_f32(w->block_scale[row * (kdim / 16) + c]);
    uint32_t o[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const uint32_t byte = ((i < 4 ? codes.x : codes.y) >> (8 * (i & 3))) & 0xffu;
      o[i] = pack_bf16x2(e2m1_to_f32(byte & 0xfu) * bs, e2m1_to_f32(byte >> 4) * bs);
    }
    uint4* d = reinterpret_cast<uint4*>(dst);
    d[0] = make_uint4(o[0], o[1], o[2], o[3]);
    d[1] = make_uint4(o[4], o[5], o[6], o[7]);
  }
}

// act[r, i] = bf16(silu(gu[r, i]) * gu[r, I + i]) for `rows` rows (fp32 maths, as the mma kernels); 8 columns a
// thread (I % 8 == 0).
__global__ void silu_mul_bf16_kernel(const uint16_t* __restrict__ gu, int64_t I, int64_t rows,
                                     uint16_t* __restrict__ act) {
  dev::pdl_enter();  // first statement: see launch.cuh
  const int64_t per_row = I / 8, n = rows * per_row;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = i / per_row, c = i - r * per_row;
    const uint4 g = *reinterpret_cast<const uint4*>(gu + r * 2 * I + c * 8);
    const uint4 u = *reinterpret_cast<const uint4*>(gu + r * 2 * I + I + c * 8);
    const uint32_t gw[4] = {g.x, g.y, g.z, g.w}, uw[4] = {u.x, u.y, u.z, u.w};
    uint32_t o[4];
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      const float g0 = bf16_to_f32(uint16_t(gw[q] & 0xffffu)), g1 = bf16_to_f32(uint16_t(gw[q] >> 16));
      const float u0 = bf16_to_f32(uint16_t(uw[q] & 0xffffu)), u1 = bf16_to_f32(uint16_t(uw[q] >> 16));
      o[q] = pack_bf16x2(silu(g0) * u0, silu(g1) * u1);
    }
    *reinterpret_cast<uint4*>(act + r * I + c * 8) = make_uint4(o[0], o[1], o[2], o[3]);
  }
}

unsigned rows_grid(int64_t n, int threads) {
  return static_cast<unsigned>(std::max<int64_t>(1, std::min<int64_t>((n + threads - 1) / threads, 1 << 20)));
}

size_t align16(size_t n) { return (n + 15) / 16 * 16; }

// The device copy of the GEMM arguments for up to n active experts (n = min(E, pairs)): their ids, then the A, B, C
// pointer arrays (3n problems each: up to 2 gate/up problems and one down problem per expert).
size_t param_bytes(int64_t n) { return align16(static_cast<size_t>(n) * 4) + static_cast<size_t>(9 * n) * 8; }
int64_t max_active(int64_t T, int top_k, int64_t E) { return std::min<int64_t>(E, T * top_k); }

struct Carve {
  void* groups;
  uint16_t *xs, *gu, *act, *y;
  char* params;
  size_t bytes;
};
Carve carve(void* base, int64_t T, int top_k, int64_t E, int64_t H, int64_t I) {
  const size_t P = static_cast<size_t>(T * top_k);
  Carve c{};
  WorkspaceCarve w(base);
  auto take = [&](size_t n) { return w.take(n); };
  c.groups = take(moe_row_groups_bytes(T, top_k, E));
  c.xs = static_cast<uint16_t*>(take(P * H * 2));
  c.gu = static_cast<uint16_t*>(take(P * 2 * I * 2));
  c.act = static_cast<uint16_t*>(take(P * I * 2));
  c.y = static_cast<uint16_t*>(take(P * H * 2));
  c.params = static_cast<char*>(take(param_bytes(max_active(T, top_k, E))));
  c.bytes = w.bytes;
  return c;
}

}  // namespace

bool moe_prefill_blas_supported(int64_t H, int64_t I, int experts_gemv2_kind, bool experts_vec_ok,
                                const WeightDesc* host_experts, int64_t E) {
  if (experts_gemv2_kind != 1 || !experts_vec_ok || H % 16 != 0 || I % 16 != 0 || H <= 0 || I <= 0 || E <= 0)
    return false;
  if (H > (int64_t(1) << 30) || I > (int64_t(1) << 30)) return false;
  for (int64_t i = 0; i < 3 * E; ++i) {
    const WeightDesc& w = host_experts[i];
    if (w.kind != WeightKind::nvfp4 || w.bias || reinterpret_cast<uintptr_t>(w.data) % 16 != 0) return false;
  }
  return true;
}

size_t moe_prefill_blas_expert_bytes(int64_t H, int64_t I) { return static_cast<size_t>(3 * H * I) * 2; }

size_t moe_prefill_blas_workspace_bytes(int64_t T, int top_k, int64_t E, int64_t H, int64_t I) {
  return carve(nullptr, T, top_k, E, H, I).bytes;
}

MoePrefillBlas::MoePrefillBlas() {
  cublasHandle_t h = nullptr;
  KILN_CUBLAS_CHECK(cublasCreate(&h));
  handle_ = h;
}

MoePrefillBlas::~MoePrefillBlas() {
  if (handle_) cublasDestroy(static_cast<cublasHandle_t>(handle_));
  if (host_) cudaFreeHost(host_);
}

void MoePrefillBlas::host_reserve(size_t bytes) {
  if (bytes <= host_bytes_) return;
  // The caller has synchronised the stream: no copy from or into the old buffer is in flight.
  if (host_) KILN_CUDA_CHECK(cudaFreeHost(host_));
  host_ = nullptr;
  host_bytes_ = 0;
  KILN_CUDA_CHECK(cudaMallocHost(&host_, bytes));
  host_bytes_ = bytes;
}

void MoePrefillBlas::run(const float* x, int64_t T, int64_t H, const int32_t* ids, const float* weights, int top_k,
                         const WeightDesc* experts_dev, const WeightDesc* experts_host, int64_t E, int64_t I,
                         void* workspace, void* weight_scratch, size_t weight_scratch_bytes, float* out,
                         const float* shared, const float* shared_gate, Stream stream) {
  if (T == 0) return;
  const size_t expert_bytes = moe_prefill_blas_expert_bytes(H, I);
  if (weight_scratch_bytes < expert_bytes)
    cuda_fail("moe_prefill_blas: a weight scratch of {} bytes holds no expert of {} bytes",
              {static_cast<int64_t>(weight_scratch_bytes), static_cast<int64_t>(expert_bytes)});
  const Carve c = carve(workspace, T, top_k, E, H, I);
  const MoeRowGroups g = moe_group_rows(ids, T, top_k, E, c.groups, stream);
  profile_mark("group");

  // Each expert's rows, on the host (the GEMM shapes). The previous call's argument copy from the pinned buffer is
  // earlier in stream order than this copy back, so after the synchronisation the host may overwrite it.
  const int64_t n_max = max_active(T, top_k, E);
  const size_t off_bytes = align16(static_cast<size_t>(E + 1) * 4);
  if (off_bytes + param_bytes(n_max) > host_bytes_) {
    KILN_CUDA_CHECK(cudaStreamSynchronize(stream));
    host_reserve(off_bytes + param_bytes(n_max));
  }
  int32_t* h_off = static_cast<int32_t*>(host_);
  KILN_CUDA_CHECK(cudaMemcpyAsync(h_off, g.group_offset, static_cast<size_t>(E + 1) * 4, cudaMemcpyDeviceToHost, stream));
  KILN_CUDA_CHECK(cudaStreamSynchronize(stream));
  const int64_t rows = h_off[E];

  if (rows > 0) {
    launch_kernel(gather_rows_bf16_kernel, rows_grid(rows * (H / 8), 256), 256, 0, stream, x, H, g.row_token, rows,
                  c.xs);
    KILN_CUDA_CHECK_LAUNCH();
    profile_mark("gather x");

    // The arguments of every problem: gate/up problems first (one per expert when gate and up share scale_2, else
    // two), then one down problem per expert; experts in batches of consecutive active ones.
    char* hp = static_cast<char*>(host_) + off_bytes;
    int32_t* h_active = reinterpret_cast<int32_t*>(hp);
    void** h_ptr = reinterpret_cast<void**>(hp + align16(static_cast<size_t>(n_max) * 4));
    void** hA = h_ptr;
    void** hB = h_ptr + 3 * n_max;
    void** hC = h_ptr + 6 * n_max;
    int64_t n_active = 0;
    for (int64_t e = 0; e < E; ++e)
      if (h_off[e + 1] > h_off[e]) h_active[n_active++] = static_cast<int32_t>(e);
    const int64_t per_batch = std::max<int64_t>(1, static_cast<int64_t>(weight_scratch_bytes / expert_bytes));
    uint16_t* wbuf = static_cast<uint16_t*>(weight_scratch);
    for (auto* v : {&transa_, &transb_, &m_, &n_, &k_, &lda_, &ldb_, &ldc_, &group_size_}) v->clear();
    alpha_.clear();
    beta_.clear();
    std::vector<int64_t> gu_first(static_cast<size_t>(n_active) + 1, 0);
    auto problem = [&](int m, int n, int k, int lda, int ldb, int ldc, float alpha, const void* A, const void* B,
                       void* C) {
      const size_t p = m_.size();
      transa_.push_back(CUBLAS_OP_T);
      transb_.push_back(CUBLAS_OP_N);
      m_.push_back(m);
      n_.push_back(n);
      k_.push_back(k);
      lda_.push_back(lda);
      ldb_.push_back(ldb);
      ldc_.push_back(ldc);
      alpha_.push_back(alpha);
      beta_.push_back(0.0f);
      group_size_.push_back(1);
      hA[p] = const_cast<void*>(A);
      hB[p] = const_cast<void*>(B);
      hC[p] = C;
    };
    const int h = static_cast<int>(H), i = static_cast<int>(I);
    for (int64_t a = 0; a < n_active; ++a) {
      const int64_t e = h_active[a], r0 = h_off[e], nr = h_off[e + 1] - r0;
      const uint16_t* wgu = wbuf + (a % per_batch) * 3 * I * H;
      const WeightDesc &gate = experts_host[3 * e], &up = experts_host[3 * e + 1];
      gu_first[static_cast<size_t>(a)] = static_cast<int64_t>(m_.size());
      if (gate.scale == up.scale) {
        problem(2 * i, static_cast<int>(nr), h, h, h, 2 * i, gate.scale, wgu, c.xs + r0 * H, c.gu + r0 * 2 * I);
      } else {
        problem(i, static_cast<int>(nr), h, h, h, 2 * i, gate.scale, wgu, c.xs + r0 * H, c.gu + r0 * 2 * I);
        problem(i, static_cast<int>(nr), h, h, h, 2 * i, up.scale, wgu + I * H, c.xs + r0 * H, c.gu + r0 * 2 * I + I);
      }
    }
    const int64_t n_gu = static_cast<int64_t>(m_.size());
    gu_first[static_cast<size_t>(n_active)] = n_gu;
    for (int64_t a = 0; a < n_active; ++a) {
      const int64_t e = h_active[a], r0 = h_off[e], nr = h_off[e + 1] - r0;
      const uint16_t* wd = wbuf + (a % per_batch) * 3 * I * H + 2 * I * H;
      problem(h, static_cast<int>(nr), i, i, i, h, experts_host[3 * e + 2].scale, wd, c.act + r0 * I, c.y + r0 * H);
    }
    KILN_CUDA_CHECK(cudaMemcpyAsync(c.params, hp, param_bytes(n_max), cudaMemcpyHostToDevice, stream));
    const int32_t* d_active = reinterpret_cast<const int32_t*>(c.params);
    void** d_ptr = reinterpret_cast<void**>(c.params + align16(static_cast<size_t>(n_max) * 4));
    void** dA = d_ptr;
    void** dB = d_ptr + 3 * n_max;
    void** dC = d_ptr + 6 * n_max;

    auto h_blas = static_cast<cublasHandle_t>(handle_);
    KILN_CUBLAS_CHECK(cublasSetStream(h_blas, stream));
    auto grouped = [&](int64_t p0, int64_t count) {
      KILN_CUBLAS_CHECK(cublasGemmGroupedBatchedEx(
          h_blas, reinterpret_cast<const cublasOperation_t*>(transa_.data() + p0),
          reinterpret_cast<const cublasOperation_t*>(transb_.data() + p0), m_.data() + p0, n_.data() + p0,
          k_.data() + p0, alpha_.data() + p0, const_cast<const void* const*>(dA + p0), CUDA_R_16BF, lda_.data() + p0,
          const_cast<const void* const*>(dB + p0), CUDA_R_16BF, ldb_.data() + p0, beta_.data() + p0,
          const_cast<void* const*>(dC + p0), CUDA_R_16BF, ldc_.data() + p0, static_cast<int>(count),
          group_size_.data() + p0, CUBLAS_COMPUTE_32F));
    };
    for (int64_t a0 = 0; a0 < n_active; a0 += per_batch) {
      const int64_t a1 = std::min(n_active, a0 + per_batch);
      const int64_t chunks = 3 * I * H / 16;
      launch_kernel(dequant_experts_kernel, dim3(rows_grid(chunks, 256), static_cast<unsigned>(a1 - a0)), 256, 0, stream,
                    experts_dev, d_active + a0, H, I, wbuf);
      KILN_CUDA_CHECK_LAUNCH();
      profile_mark("dequant");
      grouped(gu_first[static_cast<size_t>(a0)], gu_first[static_cast<size_t>(a1)] - gu_first[static_cast<size_t>(a0)]);
      profile_mark("gate_up gemm");
      const int64_t r0 = h_off[h_active[a0]], r1 = h_off[h_active[a1 - 1] + 1];
      launch_kernel(silu_mul_bf16_kernel, rows_grid((r1 - r0) * (I / 8), 256), 256, 0, stream, c.gu + r0 * 2 * I, I,
                    r1 - r0, c.act + r0 * I);
      KILN_CUDA_CHECK_LAUNCH();
      profile_mark("silu_mul");
      grouped(n_gu + a0, a1 - a0);
      profile_mark("down gemm");
    }
  }
  moe_combine_bf16(c.y, ids, weights, g.pair_pos, top_k, T, H, out, shared, shared_gate, stream);
  profile_mark("combine");
}

}  // namespace kiln::cuda::ops
