#include "engine/scheduler.h"

#include <algorithm>

#include "core/error.h"

namespace kiln::engine {

int64_t Sequence::reserved_tokens(int64_t context_length) const {
  return std::min(prompt_len + request.max_tokens, context_length);
}

Scheduler::Scheduler(SchedulerOptions options)
    : opts_(options), pages_(options.kv_pages), slots_(options.state_slots) {
  KILN_CHECK(opts_.page_size > 0, "page_size {}", opts_.page_size);
  KILN_CHECK(opts_.max_running_requests > 0, "max_running_requests {}", opts_.max_running_requests);
  KILN_CHECK(opts_.max_queued_requests >= 0, "max_queued_requests {}", opts_.max_queued_requests);
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
  waiting_.push_back(std::move(seq));
}

void Scheduler::free_resources(Sequence& seq) {
  if (!seq.pages.empty()) pages_.free(seq.pages);
  seq.pages.clear();
  if (seq.state_slot >= 0) slots_.free({seq.state_slot});
  seq.state_slot = -1;
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
      free_resources(**it);
      out.push_back(std::move(*it));
      it = running_.erase(it);
    } else {
      ++it;
    }
  }
  return out;
}

void Scheduler::admit(Clock::time_point now) {
  while (!waiting_.empty() && num_running() < opts_.max_running_requests) {
    Sequence& seq = *waiting_.front();
    int64_t need = pages_for(seq.prompt_len, seq.request.max_tokens);
    if (slots_.num_free() == 0 || pages_.num_free() < need) break;  // head waits; no overtaking
    std::vector<int32_t> slot;
    KILN_CHECK(slots_.allocate(1, slot));
    KILN_CHECK(pages_.allocate(need, seq.pages));
    seq.state_slot = slot[0];
    seq.num_cached = 0;
    seq.admitted_at = now;
    running_.push_back(std::move(waiting_.front()));
    waiting_.pop_front();
  }
}

StepPlan Scheduler::plan_step(Clock::time_point now) {
  admit(now);
  StepPlan plan;
  for (auto& s : running_) {
    if (s->prefilling()) continue;
    KILN_CHECK(s->num_cached + 1 == static_cast<int64_t>(s->tokens.size()),
               "decoding sequence {} has {} cached of {} tokens", s->uid, s->num_cached, s->tokens.size());
    plan.chunks.push_back({s.get(), s->num_cached, 1, true});
    ++plan.num_decodes;
  }
  int64_t budget = opts_.chunked_prefill_size > 0 ? opts_.chunked_prefill_size : INT64_MAX;
  for (auto& s : running_) {
    if (budget <= 0) break;
    if (!s->prefilling()) continue;
    int64_t n = std::min(s->prompt_len - s->num_cached, budget);
    bool last = s->num_cached + n == s->prompt_len;
    plan.chunks.push_back({s.get(), s->num_cached, n, last});
    plan.num_prefill_tokens += n;
    budget -= n;
  }
  return plan;
}

void Scheduler::commit_step(const StepPlan& plan) {
  for (const auto& c : plan.chunks) {
    KILN_CHECK(c.seq->num_cached == c.start_pos, "commit out of order for sequence {}", c.seq->uid);
    c.seq->num_cached += c.num_tokens;
  }
}

std::unique_ptr<Sequence> Scheduler::release(Sequence* seq) {
  auto it = std::find_if(running_.begin(), running_.end(), [&](auto& p) { return p.get() == seq; });
  KILN_CHECK(it != running_.end(), "release of a sequence that is not running");
  std::unique_ptr<Sequence> out = std::move(*it);
  running_.erase(it);
  free_resources(*out);
  return out;
}

std::vector<std::unique_ptr<Sequence>> Scheduler::release_all() {
  std::vector<std::unique_ptr<Sequence>> out;
  for (auto& s : running_) {
    free_resources(*s);
    out.push_back(std::move(s));
  }
  running_.clear();
  for (auto& s : waiting_) out.push_back(std::move(s));
  waiting_.clear();
  return out;
}

void Scheduler::for_each_sequence(const std::function<void(Sequence&)>& fn) {
  for (auto& s : waiting_) fn(*s);
  for (auto& s : running_) fn(*s);
}

}  // namespace kiln::engine
