// A byte counter for long loads, shared by every thread of the process that loads (tensor-parallel ranks load on
// threads of their own), with a periodic line on the log: "loading weights: 12.3 / 23.0 GB, 10.5 GB/s, ETA 1 s",
// and a final "loaded weights: 23.0 GB in 2.2 s (10.5 GB/s)". Loaders join with begin(total) and leave with end();
// the line covers all loaders in flight at once. Nothing is printed when no bytes were added (the CPU backend
// views its weights in place), so callers may bracket every load.
#pragma once
#include <cstdint>
#include <functional>
#include <mutex>
#include <string>

namespace kiln {

// "12.3 / 23.0 GB, 10.5 GB/s, ETA 1 s" (the rate and ETA left out while elapsed_s is 0 or nothing is done; MB and
// MB/s below 1 GB and 1 GB/s).
std::string format_progress(uint64_t done_bytes, uint64_t total_bytes, double elapsed_s);
// "23.0 GB in 2.2 s (10.5 GB/s)".
std::string format_progress_done(uint64_t done_bytes, double elapsed_s);

class ByteProgress {
 public:
  using Clock = std::function<double()>;                  // seconds, monotonic
  using Sink = std::function<void(const std::string&)>;  // one line
  // The defaults: steady_clock and KILN_LOG_INFO.
  explicit ByteProgress(Clock clock = {}, Sink sink = {}, double interval_s = 1.0);

  // A loader joins: its bytes are added to the total. `label` names the line ("loading weights").
  void begin(uint64_t total_bytes, const std::string& label);
  // Thread-safe; prints the line at most once per interval. Ignored while no loader is in.
  void add(uint64_t bytes);
  // A loader leaves; the last one prints the final line (when bytes were added and every loader succeeded) and
  // resets the counter for the next load.
  void end(bool ok = true);

  uint64_t done() const;
  uint64_t total() const;
  int loaders() const;

 private:
  void line_locked(double now, bool final);

  Clock clock_;
  Sink sink_;
  double interval_s_;
  mutable std::mutex mu_;
  int loaders_ = 0;
  bool failed_ = false;
  uint64_t total_ = 0, done_ = 0;
  double start_ = 0, last_print_ = 0;
  std::string label_;
};

// The process's weight-loading counter (model::load_model brackets each load; backends add copied bytes).
ByteProgress& weight_progress();

}  // namespace kiln
