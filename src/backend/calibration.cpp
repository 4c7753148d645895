#include "backend/calibration.h"

#include <algorithm>
#include <cmath>

#include "backend/cpu/cpu_backend.h"
#include "core/error.h"
#include "core/log.h"
#include "model/runner.h"

namespace kiln::backend {

namespace {

bool ends_with(const std::string& s, std::string_view suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

}  // namespace

namespace {
std::unique_ptr<model::Ops> checked_inner(std::unique_ptr<model::Ops> inner) {
  KILN_CHECK(inner != nullptr, "CalibratingOps needs an inner backend");
  return inner;
}
}  // namespace

CalibratingOps::CalibratingOps(std::unique_ptr<model::Ops> inner) : ForwardingOps(checked_inner(std::move(inner))) {}

TensorView CalibratingOps::place_weight(const TensorView& host) {
  TensorView placed = inner().place_weight(host);
  const auto* begin = static_cast<const uint8_t*>(placed.data);
  if (begin != nullptr) placed_[begin] = Placed{begin + placed.nbytes(), static_cast<const uint8_t*>(host.data)};
  return placed;
}

std::string CalibratingOps::module_name(const void* placed_data) {
  if (placed_data == nullptr || checkpoint_ == nullptr) return "";
  if (auto c = name_cache_.find(placed_data); c != name_cache_.end()) return c->second;
  std::string name;
  // Placed bytes -> checkpoint bytes (weights of one tensor, e.g. fused experts, share one placement).
  const auto* p = static_cast<const uint8_t*>(placed_data);
  const uint8_t* host = nullptr;
  if (auto it = placed_.upper_bound(p); it != placed_.begin()) {
    --it;
    if (p < it->second.end) host = it->second.host + (p - it->first);
  }
  if (host != nullptr) {
    if (by_address_.empty())
      for (const auto& [n, t] : checkpoint_->tensors()) by_address_[t.data] = &t;
    if (auto it = by_address_.upper_bound(host); it != by_address_.begin()) {
      --it;
      const format::TensorInfo& t = *it->second;
      const size_t offset = static_cast<size_t>(host - t.data);
      if (offset < t.nbytes) {
        const bool fused_gate_up = ends_with(t.name, ".mlp.experts.gate_up_proj");
        const bool fused_down = ends_with(t.name, ".mlp.experts.down_proj");
        if ((fused_gate_up || fused_down) && t.shape.ndim == 3) {
          // [E, R, K]: which expert, and (gate_up) which half of its rows.
          const size_t row_bytes = static_cast<size_t>(t.shape[2]) * dtype_size(t.dtype);
          const size_t expert_bytes = static_cast<size_t>(t.shape[1]) * row_bytes;
          const size_t expert = offset / expert_bytes;
          const size_t row = (offset % expert_bytes) / row_bytes;
          const std::string experts = t.name.substr(0, t.name.rfind('.'));  // "<L>mlp.experts"
          const char* proj = fused_down ? "down_proj" : (row < static_cast<size_t>(t.shape[1] / 2) ? "gate_proj" : "up_proj");
          name = experts + "." + std::to_string(expert) + "." + proj;
        } else if (ends_with(t.name, ".weight")) {
          name = t.name.substr(0, t.name.size() - 7);
        } else {
          name = t.name;
        }
      }
    }
  }
  name_cache_[placed_data] = name;
  return name;
}

void CalibratingOps::record(const void* placed_data, float value) {
  const std::string name = module_name(placed_data);
  if (name.empty()) return;
  float& a = amax_[name];
  a = std::max(a, value);
}

void CalibratingOps::linear(const TensorView& x, const model::LinearWeight& w, TensorView out) {
  record(w.weight.data, inner().max_abs(x));
  inner().linear(x, w, out);
}

void CalibratingOps::moe_experts(const TensorView& x, const TensorView& expert_ids, const TensorView& weights,
                                 std::span<const model::ExpertWeights> experts, TensorView out) {
  // x [T, H], expert_ids I32 [T, k]. The real output first, from the inner backend, untouched.
  inner().moe_experts(x, expert_ids, weights, experts, out);

  const int64_t n_tokens = x.dim(0), hidden = x.dim(1), top_k = expert_ids.dim(1);
  std::vector<int32_t> ids(static_cast<size_t>(expert_ids.numel()));
  inner().download(expert_ids, ids.data());
  std::vector<std::vector<int32_t>> rows_of(experts.size());
  for (int64_t t = 0; t < n_tokens; ++t)
    for (int64_t j = 0; j < top_k; ++j) {
      const int32_t e = ids[static_cast<size_t>(t * top_k + j)];
      KILN_CHECK(e >= 0 && static_cast<size_t>(e) < experts.size(), "expert id {} out of range", e);
      rows_of[static_cast<size_t>(e)].push_back(static_cast<int32_t>(t));
    }
  for (size_t e = 0; e < experts.size(); ++e) {
    const auto& rows = rows_of[e];
    const model::ExpertWeights& w = experts[e];
    if (rows.empty() || !w.gate.present()) continue;
    const int64_t r = static_cast<int64_t>(rows.size());
    TensorView row_ids = inner().upload(rows.data(), DType::I32, Shape{r});
    TensorView xe = inner().scratch(DType::F32, Shape{r, hidden});  // [R, H] the rows routed to e
    inner().gather_rows(x, row_ids, xe);
    const float x_amax = inner().max_abs(xe);
    record(w.gate.weight.data, x_amax);
    record(w.up.weight.data, x_amax);
    const int64_t inter = w.gate.out_features;
    TensorView gate = inner().scratch(DType::F32, Shape{r, inter});  // [R, I]
    TensorView up = inner().scratch(DType::F32, Shape{r, inter});
    inner().linear(xe, w.gate, gate);
    inner().linear(xe, w.up, up);
    inner().silu_mul(gate, up, gate);  // the input of down_proj
    record(w.down.weight.data, inner().max_abs(gate));
  }
}

std::map<std::string, float> calibrate_input_amax(const format::ModelDir& dir,
                                                  const std::vector<std::vector<int32_t>>& prompts,
                                                  const CalibrationOptions& options) {
  if (prompts.empty()) fail("calibration needs at least one prompt");
  if (options.max_tokens_per_prompt <= 0) fail("calibration: max tokens per prompt must be positive");
  auto calibrating = std::make_unique<CalibratingOps>(make_cpu_backend());
  CalibratingOps* ops = calibrating.get();
  model::RunnerOptions ro;
  ro.kv_dtype = DType::F32;  // exact attention: the activations the BF16 model really produces
  ro.state_slots = 1;
  ro.max_context = options.max_tokens_per_prompt;
  model::Runner runner(std::move(calibrating), dir, ro);
  ops->set_checkpoint(runner.model().checkpoint.get());

  const model::RunnerCapacity cap = runner.capacity();
  std::vector<int32_t> pages(static_cast<size_t>(cap.kv_pages));
  for (size_t p = 0; p < pages.size(); ++p) pages[p] = static_cast<int32_t>(p);
  std::vector<float> logits(static_cast<size_t>(runner.vocab_size()));
  CalibrationProgress progress;
  progress.prompts_total = prompts.size();
  for (const auto& prompt : prompts) {
    if (prompt.empty()) fail("calibration prompt {} encodes to no tokens", progress.prompts_done + 1);
    const size_t n = std::min(prompt.size(), static_cast<size_t>(std::min(options.max_tokens_per_prompt, cap.max_context)));
    model::SeqChunk c;
    c.state_slot = 0;
    c.tokens = std::span<const int32_t>(prompt.data(), n);
    c.start_pos = 0;
    c.page_table = pages;
    runner.forward({&c, 1}, logits);
    progress.prompts_done += 1;
    progress.tokens_done += static_cast<int64_t>(n);
    if (options.on_progress) options.on_progress(progress);
  }
  return ops->amax();
}

}  // namespace kiln::backend
