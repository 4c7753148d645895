// safetensors reader/writer and Checkpoint: valid files round-trip; every malformed input fails with a
// kiln::Error that names the file and the tensor.
#include "format/safetensors.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "fixture_util.h"

namespace kiln::format {
namespace {

using kiln::test::raw_safetensors;
using kiln::test::TempDir;
using ::testing::HasSubstr;

// Parses `bytes` and returns the error message ("" if it parsed).
std::string parse_error(const std::vector<uint8_t>& bytes, const std::string& name = "bad.safetensors") {
  try {
    SafetensorsFile f({bytes.data(), bytes.size()}, name);
    return "";
  } catch (const InternalError& e) {
    return std::string("INTERNAL: ") + e.what();
  } catch (const Error& e) {
    return e.what();
  }
}

TEST(SafetensorsFile, ParsesHandWrittenFile) {
  // Two tensors, data laid out by hand: a = BF16 [2, 2] at [0, 8), b = F32 [] at [8, 12).
  const std::string header =
      R"({"__metadata__":{"format":"pt"},"b":{"dtype":"F32","shape":[],"data_offsets":[8,12]},)"
      R"("a":{"dtype":"BF16","shape":[2,2],"data_offsets":[0,8]}})";
  std::vector<uint8_t> data(12);
  for (int i = 0; i < 12; ++i) data[i] = static_cast<uint8_t>(i + 1);
  auto bytes = raw_safetensors(header, data);
  SafetensorsFile f({bytes.data(), bytes.size()}, "hand.safetensors");
  ASSERT_EQ(f.tensors().size(), 2u);
  EXPECT_EQ(f.tensors()[0].name, "a");  // file (offset) order
  EXPECT_EQ(f.metadata().at("format"), "pt");
  const TensorInfo* a = f.find("a");
  ASSERT_NE(a, nullptr);
  EXPECT_EQ(a->dtype, DType::BF16);
  EXPECT_EQ(a->shape, (Shape{2, 2}));
  EXPECT_EQ(a->nbytes, 8u);
  EXPECT_EQ(a->file, "hand.safetensors");
  EXPECT_EQ(a->data, bytes.data() + 8 + header.size());  // zero copy
  const TensorInfo* b = f.find("b");
  ASSERT_NE(b, nullptr);
  EXPECT_EQ(b->shape.ndim, 0);
  EXPECT_EQ(b->data[0], 9);
  EXPECT_EQ(f.find("c"), nullptr);
  TensorView v = a->view();
  EXPECT_EQ(v.numel(), 4);
  EXPECT_EQ(v.nbytes(), 8u);
}

TEST(SafetensorsFile, EmptyTensorsAndEmptyHeader) {
  auto bytes = raw_safetensors(R"({"e":{"dtype":"U8","shape":[0,4],"data_offsets":[0,0]},)"
                               R"("f":{"dtype":"U8","shape":[0],"data_offsets":[0,0]}})", {});
  EXPECT_EQ(parse_error(bytes), "");
  auto empty = raw_safetensors("{}", {});
  EXPECT_EQ(parse_error(empty), "");
}

struct BadCase {
  const char* what;
  std::vector<uint8_t> bytes;
  std::vector<std::string> substrings;
};

std::vector<BadCase> bad_cases() {
  const std::vector<uint8_t> d16(16);
  const std::string ok = R"("t":{"dtype":"F32","shape":[4],"data_offsets":[0,16]})";
  std::vector<BadCase> c;
  c.push_back({"too short", {1, 2, 3}, {"bad.safetensors", "too short"}});
  c.push_back({"header length past end", raw_safetensors("{" + ok + "}", d16, 1000), {"bad.safetensors", "runs past the end"}});
  c.push_back({"header length huge", raw_safetensors("{}", {}, uint64_t(1) << 40), {"larger than the 100 MB limit"}});
  c.push_back({"header length max u64", raw_safetensors("{}", {}, ~uint64_t(0)), {"bad.safetensors"}});
  c.push_back({"not json", raw_safetensors("{not json", {}), {"not valid JSON"}});
  c.push_back({"not object", raw_safetensors("[1,2]", {}), {"not a JSON object"}});
  c.push_back({"entry not object", raw_safetensors(R"({"t":5})", {}), {"'t'", "must be an object"}});
  c.push_back({"no dtype", raw_safetensors(R"({"t":{"shape":[4],"data_offsets":[0,16]}})", d16), {"'t'", "dtype"}});
  c.push_back({"unknown dtype", raw_safetensors(R"({"t":{"dtype":"F4","shape":[4],"data_offsets":[0,16]}})", d16),
               {"'t'", "unknown dtype 'F4'"}});
  c.push_back({"negative dim", raw_safetensors(R"({"t":{"dtype":"U8","shape":[-1],"data_offsets":[0,16]}})", d16),
               {"'t'", "non-negative integers"}});
  c.push_back({"float dim", raw_safetensors(R"({"t":{"dtype":"U8","shape":[1.5],"data_offsets":[0,16]}})", d16),
               {"'t'", "non-negative integers"}});
  c.push_back({"huge shape", raw_safetensors(R"({"t":{"dtype":"F32","shape":[4294967296,4294967296],"data_offsets":[0,16]}})", d16),
               {"'t'", "too large"}});
  c.push_back({"too many dims", raw_safetensors(R"({"t":{"dtype":"U8","shape":[1,1,1,1,1,1,1,1,1],"data_offsets":[0,1]}})", d16),
               {"'t'", "dimensions"}});
  c.push_back({"offsets not pair", raw_safetensors(R"({"t":{"dtype":"U8","shape":[4],"data_offsets":[0]}})", d16),
               {"'t'", "data_offsets"}});
  c.push_back({"begin > end", raw_safetensors(R"({"t":{"dtype":"U8","shape":[0],"data_offsets":[8,4]}})", d16),
               {"'t'", "begin > end"}});
  c.push_back({"past data end", raw_safetensors(R"({"t":{"dtype":"F32","shape":[8],"data_offsets":[0,32]}})", d16),
               {"'t'", "run past the end of the data", "truncated"}});
  c.push_back({"offset overflow", raw_safetensors(R"({"t":{"dtype":"U8","shape":[0],"data_offsets":[18446744073709551615,18446744073709551615]}})", d16),
               {"'t'"}});
  c.push_back({"size mismatch", raw_safetensors(R"({"t":{"dtype":"F32","shape":[3],"data_offsets":[0,16]}})", d16),
               {"'t'", "needs 12 bytes", "hold 16"}});
  c.push_back({"overlap", raw_safetensors(R"({"a":{"dtype":"F32","shape":[3],"data_offsets":[0,12]},)"
                                          R"("b":{"dtype":"F32","shape":[2],"data_offsets":[8,16]}})", d16),
               {"'a'", "'b'", "overlap"}});
  c.push_back({"duplicate", raw_safetensors(R"({"t":{"dtype":"F32","shape":[4],"data_offsets":[0,16]},)"
                                            R"("t":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}})", d16),
               {"'t'", "more than once"}});
  c.push_back({"metadata not strings", raw_safetensors(R"({"__metadata__":{"a":1}})", {}), {"__metadata__"}});
  return c;
}

TEST(SafetensorsFile, RejectsMalformedInputWithClearErrors) {
  for (const auto& c : bad_cases()) {
    SCOPED_TRACE(c.what);
    const std::string msg = parse_error(c.bytes);
    ASSERT_NE(msg, "") << "accepted";
    EXPECT_THAT(msg, ::testing::Not(HasSubstr("INTERNAL")));
    EXPECT_THAT(msg, HasSubstr("bad.safetensors"));
    for (const auto& s : c.substrings) EXPECT_THAT(msg, HasSubstr(s));
  }
}

TEST(SafetensorsFile, EveryTruncationOfAValidFileFailsCleanly) {
  SafetensorsWriter w;
  std::vector<uint8_t> a(24, 7), b(6, 9);
  w.add("a", DType::F32, Shape{2, 3}, a);
  w.add("b", DType::BF16, Shape{3}, b);
  TempDir tmp;
  w.write(tmp.file("x.safetensors"));
  const auto full = kiln::test::read_file(tmp.file("x.safetensors"));
  ASSERT_EQ(parse_error(full), "");
  for (size_t n = 0; n < full.size(); ++n) {
    std::vector<uint8_t> cut(full.begin(), full.begin() + n);
    cut.shrink_to_fit();
    EXPECT_NE(parse_error(cut), "") << "truncated to " << n << " bytes was accepted";
  }
}

// An independent reading of a written file: the header per the format spec, decoded by hand.
TEST(SafetensorsWriter, WritesSpecCompliantSortedAlignedFiles) {
  SafetensorsWriter w;
  std::vector<uint8_t> f32(4 * 3), bf16(2 * 5), u8(7), scalar(4);
  for (size_t i = 0; i < f32.size(); ++i) f32[i] = static_cast<uint8_t>(i);
  for (size_t i = 0; i < bf16.size(); ++i) bf16[i] = static_cast<uint8_t>(100 + i);
  for (size_t i = 0; i < u8.size(); ++i) u8[i] = static_cast<uint8_t>(200 + i);
  std::memcpy(scalar.data(), "\x00\x00\x80\x3f", 4);
  w.add("z.bf16", DType::BF16, Shape{5}, bf16);
  w.add("b.u8", DType::U8, Shape{7}, u8);
  w.add("m.f32", DType::F32, Shape{3}, f32);
  w.add_view("a.scalar", DType::F32, Shape{}, scalar);
  int fills = 0;
  w.add_generated("g.gen", DType::U8, Shape{2, 2}, [&](std::span<uint8_t> out) {
    ++fills;
    for (size_t i = 0; i < out.size(); ++i) out[i] = static_cast<uint8_t>(50 + i);
  });
  w.set_metadata("format", "pt");
  EXPECT_EQ(w.size(), 5u);
  EXPECT_EQ(w.total_bytes(), 12u + 10 + 7 + 4 + 4);
  TempDir tmp;
  w.write(tmp.file("out.safetensors"));
  EXPECT_EQ(fills, 1);
  EXPECT_FALSE(std::filesystem::exists(tmp.file("out.safetensors.tmp")));

  const auto bytes = kiln::test::read_file(tmp.file("out.safetensors"));
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | bytes[i];
  EXPECT_EQ((8 + n) % 8, 0u) << "data must start 8-byte aligned";
  const std::string header(bytes.begin() + 8, bytes.begin() + 8 + n);
  EXPECT_EQ(header.find_last_not_of(' ') + 1, header.find_last_of('}') + 1) << "padding is spaces";
  auto j = nlohmann::ordered_json::parse(header);
  // __metadata__ first, then data order: 4-byte elements, then 2-byte, then 1-byte; by name within a size.
  std::vector<std::string> keys;
  for (auto& [k, v] : j.items()) keys.push_back(k);
  EXPECT_EQ(keys, (std::vector<std::string>{"__metadata__", "a.scalar", "m.f32", "z.bf16", "b.u8", "g.gen"}));
  EXPECT_EQ(j["__metadata__"]["format"], "pt");
  EXPECT_EQ(j["a.scalar"]["data_offsets"], nlohmann::json::array({0, 4}));
  EXPECT_EQ(j["a.scalar"]["shape"], nlohmann::json::array());
  EXPECT_EQ(j["m.f32"]["data_offsets"], nlohmann::json::array({4, 16}));
  EXPECT_EQ(j["z.bf16"]["dtype"], "BF16");
  EXPECT_EQ(j["z.bf16"]["data_offsets"], nlohmann::json::array({16, 26}));
  EXPECT_EQ(j["b.u8"]["data_offsets"], nlohmann::json::array({26, 33}));
  EXPECT_EQ(j["g.gen"]["data_offsets"], nlohmann::json::array({33, 37}));
  EXPECT_EQ(bytes.size(), 8 + n + 37);
  const uint8_t* data = bytes.data() + 8 + n;
  EXPECT_EQ(std::vector<uint8_t>(data + 4, data + 16), f32);
  EXPECT_EQ(std::vector<uint8_t>(data + 16, data + 26), bf16);
  EXPECT_EQ(std::vector<uint8_t>(data + 26, data + 33), u8);
  EXPECT_EQ(data[33], 50);
  EXPECT_EQ(data[36], 53);

  // And the reader agrees.
  SafetensorsFile f({bytes.data(), bytes.size()}, "out");
  EXPECT_EQ(f.find("m.f32")->nbytes, 12u);
  EXPECT_EQ(f.find("g.gen")->shape, (Shape{2, 2}));
}

TEST(SafetensorsWriter, RejectsBadAdds) {
  SafetensorsWriter w;
  std::vector<uint8_t> four(4);
  w.add("a", DType::F32, Shape{1}, four);
  try {
    w.add("a", DType::F32, Shape{1}, four);
    FAIL();
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("'a' added twice"));
  }
  try {
    w.add("b", DType::F32, Shape{2}, four);
    FAIL();
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("'b'"));
    EXPECT_THAT(e.what(), HasSubstr("needs 8 bytes, got 4"));
  }
  EXPECT_THROW(w.write("/nonexistent-dir/x.safetensors"), Error);
}

TEST(SafetensorsWriter, ShardsAndIndex) {
  SafetensorsWriter w;
  std::vector<std::vector<uint8_t>> blobs;
  for (int i = 0; i < 10; ++i) {
    blobs.emplace_back(100, static_cast<uint8_t>(i));
    w.add("t" + std::to_string(i), DType::U8, Shape{100}, blobs.back());
  }
  TempDir tmp;
  auto files = w.write_sharded(tmp.path(), 250);  // two tensors per shard
  ASSERT_EQ(files.size(), 6u);
  EXPECT_EQ(files[0], "model-00001-of-00005.safetensors");
  EXPECT_EQ(files[4], "model-00005-of-00005.safetensors");
  EXPECT_EQ(files[5], "model.safetensors.index.json");
  auto index = nlohmann::json::parse(kiln::test::read_file(tmp.file("model.safetensors.index.json")));
  EXPECT_EQ(index["metadata"]["total_size"], 1000);
  EXPECT_EQ(index["weight_map"]["t0"], "model-00001-of-00005.safetensors");
  EXPECT_EQ(index["weight_map"]["t9"], "model-00005-of-00005.safetensors");

  kiln::test::write_text(tmp.file("config.json"), "{}");
  Checkpoint ck = Checkpoint::open(ModelDir::open(tmp.path()));
  EXPECT_EQ(ck.size(), 10u);
  EXPECT_EQ(ck.files().size(), 5u);
  EXPECT_EQ(ck.total_bytes(), 1000u);
  EXPECT_EQ(ck.bytes_by_dtype().at(DType::U8), 1000u);
  EXPECT_EQ(ck.get("t7").data[0], 7);
  EXPECT_EQ(ck.get("t7").file, "model-00004-of-00005.safetensors");

  // One shard only: plain model.safetensors, no index.
  TempDir one;
  auto single = w.write_sharded(one.path(), 1 << 20);
  EXPECT_EQ(single, (std::vector<std::string>{"model.safetensors"}));
}

class CheckpointErrors : public ::testing::Test {
 protected:
  void SetUp() override { kiln::test::write_text(tmp.file("config.json"), "{}"); }
  std::string open_error() {
    try {
      Checkpoint::open(ModelDir::open(tmp.path()));
      return "";
    } catch (const Error& e) {
      return e.what();
    }
  }
  void write_st(const std::string& name, std::vector<std::pair<std::string, uint8_t>> tensors) {
    SafetensorsWriter w;
    for (auto& [n, v] : tensors) w.add(n, DType::U8, Shape{2}, std::vector<uint8_t>{v, v});
    w.write(tmp.file(name));
  }
  TempDir tmp;
};

TEST_F(CheckpointErrors, NoWeights) { EXPECT_THAT(open_error(), HasSubstr("no *.safetensors")); }

TEST_F(CheckpointErrors, SeveralFilesWithoutIndexAreMerged) {
  write_st("a.safetensors", {{"x", 1}});
  write_st("b.safetensors", {{"y", 2}});
  EXPECT_EQ(open_error(), "");
  Checkpoint ck = Checkpoint::open(ModelDir::open(tmp.path()));
  EXPECT_EQ(ck.names(), (std::vector<std::string>{"x", "y"}));
}

TEST_F(CheckpointErrors, DuplicateAcrossFiles) {
  write_st("a.safetensors", {{"x", 1}});
  write_st("b.safetensors", {{"x", 2}});
  const std::string msg = open_error();
  EXPECT_THAT(msg, HasSubstr("'x' is stored twice"));
  EXPECT_THAT(msg, HasSubstr("a.safetensors"));
  EXPECT_THAT(msg, HasSubstr("b.safetensors"));
}

TEST_F(CheckpointErrors, IndexedShardMissing) {
  write_st("s1.safetensors", {{"x", 1}});
  kiln::test::write_text(tmp.file("model.safetensors.index.json"),
                         R"({"weight_map": {"x": "s1.safetensors", "y": "s2.safetensors"}})");
  const std::string msg = open_error();
  EXPECT_THAT(msg, HasSubstr("shard 's2.safetensors'"));
  EXPECT_THAT(msg, HasSubstr("'y'"));
  EXPECT_THAT(msg, HasSubstr("missing"));
}

TEST_F(CheckpointErrors, IndexedTensorNotInShard) {
  write_st("s1.safetensors", {{"x", 1}});
  kiln::test::write_text(tmp.file("model.safetensors.index.json"),
                         R"({"weight_map": {"x": "s1.safetensors", "y": "s1.safetensors"}})");
  EXPECT_THAT(open_error(), HasSubstr("tensor 'y' is indexed to shard 's1.safetensors' but that shard does not contain it"));
}

TEST_F(CheckpointErrors, TensorInOtherShardThanIndexed) {
  write_st("s1.safetensors", {{"x", 1}});
  write_st("s2.safetensors", {{"y", 1}});
  kiln::test::write_text(tmp.file("model.safetensors.index.json"),
                         R"({"weight_map": {"x": "s2.safetensors", "y": "s1.safetensors"}})");
  EXPECT_THAT(open_error(), HasSubstr("is indexed to"));
}

TEST_F(CheckpointErrors, IndexEscapingTheFolder) {
  kiln::test::write_text(tmp.file("model.safetensors.index.json"), R"({"weight_map": {"x": "../evil.safetensors"}})");
  EXPECT_THAT(open_error(), HasSubstr("not a plain file name"));
}

TEST_F(CheckpointErrors, BadIndexJson) {
  kiln::test::write_text(tmp.file("model.safetensors.index.json"), R"({"weight_map": [)");
  EXPECT_THAT(open_error(), HasSubstr("model.safetensors.index.json: not valid JSON"));
  kiln::test::write_text(tmp.file("model.safetensors.index.json"), R"({"metadata": {}})");
  EXPECT_THAT(open_error(), HasSubstr("weight_map"));
}

TEST_F(CheckpointErrors, CorruptShardNamesTheFile) {
  kiln::test::write_file(tmp.file("model.safetensors"), {1, 2, 3, 4, 5, 6, 7, 8, 9});
  EXPECT_THAT(open_error(), HasSubstr("model.safetensors"));
}

TEST_F(CheckpointErrors, GetMissingNamesTensor) {
  write_st("model.safetensors", {{"x", 1}});
  Checkpoint ck = Checkpoint::open(ModelDir::open(tmp.path()));
  EXPECT_EQ(ck.find("nope"), nullptr);
  try {
    ck.get("model.layers.0.mlp.gate.weight");
    FAIL();
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("no tensor 'model.layers.0.mlp.gate.weight'"));
  }
}

TEST(Checkpoint, ViewsOutliveTheModelDirHandle) {
  TempDir tmp;
  kiln::test::write_text(tmp.file("config.json"), "{}");
  SafetensorsWriter w;
  w.add("x", DType::U8, Shape{3}, std::vector<uint8_t>{4, 5, 6});
  w.write(tmp.file("model.safetensors"));
  Checkpoint ck = [&] { return Checkpoint::open(ModelDir::open(tmp.path())); }();  // dir handle gone
  auto span = ck.dir().map("model.safetensors");
  const TensorInfo& x = ck.get("x");
  EXPECT_GE(x.data, span.data());
  EXPECT_LE(x.data + x.nbytes, span.data() + span.size());
  EXPECT_EQ(x.data[2], 6);
}

}  // namespace
}  // namespace kiln::format
