// Tensor / expert parallelism as composition: N ordinary Runners (runner.h), one per rank, each over its own Ops
// with its slices of the weights (format/shard_plan.h) and its local sizes, driven in lockstep on N threads (one per
// rank, kept for the runner's life: a GPU backend binds its device and stream to that thread). The ranks meet only
// in Ops::all_reduce (model/comm.h through each rank's Ops). This class implements the engine's ModelRunner
// contract: every rank runs the same step; the vocabulary-parallel logits are assembled on the host, each rank
// writing its columns; greedy steps take each rank's best (value, id), picked by its backend (a GPU copies back 8
// bytes per row), and keep the best (no full-logits gather).
//
// Process model: one process per machine drives all of that machine's ranks (serve, generate, bench-engine with
// --tp-size N). Several machines (--nnodes M, TpOptions::link): each process holds tp / M ranks, rank numbers
// node_rank x tp / M on; node 0 runs the engine and sends every step (its chunks, which result it wants) to the
// other nodes over the link (model/node_link.h), runs its own ranks, and reads back each node's ranks' results
// (their vocabulary columns of the logits, or their best (value, id) per row for a greedy step); the other nodes
// run follow() instead of an engine. At startup every node reports its capacity (KV pages, state slots, vocabulary)
// and node 0 refuses a mismatch. A failure in a multi-node step breaks the group for good (every later step fails
// with the reason): restart every node.
#pragma once
#include <chrono>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "format/model_dir.h"
#include "format/shard_plan.h"
#include "model/comm.h"
#include "model/model_runner.h"
#include "model/node_link.h"
#include "model/runner.h"
#include "model/tp_wire.h"

namespace kiln::model {

struct TpOptions {
  int tp = 1;  // ranks (--tp-size)
  int ep = 1;  // expert-parallel groups among them (--ep-size)
  // Longest wait of a rank for its peers while loading (a peer that failed or hangs at startup); afterwards a
  // failing rank aborts the group instead.
  std::chrono::milliseconds startup_timeout{std::chrono::minutes(10)};
  // Several machines: the link to the other nodes (its nnodes() and node_rank() say which ranks are this
  // process's); null: one machine.
  std::shared_ptr<NodeLink> link;
};

class TpRunner : public ModelRunner {
 public:
  // Plans the shards (kiln::Error before any weight is read when tp / ep do not fit the model), then loads this
  // node's ranks, local rank i (global rank first_rank() + i) on rank thread i: make_ops(i) gives its Ops, comms[i]
  // (rank first_rank() + i of a group of tp) its communicator. With a link, then meets the other nodes (above).
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
  // One machine only: the step wire (tp_wire.h) does not carry SeqChunk::snapshots, so a multi-node group's chunks are
  // cut at their snapshots instead.
  bool chunk_snapshots() const override { return !multi_node() && ranks_[0]->chunk_snapshots(); }
  // Speculative decoding: every rank chains its share of the MTP head; each draft step the ranks offer their best
  // (id, logit) over their vocabulary slices and all take the same winner (the highest logit, the lowest rank on
  // ties: forward_argmax's rule), so the drafts equal one rank's. One machine only (a multi-node group refuses).
  int mtp_layers() const override { return ranks_[0]->mtp_layers(); }
  // Rank 0 holds the vision tower (replicated weights need no sharding: one rank encodes every image).
  int vision_merge_size() const override { return ranks_[0]->vision_merge_size(); }
  std::vector<float> encode_image(std::span<const float> pixel_values, int64_t grid_t, int64_t grid_h,
                                  int64_t grid_w) override;
  void draft(std::span<const DraftSeq> seqs, int steps, std::span<int32_t> tokens, std::span<float> logits) override;
  void save_state(int slot) override;
  void restore_state(int slot) override;
  int position_checkpoints() const override;
  void keep_verified(int slot, int tokens) override;
  void keep_verified_rows(std::span<const VerifiedRow> rows) override;
  std::string fatal_error() const override;
  // Every rank's device figures (rank r's entry has rank r).
  std::vector<DeviceMemory> device_memory() const override;

  // Other nodes than 0: runs node 0's steps until node 0 stops the group (returns) or the link fails (kiln::Error).
  void follow();

  int size() const { return static_cast<int>(ranks_.size()); }  // this node's ranks
  int first_rank() const { return first_; }
  Runner& rank(int r) { return *ranks_[r]; }
  const format::ShardPlan& plan() const { return plan_; }

 private:
  class Threads;
  // fn(rank) on every rank thread at once; the first rank's error is rethrown after all have stopped (a failing
  // rank aborts the group, so the others' collectives return).
  void run_all(const std::function<void(int)>& fn);
  // The step on every local rank; done(local rank, its logits rows: its vocabulary slice, in row order).
  void forward_ranks(std::span<const SeqChunk> chunks, const std::function<void(int, const std::vector<float>&)>& done);
  // A greedy step on every local rank: done(local rank, its best global ids, their logits) (Runner::forward_best).
  void best_ranks(std::span<const SeqChunk> chunks,
                  const std::function<void(int, const std::vector<int32_t>&, const std::vector<float>&)>& done);
  // Node 0 of several: sends a step (model/tp_wire.h) to every other node, then (after the local ranks ran it) hands
  // each node's reply, checked to be of `kind` with one result per rank, to reply(node, body). Any failure breaks the
  // group (broken_).
  void send_step(const std::vector<uint8_t>& msg);
  void read_replies(wire::StepKind kind, const std::function<void(int, const wire::StepReply&)>& reply);
  // Another node: runs one step of node 0's on the local ranks; their results in rank order.
  wire::StepReply follow_step(const wire::Step& step);
  void check_group() const;
  bool multi_node() const { return options_.link != nullptr; }

  format::ShardPlan plan_;
  TpOptions options_;
  std::vector<std::unique_ptr<Communicator>> comms_;
  std::vector<std::unique_ptr<Runner>> ranks_;
  std::unique_ptr<Threads> threads_;
  int first_ = 0;       // global rank of local rank 0
  // Several machines: why the group failed ("" while it works); written by the stepping thread, read by any.
  void set_broken(const std::string& why);
  mutable std::mutex broken_mu_;
  std::string broken_;
};

}  // namespace kiln::model
