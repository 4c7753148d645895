#include "format/quant_config.h"

#include <algorithm>
#include <cctype>
#include <nlohmann/json.hpp>

#include "core/error.h"

namespace kiln::format {
namespace {

using json = nlohmann::json;

std::string upper(std::string s) {
  for (char& ch : s) ch = static_cast<char>(std::toupper(static_cast<unsigned char>(ch)));
  return s;
}

json parse_object(std::string_view text, std::string_view source) {
  json j = json::parse(text.begin(), text.end(), nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) fail("{}: not valid JSON", source);
  if (!j.is_object()) fail("{}: expected a JSON object", source);
  return j;
}

QuantScheme scheme_of_algo(const std::string& algo, std::string_view source, std::string_view what) {
  const std::string a = upper(algo);
  if (a == "NVFP4") return QuantScheme::nvfp4;
  if (a == "FP8") return QuantScheme::fp8;
  fail("{}: {} quant_algo '{}' is not supported (supported: NVFP4, FP8, MIXED_PRECISION)", source, what, algo);
}

std::vector<std::string> string_list(const json& j, const char* key, std::string_view source) {
  std::vector<std::string> out;
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return out;
  if (!it->is_array()) fail("{}: \"{}\" must be a list of module-name globs", source, key);
  for (const auto& e : *it) {
    if (!e.is_string()) fail("{}: \"{}\" entries must be strings", source, key);
    out.push_back(e.get<std::string>());
  }
  return out;
}

// The fields shared by both spellings: quant_algo, group_size, kv cache algo, excludes, quantized_layers.
void read_common(const json& q, std::string_view source, QuantConfig* out) {
  auto algo = q.find("quant_algo");
  if (algo == q.end() || !algo->is_string()) fail("{}: missing \"quant_algo\"", source);
  out->quant_algo = upper(algo->get<std::string>());
  if (out->quant_algo != "MIXED_PRECISION") scheme_of_algo(out->quant_algo, source, "the");

  if (auto gs = q.find("group_size"); gs != q.end() && !gs->is_null()) {
    if (!gs->is_number_integer() || gs->get<int64_t>() <= 0) fail("{}: \"group_size\" must be a positive integer", source);
    out->group_size = gs->get<int>();
  }
  if (auto kv = q.find("kv_cache_quant_algo"); kv != q.end() && kv->is_string()) out->kv_cache_quant_algo = upper(kv->get<std::string>());
  // quantization_config spelling: kv_cache_scheme {"num_bits": 8, "type": "float"}.
  if (auto kv = q.find("kv_cache_scheme"); kv != q.end() && kv->is_object()) {
    auto bits = kv->find("num_bits");
    auto type = kv->find("type");
    if (bits != kv->end() && bits->is_number_integer() && bits->get<int>() == 8 &&
        (type == kv->end() || (type->is_string() && type->get<std::string>() == "float")))
      out->kv_cache_quant_algo = "FP8";
  }
  for (const char* key : {"exclude_modules", "ignore"})
    for (auto& p : string_list(q, key, source)) out->exclude_patterns.push_back(std::move(p));

  if (auto ql = q.find("quantized_layers"); ql != q.end() && !ql->is_null()) {
    if (!ql->is_object()) fail("{}: \"quantized_layers\" must be an object {{module: {{\"quant_algo\": ..}}}}", source);
    for (auto& [module, spec] : ql->items()) {
      std::string layer_algo;
      if (spec.is_string()) layer_algo = spec.get<std::string>();
      else if (spec.is_object() && spec.contains("quant_algo") && spec["quant_algo"].is_string())
        layer_algo = spec["quant_algo"].get<std::string>();
      else fail("{}: quantized_layers entry '{}' has no quant_algo", source, module);
      out->quantized_layers[module] = scheme_of_algo(layer_algo, source, "quantized_layers['" + module + "']");
      if (spec.is_object())
        if (auto gs = spec.find("group_size"); gs != spec.end() && gs->is_number_integer() && gs->get<int>() != out->group_size) {
          if (out->quantized_layers.size() == 1) out->group_size = gs->get<int>();
          else fail("{}: quantized_layers use different group sizes ({} and {}); only one is supported", source,
                    out->group_size, gs->get<int>());
        }
    }
  }
  if (out->quant_algo == "MIXED_PRECISION" && out->quantized_layers.empty())
    fail("{}: quant_algo MIXED_PRECISION needs a \"quantized_layers\" map", source);
  if (out->group_size != 16 && (out->quant_algo == "NVFP4" || out->quant_algo == "MIXED_PRECISION"))
    fail("{}: NVFP4 group_size {} is not supported (NVFP4 uses 16)", source, out->group_size);
}

}  // namespace

const char* quant_scheme_name(QuantScheme s) {
  switch (s) {
    case QuantScheme::none: return "none";
    case QuantScheme::nvfp4: return "nvfp4";
    case QuantScheme::fp8: return "fp8";
  }
  return "?";
}

bool glob_match(std::string_view pattern, std::string_view name) {
  // Iterative wildcard match with backtracking to the last '*' (linear space, no recursion).
  size_t p = 0, n = 0, star = std::string_view::npos, star_n = 0;
  while (n < name.size()) {
    if (p < pattern.size() && (pattern[p] == '?' || pattern[p] == name[n])) {
      ++p;
      ++n;
    } else if (p < pattern.size() && pattern[p] == '*') {
      star = p++;
      star_n = n;
    } else if (star != std::string_view::npos) {
      p = star + 1;
      n = ++star_n;
    } else {
      return false;
    }
  }
  while (p < pattern.size() && pattern[p] == '*') ++p;
  return p == pattern.size();
}

QuantScheme QuantConfig::scheme_for(const std::string& module_name) const {
  if (!is_quantized()) return QuantScheme::none;
  for (const auto& p : exclude_patterns)
    if (glob_match(p, module_name)) return QuantScheme::none;
  if (quant_algo == "MIXED_PRECISION") {
    auto it = quantized_layers.find(module_name);
    if (it != quantized_layers.end()) return it->second;
    for (const auto& [pattern, scheme] : quantized_layers)
      if (pattern.find_first_of("*?") != std::string::npos && glob_match(pattern, module_name)) return scheme;
    return QuantScheme::none;
  }
  return quant_algo == "FP8" ? QuantScheme::fp8 : QuantScheme::nvfp4;
}

bool QuantConfig::kv_cache_fp8() const { return kv_cache_quant_algo == "FP8"; }

QuantConfig parse_hf_quant_config(std::string_view json_text, std::string_view source) {
  const json top = parse_object(json_text, source);
  QuantConfig qc;
  qc.source = std::string(source);
  if (auto prod = top.find("producer"); prod != top.end() && prod->is_object()) {
    auto name = prod->find("name");
    if (name != prod->end() && name->is_string() && name->get<std::string>() != "modelopt")
      fail("{}: producer '{}' is not supported (kiln reads NVIDIA ModelOpt checkpoints)", source, name->get<std::string>());
  }
  auto q = top.find("quantization");
  if (q == top.end() || !q->is_object()) fail("{}: missing \"quantization\" object", source);
  read_common(*q, source, &qc);
  return qc;
}

QuantConfig parse_quantization_config(std::string_view json_text, std::string_view source) {
  const json q = parse_object(json_text, source);
  QuantConfig qc;
  qc.source = std::string(source);
  auto method = q.find("quant_method");
  const std::string m = method != q.end() && method->is_string() ? method->get<std::string>() : "";
  if (m != "modelopt")
    fail("{}: quant_method '{}' is not supported (kiln reads NVIDIA ModelOpt checkpoints: quant_method \"modelopt\")",
         source, m);
  read_common(q, source, &qc);
  return qc;
}

QuantConfig load_quant_config(const ModelDir& dir) {
  if (dir.has("hf_quant_config.json"))
    return parse_hf_quant_config(dir.read_text("hf_quant_config.json"), dir.display_path() + "/hf_quant_config.json");
  if (dir.has("config.json")) {
    const std::string text = dir.read_text("config.json");
    json cfg = json::parse(text, nullptr, false);
    if (!cfg.is_discarded() && cfg.is_object()) {
      const json* qc = nullptr;
      if (auto it = cfg.find("quantization_config"); it != cfg.end() && it->is_object()) qc = &*it;
      if (!qc)
        if (auto tc = cfg.find("text_config"); tc != cfg.end() && tc->is_object())
          if (auto it = tc->find("quantization_config"); it != tc->end() && it->is_object()) qc = &*it;
      if (qc && !qc->empty())
        return parse_quantization_config(qc->dump(), dir.display_path() + "/config.json quantization_config");
    }
  }
  return {};
}

}  // namespace kiln::format
