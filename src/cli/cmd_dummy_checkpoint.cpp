// kiln dummy-checkpoint: a full-size model folder with random weights in the real on-disk layout, from
// config.json alone (the weights of `--load-format dummy`), with a tokenizer whose ids cover the whole
// vocabulary. For load-time and serving benchmarks of models one cannot (or need not) download.
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>

#include "cli/command.h"
#include "core/error.h"
#include "format/model_dir.h"
#include "model/random_checkpoint.h"
#include "tokenizer/covering_tokenizer.h"

namespace {

using namespace kiln;
namespace fs = std::filesystem;
using nlohmann::json;

struct Opts {
  std::string model_path;
  std::string output;
  std::string tokenizer_from;
  double shard_gib = 5.0;
};

void write_text(const fs::path& p, const std::string& text) {
  std::ofstream f(p, std::ios::binary);
  f << text;
  if (!f) fail("cannot write '{}'", p.string());
}

int run(const Opts& o) {
  const format::ModelDir cfg_dir = format::ModelDir::open(o.model_path);
  const format::ModelDir tok_dir = format::ModelDir::open_or_embedded(o.tokenizer_from);
  if (o.shard_gib <= 0) fail("--shard-gib must be > 0 (got {})", o.shard_gib);

  // Weights first (the long part), with a progress line.
  model::RandomCheckpointOptions wopt;
  wopt.max_shard_bytes = static_cast<uint64_t>(o.shard_gib * (1ull << 30));
  const auto t0 = std::chrono::steady_clock::now();
  auto last = t0;
  wopt.progress = [&](uint64_t done, uint64_t total) {
    const auto now = std::chrono::steady_clock::now();
    if (now - last < std::chrono::seconds(2) && done < total) return;
    last = now;
    const double s = std::chrono::duration<double>(now - t0).count();
    const double rate = s > 0 ? done / s : 0;
    std::fprintf(stderr, "\r[dummy-checkpoint] %.2f / %.2f GB written, %.2f GB/s, ETA %.0f s   ", done / 1e9,
                 total / 1e9, rate / 1e9, rate > 0 ? (total - done) / rate : 0.0);
    if (done >= total) std::fprintf(stderr, "\n");
  };
  const model::RandomCheckpointSummary w = model::write_random_checkpoint(cfg_dir, o.output, wopt);
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();

  // Config files as they are; the tokenizer and chat template from the tokenizer folder.
  const json cfg = json::parse(cfg_dir.read_text("config.json"));
  const json& text_cfg = cfg.contains("text_config") ? cfg["text_config"] : cfg;
  const int64_t vocab = text_cfg.value("vocab_size", int64_t{0});
  if (vocab <= 0) fail("{}: config.json has no vocab_size", cfg_dir.display_path());
  for (const char* f : {"config.json", "hf_quant_config.json", "generation_config.json"})
    if (cfg_dir.has(f)) write_text(fs::path(o.output) / f, cfg_dir.read_text(f));

  // Place the added tokens where the real model has them when config.json says (image_token_id is
  // <|image_pad|>'s id in the Qwen3.5 family); otherwise at the end of the vocabulary.
  const std::string base_json = tok_dir.read_text("tokenizer.json");
  int64_t first_added = -1;
  if (cfg.contains("image_token_id")) {
    const json base = json::parse(base_json);
    for (size_t i = 0; i < base["added_tokens"].size(); ++i)
      if (base["added_tokens"][i].value("content", "") == "<|image_pad|>")
        first_added = cfg["image_token_id"].get<int64_t>() - static_cast<int64_t>(i);
  }
  const tok::CoveringTokenizerFiles t = tok::make_covering_tokenizer(
      vocab, first_added, base_json, tok_dir.has("tokenizer_config.json") ? tok_dir.read_text("tokenizer_config.json") : "");
  write_text(fs::path(o.output) / "tokenizer.json", t.tokenizer_json);
  write_text(fs::path(o.output) / "tokenizer_config.json", t.tokenizer_config_json);
  if (tok_dir.has("chat_template.jinja"))
    write_text(fs::path(o.output) / "chat_template.jinja", tok_dir.read_text("chat_template.jinja"));
  if (!cfg_dir.has("generation_config.json")) {
    // End of turn and end of text, at the ids the covering tokenizer gave them.
    const json tj = json::parse(t.tokenizer_json);
    json eos = json::array();
    for (const char* name : {"<|im_end|>", "<|endoftext|>"})
      for (const auto& a : tj["added_tokens"])
        if (a.value("content", "") == name) eos.push_back(a["id"]);
    write_text(fs::path(o.output) / "generation_config.json", json{{"eos_token_id", eos}}.dump(2) + "\n");
  }
  write_text(fs::path(o.output) / "README.md",
             fmt::format("# Random weights (kiln dummy-checkpoint)\n\nWritten by `kiln dummy-checkpoint --model-path {}` "
                         "from config.json alone: the weights of `--load-format dummy`, in the real on-disk layout. "
                         "The output of this model is meaningless text; it is for load-time and serving benchmarks.\n",
                         fs::path(o.model_path).filename().string()));

  std::printf("wrote %zu tensors, %.2f GB in %zu files to %s in %.1f s (%.2f GB/s)\n", w.tensors, w.bytes / 1e9,
              w.files.size(), o.output.c_str(), secs, secs > 0 ? w.bytes / 1e9 / secs : 0.0);
  std::printf("tokenizer: %lld ids (256 bytes, %lld merges, added tokens from id %lld, %lld fill tokens)\n",
              static_cast<long long>(vocab), static_cast<long long>(t.num_merged),
              static_cast<long long>(t.first_added_id), static_cast<long long>(t.num_fill));
  return 0;
}

kiln::cli::Registrar reg{
    "dummy-checkpoint", "Write a full-size random-weight checkpoint (real layout) from a config.json",
    [](CLI::App& app) {
      auto o = std::make_shared<Opts>();
      app.add_option("--model-path", o->model_path, "Folder with config.json (+ hf_quant_config.json), e.g. configs/...")
          ->required();
      app.add_option("--output", o->output, "Folder to write (created; must hold no safetensors files)")->required();
      app.add_option("--tokenizer-from", o->tokenizer_from,
                     "Folder whose tokenizer.json / chat template the covering tokenizer is built from "
                     "(default: the embedded kiln-tiny, whose pre-tokenizer and special tokens are Qwen3.5's)");
      app.add_option("--shard-gib", o->shard_gib, "Largest safetensors shard, GiB")->capture_default_str();
      return [o]() { return run(*o); };
    }};

}  // namespace
