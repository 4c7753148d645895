// The multi-node wire (model/tp_wire.h): every message round-trips, and a message cut short, with bytes left over, or
// with a bad enum value is refused with an error naming the message and the field.
#include "model/tp_wire.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstring>

#include "core/error.h"

namespace kiln::model::wire {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;
using ::testing::ThrowsMessage;

// Every strict prefix of a message must be refused as cut short.
template <class Decode>
void expect_every_prefix_refused(const std::vector<uint8_t>& msg, Decode decode) {
  for (size_t n = 0; n < msg.size(); ++n) {
    const std::vector<uint8_t> cut(msg.begin(), msg.begin() + static_cast<std::ptrdiff_t>(n));
    EXPECT_THAT([&] { decode(cut); }, ThrowsMessage<Error>(HasSubstr("cut short"))) << "prefix of " << n << " bytes";
  }
}

TEST(TpWire, FieldsAreLittleEndianFixedWidth) {
  Writer w;
  w.u8(0xab).i32(-2).u32(0x01020304).i64(0x1122334455667788);
  const std::vector<uint8_t> want = {0xab, 0xfe, 0xff, 0xff, 0xff, 0x04, 0x03, 0x02, 0x01,
                                     0x88, 0x77, 0x66, 0x55, 0x44, 0x33, 0x22, 0x11};
  EXPECT_EQ(w.data(), want);
  Reader r(w.data(), "test");
  EXPECT_EQ(r.u8("a"), 0xab);
  EXPECT_EQ(r.i32("b"), -2);
  EXPECT_EQ(r.u32("c"), 0x01020304u);
  EXPECT_EQ(r.i64("d"), 0x1122334455667788);
  r.finish();
}

TEST(TpWire, StringsArraysAndBytesCarryTheirLength) {
  Writer w;
  const std::vector<int32_t> ids = {7, -1, 1 << 30};
  const std::vector<uint8_t> blob = {1, 2, 3};
  w.string("héllo").array<int32_t>(ids).bytes(blob).string("");
  Reader r(w.data(), "test");
  EXPECT_EQ(r.string("s"), "héllo");
  EXPECT_EQ(r.array<int32_t>("ids"), ids);
  const auto view = r.bytes("blob");
  EXPECT_EQ(std::vector<uint8_t>(view.begin(), view.end()), blob);
  EXPECT_EQ(r.string("empty"), "");
  r.finish();
}

TEST(TpWire, ReaderNamesTheMessageFieldAndOffsets) {
  const std::vector<uint8_t> three = {1, 2, 3};
  Reader r(three, "step from node 0");
  r.u8("kind");
  EXPECT_THAT([&] { r.i32("state_slot"); },
              ThrowsMessage<Error>(AllOf(HasSubstr("step from node 0"), HasSubstr("'state_slot'"),
                                         HasSubstr("byte 1 of 3"), HasSubstr("cut short"))));
  Reader left(three, "capacity");
  left.u8("a");
  EXPECT_THAT([&] { left.finish(); },
              ThrowsMessage<Error>(AllOf(HasSubstr("capacity"), HasSubstr("2 bytes left over"))));
}

TEST(TpWire, HugeCountsAreRefusedBeforeAllocating) {
  // A count of 2^32 - 1 elements in a 4-byte message: refused, not a 16 GiB allocation.
  Writer w;
  w.u32(0xffffffffu);
  Reader r(w.data(), "test");
  EXPECT_THAT([&] { r.array<float>("logits"); }, ThrowsMessage<Error>(HasSubstr("cut short")));
  Reader rs(w.data(), "test");
  EXPECT_THAT([&] { rs.string("fingerprint"); }, ThrowsMessage<Error>(HasSubstr("cut short")));
  Writer b;
  b.i64(-1);  // a byte block of 2^64 - 1 bytes
  Reader rb(b.data(), "test");
  EXPECT_THAT([&] { rb.bytes("blob"); }, ThrowsMessage<Error>(HasSubstr("cut short")));
}

TEST(TpWire, FrameHeaderRoundTripsAndRefusesStrangers) {
  const auto head = encode_frame_header(Message::collective_up, 1234567);
  EXPECT_EQ(head[0], 0x41);
  const FrameHeader h = decode_frame_header(head, 1 << 30);
  EXPECT_EQ(h.type, Message::collective_up);
  EXPECT_EQ(h.payload_bytes, 1234567u);
  EXPECT_THAT([&] { decode_frame_header(head, 1000); },
              ThrowsMessage<Error>(AllOf(HasSubstr("collective_up frame of 1234567 bytes"), HasSubstr("1000"))));
  // "GET / HTTP" is not a kiln frame.
  const std::array<uint8_t, kFrameHeaderBytes> http = {'G', 'E', 'T', ' ', '/', ' ', 'H', 'T', 'T'};
  EXPECT_THAT([&] { decode_frame_header(http, 1 << 30); },
              ThrowsMessage<Error>(HasSubstr("unknown message type 0x47")));
  for (Message m : {Message::rendezvous_hello, Message::rendezvous_answer, Message::capacity, Message::ready,
                    Message::step, Message::reply, Message::stop, Message::collective_up, Message::collective_down}) {
    EXPECT_TRUE(is_known_message(static_cast<uint8_t>(m))) << message_name(m);
    EXPECT_EQ(decode_frame_header(encode_frame_header(m, 0), 0).type, m);
  }
  EXPECT_FALSE(is_known_message(0));
  EXPECT_EQ(message_name(static_cast<Message>(0x7f)), "unknown message 0x7f");
}

TEST(TpWire, NodeHelloRoundTripsAndChecksTheMagic) {
  const NodeHello h{2, 4, 8, "qwen3_5_moe: 60 layers"};
  const std::vector<uint8_t> msg = encode_node_hello(h);
  const NodeHello back = decode_node_hello(msg);
  EXPECT_EQ(back.node_rank, 2);
  EXPECT_EQ(back.nnodes, 4);
  EXPECT_EQ(back.tp_size, 8);
  EXPECT_EQ(back.fingerprint, h.fingerprint);
  expect_every_prefix_refused(msg, [](const std::vector<uint8_t>& m) { decode_node_hello(m); });
  std::vector<uint8_t> other = msg;
  other[7] = '1';  // an older rendezvous
  EXPECT_THAT([&] { decode_node_hello(other); },
              ThrowsMessage<Error>(AllOf(HasSubstr("'magic'"), HasSubstr("not a kiln rendezvous"))));
  std::vector<uint8_t> longer = msg;
  longer.push_back(0);
  EXPECT_THAT([&] { decode_node_hello(longer); }, ThrowsMessage<Error>(HasSubstr("left over")));
}

TEST(TpWire, RendezvousAnswerCarriesTheBlobOrTheRefusal) {
  const RendezvousAnswer yes{true, {9, 8, 7, 0}, {}};
  const RendezvousAnswer yes_back = decode_rendezvous_answer(encode_rendezvous_answer(yes));
  EXPECT_TRUE(yes_back.accepted);
  EXPECT_EQ(yes_back.blob, yes.blob);
  const RendezvousAnswer no{false, {}, "the nodes disagree"};
  const RendezvousAnswer no_back = decode_rendezvous_answer(encode_rendezvous_answer(no));
  EXPECT_FALSE(no_back.accepted);
  EXPECT_EQ(no_back.refusal, "the nodes disagree");
  std::vector<uint8_t> bad = encode_rendezvous_answer(yes);
  bad[0] = 2;
  EXPECT_THAT([&] { decode_rendezvous_answer(bad); }, ThrowsMessage<Error>(HasSubstr("2 is neither 0 nor 1")));
  expect_every_prefix_refused(encode_rendezvous_answer(yes),
                              [](const std::vector<uint8_t>& m) { decode_rendezvous_answer(m); });
}

TEST(TpWire, NodeCapacityRoundTripsAndDescribesItself) {
  RunnerCapacity rc;
  rc.kv_pages = 1000;
  rc.page_size = 16;
  rc.state_slots = 48;
  rc.max_context = 262144;
  const NodeCapacity c = node_capacity(rc, 248320);
  const std::vector<uint8_t> msg = encode_node_capacity(c);
  EXPECT_EQ(msg.size(), 5u * 8u);
  EXPECT_EQ(decode_node_capacity(msg), c);
  EXPECT_EQ(c.describe(), "1000 KV pages of 16 tokens, 48 state slots, context 262144, vocabulary 248320");
  expect_every_prefix_refused(msg, [](const std::vector<uint8_t>& m) { decode_node_capacity(m); });
}

TEST(TpWire, StepRoundTripsEveryChunkField) {
  const std::vector<int32_t> t0 = {1, 2, 3}, p0 = {5}, t1 = {}, p1 = {6, 7};
  std::vector<SeqChunk> chunks(2);
  chunks[0] = SeqChunk{3, t0, 0, p0, true};
  chunks[1] = SeqChunk{-1, t1, 40, p1, false};
  for (StepKind kind : {StepKind::logits, StepKind::argmax}) {
    const std::vector<uint8_t> msg = encode_step(kind, chunks);
    Step s = decode_step(msg);
    EXPECT_EQ(s.kind, kind);
    ASSERT_EQ(s.chunks.size(), 2u);
    EXPECT_EQ(s.rows(), 1);
    for (size_t i = 0; i < 2; ++i) {
      EXPECT_EQ(s.chunks[i].state_slot, chunks[i].state_slot);
      EXPECT_EQ(s.chunks[i].start_pos, chunks[i].start_pos);
      EXPECT_EQ(s.chunks[i].want_logits, chunks[i].want_logits);
      EXPECT_EQ(std::vector<int32_t>(s.chunks[i].tokens.begin(), s.chunks[i].tokens.end()),
                std::vector<int32_t>(chunks[i].tokens.begin(), chunks[i].tokens.end()));
      EXPECT_EQ(std::vector<int32_t>(s.chunks[i].page_table.begin(), s.chunks[i].page_table.end()),
                std::vector<int32_t>(chunks[i].page_table.begin(), chunks[i].page_table.end()));
    }
    // The chunks' views stay valid when the step moves.
    Step moved = std::move(s);
    EXPECT_EQ(moved.chunks[0].tokens[2], 3);
    expect_every_prefix_refused(msg, [](const std::vector<uint8_t>& m) { decode_step(m); });
  }
  const Step copy = decode_step(encode_copy_state(4, 9));
  EXPECT_EQ(copy.kind, StepKind::copy_state);
  EXPECT_EQ(copy.src_slot, 4);
  EXPECT_EQ(copy.dst_slot, 9);
}

TEST(TpWire, CorruptStepsAreRefused) {
  const std::vector<int32_t> t = {1}, p = {0};
  const SeqChunk c{0, t, 0, p, true};
  std::vector<uint8_t> msg = encode_step(StepKind::logits, std::span(&c, 1));
  std::vector<uint8_t> kind = msg;
  kind[0] = 9;
  EXPECT_THAT([&] { decode_step(kind); },
              ThrowsMessage<Error>(AllOf(HasSubstr("'kind'"), HasSubstr("unknown step kind 9"))));
  std::vector<uint8_t> want = msg;
  want[1 + 4 + 4 + 8] = 5;  // kind, chunk count, state_slot, start_pos, then want_logits
  EXPECT_THAT([&] { decode_step(want); }, ThrowsMessage<Error>(HasSubstr("'want_logits'")));
  std::vector<uint8_t> many = msg;
  const uint32_t n = 0x7fffffff;
  std::memcpy(many.data() + 1, &n, 4);
  EXPECT_THAT([&] { decode_step(many); }, ThrowsMessage<Error>(AllOf(HasSubstr("'chunks'"), HasSubstr("cut short"))));
}

TEST(TpWire, StepRepliesRoundTrip) {
  StepReply logits;
  logits.kind = StepKind::logits;
  logits.logits = {{1.5f, -2.0f}, {}, {3.25f}};
  const StepReply l = decode_step_reply(encode_step_reply(logits));
  EXPECT_TRUE(l.ok);
  EXPECT_EQ(l.kind, StepKind::logits);
  EXPECT_EQ(l.logits, logits.logits);

  StepReply best;
  best.kind = StepKind::argmax;
  best.best_values = {{0.5f, 9.0f}};
  best.best_ids = {{17, 248319}};
  const std::vector<uint8_t> best_msg = encode_step_reply(best);
  const StepReply b = decode_step_reply(best_msg);
  EXPECT_EQ(b.kind, StepKind::argmax);
  EXPECT_EQ(b.best_values, best.best_values);
  EXPECT_EQ(b.best_ids, best.best_ids);
  expect_every_prefix_refused(best_msg, [](const std::vector<uint8_t>& m) { decode_step_reply(m); });

  StepReply failed;
  failed.ok = false;
  failed.error = "out of memory on rank 3";
  const StepReply f = decode_step_reply(encode_step_reply(failed));
  EXPECT_FALSE(f.ok);
  EXPECT_EQ(f.error, failed.error);

  StepReply copied;
  copied.kind = StepKind::copy_state;
  EXPECT_EQ(decode_step_reply(encode_step_reply(copied)).kind, StepKind::copy_state);
}

TEST(TpWire, ArgmaxReplyWithMismatchedIdsIsRefused) {
  Writer w;
  w.u8(1).u8(static_cast<uint8_t>(StepKind::argmax)).u32(1);
  const std::vector<float> values = {1.0f, 2.0f};
  const std::vector<int32_t> ids = {4};
  w.array<float>(values).array<int32_t>(ids);
  EXPECT_THAT([&] { decode_step_reply(w.data()); }, ThrowsMessage<Error>(HasSubstr("1 ids for 2 values")));
}

TEST(TpWire, CollectivesRoundTripAsViews) {
  const std::vector<float> a = {1.0f, 2.0f}, b = {3.0f, 4.0f};
  const std::vector<std::span<const uint8_t>> parts = {std::span(reinterpret_cast<const uint8_t*>(a.data()), 8),
                                                       std::span(reinterpret_cast<const uint8_t*>(b.data()), 8)};
  const std::vector<uint8_t> msg = encode_collective(CollectiveOp::all_reduce, 2, parts);
  const CollectiveView v = decode_collective(msg, "collective inputs from node 1");
  EXPECT_EQ(v.op, CollectiveOp::all_reduce);
  EXPECT_EQ(v.count, 2);
  ASSERT_EQ(v.parts.size(), 2u);
  float back[2];
  std::memcpy(back, v.parts[1].data(), 8);
  EXPECT_EQ(back[0], 3.0f);
  EXPECT_EQ(back[1], 4.0f);
  expect_every_prefix_refused(msg, [](const std::vector<uint8_t>& m) { decode_collective(m, "collective"); });
  std::vector<uint8_t> bad = msg;
  bad[0] = 7;
  EXPECT_THAT([&] { decode_collective(bad, "collective inputs from node 1"); },
              ThrowsMessage<Error>(
                  AllOf(HasSubstr("collective inputs from node 1"), HasSubstr("unknown collective 7"))));
}

}  // namespace
}  // namespace kiln::model::wire
