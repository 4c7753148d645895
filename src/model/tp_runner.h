// Tensor / expert parallelism as composition: N ordinary Runners (runner.h), one per rank, each over its own Ops
// with its slices of the weights (format/shard_plan.h) and its local sizes, driven in lockstep on N threads (one per
// rank, kept for the runner's life: a GPU backend binds its device and stream to that thread). The ranks meet only
// in Ops::all_reduce (model/comm.h through each rank's Ops). This class implements the engine's ModelRunner
// contract: every rank runs the same step; the vocabulary-parallel logits are assembled on the host, each rank
// writing its columns; greedy steps take each rank's local argmax and keep the best (no full-logits gather).
//
// Process model: one process drives all ranks (serve, generate, bench-engine with --tp-size N).
#pragma once
#include <chrono>
#include <functional>
#include <memory>
#include <vector>

#include "format/model_dir.h"
#include "format/shard_plan.h"
#include "model/comm.h"
#include "model/model_runner.h"
#include "model/runner.h"

namespace kiln::model {

struct TpOptions {
  int tp = 1;  // ranks (--tp-size)
  int ep = 1;  // expert-parallel groups among them (--ep-size)
  // Longest wait of a rank for its peers while loading (a peer that failed or hangs at startup); afterwards a
  // failing rank aborts the group instead.
  std::chrono::milliseconds startup_timeout{std::chrono::minutes(10)};
};

class TpRunner : public ModelRunner {
 public:
  // Plans the shards (kiln::Error before any weight is read when tp / ep do not fit the model), then loads rank r
  // on rank thread r: make_ops(r) gives its Ops, comms[r] (of a group of tp) its communicator.
  TpRunner(const format::ModelDir& dir, const RunnerOptions& options, const TpOptions& tp,
           const std::function<std::unique_ptr<Ops>(int rank)>& make_ops,
           std::vector<std::unique_ptr<Communicator>> comms);
  ~TpRunner() override;

  RunnerCapacity capacity() const override;
  int64_t vocab_size() const override;
  void forward(std::span<const SeqChunk> chunks, std::span<float> logits) override;
  void forward_argmax(std::span<const SeqChunk> chunks, std::span<int32_t> tokens) override;
  std::string describe() const override;
  // Every rank copies its share of the state (its value heads' slices), on its own thread.
  bool can_copy_state() const override;
  void copy_state(int src_slot, int dst_slot) override;
  bool has_recurrent_state() const override { return ranks_[0]->has_recurrent_state(); }
  // Every rank's device figures (rank r's entry has rank r).
  std::vector<DeviceMemory> device_memory() const override;

  int size() const { return static_cast<int>(ranks_.size()); }
  Runner& rank(int r) { return *ranks_[r]; }
  const format::ShardPlan& plan() const { return plan_; }

 private:
  class Threads;
  // fn(rank) on every rank thread at once; the first rank's error is rethrown after all have stopped (a failing
  // rank aborts the group, so the others' collectives return).
  void run_all(const std::function<void(int)>& fn);
  // The step on every rank; rank r's logits rows (its vocabulary slice) go to rows(r) in row order.
  void forward_ranks(std::span<const SeqChunk> chunks, const std::function<void(int, const std::vector<float>&)>& done);

  format::ShardPlan plan_;
  TpOptions options_;
  std::vector<std::unique_ptr<Communicator>> comms_;
  std::vector<std::unique_ptr<Runner>> ranks_;
  std::unique_ptr<Threads> threads_;
};

}  // namespace kiln::model
