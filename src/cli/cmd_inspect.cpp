// kiln inspect: what a model is and what it needs. Reads config.json (+ quantisation config); when weights
// are present, verifies them against the config and uses their real sizes. Plans memory for --tp GPUs.
#include <cstdio>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <nlohmann/json.hpp>

#include "backend/device.h"
#include "cli/command.h"
#include "engine/scheduler.h"
#include "core/log.h"
#include "core/error.h"
#include "format/capacity.h"
#include "format/model_config.h"
#include "format/model_dir.h"
#include "format/quant_config.h"
#include "format/safetensors.h"
#include "format/weight_map.h"

namespace {

using namespace kiln;
using namespace kiln::format;

struct InspectOptions {
  std::string model_path;
  int tp = 1;
  int ep = 1;
  double gpu_mem_gib = 0;
  std::string kv_cache_dtype = "bf16";
  double mem_fraction_static = 0.90;
  double activation_reserve_gib = 2.0;
  bool json = false;
  // `kiln serve`'s own plan on each GPU of --gpu-mem-gib: its flags, its defaults.
  int max_running_requests = 0;  // 0: the memory plan's, as kiln serve on CUDA
  bool disable_radix_cache = false;
  int64_t context_length = 0;
  std::string chunked_prefill_size = "auto";  // resolved as kiln serve does (backend::resolve_prefill_sizes)
  std::string max_pass_tokens = "auto";  // resolved as kiln serve does
  std::string chunked_prefill_size_while_decoding = "auto";  // resolved as kiln serve does
};

// Decimal units, scaled to the size (a tiny test model shows MB/KB, not 0.00 GB).
std::string gb(uint64_t bytes) {
  if (bytes >= 100'000'000 || bytes == 0) return fmt::format("{:.2f} GB", bytes / 1e9);
  if (bytes >= 100'000) return fmt::format("{:.2f} MB", bytes / 1e6);
  return fmt::format("{:.2f} KB", bytes / 1e3);
}
std::string gib(double bytes) { return fmt::format("{:.2f} GiB", bytes / (1024.0 * 1024.0 * 1024.0)); }
std::string mib(double bytes) { return fmt::format("{:.2f} MiB", bytes / (1024.0 * 1024.0)); }
std::string billions(int64_t n) {
  if (n >= 100'000'000) return fmt::format("{:.2f} B", n / 1e9);
  if (n >= 100'000) return fmt::format("{:.2f} M", n / 1e6);
  return fmt::format("{}", n);
}
std::string with_commas(int64_t n) {
  std::string s = std::to_string(n < 0 ? -n : n), out;
  for (size_t i = 0; i < s.size(); ++i) {
    if (i && (s.size() - i) % 3 == 0) out += ',';
    out += s[i];
  }
  return (n < 0 ? "-" : "") + out;
}

bool has_weights(const ModelDir& dir) {
  for (const auto& f : dir.files())
    if (f.ends_with(".safetensors") || f == "model.safetensors.index.json") return true;
  return false;
}

// Per role, in reading order.
const char* kRoleOrder[] = {role::kRoutedExpert, role::kSharedExpert, role::kDenseMlp, role::kRouter,
                            role::kLinearAttention, role::kAttention, role::kEmbedding, role::kLmHead,
                            role::kNorm, role::kKvScale};

// Everything kiln inspect found, for the JSON and the text forms.
struct Inspection {
  const InspectOptions& o;
  const ModelDir& dir;
  ModelConfig cfg;
  QuantConfig quant;
  CapacityOptions copt;
  std::unique_ptr<Checkpoint> ckpt;
  VerifyReport report;
  std::vector<ExpectedTensor> tensors;
  CapacityPlan p;
  std::vector<std::string> notes;
  // The plan `kiln serve --device cuda --tp-size N` makes at startup on each GPU of --gpu-mem-gib
  // (backend::plan_device_memory, the same function): one rank's GPU; the step and pass sizes serve would pick. The
  // GPU's kind is not known here, so the plan keeps the dequantised experts' buffer that serve leaves out on sm_90
  // (at most 0.25 GiB more activations).
  std::optional<backend::MemoryPlan> serve_plan;
  std::string serve_error;
  backend::PrefillSizes prefill;
};

DType inspect_kv_dtype(const std::string& flag) {
  if (flag == "bf16" || flag == "auto") return DType::BF16;
  if (flag == "fp8_e4m3" || flag == "fp8") return DType::F8_E4M3;
  fail("--kv-cache-dtype '{}' is not supported (use bf16 or fp8_e4m3)", flag);
}

// Routers stay BF16 whatever the quantisation config says (REFERENCE: a known checkpoint trap): a note when the
// config would quantise them, before the capacity plan's notes.
std::vector<std::string> inspect_notes(const Inspection& in) {
  int64_t routers_overridden = 0;
  for (const auto& t : in.tensors)
    if (t.role == role::kRouter && t.name.ends_with(".weight") &&
        in.quant.scheme_for(t.name.substr(0, t.name.size() - 7)) != QuantScheme::none)
      ++routers_overridden;
  std::vector<std::string> notes = in.p.notes;
  if (routers_overridden)
    notes.insert(notes.begin(), fmt::format("{} router linears are kept BF16 although {} would quantise them "
                                            "(its exclude list misses them)", routers_overridden, in.quant.source));
  return notes;
}

void plan_serve(Inspection& in) {
  const InspectOptions& o = in.o;
  const double gpu_bytes = o.gpu_mem_gib * 1024.0 * 1024.0 * 1024.0;
  in.prefill = backend::resolve_prefill_sizes(o.chunked_prefill_size, o.max_pass_tokens, "cuda", gpu_bytes,
                                              o.chunked_prefill_size_while_decoding);
  if (o.gpu_mem_gib <= 0) return;
  backend::LoadOptions lo;
  lo.parallel.tp_size = o.tp;
  lo.parallel.ep_size = o.ep;
  lo.kv_dtype = in.copt.kv_dtype;
  // Slots as kiln serve takes them: per running request its own, plus the prefix cache's snapshots when on.
  lo.slots_per_request = engine::state_slots_per_request(!o.disable_radix_cache);
  lo.state_slots = o.max_running_requests * lo.slots_per_request;  // 0: the memory plan chooses
  lo.max_context = o.context_length;
  lo.prefill_chunk = in.prefill.pass_tokens;
  lo.gpu.mem_fraction_static = o.mem_fraction_static;
  try {
    in.serve_plan = backend::plan_device_memory(in.dir, lo, gpu_bytes, 0);
  } catch (const Error& e) {
    in.serve_error = e.what();
  }
}

void print_json(const Inspection& in) {
  const CapacityPlan& p = in.p;
  const ModelConfig& cfg = in.cfg;
  nlohmann::ordered_json j;
  j["model"] = in.dir.display_path();
  j["model_type"] = cfg.model_type;
  j["architecture"] = cfg.architecture;
  j["tensor_prefix"] = cfg.tensor_prefix;
  j["num_layers"] = cfg.num_layers;
  j["num_full_attention_layers"] = cfg.num_full_attention_layers();
  j["num_linear_attention_layers"] = cfg.num_linear_attention_layers();
  j["layer_pattern"] = cfg.layer_pattern();
  j["quant_algo"] = in.quant.quant_algo;
  j["kv_cache_dtype"] = dtype_name(in.copt.kv_dtype);
  j["params_total"] = p.params_total;
  j["params_active"] = p.params_active;
  j["mtp_params"] = p.mtp_params;
  j["mtp_weight_bytes"] = p.mtp_weight_bytes;
  if (cfg.has_vision) {
    int64_t vp = 0;
    for (const auto& t : format::expected_vision_tensors(cfg, "model.visual.")) vp += t.shape.numel();
    j["vision_params"] = vp;
    j["vision_weight_bytes_bf16"] = 2 * vp;
  }
  j["weight_bytes"] = p.weight_bytes;
  nlohmann::ordered_json by_dtype = nlohmann::ordered_json::object();
  for (auto& [d, b] : p.weight_bytes_by_dtype) by_dtype[dtype_name(d)] = b;
  j["weight_bytes_by_dtype"] = by_dtype;
  nlohmann::ordered_json by_role = nlohmann::ordered_json::object(), dec_role = nlohmann::ordered_json::object();
  for (auto& [r, b] : p.weight_bytes_by_role) by_role[r] = b;
  for (auto& [r, b] : p.decode_bytes_by_role) dec_role[r] = b;
  j["weight_bytes_by_role"] = by_role;
  j["sizes_from_checkpoint"] = p.sizes_from_checkpoint;
  j["decode_bytes_per_token"] = p.decode_bytes_per_token;
  j["decode_bytes_by_role"] = dec_role;
  j["kv_bytes_per_token"] = p.kv_bytes_per_token;
  j["recurrent_state_dtype"] = in.copt.recurrent_state_bytes == 2 ? "bfloat16" : "float32";
  j["recurrent_state_bytes_per_layer"] = p.recurrent_state_bytes_per_layer;
  j["conv_state_bytes_per_layer"] = p.conv_state_bytes_per_layer;
  j["state_bytes_per_sequence"] = p.state_bytes_per_sequence;
  j["tp"] = p.tp;
  j["ep"] = p.ep;
  j["gpu_mem_gib"] = in.o.gpu_mem_gib;
  j["mem_fraction_static"] = in.o.mem_fraction_static;
  j["activation_reserve_bytes"] = p.activation_reserve_bytes;
  j["weight_bytes_per_gpu"] = p.weight_bytes_per_gpu;
  j["decode_bytes_per_token_per_gpu"] = p.decode_bytes_per_token_per_gpu;
  j["kv_bytes_per_token_per_gpu"] = p.kv_bytes_per_token_per_gpu;
  j["state_bytes_per_sequence_per_gpu"] = p.state_bytes_per_sequence_per_gpu;
  j["kv_budget_bytes_per_gpu"] = p.kv_budget_bytes;
  if (in.o.gpu_mem_gib > 0) j["max_kv_tokens"] = p.max_kv_tokens;
  else j["max_kv_tokens"] = nullptr;
  j["notes"] = in.notes;
  // kiln serve's plan of each GPU (one rank's), null without --gpu-mem-gib.
  if (in.serve_plan) {
    const backend::MemoryPlan& sp = *in.serve_plan;
    j["serve_plan_per_gpu"] = {{"budget_bytes", sp.budget_bytes}, {"weight_bytes", sp.weight_bytes},
                               {"kv_bytes", sp.kv_bytes}, {"kv_tokens", sp.kv_tokens},
                               {"state_bytes", sp.state_bytes}, {"state_slots", sp.state_slots},
                               {"activation_bytes", sp.activation_bytes}, {"context", sp.context},
                               {"ranks_per_gpu", sp.ranks_per_gpu},
                               {"chunked_prefill_size", in.prefill.step_tokens},
                               {"max_pass_tokens", in.prefill.pass_tokens},
                               {"chunked_prefill_size_while_decoding", in.prefill.step_tokens_while_decoding}};
  } else if (in.o.gpu_mem_gib > 0) {
    j["serve_plan_per_gpu"] = {{"error", in.serve_error}};
  } else {
    j["serve_plan_per_gpu"] = nullptr;
  }
  if (in.ckpt) {
    j["checkpoint_tensors"] = in.ckpt->size();
    j["ignored_vision_tensors"] = in.report.ignored_vision;
    j["ignored_mtp_tensors"] = in.report.ignored_mtp;
    j["unused_tensors"] = in.report.unexpected;
  }
  std::printf("%s\n", j.dump(2).c_str());
}

void line(const char* key, const std::string& value) { std::printf("%-22s %s\n", key, value.c_str()); }

// Which scheme each kind of linear uses, in reading order: "routed expert: nvfp4, attention: bf16, ...".
std::string schemes_by_role(const std::vector<ExpectedTensor>& tensors) {
  std::map<std::string, std::set<std::string>> by_role;
  for (const auto& t : tensors) {
    if (!t.name.ends_with(".weight") && !t.name.ends_with("gate_up_proj") && !t.name.ends_with("experts.down_proj")) continue;
    std::string scheme = t.dtypes.front() == DType::U8 ? "nvfp4" : t.dtypes.front() == DType::F8_E4M3 ? "fp8" : "bf16";
    by_role[t.role].insert(scheme);
  }
  std::string per_role;
  for (const char* r : kRoleOrder) {
    auto it = by_role.find(r);
    if (it == by_role.end()) continue;
    per_role += fmt::format("{}{}: {}", per_role.empty() ? "" : ", ", r, fmt::join(it->second, "+"));
  }
  return per_role;
}

// The model: shapes, quantisation, checkpoint, sizes.
void print_model_text(const Inspection& in) {
  const ModelConfig& cfg = in.cfg;
  const CapacityPlan& p = in.p;
  line("model", in.dir.display_path());
  line("architecture", fmt::format("{}{}", cfg.model_type, cfg.architecture.empty() ? "" : " (" + cfg.architecture + ")"));
  line("layers", fmt::format("{} = {} ({} linear-attention, {} full-attention)", cfg.num_layers, cfg.layer_pattern(),
                             cfg.num_linear_attention_layers(), cfg.num_full_attention_layers()));
  line("hidden / vocab", fmt::format("{} / {}, max context {}, tied embeddings: {}", cfg.hidden_size, cfg.vocab_size,
                                     cfg.max_position_embeddings, cfg.tie_word_embeddings ? "yes" : "no"));
  line("attention", fmt::format("{} heads / {} KV heads x {}{}, rotary {} dims, theta {:g}{}", cfg.num_attention_heads,
                                cfg.num_kv_heads, cfg.head_dim, cfg.attn_output_gate ? ", output gate" : "",
                                cfg.rotary_dim(), cfg.rope_theta,
                                cfg.mrope_section.empty() ? "" : fmt::format(", mrope {}", fmt::join(cfg.mrope_section, "/"))));
  if (cfg.num_linear_attention_layers())
    line("linear attention", fmt::format("{} key / {} value heads x {}/{}, conv kernel {}", cfg.linear_num_key_heads,
                                         cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim,
                                         cfg.linear_conv_kernel));
  if (cfg.num_experts)
    line("MoE", fmt::format("{} experts, top-{}{}, expert intermediate {}, shared expert {}", cfg.num_experts,
                            cfg.experts_per_tok, cfg.norm_topk_prob ? " (renormalised)" : "", cfg.moe_intermediate_size,
                            cfg.shared_expert_intermediate_size ? std::to_string(cfg.shared_expert_intermediate_size) : "none"));
  if (cfg.intermediate_size && (cfg.num_experts == 0 || !cfg.mlp_only_layers.empty()))
    line("dense MLP", fmt::format("intermediate {}", cfg.intermediate_size));
  line("quantisation",
       in.quant.is_quantized() ? fmt::format("{} (from {})", in.quant.quant_algo, in.quant.source) : "none (BF16)");
  line("", schemes_by_role(in.tensors));
  if (in.ckpt)
    line("checkpoint", fmt::format("verified: {} tensors match ({} vision + {} MTP ignored, {} unused); real sizes used",
                                   in.report.matched, in.report.ignored_vision, in.report.ignored_mtp,
                                   in.report.unexpected));
  else
    line("checkpoint", "no weights in the folder: sizes computed from the config");
  line("params", fmt::format("{} total, {} active per token", billions(p.params_total), billions(p.params_active)));
  if (cfg.has_vision) {
    int64_t vp = 0;
    for (const auto& t : format::expected_vision_tensors(cfg, "model.visual.")) vp += t.shape.numel();
    line("vision tower", fmt::format("{} blocks, hidden {}, {} params, {} as BF16 (not in the totals; kiln serve loads "
                                     "it on rank 0 unless --limit-mm-per-prompt image=0)",
                                     cfg.vision.depth, cfg.vision.hidden_size, billions(vp), gb(2 * vp)));
  } else if (!cfg.vision_problem.empty()) {
    line("vision tower", "not usable: " + cfg.vision_problem);
  }
  if (p.mtp_params > 0)
    line("MTP head", fmt::format("{} layer(s), {} params, {} (in the totals; its KV in the KV cache/token)",
                                 cfg.mtp_num_layers, billions(p.mtp_params), gb(p.mtp_weight_bytes)));
  std::string dt;
  for (auto& [d, b] : p.weight_bytes_by_dtype) dt += fmt::format("{}{} {}", dt.empty() ? "" : ", ", dtype_name(d), gb(b));
  line("weights", fmt::format("{} ({})", gb(p.weight_bytes), dt));
  std::string dr;
  for (const char* r : kRoleOrder) {
    auto it = p.decode_bytes_by_role.find(r);
    if (it == p.decode_bytes_by_role.end() || it->second == 0) continue;
    dr += fmt::format("{}{} {}", dr.empty() ? "" : ", ", r, gb(it->second));
  }
  line("decode reads/token", fmt::format("{} at batch 1 ({})", gb(p.decode_bytes_per_token), dr));
  line("KV cache/token", fmt::format("{} bytes ({}; {} full layers x 2 x {} KV heads x {})",
                                     with_commas(p.kv_bytes_per_token), dtype_name(in.copt.kv_dtype),
                                     cfg.num_full_attention_layers(), cfg.num_kv_heads, cfg.head_dim));
  if (p.state_bytes_per_sequence)
    line("state/sequence", fmt::format("{} ({} linear layers x ({} {} recurrent + {} fp32 conv))",
                                       mib(p.state_bytes_per_sequence), cfg.num_linear_attention_layers(),
                                       mib(p.recurrent_state_bytes_per_layer),
                                       in.copt.recurrent_state_bytes == 2 ? "bfloat16" : "float32",
                                       mib(p.conv_state_bytes_per_layer)));
}

// The plan per GPU for --tp, then kiln serve's own plan on such GPUs.
void print_plan_text(const Inspection& in) {
  const InspectOptions& o = in.o;
  const CapacityPlan& p = in.p;
  std::printf("\nplan for tp %d%s%s:\n", p.tp, p.ep > 1 ? fmt::format(" (ep {})", p.ep).c_str() : "",
              o.gpu_mem_gib > 0 ? fmt::format(" x {:g} GiB (mem fraction {:g}, activation reserve {:g} GiB)",
                                              o.gpu_mem_gib, o.mem_fraction_static, o.activation_reserve_gib).c_str()
                                : " (pass --gpu-mem-gib for a KV budget)");
  line("  weights/GPU", fmt::format("{} ({})", gib(p.weight_bytes_per_gpu), gb(p.weight_bytes_per_gpu)));
  line("  decode reads/GPU", gb(p.decode_bytes_per_token_per_gpu) + " per token at batch 1");
  line("  KV cache/token/GPU", with_commas(p.kv_bytes_per_token_per_gpu) + " bytes");
  if (p.state_bytes_per_sequence) line("  state/sequence/GPU", mib(p.state_bytes_per_sequence_per_gpu) + " (not in the KV budget)");
  if (o.gpu_mem_gib > 0) {
    line("  KV budget/GPU", fmt::format("{} = {} x {:g} - {} weights - {} reserve", gib(p.kv_budget_bytes),
                                        gib(p.gpu_bytes), o.mem_fraction_static, gib(p.weight_bytes_per_gpu),
                                        gib(p.activation_reserve_bytes)));
    // The serve plan below says what kiln serve really allocates on each GPU; the budget's token count is only
    // shown when nothing fits.
    if (p.max_kv_tokens <= 0)
      line("  max KV tokens", p.max_kv_tokens > 0 ? with_commas(p.max_kv_tokens)
                                                  : "0: weights + reserve exceed the budget; use more GPUs, more memory or a larger --mem-fraction-static");
  }
  for (const auto& n : in.notes) line("  note", n);
  if (o.gpu_mem_gib <= 0) return;
  const std::string gpus = o.tp > 1 ? fmt::format("each of {} x {:g} GiB GPUs (--tp-size {}{})", o.tp, o.gpu_mem_gib,
                                                  o.tp, o.ep > 1 ? fmt::format(" --ep-size {}", o.ep) : "")
                                    : fmt::format("one {:g} GiB GPU", o.gpu_mem_gib);
  const std::string running = o.max_running_requests > 0 ? std::to_string(o.max_running_requests) : "the plan's";
  std::printf("\nkiln serve on %s (--max-running-requests %s, prefix cache %s, --chunked-prefill-size %lld (%s), "
              "--max-pass-tokens %lld):\n",
              gpus.c_str(), running.c_str(), o.disable_radix_cache ? "off" : "on",
              static_cast<long long>(in.prefill.step_tokens), in.prefill.reason.c_str(),
              static_cast<long long>(in.prefill.pass_tokens));
  if (in.serve_plan) line("  ", in.serve_plan->str());
  else line("  ", "does not fit: " + in.serve_error);
}

int run_inspect(const InspectOptions& o) {
  ModelDir dir = ModelDir::open_or_embedded(o.model_path);
  Inspection in{o, dir, {}, {}, {}, {}, {}, {}, {}, {}, {}, {}, {}};
  // The router note below says what the weight map would log (once per process) while planning: keep the log
  // quiet meanwhile so the note is printed once.
  const LogLevel saved_level = log_level();
  if (saved_level == LogLevel::info) set_log_level(LogLevel::warn);
  in.cfg = load_model_config(dir);
  in.quant = load_quant_config(dir);
  in.copt.tp = o.tp;
  in.copt.ep = o.ep;
  in.copt.gpu_mem_gib = o.gpu_mem_gib;
  in.copt.mem_fraction_static = o.mem_fraction_static;
  in.copt.activation_reserve_gib = o.activation_reserve_gib;
  in.copt.kv_dtype = inspect_kv_dtype(o.kv_cache_dtype);
  // The recurrent state as kiln serve keeps it on CUDA by default (--mamba-ssm-dtype auto).
  in.copt.recurrent_state_bytes =
      backend::resolve_mamba_ssm_dtype("cuda", backend::kCudaAutoDtype, "auto") == "bfloat16" ? 2 : 4;
  if (has_weights(dir)) {
    in.ckpt = std::make_unique<Checkpoint>(Checkpoint::open(dir));
    in.report = verify_checkpoint(*in.ckpt, in.cfg, in.quant);
  }
  in.tensors = expected_tensors(in.cfg, in.quant);
  in.p = plan_capacity(in.cfg, in.tensors, in.copt, in.ckpt.get());
  set_log_level(saved_level);
  in.notes = inspect_notes(in);
  plan_serve(in);
  if (o.json) {
    print_json(in);
    return 0;
  }
  print_model_text(in);
  print_plan_text(in);
  return 0;
}

kiln::cli::Registrar reg{"inspect", "Describe a model and plan GPU memory (weights, KV cache, state)", [](CLI::App& app) {
  auto o = std::make_shared<InspectOptions>();
  app.add_option("--model-path", o->model_path, "Model folder (default: the embedded model, if built in)");
  app.add_option("--tp-size,--tp", o->tp, "GPUs to split the model over (tensor parallel; the plan kiln serve --tp-size "
                 "loads by)")->check(CLI::Range(1, 1024));
  app.add_option("--ep-size,--ep", o->ep, "Expert-parallel groups among them (divides --tp-size): whole routed experts "
                 "per group")->check(CLI::Range(1, 1024));
  app.add_option("--gpu-mem-gib", o->gpu_mem_gib, "Memory per GPU in GiB (enables the KV-token budget)")
      ->check(CLI::Range(0.0, 1e6));
  app.add_option("--kv-cache-dtype", o->kv_cache_dtype, "bf16 or fp8_e4m3");
  app.add_option("--mem-fraction-static", o->mem_fraction_static, "Share of GPU memory for weights + KV cache")
      ->check(CLI::Range(0.01, 1.0));
  app.add_option("--activation-reserve-gib", o->activation_reserve_gib, "Per-GPU reserve for activations")
      ->check(CLI::Range(0.0, 1e6));
  app.add_flag("--json", o->json, "Machine-readable output");
  app.add_option("--max-running-requests", o->max_running_requests,
                 "For kiln serve's own plan (with --gpu-mem-gib): sequences decoded together (0: the plan's)")
      ->capture_default_str();
  app.add_flag("--disable-radix-cache", o->disable_radix_cache,
               "For kiln serve's own plan: without the prefix cache (one state slot per request instead of 3)");
  app.add_option("--context-length", o->context_length,
                 "For kiln serve's own plan: longest sequence (default: the model's)");
  app.add_option("--chunked-prefill-size", o->chunked_prefill_size,
                 "For kiln serve's own plan: tokens per engine step (auto: by --gpu-mem-gib, as serve picks); the "
                 "forward pass, which the activations are planned for, is never larger")
      ->capture_default_str();
  app.add_option("--max-pass-tokens", o->max_pass_tokens,
                 "For kiln serve's own plan: most tokens in one forward pass (activation memory is planned for one); "
                 "auto: the step budget")
      ->capture_default_str();
  app.add_option("--chunked-prefill-size-while-decoding", o->chunked_prefill_size_while_decoding,
                 "For kiln serve's own plan: tokens per engine step while any request decodes (auto: 2048 where "
                 "the step budget is larger)")
      ->capture_default_str();
  return [o]() -> int { return run_inspect(*o); };
}};

}  // namespace
