#include "model/tp_runner.h"

#include <cmath>
#include <condition_variable>
#include <cstring>
#include <exception>
#include <mutex>
#include <thread>

#include <fmt/format.h>

#include "core/error.h"
#include "core/log.h"
#include "format/quant_config.h"
#include "model/tp_wire.h"

namespace kiln::model {

using wire::Message;
using wire::StepKind;

// One thread per rank, each waiting for the next job.
class TpRunner::Threads {
 public:
  explicit Threads(int n) : errors_(n) {
    for (int r = 0; r < n; ++r) threads_.emplace_back([this, r] { loop(r); });
  }
  ~Threads() {
    {
      std::lock_guard lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    for (auto& t : threads_) t.join();
  }
  // Runs job on every thread, waits for all; returns each rank's exception (null: none).
  std::vector<std::exception_ptr> run(const std::function<void(int)>& job, const std::function<void()>& on_error) {
    std::unique_lock lock(mu_);
    job_ = &job;
    on_error_ = &on_error;
    pending_ = static_cast<int>(threads_.size());
    std::fill(errors_.begin(), errors_.end(), nullptr);
    ++generation_;
    cv_.notify_all();
    done_cv_.wait(lock, [&] { return pending_ == 0; });
    job_ = nullptr;
    return errors_;
  }

 private:
  void loop(int r) {
    uint64_t seen = 0;
    std::unique_lock lock(mu_);
    for (;;) {
      cv_.wait(lock, [&] { return stop_ || generation_ != seen; });
      if (stop_) return;
      seen = generation_;
      const std::function<void(int)>* job = job_;
      const std::function<void()>* on_error = on_error_;
      lock.unlock();
      std::exception_ptr err;
      try {
        (*job)(r);
      } catch (...) {
        err = std::current_exception();
        (*on_error)();  // release the ranks waiting in a collective for this one
      }
      lock.lock();
      errors_[r] = err;
      if (--pending_ == 0) done_cv_.notify_all();
    }
  }

  std::vector<std::thread> threads_;
  std::mutex mu_;
  std::condition_variable cv_, done_cv_;
  const std::function<void(int)>* job_ = nullptr;
  const std::function<void()>* on_error_ = nullptr;
  std::vector<std::exception_ptr> errors_;
  int pending_ = 0;
  uint64_t generation_ = 0;
  bool stop_ = false;
};

TpRunner::TpRunner(const format::ModelDir& dir, const RunnerOptions& options, const TpOptions& tp,
                   const std::function<std::unique_ptr<Ops>(int rank)>& make_ops,
                   std::vector<std::unique_ptr<Communicator>> comms)
    : options_(tp), comms_(std::move(comms)) {
  // The plan first, from config.json: a size the model cannot take fails here, before any weight is read.
  const format::ModelConfig config = format::load_model_config(dir);
  plan_ = format::plan_shards(config, format::load_quant_config(dir), tp.tp, tp.ep);
  const int nnodes = tp.link ? tp.link->nnodes() : 1, node = tp.link ? tp.link->node_rank() : 0;
  if (nnodes < 1 || tp.tp % nnodes)
    fail("--tp-size {} does not divide over --nnodes {}: every machine runs tp-size / nnodes ranks", tp.tp, nnodes);
  const int local = tp.tp / nnodes;
  first_ = node * local;
  if (static_cast<int>(comms_.size()) != local)
    fail("tensor parallel: {} communicators for the {} ranks of this node (--tp-size {}, --nnodes {})", comms_.size(),
         local, tp.tp, nnodes);
  for (int r = 0; r < local; ++r)
    if (comms_[r]->rank() != first_ + r || comms_[r]->size() != tp.tp)
      fail("tensor parallel: communicator {} is rank {} of {}", r, comms_[r]->rank(), comms_[r]->size());
  ranks_.resize(local);
  threads_ = std::make_unique<Threads>(local);
  for (auto& c : comms_) c->set_timeout(tp.startup_timeout);
  run_all([&](int r) {
    RunnerOptions ro = options;
    ro.shard = plan_.ranks[first_ + r];
    auto ops = make_ops(r);
    ops->set_communicator(comms_[r].get());
    ranks_[r] = std::make_unique<Runner>(std::move(ops), dir, ro);
    comms_[r]->barrier();  // every rank loaded (a peer that failed or hangs is reported within the time-out)
  });
  for (auto& c : comms_) c->set_timeout(std::chrono::milliseconds(0));
  if (multi_node()) {
    // Every node reports what it allocated; node 0 compares and starts the group (or refuses it, naming both).
    NodeLink& link = *options_.link;
    const wire::NodeCapacity mine = wire::node_capacity(capacity(), vocab_size());
    if (node == 0) {
      for (int k = 1; k < nnodes; ++k) {
        const wire::NodeCapacity theirs =
            wire::decode_node_capacity(link.receive(k, Message::capacity, tp.startup_timeout));
        if (theirs != mine) {
          link.close();
          fail("node {} allocated {}, node 0 {}: start every node with the same model, flags and GPU kind "
               "(--mem-fraction-static, --max-total-tokens, --max-running-requests, --context-length)", k,
               theirs.describe(), mine.describe());
        }
      }
      for (int k = 1; k < nnodes; ++k) link.send(k, Message::ready, nullptr, 0);
      KILN_LOG_INFO("tensor parallel: all {} nodes loaded ({} ranks each); node 0 drives the steps", nnodes, local);
    } else {
      const std::vector<uint8_t> body = wire::encode_node_capacity(mine);
      link.send(0, Message::capacity, body.data(), body.size());
      Message type{};
      std::vector<uint8_t> ready;
      if (!link.receive_any(0, type, ready, tp.startup_timeout) || type != Message::ready)
        fail("node {}: node 0 did not start the group (it refused this node's capacity {} or failed; see its log)",
             node, mine.describe());
    }
  }
  for (const std::string& n : plan_.notes) KILN_LOG_INFO("tensor parallel: {}", n);
}

TpRunner::~TpRunner() {
  // Node 0 of several stops the other nodes (their follow() returns).
  if (multi_node() && options_.link->node_rank() == 0 && !options_.link->closed()) {
    for (int k = 1; k < options_.link->nnodes(); ++k) {
      try {
        options_.link->send(k, Message::stop, nullptr, 0);
      } catch (...) {
      }
    }
  }
  // Each rank's runner goes on its own thread (a GPU rank frees its memory with its device current), then the
  // threads are joined.
  if (threads_) {
    try {
      run_all([&](int r) { ranks_[r].reset(); });
    } catch (...) {
    }
  }
  threads_.reset();
}

bool TpRunner::can_copy_state() const {
  for (const auto& r : ranks_)
    if (!r->can_copy_state()) return false;
  return true;
}

void TpRunner::copy_state(int src_slot, int dst_slot) {
  if (multi_node()) send_step(wire::encode_copy_state(src_slot, dst_slot));
  try {
    run_all([&](int r) { ranks_[r]->copy_state(src_slot, dst_slot); });
  } catch (const std::exception& e) {
    if (multi_node()) set_broken(e.what());
    throw;
  }
  if (multi_node()) read_replies(StepKind::copy_state, [](int, const wire::StepReply&) {});
}

void TpRunner::set_broken(const std::string& why) {
  {
    std::lock_guard lock(broken_mu_);
    if (broken_.empty()) broken_ = why;
  }
  KILN_LOG_ERROR("tensor parallel over {} nodes: the group failed ({}); every later step fails: restart every node",
                 options_.link->nnodes(), why);
  options_.link->close();
}

std::string TpRunner::fatal_error() const {
  std::lock_guard lock(broken_mu_);
  return broken_.empty() ? std::string()
                         : fmt::format("the multi-node tensor-parallel group failed ({}): restart every node", broken_);
}

void TpRunner::check_group() const {
  const std::string why = fatal_error();
  if (!why.empty()) fail("{}; it failed earlier and cannot run steps", why);
}

void TpRunner::send_step(const std::vector<uint8_t>& msg) {
  check_group();
  try {
    for (int k = 1; k < options_.link->nnodes(); ++k) options_.link->send(k, Message::step, msg.data(), msg.size());
  } catch (const std::exception& e) {
    set_broken(e.what());
    throw;
  }
}

void TpRunner::read_replies(StepKind kind, const std::function<void(int, const wire::StepReply&)>& reply) {
  std::string error;
  for (int k = 1; k < options_.link->nnodes() && error.empty(); ++k) {
    try {
      const wire::StepReply body = wire::decode_step_reply(options_.link->receive(k, Message::reply));
      if (!body.ok) {
        error = fmt::format("node {} failed the step: {}", k, body.error.empty() ? "(no reason)" : body.error);
      } else if (body.kind != kind) {
        error = fmt::format("node {} answered a {} step with a {} reply: the nodes are out of step", k, int(kind),
                            int(body.kind));
      } else if (kind != StepKind::copy_state &&
                 (kind == StepKind::logits ? body.logits.size() : body.best_ids.size()) != size_t(size())) {
        error = fmt::format("node {} sent the results of {} ranks, {} expected", k,
                            kind == StepKind::logits ? body.logits.size() : body.best_ids.size(), size());
      } else {
        reply(k, body);
      }
    } catch (const std::exception& e) {
      error = e.what();
    }
  }
  if (!error.empty()) {
    set_broken(error);
    fail("{}", error);
  }
}

void TpRunner::run_all(const std::function<void(int)>& fn) {
  const std::function<void()> abort = [this] {
    for (auto& c : comms_) c->abort();
  };
  const std::vector<std::exception_ptr> errors = threads_->run(fn, abort);
  bool failed = false;
  for (const auto& e : errors) failed |= e != nullptr;
  if (!failed) return;
  for (auto& c : comms_) c->reset();  // every rank has stopped: the group is usable again
  // The lowest rank's own error (not a GroupAborted that only follows it).
  std::exception_ptr first;
  for (const auto& e : errors) {
    if (!e) continue;
    try {
      std::rethrow_exception(e);
    } catch (const GroupAborted&) {
      if (!first) first = e;
    } catch (...) {
      throw;
    }
  }
  std::rethrow_exception(first);
}

RunnerCapacity TpRunner::capacity() const { return ranks_[0]->capacity(); }
int64_t TpRunner::vocab_size() const { return ranks_[0]->vocab_size(); }

void TpRunner::forward_ranks(std::span<const SeqChunk> chunks,
                             const std::function<void(int, const std::vector<float>&)>& done) {
  int64_t rows = 0;
  for (const SeqChunk& ch : chunks) rows += ch.want_logits ? ch.logits_tokens : 0;
  try {
    run_all([&](int r) {
      std::vector<float> local(static_cast<size_t>(rows * ranks_[r]->logits_width()));
      ranks_[r]->forward(chunks, local);
      done(r, local);
    });
  } catch (const std::exception& e) {
    if (multi_node()) set_broken(e.what());
    throw;
  }
}

void TpRunner::best_ranks(std::span<const SeqChunk> chunks,
                          const std::function<void(int, const std::vector<int32_t>&, const std::vector<float>&)>& done) {
  int64_t rows = 0;
  for (const SeqChunk& ch : chunks) rows += ch.want_logits ? ch.logits_tokens : 0;
  try {
    run_all([&](int r) {
      std::vector<int32_t> ids(static_cast<size_t>(rows));
      std::vector<float> values(static_cast<size_t>(rows));
      ranks_[r]->forward_best(chunks, ids, values);
      done(r, ids, values);
    });
  } catch (const std::exception& e) {
    if (multi_node()) set_broken(e.what());
    throw;
  }
}

void TpRunner::forward(std::span<const SeqChunk> chunks, std::span<float> logits) {
  int64_t rows = 0;
  for (const SeqChunk& ch : chunks) rows += ch.want_logits ? ch.logits_tokens : 0;
  const int64_t V = vocab_size();
  if (static_cast<int64_t>(logits.size()) < rows * V)
    fail("forward: logits buffer holds {} floats, {} rows of {} needed", logits.size(), rows, V);
  if (multi_node()) send_step(wire::encode_step(StepKind::logits, chunks));
  // Each rank writes its vocabulary columns of every row (disjoint).
  auto place = [&](int g, const float* local) {
    const int64_t Vl = plan_.ranks[g].vocab.count, begin = plan_.ranks[g].vocab.begin;
    for (int64_t i = 0; i < rows; ++i)
      std::memcpy(logits.data() + i * V + begin, local + i * Vl, static_cast<size_t>(Vl) * sizeof(float));
  };
  forward_ranks(chunks, [&](int r, const std::vector<float>& local) { place(first_ + r, local.data()); });
  if (!multi_node()) return;
  read_replies(StepKind::logits, [&](int k, const wire::StepReply& body) {
    for (int i = 0; i < size(); ++i) {
      const int g = k * size() + i;
      const size_t want = static_cast<size_t>(rows * plan_.ranks[g].vocab.count);
      if (body.logits[i].size() != want)
        fail("node {} sent {} logits for rank {}, {} expected: the nodes are out of step", k, body.logits[i].size(), g,
             want);
      place(g, body.logits[i].data());
    }
  });
}

void TpRunner::forward_argmax(std::span<const SeqChunk> chunks, std::span<int32_t> tokens) {
  int64_t rows = 0;
  for (const SeqChunk& ch : chunks) rows += ch.want_logits ? ch.logits_tokens : 0;
  if (static_cast<int64_t>(tokens.size()) < rows)
    fail("forward_argmax: token buffer holds {} ids, {} needed", tokens.size(), rows);
  if (multi_node()) send_step(wire::encode_step(StepKind::argmax, chunks));
  // Each rank's best (value, id) per row over its vocabulary slice; the lowest rank wins ties, as the lowest id
  // does in host_argmax (the slices are in rank order). Each rank's backend picks them (a GPU copies back these 8
  // bytes per row, not its logits); another node sends the same.
  const int n = options_.tp;
  std::vector<std::vector<std::pair<float, int32_t>>> best(n);
  best_ranks(chunks, [&](int r, const std::vector<int32_t>& ids, const std::vector<float>& values) {
    const int g = first_ + r;
    best[g].resize(rows);
    for (int64_t i = 0; i < rows; ++i) best[g][i] = {values[i], ids[i]};
  });
  if (multi_node())
    read_replies(StepKind::argmax, [&](int k, const wire::StepReply& body) {
      for (int i = 0; i < size(); ++i) {
        const int g = k * size() + i;
        if (body.best_ids[i].size() != static_cast<size_t>(rows))
          fail("node {} sent {} greedy picks for rank {}, {} expected: the nodes are out of step", k,
               body.best_ids[i].size(), g, rows);
        best[g].resize(rows);
        for (int64_t j = 0; j < rows; ++j) best[g][j] = {body.best_values[i][j], body.best_ids[i][j]};
      }
    });
  for (int64_t i = 0; i < rows; ++i) {
    int pick = -1;
    for (int r = 0; r < n; ++r) {
      if (std::isnan(best[r][i].first)) continue;  // a slice without a number
      if (pick < 0 || best[r][i].first > best[pick][i].first) pick = r;
    }
    tokens[static_cast<size_t>(i)] = pick < 0 ? 0 : best[pick][i].second;
  }
}

void TpRunner::draft(std::span<const DraftSeq> seqs, int steps, std::span<int32_t> tokens, std::span<float> logits) {
  if (multi_node())
    fail("speculative decoding across machines (--nnodes > 1) is not supported: run with --speculative-algorithm none");
  const int64_t S = static_cast<int64_t>(seqs.size()), V = vocab_size();
  if (S == 0) return;
  if (steps < 1) fail("draft: {} steps (at least 1)", steps);
  for (const DraftSeq& d : seqs)
    if (d.carried_row >= 0) fail("draft: a tensor-parallel group carries no first drafts (can_carry_drafts)");
  if (static_cast<int64_t>(tokens.size()) < S * steps) fail("draft: {} ids for {} x {} drafts", tokens.size(), S, steps);
  if (!logits.empty() && static_cast<int64_t>(logits.size()) < S * steps * V)
    fail("draft: logits buffer holds {} floats, {} rows of {} needed", logits.size(), S * steps, V);
  // Each step, every rank writes its offers for step k into its own column and waits for the others; then each reads
  // all columns and takes the same winner. Offers are kept per step, so a fast rank's next step cannot overwrite
  // what a slow one still reads. A rank that fails wakes the waiting ones (they throw too).
  const int n = size();
  struct Exchange {
    std::mutex mu;
    std::condition_variable cv;
    std::vector<int> arrived;
    bool failed = false;
  } ex;
  ex.arrived.assign(static_cast<size_t>(steps), 0);
  std::vector<std::vector<int32_t>> offer_ids(static_cast<size_t>(steps * n), std::vector<int32_t>(S));
  std::vector<std::vector<float>> offer_values(static_cast<size_t>(steps * n), std::vector<float>(S));
  auto pick = [&](int r, int k, std::span<const int32_t> ids, std::span<const float> values, std::span<int32_t> chosen) {
    std::copy(ids.begin(), ids.end(), offer_ids[k * n + r].begin());
    std::copy(values.begin(), values.end(), offer_values[k * n + r].begin());
    {
      std::unique_lock<std::mutex> lock(ex.mu);
      if (++ex.arrived[k] == n) ex.cv.notify_all();
      ex.cv.wait(lock, [&] { return ex.arrived[k] == n || ex.failed; });
      if (ex.arrived[k] != n) fail("draft: another rank failed");
    }
    for (int64_t s = 0; s < S; ++s) {
      int best = -1;
      for (int q = 0; q < n; ++q) {
        const float v = offer_values[k * n + q][s];
        if (std::isnan(v)) continue;  // a slice without a number
        if (best < 0 || v > offer_values[k * n + best][s]) best = q;
      }
      chosen[s] = best < 0 ? 0 : offer_ids[k * n + best][s];
      if (r == 0) tokens[static_cast<size_t>(s * steps + k)] = chosen[s];
    }
  };
  run_all([&](int r) {
    const format::Range cols = plan_.ranks[first_ + r].vocab;
    Runner::DraftLogits slice;
    if (!logits.empty())
      slice = [&, cols](int k, int64_t s, std::span<const float> row) {
        std::memcpy(logits.data() + (s * steps + k) * V + cols.begin, row.data(), row.size() * sizeof(float));
      };
    try {
      ranks_[r]->draft_rank(
          seqs, steps,
          [&, r](int k, std::span<const int32_t> ids, std::span<const float> values, std::span<int32_t> chosen) {
            pick(r, k, ids, values, chosen);
          },
          slice);
    } catch (...) {
      {
        std::lock_guard<std::mutex> lock(ex.mu);
        ex.failed = true;
      }
      ex.cv.notify_all();
      throw;
    }
  });
}

std::vector<float> TpRunner::encode_image(std::span<const float> pixel_values, int64_t grid_t, int64_t grid_h,
                                         int64_t grid_w) {
  std::vector<float> out;
  run_all([&](int r) {  // on rank 0's thread (its device)
    if (r == 0) out = ranks_[0]->encode_image(pixel_values, grid_t, grid_h, grid_w);
  });
  return out;
}

void TpRunner::save_state(int slot) {
  if (multi_node()) fail("save_state across machines is not supported");
  run_all([&](int r) { ranks_[r]->save_state(slot); });
}

void TpRunner::restore_state(int slot) {
  if (multi_node()) fail("restore_state across machines is not supported");
  run_all([&](int r) { ranks_[r]->restore_state(slot); });
}

int TpRunner::position_checkpoints() const {
  return multi_node() ? 0 : ranks_[0]->position_checkpoints();  // the wire carries no checkpoint chunks
}

void TpRunner::keep_verified(int slot, int tokens) {
  if (multi_node()) fail("keep_verified across machines is not supported");
  run_all([&](int r) { ranks_[r]->keep_verified(slot, tokens); });
}

void TpRunner::keep_verified_rows(std::span<const VerifiedRow> rows) {
  if (multi_node()) fail("keep_verified across machines is not supported");
  run_all([&](int r) { ranks_[r]->keep_verified_rows(rows); });
}

void TpRunner::follow() {
  if (!multi_node() || options_.link->node_rank() == 0) fail("follow(): only the nodes other than 0 follow steps");
  NodeLink& link = *options_.link;
  const int node = link.node_rank();
  for (;;) {
    Message type{};
    std::vector<uint8_t> msg;
    if (!link.receive_any(0, type, msg))
      fail("node {}: node 0 closed the connection without stopping the group (it failed or was killed); restart every "
           "node", node);
    if (type == Message::stop) {
      KILN_LOG_INFO("node {}: node 0 stopped the group", node);
      return;
    }
    if (type != Message::step)
      fail("node {}: node 0 sent a {} message where a step was due: the nodes are out of step", node,
           wire::message_name(type));
    wire::StepReply reply;
    try {
      reply = follow_step(wire::decode_step(msg));
    } catch (const std::exception& e) {
      // The step failed here: say why to node 0, then stop (the group's collectives are out of step now).
      const std::string why = e.what();
      try {
        wire::StepReply bad;
        bad.ok = false;
        bad.error = why;
        const std::vector<uint8_t> body = wire::encode_step_reply(bad);
        if (!link.closed()) link.send(0, Message::reply, body.data(), body.size());
      } catch (...) {
      }
      link.close();
      fail("node {}: a step failed: {}; the group is broken, restart every node", node, why);
    }
    const std::vector<uint8_t> body = wire::encode_step_reply(reply);
    link.send(0, Message::reply, body.data(), body.size());
  }
}

wire::StepReply TpRunner::follow_step(const wire::Step& step) {
  wire::StepReply reply;
  reply.kind = step.kind;
  if (step.kind == StepKind::copy_state) {
    run_all([&](int r) { ranks_[r]->copy_state(step.src_slot, step.dst_slot); });
  } else if (step.kind == StepKind::logits) {
    reply.logits.resize(size());
    forward_ranks(step.chunks, [&](int r, const std::vector<float>& local) { reply.logits[r] = local; });
  } else {
    reply.best_values.resize(size());
    reply.best_ids.resize(size());
    best_ranks(step.chunks, [&](int r, const std::vector<int32_t>& ids, const std::vector<float>& values) {
      reply.best_ids[r] = ids;
      reply.best_values[r] = values;
    });
  }
  return reply;
}

std::string TpRunner::describe() const {
  std::string per_rank;
  for (int r = 0; r < size(); ++r) {
    const auto& w = ranks_[r]->model().weights;
    per_rank += fmt::format("{}rank {} {:.1f} MB", r ? ", " : "", first_ + r,
                            (w.bytes_by_format[0] + w.bytes_by_format[1] + w.bytes_by_format[2]) / 1e6);
  }
  const format::ModelConfig& lc = ranks_[0]->config();
  const std::string where =
      multi_node() ? fmt::format("{} nodes; ranks {}-{} on this node (node {}) as threads", options_.link->nnodes(),
                                 first_, first_ + size() - 1, options_.link->node_rank())
                   : fmt::format("{} ranks as threads of this process", size());
  return fmt::format(
      "tensor parallel {} x {} (ep {}; {}) | per rank: {} q / {} KV heads, {} key / "
      "{} value heads, experts {} of {} (intermediate {}), vocab {} | linear weights per rank: {} | rank 0: {}",
      options_.tp, ranks_[0]->ops().name(), plan_.ep, where, lc.num_attention_heads, lc.num_kv_heads,
      lc.linear_num_key_heads, lc.linear_num_value_heads, plan_.ranks[0].experts.count, lc.num_experts,
      lc.moe_intermediate_size, plan_.ranks[0].vocab.count, per_rank, ranks_[0]->describe());
}

std::vector<DeviceMemory> TpRunner::device_memory() const {
  std::vector<DeviceMemory> out;
  for (int r = 0; r < size(); ++r)
    for (DeviceMemory d : ranks_[r]->device_memory()) {
      d.rank = first_ + r;
      out.push_back(std::move(d));
    }
  return out;
}

}  // namespace kiln::model
