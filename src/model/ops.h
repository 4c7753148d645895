// The operations a forward pass needs from a backend: a table of virtual functions over TensorViews.
//
// The model layer (blocks, families, the generic runner) is written against this interface; each
// backend implements it (src/backend/cpu: the oracle; src/backend/cuda). src/backend/backend.h re-exports
// it as kiln::backend::Backend. It lives here, in the model layer, because layers point one way
// (model -> backend): the model says what it needs, backends provide it.
//
// Conventions
//  - Shapes in comments: T = tokens in the step (all sequences concatenated, in chunk order), S = sequences
//    in the step, H = hidden size, V = vocab, E = experts, k = experts per token.
//  - Activations are F32 on the CPU backend; a GPU backend may use BF16 activations internally but takes
//    and returns the same shapes. Weights are read as stored (BF16 / FP8 / NVFP4), never dequantised into
//    a full copy.
//  - Unless a comment says otherwise, views are contiguous (row-major) and `out` never aliases an input.
//  - Every op may run asynchronously on its device; download() synchronises.
#pragma once
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "core/tensor.h"
#include "model/comm.h"
#include "model/device_memory.h"
#include "model/sampling.h"

namespace kiln::format {
struct TensorSlice;  // format/shard_plan.h
}

namespace kiln::model {

// How a linear layer's weight is stored.
enum class WeightFormat : uint8_t {
  dense,       // BF16 / F16 / F32 [N, K]
  fp8_tensor,  // F8_E4M3 [N, K] x one F32 scale: W = float(w) * scale
  nvfp4,       // U8 [N, K/2] E2M1 pairs (element 2i in the low nibble) + F8_E4M3 block scales [N, K/16]
               // + F32 scale_2: W[n,k] = (e2m1(code) * float(block_scale[n, k/16])) * scale_2
};
const char* weight_format_name(WeightFormat f);

// One linear layer, y = x W^T (+ bias), W [N out, K in].
struct LinearWeight {
  WeightFormat format = WeightFormat::dense;
  int64_t out_features = 0;  // N
  int64_t in_features = 0;   // K
  TensorView weight;         // dense [N, K]; fp8_tensor F8_E4M3 [N, K]; nvfp4 U8 [N, K/2]
  TensorView block_scale;    // nvfp4 only: F8_E4M3 [N, K/16]
  float scale = 1.0f;        // fp8_tensor: weight_scale; nvfp4: weight_scale_2
  TensorView bias;           // optional [N] (data == nullptr: none)

  bool present() const { return weight.data != nullptr; }
  int64_t weight_bytes() const;  // bytes read per full pass over W (incl. scales)
};

enum class NormKind : uint8_t {
  plain,         // x_hat * w            (qwen3, qwen3_moe)
  zero_centred,  // x_hat * (1 + w)      (qwen3_5, qwen3_5_moe, qwen3_next)
};

// The residual step between blocks as an op's input (Ops::moe_block, Ops::deltanet_block): hidden += y, the input is
// rms_norm(hidden) * weight (kind). hidden, y F32 [T, D] contiguous (y empty, data null: nothing to add, where the op
// allows it); weight [D].
struct ResidualNorm {
  TensorView hidden;
  TensorView y;
  TensorView weight;
  float eps = 0.0f;
  NormKind kind = NormKind::plain;
};

// Multimodal RoPE (Qwen2-VL / Qwen3-VL / Qwen3.5): each token has three positions (time, height, width) and each
// rotary frequency i in [0, rotary_dim / 2) takes its angle from one of them. Text tokens carry three equal positions,
// which makes M-RoPE the plain rope. axis(i) is 0, 1 or 2, packed 2 bits per frequency (at most 64 frequencies).
struct MRopeAxes {
  uint64_t bits[2] = {0, 0};
  int axis(int i) const { return static_cast<int>((bits[i / 32] >> (2 * (i % 32))) & 3u); }
  // sections {t, h, w} (config mrope_section, summing to rotary_dim / 2). interleaved (Qwen3-VL, Qwen3.5): frequency
  // i takes h when i % 3 == 1 and i < 3 h, w when i % 3 == 2 and i < 3 w, t otherwise. Not interleaved (Qwen2-VL):
  // the first t frequencies take t, the next h take h, the rest w.
  static MRopeAxes from_sections(const std::vector<int>& sections, bool interleaved, int half);
};

// A view of `base`'s memory (same dtype) starting `offset` elements in, with explicit strides (elements).
TensorView strided_view(const TensorView& base, int64_t offset, Shape shape, std::initializer_list<int64_t> strides);
// The same memory viewed with another contiguous shape (numel must match).
TensorView reshaped(const TensorView& base, Shape shape);

// Ops::qk_norm_rope's shapes (see there), checked: fails naming them.
void check_qk_norm_rope(const TensorView& q_proj, const TensorView& k, bool gated, const TensorView& q_out,
                        const TensorView& gate_out, const TensorView& k_out);

// The activation Ops::linear_gated_input applies to its input.
enum class InputAct { silu_mul, sigmoid_mul };

// One full-attention layer's slice of the paged KV pool.
struct KvLayerView {
  TensorView k;  // [num_pages, page_size, kv_heads, head_dim]; F32, BF16 or F8_E4M3
  TensorView v;  // same
  float k_scale = 1.0f;  // F8_E4M3 pools: stored = round(value / scale)
  float v_scale = 1.0f;
};

// The layout of one forward step, as device-visible I32 arrays (flashinfer-style CSR) plus the host copies
// the CPU backend reads directly. Built by the runner with Ops::upload().
struct StepLayout {
  int64_t num_tokens = 0;  // T
  int num_seqs = 0;        // S
  int page_size = 0;
  int max_pages_per_seq = 0;
  TensorView token_pos;        // I32 [T]      absolute position of each token (KV row; the rope position too unless:)
  TensorView token_mrope_pos;  // I32 [T, 3]   M-RoPE positions (t, h, w) of each token; empty (and host mirror
                               //              empty) when every token's rope position is its position
  TensorView seq_token_begin;  // I32 [S + 1]  token range of sequence s: [begin[s], begin[s+1])
  TensorView seq_start_pos;    // I32 [S]      position of the first token of the sequence in this step
  TensorView seq_state_slot;   // I32 [S]      recurrent/conv state slot
  TensorView page_table;       // I32 [S, max_pages_per_seq] KV pages (unused entries -1)
  // Host mirrors (same content; always valid).
  std::vector<int32_t> host_token_pos, host_seq_token_begin, host_seq_start_pos, host_seq_state_slot,
      host_page_table, host_token_mrope_pos;
  // Position checkpoints (speculative verify; ModelRunner::keep_verified): per token, the state slot that receives the
  // recurrent and conv state as it stands after that token (-1: none). Empty (both) when the pass keeps none; a pass
  // that keeps some runs the delta rule as the recurrence.
  TensorView token_checkpoint_slot;  // I32 [T]
  std::vector<int32_t> host_token_checkpoint_slot;
};

// Routed experts of one MoE layer: expert e computes down(silu(gate x) * up x).
struct ExpertWeights {
  LinearWeight gate;  // [I, H]
  LinearWeight up;    // [I, H]
  LinearWeight down;  // [H, I]
};

// How `--load-format dummy` fills a weight that has no bytes. Deterministic: element i is a function of
// (seed, i) alone (random_fill_hash), so every backend produces the same bytes for the same tensor.
struct RandomFill {
  enum class Kind : uint8_t {
    uniform,  // float dtypes: lo + (hi - lo) * u, u = k / 2^24, k = the hash's top 24 bits; rounded to the dtype
    bytes,    // 1-byte dtypes: byte_lo + (hash >> 32) % (byte_hi - byte_lo), sign bit 0x80 set when random_sign
              // and the hash's lowest bit is 1 (NVFP4 codes, E4M3 scales / weights in a safe exponent range)
  };
  Kind kind = Kind::uniform;
  float lo = 0.0f, hi = 0.0f;
  uint32_t byte_lo = 0, byte_hi = 256;
  bool random_sign = false;
  uint64_t seed = 0;
};
// splitmix64 of seed + (i + 1) * golden ratio: the random bits of element i.
inline uint64_t random_fill_hash(uint64_t seed, uint64_t i) {
  uint64_t z = seed + (i + 1) * 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}
// Fills `out` (shape.numel() elements of dtype) on the host: the definition the GPU fill kernel follows.
void fill_random_host(DType dtype, int64_t numel, const RandomFill& fill, void* out);
// Elements [first, first + count) of the same fill into out[0, count) (for filling one tensor on several threads).
void fill_random_host_range(DType dtype, int64_t first, int64_t count, const RandomFill& fill, void* out);
// A tensor-parallel rank's slice of the same random tensor: element i of `out` (slice.shape) is element
// format::slice_source_index(slice, stored, i) of the full tensor fill_random_host would make, so TP N loads the
// same dummy model as TP 1.
void fill_random_host_slice(DType dtype, const Shape& stored, const format::TensorSlice& slice, const RandomFill& fill,
                            void* out);

// argmax of row[0, n) on the host: the lowest index on ties, NaN never wins, 0 when every value is NaN.
int32_t host_argmax(const float* row, int64_t n);

// One op's share of a profiled step (Ops::profile_end): label = op name and shape.
struct OpTime {
  std::string label;
  int64_t calls = 0;
  double total_us = 0;
  bool nested = false;  // a stage inside another op's time (not added to the step's total)
};

enum class GeluKind : uint8_t {
  erf,   // exact: torch nn.GELU(), transformers "gelu"
  tanh,  // the tanh approximation: transformers "gelu_pytorch_tanh" / "gelu_new"
};

enum class DeltaRuleMode : uint8_t {
  recurrent,  // token by token (decode, and the definition)
  chunked,    // UT-transform chunks of 64 tokens (prefill); equals the recurrence up to rounding
};

class Ops {
 public:
  virtual ~Ops() = default;
  virtual std::string name() const = 0;        // "cpu", "cuda"
  virtual std::string describe() const = 0;    // kernels / threads, for the startup summary

  // ---- memory
  // Long-lived device memory owned by the Ops (KV pool, state slots), zero-filled.
  virtual TensorView allocate(DType dtype, Shape shape) = 0;
  // A weight tensor as the backend will read it: the CPU returns the (mmapped) view itself; a GPU copies it
  // to device memory it owns (the view's address is final at once; the bytes are there after finish_weights()).
  virtual TensorView place_weight(const TensorView& host) = 0;
  // A weight with no bytes (--load-format dummy): memory of the backend's own, filled as `fill` says. The default
  // fills a host buffer (kept alive by the Ops) and places it; a GPU backend fills device memory directly.
  virtual TensorView place_random(DType dtype, Shape shape, const RandomFill& fill);
  // A tensor-parallel rank's slice (shape slice.shape) of the random tensor place_random(dtype, stored, fill) would
  // make: the values of fill_random_host_slice. Default: filled on the host and placed; a GPU fills it in place.
  virtual TensorView place_random_slice(DType dtype, const Shape& stored, const format::TensorSlice& slice,
                                        const RandomFill& fill);
  // place_weight / place_random may return before the bytes are on the device (a GPU backend copies in the
  // background): this waits until every placed weight holds its bytes and throws kiln::Error if a copy failed. Call
  // it after placing and before any op reads a placed weight (load_model does); the host bytes given to
  // place_weight must stay alive and unchanged until it returns. Default: nothing to wait for.
  virtual void finish_weights() {}
  // Per-step scratch, valid until reset_scratch() (called by the runner at the start of each step).
  virtual TensorView scratch(DType dtype, Shape shape) = 0;
  virtual void reset_scratch() = 0;
  // Scratch as a stack inside a step: scratch_release(m) ends every scratch view taken since m = scratch_mark() (the
  // memory is reused by the next scratch() calls; work already queued on it is ordered before them on a backend's
  // stream). The runner frees each layer's buffers this way in large passes. Default: nothing is freed before the
  // next reset_scratch().
  struct ScratchMark {
    size_t blocks = 0, used = 0, in_use = 0;
  };
  virtual ScratchMark scratch_mark() { return {}; }
  virtual void scratch_release(const ScratchMark& mark) { (void)mark; }
  // Bytes of scratch in use at most since the last reset_scratch() (0: the backend does not count).
  virtual size_t scratch_peak_bytes() const { return 0; }
  // Host -> device copy into scratch.
  virtual TensorView upload(const void* host, DType dtype, Shape shape) = 0;
  // Device -> host (contiguous src); synchronises.
  virtual void download(const TensorView& src, void* host) = 0;
  virtual void fill_zero(TensorView t) = 0;
  // dst = src elementwise over arbitrary strides (same shape, F32). Used to split / interleave views.
  virtual void copy(const TensorView& src, TensorView dst) = 0;
  // Several contiguous byte ranges copied (src and dst of each are the backend's memory, ranges do not overlap),
  // in order with the stream's other work: what one launch can do for many small state-row copies (the settling of a
  // speculative step's rows). Default: one copy() each.
  struct CopySpan {
    const void* src = nullptr;
    void* dst = nullptr;
    size_t bytes = 0;
  };
  virtual void copy_spans(std::span<const CopySpan> spans);
  // max |x| over a view (F32), synchronises. Used to pick FP8 KV scales.
  virtual float max_abs(const TensorView& x) = 0;

  // ---- step graphs (CUDA graphs on the GPU; a no-op elsewhere)
  // The runner brackets a decode pass's compute (after its uploads, before its download) with
  // graph_capture_begin() / graph_capture_end(), then replays it with graph_launch() while the step's shape is
  // the same. Inputs must sit at the same device addresses on every replay (same scratch layout).
  // graph_capture_begin: false when the backend does not capture (the body then runs eagerly as usual).
  virtual bool graph_capture_begin() { return false; }
  // Ends the capture: a handle >= 0, or -1 when capturing failed (nothing ran: run the body again eagerly).
  virtual int graph_capture_end() { return -1; }
  // Replays a captured pass; false when the handle is stale (scratch memory moved since): capture again.
  virtual bool graph_launch(int handle) { (void)handle; return false; }
  // Forgets every captured graph.
  virtual void graph_reset() {}

  // ---- per-op profiling (kiln bench-engine --profile): time of every op between begin and end, by label.
  virtual bool profile_begin() { return false; }  // false: not supported by this backend
  virtual std::vector<OpTime> profile_end() { return {}; }

  // ---- dense maths
  // out[t] = table[ids[t]]. table [V, H] (BF16 / F32), ids I32 [T], out F32 [T, H].
  virtual void embedding(const TensorView& table, const TensorView& ids, TensorView out) = 0;
  // A vocabulary-parallel rank's embedding: table holds rows [vocab_begin, vocab_begin + R) of the full table;
  // out[t] = table[ids[t] - vocab_begin] for ids in that range, zeros for the others (the ranks' outputs are then
  // summed by all_reduce). The default fails: a backend that shards the vocabulary implements it.
  virtual void embedding_shard(const TensorView& table, const TensorView& ids, int64_t vocab_begin, TensorView out);
  // out = x W^T (+ bias). x F32 [T, K], out F32 [T, N]. fp32 accumulation.
  virtual void linear(const TensorView& x, const LinearWeight& w, TensorView out) = 0;
  // out = act(x, x2) W^T (+ bias): silu(x) * x2 (an MLP's down projection) or x * sigmoid(x2) (attention's output
  // gate). x, x2 F32 [T, K] contiguous, out [T, N]. The default computes the activation into scratch, then linear();
  // a GPU backend may apply it as it reads x (one launch fewer).
  virtual void linear_gated_input(const TensorView& x, const TensorView& x2, InputAct act, const LinearWeight& w,
                                  TensorView out);
  // Several linears of the same input at once: outs[i] = x W_i^T (+ bias_i). The default calls linear() for each;
  // a GPU backend may run them as one launch (decode steps: fewer, larger kernels).
  virtual void linear_multi(const TensorView& x, std::span<const LinearWeight* const> ws, std::span<const TensorView> outs);
  // Row-wise RMSNorm over the last dim in fp32: x_hat = x * rsqrt(mean(x^2) + eps), then * w or * (1 + w).
  // x [R, D] (rows may be strided: strides[0] >= D), weight [D] (BF16 / F32), out [R, D] contiguous.
  virtual void rms_norm(const TensorView& x, const TensorView& weight, float eps, NormKind kind,
                        TensorView out) = 0;
  // The residual step between blocks: hidden += y, then out = rms_norm(hidden). hidden, y, out [R, D] contiguous.
  // The default runs add() then rms_norm(); a GPU backend may fuse them (one pass over the row).
  virtual void add_rms_norm(TensorView hidden, const TensorView& y, const TensorView& weight, float eps, NormKind kind,
                            TensorView out);
  // Gated DeltaNet output norm: out = w * rmsnorm(x) * silu(z), per row, fp32. x, z, out [R, D]; w [D].
  virtual void gated_rms_norm(const TensorView& x, const TensorView& z, const TensorView& weight, float eps,
                              TensorView out) = 0;
  // In-place rotary embedding on the first rotary_dim dims of every head (rotate_half pairing i <-> i +
  // rotary_dim/2), inv_freq[i] = theta^(-2i/rotary_dim), angle = pos * inv_freq (fp32).
  // x [T, heads, head_dim] contiguous, positions I32 [T].
  virtual void rope(TensorView x, const TensorView& positions, int rotary_dim, double theta) = 0;
  // The same with three positions per token: frequency i of token t turns by positions[t, axes.axis(i)] * inv_freq[i].
  // positions I32 [T, 3]. The default fails: a backend that serves images implements it.
  virtual void mrope(TensorView x, const TensorView& positions, int rotary_dim, double theta, const MRopeAxes& axes);
  // A full-attention block's q / k prologue: q_out = rope(rms_norm(q)) and k_out = rope(rms_norm(k)) per head (norm
  // weights [D], `kind`), rotated by text positions (axes null: positions I32 [T], as rope()) or M-RoPE ones (positions
  // [T, 3], as mrope()). q_proj [T, Hq * D], or with gated [T, Hq * 2D] holding per head [q (D) | gate (D)], whose
  // gate halves go to gate_out [T, Hq * D]; k [T, Hkv * D]; q_out [T, Hq, D], k_out [T, Hkv, D]. The default runs
  // copy, rms_norm and rope / mrope; a GPU backend may fuse them (one launch per layer instead of five or six).
  virtual void qk_norm_rope(const TensorView& q_proj, const TensorView& k, bool gated, const TensorView& q_norm,
                            const TensorView& k_norm, float eps, NormKind kind, const TensorView& positions,
                            int rotary_dim, double theta, const MRopeAxes* axes, TensorView q_out, TensorView gate_out,
                            TensorView k_out);
  // dst[rows[r]] = src[r]: rows of precomputed input embeddings (image tokens) written over the token embeddings.
  // src F32 [R, H], rows I32 [R] (distinct, < T), dst F32 [T, H]; or src and dst I32 (ids, bit for bit). The default
  // fails (as mrope).
  virtual void scatter_rows(const TensorView& src, const TensorView& rows, TensorView dst);
  // out = a + b (same shape, F32). out may alias a.
  virtual void add(const TensorView& a, const TensorView& b, TensorView out) = 0;
  // out = silu(gate) * up. gate, up, out [T, I]. out may alias gate.
  virtual void silu_mul(const TensorView& gate, const TensorView& up, TensorView out) = 0;
  // out = x * sigmoid(g). x, out [T, N]; g [T, N] or [T, 1] (broadcast over N). out may alias x.
  virtual void sigmoid_mul(const TensorView& x, const TensorView& g, TensorView out) = 0;
  // out[r] = x[rows[r]]. x [T, H], rows I32 [R], out [R, H]; F32, or I32 (ids, bit for bit).
  virtual void gather_rows(const TensorView& x, const TensorView& rows, TensorView out) = 0;

  // ---- full attention over the paged KV cache
  // Writes each token's k, v at its position: page page_table[s][pos / page_size], row pos % page_size.
  // k, v F32 [T, kv_heads, head_dim].
  virtual void kv_store(const TensorView& k, const TensorView& v, KvLayerView cache, const StepLayout& step) = 0;
  // Causal softmax attention (GQA: q head h reads kv head h / (q_heads / kv_heads)); token t of sequence s
  // at position p attends to positions [0, p] of its sequence (kv_store for this step must have run).
  // scores = q.k * scale in fp32, softmax in fp32. q F32 [T, q_heads, head_dim], out F32 [T, q_heads, head_dim].
  virtual void attention(const TensorView& q, KvLayerView cache, const StepLayout& step, float scale,
                         TensorView out) = 0;

  // ---- Gated DeltaNet (linear attention)
  // Depthwise causal conv1d with kernel Kc over each sequence's tokens, continuing from its conv state (the
  // previous Kc-1 inputs, oldest first; zeros for a fresh sequence, as reset by the runner), then SiLU.
  // Updates the state to the last Kc-1 inputs.
  // x F32 [T, C], weight [C, Kc] (BF16 / F32; the checkpoint's [C, 1, Kc] viewed 2-D),
  // conv_state F32 [slots, C, Kc - 1], out F32 [T, C].
  virtual void causal_conv1d_silu(const TensorView& x, const TensorView& weight, TensorView conv_state,
                                  const StepLayout& step, TensorView out) = 0;
  // g = -exp(A_log) * softplus(a + dt_bias), beta = sigmoid(b), fp32. a, b, g, beta [T, Hv]; A_log, dt_bias [Hv].
  virtual void delta_rule_gates(const TensorView& a, const TensorView& b, const TensorView& A_log,
                                const TensorView& dt_bias, TensorView g, TensorView beta) = 0;
  // The gated delta rule per value head with a state S [Dk, Dv] per sequence slot, updated in fp32:
  //   q, k L2-normalised per head (x * rsqrt(sum x^2 + 1e-6)), q *= 1/sqrt(Dk); value head h reads key head
  //   h / (Hv / Hk); per token: S *= exp(g); delta = (v - k^T S) * beta; S += k (outer) delta; o = q^T S.
  // q, k F32 [T, Hk, Dk]; v F32 [T, Hv, Dv] (each may have a row stride: strides[0] >= heads * D, the heads of a
  // row contiguous, so they can be views of the conv output); g, beta F32 [T, Hv]; state [slots, Hv, Dk, Dv] (read
  // and updated) F32, or BF16 where recurrent_state_dtype() says so; out F32 [T, Hv, Dv] contiguous.
  virtual void gated_delta_rule(const TensorView& q, const TensorView& k, const TensorView& v,
                                const TensorView& g, const TensorView& beta, TensorView state,
                                const StepLayout& step, DeltaRuleMode mode, TensorView out) = 0;
  // The element type the runner stores the recurrent state in: F32 (the default, the oracle's), or BF16 on a backend
  // whose delta rule reads it into fp32 and rounds it once on store (half the bytes per step and per slot).
  virtual DType recurrent_state_dtype() const { return DType::F32; }
  // delta_rule_gates(a, b, A_log, dt_bias, g, beta) then gated_delta_rule(q, k, v, g, beta, ...) as one op, so that
  // a backend can compute the gates inside the delta rule (g and beta are then scratch it may leave unwritten).
  // The default runs the two ops.
  virtual void gated_delta_rule_with_gates(const TensorView& q, const TensorView& k, const TensorView& v,
                                           const TensorView& a, const TensorView& b, const TensorView& A_log,
                                           const TensorView& dt_bias, TensorView g, TensorView beta,
                                           TensorView state, const StepLayout& step, DeltaRuleMode mode,
                                           TensorView out);
  // A DeltaNet layer's recurrence and output norm: gated_delta_rule_with_gates(..., core), then
  // gated_rms_norm(core viewed [T * Hv, Dv], z, norm_weight, eps, out), as one op so that a backend can norm each
  // head's output row where the delta rule produces it (one launch fewer per layer and step). z, out F32 [T * Hv, Dv]
  // contiguous; core [T, Hv, Dv] is written as by gated_delta_rule. The default runs the two ops.
  virtual void gated_delta_rule_norm(const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& a,
                                     const TensorView& b, const TensorView& A_log, const TensorView& dt_bias,
                                     TensorView g, TensorView beta, TensorView state, const StepLayout& step,
                                     DeltaRuleMode mode, const TensorView& z, const TensorView& norm_weight, float eps,
                                     TensorView core, TensorView out);

  // A Gated DeltaNet layer's tensors as Ops::deltanet_block reads them (Qwen3.5 layout: separate input projections;
  // the rank's heads).
  struct DeltaNetBlockWeights {
    const LinearWeight* in_proj_qkv = nullptr;  // [2 Hk Dk + Hv Dv, H]
    const LinearWeight* in_proj_z = nullptr;    // [Hv Dv, H]
    const LinearWeight* in_proj_b = nullptr;    // [Hv, H]
    const LinearWeight* in_proj_a = nullptr;    // [Hv, H]
    TensorView conv1d;                          // [C, Kc]
    TensorView A_log, dt_bias;                  // [Hv]
    TensorView norm;                            // [Dv] the gated output norm (plain w)
    const LinearWeight* out_proj = nullptr;     // [H, Hv Dv]
    int64_t Hk = 0, Hv = 0, Dk = 0, Dv = 0;
  };
  // A Gated DeltaNet mixer of a step as one op where a backend fuses it: x = rms_norm of the residual step `in`
  // (in.hidden += in.y first when in.y is set, as input_norm adds a pending block output), then what
  // model::gated_deltanet computes from x through the output projection (linear_multi of the input projections,
  // causal_conv1d_silu, gated_delta_rule_norm with the recurrence, linear of out_proj), eps the model's
  // rms_norm_eps. conv_state, state: the layer's (as causal_conv1d_silu / gated_delta_rule take them). out F32 [T, H].
  // Returns false, having done nothing, where the backend does not fuse this step (the default). (CUDA: decode steps
  // of 1-4 sequences in one persistent kernel, deltanet_block_decode.cu.)
  virtual bool deltanet_block(const ResidualNorm& in, const DeltaNetBlockWeights& w, TensorView conv_state,
                              TensorView state, const StepLayout& step, float eps, TensorView out) {
    (void)in, (void)w, (void)conv_state, (void)state, (void)step, (void)eps, (void)out;
    return false;
  }

  // ---- mixture of experts
  // softmax over E in fp32, top-k (ties: lower expert id first), optionally renormalised to sum 1.
  // logits F32 [T, E]; expert_ids I32 [T, k]; weights F32 [T, k].
  virtual void moe_route(const TensorView& logits, int top_k, bool renormalise, TensorView expert_ids,
                         TensorView weights) = 0;
  // out[t] = sum_j weights[t, j] * expert_{ids[t, j]}(x[t]), experts applied in ascending expert id.
  // x F32 [T, H], out F32 [T, H], experts [E]. An expert without weights (gate.present() false: held by another
  // expert-parallel rank) contributes nothing.
  virtual void moe_experts(const TensorView& x, const TensorView& expert_ids, const TensorView& weights,
                           std::span<const ExpertWeights> experts, TensorView out) = 0;
  // The routed experts plus a gated shared expert's output: out = moe_experts(...) + shared * sigmoid(shared_gate).
  // shared F32 [T, H] (may be overwritten with shared * sigmoid(gate)), shared_gate F32 [T, 1]. The default runs
  // moe_experts, sigmoid_mul and add; a GPU backend folds the last two into the experts' combine.
  virtual void moe_experts_shared(const TensorView& x, const TensorView& expert_ids, const TensorView& weights,
                                  std::span<const ExpertWeights> experts, TensorView shared,
                                  const TensorView& shared_gate, TensorView out);
  // moe_route(logits, top_k, renormalise, expert_ids, weights) then the experts as one op: moe_experts_shared(x,
  // expert_ids, weights, experts, shared, shared_gate, out), or moe_experts(...) when shared.data is null (then
  // shared_gate is unused). expert_ids and weights are written as moe_route writes them. The default runs the ops one
  // by one; a GPU backend may run the routing inside the experts' kernels (CUDA: decode-sized steps in two kernels).
  virtual void moe_route_experts(const TensorView& x, const TensorView& logits, int top_k, bool renormalise,
                                 std::span<const ExpertWeights> experts, TensorView shared,
                                 const TensorView& shared_gate, TensorView expert_ids, TensorView weights,
                                 TensorView out);

  // The whole MoE block of a layer with a gated shared expert, as one op where a backend can fuse it: out = the routed
  // experts of softmax-top-k(x router^T) (renormalised or not) + sigmoid(x shared_expert_gate^T) *
  // shared_down(silu(x shared_gate^T) * (x shared_up^T)): what model::moe computes with linear_multi,
  // linear_gated_input and moe_route_experts. x, out F32 [T, H]. With `pre` (x then empty), the residual step before
  // the block is folded in: pre->hidden += pre->y and x = rms_norm(pre->hidden) (add_rms_norm's maths). Returns false,
  // having done nothing (pre->hidden untouched), where the backend does not fuse this step (the default): the caller
  // then runs the ops one by one. (CUDA: steps of 1-4 tokens in one persistent kernel, moe_block_decode.cu.)
  virtual bool moe_block(const TensorView& x, const ResidualNorm* pre, const LinearWeight& router,
                         const LinearWeight& shared_gate_proj, const LinearWeight& shared_up_proj,
                         const LinearWeight& shared_down_proj, const LinearWeight& shared_expert_gate,
                         std::span<const ExpertWeights> experts, int top_k, bool renormalise, TensorView out) {
    (void)x, (void)pre, (void)router, (void)shared_gate_proj, (void)shared_up_proj, (void)shared_down_proj,
        (void)shared_expert_gate, (void)experts, (void)top_k, (void)renormalise, (void)out;
    return false;
  }

  // ---- vision encoder (the Qwen3.5 vision tower, model/qwen3_5_vision.h). Every op below has a default that throws
  // "<op> is not implemented on the <name> backend": a backend that encodes images implements them.
  // out = (x - mean(x)) * rsqrt(var(x) + eps) * weight + bias per row over the last dim, fp32 (var: the biased
  // variance, torch.nn.LayerNorm). x, out F32 [R, D] contiguous (out may alias x); weight, bias [D] (BF16 / F32).
  virtual void layer_norm(const TensorView& x, const TensorView& weight, const TensorView& bias, float eps,
                          TensorView out);
  // out = gelu(x) elementwise, fp32: erf form 0.5 x (1 + erf(x / sqrt 2)) (torch nn.GELU()), or the tanh
  // approximation 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3))) ("gelu_pytorch_tanh"). x, out F32, same shape,
  // contiguous; out may alias x.
  virtual void gelu(const TensorView& x, GeluKind kind, TensorView out);
  // In-place rotary embedding over the whole head with per-token angles given as tables (rotate_half pairing
  // i <-> i + D/2): x[i] = x[i] cos[t, i] - x[i + D/2] sin[t, i], x[i + D/2] = x[i + D/2] cos[t, i] + x[i] sin[t, i]
  // for i < D/2. x F32 [T, heads, D] contiguous; cos, sin F32 [T, D/2].
  virtual void rope_cos_sin(TensorView x, const TensorView& cos, const TensorView& sin);
  // Bidirectional softmax attention within segments (flash-attention's varlen layout): token t of segment s
  // ([cu_seqlens[s], cu_seqlens[s+1])) attends to every token of its segment, none of the others. scores =
  // q.k * scale, softmax in fp32. q, k, v F32 [T, heads, D] contiguous; cu_seqlens I32 [S + 1] (0 first, T last,
  // non-decreasing); max_seqlen = the longest segment (a GPU backend sizes its launch by it); out F32 [T, heads, D].
  virtual void attention_segments(const TensorView& q, const TensorView& k, const TensorView& v,
                                  const TensorView& cu_seqlens, int64_t max_seqlen, float scale, TensorView out);
  // out[t] = sum_j weights[t, j] * table[ids[t, j]] (j ascending, fp32): a weighted gather of table rows (the
  // bilinear resampling of a learned position-embedding grid). table [V, H] (BF16 / F32), ids I32 [T, J],
  // weights F32 [T, J], out F32 [T, H].
  virtual void weighted_embedding(const TensorView& table, const TensorView& ids, const TensorView& weights,
                                  TensorView out);

  // ---- tensor parallelism
  // The rank's group (model/comm.h), set by the tensor-parallel runner before the model loads; none on one device.
  void set_communicator(Communicator* comm) { comm_ = comm; }
  Communicator* communicator() const { return comm_; }
  // The points where a tensor-parallel rank's partial block output is summed over the group (after the attention /
  // DeltaNet output projection, the MLP down projection, the MoE combine, the vocabulary-parallel embedding):
  // x F32 [T, H] contiguous, in place. Without a group (or a group of one) the sum is already whole: nothing to do.
  // The default fails for a group of several ranks: a backend implements it over its communicator (the CPU backend
  // over host memory; a GPU backend on its stream).
  virtual void all_reduce(TensorView x);

  // ---- sampling
  // ids[r] = argmax_v logits[r, v] (lowest index on ties; NaN never wins; all NaN: 0), written to host memory
  // (synchronises). logits F32 [R, V] contiguous. The default downloads the logits and scans them on the host.
  virtual void argmax_rows(const TensorView& logits, std::span<int32_t> ids);
  // argmax_rows plus each row's best logit (values[r] = logits[r, ids[r]]; NaN for a row without a number): what a
  // tensor-parallel rank's vocabulary slice offers against the other ranks'. The default downloads and scans.
  virtual void argmax_rows_best(const TensorView& logits, std::span<int32_t> ids, std::span<float> values);
  // ids[r] = id_offset + argmax_v logits[r, v] (argmax_rows' rule: lowest index on ties; NaN never wins; all NaN: 0),
  // written to device memory: ids I32 [R] contiguous, logits F32 [R, V] contiguous. No host copy and no
  // synchronisation, so a captured step graph (the MTP draft chain) can feed the ids to its next step. id_offset: a
  // lone tensor-parallel rank's first vocabulary id (0 otherwise). The default runs argmax_rows (a download) and
  // uploads the ids, which a graph cannot capture; the CPU and CUDA backends pick on the device itself.
  virtual void argmax_rows_into(const TensorView& logits, TensorView ids, int32_t id_offset);
  // ids[r] = sample_row_host(logits[r], V, rows[r]) (model/sampling.h: temperature, top-k, top-p, min-p, the draw
  // with rows[r].u; -1 for a row without a finite logit), written to host memory (synchronises). logits F32 [R, V]
  // contiguous. The default downloads the logits and samples on the host; a GPU backend samples on the device and
  // copies back only the ids (the same tokens up to the rounding of its sums, see backend/cuda/kernels.h).
  virtual void sample_rows(const TensorView& logits, std::span<const RowSampling> rows, std::span<int32_t> ids);

  // ---- reporting
  // The device's memory figures (its index, name, weights, scratch, total memory; the runner adds its KV pool and
  // state slots). Empty for a backend without a device (the CPU).
  virtual std::optional<DeviceMemory> device_memory() const { return std::nullopt; }

 private:
  std::vector<std::unique_ptr<uint8_t[]>> random_storage_;  // place_random's default

 protected:
  Communicator* comm_ = nullptr;
};

// Uploads the step's host mirrors into its device arrays with Ops::upload(), always in the same order (token_pos,
// seq_token_begin, seq_start_pos, seq_state_slot, page_table): a replayed graph finds its inputs where the captured
// pass read them.
void upload_step(Ops& ops, StepLayout& step);

// Several I32 arrays uploaded as one (one host-to-device copy instead of one per array: each small pageable copy costs
// the host a few microseconds and the stream one more copy ahead of the pass's kernels). add() each array (its offset
// in ints comes back; every array starts on a 256-byte boundary), upload() once, then view() each. The same arrays
// in the same order give the same sizes, so a replayed pass finds its inputs where the captured one read them.
class I32Upload {
 public:
  int64_t add(std::span<const int32_t> data);
  void upload(Ops& ops);
  TensorView view(int64_t offset, Shape shape) const;

 private:
  std::vector<int32_t> host_;
  TensorView dev_;
};
// upload_step through an I32Upload: stage_step adds the step's arrays, bind_step (after upload) sets its views.
struct StagedStep {
  int64_t token_pos = -1, seq_token_begin = -1, seq_start_pos = -1, seq_state_slot = -1, page_table = -1,
          token_mrope_pos = -1, token_checkpoint_slot = -1;
};
StagedStep stage_step(I32Upload& up, const StepLayout& step);
void bind_step(const I32Upload& up, const StagedStep& at, StepLayout& step);

}  // namespace kiln::model
