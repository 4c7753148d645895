// CPU paged KV cache: store and causal GQA attention, fp32 scores and softmax.
#include <algorithm>
#include <cmath>
#include <vector>

#include "backend/cpu/cpu_ops.h"
#include "core/error.h"
#include "core/thread_pool.h"

namespace kiln::backend::cpu {
namespace {

// The sequence of each token of the step.
std::vector<int32_t> token_seq(const StepLayout& step) {
  std::vector<int32_t> seq(step.num_tokens);
  for (int s = 0; s < step.num_seqs; ++s)
    for (int32_t t = step.host_seq_token_begin[s]; t < step.host_seq_token_begin[s + 1]; ++t) seq[t] = s;
  return seq;
}

// Address of (page, row) for position `pos` of sequence s, in elements of [pages, page_size, heads, D].
int64_t kv_row(const StepLayout& step, int s, int64_t pos, int64_t row_elems) {
  const int32_t page = step.host_page_table[static_cast<size_t>(s) * step.max_pages_per_seq + pos / step.page_size];
  KILN_CHECK(page >= 0, "no KV page for position {} of sequence {}", pos, s);
  return (static_cast<int64_t>(page) * step.page_size + pos % step.page_size) * row_elems;
}

void store_row(const float* src, int64_t n, const TensorView& pool, int64_t offset, float scale) {
  switch (pool.dtype) {
    case DType::F32: {
      float* d = static_cast<float*>(pool.data) + offset;
      for (int64_t i = 0; i < n; ++i) d[i] = src[i];
      return;
    }
    case DType::BF16: {
      uint16_t* d = static_cast<uint16_t*>(pool.data) + offset;
      for (int64_t i = 0; i < n; ++i) d[i] = f32_to_bf16(src[i]);
      return;
    }
    case DType::F8_E4M3: {
      uint8_t* d = static_cast<uint8_t*>(pool.data) + offset;
      const float inv = 1.0f / scale;
      for (int64_t i = 0; i < n; ++i) d[i] = f32_to_e4m3(src[i] * inv, /*saturate=*/true);
      return;
    }
    default: KILN_CHECK(false, "KV pool dtype {}", dtype_name(pool.dtype));
  }
}

void load_row(const TensorView& pool, int64_t offset, int64_t n, float scale, float* dst) {
  switch (pool.dtype) {
    case DType::F32: {
      const float* s = static_cast<const float*>(pool.data) + offset;
      for (int64_t i = 0; i < n; ++i) dst[i] = s[i];
      return;
    }
    case DType::BF16: {
      const uint16_t* s = static_cast<const uint16_t*>(pool.data) + offset;
      for (int64_t i = 0; i < n; ++i) dst[i] = bf16_to_f32(s[i]);
      return;
    }
    case DType::F8_E4M3: {
      const uint8_t* s = static_cast<const uint8_t*>(pool.data) + offset;
      for (int64_t i = 0; i < n; ++i) dst[i] = e4m3_to_f32(s[i]) * scale;
      return;
    }
    default: KILN_CHECK(false, "KV pool dtype {}", dtype_name(pool.dtype));
  }
}

}  // namespace

void CpuOps::kv_store(const TensorView& k, const TensorView& v, KvLayerView cache, const StepLayout& step) {
  const int64_t T = k.dim(0), Hkv = k.dim(1), D = k.dim(2);
  KILN_CHECK(cache.k.dim(2) == Hkv && cache.k.dim(3) == D, "kv_store: k {} for pool {}", k.shape.str(),
             cache.k.shape.str());
  const std::vector<int32_t> seq = token_seq(step);
  const float* pk = static_cast<const float*>(k.data);
  const float* pv = static_cast<const float*>(v.data);
  for (int64_t t = 0; t < T; ++t) {
    const int64_t off = kv_row(step, seq[t], step.host_token_pos[t], Hkv * D);
    store_row(pk + t * Hkv * D, Hkv * D, cache.k, off, cache.k_scale);
    store_row(pv + t * Hkv * D, Hkv * D, cache.v, off, cache.v_scale);
  }
}

void CpuOps::attention(const TensorView& q, KvLayerView cache, const StepLayout& step, float scale, TensorView out) {
  const int64_t T = q.dim(0), Hq = q.dim(1), D = q.dim(2), Hkv = cache.k.dim(2);
  KILN_CHECK(Hq % Hkv == 0 && cache.k.dim(3) == D, "attention: q {} for pool {}", q.shape.str(), cache.k.shape.str());
  const int64_t group = Hq / Hkv;
  const std::vector<int32_t> seq = token_seq(step);
  const float* pq = static_cast<const float*>(q.data);
  float* po = static_cast<float*>(out.data);
  int64_t max_pos = 0;
  for (int64_t t = 0; t < T; ++t) max_pos = std::max<int64_t>(max_pos, step.host_token_pos[t]);
  auto body = [&](int64_t b, int64_t e) {
    std::vector<float> scores(max_pos + 1), krow(D), acc(D);
    for (int64_t item = b; item < e; ++item) {
      const int64_t t = item / Hq, h = item % Hq, kvh = h / group;
      const int s = seq[t];
      const int64_t pos = step.host_token_pos[t];
      const float* qv = pq + (t * Hq + h) * D;
      float m = -INFINITY;
      for (int64_t j = 0; j <= pos; ++j) {
        load_row(cache.k, kv_row(step, s, j, Hkv * D) + kvh * D, D, cache.k_scale, krow.data());
        float dot = 0;
        for (int64_t d = 0; d < D; ++d) dot += qv[d] * krow[d];
        scores[j] = dot * scale;
        m = std::max(m, scores[j]);
      }
      float sum = 0;
      for (int64_t j = 0; j <= pos; ++j) sum += (scores[j] = std::exp(scores[j] - m));
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int64_t j = 0; j <= pos; ++j) {
        const float p = scores[j] / sum;
        load_row(cache.v, kv_row(step, s, j, Hkv * D) + kvh * D, D, cache.v_scale, krow.data());
        for (int64_t d = 0; d < D; ++d) acc[d] += p * krow[d];
      }
      std::copy(acc.begin(), acc.end(), po + (t * Hq + h) * D);
    }
  };
  const int64_t items = T * Hq;
  if (items * (max_pos + 1) * D < (int64_t{1} << 15))
    body(0, items);
  else
    ThreadPool::global().parallel_for(items, body, 1);
}

}  // namespace kiln::backend::cpu
