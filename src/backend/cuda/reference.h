// Plain C++ references for the CUDA kernels (kernels.h), one per kernel family: the same maths on
// the CPU in double precision, with bf16 rounding exactly where the kernel's contract rounds
// (its bf16 outputs and documented bf16 intermediates). Tests compare the kernels with these;
// they are written for clarity, not speed. bf16 data is uint16_t bits, as in kernels.h.
#pragma once
#include <cstdint>
#include <vector>

namespace kiln::cuda::ref {

float bf16(uint16_t bits);   // bits -> value
uint16_t to_bf16(double v);  // value -> bits, round to nearest even
float round_bf16(double v);  // value rounded through bf16

// NVFP4 weight [n, k] -> dense float [n, k].
std::vector<float> nvfp4_dequant(const uint8_t* codes, const uint8_t* scales, float global_scale, int n, int k);

// out[m, n] = x[m, k] . w[n, k]^T in double (x bf16 bits, w dense float).
std::vector<double> linear(const uint16_t* x, int64_t ldx, const float* w, int m, int n, int k);

// Softmax over E (fp32 semantics evaluated in double), top-k (lowest index on ties), optional renorm.
void moe_route(const float* logits, int T, int E, int k, bool renormalize, int* ids, float* weights);

// One expert on one token: act = bf16(silu(x Wg^T) * (x Wu^T)); y = bf16(act Wd^T).
std::vector<uint16_t> expert_ffn(const uint16_t* x, const float* wg, const float* wu, const float* wd, int H, int I);

// out = x * rsqrt(mean(x^2) + eps) * (zero_centred ? 1 + w : w), bf16 result as float.
void rmsnorm(const uint16_t* x, const uint16_t* w, int H, float eps, bool zero_centred, float* out);

// q/k norm + partial RoPE for one head vector of 256 values (x bf16 bits, w bf16 bits) -> float.
void norm_rope(const uint16_t* x, const uint16_t* w, float eps, int pos, float theta, int rotary_dim,
               bool apply_norm, float* out);

// Causal gated attention for one query row against keys [0, n_keys): q [256] float, keys/values as
// float rows; returns out[256] = softmax(q.k / 16) V * sigmoid(gate).
void attention_row(const float* q, const std::vector<const float*>& keys, const std::vector<const float*>& values,
                   const float* gate, float* out);

// Depthwise causal conv1d (kernel 4) + silu for one channel over a token run, with a 3-value window.
void conv1d_channel(const float* x, int T, const float w[4], float window[3], float* out);

// One value head, one token of the gated delta rule. S is [dv][dk] (transposed state), updated in place.
// q, k: raw (pre-l2norm) [dk]; v, z: [dv]; a, b scalars; returns out [dv] (gated RMSNorm applied).
void gdn_step(const float* q, const float* k, const float* v, const float* z, float a, float b, float A_log,
              float dt_bias, const float* norm_w, float eps, int dk, int dv, double* S, float* out);

}  // namespace kiln::cuda::ref
