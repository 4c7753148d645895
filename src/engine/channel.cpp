#include "engine/channel.h"

#include "core/error.h"

namespace kiln::engine {

RequestChannel::RequestChannel(int num_sequences)
    : num_sequences_(num_sequences), finished_(num_sequences, false), seq_cancelled_(num_sequences, false),
      seq_stopped_(num_sequences, false) {
  KILN_CHECK(num_sequences >= 1, "a channel needs at least one sequence, got {}", num_sequences);
}

void RequestChannel::push(TokenEvent event) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    KILN_CHECK(event.index >= 0 && event.index < num_sequences_, "event index {} out of range", event.index);
    KILN_CHECK(!finished_[event.index], "event for sequence {} after its final event", event.index);
    if (event.finished) {
      finished_[event.index] = true;
      ++num_finished_;
    }
    events_.push_back(std::move(event));
  }
  cv_.notify_all();
}

size_t RequestChannel::wait(std::vector<TokenEvent>& out, std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait_for(lock, timeout, [&] { return !events_.empty() || num_finished_ == num_sequences_; });
  size_t n = events_.size();
  for (auto& e : events_) out.push_back(std::move(e));
  events_.clear();
  return n;
}

bool RequestChannel::all_finished() const {
  std::lock_guard<std::mutex> lock(mu_);
  return num_finished_ == num_sequences_;
}

bool RequestChannel::has_events() const {
  std::lock_guard<std::mutex> lock(mu_);
  return !events_.empty();
}

void RequestChannel::cancel() { cancelled_.store(true, std::memory_order_release); }

void RequestChannel::cancel_sequence(int index, bool as_stop) {
  std::lock_guard<std::mutex> lock(mu_);
  if (index >= 0 && index < num_sequences_) {
    seq_cancelled_[index] = true;
    if (as_stop) seq_stopped_[index] = true;
  }
}

bool RequestChannel::sequence_stopped(int index) const {
  std::lock_guard<std::mutex> lock(mu_);
  return index >= 0 && index < num_sequences_ && seq_stopped_[index];
}

bool RequestChannel::sequence_cancelled(int index) const {
  if (cancelled()) return true;
  std::lock_guard<std::mutex> lock(mu_);
  return index >= 0 && index < num_sequences_ && seq_cancelled_[index];
}

}  // namespace kiln::engine
