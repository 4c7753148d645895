#include "engine/scheduler.h"

#include "engine/image_inputs.h"

#include <algorithm>

#include "core/error.h"
#include "engine/sampler.h"

namespace kiln::engine {

Sequence::Sequence() = default;
Sequence::~Sequence() = default;

Scheduler::Scheduler(SchedulerOptions options)
    : opts_(options), pages_(options.kv_pages), slots_(options.state_slots) {
  KILN_CHECK(opts_.page_size > 0, "page_size {}", opts_.page_size);
  KILN_CHECK(opts_.max_running_requests > 0, "max_running_requests {}", opts_.max_running_requests);
  KILN_CHECK(opts_.max_queued_requests >= 0, "max_queued_requests {}", opts_.max_queued_requests);
  if (opts_.prefix_cache) cache_ = std::make_unique<PrefixCache>(opts_.page_size, opts_.needs_state);
}

int64_t Scheduler::pages_for(int64_t prompt_len, int64_t max_tokens) const {
  int64_t tokens = std::min(prompt_len + max_tokens, opts_.context_length);
  return (tokens + opts_.page_size - 1) / opts_.page_size;
}

std::string Scheduler::check_fits(int64_t prompt_len, int64_t max_tokens) const {
  if (prompt_len <= 0) return "the prompt is empty";
  if (max_tokens <= 0) return fmt::format("max_tokens must be at least 1, got {}", max_tokens);
  if (prompt_len >= opts_.context_length)
    return fmt::format("the prompt has {} tokens, but the context length is {} tokens", prompt_len,
                       opts_.context_length);
  if (prompt_len + max_tokens > opts_.context_length)
    return fmt::format(
        "the prompt ({} tokens) plus max_tokens ({}) is {} tokens, more than the context length of {} "
        "tokens; lower max_tokens to at most {}",
        prompt_len, max_tokens, prompt_len + max_tokens, opts_.context_length,
        opts_.context_length - prompt_len);
  int64_t need = pages_for(prompt_len, max_tokens);
  if (need > pages_.size())
    return fmt::format(
        "the prompt ({} tokens) plus max_tokens ({}) needs {} KV pages of {} tokens, but the KV cache "
        "holds only {} pages ({} tokens); lower max_tokens or shorten the prompt",
        prompt_len, max_tokens, need, opts_.page_size, pages_.size(), pages_.size() * opts_.page_size);
  if (slots_.size() == 0) return "the model runner has no sequence state slots";
  return {};
}

bool Scheduler::queue_has_room(int n) const {
  return static_cast<int64_t>(waiting_.size()) + n <= opts_.max_queued_requests;
}

void Scheduler::enqueue(std::unique_ptr<Sequence> seq) {
  KILN_CHECK(seq && seq->prompt_len > 0 && static_cast<int64_t>(seq->tokens.size()) == seq->prompt_len,
             "enqueue: a fresh sequence with its prompt");
  seq->prefill_target = seq->prompt_len;
  waiting_.push_back(std::move(seq));
}

void Scheduler::give_back(std::vector<int32_t>& pages, std::vector<int32_t>& slots) {
  pages_.free(pages);
  slots_.free(slots);
  pages.clear();
  slots.clear();
}

void Scheduler::free_resources(Sequence& seq, bool cache) {
  std::vector<int32_t> free_pages, free_slots;
  const int64_t P = opts_.page_size;
  const size_t shared = seq.cache_path.size();
  size_t inserted = shared;  // pages [0, inserted) are the tree's after this
  // Snapshots of computed tokens only (a save planned in a step that never ran holds nothing).
  std::vector<PrefixCache::SnapshotAt> snaps;
  for (const auto& sn : seq.snaps) {
    const int64_t pages = sn.pos / P;
    if (cache_ && cache && opts_.needs_state && sn.pos <= seq.num_cached && pages > static_cast<int64_t>(shared) &&
        pages <= static_cast<int64_t>(seq.pages.size()))
      snaps.push_back({pages, sn.slot});
    else
      free_slots.push_back(sn.slot);
  }
  seq.snaps.clear();
  // Under slot pressure the shallowest snapshot (the prompt's second-to-last boundary) is the one to keep: it
  // matches the next turn whatever the client re-sends; the deeper ones match only a client that re-sends the
  // same ids, so they are evicted first.
  for (size_t i = 1; i < snaps.size(); ++i) snaps[i].demote = true;
  if (cache_ && cache) {
    // Full pages up to the deepest snapshot (models without state: every full page of computed KV).
    size_t n = opts_.needs_state ? (snaps.empty() ? 0 : static_cast<size_t>(snaps.back().pages))
                                 : static_cast<size_t>(seq.num_cached / P);
    n = std::min(n, seq.pages.size());
    if (n > shared) {
      std::vector<int32_t> key_scratch;
      cache_->insert(cache_key(seq, key_scratch), std::span<const int32_t>(seq.pages.data(), n), snaps, free_pages,
                     free_slots);
      // The snapshot this sequence started from is superseded on its path by the deeper ones it handed in, unless
      // other sequences branch off there too (a shared prefix: the others still need it).
      if (!snaps.empty() && shared > 0 && seq.cache_path.back()->children.size() <= 1)
        cache_->demote_snapshot(seq.cache_path.back());
      inserted = n;
    } else {
      for (const auto& sn : snaps) free_slots.push_back(sn.slot);
    }
  }
  for (size_t i = inserted; i < seq.pages.size(); ++i) free_pages.push_back(seq.pages[i]);
  if (cache_) cache_->unlock(seq.cache_path);
  seq.cache_path.clear();
  seq.pages.clear();
  if (seq.state_slot >= 0) free_slots.push_back(seq.state_slot);
  seq.state_slot = -1;
  give_back(free_pages, free_slots);
}

bool Scheduler::take_slot(int& slot) {
  std::vector<int32_t> got;
  if (slots_.num_free() == 0 && cache_) {
    std::vector<int32_t> freed;
    cache_->evict_snapshots(1, freed);
    slots_.free(freed);
  }
  if (!slots_.allocate(1, got)) return false;
  slot = got[0];
  return true;
}

bool Scheduler::grow_pages(Sequence& seq, int64_t tokens) {
  const int64_t need = (tokens + opts_.page_size - 1) / opts_.page_size - static_cast<int64_t>(seq.pages.size());
  if (need <= 0) return true;
  if (pages_.num_free() < need && cache_) {
    std::vector<int32_t> free_pages, free_slots;
    cache_->evict_pages(need - pages_.num_free(), free_pages, free_slots);
    give_back(free_pages, free_slots);
  }
  return pages_.allocate(need, seq.pages);
}

void Scheduler::preempt(size_t i) {
  std::unique_ptr<Sequence> seq = std::move(running_[i]);
  running_.erase(running_.begin() + static_cast<std::ptrdiff_t>(i));
  free_resources(*seq, /*cache=*/true);
  seq->num_cached = 0;
  seq->prefill_target = static_cast<int64_t>(seq->tokens.size());
  ++seq->preemptions;
  ++counters_.preemptions;
  waiting_.push_front(std::move(seq));
}

std::vector<std::unique_ptr<Sequence>> Scheduler::take_aborted() {
  std::vector<std::unique_ptr<Sequence>> out;
  for (auto it = waiting_.begin(); it != waiting_.end();) {
    if ((*it)->abort_requested) {
      out.push_back(std::move(*it));
      it = waiting_.erase(it);
    } else {
      ++it;
    }
  }
  for (auto it = running_.begin(); it != running_.end();) {
    if ((*it)->abort_requested) {
      free_resources(**it, true);
      out.push_back(std::move(*it));
      it = running_.erase(it);
    } else {
      ++it;
    }
  }
  return out;
}

void Scheduler::admit(Clock::time_point now, StepPlan& plan) {
  const int64_t P = opts_.page_size;
  int64_t pending = 0;  // pages the sequences admitted here take for their first chunks in this step
  while (!waiting_.empty() && num_running() < opts_.max_running_requests) {
    Sequence& seq = *waiting_.front();
    // Match first (the matched snapshot becomes the most recently used), then take a slot: evicting a snapshot
    // if needed, at worst the matched one itself, whose slot then is the sequence's (the restore copies nothing).
    PrefixCache::Match m;
    if (cache_) {
      std::vector<int32_t> key_scratch;
      m = cache_->match(cache_key(seq, key_scratch), seq.prefill_target - 1);  // at least one token left to compute
      cache_->lock(m.path);
    }
    int slot = -1;
    if (!take_slot(slot)) {
      if (cache_) cache_->unlock(m.path);
      break;  // head waits; no overtaking
    }
    // Pages for the first chunk plus a page of headroom per running sequence, counting what the cache
    // could give up.
    int64_t first = seq.prefill_target - m.tokens;
    if (opts_.chunked_prefill_size > 0) first = std::min(first, opts_.chunked_prefill_size);
    const int64_t first_pages = (m.tokens + first + P - 1) / P - static_cast<int64_t>(m.path.size());
    const int64_t need = first_pages + num_running() + pending;
    const int64_t can = pages_.num_free() + (cache_ ? cache_->evictable_pages() : 0);
    if (can < need && num_running() > 0) {
      if (cache_) cache_->unlock(m.path);
      slots_.free({slot});
      break;
    }
    pending += first_pages;
    seq.state_slot = slot;
    seq.num_cached = m.tokens;
    seq.cache_path = m.path;
    for (PrefixCache::Node* n : m.path) seq.pages.push_back(n->page);
    if (m.snapshot_slot >= 0 && m.snapshot_slot != slot) plan.restores.push_back({m.snapshot_slot, slot});
    if (!seq.admitted_once) {
      seq.admitted_once = true;
      seq.cached_tokens = m.tokens;
      seq.admitted_at = now;
      counters_.cache_query_tokens += static_cast<uint64_t>(seq.prompt_len);
      counters_.cache_hit_tokens += static_cast<uint64_t>(m.tokens);
    }
    running_.push_back(std::move(waiting_.front()));
    waiting_.pop_front();
  }
}

StepPlan Scheduler::plan_step(Clock::time_point now) {
  StepPlan plan;
  admit(now, plan);
  // Running sequences that are all prefilling can fill the pool between them with none able to go on:
  // then the newest is preempted until one can.
  for (;;) {
    plan_chunks(plan);
    if (!plan.chunks.empty() || running_.size() <= 1) break;
    preempt(running_.size() - 1);
  }
  // A sequence admitted and preempted in this plan restores nothing.
  std::erase_if(plan.restores, [&](const StateCopy& c) {
    return std::none_of(running_.begin(), running_.end(), [&](const auto& r) { return r->state_slot == c.dst; });
  });
  return plan;
}

void Scheduler::plan_chunks(StepPlan& plan) {
  const int64_t P = opts_.page_size;
  const bool snapshots = cache_ && opts_.needs_state;
  // The prompt's second-to-last page boundary (at least a page before its end; 0: none) and the prefill's last.
  auto tail_boundary = [&](const Sequence& s) { return std::max<int64_t>(0, s.prompt_len / P * P - P); };
  auto last_boundary = [&](const Sequence& s) { return s.prefill_target / P * P; };
  // A chunk that ends on a page boundary past the sequence's latest snapshot saves the state there (best
  // effort): into a new slot while it holds fewer than max_snapshots_per_sequence, else into the slot of its
  // oldest snapshot that is not the prompt tail's.
  // Books the snapshot at `end` and returns its slot (-1: none, or no slot for it).
  auto book_snapshot = [&](Sequence& s, int64_t end) -> int {
    if (!snapshots || end % P != 0 || end <= 0 || (!s.snaps.empty() && end <= s.snaps.back().pos)) return -1;
    const bool keep = end == tail_boundary(s) && end < s.prompt_len;
    int slot = -1;
    if (static_cast<int>(s.snaps.size()) < opts_.max_snapshots_per_sequence) {
      if (!take_slot(slot)) return -1;
    } else {
      auto it = std::find_if(s.snaps.begin(), s.snaps.end(), [](const Sequence::Snapshot& x) { return !x.keep; });
      if (it == s.snaps.end()) return -1;
      slot = it->slot;
      s.snaps.erase(it);
    }
    s.snaps.push_back({end, slot, keep});
    return slot;
  };
  // A snapshot at a chunk's end: the slot's state copied after the step's forward.
  auto plan_save = [&](Sequence& s, int64_t end) {
    const int slot = book_snapshot(s, end);
    if (slot >= 0) plan.saves.push_back({s.state_slot, slot});
  };
  // Decodes, oldest first; a sequence that needs a page and cannot get one preempts the newest.
  for (size_t i = 0; i < running_.size();) {
    Sequence& s = *running_[i];
    if (s.prefilling()) {
      ++i;
      continue;
    }
    KILN_CHECK(s.num_cached + 1 == static_cast<int64_t>(s.tokens.size()),
               "decoding sequence {} has {} cached of {} tokens", s.uid, s.num_cached, s.tokens.size());
    if (!grow_pages(s, s.num_cached + 1)) {
      preempt(running_.size() - 1);  // the newest (this one, when it is the newest)
      continue;                      // retry i (or stop, when it was this one)
    }
    // The verify's further positions: free pages only (a shortfall only means fewer drafts).
    if (opts_.decode_lookahead > 0) {
      const int64_t want = (s.num_cached + 1 + opts_.decode_lookahead + opts_.page_size - 1) / opts_.page_size -
                           static_cast<int64_t>(s.pages.size());
      if (want > 0 && pages_.num_free() >= want) pages_.allocate(want, s.pages);
    }
    plan.chunks.push_back({&s, s.num_cached, 1, true, {}});
    ++plan.num_decodes;
    plan_save(s, s.num_cached + 1);
    ++i;
  }
  // Prefill chunks, oldest first, within what the decodes leave of the step's budget (at least a page: prompts
  // are never starved by a full batch of decodes) and the pages there are (they do not preempt).
  int64_t step_budget = opts_.chunked_prefill_size;
  if (plan.num_decodes > 0 && opts_.step_budget_while_decoding > 0)
    step_budget = step_budget > 0 ? std::min(step_budget, opts_.step_budget_while_decoding)
                                  : opts_.step_budget_while_decoding;
  int64_t budget = INT64_MAX;
  if (step_budget > 0)
    budget = std::max<int64_t>(step_budget - plan.num_decodes * (1 + opts_.decode_lookahead),
                               std::min<int64_t>(P, step_budget));
  for (auto& sp : running_) {
    if (budget <= 0) break;
    Sequence& s = *sp;
    if (!s.prefilling()) continue;
    int64_t n = std::min(s.prefill_target - s.num_cached, budget);
    // With snapshots, the state is saved at the prompt's second-to-last page boundary and at the prefill's last one:
    // inside the chunk when the runner writes snapshots there (chunk_snapshots), else the chunk stops at the first of
    // them and the rest follows in the next step.
    std::vector<int64_t> inside;
    if (snapshots && opts_.max_snapshots_per_sequence > 0)
      for (int64_t cut : {tail_boundary(s), last_boundary(s)})
        if (cut > s.num_cached && cut < s.num_cached + n && cut < s.prefill_target) {
          if (!opts_.chunk_snapshots) {
            n = cut - s.num_cached;
            break;
          }
          if (inside.empty() || inside.back() < cut) inside.push_back(cut);
        }
    const int64_t have = static_cast<int64_t>(s.pages.size()) + pages_.num_free() +
                         (cache_ ? cache_->evictable_pages() : 0);
    n = std::min(n, have * P - s.num_cached);
    if (n <= 0) continue;
    KILN_CHECK(grow_pages(s, s.num_cached + n), "prefill pages for sequence {}", s.uid);
    const bool last = s.num_cached + n == s.prefill_target;
    PlannedChunk chunk{&s, s.num_cached, n, last, {}};
    for (int64_t b : inside) {
      if (b >= s.num_cached + n) break;
      const int slot = book_snapshot(s, b);
      if (slot >= 0) chunk.snapshots.push_back({b - s.num_cached, slot});
    }
    plan.chunks.push_back(std::move(chunk));
    plan.num_prefill_tokens += n;
    budget -= n;
    plan_save(s, s.num_cached + n);
  }
}

void Scheduler::commit_step(const StepPlan& plan) {
  for (const auto& c : plan.chunks) {
    KILN_CHECK(c.seq->num_cached == c.start_pos, "commit out of order for sequence {}", c.seq->uid);
    c.seq->num_cached += c.num_tokens;
  }
}

void Scheduler::commit_accepted(Sequence* seq, int64_t tokens) {
  KILN_CHECK(tokens >= 0 && !seq->prefilling() && seq->num_cached == static_cast<int64_t>(seq->tokens.size()),
             "commit_accepted: sequence {} has {} cached of {} tokens", seq->uid, seq->num_cached, seq->tokens.size());
  KILN_CHECK((seq->num_cached + tokens + opts_.page_size - 1) / opts_.page_size <=
                 static_cast<int64_t>(seq->pages.size()),
             "commit_accepted: sequence {} accepted past its pages", seq->uid);
  seq->num_cached += tokens;
}

std::unique_ptr<Sequence> Scheduler::release(Sequence* seq, bool cache) {
  auto it = std::find_if(running_.begin(), running_.end(), [&](auto& p) { return p.get() == seq; });
  KILN_CHECK(it != running_.end(), "release of a sequence that is not running");
  std::unique_ptr<Sequence> out = std::move(*it);
  running_.erase(it);
  free_resources(*out, cache);
  return out;
}

std::vector<std::unique_ptr<Sequence>> Scheduler::release_all() {
  std::vector<std::unique_ptr<Sequence>> out;
  for (auto& s : running_) {
    free_resources(*s, false);
    out.push_back(std::move(s));
  }
  running_.clear();
  for (auto& s : waiting_) out.push_back(std::move(s));
  waiting_.clear();
  return out;
}

int64_t Scheduler::flush_prefix_cache() {
  KILN_CHECK(idle(), "flush_prefix_cache with {} running and {} waiting", running_.size(), waiting_.size());
  if (!cache_) return 0;
  std::vector<int32_t> free_pages, free_slots;
  cache_->clear(free_pages, free_slots);
  const int64_t freed = static_cast<int64_t>(free_pages.size());
  give_back(free_pages, free_slots);
  return freed;
}

void Scheduler::for_each_sequence(const std::function<void(Sequence&)>& fn) {
  for (auto& s : waiting_) fn(*s);
  for (auto& s : running_) fn(*s);
}

}  // namespace kiln::engine
