// Helpers of the routed-expert tests at the real layer shapes (moe_decode_fused_test, moe_prefill_blas_test): random
// NVFP4 experts on the host (op_check's recipe), placed on an Ops, and host vectors of device tensors.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <ostream>
#include <random>
#include <vector>

#include <gtest/gtest.h>

#include "backend/cuda/cuda_ops.h"
#include "backend/cuda/cuda_options.h"
#include "core/dtype.h"
#include "model/ops.h"

namespace kiln::backend::cuda::test {

using model::ExpertWeights;
using model::LinearWeight;
using model::WeightFormat;

struct LayerShape {
  const char* name;
  int64_t hidden, experts, inter;
  int top_k;
};
inline void PrintTo(const LayerShape& s, std::ostream* os) { *os << s.name; }

// Random NVFP4 experts on the host (codes uniform over all 256 bytes, block scales 2^U(-2, 2), scale_2 1 / (3 sqrt(K)):
// op_check's recipe); experts outside [held_begin, held_end) are left absent (another expert-parallel rank's).
struct HostExperts {
  std::vector<std::vector<uint8_t>> bytes;  // keeps every tensor alive (the CPU backend reads them in place)
  std::vector<ExpertWeights> experts;
};

inline LinearWeight host_nvfp4(HostExperts& h, std::mt19937_64& rng, int64_t N, int64_t K) {
  LinearWeight w;
  w.format = WeightFormat::nvfp4;
  w.out_features = N;
  w.in_features = K;
  std::vector<uint8_t>& codes = h.bytes.emplace_back(static_cast<size_t>(N * K / 2));
  for (size_t i = 0; i < codes.size(); i += 8) {
    const uint64_t r = rng();
    std::memcpy(codes.data() + i, &r, std::min<size_t>(8, codes.size() - i));
  }
  std::vector<uint8_t>& scales = h.bytes.emplace_back(static_cast<size_t>(N * K / 16));
  std::uniform_real_distribution<float> u(-2.0f, 2.0f);
  for (uint8_t& s : scales) s = f32_to_e4m3(std::exp2(u(rng)));
  w.weight = TensorView(codes.data(), DType::U8, Shape{N, K / 2});
  w.block_scale = TensorView(scales.data(), DType::F8_E4M3, Shape{N, K / 16});
  w.scale = 1.0f / (3.0f * std::sqrt(static_cast<float>(K)));
  return w;
}

inline HostExperts make_experts(const LayerShape& s, uint64_t seed, int64_t held_begin, int64_t held_end) {
  HostExperts h;
  std::mt19937_64 rng(seed);
  h.bytes.reserve(static_cast<size_t>(6 * s.experts));
  h.experts.resize(static_cast<size_t>(s.experts));
  for (int64_t e = held_begin; e < held_end; ++e) {
    h.experts[e].gate = host_nvfp4(h, rng, s.inter, s.hidden);
    h.experts[e].up = host_nvfp4(h, rng, s.inter, s.hidden);
    h.experts[e].down = host_nvfp4(h, rng, s.hidden, s.inter);
  }
  return h;
}

// The experts as `ops` reads them (place_weight; the CPU returns the host views).
inline std::vector<ExpertWeights> place(model::Ops& ops, const std::vector<ExpertWeights>& host) {
  std::vector<ExpertWeights> out = host;
  for (ExpertWeights& e : out)
    for (LinearWeight* w : {&e.gate, &e.up, &e.down})
      if (w->present()) {
        w->weight = ops.place_weight(w->weight);
        w->block_scale = ops.place_weight(w->block_scale);
      }
  ops.finish_weights();
  return out;
}

inline std::vector<float> normal(std::mt19937_64& rng, size_t n, float stddev) {
  std::normal_distribution<float> d(0.0f, stddev);
  std::vector<float> v(n);
  for (float& x : v) x = d(rng);
  return v;
}

template <typename T>
std::vector<T> read(model::Ops& ops, const TensorView& v) {
  std::vector<T> out(static_cast<size_t>(v.numel()));
  ops.download(v, out.data());
  return out;
}

// One step's inputs on the host: x [T, H], router logits [T, E], the shared expert's output [T, H] and gate [T].
struct StepInputs {
  int64_t T = 0;
  std::vector<float> x, logits, shared, shared_gate;
};
inline StepInputs make_inputs(const LayerShape& s, int64_t T, uint64_t seed) {
  std::mt19937_64 rng(seed);
  StepInputs in;
  in.T = T;
  in.x = normal(rng, static_cast<size_t>(T * s.hidden), 1.0f);
  in.logits = normal(rng, static_cast<size_t>(T * s.experts), 2.0f);
  in.shared = normal(rng, static_cast<size_t>(T * s.hidden), 1.0f);
  in.shared_gate = normal(rng, static_cast<size_t>(T), 2.0f);
  return in;
}

using Inputs = StepInputs;

// One step's outputs: the routing's expert ids and the MoE block's output.
struct Outputs {
  std::vector<int32_t> ids;
  std::vector<float> out;
};
// One step's tensors on `ops` (its scratch reset first): x and the router logits uploaded, the routing's ids and
// weights and the block's output as scratch.
struct StepViews {
  TensorView x, logits, ids, weights, out;
};
inline StepViews upload_step(model::Ops& ops, const LayerShape& s, const Inputs& in) {
  ops.reset_scratch();
  const int64_t T = in.T, H = s.hidden;
  return {ops.upload(in.x.data(), DType::F32, Shape{T, H}), ops.upload(in.logits.data(), DType::F32, Shape{T, s.experts}),
          ops.scratch(DType::I32, Shape{T, s.top_k}), ops.scratch(DType::F32, Shape{T, s.top_k}),
          ops.scratch(DType::F32, Shape{T, H})};
}

// moe_route, then moe_experts_shared (with_shared) or moe_experts, eagerly.
inline Outputs run(model::Ops& ops, const std::vector<model::ExpertWeights>& experts, const LayerShape& s,
                   const Inputs& in, bool with_shared) {
  const StepViews v = upload_step(ops, s, in);
  ops.moe_route(v.logits, s.top_k, true, v.ids, v.weights);
  if (with_shared) {
    const TensorView shared = ops.upload(in.shared.data(), DType::F32, Shape{in.T, s.hidden});
    const TensorView gate = ops.upload(in.shared_gate.data(), DType::F32, Shape{in.T, 1});
    ops.moe_experts_shared(v.x, v.ids, v.weights, experts, shared, gate, v.out);
  } else {
    ops.moe_experts(v.x, v.ids, v.weights, experts, v.out);
  }
  return {read<int32_t>(ops, v.ids), read<float>(ops, v.out)};
}

// --dtype bfloat16 with the large-step expert path `mode`.
inline CudaOptions bf16_options(MoePrefill mode) {
  CudaOptions o;
  o.dtype = CudaOptions::ActivationDtype::bfloat16;
  o.moe_prefill = mode;
  return o;
}

// run() without the shared expert, captured into a CUDA graph and replayed once: the output (empty, with a test
// failure, when the capture or the replay fails).
inline std::vector<float> run_captured(CudaOps& gpu, const std::vector<model::ExpertWeights>& experts,
                                       const LayerShape& s, const Inputs& in) {
  const StepViews v = upload_step(gpu, s, in);
  gpu.synchronize();
  if (!gpu.graph_capture_begin()) {
    ADD_FAILURE() << "the capture did not begin";
    return {};
  }
  gpu.moe_route(v.logits, s.top_k, true, v.ids, v.weights);
  gpu.moe_experts(v.x, v.ids, v.weights, experts, v.out);
  const int graph = gpu.graph_capture_end();
  if (graph < 0 || !gpu.graph_launch(graph)) {
    ADD_FAILURE() << "the capture or its replay failed";
    return {};
  }
  return read<float>(gpu, v.out);
}

}  // namespace kiln::backend::cuda::test
