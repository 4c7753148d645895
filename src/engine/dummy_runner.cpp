#include "engine/dummy_runner.h"

#include <algorithm>
#include <chrono>
#include <thread>

#include "core/error.h"

namespace kiln::engine {

namespace {
uint64_t mix(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}
}  // namespace

DummyRunner::DummyRunner(Options o)
    : o_(o),
      kv_(static_cast<size_t>(o.capacity.kv_pages * o.capacity.page_size), -1),
      state_(static_cast<size_t>(o.capacity.state_slots), 0),
      logits_done_(static_cast<size_t>(o.capacity.state_slots), 0) {
  if (o_.echo && (o_.turn_start < 0 || o_.turn_end < 0 || o_.newline < 0))
    fail("the echo dummy runner needs turn start / end and newline token ids");
}

model::RunnerCapacity DummyRunner::capacity() const {
  model::RunnerCapacity c = o_.capacity;
  c.kv_bytes_per_token = sizeof(int32_t);     // kv_: one token id per page row
  c.state_bytes_per_slot = sizeof(uint64_t);  // state_: one running hash per slot
  return c;
}

std::string DummyRunner::describe() const {
  return o_.echo ? "dummy runner (echo): repeats the last chat turn, no weights (testing only)"
                 : "dummy runner (hash): logits hash each sequence's tokens, no weights (testing only)";
}

int64_t DummyRunner::steps() const {
  std::lock_guard<std::mutex> lock(mu_);
  return steps_;
}

int64_t DummyRunner::max_batch() const {
  std::lock_guard<std::mutex> lock(mu_);
  return max_batch_;
}

size_t DummyRunner::row_of(std::span<const int32_t> pages, int64_t pos) const {
  int32_t page = pages[static_cast<size_t>(pos / o_.capacity.page_size)];
  if (page < 0 || page >= o_.capacity.kv_pages) fail("dummy runner: page id {} outside the pool", page);
  return static_cast<size_t>(page) * o_.capacity.page_size + static_cast<size_t>(pos % o_.capacity.page_size);
}

int32_t DummyRunner::echo_token(std::span<const int32_t> pages, int64_t end, int64_t generated) const {
  // The prompt is what came before the generated tokens; every generated token was fed back.
  int64_t prompt_end = end - generated;
  auto at = [&](int64_t p) { return kv_[row_of(pages, p)]; };
  int64_t turn_end = -1, turn_start = -1;
  for (int64_t p = prompt_end - 1; p >= 0 && turn_end < 0; --p)
    if (at(p) == o_.turn_end) turn_end = p;
  for (int64_t p = turn_end - 1; p >= 0 && turn_start < 0; --p)
    if (at(p) == o_.turn_start) turn_start = p;
  if (turn_end < 0 || turn_start < 0) return o_.turn_end;
  int64_t content = turn_start + 1;
  while (content < turn_end && at(content) != o_.newline) ++content;
  ++content;  // past the role line's newline
  int64_t k = content + generated;
  return k < turn_end ? at(k) : o_.turn_end;
}

void DummyRunner::copy_state(int src_slot, int dst_slot) {
  std::lock_guard<std::mutex> lock(mu_);
  if (src_slot < 0 || src_slot >= o_.capacity.state_slots || dst_slot < 0 || dst_slot >= o_.capacity.state_slots)
    fail("dummy runner: copy_state {} -> {} outside [0, {})", src_slot, dst_slot, o_.capacity.state_slots);
  state_[dst_slot] = state_[src_slot];
  logits_done_[dst_slot] = logits_done_[src_slot];
}

void DummyRunner::forward(std::span<const model::SeqChunk> chunks, std::span<float> logits) {
  if (o_.step_delay_us > 0) std::this_thread::sleep_for(std::chrono::microseconds(o_.step_delay_us));
  std::lock_guard<std::mutex> lock(mu_);
  ++steps_;
  max_batch_ = std::max<int64_t>(max_batch_, static_cast<int64_t>(chunks.size()));
  size_t row = 0;
  for (const auto& c : chunks) {
    if (c.state_slot < 0 || c.state_slot >= o_.capacity.state_slots)
      fail("dummy runner: bad state slot {}", c.state_slot);
    int64_t end = c.start_pos + static_cast<int64_t>(c.tokens.size());
    if (static_cast<int64_t>(c.page_table.size()) * o_.capacity.page_size < end)
      fail("dummy runner: page table too short");
    if (end > o_.capacity.max_context) fail("dummy runner: position {} past the context", end);
    for (int32_t t : c.tokens)
      if (t == o_.fail_on_token) fail("injected failure");
    uint64_t& st = state_[c.state_slot];
    if (c.start_pos == 0) {
      st = 0x1234567;
      logits_done_[c.state_slot] = 0;
    }
    size_t snap = 0;
    for (size_t i = 0; i < c.tokens.size(); ++i) {
      kv_.at(row_of(c.page_table, c.start_pos + static_cast<int64_t>(i))) = c.tokens[i];
      st = mix(st ^ static_cast<uint64_t>(c.tokens[i] + 1));
      if (snap < c.snapshots.size() && c.snapshots[snap].tokens == static_cast<int64_t>(i) + 1) {
        const int dst = c.snapshots[snap++].slot;
        if (dst < 0 || dst >= o_.capacity.state_slots || dst == c.state_slot)
          fail("dummy runner: snapshot into slot {}", dst);
        state_[dst] = st;
        logits_done_[dst] = logits_done_[c.state_slot];
      }
    }
    if (snap != c.snapshots.size()) fail("dummy runner: {} of a chunk's snapshots not reached", c.snapshots.size() - snap);
    if (!c.want_logits) continue;
    uint64_t h = st;
    for (int64_t p = 0; p < end; ++p) h = mix(h ^ static_cast<uint64_t>(kv_.at(row_of(c.page_table, p)) + 7));
    float* out = logits.data() + row * o_.vocab;
    for (int64_t v = 0; v < o_.vocab; ++v) out[v] = static_cast<float>((mix(h + v) >> 40) % 1000) / 100.0f;
    if (o_.echo) {
      // A margin no temperature up to 2 can overcome.
      out[echo_token(c.page_table, end, logits_done_[c.state_slot])] += 200.0f;
    } else if (o_.favourite_token >= 0 && end >= o_.favourite_after) {
      out[o_.favourite_token] += 20.0f;
    }
    ++logits_done_[c.state_slot];
    ++row;
  }
}

}  // namespace kiln::engine
