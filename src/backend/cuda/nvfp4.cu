// NVFP4 W4A16 linears on tensor cores (Hopper has no FP4 MMA: codes are decoded to bf16 in registers
// and fed to mma.sync m16n8k16 with fp32 accumulation).
//
// Two kernels, both "grouped": a launch covers several groups of rows of x (one group per MoE expert,
// or a single group for a dense linear), each group with its own weight matrix.
//  - GEMV (small m): the weight tile is the MMA's A operand (16 weight rows), the tokens its B operand
//    (8 per tile). Each lane streams 16-byte pieces of two weight rows straight from global memory and
//    decodes them in registers; 8 warps split k and reduce through shared memory. The order in which
//    a lane's codes enter the MMA's k dimension is a permutation of the physical k (same for A and B),
//    chosen so that decoding is a few shifts per pair of codes.
//  - GEMM (large m): 128x128 output tiles, 64-wide k blocks staged by cp.async (two stages); the FP4
//    block is decoded once into a bf16 tile in shared memory, then ldmatrix + mma.sync.
// Fused gate/up variants compute silu(x Wg^T) * (x Wu^T) in the epilogue (the MoE expert's first half).
#include <cuda_bf16.h>

#include <algorithm>

#include "backend/cuda/cuda_check.h"
#include "backend/cuda/device_utils.cuh"
#include "backend/cuda/kernels.h"

namespace kiln::cuda {
namespace {

using namespace dev;

struct Nvfp4Params {
  const Nvfp4Weight* table_a = nullptr;  // [E] per-group weight (gate when fused); null: single_a
  const Nvfp4Weight* table_b = nullptr;  // [E] up weight (fused only)
  Nvfp4Weight single_a, single_b;
  int n = 0, k = 0;  // rows of each weight matrix, inputs
  const uint16_t* x = nullptr;
  int64_t ldx = 0;
  const int* x_rows = nullptr;  // [pairs] row of x for each pair; null: pair index itself
  uint16_t* out = nullptr;
  int64_t ldo = 0;
  // Groups: null group_offset means one group of pairs [0, m).
  const int* group_expert = nullptr;
  const int* group_offset = nullptr;
  const int* group_tile_offset = nullptr;  // GEMM: first m-tile of each group
  const int* num_groups = nullptr;
  int m = 0;
};

struct GroupInfo {
  int begin, end;
  Nvfp4Weight a, b;
};

__device__ __forceinline__ GroupInfo group_of(const Nvfp4Params& p, int group, bool fused) {
  GroupInfo gi{0, p.m, p.single_a, p.single_b};
  if (p.group_offset) {
    const int e = p.group_expert[group];
    gi.begin = p.group_offset[group];
    gi.end = p.group_offset[group + 1];
    gi.a = p.table_a[e];
    if (fused) gi.b = p.table_b[e];
  }
  return gi;
}

// ---------------------------------------------------------------------------------------------
// GEMV
// ---------------------------------------------------------------------------------------------
constexpr int kGemvWarps = 8;  // k split over 8 warps: short per-warp load chains at batch 1
constexpr int kGemvRows = 16;   // weight rows per block (one MMA M tile)
constexpr int kGemvTokens = 8;  // tokens per MMA N tile
constexpr int kStepK = 128;     // k per warp step: 4 lanes x 32 codes per weight row

template <int kMats>
struct GemvStep {
  uint4 w[kMats][2];      // 32 codes of rows g and g+8
  uint32_t sc[kMats][2];  // 2 scale bytes each
  uint4 x[4];             // 32 activations of this lane's token
};

template <int kMats>
__device__ __forceinline__ void gemv_load(GemvStep<kMats>& st, const uint8_t* const (&wrow)[kMats][2],
                                          const uint8_t* const (&srow)[kMats][2], const uint16_t* xrow,
                                          int step) {
#pragma unroll
  for (int mi = 0; mi < kMats; ++mi)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      st.w[mi][r] = ld_stream_16(wrow[mi][r] + step * (kStepK / 2));
      st.sc[mi][r] = __ldg(reinterpret_cast<const uint16_t*>(srow[mi][r] + step * (kStepK / 16)));
    }
  if (xrow) {
    const uint4* xp = reinterpret_cast<const uint4*>(xrow + step * kStepK);
#pragma unroll
    for (int i = 0; i < 4; ++i) st.x[i] = __ldg(xp + i);
  } else {
#pragma unroll
    for (int i = 0; i < 4; ++i) st.x[i] = make_uint4(0, 0, 0, 0);
  }
}

template <int kMats>
__device__ __forceinline__ void gemv_compute(const GemvStep<kMats>& st, float (&acc)[kMats][4]) {
  uint32_t sc[kMats][2][2];  // [mat][row][scale group]
#pragma unroll
  for (int mi = 0; mi < kMats; ++mi)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      sc[mi][r][0] = nvfp4_scale_bf16x2(st.sc[mi][r] & 0xff);
      sc[mi][r][1] = nvfp4_scale_bf16x2(st.sc[mi][r] >> 8);
    }
#pragma unroll
  for (int j = 0; j < 4; ++j) {  // word j: codes 8j..8j+7 of this lane's 32
    const uint4 xv = st.x[j];
    // k-step 0 uses code pairs (0,4), (1,5); k-step 1 uses (2,6), (3,7).
    const uint32_t b00 = __byte_perm(xv.x, xv.z, 0x5410), b01 = __byte_perm(xv.x, xv.z, 0x7632);
    const uint32_t b10 = __byte_perm(xv.y, xv.w, 0x5410), b11 = __byte_perm(xv.y, xv.w, 0x7632);
#pragma unroll
    for (int mi = 0; mi < kMats; ++mi) {
      const uint32_t w0 = j == 0 ? st.w[mi][0].x : j == 1 ? st.w[mi][0].y : j == 2 ? st.w[mi][0].z : st.w[mi][0].w;
      const uint32_t w1 = j == 0 ? st.w[mi][1].x : j == 1 ? st.w[mi][1].y : j == 2 ? st.w[mi][1].z : st.w[mi][1].w;
      const uint32_t s0 = sc[mi][0][j / 2], s1 = sc[mi][1][j / 2];
      uint32_t a[4];
      a[0] = bf16x2_mul(e2m1_pair_bits<0>(w0), s0);
      a[1] = bf16x2_mul(e2m1_pair_bits<0>(w1), s1);
      a[2] = bf16x2_mul(e2m1_pair_bits<1>(w0), s0);
      a[3] = bf16x2_mul(e2m1_pair_bits<1>(w1), s1);
      mma_bf16_16816(acc[mi], a, b00, b01);
      a[0] = bf16x2_mul(e2m1_pair_bits<2>(w0), s0);
      a[1] = bf16x2_mul(e2m1_pair_bits<2>(w1), s1);
      a[2] = bf16x2_mul(e2m1_pair_bits<3>(w0), s0);
      a[3] = bf16x2_mul(e2m1_pair_bits<3>(w1), s1);
      mma_bf16_16816(acc[mi], a, b10, b11);
    }
  }
}

// grid: (n / 16, groups). Block: kGemvWarps warps over k. kMats 2 = fused gate/up (out is the activation).
template <int kMats>
__global__ void __launch_bounds__(kGemvWarps * 32) nvfp4_gemv_kernel(const Nvfp4Params p) {
  const int group = blockIdx.y;
  if (p.group_offset && group >= *p.num_groups) return;
  const GroupInfo gi = group_of(p, group, kMats == 2);
  if (gi.begin >= gi.end) return;

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, q = lane % 4;
  const int row0 = blockIdx.x * kGemvRows;
  const int64_t row_bytes = p.k / 2, row_scales = p.k / 16;
  const int steps = p.k / kStepK;

  const uint8_t* wrow[kMats][2];
  const uint8_t* srow[kMats][2];
  float gscale[kMats];
#pragma unroll
  for (int mi = 0; mi < kMats; ++mi) {
    const Nvfp4Weight& w = mi == 0 ? gi.a : gi.b;
    gscale[mi] = w.global_scale * kNvfp4AccumScale;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int64_t row = row0 + g + 8 * r;
      wrow[mi][r] = w.codes + row * row_bytes + 16 * q;
      srow[mi][r] = w.scales + row * row_scales + 2 * q;
    }
  }

  __shared__ float red[kGemvWarps][kMats][4][32];

  for (int tb = gi.begin; tb < gi.end; tb += kGemvTokens) {
    const int tok = tb + g;
    const uint16_t* xrow = nullptr;
    if (tok < gi.end) xrow = p.x + int64_t(p.x_rows ? p.x_rows[tok] : tok) * p.ldx + 32 * q;

    float acc[kMats][4];
#pragma unroll
    for (int mi = 0; mi < kMats; ++mi) acc[mi][0] = acc[mi][1] = acc[mi][2] = acc[mi][3] = 0.0f;

    // Software pipeline: the next step's loads are in flight while this step decodes and multiplies.
    int s = warp;
    if (s < steps) {
      GemvStep<kMats> cur;
      gemv_load<kMats>(cur, wrow, srow, xrow, s);
      for (; s + kGemvWarps < steps; s += kGemvWarps) {
        GemvStep<kMats> nxt;
        gemv_load<kMats>(nxt, wrow, srow, xrow, s + kGemvWarps);
        gemv_compute<kMats>(cur, acc);
        cur = nxt;
      }
      gemv_compute<kMats>(cur, acc);
    }

#pragma unroll
    for (int mi = 0; mi < kMats; ++mi)
#pragma unroll
      for (int c = 0; c < 4; ++c) red[warp][mi][c][lane] = acc[mi][c];
    __syncthreads();
    if (warp == 0) {
      float v[kMats][4];
#pragma unroll
      for (int mi = 0; mi < kMats; ++mi)
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          float sum = 0.0f;
#pragma unroll
          for (int w = 0; w < kGemvWarps; ++w) sum += red[w][mi][c][lane];
          v[mi][c] = sum * gscale[mi];
        }
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        const int t = tb + 2 * q + (c & 1);
        const int row = row0 + g + 8 * (c >> 1);
        if (t < gi.end) {
          const float val = kMats == 2 ? silu(v[0][c]) * v[kMats - 1][c] : v[0][c];
          p.out[int64_t(t) * p.ldo + row] = __bfloat16_as_ushort(__float2bfloat16_rn(val));
        }
      }
    }
    __syncthreads();
  }
}

// ---------------------------------------------------------------------------------------------
// GEMM
// ---------------------------------------------------------------------------------------------
constexpr int kBM = 128, kBN = 128, kBK = 64;
constexpr int kGemmThreads = 256;
constexpr int kStageA = kBM * kBK * 2;         // bf16 activations, swizzled 16-byte chunks
constexpr int kStageW = kBN * kBK / 2;         // raw codes
constexpr int kStageS = kBN * kBK / 16;        // raw scales
constexpr int kTileW = kBN * kBK * 2;          // decoded bf16 weights, swizzled
constexpr int kGemmSmem = 2 * (kStageA + kStageW + kStageS) + kTileW;

__device__ __forceinline__ int swz(int row, int chunk) { return row * 8 + (chunk ^ (row & 7)); }  // 16B units

// Tile row r of the weight tile -> (matrix, source row). Fused: blocks of 8 rows alternate gate/up,
// so MMA n-tiles 2i and 2i+1 hold gate and up of the same 8 output columns.
template <bool kFused>
__device__ __forceinline__ void weight_row_of(int r, int& mat, int& src_row) {
  if (kFused) {
    mat = (r / 8) & 1;
    src_row = blockIdx.x * (kBN / 2) + (r / 16) * 8 + (r % 8);
  } else {
    mat = 0;
    src_row = blockIdx.x * kBN + r;
  }
}

template <bool kFused>
__global__ void __launch_bounds__(kGemmThreads) nvfp4_gemm_kernel(const Nvfp4Params p) {
  extern __shared__ __align__(128) uint8_t smem[];
  uint8_t* sA = smem;                            // [2][kBM][kBK] bf16
  uint8_t* sWraw = sA + 2 * kStageA;             // [2][kBN][kBK/2]
  uint8_t* sWsc = sWraw + 2 * kStageW;           // [2][kBN][kBK/16]
  uint8_t* sW = sWsc + 2 * kStageS;              // [kBN][kBK] bf16

  // Which group and which 128-pair tile of it.
  int group = 0, mtile = blockIdx.y;
  if (p.group_offset) {
    const int ng = *p.num_groups;
    if (mtile >= p.group_tile_offset[ng]) return;
    int lo = 0, hi = ng - 1;  // last group whose first tile <= blockIdx.y
    while (lo < hi) {
      const int mid = (lo + hi + 1) / 2;
      if (p.group_tile_offset[mid] <= mtile) lo = mid; else hi = mid - 1;
    }
    group = lo;
    mtile -= p.group_tile_offset[group];
  }
  const GroupInfo gi = group_of(p, group, kFused);
  const int pair0 = gi.begin + mtile * kBM;
  if (pair0 >= gi.end) return;

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, q = lane % 4;
  const int ktiles = p.k / kBK;
  const int64_t row_bytes = p.k / 2, row_scales = p.k / 16;

  // Per-thread load assignments.
  // A: rows tid/8 + 32i (i < 4), chunk tid % 8.
  const uint16_t* a_src[4];
  int a_bytes[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int pr = pair0 + tid / 8 + 32 * i;
    const bool ok = pr < gi.end;
    const int64_t xr = ok ? (p.x_rows ? p.x_rows[pr] : pr) : 0;
    a_src[i] = p.x + xr * p.ldx + (tid % 8) * 8;
    a_bytes[i] = ok ? 16 : 0;
  }
  // W codes: row tid/2, 16-byte half tid%2. Scales: row tid (tid < 128), 4 bytes.
  const uint8_t* w_src;
  {
    int mat, src;
    weight_row_of<kFused>(tid / 2, mat, src);
    const Nvfp4Weight& w = mat ? gi.b : gi.a;
    w_src = w.codes + int64_t(src) * row_bytes + (tid % 2) * 16;
  }
  const uint8_t* s_src = nullptr;
  if (tid < kBN) {
    int mat, src;
    weight_row_of<kFused>(tid, mat, src);
    const Nvfp4Weight& w = mat ? gi.b : gi.a;
    s_src = w.scales + int64_t(src) * row_scales;
  }

  auto load_stage = [&](int stage, int kt) {
    const uint32_t a_base = smem_addr(sA + stage * kStageA);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int r = tid / 8 + 32 * i;
      cp_async_16(a_base + swz(r, tid % 8) * 16, a_src[i] + kt * kBK, a_bytes[i]);
    }
    cp_async_16(smem_addr(sWraw + stage * kStageW + tid * 16), w_src + kt * (kBK / 2));
    if (tid < kBN) cp_async_4(smem_addr(sWsc + stage * kStageS + tid * 4), s_src + kt * (kBK / 16));
  };

  float acc[4][4][4];
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j) acc[i][j][0] = acc[i][j][1] = acc[i][j][2] = acc[i][j][3] = 0.0f;

  const int wm = warp / 4, wn = warp % 4;
  load_stage(0, 0);
  cp_async_commit();
  for (int kt = 0; kt < ktiles; ++kt) {
    const int stage = kt & 1;
    if (kt + 1 < ktiles) {
      load_stage(stage ^ 1, kt + 1);
      cp_async_commit();
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    // Decode: thread -> tile row tid/2, 32 codes (half tid%2) -> 4 swizzled bf16 chunks.
    {
      const int r = tid / 2, h = tid % 2;
      const uint4 raw = *reinterpret_cast<const uint4*>(sWraw + stage * kStageW + tid * 16);
      const uint32_t sb = *reinterpret_cast<const uint16_t*>(sWsc + stage * kStageS + r * 4 + 2 * h);
      const uint32_t s0 = nvfp4_scale_bf16x2(sb & 0xff), s1 = nvfp4_scale_bf16x2(sb >> 8);
      const uint32_t words[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const uint32_t s = i < 2 ? s0 : s1;
        const uint32_t p0 = bf16x2_mul(e2m1_pair_bits<0>(words[i]), s);  // (e0, e4)
        const uint32_t p1 = bf16x2_mul(e2m1_pair_bits<1>(words[i]), s);  // (e1, e5)
        const uint32_t p2 = bf16x2_mul(e2m1_pair_bits<2>(words[i]), s);  // (e2, e6)
        const uint32_t p3 = bf16x2_mul(e2m1_pair_bits<3>(words[i]), s);  // (e3, e7)
        uint4 o;
        o.x = __byte_perm(p0, p1, 0x5410);  // e0 e1
        o.y = __byte_perm(p2, p3, 0x5410);  // e2 e3
        o.z = __byte_perm(p0, p1, 0x7632);  // e4 e5
        o.w = __byte_perm(p2, p3, 0x7632);  // e6 e7
        *reinterpret_cast<uint4*>(sW + swz(r, 4 * h + i) * 16) = o;
      }
    }
    __syncthreads();
    const uint32_t a_base = smem_addr(sA + stage * kStageA), w_base = smem_addr(sW);
#pragma unroll
    for (int ks = 0; ks < kBK / 16; ++ks) {
      uint32_t af[4][4], bfr[4][2];
#pragma unroll
      for (int mt = 0; mt < 4; ++mt) {
        const int row = wm * 64 + mt * 16 + (lane % 16);
        ldmatrix_x4(af[mt], a_base + swz(row, ks * 2 + lane / 16) * 16);
      }
#pragma unroll
      for (int np = 0; np < 2; ++np) {
        const int row = wn * 32 + np * 16 + (lane % 8) + (lane / 16) * 8;
        uint32_t r[4];
        ldmatrix_x4(r, w_base + swz(row, ks * 2 + (lane / 8) % 2) * 16);
        bfr[2 * np][0] = r[0];
        bfr[2 * np][1] = r[1];
        bfr[2 * np + 1][0] = r[2];
        bfr[2 * np + 1][1] = r[3];
      }
#pragma unroll
      for (int mt = 0; mt < 4; ++mt)
#pragma unroll
        for (int nt = 0; nt < 4; ++nt) mma_bf16_16816(acc[mt][nt], af[mt], bfr[nt][0], bfr[nt][1]);
    }
    __syncthreads();
  }

  // Epilogue.
  const float ga = gi.a.global_scale * kNvfp4AccumScale;
  const float gb = kFused ? gi.b.global_scale * kNvfp4AccumScale : 0.0f;
#pragma unroll
  for (int mt = 0; mt < 4; ++mt)
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      const int pr = pair0 + wm * 64 + mt * 16 + g + 8 * hr;
      if (pr >= gi.end) continue;
      uint16_t* orow = p.out + int64_t(pr) * p.ldo;
      if (kFused) {
#pragma unroll
        for (int np = 0; np < 2; ++np) {
          const int col = blockIdx.x * (kBN / 2) + (wn * 2 + np) * 8 + 2 * q;
          const float g0 = acc[mt][2 * np][2 * hr] * ga, g1 = acc[mt][2 * np][2 * hr + 1] * ga;
          const float u0 = acc[mt][2 * np + 1][2 * hr] * gb, u1 = acc[mt][2 * np + 1][2 * hr + 1] * gb;
          *reinterpret_cast<uint32_t*>(orow + col) = pack_bf16x2(silu(g0) * u0, silu(g1) * u1);
        }
      } else {
#pragma unroll
        for (int nt = 0; nt < 4; ++nt) {
          const int col = blockIdx.x * kBN + wn * 32 + nt * 8 + 2 * q;
          *reinterpret_cast<uint32_t*>(orow + col) =
              pack_bf16x2(acc[mt][nt][2 * hr] * ga, acc[mt][nt][2 * hr + 1] * ga);
        }
      }
    }
}

// ---------------------------------------------------------------------------------------------
// Launch helpers
// ---------------------------------------------------------------------------------------------
void check_aligned(const void* ptr, int bytes, const char* what) {
  if (reinterpret_cast<uintptr_t>(ptr) % bytes != 0)
    cuda_fail(std::string("nvfp4: ") + what + " must be {}-byte aligned", {bytes});
}

void launch_gemv(const Nvfp4Params& p, bool fused, int grid_groups, Stream stream) {
  if (p.n % kGemvRows != 0 || p.k % kStepK != 0)
    cuda_fail("nvfp4 GEMV: needs n % {} == 0 and k % {} == 0 (got n={}, k={})", {kGemvRows, kStepK, p.n, p.k});
  if (p.ldx % 8 != 0) cuda_fail("nvfp4: activation row stride must be a multiple of 8 elements");
  check_aligned(p.x, 16, "x");
  const dim3 grid(p.n / kGemvRows, grid_groups);
  if (fused) nvfp4_gemv_kernel<2><<<grid, kGemvWarps * 32, 0, stream>>>(p);
  else nvfp4_gemv_kernel<1><<<grid, kGemvWarps * 32, 0, stream>>>(p);
  KILN_CUDA_CHECK_LAUNCH();
}

template <bool kFused>
void set_gemm_smem() {
  static const bool done = [] {
    KILN_CUDA_CHECK(cudaFuncSetAttribute(nvfp4_gemm_kernel<kFused>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         kGemmSmem));
    return true;
  }();
  (void)done;
}

void launch_gemm(const Nvfp4Params& p, bool fused, int grid_tiles, Stream stream) {
  const int cols_per_block = fused ? kBN / 2 : kBN;
  if (p.n % cols_per_block != 0 || p.k % kBK != 0)
    cuda_fail("nvfp4 GEMM: needs n % {} == 0 and k % {} == 0 (got n={}, k={})", {cols_per_block, kBK, p.n, p.k});
  if (p.ldx % 8 != 0 || p.ldo % 2 != 0) cuda_fail("nvfp4 GEMM: row strides must be multiples of 8 (x) and 2 (out)");
  check_aligned(p.x, 16, "x");
  const dim3 grid(p.n / cols_per_block, grid_tiles);
  if (grid_tiles == 0) return;
  if (fused) {
    set_gemm_smem<true>();
    nvfp4_gemm_kernel<true><<<grid, kGemmThreads, kGemmSmem, stream>>>(p);
  } else {
    set_gemm_smem<false>();
    nvfp4_gemm_kernel<false><<<grid, kGemmThreads, kGemmSmem, stream>>>(p);
  }
  KILN_CUDA_CHECK_LAUNCH();
}

Nvfp4Path choose(Nvfp4Path path, int pairs) {
  if (path != Nvfp4Path::kAuto) return path;
  return pairs <= 16 ? Nvfp4Path::kGemv : Nvfp4Path::kGemm;
}

}  // namespace

const char* nvfp4_path_name(Nvfp4Path p) {
  switch (p) {
    case Nvfp4Path::kAuto: return "auto";
    case Nvfp4Path::kGemv: return "gemv";
    case Nvfp4Path::kGemm: return "gemm";
  }
  return "?";
}

void nvfp4_linear(const Nvfp4Weight& w, int n, int k, const uint16_t* x, int64_t ldx, int m, uint16_t* out,
                  int64_t ldo, Stream stream, Nvfp4Path path) {
  if (m <= 0) return;
  Nvfp4Params p{};
  p.single_a = w;
  p.n = n;
  p.k = k;
  p.x = x;
  p.ldx = ldx;
  p.out = out;
  p.ldo = ldo;
  p.m = m;
  if (choose(path, m) == Nvfp4Path::kGemv) {
    launch_gemv(p, false, 1, stream);
  } else {
    launch_gemm(p, false, (m + kBM - 1) / kBM, stream);
  }
}

void moe_expert_ffn(const MoeExperts& e, const uint16_t* x, int64_t ldx, int T, const MoeRouting& r,
                    uint16_t* act, uint16_t* y, Stream stream, Nvfp4Path path) {
  if (T <= 0) return;
  if (T > r.max_tokens) cuda_fail("moe_expert_ffn: {} tokens but the routing was sized for {}", {T, r.max_tokens});
  const int pairs = T * r.top_k;
  // GEMV while groups are small on average (it re-streams a group's weights per 8 pairs; the GEMM
  // pads every group to 128-pair tiles).
  const Nvfp4Path chosen =
      path != Nvfp4Path::kAuto ? path : (pairs <= 16 * r.num_experts ? Nvfp4Path::kGemv : Nvfp4Path::kGemm);
  // Upper bound of non-empty groups, and of GEMM tiles (each group rounds up once).
  const int max_groups = std::min(r.num_experts, pairs);
  const int max_tiles = (pairs + kBM - 1) / kBM + max_groups;

  Nvfp4Params p{};
  p.group_expert = r.group_expert;
  p.group_offset = r.group_offset;
  p.group_tile_offset = r.group_tile_offset;
  p.num_groups = r.num_groups;
  p.m = pairs;

  // gate/up: rows of x gathered by sorted_token; out = activation [pairs, inter].
  p.table_a = e.gate;
  p.table_b = e.up;
  p.n = e.inter;
  p.k = e.hidden;
  p.x = x;
  p.ldx = ldx;
  p.x_rows = r.sorted_token;
  p.out = act;
  p.ldo = e.inter;
  if (chosen == Nvfp4Path::kGemv) launch_gemv(p, true, max_groups, stream);
  else launch_gemm(p, true, max_tiles, stream);

  // down: act rows are already in pair order.
  p.table_a = e.down;
  p.table_b = nullptr;
  p.n = e.hidden;
  p.k = e.inter;
  p.x = act;
  p.ldx = e.inter;
  p.x_rows = nullptr;
  p.out = y;
  p.ldo = e.hidden;
  if (chosen == Nvfp4Path::kGemv) launch_gemv(p, false, max_groups, stream);
  else launch_gemm(p, false, max_tiles, stream);
}

}  // namespace kiln::cuda
