// The Qwen3.5 / Qwen3.5-MoE vision tower: pixel patches in, one embedding per merged 2 x 2 patch block out (the rows
// that replace the prompt's <|image_pad|> tokens). Written from transformers 5.17's Qwen3_5MoeVisionModel /
// Qwen3_5VisionModel (models/qwen3_5_moe, models/qwen3_5: Qwen3-VL's vision model without its deepstack mergers;
// Qwen3.5's vision config has no deepstack_visual_indexes and its model deletes them) and vision_utils.py.
//
// Sizes (config.vision, the 397B's in brackets): h = hidden_size [1152], heads [16], D = h / heads [72], I =
// intermediate_size [4304], m = spatial_merge_size [2], P = patch_size [16], Tp = temporal_patch_size [2], C =
// in_channels [3], side = sqrt(num_position_embeddings) [48], out = out_hidden_size [4096 = the text hidden size].
//
// Input (what the image processor produces, transformers' layout):
//  - grids: per image or video (t, gh, gw) in patches (grid_thw; an image has t = 1, its frame repeated Tp times);
//    gh and gw are multiples of m.
//  - pixel_values F32 [N, C * Tp * P * P], N = sum t * gh * gw: one row per patch, flattened in (c, tp, py, px)
//    order; rows per image in frame order, and within a frame in merge-block order: the patch at (row, col) sits at
//    index ((row / m) * (gw / m) + col / m) * m^2 + (row % m) * m + col % m. So every m^2 consecutive rows are one
//    output token's patches, in row-major order within the block.
//
// Steps (transformers names in brackets):
//  1. Patch embedding [patch_embed.proj, an nn.Conv3d with kernel = stride = (Tp, P, P), bias]: x = pixel_values
//     W^T + b with W the Conv3d weight [h, C, Tp, P, P] viewed as [h, C*Tp*P*P] (a linear over the flattened patch).
//  2. Learned position embedding [pos_embed, fast_pos_embed_interpolate / get_vision_interpolation_indices_and_
//     weights, bilinear, align_corners]: the table [side * side, h] is a side x side grid, resampled to each image's
//     gh x gw grid: for patch (row, col), sr = row * (side - 1) / max(gh - 1, 1), sc likewise with gw (fp32);
//     r0 = floor(sr), r1 = min(r0 + 1, side - 1), dr = sr - r0 (c0, c1, dc likewise);
//     pos = (1-dr)(1-dc) E[r0*side + c0] + (1-dr) dc E[r0*side + c1] + dr (1-dc) E[r1*side + c0] + dr dc E[r1*side + c1]
//     (the four terms summed in that order), the same for every frame, in the rows' merge-block order; x += pos.
//  3. Rotary embedding [rotary_pos_emb, Qwen3_5MoeVisionRotaryEmbedding "axial", get_vision_position_ids]: each
//     patch has a 2-D position (row, col) within its frame (merge-block order, as the rows). inv_freq[j] =
//     1 / theta^(2j / (D/2)), j < D/4, theta = rope_theta [10000]. The angle table per patch is D/2 wide:
//     [row * inv_freq (D/4) | col * inv_freq (D/4)], and rotate_half pairs dim i with i + D/2 over the whole head
//     (cos/sin = cat(table, table)). So dims [0, D/4) and [D/2, 3D/4) rotate with the row, dims [D/4, D/2) and
//     [3D/4, D) with the column. Applied to q and k (not v) of every block, in fp32.
//  4. depth blocks [blocks.i, Qwen3_5MoeVisionBlock], pre-norm, residual:
//       x = x + proj(attn(norm1(x)));  x = x + linear_fc2(act(linear_fc1(norm2(x))))
//     norm1 / norm2: nn.LayerNorm(h, eps 1e-6) with weight and bias. attn: qkv = x W_qkv^T + b [N, 3h], split as
//     reshape(N, 3, heads, D): rows of W_qkv are q (heads x D) | k | v. Rotary on q, k; softmax(q k^T / sqrt(D)) v,
//     bidirectional, each frame of each image attending only to itself (cu_seqlens: one segment of gh * gw patches
//     per frame); heads concatenated; proj (bias). MLP: linear_fc1 (bias) -> act = hidden_act ["gelu_pytorch_tanh",
//     the tanh approximation] -> linear_fc2 (bias).
//  5. Patch merger [merger, Qwen3_5MoeVisionPatchMerger, use_postshuffle_norm false]: LayerNorm over h (eps 1e-6,
//     weight and bias) per patch, then every m^2 consecutive rows concatenated into one row of m^2 * h [4608];
//     linear_fc1 [4608 -> 4608] (bias), nn.GELU() (the exact erf form, whatever hidden_act says), linear_fc2
//     [4608 -> out] (bias). Output [N / m^2, out], images in order (transformers splits it by t * gh * gw / m^2).
//
// Checkpoint tensors (format::expected_vision_tensors, under "model.visual."): patch_embed.proj.{weight [h, C, Tp,
// P, P], bias}, pos_embed.weight [side^2, h], blocks.{i}.{norm1, norm2}.{weight, bias}, blocks.{i}.attn.qkv.{weight
// [3h, h], bias}, blocks.{i}.attn.proj.{weight, bias}, blocks.{i}.mlp.linear_fc1.{weight [I, h], bias},
// blocks.{i}.mlp.linear_fc2.{weight [h, I], bias}, merger.norm.{weight, bias} [h], merger.linear_fc1.{weight, bias},
// merger.linear_fc2.{weight [out, m^2 h], bias}. BF16 in the releases (F16 / F32 accepted), read as stored.
//
// Numerics: every op runs in fp32 on the CPU backend (the reference). transformers in bf16 additionally rounds the
// pixels to bf16 before the Conv3d and every activation to bf16; the fixtures (tools/reference/
// make_vision_fixtures.py) compare against transformers in fp32 on the stored bf16 weights.
//
// The host computes what depends only on the grids (plan_vision: segment bounds, the rotary cos / sin tables, the
// position-embedding rows and weights) and uploads it; the ops do the rest (model::Ops: linear, layer_norm, gelu,
// rope_cos_sin, attention_segments, weighted_embedding, add, copy).
#pragma once
#include <cstdint>
#include <functional>
#include <span>
#include <string_view>
#include <vector>

#include "core/tensor.h"
#include "format/model_config.h"
#include "format/safetensors.h"
#include "model/ops.h"

namespace kiln::model {

// One image's (or video's) patch grid: frames x rows x columns of patches (transformers' grid_thw).
struct ImageGrid {
  int64_t t = 1;
  int64_t h = 0;
  int64_t w = 0;
  int64_t patches() const { return t * h * w; }
};

struct VisionBlockWeights {
  TensorView norm1_weight, norm1_bias;  // [h]
  LinearWeight qkv;                     // [3h, h] + bias, rows q | k | v
  LinearWeight proj;                    // [h, h] + bias
  TensorView norm2_weight, norm2_bias;  // [h]
  LinearWeight fc1;                     // [I, h] + bias
  LinearWeight fc2;                     // [h, I] + bias
};

struct VisionWeights {
  LinearWeight patch_embed;  // [h, C*Tp*P*P] + bias (the Conv3d weight viewed 2-D)
  TensorView pos_embed;      // [side^2, h]
  std::vector<VisionBlockWeights> blocks;
  TensorView merger_norm_weight, merger_norm_bias;  // [h]
  LinearWeight merger_fc1;                          // [m^2 h, m^2 h] + bias
  LinearWeight merger_fc2;                          // [out, m^2 h] + bias
};

// The vision tower's weights from the checkpoint, placed on the backend (Ops::place_weight; Ops::finish_weights is
// called before returning). kiln::Error when config.json has no usable vision_config or the checkpoint's tower does
// not match it (every mismatch listed: format::verify_vision_tensors).
VisionWeights load_vision_weights(const format::Checkpoint& ckpt, const format::ModelConfig& config, Ops& ops);

// The host-side inputs of one forward, from the grids alone (N patches, S = sum t segments).
struct VisionPlan {
  int64_t num_patches = 0;            // N
  int64_t num_tokens = 0;             // N / m^2
  std::vector<int32_t> cu_seqlens;    // [S + 1] frame bounds
  int64_t max_seqlen = 0;             // the largest frame, patches
  std::vector<float> rope_cos;        // [N, D/2]
  std::vector<float> rope_sin;        // [N, D/2]
  std::vector<int32_t> pos_rows;      // [N, 4] rows of pos_embed
  std::vector<float> pos_weights;     // [N, 4] their bilinear weights
};
// kiln::Error for a grid the tower cannot take (a size < 1, rows or columns not a multiple of m).
VisionPlan plan_vision(const format::VisionConfig& config, std::span<const ImageGrid> grids);

// Called with intermediate results (F32, valid during the call): "embed" [N, h] (patch + position embedding),
// "block.{i}" [N, h] (after block i), "merged" [N / m^2, out] (the output).
using VisionTap = std::function<void(std::string_view name, const TensorView& value)>;

// The tower over every image of `grids` at once: pixel_values F32 [N, C*Tp*P*P] contiguous on the backend (layout
// above). Returns F32 [N / m^2, out_hidden_size] in the backend's scratch (valid until Ops::reset_scratch). kiln::Error
// when pixel_values do not match the grids.
TensorView vision_forward(Ops& ops, const VisionWeights& weights, const format::VisionConfig& config,
                          const TensorView& pixel_values, std::span<const ImageGrid> grids, const VisionTap& tap = {});

}  // namespace kiln::model
