// The link between one client request (an HTTP thread) and the engine thread: a thread-safe queue of
// TokenEvents for the n sequences of a submission, plus a cancel flag the engine polls every step.
//
//   engine thread: push(event) ... push(final event)
//   client thread: while (!ch->all_finished() || ch->has_events()) ch->wait(events, 100ms); ...
//                  ch->cancel() on disconnect: the engine drops the sequences at its next step.
#pragma once
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <vector>

#include "engine/request.h"

namespace kiln::engine {

class RequestChannel {
 public:
  explicit RequestChannel(int num_sequences = 1);
  RequestChannel(const RequestChannel&) = delete;
  RequestChannel& operator=(const RequestChannel&) = delete;

  int num_sequences() const { return num_sequences_; }

  // Engine side. An event with finished = true ends its sequence; later events for it are a bug.
  void push(TokenEvent event);

  // Client side: moves every pending event into `out` (appended). Blocks until at least one event is
  // pending, all sequences have finished, or `timeout` passes. Returns the number of events moved.
  size_t wait(std::vector<TokenEvent>& out, std::chrono::milliseconds timeout);
  bool all_finished() const;
  bool has_events() const;

  // Asks the engine to stop every sequence (client gone, stop string matched, shutdown). The engine
  // answers with a final event (finish_reason abort) for each sequence still alive.
  void cancel();
  bool cancelled() const { return cancelled_.load(std::memory_order_acquire); }
  // Stops one sequence of an n > 1 submission. as_stop: the client ended it on a stop string, so it counts as
  // finished with reason stop (else abort).
  void cancel_sequence(int index, bool as_stop = false);
  bool sequence_cancelled(int index) const;
  bool sequence_stopped(int index) const;

 private:
  const int num_sequences_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<TokenEvent> events_;
  std::vector<bool> finished_;       // [num_sequences]
  std::vector<bool> seq_cancelled_;  // [num_sequences]
  std::vector<bool> seq_stopped_;    // [num_sequences]: cancelled as a stop
  int num_finished_ = 0;
  std::atomic<bool> cancelled_{false};
};

}  // namespace kiln::engine
