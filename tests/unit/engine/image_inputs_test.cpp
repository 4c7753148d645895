// Image inputs in the engine (src/engine/image_inputs.*): the sequence's image fields, each chunk's M-RoPE positions
// and embeddings, the prefix-cache key; then end to end on the CPU runner of a real Qwen3.5-MoE fixture through a
// wrapper whose "vision encoder" returns known rows. The honest invariant there: an image whose placeholder run is a
// single merged token (grid 1 x 2 x 2) sits at one rope position on all three axes, exactly like a text token, so
// with the embedding row of token X it must give the greedy output of the text prompt with X in its place.
#include "engine/image_inputs.h"

#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <filesystem>
#include <cstring>

#include "backend/cpu/cpu_backend.h"
#include "core/dtype.h"
#include "core/error.h"
#include "engine/engine.h"
#include "format/model_dir.h"
#include "format/safetensors.h"
#include "model/mrope.h"
#include "forwarding_runner.h"
#include "reference_fixture.h"

namespace kiln::engine {
namespace {

using namespace std::chrono_literals;

// A runner with a "vision encoder" only: embedding value = pixel_values[0] (the image's id) + 0.01 token + 1e-4 dim.
class FakeVision : public model::ModelRunner {
 public:
  explicit FakeVision(int merge, int64_t hidden = 4) : merge_(merge), hidden_(hidden) {}
  model::RunnerCapacity capacity() const override { return {64, 16, 4, 1024, 0, 0}; }
  int64_t vocab_size() const override { return 100; }
  void forward(std::span<const model::SeqChunk>, std::span<float>) override {}
  std::string describe() const override { return "fake vision"; }
  int vision_merge_size() const override { return merge_; }
  std::vector<float> encode_image(std::span<const float> px, int64_t t, int64_t h, int64_t w) override {
    const int64_t n = t * h * w / (merge_ * merge_);
    std::vector<float> out(static_cast<size_t>(n * hidden_));
    for (int64_t k = 0; k < n; ++k)
      for (int64_t d = 0; d < hidden_; ++d) out[k * hidden_ + d] = px[0] + 0.01f * k + 1e-4f * d;
    ++encoded;
    return out;
  }
  int encoded = 0;

 private:
  int merge_;
  int64_t hidden_;
};

ImageInput image(int64_t offset, int64_t gh, int64_t gw, float id, uint64_t hash) {
  ImageInput im;
  im.offset = offset;
  im.grid_t = 1;
  im.grid_h = gh;
  im.grid_w = gw;
  im.pixel_values.assign(static_cast<size_t>(gh * gw * 8), id);
  im.hash = hash;
  return im;
}

void fill(Sequence& s, std::vector<int32_t> prompt, std::vector<ImageInput> images) {
  s.request.prompt = prompt;
  s.request.images = std::move(images);
  s.tokens = prompt;
  s.prompt_len = static_cast<int64_t>(prompt.size());
}

TEST(ImageInputs, PrepareEncodesPlacesAndPositions) {
  // "a b" | image of 4 x 6 patches = 2 x 3 merged tokens at 2 | "c": rope t/h/w as worked out in mrope_test.
  FakeVision r(2);
  Sequence s;
  fill(s, {5, 6, 9, 9, 9, 9, 9, 9, 7}, {image(2, 4, 6, 3.0f, 42)});
  prepare_images(s, r);
  EXPECT_EQ(r.encoded, 1);
  EXPECT_EQ(s.image_token_index, (std::vector<int32_t>{2, 3, 4, 5, 6, 7}));
  ASSERT_EQ(s.image_embeds.size(), 6u * 4);
  EXPECT_FLOAT_EQ(s.image_embeds[1 * 4 + 2], 3.0f + 0.01f + 2e-4f);
  EXPECT_TRUE(s.request.images[0].pixel_values.empty());  // freed once encoded
  const std::vector<int32_t> h_axis = {0, 1, 2, 2, 2, 3, 3, 3, 5};
  for (size_t i = 0; i < h_axis.size(); ++i) EXPECT_EQ(s.mrope_pos[3 * i + 1], h_axis[i]) << i;
  EXPECT_EQ(s.rope_delta, 6 - 9);
  EXPECT_EQ(rope_position(s, 9), (std::array<int32_t, 3>{6, 6, 6}));
  for (uint64_t k : {0, 1}) EXPECT_LT(s.image_token_key[k], 0);
  EXPECT_NE(s.image_token_key[0], s.image_token_key[1]);
}

TEST(ImageInputs, ClearErrors) {
  FakeVision none(0);
  Sequence a;
  fill(a, {1, 9, 9, 9, 9}, {image(1, 4, 4, 1.0f, 1)});
  EXPECT_THROW(prepare_images(a, none), Error);
  FakeVision r(2);
  Sequence odd;
  fill(odd, {1, 9, 9, 9, 9}, {image(1, 2, 3, 1.0f, 1)});  // 3 is not a multiple of the merge 2
  EXPECT_THROW(prepare_images(odd, r), Error);
  Sequence past;
  fill(past, {1, 9, 9}, {image(1, 4, 4, 1.0f, 1)});  // 4 tokens from index 1 leave the prompt of 3
  EXPECT_THROW(prepare_images(past, r), Error);
  Sequence overlap;
  fill(overlap, {9, 9, 9, 9, 9}, {image(0, 2, 4, 1.0f, 1), image(1, 2, 2, 2.0f, 2)});
  EXPECT_THROW(prepare_images(overlap, r), Error);
  Sequence text;
  fill(text, {1, 2, 3}, {});
  prepare_images(text, none);  // no images: nothing asked of the runner
  EXPECT_FALSE(text.has_images());
}

TEST(ImageInputs, ChunksCarryTheirPositionsAndEmbeddings) {
  FakeVision r(2);
  Sequence s;
  fill(s, {5, 6, 9, 9, 9, 9, 9, 9, 7}, {image(2, 4, 6, 3.0f, 42)});
  prepare_images(s, r);
  model::SeqChunk c;
  c.start_pos = 0;
  c.tokens = std::span<const int32_t>(s.tokens).first(5);
  attach_image_inputs(s, c);
  EXPECT_EQ(std::vector<int32_t>(c.embed_offsets.begin(), c.embed_offsets.end()), (std::vector<int32_t>{2, 3, 4}));
  ASSERT_EQ(c.embeds.size(), 3u * 4);
  EXPECT_FLOAT_EQ(c.embeds[0], 3.0f);
  ASSERT_EQ(c.mrope_pos.size(), 15u);
  EXPECT_EQ(c.mrope_pos[3 * 4 + 2], 4);  // token 4: image row 0, column 2 -> w = base 2 + 2
  model::SeqChunk d;
  d.start_pos = 5;
  d.tokens = std::span<const int32_t>(s.tokens).subspan(5);
  attach_image_inputs(s, d);
  EXPECT_EQ(std::vector<int32_t>(d.embed_offsets.begin(), d.embed_offsets.end()), (std::vector<int32_t>{0, 1, 2}));
  EXPECT_FLOAT_EQ(d.embeds[0], 3.0f + 0.03f);  // the 4th image token's row
  EXPECT_EQ(d.mrope_prev, (std::array<int32_t, 3>{2, 2, 4}));
  // A decode token after the prompt: index + delta on every axis, no embeddings.
  s.tokens.push_back(11);
  model::SeqChunk e;
  e.start_pos = 9;
  e.tokens = std::span<const int32_t>(s.tokens).subspan(9);
  attach_image_inputs(s, e);
  EXPECT_EQ(std::vector<int32_t>(e.mrope_pos.begin(), e.mrope_pos.end()), (std::vector<int32_t>{6, 6, 6}));
  EXPECT_TRUE(e.embed_offsets.empty());
  // A text sequence's chunk is left as it is.
  Sequence t;
  fill(t, {1, 2, 3}, {});
  model::SeqChunk f;
  f.tokens = t.tokens;
  attach_image_inputs(t, f);
  EXPECT_TRUE(f.mrope_pos.empty());
}

TEST(ImageInputs, CacheKeyFollowsTheImageContent) {
  FakeVision r(2);
  Sequence a;
  fill(a, {5, 9, 9, 9, 9, 7}, {image(1, 4, 4, 1.0f, 100)});
  Sequence b;
  fill(b, {5, 9, 9, 9, 9, 7}, {image(1, 4, 4, 2.0f, 100)});  // the same content hash
  Sequence c;
  fill(c, {5, 9, 9, 9, 9, 7}, {image(1, 4, 4, 1.0f, 101)});  // other content
  for (Sequence* s : {&a, &b, &c}) prepare_images(*s, r);
  std::vector<int32_t> ka, kb, kc;
  const auto sa = cache_key(a, ka), sb = cache_key(b, kb), sc = cache_key(c, kc);
  EXPECT_TRUE(std::equal(sa.begin(), sa.end(), sb.begin(), sb.end()));
  EXPECT_EQ(sa[0], 5);
  EXPECT_EQ(sa[5], 7);
  for (int i = 1; i < 5; ++i) {
    EXPECT_LT(sa[i], 0);
    EXPECT_NE(sa[i], sc[i]);
  }
  Sequence t;
  fill(t, {1, 2, 3}, {});
  std::vector<int32_t> kt;
  EXPECT_EQ(cache_key(t, kt).data(), t.tokens.data());  // text: the tokens themselves, no copy
}

// ---- end to end on a real model

const std::string kFixture = std::string(KILN_SOURCE_DIR) + "/tests/fixtures/reference/qwen3_5_moe_bf16/model";

// The CPU runner of the fixture, with a vision encoder that returns embedding-table rows: image i of a call gives,
// for its k-th token, the row of token rows[pixel_values[0]][k].
class TableVision : public test::ForwardingRunner {
 public:
  TableVision(std::unique_ptr<model::ModelRunner> inner, std::vector<std::vector<int32_t>> rows)
      : ForwardingRunner(std::move(inner)), rows_(std::move(rows)) {
    const std::vector<uint8_t> bytes = read_file(kFixture + "/model.safetensors");
    format::SafetensorsFile f(bytes, "fixture");
    const format::TensorInfo* t = f.find("model.language_model.embed_tokens.weight");
    KILN_CHECK(t && t->dtype == DType::BF16, "embedding table");
    hidden_ = t->shape.dims[1];
    table_.resize(static_cast<size_t>(t->shape.numel()));
    const auto* b = reinterpret_cast<const uint16_t*>(t->data);
    for (size_t i = 0; i < table_.size(); ++i) table_[i] = bf16_to_f32(b[i]);
  }
  static std::vector<uint8_t> read_file(const std::string& path) {
    std::FILE* fp = std::fopen(path.c_str(), "rb");
    KILN_CHECK(fp, "open {}", path);
    std::vector<uint8_t> v;
    uint8_t buf[65536];
    for (size_t n; (n = std::fread(buf, 1, sizeof buf, fp)) > 0;) v.insert(v.end(), buf, buf + n);
    std::fclose(fp);
    return v;
  }
  int vision_merge_size() const override { return 2; }
  std::vector<float> encode_image(std::span<const float> px, int64_t t, int64_t h, int64_t w) override {
    const std::vector<int32_t>& ids = rows_.at(static_cast<size_t>(px[0]));
    EXPECT_EQ(static_cast<int64_t>(ids.size()), t * h * w / 4);
    std::vector<float> out;
    for (int32_t id : ids) out.insert(out.end(), table_.begin() + id * hidden_, table_.begin() + (id + 1) * hidden_);
    return out;
  }

 private:
  std::vector<std::vector<int32_t>> rows_;
  std::vector<float> table_;
  int64_t hidden_ = 0;
};

struct Result {
  std::vector<int32_t> tokens;
  int64_t cached = -1;
  std::string error;
};

Result run(Engine& e, GenerateRequest r) {
  auto ch = e.submit({std::move(r)}).channel;
  Result out;
  const auto deadline = std::chrono::steady_clock::now() + 60s;
  while (!(ch->all_finished() && !ch->has_events()) && std::chrono::steady_clock::now() < deadline) {
    std::vector<TokenEvent> evs;
    ch->wait(evs, 100ms);
    for (auto& ev : evs) {
      if (ev.token >= 0 && out.tokens.empty()) out.cached = ev.cached_tokens;
      if (ev.token >= 0) out.tokens.push_back(ev.token);
      if (ev.finished) out.error = ev.error;
    }
  }
  return out;
}

TEST(ImageInputsEngine, OneTokenImagesEqualTheTextTheyEmbedAndTheCacheKeysByContent) {
  backend::LoadOptions lo;
  lo.kv_dtype = DType::F32;
  lo.max_context = 512;
  lo.state_slots = 8;
  lo.prefill_chunk = 16;
  // Image 0 embeds token 77, image 1 token 123 (one merged token each: grid 1 x 2 x 2).
  auto make = [&] {
    return std::make_unique<TableVision>(backend::load_cpu_model(format::ModelDir::open(kFixture), lo),
                                         std::vector<std::vector<int32_t>>{{77}, {123}});
  };
  EngineOptions o;
  o.max_running_requests = 4;
  o.chunked_prefill_size = 16;
  o.eos_token_ids = {0};
  o.enable_prefix_cache = true;
  std::vector<int32_t> text(40);
  for (size_t i = 0; i < text.size(); ++i) text[i] = static_cast<int32_t>(1 + (i * 37) % 500);
  text[20] = 77;
  text[33] = 123;
  std::vector<int32_t> with_pads = text;
  with_pads[20] = with_pads[33] = 9;  // the placeholder id: its own embedding is replaced
  auto greedy = [](std::vector<int32_t> p) {
    GenerateRequest r;
    r.prompt = std::move(p);
    r.max_tokens = 12;
    r.ignore_eos = true;
    r.sampling.temperature = 0.0f;
    return r;
  };
  Engine plain(make(), o);
  plain.start();
  const Result want = run(plain, greedy(text));
  ASSERT_EQ(want.tokens.size(), 12u);
  const Result want_again = run(plain, greedy(text));  // what the cache serves of a repeated text prompt
  ASSERT_GT(want_again.cached, 0);

  Engine e(make(), o);
  e.start();
  GenerateRequest r = greedy(with_pads);
  r.images = {image(20, 2, 2, 0.0f, 7), image(33, 2, 2, 1.0f, 8)};
  const Result got = run(e, r);
  EXPECT_EQ(got.error, "");
  EXPECT_EQ(got.tokens, want.tokens);
  // The same images again: the cache serves as much as for the repeated text prompt.
  const Result again = run(e, r);
  EXPECT_EQ(again.tokens, want.tokens);
  EXPECT_EQ(again.cached, want_again.cached);
  // Other content behind the same placeholder ids (image 0 swapped for image 1's rows): no match past token 20's
  // page (page size 16), and the output is that of the text with token 123 at 20.
  GenerateRequest other = greedy(with_pads);
  other.images = {image(20, 2, 2, 1.0f, 9), image(33, 2, 2, 1.0f, 8)};
  const Result o2 = run(e, other);
  EXPECT_EQ(o2.error, "");
  EXPECT_LE(o2.cached, 16);
  std::vector<int32_t> text2 = text;
  text2[20] = 123;
  Engine plain2(make(), o);
  plain2.start();
  EXPECT_EQ(o2.tokens, run(plain2, greedy(text2)).tokens);
  // A runner without a vision encoder ends the request with a clear error.
  Engine no_vision(backend::load_cpu_model(format::ModelDir::open(kFixture), lo), o);
  no_vision.start();
  const Result none = run(no_vision, r);
  EXPECT_NE(none.error.find("no vision encoder"), std::string::npos) << none.error;
}

// ---- against transformers: the tiny Qwen3_5MoeForConditionalGeneration of tools/reference/make_vision_fixtures.py
// (fixture qwen3_5_moe_vl: one image of grid 1 x 4 x 6 inside an 18-token prompt). kiln's M-RoPE positions must be
// transformers' exactly; the prefill logits of every position within the reference fixtures' tolerance; greedy decoding
// through the engine (the image encoded by the CPU vision tower, the M-RoPE delta on later tokens) the same 8 tokens.
TEST(ImageInputsTransformers, PromptWithAnImageMatchesTransformers) {
  const std::string dir = testing::fixtures_root() + "/qwen3_5_moe_vl";
  if (!std::filesystem::exists(dir + "/expected.safetensors"))
    GTEST_SKIP() << "fixture qwen3_5_moe_vl absent: run tools/reference/make_vision_fixtures.py (torch + transformers)";
  const std::vector<uint8_t> bytes = testing::read_bytes(dir + "/expected.safetensors");
  format::SafetensorsFile f(bytes, "qwen3_5_moe_vl/expected.safetensors");
  auto i32 = [&](const char* n) { return testing::tensor_values<int32_t>(f, n); };
  auto f32 = [&](const char* n) { return testing::tensor_values<float>(f, n); };
  const std::vector<int32_t> ids = i32("input_ids"), types = i32("mm_token_type_ids"), grid = i32("image_grid_thw");
  const std::vector<int32_t> pos = i32("position_ids"), greedy = i32("greedy_tokens");
  const std::vector<float> pixels = f32("pixel_values"), prefill = f32("prefill_logits");
  const int64_t L = static_cast<int64_t>(ids.size()), V = static_cast<int64_t>(prefill.size()) / L;
  const int64_t offset = std::find(types.begin(), types.end(), 1) - types.begin();
  // Positions: kiln's reading of get_rope_index against transformers' [3, L] rows.
  const model::ImagePlacement im{offset, grid[0], grid[1] / 2, grid[2] / 2};
  const model::MRopePositions mp = model::mrope_positions(L, std::span<const model::ImagePlacement>(&im, 1));
  for (int64_t t = 0; t < L; ++t)
    for (int a = 0; a < 3; ++a) ASSERT_EQ(mp.pos[3 * t + a], pos[a * L + t]) << "token " << t << " axis " << a;
  // Prefill logits at every position through the runner (vision tower loaded, CPU, F32 KV).
  backend::LoadOptions lo;
  lo.kv_dtype = DType::F32;
  lo.max_context = 256;
  lo.vision = true;
  auto runner = backend::load_cpu_model(format::ModelDir::open(dir + "/model"), lo);
  ASSERT_EQ(runner->vision_merge_size(), 2);
  const std::vector<float> emb = runner->encode_image(pixels, grid[0], grid[1], grid[2]);
  std::vector<int32_t> offsets;
  for (int64_t t = 0; t < L; ++t)
    if (types[t]) offsets.push_back(static_cast<int32_t>(t));
  std::vector<int32_t> pages(16);
  for (int i = 0; i < 16; ++i) pages[i] = i;
  model::SeqChunk c;
  c.state_slot = 0;
  c.tokens = ids;
  c.start_pos = 0;
  c.page_table = pages;
  c.logits_tokens = static_cast<int>(L);
  c.mrope_pos = mp.pos;
  c.embed_offsets = offsets;
  c.embeds = emb;
  std::vector<float> got(static_cast<size_t>(L * V));
  runner->forward({&c, 1}, got);
  double num = 0, den = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    num += (got[i] - prefill[i]) * (got[i] - prefill[i]);
    den += prefill[i] * prefill[i];
  }
  const double rel = std::sqrt(num / den);
  std::printf("[images] qwen3_5_moe_vl prefill logits rel-L2 vs transformers %.2e\n", rel);
  EXPECT_LT(rel, 1e-4);  // fp32 on both sides: summation order only (the text fixtures' bound)
  // Greedy through the engine, the image encoded there.
  EngineOptions o;
  o.max_running_requests = 1;
  o.eos_token_ids = {-1};
  Engine e(backend::load_cpu_model(format::ModelDir::open(dir + "/model"), lo), o);
  e.start();
  GenerateRequest r;
  r.prompt = ids;
  r.max_tokens = static_cast<int64_t>(greedy.size());
  r.ignore_eos = true;
  r.sampling.temperature = 0.0f;
  ImageInput in = image(offset, grid[1], grid[2], 0.0f, 1);
  in.grid_t = grid[0];
  in.pixel_values = pixels;
  r.images = {in};
  const Result out = run(e, r);
  EXPECT_EQ(out.error, "");
  EXPECT_EQ(out.tokens, greedy);
}

}  // namespace
}  // namespace kiln::engine
