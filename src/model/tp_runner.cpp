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

namespace kiln::model {

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
  if (static_cast<int>(comms_.size()) != tp.tp)
    fail("tensor parallel: {} communicators for --tp-size {}", comms_.size(), tp.tp);
  for (int r = 0; r < tp.tp; ++r)
    if (comms_[r]->rank() != r || comms_[r]->size() != tp.tp)
      fail("tensor parallel: communicator {} is rank {} of {}", r, comms_[r]->rank(), comms_[r]->size());
  ranks_.resize(tp.tp);
  threads_ = std::make_unique<Threads>(tp.tp);
  for (auto& c : comms_) c->set_timeout(tp.startup_timeout);
  run_all([&](int r) {
    RunnerOptions ro = options;
    ro.shard = plan_.ranks[r];
    auto ops = make_ops(r);
    ops->set_communicator(comms_[r].get());
    ranks_[r] = std::make_unique<Runner>(std::move(ops), dir, ro);
    comms_[r]->barrier();  // every rank loaded (a peer that failed or hangs is reported within the time-out)
  });
  for (auto& c : comms_) c->set_timeout(std::chrono::milliseconds(0));
  for (const std::string& n : plan_.notes) KILN_LOG_INFO("tensor parallel: {}", n);
}

TpRunner::~TpRunner() {
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
  run_all([&](int r) { ranks_[r]->copy_state(src_slot, dst_slot); });
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
  // The lowest rank's own error (not a "group aborted" that only follows it).
  std::exception_ptr first;
  for (const auto& e : errors) {
    if (!e) continue;
    try {
      std::rethrow_exception(e);
    } catch (const Error& err) {
      if (std::string(err.what()).find("group aborted") != std::string::npos) {
        if (!first) first = e;
        continue;
      }
      std::rethrow_exception(e);
    } catch (...) {
      std::rethrow_exception(e);
    }
  }
  std::rethrow_exception(first);
}

RunnerCapacity TpRunner::capacity() const { return ranks_[0]->capacity(); }
int64_t TpRunner::vocab_size() const { return ranks_[0]->vocab_size(); }

void TpRunner::forward_ranks(std::span<const SeqChunk> chunks,
                             const std::function<void(int, const std::vector<float>&)>& done) {
  int64_t rows = 0;
  for (const SeqChunk& ch : chunks) rows += ch.want_logits ? 1 : 0;
  run_all([&](int r) {
    std::vector<float> local(static_cast<size_t>(rows * ranks_[r]->logits_width()));
    ranks_[r]->forward(chunks, local);
    done(r, local);
  });
}

void TpRunner::forward(std::span<const SeqChunk> chunks, std::span<float> logits) {
  int64_t rows = 0;
  for (const SeqChunk& ch : chunks) rows += ch.want_logits ? 1 : 0;
  const int64_t V = vocab_size();
  if (static_cast<int64_t>(logits.size()) < rows * V)
    fail("forward: logits buffer holds {} floats, {} rows of {} needed", logits.size(), rows, V);
  // Each rank writes its vocabulary columns of every row (disjoint).
  forward_ranks(chunks, [&](int r, const std::vector<float>& local) {
    const int64_t Vl = ranks_[r]->logits_width(), begin = plan_.ranks[r].vocab.begin;
    for (int64_t i = 0; i < rows; ++i)
      std::memcpy(logits.data() + i * V + begin, local.data() + i * Vl, static_cast<size_t>(Vl) * sizeof(float));
  });
}

void TpRunner::forward_argmax(std::span<const SeqChunk> chunks, std::span<int32_t> tokens) {
  int64_t rows = 0;
  for (const SeqChunk& ch : chunks) rows += ch.want_logits ? 1 : 0;
  if (static_cast<int64_t>(tokens.size()) < rows)
    fail("forward_argmax: token buffer holds {} ids, {} needed", tokens.size(), rows);
  // Each rank's best (value, id) per row over its vocabulary slice; the lowest rank wins ties, as the lowest id
  // does in host_argmax (the slices are in rank order). A GPU rank can return just these 8 bytes per row.
  const int n = size();
  std::vector<std::vector<std::pair<float, int32_t>>> best(n);
  forward_ranks(chunks, [&](int r, const std::vector<float>& local) {
    const int64_t Vl = ranks_[r]->logits_width();
    best[r].resize(rows);
    for (int64_t i = 0; i < rows; ++i) {
      const float* row = local.data() + i * Vl;
      const int32_t j = host_argmax(row, Vl);
      best[r][i] = {row[j], static_cast<int32_t>(plan_.ranks[r].vocab.begin + j)};
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

std::string TpRunner::describe() const {
  std::string per_rank;
  for (int r = 0; r < size(); ++r) {
    const auto& w = ranks_[r]->model().weights;
    per_rank += fmt::format("{}rank {} {:.1f} MB", r ? ", " : "", r,
                            (w.bytes_by_format[0] + w.bytes_by_format[1] + w.bytes_by_format[2]) / 1e6);
  }
  const format::ModelConfig& lc = ranks_[0]->config();
  return fmt::format(
      "tensor parallel {} x {} (ep {}; {} ranks as threads of this process) | per rank: {} q / {} KV heads, {} key / "
      "{} value heads, experts {} of {} (intermediate {}), vocab {} | linear weights per rank: {} | rank 0: {}",
      size(), ranks_[0]->ops().name(), plan_.ep, size(), lc.num_attention_heads, lc.num_kv_heads,
      lc.linear_num_key_heads, lc.linear_num_value_heads, plan_.ranks[0].experts.count, lc.num_experts,
      lc.moe_intermediate_size, plan_.ranks[0].vocab.count, per_rank, ranks_[0]->describe());
}

std::vector<DeviceMemory> TpRunner::device_memory() const {
  std::vector<DeviceMemory> out;
  for (int r = 0; r < size(); ++r)
    for (DeviceMemory d : ranks_[r]->device_memory()) {
      d.rank = r;
      out.push_back(std::move(d));
    }
  return out;
}

}  // namespace kiln::model
