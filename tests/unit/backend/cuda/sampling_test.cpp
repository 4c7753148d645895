// Device sampling (sampling.cu) through CudaOps: argmax_rows (and argmax_rows_best's values) against
// model::host_argmax (lowest index on ties, NaN never wins, an all-NaN row gives 0, -0 ties +0; rows of 1 .. 248,320
// values, ties across chunk boundaries, NaN / inf); argmax_rows_into (ids left on the device, plus an offset) against
// host_argmax and the CPU backend's, eagerly and replayed from a CUDA graph on new logits; and sample_rows against
// model::sample_row_host. Skipped without a usable GPU.
//
// The device sums the probabilities in another order than the host (trees and per-thread segments there, running
// sums here), so in principle a token could differ when a uniform or a top-p / min-p threshold lands within ~1e-12
// (relative) of a boundary. With these random inputs that does not happen: the tokens must be identical, row by row.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include <cuda_runtime.h>

#include "backend/cpu/cpu_backend.h"
#include "backend/cuda/cuda_check.h"
#include "backend/cuda/cuda_ops.h"
#include "model/ops.h"
#include "model/sampling.h"
#include "test_util.h"

namespace kiln::backend::cuda {
namespace {

TEST(CudaArgmaxRows, MatchesHostDefinition) {
  KILN_REQUIRE_CUDA_DEVICE();
  CudaOps ops;
  std::mt19937 rng(123);
  const float nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
  int cases = 0;
  for (int64_t V : {1, 2, 31, 4095, 4096, 4097, 50000, 248320}) {
    for (int kind = 0; kind < 7; ++kind) {
      const int64_t R = kind == 0 ? 37 : 3;
      std::vector<float> h(static_cast<size_t>(R * V));
      std::uniform_real_distribution<float> u(-20.0f, 20.0f);
      for (float& x : h) x = kind == 4 ? std::round(u(rng)) : u(rng);  // kind 4: many exact ties
      for (int64_t r = 0; r < R; ++r) {
        float* row = h.data() + r * V;
        std::uniform_int_distribution<int64_t> pos(0, V - 1);
        switch (kind) {
          case 1: {  // the maximum twice, far apart (different chunks when V is large): the lower index wins
            const int64_t a = pos(rng), b = pos(rng);
            row[a] = row[b] = 25.0f;
            break;
          }
          case 2:  // NaNs everywhere but one finite value somewhere
            for (int64_t v = 0; v < V; ++v) row[v] = nan;
            row[pos(rng)] = -3.0f;
            break;
          case 3:  // all NaN: 0
            for (int64_t v = 0; v < V; ++v) row[v] = nan;
            break;
          case 5:  // -inf everywhere, +inf somewhere, NaN at the front
            for (int64_t v = 0; v < V; ++v) row[v] = -inf;
            row[pos(rng)] = inf;
            row[0] = nan;
            break;
          case 6:  // zeros of both signs only: the first wins
            for (int64_t v = 0; v < V; ++v) row[v] = (v % 3 == 0) ? 0.0f : -0.0f;
            break;
          default: break;
        }
      }
      TensorView d = ops.upload(h.data(), DType::F32, Shape{R, V});
      std::vector<int32_t> ids(static_cast<size_t>(R), -7), ids2(static_cast<size_t>(R), -7);
      std::vector<float> values(static_cast<size_t>(R), 1234.5f);
      ops.argmax_rows(d, ids);
      ops.argmax_rows_best(d, ids2, values);  // the same ids, and each row's best logit (a TP rank's offer)
      for (int64_t r = 0; r < R; ++r) {
        const int32_t want = model::host_argmax(h.data() + r * V, V);
        EXPECT_EQ(ids[static_cast<size_t>(r)], want) << "V " << V << " kind " << kind << " row " << r;
        EXPECT_EQ(ids2[static_cast<size_t>(r)], want) << "V " << V << " kind " << kind << " row " << r;
        const float best = h[static_cast<size_t>(r * V + want)];
        if (std::isnan(best)) EXPECT_TRUE(std::isnan(values[static_cast<size_t>(r)])) << "V " << V << " row " << r;
        else EXPECT_EQ(values[static_cast<size_t>(r)], best) << "V " << V << " kind " << kind << " row " << r;
        ++cases;
      }
      ops.reset_scratch();
    }
  }
  EXPECT_GT(cases, 100);
}

// Rows of the kinds above (ties far apart and within a chunk, NaN, all NaN, infinities, signed zeros) for the ids-on-
// the-device form.
std::vector<float> argmax_case(std::mt19937& rng, int64_t R, int64_t V) {
  const float nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
  std::vector<float> h(static_cast<size_t>(R * V));
  std::uniform_real_distribution<float> u(-20.0f, 20.0f);
  std::uniform_int_distribution<int64_t> pos(0, V - 1);
  for (int64_t r = 0; r < R; ++r) {
    float* row = h.data() + r * V;
    const int kind = static_cast<int>(r % 6);
    for (int64_t v = 0; v < V; ++v) row[v] = kind == 1 ? std::round(u(rng)) : u(rng);
    switch (kind) {
      case 0: {
        const int64_t a = pos(rng), b = pos(rng);
        row[a] = row[b] = 25.0f;
        break;
      }
      case 2:
        for (int64_t v = 0; v < V; ++v) row[v] = nan;
        row[pos(rng)] = -3.0f;
        break;
      case 3:
        for (int64_t v = 0; v < V; ++v) row[v] = nan;
        break;
      case 4:
        for (int64_t v = 0; v < V; ++v) row[v] = -inf;
        row[pos(rng)] = inf;
        row[0] = nan;
        break;
      case 5:
        for (int64_t v = 0; v < V; ++v) row[v] = (v % 3 == 0) ? 0.0f : -0.0f;
        break;
      default: break;
    }
  }
  return h;
}

TEST(CudaArgmaxRows, IntoDeviceIdsMatchesTheCpuBackend) {
  KILN_REQUIRE_CUDA_DEVICE();
  CudaOps gpu;
  auto cpu = make_cpu_backend();
  std::mt19937 rng(321);
  int cases = 0;
  for (int64_t V : {1, 3, 255, 4095, 4096, 4097, 12289, 50000, 248320}) {
    for (int64_t R : {1, 3, 13}) {
      const std::vector<float> h = argmax_case(rng, R, V);
      for (int32_t offset : {0, 124160}) {
        // The ids go to row 1 of a [3, R] block (a draft chain's step row); rows 0 and 2 stay as they were.
        std::vector<int32_t> init(static_cast<size_t>(3 * R), -7), got(init.size()), want(init.size());
        for (model::Ops* ops : {static_cast<model::Ops*>(&gpu), static_cast<model::Ops*>(cpu.get())}) {
          ops->reset_scratch();
          const TensorView logits = ops->upload(h.data(), DType::F32, Shape{R, V});
          const TensorView block = ops->upload(init.data(), DType::I32, Shape{3, R});
          ops->argmax_rows_into(logits, block.row(1), offset);
          ops->download(block, ops == &gpu ? got.data() : want.data());
        }
        EXPECT_EQ(got, want) << "V " << V << " R " << R << " offset " << offset;
        for (int64_t r = 0; r < R; ++r) {
          EXPECT_EQ(got[static_cast<size_t>(R + r)], offset + model::host_argmax(h.data() + r * V, V))
              << "V " << V << " row " << r << " offset " << offset;
          EXPECT_EQ(got[static_cast<size_t>(r)], -7);
          EXPECT_EQ(got[static_cast<size_t>(2 * R + r)], -7);
          ++cases;
        }
      }
    }
  }
  EXPECT_EQ(cases, 9 * (1 + 3 + 13) * 2);
}

// Captured once, replayed on other logits at the same address: the ids follow the new logits (the op reads and writes
// only device memory; its chunk keys live in the step's scratch).
TEST(CudaArgmaxRows, IntoDeviceIdsReplaysFromAGraph) {
  KILN_REQUIRE_CUDA_DEVICE();
  CudaOps gpu;
  std::mt19937 rng(99);
  const int64_t R = 3, V = 50000;
  const TensorView logits = gpu.allocate(DType::F32, Shape{R, V});
  const TensorView ids = gpu.allocate(DType::I32, Shape{R});
  auto put = [&](const std::vector<float>& h) {
    KILN_CUDA_CHECK(cudaMemcpy(logits.data, h.data(), h.size() * sizeof(float), cudaMemcpyHostToDevice));
    // From pageable memory cudaMemcpy may return before the DMA lands (CUDA's API sync notes), and the ops' stream
    // does not wait for the legacy stream: without this a replay read the end of the old logits (seen on an H100).
    KILN_CUDA_CHECK(cudaDeviceSynchronize());
  };
  auto check = [&](const std::vector<float>& h, int32_t offset, const char* what) {
    std::vector<int32_t> got(static_cast<size_t>(R));
    gpu.download(ids, got.data());
    for (int64_t r = 0; r < R; ++r)
      EXPECT_EQ(got[static_cast<size_t>(r)], offset + model::host_argmax(h.data() + r * V, V)) << what << " row " << r;
  };
  std::vector<float> h = argmax_case(rng, R, V);
  put(h);
  gpu.argmax_rows_into(logits, ids, 7);  // eager: the scratch grows to what the op takes
  check(h, 7, "eager");
  gpu.reset_scratch();
  gpu.synchronize();
  ASSERT_TRUE(gpu.graph_capture_begin());
  gpu.argmax_rows_into(logits, ids, 7);
  const int graph = gpu.graph_capture_end();
  ASSERT_GE(graph, 0) << "the capture failed";
  for (int replay = 0; replay < 3; ++replay) {
    h = argmax_case(rng, R, V);
    put(h);
    ASSERT_TRUE(gpu.graph_launch(graph)) << "replay " << replay;
    check(h, 7, "replay");
  }
}

// Logits of several kinds: continuous, heavy ties (8 levels), -inf entries, one dominant token, all equal.
std::vector<float> sampling_test_row(std::mt19937_64& rng, int64_t V, int kind) {
  std::normal_distribution<float> normal(0.0f, 3.0f);
  std::vector<float> l(static_cast<size_t>(V));
  for (auto& x : l) {
    switch (kind) {
      case 0: x = normal(rng); break;
      case 1: x = static_cast<float>(rng() % 8) * 0.5f; break;
      case 2: x = rng() % 4 == 0 ? -INFINITY : normal(rng); break;
      case 3: x = normal(rng) * 0.2f; break;
      default: x = 0.25f; break;
    }
  }
  if (kind == 2) l[static_cast<size_t>(rng() % static_cast<uint64_t>(V))] = 1.0f;  // a finite value
  if (kind == 3) l[static_cast<size_t>(rng() % static_cast<uint64_t>(V))] = 12.0f;
  return l;
}

struct SampleCase {
  std::vector<float> logits;  // [R, V]
  std::vector<model::RowSampling> rows;
};

// R rows of vocabulary V: parameters from the grid (every combination in turn), uniforms random.
SampleCase sampling_case(int64_t V, int R, uint64_t seed) {
  static const float temps[] = {0.0f, 0.3f, 0.7f, 1.0f, 1.3f, 2.0f};
  static const float top_ps[] = {1.0f, 0.9f, 0.5f, 0.01f};
  static const float min_ps[] = {0.0f, 0.05f};
  const int64_t top_ks[] = {0, 1, 5, 50, V};
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> uniform(0.0, 1.0);
  SampleCase c;
  c.logits.reserve(static_cast<size_t>(R * V));
  for (int r = 0; r < R; ++r) {
    int g = r;
    model::RowSampling rs;
    rs.temperature = temps[g % 6];
    g /= 6;
    rs.top_k = static_cast<int32_t>(top_ks[g % 5]);
    g /= 5;
    rs.top_p = top_ps[g % 4];
    g /= 4;
    rs.min_p = min_ps[g % 2];
    rs.u = uniform(rng);
    const std::vector<float> l = sampling_test_row(rng, V, static_cast<int>((r / 240 + r) % 5));
    c.logits.insert(c.logits.end(), l.begin(), l.end());
    c.rows.push_back(rs);
  }
  return c;
}

TEST(CudaOps, SampleRowsAreTheHostsTokens) {
  KILN_REQUIRE_CUDA_DEVICE();
  CudaOps gpu;
  int checked = 0, drawn = 0;
  for (auto [V, R] : {std::pair<int64_t, int>{1, 60}, {7, 480}, {1000, 960}, {50000, 480}, {248320, 240}}) {
    const SampleCase c = sampling_case(V, R, 1000 + static_cast<uint64_t>(V));
    gpu.reset_scratch();
    const TensorView logits = gpu.upload(c.logits.data(), DType::F32, Shape{R, V});
    std::vector<int32_t> ids(static_cast<size_t>(R), -2), again(static_cast<size_t>(R), -2);
    gpu.sample_rows(logits, c.rows, ids);
    gpu.sample_rows(logits, c.rows, again);
    EXPECT_EQ(ids, again) << "V " << V << ": the same inputs, the same tokens";
    model::SampleScratch scratch;
    int bad = 0;
    for (int r = 0; r < R; ++r) {
      const model::RowSampling& rs = c.rows[static_cast<size_t>(r)];
      const int32_t want = model::sample_row_host(c.logits.data() + r * V, V, rs, scratch);
      if (ids[static_cast<size_t>(r)] != want && ++bad <= 10)
        ADD_FAILURE() << "V " << V << " row " << r << ": device " << ids[static_cast<size_t>(r)] << ", host " << want
                      << " (T " << rs.temperature << " top_k " << rs.top_k << " top_p " << rs.top_p << " min_p "
                      << rs.min_p << " u " << rs.u << ")";
      ++checked;
      drawn += rs.temperature >= 1e-6f;
    }
    EXPECT_EQ(bad, 0) << "V " << V;
  }
  std::printf("[ sample   ] %d rows (%d drawn, the rest greedy): device tokens == host tokens\n", checked, drawn);
}

TEST(CudaOps, SampleRowsEdgeCases) {
  KILN_REQUIRE_CUDA_DEVICE();
  CudaOps gpu;
  const int64_t V = 4;
  const float l3 = std::log(3.0f);
  struct Row {
    std::vector<float> logits;
    model::RowSampling rs;
    int32_t want;
  };
  auto rs = [](float t, int k, float p, float m, double u) { return model::RowSampling{t, k, p, m, u}; };
  const std::vector<Row> rows = {
      {{1, 3, 3, 2}, rs(0, 0, 1, 0, 0), 1},                    // greedy: lowest id of the tie
      {{-0.0f, 0.0f, -1, -2}, rs(0, 0, 1, 0, 0), 0},           // -0 ties +0
      {{-INFINITY, -INFINITY, -INFINITY, -INFINITY}, rs(1, 0, 1, 0, 0.5), -1},
      {{-INFINITY, -INFINITY, -INFINITY, -INFINITY}, rs(0, 0, 1, 0, 0.5), -1},
      {{0, INFINITY, 0, 0}, rs(1, 0, 1, 0, 0.5), -1},
      {{0, 0, 0, 0}, rs(1, 0, 1, 0, 0.2499), 0},               // the draw walks ascending ids
      {{0, 0, 0, 0}, rs(1, 0, 1, 0, 0.25), 1},
      {{0, 0, 0, 0}, rs(1, 0, 1, 0, 0.99), 3},
      {{5, 1, 5, 5}, rs(1, 1, 1, 0, 0.5), 2},                  // top-k keeps the ties with the k-th
      {{0, 0, 0, 0}, rs(1, 0, 0.5f, 0, 0.99), 1},              // top-p: the lower ids of a tie
      {{0, 0, 0, 0}, rs(1, 0, 0.6f, 0, 0.99), 2},              // the crossing token is kept
      {{0, l3, l3, l3}, rs(1, 0, 0.5f, 0, 0.6), 2},
      {{0, l3, l3, l3}, rs(1, 0, 0.5f, 0, 0.999), 2},
      {{0, std::log(0.5f), std::log(0.04f), -INFINITY}, rs(1, 0, 1, 0.05f, 0.999), 1},  // min-p
      {{0, std::log(0.5f), std::log(0.04f), -INFINITY}, rs(1, 0, 1, 0, 0.999), 2},
  };
  std::vector<float> logits;
  std::vector<model::RowSampling> params;
  for (const Row& r : rows) {
    logits.insert(logits.end(), r.logits.begin(), r.logits.end());
    params.push_back(r.rs);
  }
  const int R = static_cast<int>(rows.size());
  const TensorView view = gpu.upload(logits.data(), DType::F32, Shape{R, V});
  std::vector<int32_t> ids(static_cast<size_t>(R));
  gpu.sample_rows(view, params, ids);
  for (int r = 0; r < R; ++r) {
    EXPECT_EQ(model::sample_row_host(rows[r].logits.data(), V, rows[r].rs), rows[r].want) << "host, row " << r;
    EXPECT_EQ(ids[static_cast<size_t>(r)], rows[r].want) << "device, row " << r;
  }
}


}  // namespace
}  // namespace kiln::backend::cuda
