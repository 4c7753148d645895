#include "format/quantize_checkpoint.h"

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

#include "core/dtype.h"
#include "core/error.h"
#include "core/thread_pool.h"
#include "format/model_dir.h"
#include "format/nvfp4_quant.h"
#include "format/quant_config.h"
#include "format/safetensors.h"

namespace kiln::format {
namespace {

namespace fs = std::filesystem;
using nlohmann::ordered_json;

bool ends_with(std::string_view s, std::string_view suffix) {
  return s.size() >= suffix.size() && s.substr(s.size() - suffix.size()) == suffix;
}
bool starts_with(std::string_view s, std::string_view prefix) { return s.substr(0, prefix.size()) == prefix; }

// One linear to quantise: rows [row_begin, row_begin + n) of expert `expert` (or of the 2-D tensor when
// expert < 0) of the source tensor. The quantised bytes are computed on first use and dropped once both
// the weight and its scales have been written, so memory stays at about one linear at a time.
struct LinearJob {
  std::string module;  // output module name ("...mlp.experts.3.gate_proj")
  const TensorInfo* src = nullptr;
  int64_t expert = -1;
  int64_t row_begin = 0;
  int64_t n = 0, k = 0;
  float input_scale = 1.0f;

  bool have_scale2 = false;
  float weight_scale_2 = 0.0f;
  std::vector<uint8_t> packed, scales;
  bool quantized = false;
  int pending_reads = 2;  // weight + weight_scale

  std::vector<float> load() const {
    const int64_t rows_per_expert = expert < 0 ? src->shape[0] : src->shape[1];
    const int64_t first = ((expert < 0 ? 0 : expert) * rows_per_expert + row_begin) * k;
    const size_t es = dtype_size(src->dtype);
    std::vector<float> out(static_cast<size_t>(n * k));
    const uint8_t* p = src->data + static_cast<size_t>(first) * es;
    if (src->dtype == DType::BF16) {
      for (size_t i = 0; i < out.size(); ++i) {
        uint16_t v;
        std::memcpy(&v, p + 2 * i, 2);
        out[i] = bf16_to_f32(v);
      }
    } else {
      for (size_t i = 0; i < out.size(); ++i) out[i] = load_as_f32(src->dtype, p + es * i);
    }
    return out;
  }
  uint64_t source_bytes() const { return static_cast<uint64_t>(n * k) * dtype_size(src->dtype); }
};

struct Progress {
  int64_t done = 0, total = 0;
  uint64_t bytes_done = 0, bytes_total = 0;
  const std::function<void(const QuantizeProgress&)>* callback = nullptr;
};

void ensure_scale2(LinearJob& job) {
  if (job.have_scale2) return;
  std::vector<float> w = job.load();
  job.weight_scale_2 = nvfp4::global_scale(nvfp4::abs_max(w, job.module.c_str()));
  job.have_scale2 = true;
}

void ensure_quantized(LinearJob& job, Progress& progress) {
  if (job.quantized) return;
  std::vector<float> w = job.load();
  if (!job.have_scale2) {
    job.weight_scale_2 = nvfp4::global_scale(nvfp4::abs_max(w, job.module.c_str()));
    job.have_scale2 = true;
  }
  job.packed.assign(static_cast<size_t>(job.n * job.k / 2), 0);
  job.scales.assign(static_cast<size_t>(job.n * job.k / nvfp4::kGroupSize), 0);
  ThreadPool::global().parallel_for(
      job.n,
      [&](int64_t b, int64_t e) {
        nvfp4::quantize_rows(w, job.n, job.k, job.weight_scale_2, b, e, job.packed.data(), job.scales.data());
      },
      16);
  job.quantized = true;
  progress.done += 1;
  progress.bytes_done += job.source_bytes();
  if (progress.callback && *progress.callback)
    (*progress.callback)({progress.done, progress.total, progress.bytes_done, progress.bytes_total, job.module});
}

void release_if_done(LinearJob& job) {
  if (--job.pending_reads == 0) {
    std::vector<uint8_t>().swap(job.packed);
    std::vector<uint8_t>().swap(job.scales);
  }
}

bool is_float_weight(DType t) { return t == DType::BF16 || t == DType::F16 || t == DType::F32; }

// "<L>mlp.experts.<e>.<proj>.weight" -> (experts prefix "<L>mlp.experts", e, proj); false otherwise.
bool parse_per_expert(const std::string& name, std::string* experts, int64_t* e, std::string* proj) {
  static const std::string kMark = ".mlp.experts.";
  const size_t at = name.find(kMark);
  if (at == std::string::npos || !ends_with(name, ".weight")) return false;
  const size_t digits = at + kMark.size();
  size_t dot = name.find('.', digits);
  if (dot == std::string::npos || dot == digits) return false;
  for (size_t i = digits; i < dot; ++i)
    if (name[i] < '0' || name[i] > '9') return false;
  const std::string rest = name.substr(dot + 1);
  for (const char* p : {"gate_proj", "up_proj", "down_proj"}) {
    if (rest == std::string(p) + ".weight") {
      *experts = name.substr(0, at + kMark.size() - 1);
      *e = std::stoll(name.substr(digits, dot - digits));
      *proj = p;
      return true;
    }
  }
  return false;
}

bool is_router(std::string_view module) { return ends_with(module, ".mlp.gate") || ends_with(module, "shared_expert_gate"); }
bool is_side_model(std::string_view name) { return starts_with(name, "model.visual.") || starts_with(name, "mtp."); }

// The input_scale of a module, from calibration: its own amax, else the largest amax of the same
// projection among the same layer's experts ("<L>mlp.experts.*.<proj>"), else the default.
float pick_input_scale(const std::string& module, const QuantizeOptions& opt, QuantizeSummary& summary) {
  auto it = opt.input_amax.find(module);
  if (it != opt.input_amax.end() && it->second > 0.0f) {
    summary.calibrated += 1;
    return nvfp4::global_scale(it->second);
  }
  std::string experts, proj;
  int64_t e = 0;
  if (parse_per_expert(module + ".weight", &experts, &e, &proj)) {
    float best = 0.0f;
    const std::string prefix = experts + ".";
    for (auto i = opt.input_amax.lower_bound(prefix); i != opt.input_amax.end() && starts_with(i->first, prefix); ++i)
      if (ends_with(i->first, "." + proj)) best = std::max(best, i->second);
    if (best > 0.0f) {
      summary.calibrated_from_layer += 1;
      return nvfp4::global_scale(best);
    }
  }
  summary.uncalibrated += 1;
  return opt.default_input_scale;
}

bool excluded(const std::string& module, const QuantizeOptions& opt) {
  for (const auto& g : opt.exclude)
    if (glob_match(g, module)) return true;
  return false;
}

void write_text(const fs::path& path, const std::string& text) {
  std::ofstream f(path, std::ios::binary);
  f << text;
  if (!f) fail("cannot write '{}'", path.string());
}

}  // namespace

std::map<std::string, float> load_calibration_amax(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) fail("cannot read calibration file '{}'", path);
  std::stringstream ss;
  ss << f.rdbuf();
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(ss.str());
  } catch (const std::exception& e) {
    fail("calibration file '{}' is not valid JSON: {}", path, e.what());
  }
  if (!j.is_object() || !j.contains("amax") || !j["amax"].is_object())
    fail("calibration file '{}' has no \"amax\" object (expected {{\"amax\": {{\"<module>\": <float>}}}})", path);
  std::map<std::string, float> out;
  for (const auto& [k, v] : j["amax"].items()) {
    if (!v.is_number() || !(v.get<double>() >= 0.0))
      fail("calibration file '{}': amax of '{}' must be a non-negative number", path, k);
    out[k] = v.get<float>();
  }
  return out;
}

QuantizeSummary quantize_checkpoint_nvfp4(const std::string& in_dir, const std::string& out_dir,
                                          const QuantizeOptions& opt) {
  std::error_code ec;
  if (fs::exists(out_dir, ec) && fs::equivalent(in_dir, out_dir, ec))
    fail("kiln quantize: --output must differ from --model-path ('{}')", out_dir);
  ModelDir dir = ModelDir::open(in_dir);
  if (dir.has("hf_quant_config.json"))
    fail("'{}' is already quantised (it has hf_quant_config.json); kiln quantize needs a BF16 checkpoint", in_dir);
  if (fs::is_directory(out_dir, ec)) {
    for (const auto& entry : fs::directory_iterator(out_dir))
      if (entry.path().extension() == ".safetensors")
        fail("output folder '{}' already holds {}: remove it or choose another --output", out_dir,
             entry.path().filename().string());
  }
  Checkpoint ckpt = Checkpoint::open(dir);

  QuantizeSummary summary;
  std::vector<std::unique_ptr<LinearJob>> jobs;
  std::vector<const TensorInfo*> copied;
  std::set<std::string> kept_linears;  // exclude_modules
  std::set<std::string> side_globs;    // vision tower / MTP head: one glob each

  auto add_job = [&](const std::string& module, const TensorInfo* src, int64_t expert, int64_t row_begin,
                     int64_t n, int64_t k) {
    auto job = std::make_unique<LinearJob>();
    job->module = module;
    job->src = src;
    job->expert = expert;
    job->row_begin = row_begin;
    job->n = n;
    job->k = k;
    job->input_scale = pick_input_scale(module, opt, summary);
    jobs.push_back(std::move(job));
  };

  for (const auto& [name, info] : ckpt.tensors()) {
    const TensorInfo* t = &info;
    summary.bytes_in += t->nbytes;
    if (t->dtype == DType::U8 || t->dtype == DType::F8_E4M3)
      fail("'{}' holds quantised tensors ('{}' is {}); kiln quantize needs a BF16 checkpoint", in_dir, name,
           dtype_name(t->dtype));
    if (is_side_model(name)) {
      if (t->shape.ndim == 2 && ends_with(name, ".weight"))
        side_globs.insert(starts_with(name, "mtp.") ? "mtp*" : "model.visual*");
      copied.push_back(t);
      continue;
    }
    // Fused routed experts.
    const bool fused_gate_up = ends_with(name, ".mlp.experts.gate_up_proj");
    const bool fused_down = ends_with(name, ".mlp.experts.down_proj");
    if ((fused_gate_up || fused_down) && t->shape.ndim == 3) {
      if (!is_float_weight(t->dtype)) fail("'{}' is {}, expected BF16/F16/F32", name, dtype_name(t->dtype));
      const std::string experts = name.substr(0, name.rfind('.'));  // "<L>mlp.experts"
      const int64_t e_count = t->shape[0], rows = t->shape[1], k = t->shape[2];
      if (fused_gate_up && rows % 2 != 0) fail("'{}' {}: gate_up rows must be even", name, t->shape.str());
      const int64_t n = fused_gate_up ? rows / 2 : rows;
      struct Part {
        std::string module;
        int64_t expert, row0;
      };
      std::vector<Part> parts;
      for (int64_t e = 0; e < e_count; ++e) {
        const std::string base = experts + "." + std::to_string(e) + ".";
        if (fused_gate_up) {
          parts.push_back({base + "gate_proj", e, 0});
          parts.push_back({base + "up_proj", e, n});
        } else {
          parts.push_back({base + "down_proj", e, 0});
        }
      }
      const size_t n_excluded =
          std::count_if(parts.begin(), parts.end(), [&](const Part& p) { return excluded(p.module, opt); });
      if (k % nvfp4::kGroupSize != 0 || n_excluded == parts.size()) {
        // Kept whole, in its fused BF16 form.
        for (const Part& p : parts) kept_linears.insert(p.module);
        copied.push_back(t);
      } else if (n_excluded > 0) {
        fail("'{}': --exclude matches only some of the experts stored in this fused tensor; exclude all or none",
             name);
      } else {
        for (const Part& p : parts) add_job(p.module, t, p.expert, p.row0, n, k);
      }
      continue;
    }
    // Per-expert routed experts and other 2-D linears.
    if (t->shape.ndim == 2 && ends_with(name, ".weight")) {
      const std::string module = name.substr(0, name.size() - std::string(".weight").size());
      if (module.find("embed_tokens") != std::string::npos) {
        copied.push_back(t);
        continue;
      }
      std::string experts, proj;
      int64_t e = 0;
      const bool routed = parse_per_expert(name, &experts, &e, &proj);
      const bool wanted = routed || (opt.scope == QuantizeScope::all_linears && !is_router(module) &&
                                     module != "lm_head" && !ends_with(module, ".lm_head"));
      if (wanted && !excluded(module, opt) && t->shape[1] % nvfp4::kGroupSize == 0) {
        if (!is_float_weight(t->dtype)) fail("'{}' is {}, expected BF16/F16/F32", name, dtype_name(t->dtype));
        add_job(module, t, -1, 0, t->shape[0], t->shape[1]);
      } else {
        kept_linears.insert(module);
        copied.push_back(t);
      }
      continue;
    }
    copied.push_back(t);
  }
  if (jobs.empty()) fail("'{}': found no routed-expert weights to quantise (is this a MoE checkpoint?)", in_dir);

  // Output tensors.
  Progress progress;
  progress.total = static_cast<int64_t>(jobs.size());
  progress.callback = &opt.on_progress;
  for (const auto& j : jobs) progress.bytes_total += j->source_bytes();

  SafetensorsWriter writer;
  writer.set_metadata("format", "pt");
  for (const TensorInfo* t : copied) writer.add_view(t->name, t->dtype, t->shape, t->bytes());
  for (auto& jp : jobs) {
    LinearJob* job = jp.get();
    writer.add_generated(job->module + ".weight", DType::U8, Shape{job->n, job->k / 2}, [job, &progress](std::span<uint8_t> out) {
      ensure_quantized(*job, progress);
      std::memcpy(out.data(), job->packed.data(), out.size());
      release_if_done(*job);
    });
    writer.add_generated(job->module + ".weight_scale", DType::F8_E4M3, Shape{job->n, job->k / nvfp4::kGroupSize},
                         [job, &progress](std::span<uint8_t> out) {
                           ensure_quantized(*job, progress);
                           std::memcpy(out.data(), job->scales.data(), out.size());
                           release_if_done(*job);
                         });
    writer.add_generated(job->module + ".weight_scale_2", DType::F32, Shape{}, [job](std::span<uint8_t> out) {
      ensure_scale2(*job);
      std::memcpy(out.data(), &job->weight_scale_2, 4);
    });
    writer.add_generated(job->module + ".input_scale", DType::F32, Shape{},
                         [job](std::span<uint8_t> out) { std::memcpy(out.data(), &job->input_scale, 4); });
  }
  fs::create_directories(out_dir, ec);
  if (!fs::is_directory(out_dir)) fail("cannot create output folder '{}'", out_dir);
  summary.files_written = writer.write_sharded(out_dir, opt.max_shard_bytes);
  summary.bytes_out = writer.total_bytes();
  summary.quantized_linears = static_cast<int64_t>(jobs.size());
  summary.copied_tensors = static_cast<int64_t>(copied.size());

  // hf_quant_config.json: every linear left unquantised is listed (routers included: loaders that trust
  // the list must keep them BF16), plus one glob per side model.
  summary.exclude_modules.assign(kept_linears.begin(), kept_linears.end());
  summary.exclude_modules.insert(summary.exclude_modules.end(), side_globs.begin(), side_globs.end());
  ordered_json q = ordered_json::object();
  q["producer"] = {{"name", "modelopt"}, {"version", "kiln-quantize"}};
  ordered_json quant = ordered_json::object();
  quant["quant_algo"] = "NVFP4";
  quant["kv_cache_quant_algo"] = nullptr;
  quant["group_size"] = nvfp4::kGroupSize;
  quant["exclude_modules"] = summary.exclude_modules;
  q["quantization"] = quant;
  write_text(fs::path(out_dir) / "hf_quant_config.json", q.dump(4) + "\n");
  summary.files_written.push_back("hf_quant_config.json");

  // The folder's other files (config, tokenizer, template, generation config, README, ...).
  for (const std::string& file : dir.files()) {
    if (ends_with(file, ".safetensors") || file == "model.safetensors.index.json" || file == "hf_quant_config.json")
      continue;
    std::span<const uint8_t> bytes = dir.map(file);
    write_text(fs::path(out_dir) / file, std::string(reinterpret_cast<const char*>(bytes.data()), bytes.size()));
    summary.files_written.push_back(file);
  }
  return summary;
}

}  // namespace kiln::format
