// Weight upload (weight_upload.h): the staging plan on the host (no GPU needed), then the asynchronous copies on
// the GPU checked byte for byte, and a model loaded through small staging buffers giving the same logits.
#include "backend/cuda/weight_upload.h"

#include <gtest/gtest.h>

#include <chrono>
#include <cstring>
#include <random>
#include <vector>

#include "backend/cpu/cpu_ops.h"
#include "backend/cuda/cuda_ops.h"
#include "model/runner.h"
#include "test_util.h"

namespace kiln::backend::cuda {
namespace {

size_t align256(size_t n) { return (n + 255) / 256 * 256; }

// Destinations laid out as the runtime lays out weights: 256-byte aligned, back to back.
struct Layout {
  std::vector<size_t> offsets;
  size_t total = 0;
  explicit Layout(const std::vector<size_t>& sizes) {
    for (size_t s : sizes) {
      offsets.push_back(total);
      total += align256(std::max<size_t>(s, 1));
    }
  }
};

std::vector<uint8_t> random_bytes(size_t n, uint32_t seed) {
  std::vector<uint8_t> v(n);
  std::mt19937 rng(seed);
  for (auto& b : v) b = static_cast<uint8_t>(rng());
  return v;
}

// Plays a plan on the host: pieces into a staging buffer, then its device copies into `dst`.
void play(const std::vector<StagingBatch>& batches, size_t buffer_bytes, uint8_t* dst_base, uint8_t* dst_host) {
  std::vector<uint8_t> staging(buffer_bytes, 0xEE);
  for (const StagingBatch& b : batches) {
    ASSERT_LE(b.used, buffer_bytes);
    size_t payload = 0;
    for (const auto& p : b.pieces) {
      ASSERT_LE(p.offset + p.bytes, buffer_bytes);
      std::memcpy(staging.data() + p.offset, p.src, p.bytes);
      payload += p.bytes;
    }
    EXPECT_EQ(payload, b.payload);
    for (const auto& c : b.copies) {
      ASSERT_LE(c.offset + c.bytes, buffer_bytes);
      std::memcpy(dst_host + (c.dst - dst_base), staging.data() + c.offset, c.bytes);
    }
  }
}

std::vector<size_t> varied_sizes() {
  std::vector<size_t> sizes = {0, 1, 3, 255, 256, 257, 4096, 4097, 10000, 65536 * 3 + 5};
  std::mt19937 rng(3);
  for (int i = 0; i < 300; ++i) sizes.push_back(std::uniform_int_distribution<size_t>(1, 3000)(rng));
  sizes.push_back(65536 * 2);  // exactly two buffers below
  sizes.push_back(7);
  return sizes;
}

TEST(StagingPlanner, EveryByteLandsWhereItBelongs) {
  const size_t buffer = 65536;
  const std::vector<size_t> sizes = varied_sizes();
  const Layout layout(sizes);
  size_t src_total = 0;
  for (size_t s : sizes) src_total += s;
  const std::vector<uint8_t> src = random_bytes(src_total, 1);
  // Fake device addresses: a host buffer stands for the device memory.
  std::vector<uint8_t> device(layout.total, 0);
  StagingPlanner planner(buffer);
  std::vector<StagingBatch> batches;
  size_t at = 0;
  for (size_t i = 0; i < sizes.size(); ++i) {
    planner.add(device.data() + layout.offsets[i], src.data() + at, sizes[i], i, batches);
    at += sizes[i];
  }
  if (auto last = planner.flush()) batches.push_back(std::move(*last));
  EXPECT_FALSE(planner.flush().has_value());
  std::vector<uint8_t> got(layout.total, 0);
  play(batches, buffer, device.data(), got.data());
  at = 0;
  size_t payload = 0;
  for (const StagingBatch& b : batches) payload += b.payload;
  EXPECT_EQ(payload, src_total);
  for (size_t i = 0; i < sizes.size(); ++i) {
    EXPECT_EQ(0, std::memcmp(got.data() + layout.offsets[i], src.data() + at, sizes[i])) << "tensor " << i;
    at += sizes[i];
  }
  // Small neighbours share device copies: far fewer copies than tensors.
  size_t copies = 0;
  for (const StagingBatch& b : batches) copies += b.copies.size();
  EXPECT_LT(copies, sizes.size() / 4);
  // ~1.3 MB of 64 KiB buffers: every batch but the last is (almost) full.
  EXPECT_LE(batches.size(), layout.total / buffer + 2);
}

TEST(StagingPlanner, LargeTensorGoesInBufferSizedPieces) {
  const size_t buffer = 1000;
  std::vector<uint8_t> dev(4096);
  std::vector<uint8_t> src = random_bytes(2500, 2);
  StagingPlanner planner(buffer);
  std::vector<StagingBatch> batches;
  planner.add(dev.data(), src.data(), 2500, 0, batches);
  ASSERT_EQ(batches.size(), 2u);  // two full buffers closed, 500 bytes still open
  auto last = planner.flush();
  ASSERT_TRUE(last.has_value());
  batches.push_back(*last);
  const size_t expect_bytes[] = {1000, 1000, 500};
  for (size_t i = 0; i < 3; ++i) {
    ASSERT_EQ(batches[i].pieces.size(), 1u);
    ASSERT_EQ(batches[i].copies.size(), 1u);
    EXPECT_EQ(batches[i].pieces[0].bytes, expect_bytes[i]);
    EXPECT_EQ(batches[i].pieces[0].offset, 0u);
    EXPECT_EQ(batches[i].copies[0].dst, dev.data() + 1000 * i);
    EXPECT_EQ(batches[i].pieces[0].src, src.data() + 1000 * i);
  }
}

TEST(StagingPlanner, JoinsOnlyAcrossPaddingGaps) {
  std::vector<uint8_t> dev(8192);
  std::vector<uint8_t> src(8192);
  StagingPlanner planner(65536);
  std::vector<StagingBatch> batches;
  planner.add(dev.data(), src.data(), 100, 0, batches);             // [0, 100)
  planner.add(dev.data() + 256, src.data() + 100, 300, 1, batches);  // gap of 156 bytes: joined
  planner.add(dev.data() + 556, src.data() + 400, 10, 2, batches);   // adjacent: joined
  planner.add(dev.data() + 1024, src.data() + 410, 10, 3, batches);  // gap of 458 bytes: a new copy
  planner.add(dev.data() + 512, src.data() + 420, 10, 4, batches);   // backwards: a new copy
  planner.add(dev.data() + 2048, src.data() + 430, 0, 5, batches);   // nothing
  auto b = planner.flush();
  ASSERT_TRUE(b.has_value());
  EXPECT_TRUE(batches.empty());
  ASSERT_EQ(b->copies.size(), 3u);
  EXPECT_EQ(b->copies[0].dst, dev.data());
  EXPECT_EQ(b->copies[0].bytes, 566u);
  EXPECT_EQ(b->copies[1].dst, dev.data() + 1024);
  EXPECT_EQ(b->copies[1].bytes, 10u);
  EXPECT_EQ(b->copies[2].dst, dev.data() + 512);
  EXPECT_EQ(b->pieces.size(), 5u);
  EXPECT_EQ(b->pieces[1].offset, 256u);  // at its distance from the joined copy's start
  EXPECT_EQ(b->pieces[3].offset % 16, 0u);
  EXPECT_EQ(b->payload, 430u);
  EXPECT_EQ(b->first_placement, 0u);
  EXPECT_EQ(b->last_placement, 4u);
}

// ---- on the GPU

// Places `sizes` through `up` into one device buffer laid out like the runtime's weights; checks every byte.
void check_uploads(WeightUploader& up, const std::vector<size_t>& sizes, uint32_t seed) {
  const Layout layout(sizes);
  size_t src_total = 0;
  for (size_t s : sizes) src_total += s;
  const std::vector<uint8_t> src = random_bytes(src_total, seed);
  ::kiln::cuda::DeviceBuffer dev(layout.total);
  size_t at = 0;
  for (size_t i = 0; i < sizes.size(); ++i) {
    up.enqueue(dev.as<uint8_t>() + layout.offsets[i], src.data() + at, sizes[i]);
    at += sizes[i];
  }
  up.finish();
  std::vector<uint8_t> got(layout.total);
  ASSERT_EQ(cudaMemcpy(got.data(), dev.data(), layout.total, cudaMemcpyDeviceToHost), cudaSuccess);
  at = 0;
  for (size_t i = 0; i < sizes.size(); ++i) {
    ASSERT_EQ(0, std::memcmp(got.data() + layout.offsets[i], src.data() + at, sizes[i]))
        << "tensor " << i << " of " << sizes[i] << " bytes";
    at += sizes[i];
  }
}

TEST(WeightUpload, EveryByteArrivesThroughSmallStagingBuffers) {
  KILN_REQUIRE_CUDA_DEVICE();
  for (bool pinned : {true, false}) {
    UploadOptions o;
    o.buffer_bytes = 65536;
    o.threads = 3;
    o.pinned = pinned;
    WeightUploader up(probe_cuda_device().index, o);
    std::vector<size_t> sizes = varied_sizes();
    for (int i = 0; i < 2000; ++i) sizes.push_back(16 + i % 97);  // many small ones back to back
    sizes.push_back(1 << 20);  // 16 buffers
    check_uploads(up, sizes, pinned ? 11 : 12);
    const auto st = up.stats();
    EXPECT_EQ(st.threads, 3) << "pinned " << pinned;
    EXPECT_GT(st.batches, 20u);
    // Reused after finish(): a second load through the same uploader.
    check_uploads(up, {5, 70000, 0, 300}, 13);
  }
}

TEST(WeightUpload, FewSmallTensorsRunOnTheCallersThread) {
  KILN_REQUIRE_CUDA_DEVICE();
  WeightUploader up(probe_cuda_device().index);
  check_uploads(up, {0, 1, 2, 3, 1000, 4096}, 14);
  EXPECT_EQ(up.stats().threads, 0);
  up.finish();  // nothing queued: fine
}

TEST(WeightUpload, CudaOpsPlacesAsynchronouslyAndFinishes) {
  KILN_REQUIRE_CUDA_DEVICE();
  CudaOps ops;
  // Default staging (32 MiB buffers): tensors larger than a buffer, odd sizes, many small ones.
  std::vector<size_t> sizes = {0, 1, 7, 255, 257, (size_t(32) << 20) + 1, (size_t(80) << 20) + 13, 3};
  for (int i = 0; i < 5000; ++i) sizes.push_back(2 + (i * 37) % 4099);
  std::vector<std::vector<uint8_t>> host;
  std::vector<TensorView> placed;
  for (size_t i = 0; i < sizes.size(); ++i) {
    host.push_back(random_bytes(sizes[i], static_cast<uint32_t>(100 + i)));
    placed.push_back(ops.place_weight(TensorView(host.back().data(), DType::U8, Shape{static_cast<int64_t>(sizes[i])})));
  }
  ops.finish_weights();
  for (size_t i = 0; i < sizes.size(); ++i) {
    std::vector<uint8_t> got(sizes[i]);
    ops.download(placed[i], got.data());
    ASSERT_EQ(got, host[i]) << "tensor " << i << " of " << sizes[i] << " bytes";
  }
}

// The load rate from host memory (page-cache loads go through the same path; `kiln serve` logs "loaded weights:
// ... GB/s" for a real checkpoint).
TEST(WeightUpload, RateFromHostMemory) {
  KILN_REQUIRE_CUDA_DEVICE();
  CudaOps ops;
  const size_t tensor = size_t(24) << 20;
  const int n = 160;  // ~4 GB
  std::vector<uint8_t> host(tensor * n);
  for (size_t i = 0; i < host.size(); i += 4096) host[i] = static_cast<uint8_t>(i >> 12);
  const auto t0 = std::chrono::steady_clock::now();
  std::vector<TensorView> placed;
  for (int i = 0; i < n; ++i)
    placed.push_back(ops.place_weight(TensorView(host.data() + tensor * i, DType::U8, Shape{static_cast<int64_t>(tensor)})));
  ops.finish_weights();
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::vector<uint8_t> got(tensor);
  ops.download(placed[n - 1], got.data());
  EXPECT_EQ(0, std::memcmp(got.data(), host.data() + tensor * (n - 1), tensor));
  std::printf("[ upload   ] place_weight of %.2f GB from host memory: %.3f s, %.1f GB/s\n", host.size() / 1e9, s,
              host.size() / 1e9 / s);
}

// kiln-tiny (17 MB: below one default staging buffer, so its load runs on the caller's thread) loaded through
// 64 KiB buffers on 4 threads: the same logits, bit for bit.
TEST(WeightUpload, ModelLoadedThroughWorkersGivesTheSameLogits) {
  KILN_REQUIRE_CUDA_DEVICE();
  const std::string dir = std::string(KILN_SOURCE_DIR) + "/models/kiln-tiny";
  auto logits = [&](bool small_buffers) {
    auto ops = std::make_unique<CudaOps>();
    if (small_buffers) {
      UploadOptions o;
      o.buffer_bytes = 65536;
      o.threads = 4;
      ops->set_weight_upload(o);
    }
    model::RunnerOptions ro;
    ro.kv_dtype = DType::F32;
    ro.state_slots = 1;
    ro.max_context = 64;
    model::Runner r(std::move(ops), format::ModelDir::open(dir), ro);
    const std::vector<int32_t> prompt = {1, 2, 3, 4, 5, 6, 7, 8, 900, 17};
    const auto cap = r.capacity();
    std::vector<int32_t> pages(cap.kv_pages / cap.state_slots);
    for (size_t p = 0; p < pages.size(); ++p) pages[p] = static_cast<int32_t>(p);
    std::vector<model::SeqChunk> chunks(1);
    chunks[0].state_slot = 0;
    chunks[0].tokens = prompt;
    chunks[0].start_pos = 0;
    chunks[0].page_table = pages;
    std::vector<float> out(r.vocab_size());
    r.forward(chunks, out);
    return out;
  };
  const std::vector<float> a = logits(false), b = logits(true);
  ASSERT_EQ(a.size(), b.size());
  EXPECT_EQ(0, std::memcmp(a.data(), b.data(), a.size() * sizeof(float)));
}

}  // namespace
}  // namespace kiln::backend::cuda
