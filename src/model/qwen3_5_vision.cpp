// The Qwen3.5 vision tower (the maths and layouts are in the header).
#include "model/qwen3_5_vision.h"

#include <algorithm>
#include <cmath>
#include <string>

#include "core/error.h"
#include "format/weight_map.h"

namespace kiln::model {
namespace {

GeluKind gelu_of(const std::string& hidden_act) {
  if (hidden_act == "gelu") return GeluKind::erf;
  if (hidden_act == "gelu_pytorch_tanh" || hidden_act == "gelu_new") return GeluKind::tanh;
  fail("vision_config hidden_act '{}' is not supported (supported: gelu_pytorch_tanh, gelu_new, gelu)", hidden_act);
}

// Columns [first, first + heads * D) of a contiguous [N, W] matrix, viewed [N, heads, D] (row stride W).
TensorView column_heads(const TensorView& m, int64_t first, int64_t heads, int64_t D) {
  TensorView v;
  v.data = static_cast<char*>(m.data) + first * static_cast<int64_t>(dtype_size(m.dtype));
  v.dtype = m.dtype;
  v.shape = Shape{m.dim(0), heads, D};
  v.strides[0] = m.dim(1);
  v.strides[1] = D;
  v.strides[2] = 1;
  return v;
}

}  // namespace

VisionWeights load_vision_weights(const format::Checkpoint& ckpt, const format::ModelConfig& config, Ops& ops) {
  const std::string prefix = format::verify_vision_tensors(ckpt, config);
  if (ckpt.is_synthetic())
    fail("{}: the vision tower has no weights with --load-format dummy", ckpt.dir().display_path());
  const format::VisionConfig& v = config.vision;
  auto tensor = [&](const std::string& name, Shape shape) {
    const format::TensorInfo& t = ckpt.get(prefix + name);
    KILN_CHECK(t.shape.numel() == shape.numel(), "{}: {} viewed as {}", t.name, t.shape.str(), shape.str());
    return ops.place_weight(TensorView(const_cast<uint8_t*>(t.data), t.dtype, shape));
  };
  auto linear = [&](const std::string& module, int64_t n_out, int64_t k_in) {
    LinearWeight w;
    w.format = WeightFormat::dense;
    w.out_features = n_out;
    w.in_features = k_in;
    w.weight = tensor(module + ".weight", Shape{n_out, k_in});
    w.bias = tensor(module + ".bias", Shape{n_out});
    return w;
  };
  const int64_t h = v.hidden_size, inter = v.intermediate_size, merged = v.merged_hidden();
  VisionWeights w;
  w.patch_embed = linear("patch_embed.proj", h, v.patch_dim());
  w.pos_embed = tensor("pos_embed.weight", Shape{v.num_position_embeddings, h});
  for (int i = 0; i < v.depth; ++i) {
    const std::string b = "blocks." + std::to_string(i) + ".";
    VisionBlockWeights bw;
    bw.norm1_weight = tensor(b + "norm1.weight", Shape{h});
    bw.norm1_bias = tensor(b + "norm1.bias", Shape{h});
    bw.qkv = linear(b + "attn.qkv", 3 * h, h);
    bw.proj = linear(b + "attn.proj", h, h);
    bw.norm2_weight = tensor(b + "norm2.weight", Shape{h});
    bw.norm2_bias = tensor(b + "norm2.bias", Shape{h});
    bw.fc1 = linear(b + "mlp.linear_fc1", inter, h);
    bw.fc2 = linear(b + "mlp.linear_fc2", h, inter);
    w.blocks.push_back(bw);
  }
  w.merger_norm_weight = tensor("merger.norm.weight", Shape{h});
  w.merger_norm_bias = tensor("merger.norm.bias", Shape{h});
  w.merger_fc1 = linear("merger.linear_fc1", merged, merged);
  w.merger_fc2 = linear("merger.linear_fc2", v.out_hidden_size, merged);
  ops.finish_weights();
  return w;
}

VisionPlan plan_vision(const format::VisionConfig& config, std::span<const ImageGrid> grids) {
  const int64_t m = config.spatial_merge_size, D = config.head_dim(), quarter = D / 4, half = D / 2;
  const int side = config.position_grid_side();
  KILN_CHECK(m > 0 && D % 4 == 0 && side > 0, "vision config: merge {} head dim {} position grid side {}", m, D, side);
  if (grids.empty()) fail("vision encoder: no images");
  VisionPlan p;
  for (size_t i = 0; i < grids.size(); ++i) {
    const ImageGrid& g = grids[i];
    if (g.t < 1 || g.h < 1 || g.w < 1 || g.h % m || g.w % m || g.h > (1 << 16) || g.w > (1 << 16) || g.t > (1 << 16))
      fail("vision encoder: image {} has a patch grid of {} x {} x {} (frames x rows x columns); rows and columns "
           "must be positive multiples of spatial_merge_size {}", i, g.t, g.h, g.w, m);
    p.num_patches += g.patches();
    p.max_seqlen = std::max(p.max_seqlen, g.h * g.w);
  }
  if (p.num_patches > (int64_t{1} << 30)) fail("vision encoder: {} patches in one call is too many", p.num_patches);
  p.num_tokens = p.num_patches / (m * m);

  // inv_freq as torch computes it in fp32: 1 / theta^(float(2j) / (D/2)).
  std::vector<float> inv_freq(quarter);
  for (int64_t j = 0; j < quarter; ++j)
    inv_freq[j] = 1.0f / std::pow(static_cast<float>(config.rope_theta),
                                  static_cast<float>(2 * j) / static_cast<float>(half));

  p.cu_seqlens.push_back(0);
  p.rope_cos.resize(p.num_patches * half);
  p.rope_sin.resize(p.num_patches * half);
  p.pos_rows.resize(p.num_patches * 4);
  p.pos_weights.resize(p.num_patches * 4);
  // One axis of the align-corners bilinear resampling: taps (lo, hi) and weights (1 - d, d) for `index` of `size`.
  struct Taps {
    int32_t lo, hi;
    float w_lo, w_hi;
  };
  auto taps = [&](int64_t index, int64_t size) {
    const float src = static_cast<float>(index) * static_cast<float>(side - 1) /
                      static_cast<float>(std::max<int64_t>(size - 1, 1));
    const float fl = std::floor(src);
    const float d = src - fl;
    const int32_t lo = std::clamp(static_cast<int32_t>(fl), 0, side - 1);
    return Taps{lo, std::min(lo + 1, side - 1), 1.0f - d, d};
  };
  int64_t n = 0;
  for (const ImageGrid& g : grids) {
    const int64_t blocks_w = g.w / m;
    for (int64_t f = 0; f < g.t; ++f) {
      p.cu_seqlens.push_back(static_cast<int32_t>(p.cu_seqlens.back() + g.h * g.w));
      for (int64_t within = 0; within < g.h * g.w; ++within, ++n) {
        // merge-block order: (block row, block column, row in block, column in block)
        const int64_t in_col = within % m, in_row = (within / m) % m;
        const int64_t block = within / (m * m);
        const int64_t row = (block / blocks_w) * m + in_row, col = (block % blocks_w) * m + in_col;
        float* cs = &p.rope_cos[n * half];
        float* sn = &p.rope_sin[n * half];
        for (int64_t j = 0; j < quarter; ++j) {
          const float a_row = static_cast<float>(row) * inv_freq[j], a_col = static_cast<float>(col) * inv_freq[j];
          cs[j] = std::cos(a_row);
          sn[j] = std::sin(a_row);
          cs[quarter + j] = std::cos(a_col);
          sn[quarter + j] = std::sin(a_col);
        }
        const Taps r = taps(row, g.h), c = taps(col, g.w);
        int32_t* ids = &p.pos_rows[n * 4];
        float* wts = &p.pos_weights[n * 4];
        const int32_t rows[4] = {r.lo, r.lo, r.hi, r.hi}, cols[4] = {c.lo, c.hi, c.lo, c.hi};
        const float row_w[4] = {r.w_lo, r.w_lo, r.w_hi, r.w_hi}, col_w[4] = {c.w_lo, c.w_hi, c.w_lo, c.w_hi};
        for (int j = 0; j < 4; ++j) {
          ids[j] = rows[j] * side + cols[j];
          wts[j] = row_w[j] * col_w[j];
        }
      }
    }
  }
  return p;
}

TensorView vision_forward(Ops& ops, const VisionWeights& weights, const format::VisionConfig& config,
                          const TensorView& pixel_values, std::span<const ImageGrid> grids, const VisionTap& tap) {
  const VisionPlan plan = plan_vision(config, grids);
  const int64_t N = plan.num_patches, h = config.hidden_size, heads = config.num_heads, D = config.head_dim();
  const int64_t m2 = config.merge_unit(), inter = config.intermediate_size;
  if (pixel_values.dtype != DType::F32 || pixel_values.ndim() != 2 || !pixel_values.is_contiguous() ||
      pixel_values.dim(0) != N || pixel_values.dim(1) != config.patch_dim())
    fail("vision encoder: pixel_values are {} {} but the grids need F32 [{}, {}] (patches x C*T*P*P)",
         dtype_name(pixel_values.dtype), pixel_values.shape.str(), N, config.patch_dim());
  KILN_CHECK(static_cast<int64_t>(weights.blocks.size()) == config.depth, "{} vision blocks for depth {}",
             weights.blocks.size(), config.depth);
  const GeluKind act = gelu_of(config.hidden_act);

  const TensorView cu = ops.upload(plan.cu_seqlens.data(), DType::I32, Shape{static_cast<int64_t>(plan.cu_seqlens.size())});
  const TensorView cos = ops.upload(plan.rope_cos.data(), DType::F32, Shape{N, D / 2});
  const TensorView sin = ops.upload(plan.rope_sin.data(), DType::F32, Shape{N, D / 2});
  const TensorView pos_rows = ops.upload(plan.pos_rows.data(), DType::I32, Shape{N, 4});
  const TensorView pos_weights = ops.upload(plan.pos_weights.data(), DType::F32, Shape{N, 4});

  // 1-2. patch embedding + interpolated position embedding
  TensorView x = ops.scratch(DType::F32, Shape{N, h});
  TensorView y = ops.scratch(DType::F32, Shape{N, h});
  ops.linear(pixel_values, weights.patch_embed, x);
  ops.weighted_embedding(weights.pos_embed, pos_rows, pos_weights, y);
  ops.add(x, y, x);
  if (tap) tap("embed", x);

  // 3-4. blocks (buffers reused by every block)
  TensorView xn = ops.scratch(DType::F32, Shape{N, h});
  TensorView qkv = ops.scratch(DType::F32, Shape{N, 3 * h});
  TensorView q = ops.scratch(DType::F32, Shape{N, heads, D});
  TensorView k = ops.scratch(DType::F32, Shape{N, heads, D});
  TensorView v = ops.scratch(DType::F32, Shape{N, heads, D});
  TensorView attn = ops.scratch(DType::F32, Shape{N, heads, D});
  TensorView mlp = ops.scratch(DType::F32, Shape{N, inter});
  const float eps = static_cast<float>(config.layer_norm_eps);
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  for (size_t i = 0; i < weights.blocks.size(); ++i) {
    const VisionBlockWeights& b = weights.blocks[i];
    ops.layer_norm(x, b.norm1_weight, b.norm1_bias, eps, xn);
    ops.linear(xn, b.qkv, qkv);
    ops.copy(column_heads(qkv, 0, heads, D), q);
    ops.copy(column_heads(qkv, h, heads, D), k);
    ops.copy(column_heads(qkv, 2 * h, heads, D), v);
    ops.rope_cos_sin(q, cos, sin);
    ops.rope_cos_sin(k, cos, sin);
    ops.attention_segments(q, k, v, cu, plan.max_seqlen, scale, attn);
    ops.linear(reshaped(attn, Shape{N, h}), b.proj, y);
    ops.add(x, y, x);
    ops.layer_norm(x, b.norm2_weight, b.norm2_bias, eps, xn);
    ops.linear(xn, b.fc1, mlp);
    ops.gelu(mlp, act, mlp);
    ops.linear(mlp, b.fc2, y);
    ops.add(x, y, x);
    if (tap) tap("block." + std::to_string(i), x);
  }

  // 5. merger: LayerNorm per patch, m^2 consecutive patches -> one row, fc1, erf GELU, fc2
  const int64_t T = plan.num_tokens;
  ops.layer_norm(x, weights.merger_norm_weight, weights.merger_norm_bias, eps, xn);
  TensorView hidden = ops.scratch(DType::F32, Shape{T, m2 * h});
  ops.linear(reshaped(xn, Shape{T, m2 * h}), weights.merger_fc1, hidden);
  ops.gelu(hidden, GeluKind::erf, hidden);
  TensorView out = ops.scratch(DType::F32, Shape{T, config.out_hidden_size});
  ops.linear(hidden, weights.merger_fc2, out);
  if (tap) tap("merged", out);
  return out;
}

}  // namespace kiln::model
