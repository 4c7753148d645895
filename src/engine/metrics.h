// Engine counters and latency histograms, written by the engine thread and read by any thread
// (the /metrics endpoint) through snapshot().
#pragma once
#include <array>
#include <cstdint>
#include <mutex>
#include <vector>

namespace kiln::engine {

// A Prometheus-style cumulative histogram over fixed bucket upper bounds (seconds, or counts).
class Histogram {
 public:
  explicit Histogram(std::vector<double> upper_bounds);
  void observe(double value);

  struct Snapshot {
    std::vector<double> upper_bounds;
    std::vector<uint64_t> cumulative_counts;  // [upper_bounds.size()], then +Inf == count
    uint64_t count = 0;
    double sum = 0.0;
  };
  Snapshot snapshot() const;

 private:
  mutable std::mutex mu_;
  std::vector<double> bounds_;
  std::vector<uint64_t> counts_;  // per bucket (not cumulative)
  uint64_t count_ = 0;
  double sum_ = 0.0;
};

struct EngineMetricsSnapshot {
  int num_waiting = 0;
  int num_running = 0;
  int64_t kv_pages_used = 0;
  int64_t kv_pages_total = 0;
  int page_size = 0;
  int state_slots_used = 0;
  int state_slots_total = 0;
  uint64_t prompt_tokens_total = 0;      // prompt tokens of admitted sequences, once prefilled
  uint64_t generation_tokens_total = 0;
  uint64_t steps_total = 0;
  // Finished sequences by FinishReason (stop, length, abort, error).
  uint64_t finished_stop = 0, finished_length = 0, finished_abort = 0, finished_error = 0;
  uint64_t rejected_queue_full = 0, rejected_too_long = 0;
  // Paging and the prefix cache.
  uint64_t preemptions_total = 0;                // running sequences retracted for pages (recomputed later)
  bool prefix_cache_enabled = false;
  int64_t kv_pages_cached = 0;                   // pages the prefix cache holds (shared or evictable)
  int64_t state_snapshots_cached = 0;            // state slots holding cached snapshots
  uint64_t prefix_cache_query_tokens_total = 0;  // prompt tokens looked up
  uint64_t prefix_cache_hit_tokens_total = 0;    // of them, served from the cache
  uint64_t prefix_cache_evicted_pages_total = 0;
  uint64_t prefix_cache_evicted_snapshots_total = 0;
  // Speculative decoding: draft tokens verified, of them accepted, and the tokens each verify gave a sequence
  // (accepted + 1).
  int speculative_num_steps = 0;  // 0: off
  uint64_t spec_draft_tokens_total = 0;
  uint64_t spec_accepted_tokens_total = 0;
  uint64_t spec_carried_drafts_total = 0;  // first drafts that came out of the step before (no chain step ran them)
  Histogram::Snapshot spec_accept_length;
  Histogram::Snapshot spec_step_draft_length;  // the draft length K chosen per step with decode rows (0: none)
  Histogram::Snapshot time_to_first_token_s;
  Histogram::Snapshot inter_token_latency_s;
  Histogram::Snapshot e2e_latency_s;
  Histogram::Snapshot queue_time_s;
};

}  // namespace kiln::engine
