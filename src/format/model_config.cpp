#include "format/model_config.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <nlohmann/json.hpp>
#include <set>

#include "core/error.h"
#include "core/log.h"

namespace kiln::format {
namespace {

using json = nlohmann::json;

struct ArchInfo {
  Arch arch;
  const char* name;
  const char* text_name;  // model_type of the nested text config
};
constexpr ArchInfo kArchs[] = {
    {Arch::qwen3_5_moe, "qwen3_5_moe", "qwen3_5_moe_text"},
    {Arch::qwen3_5, "qwen3_5", "qwen3_5_text"},
    {Arch::qwen3_next, "qwen3_next", nullptr},
    {Arch::qwen3_moe, "qwen3_moe", nullptr},
    {Arch::qwen3, "qwen3", nullptr},
};

// The transformers class names of each family (config.json "architectures").
bool architecture_matches(Arch arch, const std::string& name) {
  switch (arch) {
    case Arch::qwen3_5_moe:
      return name == "Qwen3_5MoeForConditionalGeneration" || name == "Qwen3_5MoeForCausalLM";
    case Arch::qwen3_5: return name == "Qwen3_5ForConditionalGeneration" || name == "Qwen3_5ForCausalLM";
    case Arch::qwen3_next: return name == "Qwen3NextForCausalLM";
    case Arch::qwen3_moe: return name == "Qwen3MoeForCausalLM";
    case Arch::qwen3: return name == "Qwen3ForCausalLM";
  }
  return false;
}

std::string architectures_of(Arch arch) {
  switch (arch) {
    case Arch::qwen3_5_moe: return "Qwen3_5MoeForConditionalGeneration, Qwen3_5MoeForCausalLM";
    case Arch::qwen3_5: return "Qwen3_5ForConditionalGeneration, Qwen3_5ForCausalLM";
    case Arch::qwen3_next: return "Qwen3NextForCausalLM";
    case Arch::qwen3_moe: return "Qwen3MoeForCausalLM";
    case Arch::qwen3: return "Qwen3ForCausalLM";
  }
  return "";
}

std::string supported_list() {
  std::string s;
  for (const auto& a : kArchs) s += (s.empty() ? "" : ", ") + std::string(a.name);
  return s;
}

// Typed lookups that name the key and the file in errors. `obj` is the settings object (text_config or
// top level).
class Reader {
 public:
  Reader(const json& obj, const json& top, std::string source) : obj_(obj), top_(top), source_(std::move(source)) {}

  const json* find(const char* key) const {
    auto it = obj_.find(key);
    if (it != obj_.end() && !it->is_null()) return &*it;
    return nullptr;
  }
  // Looks in the settings object, then at top level (keys that VL configs keep outside text_config).
  const json* find_any(const char* key) const {
    if (const json* v = find(key)) return v;
    if (&obj_ != &top_) {
      auto it = top_.find(key);
      if (it != top_.end() && !it->is_null()) return &*it;
    }
    return nullptr;
  }
  int64_t integer(const char* key, int64_t def) const { return integer_of(find(key), key, def); }
  int64_t integer_of(const json* v, const char* key, int64_t def) const {
    if (!v) return def;
    if (v->is_number_integer() || v->is_number_unsigned()) return v->get<int64_t>();
    if (v->is_number_float() && std::floor(v->get<double>()) == v->get<double>()) return static_cast<int64_t>(v->get<double>());
    fail("{}: \"{}\" must be an integer, got {}", source_, key, v->dump());
  }
  double number(const json* v, const char* key, double def) const {
    if (!v) return def;
    if (v->is_number()) return v->get<double>();
    fail("{}: \"{}\" must be a number, got {}", source_, key, v->dump());
  }
  double number(const char* key, double def) const { return number(find(key), key, def); }
  bool boolean(const json* v, const char* key, bool def) const {
    if (!v) return def;
    if (v->is_boolean()) return v->get<bool>();
    fail("{}: \"{}\" must be true or false, got {}", source_, key, v->dump());
  }
  bool boolean(const char* key, bool def) const { return boolean(find(key), key, def); }
  std::string string(const json* v, const char* key) const {
    if (!v) return {};
    if (v->is_string()) return v->get<std::string>();
    fail("{}: \"{}\" must be a string, got {}", source_, key, v->dump());
  }
  std::vector<int64_t> int_list(const json* v, const char* key) const {
    std::vector<int64_t> out;
    if (!v) return out;
    if (!v->is_array()) fail("{}: \"{}\" must be a list of integers", source_, key);
    for (const auto& e : *v) out.push_back(integer_of(&e, key, 0));
    return out;
  }
  // An int or a list of ints (eos_token_id).
  std::vector<int64_t> int_or_list(const json* v, const char* key) const {
    if (!v) return {};
    if (v->is_array()) return int_list(v, key);
    return {integer_of(v, key, 0)};
  }
  const std::string& source() const { return source_; }

 private:
  const json& obj_;
  const json& top_;
  std::string source_;
};

json parse_json(std::string_view text, std::string_view source) {
  json j = json::parse(text.begin(), text.end(), nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) fail("{}: not valid JSON", source);
  if (!j.is_object()) fail("{}: expected a JSON object at top level", source);
  return j;
}

LayerType parse_layer_type(const std::string& s, const std::string& source, size_t i) {
  if (s == "linear_attention" || s == "linear") return LayerType::linear_attention;
  if (s == "full_attention" || s == "full" || s == "attention") return LayerType::full_attention;
  fail("{}: layer_types[{}] is '{}'; supported: linear_attention, full_attention", source, i, s);
}

}  // namespace

const char* arch_name(Arch a) {
  for (const auto& i : kArchs)
    if (i.arch == a) return i.name;
  return "?";
}

const char* layer_type_name(LayerType t) {
  return t == LayerType::linear_attention ? "linear_attention" : "full_attention";
}

bool ModelConfig::layer_is_moe(int layer) const {
  if (num_experts <= 0) return false;
  if (layer >= num_layers) layer -= num_layers;  // MTP layer k is built as decoder layer k (vLLM, SGLang)
  if (std::find(mlp_only_layers.begin(), mlp_only_layers.end(), layer) != mlp_only_layers.end()) return false;
  return decoder_sparse_step <= 1 || (layer + 1) % decoder_sparse_step == 0;
}

int VisionConfig::position_grid_side() const {
  if (num_position_embeddings <= 0) return 0;
  int64_t side = static_cast<int64_t>(std::llround(std::sqrt(static_cast<double>(num_position_embeddings))));
  return side * side == num_position_embeddings ? static_cast<int>(side) : 0;
}

int ModelConfig::num_full_attention_layers() const {
  return static_cast<int>(std::count(layer_types.begin(), layer_types.end(), LayerType::full_attention));
}
int ModelConfig::num_linear_attention_layers() const {
  return static_cast<int>(std::count(layer_types.begin(), layer_types.end(), LayerType::linear_attention));
}

int ModelConfig::rotary_dim() const {
  int d = static_cast<int>(head_dim * partial_rotary_factor);
  return d - d % 2;
}

std::string ModelConfig::layer_pattern() const {
  auto short_name = [](LayerType t) { return t == LayerType::linear_attention ? "linear" : "full"; };
  const int n = static_cast<int>(layer_types.size());
  for (int period = 1; period <= n; ++period) {
    if (n % period) continue;
    bool ok = true;
    for (int i = period; i < n && ok; ++i) ok = layer_types[i] == layer_types[i - period];
    if (!ok) continue;
    if (period == n && n > 8) break;  // no short period: list counts instead
    std::string s = std::to_string(n / period) + " x [";
    for (int i = 0; i < period; ++i) s += std::string(i ? ", " : "") + short_name(layer_types[i]);
    return s + "]";
  }
  return std::to_string(n) + " layers: " + std::to_string(num_linear_attention_layers()) + " linear, " +
         std::to_string(num_full_attention_layers()) + " full (irregular)";
}

namespace {

bool is_hybrid(Arch a) { return a == Arch::qwen3_5_moe || a == Arch::qwen3_5 || a == Arch::qwen3_next; }

// model_type (the family) and architectures[0] (a warning when it names another family).
void read_family(const json& top, const std::string& source, ModelConfig& c) {
  auto mt = top.find("model_type");
  if (mt == top.end() || !mt->is_string())
    fail("{}: no \"model_type\" (supported: {})", source, supported_list());
  c.model_type = mt->get<std::string>();
  bool found = false;
  for (const auto& a : kArchs)
    if (c.model_type == a.name || (a.text_name && c.model_type == a.text_name)) {
      c.arch = a.arch;
      found = true;
    }
  if (!found) fail("{}: unsupported model_type '{}' (supported: {})", source, c.model_type, supported_list());
  if (auto ar = top.find("architectures"); ar != top.end() && ar->is_array() && !ar->empty() && (*ar)[0].is_string())
    c.architecture = (*ar)[0].get<std::string>();
  if (!c.architecture.empty() && !architecture_matches(c.arch, c.architecture))
    c.warnings.push_back(fmt::format(
        "{}: architectures[0] is '{}' but model_type is '{}' (whose architectures are {}); kiln loads it as "
        "{} by model_type: check that the checkpoint really is that family",
        source, c.architecture, c.model_type, architectures_of(c.arch), c.model_type));
}

// Defaults: transformers configuration_<family>.py.
struct Defaults {
  int64_t vocab, hidden, inter, layers, heads, kv_heads, head_dim, max_pos;
  int64_t experts, topk, moe_inter, shared_inter;
  bool norm_topk;
};
Defaults defaults_of(Arch arch) {
  switch (arch) {
    case Arch::qwen3_5_moe: return {248320, 2048, 0, 40, 16, 2, 256, 32768, 256, 8, 512, 512, true};
    case Arch::qwen3_5: return {248320, 4096, 12288, 32, 16, 4, 256, 32768, 0, 0, 0, 0, true};
    case Arch::qwen3_next: return {151936, 2048, 5632, 48, 16, 2, 256, 32768, 512, 10, 512, 512, true};
    case Arch::qwen3_moe: return {151936, 2048, 6144, 24, 32, 4, 0, 32768, 128, 8, 768, 0, false};
    case Arch::qwen3: return {151936, 4096, 22016, 32, 32, 32, 128, 32768, 0, 0, 0, 0, false};
  }
  return {};
}

// Sizes of the attention, linear-attention and feed-forward blocks.
void read_sizes(const Reader& r, ModelConfig& c) {
  const Defaults d = defaults_of(c.arch);
  const bool hybrid = is_hybrid(c.arch);
  c.vocab_size = r.integer("vocab_size", d.vocab);
  c.hidden_size = r.integer("hidden_size", d.hidden);
  c.num_layers = static_cast<int>(r.integer("num_hidden_layers", d.layers));
  c.num_attention_heads = static_cast<int>(r.integer("num_attention_heads", d.heads));
  c.num_kv_heads = static_cast<int>(r.integer("num_key_value_heads", d.kv_heads));
  if (c.num_kv_heads == 0) c.num_kv_heads = c.num_attention_heads;  // qwen3: None means MHA
  // qwen3_moe has no head_dim default: hidden / heads.
  const int64_t head_dim_default = d.head_dim ? d.head_dim : (c.num_attention_heads ? c.hidden_size / c.num_attention_heads : 0);
  c.head_dim = static_cast<int>(r.integer("head_dim", head_dim_default));
  c.max_position_embeddings = r.integer("max_position_embeddings", d.max_pos);
  c.attention_bias = r.boolean("attention_bias", false);
  c.attn_output_gate = hybrid;  // the hybrids' q_proj always carries the output gate
  c.rms_norm_eps = r.number("rms_norm_eps", 1e-6);
  c.norm_zero_centred = hybrid;
  c.intermediate_size = r.integer("intermediate_size", d.inter);
  if (hybrid) {
    c.linear_num_key_heads = static_cast<int>(r.integer("linear_num_key_heads", 16));
    c.linear_num_value_heads = static_cast<int>(r.integer("linear_num_value_heads", 32));
    c.linear_key_head_dim = static_cast<int>(r.integer("linear_key_head_dim", 128));
    c.linear_value_head_dim = static_cast<int>(r.integer("linear_value_head_dim", 128));
    c.linear_conv_kernel = static_cast<int>(r.integer("linear_conv_kernel_dim", 4));
  }
  if (c.arch == Arch::qwen3_5_moe || c.arch == Arch::qwen3_next || c.arch == Arch::qwen3_moe) {
    // transformers 5.x writes qwen3_moe's expert count as num_local_experts; older configs use num_experts.
    c.num_experts = static_cast<int>(r.integer("num_experts", r.integer("num_local_experts", d.experts)));
    c.experts_per_tok = static_cast<int>(r.integer("num_experts_per_tok", d.topk));
    c.moe_intermediate_size = r.integer("moe_intermediate_size", d.moe_inter);
    if (c.arch != Arch::qwen3_moe) c.shared_expert_intermediate_size = r.integer("shared_expert_intermediate_size", d.shared_inter);
    // qwen3_5_moe always renormalises (its router has no switch); the others read norm_topk_prob.
    c.norm_topk_prob = c.arch == Arch::qwen3_5_moe ? true : r.boolean("norm_topk_prob", d.norm_topk);
    if (c.arch != Arch::qwen3_5_moe) {
      c.decoder_sparse_step = static_cast<int>(r.integer("decoder_sparse_step", 1));
      for (int64_t l : r.int_list(r.find("mlp_only_layers"), "mlp_only_layers")) c.mlp_only_layers.push_back(static_cast<int>(l));
    }
  }
}

// The MTP head (speculative decoding); only the hybrids ship one.
void read_mtp(const Reader& r, ModelConfig& c) {
  if (!is_hybrid(c.arch)) return;
  c.mtp_num_layers = static_cast<int>(r.integer("mtp_num_hidden_layers", r.integer("num_nextn_predict_layers", 0)));
  if (c.mtp_num_layers < 0 || c.mtp_num_layers > 16)
    fail("{}: mtp_num_hidden_layers {} is out of range", r.source(), c.mtp_num_layers);
}

void read_layer_types(const Reader& r, ModelConfig& c) {
  const std::string& source = r.source();
  const bool hybrid = is_hybrid(c.arch);
  if (const json* lt = r.find("layer_types"); lt && hybrid) {
    if (!lt->is_array()) fail("{}: \"layer_types\" must be a list", source);
    for (size_t i = 0; i < lt->size(); ++i) {
      if (!(*lt)[i].is_string()) fail("{}: layer_types[{}] must be a string", source, i);
      c.layer_types.push_back(parse_layer_type((*lt)[i].get<std::string>(), source, i));
    }
    if (static_cast<int>(c.layer_types.size()) != c.num_layers)
      fail("{}: layer_types has {} entries but num_hidden_layers is {}", source, c.layer_types.size(), c.num_layers);
  } else if (hybrid) {
    const int64_t interval = r.integer("full_attention_interval", 4);
    if (interval <= 0) fail("{}: full_attention_interval must be positive, got {}", source, interval);
    for (int i = 0; i < c.num_layers; ++i)
      c.layer_types.push_back((i + 1) % interval ? LayerType::linear_attention : LayerType::full_attention);
  } else {
    if (r.boolean("use_sliding_window", false))
      fail("{}: use_sliding_window is true: sliding-window attention is not supported", source);
    c.layer_types.assign(std::max(0, c.num_layers), LayerType::full_attention);
  }
}

// RoPE: rope_scaling (legacy) or rope_parameters, then top-level rope_theta / partial_rotary_factor.
void read_rope(const Reader& r, ModelConfig& c) {
  const std::string& source = r.source();
  const json* rp = r.find("rope_scaling");
  if (!rp) rp = r.find("rope_parameters");
  if (rp && !rp->is_object()) fail("{}: rope_parameters must be an object", source);
  static const json kEmpty = json::object();
  const json& rope = rp ? *rp : kEmpty;
  const Reader rr(rope, rope, source + " rope_parameters");
  const json* type = rr.find("rope_type");
  if (!type) type = rr.find("type");
  c.rope_type = type ? rr.string(type, "rope_type") : "default";
  c.rope_theta = rr.number(rr.find("rope_theta"), "rope_theta", r.number("rope_theta", 10000.0));
  const double prf_default = is_hybrid(c.arch) ? 0.25 : 1.0;
  c.partial_rotary_factor =
      rr.number(rr.find("partial_rotary_factor"), "partial_rotary_factor", r.number("partial_rotary_factor", prf_default));
  if (c.arch == Arch::qwen3_5_moe || c.arch == Arch::qwen3_5) {
    // transformers falls back to [11, 11, 10] and always interleaves the sections.
    auto sec = rr.int_list(rr.find("mrope_section"), "mrope_section");
    if (sec.empty()) sec = {11, 11, 10};
    for (int64_t s : sec) c.mrope_section.push_back(static_cast<int>(s));
    c.mrope_interleaved = rr.boolean("mrope_interleaved", true);
  }
  if (c.rope_type != "default" && c.rope_type != "mrope")
    fail("{}: rope type '{}' is not supported (supported: default)", source, c.rope_type);
}

// Special tokens: the union of every place that names them (settings, top level, generation_config.json).
void read_special_tokens(const Reader& r, const Reader& top, std::string_view generation_config_json,
                         ModelConfig& c) {
  std::set<int64_t> eos;
  for (int64_t v : r.int_or_list(r.find("eos_token_id"), "eos_token_id")) eos.insert(v);
  if (&r != &top)
    for (int64_t v : top.int_or_list(top.find("eos_token_id"), "eos_token_id")) eos.insert(v);
  if (const json* b = r.find_any("bos_token_id")) c.bos_token_id = r.integer_of(b, "bos_token_id", 0);
  if (const json* p = r.find_any("pad_token_id")) c.pad_token_id = r.integer_of(p, "pad_token_id", 0);
  if (!generation_config_json.empty()) {
    const json gen = parse_json(generation_config_json, "generation_config.json");
    const Reader g(gen, gen, "generation_config.json");
    for (int64_t v : g.int_or_list(g.find("eos_token_id"), "eos_token_id")) eos.insert(v);
    if (!c.bos_token_id)
      if (const json* b = g.find("bos_token_id")) c.bos_token_id = g.integer_of(b, "bos_token_id", 0);
    if (!c.pad_token_id)
      if (const json* p = g.find("pad_token_id")) c.pad_token_id = g.integer_of(p, "pad_token_id", 0);
  }
  c.eos_token_ids.assign(eos.begin(), eos.end());
}

// The vision tower (qwen3_5*): vision_config's keys (wrong JSON types are errors, like the text settings), the
// multimodal token ids at top level, then whether the tower can run (a problem turns images off with a warning; it
// never stops the text model).
void read_vision(const json& top, const std::string& source, ModelConfig& c) {
  if (c.arch != Arch::qwen3_5_moe && c.arch != Arch::qwen3_5) return;
  auto it = top.find("vision_config");
  if (it == top.end() || it->is_null()) return;
  if (!it->is_object()) fail("{}: \"vision_config\" must be an object, got {}", source, it->dump());
  const Reader r(*it, *it, source + " vision_config");
  VisionConfig& v = c.vision;
  const VisionConfig d;
  // patch_size / temporal_patch_size may be written as [n, n] (transformers accepts int | list).
  auto size_of = [&](const char* key, int def) {
    const json* e = r.find(key);
    if (e && e->is_array()) {
      const std::vector<int64_t> l = r.int_list(e, key);
      if (l.empty() || std::adjacent_find(l.begin(), l.end(), std::not_equal_to<>()) != l.end())
        fail("{} vision_config: \"{}\" {} must be one size (a square patch)", source, key, e->dump());
      return static_cast<int>(l.front());
    }
    return static_cast<int>(r.integer_of(e, key, def));
  };
  v.depth = static_cast<int>(r.integer("depth", d.depth));
  v.hidden_size = r.integer("hidden_size", d.hidden_size);
  v.intermediate_size = r.integer("intermediate_size", d.intermediate_size);
  v.num_heads = static_cast<int>(r.integer("num_heads", d.num_heads));
  if (const json* a = r.find("hidden_act")) v.hidden_act = r.string(a, "hidden_act");
  v.in_channels = static_cast<int>(r.integer("in_channels", d.in_channels));
  v.patch_size = size_of("patch_size", d.patch_size);
  v.temporal_patch_size = size_of("temporal_patch_size", d.temporal_patch_size);
  v.spatial_merge_size = static_cast<int>(r.integer("spatial_merge_size", d.spatial_merge_size));
  v.out_hidden_size = r.integer("out_hidden_size", d.out_hidden_size);
  v.num_position_embeddings = r.integer("num_position_embeddings", d.num_position_embeddings);
  std::string rope_type = "axial";
  if (const json* rp = r.find("rope_parameters")) {
    if (!rp->is_object()) fail("{} vision_config: rope_parameters must be an object", source);
    const Reader rr(*rp, *rp, source + " vision_config rope_parameters");
    if (const json* t = rr.find("rope_type")) rope_type = rr.string(t, "rope_type");
    v.rope_theta = rr.number(rr.find("rope_theta"), "rope_theta", r.number("rope_theta", d.rope_theta));
  } else {
    v.rope_theta = r.number("rope_theta", d.rope_theta);
  }
  const Reader t(top, top, source);
  c.image_token_id = t.integer("image_token_id", 248056);
  c.video_token_id = t.integer("video_token_id", 248057);
  c.vision_start_token_id = t.integer("vision_start_token_id", 248053);
  c.vision_end_token_id = t.integer("vision_end_token_id", 248054);

  std::string& problem = c.vision_problem;
  auto check = [&](bool ok, std::string why) {
    if (!ok && problem.empty()) problem = std::move(why);
  };
  auto in_range = [&](int64_t value, int64_t hi, const char* key) {
    check(value > 0 && value <= hi, fmt::format("\"{}\" is {} (expected 1 .. {})", key, value, hi));
  };
  in_range(v.depth, 1024, "depth");
  in_range(v.hidden_size, int64_t{1} << 16, "hidden_size");
  in_range(v.intermediate_size, int64_t{1} << 18, "intermediate_size");
  in_range(v.num_heads, 1024, "num_heads");
  in_range(v.in_channels, 16, "in_channels");
  in_range(v.patch_size, 1024, "patch_size");
  in_range(v.temporal_patch_size, 64, "temporal_patch_size");
  in_range(v.spatial_merge_size, 16, "spatial_merge_size");
  in_range(v.out_hidden_size, int64_t{1} << 20, "out_hidden_size");
  in_range(v.num_position_embeddings, int64_t{1} << 24, "num_position_embeddings");
  if (problem.empty()) {
    check(v.hidden_size % v.num_heads == 0,
          fmt::format("hidden_size {} is not a multiple of num_heads {}", v.hidden_size, v.num_heads));
    check(v.head_dim() % 4 == 0, fmt::format("the head size {} is not a multiple of 4 (the 2-D rotary embedding "
                                             "gives a quarter of each head's dims to each of rows and columns, "
                                             "sine and cosine halves)", v.head_dim()));
    check(v.position_grid_side() > 0,
          fmt::format("num_position_embeddings {} is not a square (the learned positions form a side x side grid)",
                      v.num_position_embeddings));
    check(v.hidden_act == "gelu_pytorch_tanh" || v.hidden_act == "gelu_new" || v.hidden_act == "gelu",
          fmt::format("hidden_act '{}' is not supported (supported: gelu_pytorch_tanh, gelu_new, gelu)", v.hidden_act));
    check(rope_type == "axial" || rope_type == "default",
          fmt::format("rope_parameters.rope_type '{}' is not supported (supported: axial)", rope_type));
    check(v.rope_theta > 0, fmt::format("rope_theta {} must be positive", v.rope_theta));
    check(v.out_hidden_size == c.hidden_size,
          fmt::format("out_hidden_size {} differs from the language model's hidden_size {}", v.out_hidden_size,
                      c.hidden_size));
  }
  c.has_vision = problem.empty();
  if (!c.has_vision)
    c.warnings.push_back(fmt::format("{} vision_config: {}; images are not supported with this checkpoint "
                                     "(text is unaffected)", source, problem));
}

// Sanity: everything later code divides by or allocates with.
void check_sizes(const ModelConfig& c, const std::string& source) {
  auto positive = [&](int64_t v, const char* key) {
    if (v <= 0) fail("{}: \"{}\" must be positive, got {}", source, key, v);
  };
  positive(c.hidden_size, "hidden_size");
  positive(c.num_layers, "num_hidden_layers");
  positive(c.vocab_size, "vocab_size");
  positive(c.num_attention_heads, "num_attention_heads");
  positive(c.num_kv_heads, "num_key_value_heads");
  positive(c.head_dim, "head_dim");
  if (c.num_layers > 100000 || c.hidden_size > (1 << 20) || c.vocab_size > (1 << 24))
    fail("{}: implausible sizes (hidden_size {}, num_hidden_layers {}, vocab_size {})", source, c.hidden_size,
         c.num_layers, c.vocab_size);
  if (c.num_attention_heads % c.num_kv_heads)
    fail("{}: num_attention_heads {} is not a multiple of num_key_value_heads {}", source, c.num_attention_heads,
         c.num_kv_heads);
  if (c.partial_rotary_factor <= 0 || c.partial_rotary_factor > 1)
    fail("{}: partial_rotary_factor {} must be in (0, 1]", source, c.partial_rotary_factor);
  if (is_hybrid(c.arch)) {
    positive(c.linear_num_key_heads, "linear_num_key_heads");
    positive(c.linear_num_value_heads, "linear_num_value_heads");
    positive(c.linear_key_head_dim, "linear_key_head_dim");
    positive(c.linear_value_head_dim, "linear_value_head_dim");
    positive(c.linear_conv_kernel, "linear_conv_kernel_dim");
    if (c.linear_num_value_heads % c.linear_num_key_heads)
      fail("{}: linear_num_value_heads {} is not a multiple of linear_num_key_heads {}", source,
           c.linear_num_value_heads, c.linear_num_key_heads);
  }
  if (c.num_experts > 0) {
    positive(c.experts_per_tok, "num_experts_per_tok");
    positive(c.moe_intermediate_size, "moe_intermediate_size");
    if (c.experts_per_tok > c.num_experts)
      fail("{}: num_experts_per_tok {} exceeds num_experts {}", source, c.experts_per_tok, c.num_experts);
  }
  bool needs_dense = c.num_experts == 0;
  for (int l = 0; l < c.num_layers && !needs_dense; ++l) needs_dense = !c.layer_is_moe(l);
  if (needs_dense) positive(c.intermediate_size, "intermediate_size");
}

}  // namespace

ModelConfig parse_model_config(std::string_view config_json, std::string_view generation_config_json,
                               std::string_view source_view) {
  const std::string source(source_view);
  const json top = parse_json(config_json, source);
  ModelConfig c;
  read_family(top, source, c);
  // Settings live under text_config for the VL families; a text-only checkpoint has them at top level.
  const json* settings = &top;
  std::string settings_source = source;
  auto tc = top.find("text_config");
  if ((c.arch == Arch::qwen3_5_moe || c.arch == Arch::qwen3_5) && tc != top.end() && !tc->is_null()) {
    if (!tc->is_object()) fail("{}: \"text_config\" must be an object", source);
    settings = &*tc;
    settings_source = source + " text_config";
  }
  const Reader r(*settings, top, settings_source);
  const Reader top_reader(top, top, source);
  read_sizes(r, c);
  read_mtp(r, c);
  read_layer_types(r, c);
  read_rope(r, c);
  // Embedding tying is a top-level setting in the VL configs.
  c.tie_word_embeddings = r.boolean(r.find_any("tie_word_embeddings"), "tie_word_embeddings", false);
  if (auto it = top.find("tie_word_embeddings"); it != top.end() && it->is_boolean()) c.tie_word_embeddings = it->get<bool>();
  read_special_tokens(r, settings != &top ? top_reader : r, generation_config_json, c);
  // torch_dtype (transformers >= 5 writes "dtype").
  for (const char* key : {"torch_dtype", "dtype"})
    if (c.torch_dtype.empty())
      if (const json* v = r.find_any(key); v && v->is_string()) c.torch_dtype = v->get<std::string>();
  c.tensor_prefix = c.architecture.find("ForConditionalGeneration") != std::string::npos ? "model.language_model." : "model.";
  c.expert_layout = c.arch == Arch::qwen3_5_moe ? ExpertLayout::fused : ExpertLayout::per_expert;
  c.mtp_expert_layout = c.expert_layout;
  check_sizes(c, settings_source);
  read_vision(top, source, c);
  return c;
}

ModelConfig load_model_config(const ModelDir& dir) {
  const std::string source = dir.display_path() + "/config.json";
  std::string gen;
  if (dir.has("generation_config.json")) gen = dir.read_text("generation_config.json");
  if (!dir.has("config.json")) fail("{}: no config.json", dir.display_path());
  ModelConfig c = parse_model_config(dir.read_text("config.json"), gen, source);
  for (const auto& w : c.warnings) KILN_LOG_WARN("{}", w);
  return c;
}

}  // namespace kiln::format
