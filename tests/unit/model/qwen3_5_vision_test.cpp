// The Qwen3.5 vision tower (model/qwen3_5_vision.h) on the CPU backend:
//  - against transformers' own Qwen3_5MoeVisionModel on random weights (fixture qwen3_5_vision, and the image
//    embeddings of the multimodal fixture qwen3_5_moe_vl; both from tools/reference/make_vision_fixtures.py), and
//  - against a naive re-implementation written here from the maths (double precision, raster patch order, plain
//    loops; no helper of the code under test), on a 2-block tower with 3 images of different grids (one with two
//    frames), so that layout slips (merge-block order, rotary halves, the merger's concatenation, per-frame attention)
//    show before the GPU machine produces the transformers fixtures.
#include "model/qwen3_5_vision.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <random>

#include "backend/cpu/cpu_ops.h"
#include "core/error.h"
#include "fixture_util.h"
#include "format/model_config.h"
#include "format/model_dir.h"
#include "format/safetensors.h"

namespace kiln::model {
namespace {

using ::testing::HasSubstr;
using json = nlohmann::json;

// ---------------------------------------------------------------------------------------------------------------
// Comparison

struct Diff {
  double rel_l2 = 0;   // ||got - want|| / ||want||
  double max_abs = 0;  // max |got - want|
};
Diff compare(const float* got, const std::vector<double>& want) {
  double num = 0, den = 0, mx = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    const double e = got[i] - want[i];
    num += e * e;
    den += want[i] * want[i];
    mx = std::max(mx, std::fabs(e));
  }
  return {std::sqrt(num / std::max(den, 1e-300)), mx};
}

std::vector<float> download(Ops& ops, const TensorView& t) {
  std::vector<float> v(t.numel());
  ops.download(t, v.data());
  return v;
}

// ---------------------------------------------------------------------------------------------------------------
// The naive tower (double precision, written from the maths in the model header's terms, raster patch order)

// x rounded to 8 significant bits (a bfloat16 value), and its bfloat16 bits.
double round_to_bf16(double x) {
  if (x == 0) return 0;
  int e = 0;
  const double mant = std::frexp(x, &e);  // [0.5, 1)
  return std::ldexp(std::round(mant * 256.0) / 256.0, e);
}
uint16_t bf16_bits(double exact) {
  const float f = static_cast<float>(exact);
  uint32_t u = 0;
  std::memcpy(&u, &f, 4);
  EXPECT_EQ(u & 0xffffu, 0u);
  return static_cast<uint16_t>(u >> 16);
}

struct NaiveConfig {
  int C = 3, Tp = 2, P = 16, m = 2, hidden = 16, heads = 2, inter = 24, out = 64, side = 4, depth = 2;
  double theta = 10000.0;
  int patch_dim() const { return C * Tp * P * P; }
  int D() const { return hidden / heads; }
};

struct NaiveGrid {
  int t, h, w;
};

// Weights by checkpoint name (without "model.visual."), values exactly representable in BF16, with shapes.
struct NaiveWeights {
  std::map<std::string, std::vector<double>> values;
  std::map<std::string, std::vector<int64_t>> shapes;
  const std::vector<double>& operator[](const std::string& n) const { return values.at(n); }
};

NaiveWeights make_weights(const NaiveConfig& c, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<double> u(-1.0, 1.0);
  NaiveWeights w;
  auto add = [&](const std::string& name, std::vector<int64_t> shape, double scale, double offset) {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    std::vector<double> v(n);
    for (auto& x : v) x = round_to_bf16(offset + scale * u(rng));
    w.values[name] = v;
    w.shapes[name] = shape;
  };
  auto linear = [&](const std::string& name, int64_t n_out, int64_t k_in) {
    add(name + ".weight", {n_out, k_in}, std::sqrt(3.0 / k_in), 0.0);
    add(name + ".bias", {n_out}, 0.2, 0.0);
  };
  auto norm = [&](const std::string& name, int64_t n) {
    add(name + ".weight", {n}, 0.2, 1.0);
    add(name + ".bias", {n}, 0.2, 0.0);
  };
  const int h = c.hidden, M = c.hidden * c.m * c.m;
  add("patch_embed.proj.weight", {h, c.C, c.Tp, c.P, c.P}, std::sqrt(3.0 / c.patch_dim()), 0.0);
  add("patch_embed.proj.bias", {h}, 0.2, 0.0);
  add("pos_embed.weight", {int64_t{c.side} * c.side, h}, 1.0, 0.0);
  for (int i = 0; i < c.depth; ++i) {
    const std::string b = "blocks." + std::to_string(i) + ".";
    norm(b + "norm1", h);
    linear(b + "attn.qkv", 3 * h, h);
    linear(b + "attn.proj", h, h);
    norm(b + "norm2", h);
    linear(b + "mlp.linear_fc1", c.inter, h);
    linear(b + "mlp.linear_fc2", h, c.inter);
  }
  norm("merger.norm", h);
  linear("merger.linear_fc1", M, M);
  linear("merger.linear_fc2", c.out, M);
  return w;
}

std::vector<double> affine(const std::vector<double>& W, const std::vector<double>& b, const double* x, int n_out,
                           int k_in) {
  std::vector<double> y(n_out);
  for (int o = 0; o < n_out; ++o) {
    double s = b[o];
    for (int k = 0; k < k_in; ++k) s += W[static_cast<size_t>(o) * k_in + k] * x[k];
    y[o] = s;
  }
  return y;
}

std::vector<double> layer_norm_ref(const double* x, int n, const std::vector<double>& w, const std::vector<double>& b) {
  double mean = 0, var = 0;
  for (int i = 0; i < n; ++i) mean += x[i];
  mean /= n;
  for (int i = 0; i < n; ++i) var += (x[i] - mean) * (x[i] - mean);
  var /= n;
  std::vector<double> y(n);
  for (int i = 0; i < n; ++i) y[i] = (x[i] - mean) / std::sqrt(var + 1e-6) * w[i] + b[i];
  return y;
}

double gelu_tanh_ref(double x) {
  const double pi = 3.14159265358979323846;
  return 0.5 * x * (1 + std::tanh(std::sqrt(2 / pi) * (x + 0.044715 * x * x * x)));
}
double gelu_erf_ref(double x) { return 0.5 * x * (1 + std::erf(x / std::sqrt(2.0))); }

// One image's patches in raster order: pixels[(f, row, col)][patch_dim], random.
using Pixels = std::vector<std::vector<double>>;

struct NaiveResult {
  std::vector<std::vector<double>> embed;   // per image: [(f, row, col)][hidden], raster order
  std::vector<std::vector<double>> merged;  // per image: [(f, block row, block col)][out]
};

// Bilinear, align-corners resampling of the side x side position grid at patch (r, c) of an h x w grid.
std::vector<double> position_ref(const NaiveConfig& c, const NaiveWeights& W, int r, int col, int h, int w) {
  auto axis = [&](int i, int n, int& lo, int& hi, double& frac) {
    const double src = n > 1 ? i * (c.side - 1.0) / (n - 1.0) : 0.0;
    lo = static_cast<int>(std::floor(src));
    hi = std::min(lo + 1, c.side - 1);
    frac = src - lo;
  };
  int r0, r1, c0, c1;
  double dr, dc;
  axis(r, h, r0, r1, dr);
  axis(col, w, c0, c1, dc);
  const auto& E = W["pos_embed.weight"];
  std::vector<double> p(c.hidden, 0.0);
  auto acc = [&](int rr, int cc, double wt) {
    for (int k = 0; k < c.hidden; ++k) p[k] += wt * E[static_cast<size_t>(rr * c.side + cc) * c.hidden + k];
  };
  acc(r0, c0, (1 - dr) * (1 - dc));
  acc(r0, c1, (1 - dr) * dc);
  acc(r1, c0, dr * (1 - dc));
  acc(r1, c1, dr * dc);
  return p;
}

NaiveResult naive_tower(const NaiveConfig& c, const NaiveWeights& W, const std::vector<NaiveGrid>& grids,
                        const std::vector<Pixels>& pixels) {
  NaiveResult res;
  const int h = c.hidden, D = c.D(), quarter = D / 4, half = D / 2, M = h * c.m * c.m;
  for (size_t img = 0; img < grids.size(); ++img) {
    const NaiveGrid g = grids[img];
    std::vector<double> embed_all, merged_all;
    for (int f = 0; f < g.t; ++f) {
      const int L = g.h * g.w;
      // patch embedding (the Conv3d as a sum over c, tp, py, px) + position embedding
      std::vector<std::vector<double>> x(L);
      for (int r = 0; r < g.h; ++r)
        for (int col = 0; col < g.w; ++col) {
          const std::vector<double>& pix = pixels[img][(static_cast<size_t>(f) * g.h + r) * g.w + col];
          const auto& Wc = W["patch_embed.proj.weight"];
          std::vector<double> e(h);
          for (int o = 0; o < h; ++o) {
            double s = W["patch_embed.proj.bias"][o];
            for (int ch = 0; ch < c.C; ++ch)
              for (int tp = 0; tp < c.Tp; ++tp)
                for (int py = 0; py < c.P; ++py)
                  for (int px = 0; px < c.P; ++px) {
                    const size_t k = ((static_cast<size_t>(ch) * c.Tp + tp) * c.P + py) * c.P + px;
                    s += Wc[static_cast<size_t>(o) * c.patch_dim() + k] * pix[k];
                  }
            e[o] = s;
          }
          const std::vector<double> pos = position_ref(c, W, r, col, g.h, g.w);
          for (int o = 0; o < h; ++o) e[o] += pos[o];
          x[r * g.w + col] = e;
        }
      for (const auto& e : x) embed_all.insert(embed_all.end(), e.begin(), e.end());
      // blocks; the frame's patches attend to each other (and to nothing else)
      for (int blk = 0; blk < c.depth; ++blk) {
        const std::string b = "blocks." + std::to_string(blk) + ".";
        std::vector<std::vector<double>> q(L), k(L), v(L);
        for (int p = 0; p < L; ++p) {
          const std::vector<double> xn = layer_norm_ref(x[p].data(), h, W[b + "norm1.weight"], W[b + "norm1.bias"]);
          const std::vector<double> qkv = affine(W[b + "attn.qkv.weight"], W[b + "attn.qkv.bias"], xn.data(), 3 * h, h);
          q[p].assign(qkv.begin(), qkv.begin() + h);
          k[p].assign(qkv.begin() + h, qkv.begin() + 2 * h);
          v[p].assign(qkv.begin() + 2 * h, qkv.end());
          const int row = p / g.w, col = p % g.w;
          for (int hh = 0; hh < c.heads; ++hh)
            for (int i = 0; i < half; ++i) {
              // dims [0, D/4) (and their partners D/2 + i) turn with the row, [D/4, D/2) with the column
              const double pos = i < quarter ? row : col;
              const double angle = pos * std::pow(c.theta, -2.0 * (i % quarter) / half);
              for (auto* vec : {&q[p], &k[p]}) {
                double& a = (*vec)[hh * D + i];
                double& z = (*vec)[hh * D + i + half];
                const double a0 = a, z0 = z;
                a = a0 * std::cos(angle) - z0 * std::sin(angle);
                z = z0 * std::cos(angle) + a0 * std::sin(angle);
              }
            }
        }
        std::vector<std::vector<double>> att(L, std::vector<double>(h, 0.0));
        for (int p = 0; p < L; ++p)
          for (int hh = 0; hh < c.heads; ++hh) {
            std::vector<double> s(L);
            double mx = -1e300, sum = 0;
            for (int j = 0; j < L; ++j) {
              double dot = 0;
              for (int d = 0; d < D; ++d) dot += q[p][hh * D + d] * k[j][hh * D + d];
              s[j] = dot / std::sqrt(static_cast<double>(D));
              mx = std::max(mx, s[j]);
            }
            for (int j = 0; j < L; ++j) sum += (s[j] = std::exp(s[j] - mx));
            for (int j = 0; j < L; ++j)
              for (int d = 0; d < D; ++d) att[p][hh * D + d] += s[j] / sum * v[j][hh * D + d];
          }
        for (int p = 0; p < L; ++p) {
          const std::vector<double> y = affine(W[b + "attn.proj.weight"], W[b + "attn.proj.bias"], att[p].data(), h, h);
          for (int o = 0; o < h; ++o) x[p][o] += y[o];
          const std::vector<double> xn = layer_norm_ref(x[p].data(), h, W[b + "norm2.weight"], W[b + "norm2.bias"]);
          std::vector<double> a = affine(W[b + "mlp.linear_fc1.weight"], W[b + "mlp.linear_fc1.bias"], xn.data(),
                                         c.inter, h);
          for (auto& e : a) e = gelu_tanh_ref(e);
          const std::vector<double> y2 =
              affine(W[b + "mlp.linear_fc2.weight"], W[b + "mlp.linear_fc2.bias"], a.data(), h, c.inter);
          for (int o = 0; o < h; ++o) x[p][o] += y2[o];
        }
      }
      // merger: each m x m block's normalised patches, row-major within the block, side by side
      for (int br = 0; br < g.h / c.m; ++br)
        for (int bc = 0; bc < g.w / c.m; ++bc) {
          std::vector<double> cat;
          for (int ir = 0; ir < c.m; ++ir)
            for (int ic = 0; ic < c.m; ++ic) {
              const int p = (br * c.m + ir) * g.w + bc * c.m + ic;
              const std::vector<double> n = layer_norm_ref(x[p].data(), h, W["merger.norm.weight"], W["merger.norm.bias"]);
              cat.insert(cat.end(), n.begin(), n.end());
            }
          std::vector<double> a = affine(W["merger.linear_fc1.weight"], W["merger.linear_fc1.bias"], cat.data(), M, M);
          for (auto& e : a) e = gelu_erf_ref(e);
          const std::vector<double> o = affine(W["merger.linear_fc2.weight"], W["merger.linear_fc2.bias"], a.data(), c.out, M);
          merged_all.insert(merged_all.end(), o.begin(), o.end());
        }
    }
    res.embed.push_back(embed_all);
    res.merged.push_back(merged_all);
  }
  return res;
}

// The tiny tower as a checkpoint folder: config.json (the tiny qwen3_5_moe text model of fixture_util with this
// vision_config) and model.safetensors with the model.visual.* tensors only, all BF16.
void write_tower(const std::string& dir, const NaiveConfig& c, const NaiveWeights& W,
                 const std::vector<std::string>& skip = {}) {
  json cfg = json::parse(kiln::test::tiny_config_json(kiln::test::Family::qwen3_5_moe));
  cfg["vision_config"] = {{"model_type", "qwen3_5_moe"},
                          {"depth", c.depth},
                          {"hidden_size", c.hidden},
                          {"hidden_act", "gelu_pytorch_tanh"},
                          {"intermediate_size", c.inter},
                          {"num_heads", c.heads},
                          {"in_channels", c.C},
                          {"patch_size", c.P},
                          {"spatial_merge_size", c.m},
                          {"temporal_patch_size", c.Tp},
                          {"out_hidden_size", c.out},
                          {"num_position_embeddings", c.side * c.side}};
  kiln::test::write_text(dir + "/config.json", cfg.dump(2));
  format::SafetensorsWriter w;
  for (const auto& [name, values] : W.values) {
    if (std::find(skip.begin(), skip.end(), name) != skip.end()) continue;
    std::vector<uint8_t> bytes(values.size() * 2);
    for (size_t i = 0; i < values.size(); ++i) {
      const uint16_t bits = bf16_bits(values[i]);
      std::memcpy(&bytes[i * 2], &bits, 2);
    }
    w.add("model.visual." + name, DType::BF16, Shape::from(W.shapes.at(name)), bytes);
  }
  w.set_metadata("format", "pt");
  w.write(dir + "/model.safetensors");
}

struct LoadedTower {
  format::ModelDir dir;
  format::Checkpoint ckpt;
  format::ModelConfig config;
  backend::cpu::CpuOps ops;
  VisionWeights weights;
  explicit LoadedTower(const std::string& path)
      : dir(format::ModelDir::open(path)),
        ckpt(format::Checkpoint::open(dir)),
        config(format::load_model_config(dir)),
        weights(load_vision_weights(ckpt, config, ops)) {}
};

TEST(Qwen35Vision, MatchesNaiveTowerOnThreeGridsIncludingTwoFrames) {
  const NaiveConfig c;
  const NaiveWeights W = make_weights(c, 7);
  kiln::test::TempDir tmp;
  write_tower(tmp.path(), c, W);
  LoadedTower tower(tmp.path());
  ASSERT_TRUE(tower.config.has_vision) << tower.config.vision_problem;

  // Grids: wider than tall, two frames (a video: each frame attends only to itself), taller than wide; 2 x 2 and
  // 6-sided grids resample the 4 x 4 position grid both down and up.
  const std::vector<NaiveGrid> grids = {{1, 4, 6}, {2, 2, 4}, {1, 6, 2}};
  std::mt19937 rng(11);
  std::uniform_real_distribution<double> u(-1.0, 1.0);
  std::vector<Pixels> pixels;
  std::vector<float> pixel_values;  // the processor's layout: per frame, merge-block order
  std::vector<ImageGrid> kiln_grids;
  for (const NaiveGrid& g : grids) {
    Pixels px(static_cast<size_t>(g.t) * g.h * g.w, std::vector<double>(c.patch_dim()));
    for (auto& patch : px)
      for (auto& v : patch) v = static_cast<float>(u(rng));  // values the F32 input holds exactly
    for (int f = 0; f < g.t; ++f)
      for (int br = 0; br < g.h / c.m; ++br)
        for (int bc = 0; bc < g.w / c.m; ++bc)
          for (int ir = 0; ir < c.m; ++ir)
            for (int ic = 0; ic < c.m; ++ic) {
              const auto& patch = px[(static_cast<size_t>(f) * g.h + br * c.m + ir) * g.w + bc * c.m + ic];
              pixel_values.insert(pixel_values.end(), patch.begin(), patch.end());
            }
    pixels.push_back(std::move(px));
    kiln_grids.push_back({g.t, g.h, g.w});
  }
  const NaiveResult want = naive_tower(c, W, grids, pixels);

  const int64_t N = static_cast<int64_t>(pixel_values.size()) / c.patch_dim();
  Ops& ops = tower.ops;
  const TensorView pv = ops.upload(pixel_values.data(), DType::F32, Shape{N, c.patch_dim()});
  std::vector<float> embed;
  const TensorView out = vision_forward(ops, tower.weights, tower.config.vision, pv, kiln_grids,
                                        [&](std::string_view name, const TensorView& t) {
                                          if (name == "embed") embed = download(ops, t);
                                        });
  ASSERT_EQ(out.dim(0), N / 4);
  ASSERT_EQ(out.dim(1), c.out);
  const std::vector<float> got = download(ops, out);

  // The embedding (before any block) in the processor's order: naive raster rows permuted the same way.
  std::vector<double> want_embed, want_out;
  for (size_t i = 0; i < grids.size(); ++i) {
    const NaiveGrid g = grids[i];
    for (int f = 0; f < g.t; ++f)
      for (int br = 0; br < g.h / c.m; ++br)
        for (int bc = 0; bc < g.w / c.m; ++bc)
          for (int ir = 0; ir < c.m; ++ir)
            for (int ic = 0; ic < c.m; ++ic) {
              const size_t p = (static_cast<size_t>(f) * g.h + br * c.m + ir) * g.w + bc * c.m + ic;
              want_embed.insert(want_embed.end(), want.embed[i].begin() + p * c.hidden,
                                want.embed[i].begin() + (p + 1) * c.hidden);
            }
    want_out.insert(want_out.end(), want.merged[i].begin(), want.merged[i].end());
  }
  // fp32 against double: a few ulps of fp32 per op, ~1e-6 relative after two blocks; a layout slip is O(1).
  const Diff de = compare(embed.data(), want_embed);
  EXPECT_LT(de.rel_l2, 1e-5) << "embed max abs " << de.max_abs;
  const Diff d = compare(got.data(), want_out);
  EXPECT_LT(d.rel_l2, 1e-5) << "output max abs " << d.max_abs;
  std::printf("naive tower vs kiln: rel-L2 embed %.2e, output %.2e (max abs %.2e)\n", de.rel_l2, d.rel_l2, d.max_abs);
  // Per image: each image's rows must match on their own (an image-order slip would hide in the global norm).
  size_t row = 0;
  for (size_t i = 0; i < grids.size(); ++i) {
    const Diff di = compare(got.data() + row * c.out, want.merged[i]);
    EXPECT_LT(di.rel_l2, 1e-5) << "image " << i;
    row += want.merged[i].size() / c.out;
  }
}

TEST(Qwen35Vision, RejectsGridsAndPixelsThatDoNotFit) {
  const NaiveConfig c;
  const NaiveWeights W = make_weights(c, 3);
  kiln::test::TempDir tmp;
  write_tower(tmp.path(), c, W);
  LoadedTower tower(tmp.path());
  Ops& ops = tower.ops;
  std::vector<float> pixels(static_cast<size_t>(24) * c.patch_dim(), 0.5f);
  const TensorView pv = ops.upload(pixels.data(), DType::F32, Shape{24, c.patch_dim()});
  auto error_of = [&](std::vector<ImageGrid> grids, const TensorView& p) -> std::string {
    try {
      vision_forward(ops, tower.weights, tower.config.vision, p, grids);
      return "";
    } catch (const Error& e) {
      return e.what();
    }
  };
  EXPECT_THAT(error_of({{1, 4, 5}}, pv), HasSubstr("multiples of spatial_merge_size 2"));
  EXPECT_THAT(error_of({{0, 4, 6}}, pv), HasSubstr("patch grid of 0 x 4 x 6"));
  EXPECT_THAT(error_of({{1, 4, 4}}, pv), HasSubstr("need F32 [16, 1536]"));
  EXPECT_THAT(error_of({}, pv), HasSubstr("no images"));
  const TensorView narrow = ops.upload(pixels.data(), DType::F32, Shape{48, c.patch_dim() / 2});
  EXPECT_THAT(error_of({{1, 4, 6}}, narrow), HasSubstr("pixel_values are F32 [48, 768]"));
  EXPECT_EQ(error_of({{1, 4, 6}}, pv), "");
}

TEST(Qwen35Vision, LoaderListsEveryMismatchAndMissingTower) {
  const NaiveConfig c;
  NaiveWeights W = make_weights(c, 5);
  {
    kiln::test::TempDir tmp;
    W.shapes["blocks.1.attn.qkv.bias"] = {3 * c.hidden - 1};
    W.values["blocks.1.attn.qkv.bias"].pop_back();
    write_tower(tmp.path(), c, W, {"merger.norm.bias"});
    try {
      LoadedTower tower(tmp.path());
      FAIL() << "loaded a tower with a missing and a misshapen tensor";
    } catch (const Error& e) {
      EXPECT_THAT(e.what(), HasSubstr("the vision tower does not match config.json's vision_config: 2 problems"));
      EXPECT_THAT(e.what(), HasSubstr("missing model.visual.merger.norm.bias (BF16 [16])"));
      EXPECT_THAT(e.what(), HasSubstr("model.visual.blocks.1.attn.qkv.bias: shape [47], expected [48]"));
    }
  }
  {
    // A checkpoint whose config.json describes a tower it does not hold.
    kiln::test::TempDir tmp;
    write_tower(tmp.path(), c, W, {"patch_embed.proj.weight"});
    EXPECT_THROW(
        {
          try {
            LoadedTower tower(tmp.path());
          } catch (const Error& e) {
            EXPECT_THAT(e.what(), HasSubstr("the checkpoint holds none"));
            throw;
          }
        },
        Error);
  }
  {
    // No vision_config at all (a text-only checkpoint).
    kiln::test::TempDir tmp;
    kiln::test::write_fixture_model(tmp.path(), kiln::test::Family::qwen3_5_moe_text, kiln::test::Layout::bf16);
    const format::ModelDir dir = format::ModelDir::open(tmp.path());
    const format::Checkpoint ckpt = format::Checkpoint::open(dir);
    const format::ModelConfig config = format::load_model_config(dir);
    backend::cpu::CpuOps ops;
    try {
      load_vision_weights(ckpt, config, ops);
      FAIL() << "loaded a tower from a text-only checkpoint";
    } catch (const Error& e) {
      EXPECT_THAT(e.what(), HasSubstr("images are not supported with this checkpoint: config.json has no vision_config"));
    }
  }
}

// ---------------------------------------------------------------------------------------------------------------
// The transformers fixtures (tools/reference/make_vision_fixtures.py)

std::string fixture_dir(const std::string& name) {
  return std::string(KILN_SOURCE_DIR) + "/tests/fixtures/reference/" + name;
}
constexpr const char* kRegenerate =
    "absent: generate it with `python3 tools/reference/make_vision_fixtures.py --out tests/fixtures/reference` "
    "(torch + transformers 5.17)";

struct Expected {
  std::vector<uint8_t> bytes;
  std::unique_ptr<format::SafetensorsFile> file;
  explicit Expected(const std::string& path) : bytes(kiln::test::read_file(path)) {
    file = std::make_unique<format::SafetensorsFile>(bytes, path);
  }
  template <typename T>
  std::vector<T> get(const std::string& name, Shape* shape = nullptr) const {
    const format::TensorInfo* t = file->find(name);
    if (!t) throw Error(name + " missing from " + file->name());
    std::vector<T> v(t->shape.numel());
    std::memcpy(v.data(), t->data, v.size() * sizeof(T));
    if (shape) *shape = t->shape;
    return v;
  }
};

std::vector<double> as_double(const std::vector<float>& v) { return {v.begin(), v.end()}; }

// Runs kiln's tower on the fixture's pixel_values / grid_thw; returns the output and the taps.
struct FixtureRun {
  std::vector<float> out, embed, block0;
  int64_t rows = 0, cols = 0;
};
FixtureRun run_fixture(LoadedTower& tower, const Expected& ex, const std::string& grid_name) {
  Shape pshape, gshape;
  const std::vector<float> pixels = ex.get<float>("pixel_values", &pshape);
  const std::vector<int32_t> grid = ex.get<int32_t>(grid_name, &gshape);
  std::vector<ImageGrid> grids;
  for (int64_t i = 0; i < gshape[0]; ++i) grids.push_back({grid[i * 3], grid[i * 3 + 1], grid[i * 3 + 2]});
  Ops& ops = tower.ops;
  const TensorView pv = ops.upload(pixels.data(), DType::F32, pshape);
  FixtureRun r;
  const TensorView out = vision_forward(ops, tower.weights, tower.config.vision, pv, grids,
                                        [&](std::string_view name, const TensorView& t) {
                                          if (name == "embed") r.embed = download(ops, t);
                                          if (name == "block.0") r.block0 = download(ops, t);
                                        });
  r.out = download(ops, out);
  r.rows = out.dim(0);
  r.cols = out.dim(1);
  return r;
}

// Bound for kiln fp32 against transformers fp32 on the same stored weights: both round every op to fp32, in
// different orders (the Conv3d's 1536-term sums, erf / tanh / cos implementations); kiln against the double-precision
// naive tower above is 2e-7, so ~1e-6 is expected here. A layout or maths slip gives O(1) (a rotary with rows and
// columns swapped: 0.3); the subtlest slip, the merger's erf GELU replaced by the tanh form, gives 2e-4. 2e-5 sits
// between: 20x above the expected rounding, 10x below that slip.
constexpr double kFixtureRelL2 = 2e-5;

TEST(Qwen35Vision, MatchesTransformersVisionModel) {
  const std::string dir = fixture_dir("qwen3_5_vision");
  if (!std::filesystem::exists(dir + "/manifest.json")) GTEST_SKIP() << "fixture qwen3_5_vision " << kRegenerate;
  LoadedTower tower(dir + "/model");
  ASSERT_TRUE(tower.config.has_vision) << tower.config.vision_problem;
  const Expected ex(dir + "/expected.safetensors");
  const FixtureRun r = run_fixture(tower, ex, "grid_thw");
  Shape oshape;
  const std::vector<float> want = ex.get<float>("output", &oshape);
  ASSERT_EQ(r.rows, oshape[0]);
  ASSERT_EQ(r.cols, oshape[1]);
  const Diff de = compare(r.embed.data(), as_double(ex.get<float>("embed")));
  const Diff d0 = compare(r.block0.data(), as_double(ex.get<float>("block0")));
  const Diff d = compare(r.out.data(), as_double(want));
  EXPECT_LT(de.rel_l2, kFixtureRelL2) << "after patch + position embedding, max abs " << de.max_abs;
  EXPECT_LT(d0.rel_l2, kFixtureRelL2) << "after block 0, max abs " << d0.max_abs;
  EXPECT_LT(d.rel_l2, kFixtureRelL2) << "merger output, max abs " << d.max_abs;
  std::printf("qwen3_5_vision vs transformers: rel-L2 embed %.2e, block 0 %.2e, output %.2e (max abs %.2e)\n",
              de.rel_l2, d0.rel_l2, d.rel_l2, d.max_abs);
}

TEST(Qwen35Vision, MatchesTransformersImageEmbeddingsOfTheMultimodalFixture) {
  const std::string dir = fixture_dir("qwen3_5_moe_vl");
  if (!std::filesystem::exists(dir + "/manifest.json")) GTEST_SKIP() << "fixture qwen3_5_moe_vl " << kRegenerate;
  LoadedTower tower(dir + "/model");
  ASSERT_TRUE(tower.config.has_vision) << tower.config.vision_problem;
  EXPECT_EQ(tower.config.vision.out_hidden_size, tower.config.hidden_size);
  const Expected ex(dir + "/expected.safetensors");
  const FixtureRun r = run_fixture(tower, ex, "image_grid_thw");
  const Diff d = compare(r.out.data(), as_double(ex.get<float>("image_embeds")));
  EXPECT_LT(d.rel_l2, kFixtureRelL2) << "max abs " << d.max_abs;
  // The special tokens config.json names are the ones the prompt uses.
  const std::vector<int32_t> ids = ex.get<int32_t>("input_ids");
  EXPECT_EQ(std::count(ids.begin(), ids.end(), static_cast<int32_t>(tower.config.image_token_id)), r.rows);
  EXPECT_EQ(std::count(ids.begin(), ids.end(), static_cast<int32_t>(tower.config.vision_start_token_id)), 1);
  EXPECT_EQ(std::count(ids.begin(), ids.end(), static_cast<int32_t>(tower.config.vision_end_token_id)), 1);
}

}  // namespace
}  // namespace kiln::model
