// Reads the transformers reference fixtures in tests/fixtures/reference/<family>_<variant>/ (written by
// tools/reference/make_fixtures.py): model/ (a tiny checkpoint), expected.safetensors, manifest.json.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "backend/cpu/cpu_backend.h"
#include "core/error.h"
#include "format/safetensors.h"
#include "model/runner.h"

namespace kiln::testing {

inline std::string fixtures_root() { return std::string(KILN_SOURCE_DIR) + "/tests/fixtures/reference"; }

inline std::vector<uint8_t> read_bytes(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>()};
}

// A named I32 / F32 tensor of an expected.safetensors, as a vector (KILN_CHECK: present).
template <typename T>
std::vector<T> tensor_values(const format::SafetensorsFile& f, const char* name) {
  const format::TensorInfo* t = f.find(name);
  KILN_CHECK(t, "{} missing", name);
  std::vector<T> v(static_cast<size_t>(t->shape.numel()));
  std::memcpy(v.data(), t->data, v.size() * sizeof(T));
  return v;
}

struct Prompt {
  std::vector<int32_t> tokens;
  int64_t prefill_first_pos = 0;
  std::vector<float> prefill_logits;  // [rows, V], positions prefill_first_pos ..
  std::vector<int32_t> greedy_tokens;  // [S]
  std::vector<float> greedy_logits;    // [S, V]
  std::vector<float> bf16_last_logits;  // [V] or empty
  double min_top2_gap = 0;
};

struct Fixture {
  std::string name;
  std::string model_dir;
  nlohmann::json manifest;
  int64_t vocab = 0;
  std::vector<Prompt> prompts;

  static Fixture load(const std::string& name) {
    Fixture fx;
    fx.name = name;
    const std::string dir = fixtures_root() + "/" + name;
    fx.model_dir = dir + "/model";
    fx.manifest = nlohmann::json::parse(std::ifstream(dir + "/manifest.json"));
    fx.vocab = fx.manifest["vocab_size"].get<int64_t>();
    std::vector<uint8_t> bytes = read_bytes(dir + "/expected.safetensors");
    format::SafetensorsFile file(bytes, name + "/expected.safetensors");
    auto i32 = [&](const std::string& n) {
      const format::TensorInfo* t = file.find(n);
      std::vector<int32_t> v(t->shape.numel());
      std::memcpy(v.data(), t->data, v.size() * 4);
      return v;
    };
    auto f32 = [&](const std::string& n) {
      const format::TensorInfo* t = file.find(n);
      std::vector<float> v;
      if (!t) return v;
      v.resize(t->shape.numel());
      std::memcpy(v.data(), t->data, v.size() * 4);
      return v;
    };
    for (const auto& p : fx.manifest["prompts"]) {
      const std::string pre = "p" + std::to_string(p["index"].get<int>()) + ".";
      Prompt pr;
      pr.tokens = i32(pre + "tokens");
      pr.prefill_first_pos = p["prefill_first_pos"].get<int64_t>();
      pr.prefill_logits = f32(pre + "prefill_logits");
      pr.greedy_tokens = i32(pre + "greedy_tokens");
      pr.greedy_logits = f32(pre + "greedy_logits");
      pr.bf16_last_logits = f32(pre + "prefill_last_logits_bf16");
      pr.min_top2_gap = p["min_top2_gap"].get<double>();
      fx.prompts.push_back(std::move(pr));
    }
    return fx;
  }

  // The text-model fixtures (a manifest with prompts); the vision fixtures of make_vision_fixtures.py
  // (qwen3_5_vision, qwen3_5_moe_vl) have their own tests.
  static std::vector<std::string> all_names() {
    std::vector<std::string> names;
    for (const auto& e : std::filesystem::directory_iterator(fixtures_root())) {
      const auto manifest = e.path() / "manifest.json";
      if (!std::filesystem::exists(manifest)) continue;
      const nlohmann::json m = nlohmann::json::parse(std::ifstream(manifest), nullptr, /*allow_exceptions=*/false);
      if (m.is_object() && m.contains("prompts")) names.push_back(e.path().filename().string());
    }
    std::sort(names.begin(), names.end());
    return names;
  }
};

// Max abs error and max error relative to the row's largest |reference| logit.
struct ErrorStats {
  double max_abs = 0;
  double max_rel = 0;
  void add(const float* got, const float* want, int64_t n) {
    double ref_max = 1e-12;
    for (int64_t i = 0; i < n; ++i) ref_max = std::max(ref_max, std::fabs(static_cast<double>(want[i])));
    for (int64_t i = 0; i < n; ++i) {
      const double e = std::fabs(static_cast<double>(got[i]) - want[i]);
      max_abs = std::max(max_abs, e);
      max_rel = std::max(max_rel, e / ref_max);
    }
  }
  void merge(const ErrorStats& o) {
    max_abs = std::max(max_abs, o.max_abs);
    max_rel = std::max(max_rel, o.max_rel);
  }
};

inline int32_t argmax(const float* x, int64_t n) {
  return static_cast<int32_t>(std::max_element(x, x + n) - x);
}

// A runner plus simple page bookkeeping: slot s owns pages [s * pages_per_slot, (s + 1) * pages_per_slot).
struct TestRunner {
  std::unique_ptr<model::ModelRunner> runner;
  int64_t pages_per_slot = 0;
  std::vector<std::vector<int32_t>> page_tables;

  TestRunner(const std::string& model_dir, backend::LoadOptions opts) {
    if (opts.max_context == 0) opts.max_context = 256;
    runner = backend::load_cpu_model(format::ModelDir::open(model_dir), opts);
    const auto cap = runner->capacity();
    pages_per_slot = cap.kv_pages / cap.state_slots;
    for (int s = 0; s < cap.state_slots; ++s) {
      std::vector<int32_t> pt(pages_per_slot);
      for (int64_t p = 0; p < pages_per_slot; ++p) pt[p] = static_cast<int32_t>(s * pages_per_slot + p);
      page_tables.push_back(pt);
    }
  }
  model::Runner& impl() { return dynamic_cast<model::Runner&>(*runner); }
  int64_t vocab() const { return runner->vocab_size(); }

  model::SeqChunk chunk(int slot, std::span<const int32_t> tokens, int64_t start_pos, bool logits = true) {
    model::SeqChunk c;
    c.state_slot = slot;
    c.tokens = tokens;
    c.start_pos = start_pos;
    // An out-of-range slot (for error tests) borrows slot 0's pages: the runner must reject the slot itself.
    c.page_table = page_tables[slot >= 0 && slot < static_cast<int>(page_tables.size()) ? slot : 0];
    c.want_logits = logits;
    return c;
  }
  // One chunk alone; returns its last-token logits.
  std::vector<float> run(int slot, std::span<const int32_t> tokens, int64_t start_pos) {
    std::vector<float> out(vocab());
    model::SeqChunk c = chunk(slot, tokens, start_pos);
    runner->forward({&c, 1}, out);
    return out;
  }
};

}  // namespace kiln::testing
