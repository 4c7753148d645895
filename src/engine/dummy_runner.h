// A deterministic stand-in for a model, for engine and server tests.
//
// It keeps a real paged "KV pool" (one int per page row: the token written there) and per-slot
// "recurrent state" (a running hash), both driven only by the page tables and state slots the engine
// hands out. A chunk's logits are a hash of everything its sequence wrote (read back through its
// page table) and of its state slot, so a sequence's output depends on its own tokens only when the
// engine keeps sequences apart: shared or stale pages, a wrong slot, or a wrong position all change
// the output, and tests comparing "alone" against "batched" catch it.
#pragma once
#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <mutex>
#include <span>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "model/model_runner.h"

namespace kiln::testing {

class FakeRunner : public model::ModelRunner {
 public:
  struct Options {
    int64_t vocab = 64;
    int64_t kv_pages = 256;
    int page_size = 4;
    int state_slots = 16;
    int64_t max_context = 512;
    int step_delay_us = 0;                // sleep per forward (slow model)
    int32_t favourite_token = -1;         // when >= 0, this token wins with bias when history is long
    int favourite_after = 0;              //   ... after this many tokens in the sequence
    int32_t fail_on_token = -1;           // forward throws when a chunk contains this token
  };

  explicit FakeRunner(Options o) : o_(o), kv_(static_cast<size_t>(o.kv_pages * o.page_size), -1), state_(o.state_slots, 0) {}

  model::RunnerCapacity capacity() const override {
    model::RunnerCapacity c;
    c.kv_pages = o_.kv_pages;
    c.page_size = o_.page_size;
    c.state_slots = o_.state_slots;
    c.max_context = o_.max_context;
    c.kv_bytes_per_token = 4;
    c.state_bytes_per_slot = 8;
    return c;
  }
  int64_t vocab_size() const override { return o_.vocab; }
  std::string describe() const override { return "fake runner (hash logits over a paged token store)"; }

  void forward(std::span<const model::SeqChunk> chunks, std::span<float> logits) override {
    if (o_.step_delay_us > 0) std::this_thread::sleep_for(std::chrono::microseconds(o_.step_delay_us));
    std::lock_guard<std::mutex> lock(mu_);
    ++steps_;
    size_t row = 0;
    for (const auto& c : chunks) {
      if (c.state_slot < 0 || c.state_slot >= o_.state_slots) throw std::runtime_error("bad state slot");
      int64_t end = c.start_pos + static_cast<int64_t>(c.tokens.size());
      if (static_cast<int64_t>(c.page_table.size()) * o_.page_size < end) throw std::runtime_error("page table too short");
      if (end > o_.max_context) throw std::runtime_error("past max context");
      for (int32_t t : c.tokens)
        if (t == o_.fail_on_token) throw std::runtime_error("injected failure");
      uint64_t& st = state_[c.state_slot];
      if (c.start_pos == 0) st = 0x1234567;
      for (size_t i = 0; i < c.tokens.size(); ++i) {
        int64_t pos = c.start_pos + static_cast<int64_t>(i);
        kv_.at(slot_of(c.page_table, pos)) = c.tokens[i];
        st = mix(st ^ static_cast<uint64_t>(c.tokens[i] + 1));
      }
      max_batch_ = std::max<int64_t>(max_batch_, static_cast<int64_t>(chunks.size()));
      if (!c.want_logits) continue;
      uint64_t h = st;
      for (int64_t p = 0; p < end; ++p) h = mix(h ^ static_cast<uint64_t>(kv_.at(slot_of(c.page_table, p)) + 7));
      float* out = logits.data() + row * o_.vocab;
      for (int64_t v = 0; v < o_.vocab; ++v) out[v] = static_cast<float>((mix(h + v) >> 40) % 1000) / 100.0f;
      if (o_.favourite_token >= 0 && end >= o_.favourite_after) out[o_.favourite_token] += 20.0f;
      ++row;
    }
  }

  int64_t steps() const {
    std::lock_guard<std::mutex> lock(mu_);
    return steps_;
  }
  int64_t max_batch() const {
    std::lock_guard<std::mutex> lock(mu_);
    return max_batch_;
  }

  static uint64_t mix(uint64_t x) {
    x += 0x9E3779B97F4A7C15ull;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
    return x ^ (x >> 31);
  }

 private:
  size_t slot_of(std::span<const int32_t> pages, int64_t pos) const {
    int32_t page = pages[static_cast<size_t>(pos / o_.page_size)];
    if (page < 0 || page >= o_.kv_pages) throw std::runtime_error("bad page id");
    return static_cast<size_t>(page) * o_.page_size + static_cast<size_t>(pos % o_.page_size);
  }

  Options o_;
  std::vector<int32_t> kv_;
  std::vector<uint64_t> state_;
  mutable std::mutex mu_;
  int64_t steps_ = 0;
  int64_t max_batch_ = 0;
};

}  // namespace kiln::testing
