// kiln bench: a serving benchmark against any OpenAI-compatible server (see clients/bench.h).
#include <cstdio>
#include <cstdlib>
#include <memory>

#include "cli/client_command.h"
#include "cli/command.h"
#include "cli/environment.h"
#include "clients/bench.h"
#include "core/error.h"

namespace {

struct BenchArgs {
  kiln::cli::ClientFlags client{.timeout_s = 600};
  std::string endpoint = "completions";
  size_t input_len = 1024;
  size_t output_len = 128;
  size_t num_prompts = 0;
  std::string max_concurrency;
  std::string request_rate = "inf";
  uint64_t seed = 1;
  std::string tokenizer_dir;
  double max_failed_fraction = 0.05;
  bool no_progress = false;
  size_t multi_turn = 0;
  size_t conversations = 8;
  size_t long_input_len = 0;
  size_t long_every = 0;
  std::string dataset_path;
  bool dataset_shuffle = false;
  double temperature = 0.0;
};

kiln::cli::Registrar reg{"bench", "Serving benchmark (TTFT, TPOT, ITL, throughput) against any OpenAI-compatible server",
                         [](CLI::App& app) {
  auto args = std::make_shared<BenchArgs>();
  kiln::cli::add_client_flags(app, args->client, "Also write the results to FILE");
  app.add_option("--endpoint", args->endpoint, "completions (raw prompt) or chat")
      ->check(CLI::IsMember({"completions", "chat"}))
      ->capture_default_str();
  auto* input_len = app.add_option("--input-len", args->input_len, "Prompt length in tokens (exact; random prompts)")
                        ->capture_default_str();
  app.add_option("--output-len", args->output_len,
                 "Output tokens per request (sent with ignore_eos); with --dataset-path the most per request (an "
                 "item's max_tokens wins), outputs ending at the model's end token")
      ->capture_default_str();
  app.add_option("--num-prompts", args->num_prompts,
                 "Requests per concurrency level (default: max(16, 4 x concurrency); 64 when unlimited); with "
                 "--dataset-path: the first N items of the file (default: all of them)");
  auto* dataset_path = app.add_option("--dataset-path", args->dataset_path,
                 "Real prompts from FILE instead of random ones: a JSON object with an \"items\" array (as "
                 "tools/tiny/eval_prompts.json), a JSON array of items, or JSONL; each item's \"prompt_ids\" "
                 "(token ids) or \"prompt\" (text) for completions, \"messages\" or \"prompt\" for chat, optional "
                 "\"max_tokens\". Sent without ignore_eos (natural output lengths), greedy unless --temperature; "
                 "every level sends the same items; not with --multi-turn or --long-every")
      ->excludes(input_len);
  app.add_flag("--dataset-shuffle", args->dataset_shuffle,
               "With --dataset-path: shuffle the items (seeded by --seed) before taking --num-prompts of them")
      ->needs(dataset_path);
  app.add_option("--temperature", args->temperature, "Sampling temperature of every request; 0 = greedy")
      ->capture_default_str();
  app.add_option("--max-concurrency", args->max_concurrency,
                 "Comma list of concurrency limits to sweep, e.g. 1,4,16 (default: unlimited)");
  app.add_option("--request-rate", args->request_rate, "Requests per second, Poisson arrivals; inf = all at once")
      ->capture_default_str();
  app.add_option("--seed", args->seed, "Seed of the random prompts, the arrival times and --dataset-shuffle")
      ->capture_default_str();
  app.add_option("--tokenizer", args->tokenizer_dir,
                 "Folder with the model's tokenizer.json: count prompt tokens locally, not with the server's /tokenize");
  app.add_option("--max-failed-fraction", args->max_failed_fraction,
                 "Fail the run when a level has more failed requests than this fraction")
      ->capture_default_str();
  app.add_flag("--no-progress", args->no_progress, "No live progress bar");
  app.add_option("--multi-turn", args->multi_turn,
                 "Multi-turn mode: conversations of this many turns, each turn sending the history plus a new "
                 "message of --input-len tokens (completions endpoint); TTFT and throughput per turn");
  app.add_option("--conversations", args->conversations, "Multi-turn mode: conversations run at once")
      ->capture_default_str();
  app.add_option("--long-input-len", args->long_input_len,
                 "Mixed load, with --long-every: the prompt length in tokens of the long requests");
  app.add_option("--long-every", args->long_every,
                 "Mixed load: every Nth request of a level sends --long-input-len prompt tokens instead of "
                 "--input-len; TTFT and ITL are also reported for the short and the long requests apart");
  return [args]() -> int {
    using namespace kiln::clients;
    BenchOptions options;
    options.server = kiln::cli::client_server_address(args->client);
    options.model = args->client.model;
    options.endpoint = args->endpoint == "chat" ? BenchEndpoint::chat : BenchEndpoint::completions;
    options.input_len = args->input_len;
    options.output_len = args->output_len;
    if (args->num_prompts > 0) options.num_prompts = args->num_prompts;
    if (!args->max_concurrency.empty()) options.max_concurrency = parse_concurrency_list(args->max_concurrency);
    options.request_rate = parse_request_rate(args->request_rate);
    options.seed = args->seed;
    options.tokenizer_dir = args->tokenizer_dir;
    options.max_failed_fraction = args->max_failed_fraction;
    options.progress = !args->no_progress;
    options.multi_turn = args->multi_turn;
    options.conversations = args->conversations;
    options.long_input_len = args->long_input_len;
    options.long_every = args->long_every;
    options.dataset_path = args->dataset_path;
    options.dataset_shuffle = args->dataset_shuffle;
    options.temperature = args->temperature;
    kiln::cli::JsonOutputFile json_file(args->client.json_path, "results");
    // Either report (BenchReport, MultiTurnReport): its JSON, then the exit status.
    auto finish = [&](const auto& report) -> int {
      json_file.write(report.to_json());
      if (report.passed) return 0;
      std::fflush(stdout);
      std::fprintf(stderr, "error: benchmark failed: %s\n", report.failure.c_str());
      return 1;
    };
    if (options.multi_turn > 0) return finish(run_multi_turn_bench(options, stdout));
    return finish(run_bench(options, stdout));
  };
}};

}  // namespace
