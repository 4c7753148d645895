#include "model/tp_wire.h"

#include <bit>
#include <cstring>
#include <utility>

#include <fmt/format.h>

#include "core/error.h"

namespace kiln::model::wire {

static_assert(std::endian::native == std::endian::little, "the wire is little-endian; a big-endian host must swap");

namespace {

constexpr char kHelloMagic[8] = {'K', 'I', 'L', 'N', 'R', 'D', 'V', '2'};

StepKind step_kind(Reader& r) {
  const uint8_t k = r.u8("kind");
  if (k < uint8_t(StepKind::logits) || k > uint8_t(StepKind::copy_state))
    r.fail_field("kind", fmt::format("unknown step kind {}", k));
  return static_cast<StepKind>(k);
}

}  // namespace

std::string message_name(Message type) {
  switch (type) {
    case Message::rendezvous_hello: return "rendezvous_hello";
    case Message::rendezvous_answer: return "rendezvous_answer";
    case Message::capacity: return "capacity";
    case Message::ready: return "ready";
    case Message::step: return "step";
    case Message::reply: return "reply";
    case Message::stop: return "stop";
    case Message::collective_up: return "collective_up";
    case Message::collective_down: return "collective_down";
  }
  return fmt::format("unknown message 0x{:02x}", static_cast<unsigned>(type));
}

bool is_known_message(uint8_t type) {
  return message_name(static_cast<Message>(type)).rfind("unknown", 0) != 0;
}

std::array<uint8_t, kFrameHeaderBytes> encode_frame_header(Message type, uint64_t payload_bytes) {
  std::array<uint8_t, kFrameHeaderBytes> h{};
  h[0] = static_cast<uint8_t>(type);
  std::memcpy(h.data() + 1, &payload_bytes, sizeof(payload_bytes));
  return h;
}

FrameHeader decode_frame_header(std::span<const uint8_t, kFrameHeaderBytes> head, uint64_t max_payload_bytes) {
  if (!is_known_message(head[0]))
    fail("frame of unknown message type 0x{:02x}: the peer is not a kiln node of this version", unsigned(head[0]));
  FrameHeader h;
  h.type = static_cast<Message>(head[0]);
  std::memcpy(&h.payload_bytes, head.data() + 1, sizeof(h.payload_bytes));
  if (h.payload_bytes > max_payload_bytes)
    fail("{} frame of {} bytes, more than the {} allowed: the peer is not a kiln node of this version",
         message_name(h.type), h.payload_bytes, max_payload_bytes);
  return h;
}

// ---- Writer / Reader

void Writer::append(const void* p, size_t n) {
  const auto* b = static_cast<const uint8_t*>(p);
  if (n) out_.insert(out_.end(), b, b + n);
}

Writer& Writer::string(std::string_view s) {
  u32(static_cast<uint32_t>(s.size()));
  append(s.data(), s.size());
  return *this;
}

Writer& Writer::bytes(std::span<const uint8_t> b) {
  scalar<uint64_t>(b.size());
  append(b.data(), b.size());
  return *this;
}

void Reader::fail_field(const char* field, const std::string& why) const {
  fail("{}: field '{}' at byte {} of {}: {}", message_, field, at_, in_.size(), why);
}

void Reader::check_count(const char* field, uint32_t count, size_t min_bytes_each) const {
  const size_t left = in_.size() - at_;
  if (count > left / min_bytes_each)
    fail_field(field, fmt::format("cut short ({} items of at least {} bytes each, {} bytes left)", count,
                                  min_bytes_each, left));
}

void Reader::take(void* out, size_t count, size_t size, const char* field) {
  const size_t left = in_.size() - at_;
  if (count > left / size)  // no overflow: count * size > left
    fail_field(field, fmt::format("cut short ({} x {} bytes needed, {} left)", count, size, left));
  if (count) std::memcpy(out, in_.data() + at_, count * size);
  at_ += count * size;
}

bool Reader::flag(const char* field) {
  const uint8_t v = u8(field);
  if (v > 1) fail_field(field, fmt::format("{} is neither 0 nor 1", v));
  return v == 1;
}

std::string Reader::string(const char* field) {
  const uint32_t n = u32(field);
  check_count(field, n, 1);  // before allocating
  std::string s(n, '\0');
  take(s.data(), n, 1, field);
  return s;
}

std::span<const uint8_t> Reader::bytes(const char* field) {
  uint64_t n = 0;
  take(&n, 1, sizeof(n), field);
  if (n > in_.size() - at_) fail_field(field, fmt::format("cut short ({} bytes needed, {} left)", n, in_.size() - at_));
  const auto view = in_.subspan(at_, static_cast<size_t>(n));
  at_ += static_cast<size_t>(n);
  return view;
}

void Reader::finish() const {
  if (at_ != in_.size())
    fail("{}: {} bytes left over after byte {} of {}: the peer runs another kiln version", message_, in_.size() - at_,
         at_, in_.size());
}

// ---- rendezvous

std::vector<uint8_t> encode_node_hello(const NodeHello& h) {
  Writer w;
  for (char c : kHelloMagic) w.u8(static_cast<uint8_t>(c));
  w.i32(h.node_rank).i32(h.nnodes).i32(h.tp_size).string(h.fingerprint);
  return w.take();
}

NodeHello decode_node_hello(std::span<const uint8_t> payload) {
  Reader r(payload, "rendezvous hello");
  for (char c : kHelloMagic)
    if (r.u8("magic") != static_cast<uint8_t>(c)) r.fail_field("magic", "not a kiln rendezvous of this version");
  NodeHello h;
  h.node_rank = r.i32("node_rank");
  h.nnodes = r.i32("nnodes");
  h.tp_size = r.i32("tp_size");
  h.fingerprint = r.string("fingerprint");
  r.finish();
  return h;
}

std::vector<uint8_t> encode_rendezvous_answer(const RendezvousAnswer& a) {
  Writer w;
  w.flag(a.accepted);
  if (a.accepted)
    w.bytes(a.blob);
  else
    w.string(a.refusal);
  return w.take();
}

RendezvousAnswer decode_rendezvous_answer(std::span<const uint8_t> payload) {
  Reader r(payload, "rendezvous answer");
  RendezvousAnswer a;
  a.accepted = r.flag("accepted");
  if (a.accepted) {
    const auto blob = r.bytes("blob");
    a.blob.assign(blob.begin(), blob.end());
  } else {
    a.refusal = r.string("refusal");
  }
  r.finish();
  return a;
}

// ---- capacity

std::string NodeCapacity::describe() const {
  return fmt::format("{} KV pages of {} tokens, {} state slots, context {}, vocabulary {}", kv_pages, page_size,
                     state_slots, max_context, vocab);
}

NodeCapacity node_capacity(const RunnerCapacity& c, int64_t vocab) {
  return NodeCapacity{c.kv_pages, c.page_size, c.state_slots, c.max_context, vocab};
}

namespace {
// The capacity message: these fields as i64s, in this order (the names are the decoder's field names).
constexpr std::pair<const char*, int64_t NodeCapacity::*> kCapacityFields[] = {
    {"kv_pages", &NodeCapacity::kv_pages},       {"page_size", &NodeCapacity::page_size},
    {"state_slots", &NodeCapacity::state_slots}, {"max_context", &NodeCapacity::max_context},
    {"vocab", &NodeCapacity::vocab}};
}  // namespace

std::vector<uint8_t> encode_node_capacity(const NodeCapacity& c) {
  Writer w;
  for (const auto& [name, field] : kCapacityFields) w.i64(c.*field);
  return w.take();
}

NodeCapacity decode_node_capacity(std::span<const uint8_t> payload) {
  Reader r(payload, "capacity");
  NodeCapacity c;
  for (const auto& [name, field] : kCapacityFields) c.*field = r.i64(name);
  r.finish();
  return c;
}

// ---- steps

std::vector<uint8_t> encode_step(StepKind kind, std::span<const SeqChunk> chunks) {
  KILN_CHECK(kind != StepKind::copy_state, "encode_copy_state encodes state copies");
  Writer w;
  w.u8(static_cast<uint8_t>(kind)).u32(static_cast<uint32_t>(chunks.size()));
  for (const SeqChunk& c : chunks) {
    if (!c.mrope_pos.empty() || !c.embed_offsets.empty())
      fail("image inputs are not supported across machines yet (--nnodes > 1): serve images on one machine");
    KILN_CHECK(c.snapshots.empty(), "snapshots inside chunks do not cross machines (TpRunner::chunk_snapshots)");
    w.i32(c.state_slot).i64(c.start_pos).flag(c.want_logits);
    w.array(c.tokens).array(c.page_table);
  }
  return w.take();
}

std::vector<uint8_t> encode_copy_state(int src_slot, int dst_slot) {
  Writer w;
  w.u8(static_cast<uint8_t>(StepKind::copy_state)).i32(src_slot).i32(dst_slot);
  return w.take();
}

int64_t Step::rows() const {
  int64_t n = 0;
  for (const SeqChunk& c : chunks) n += c.want_logits ? 1 : 0;
  return n;
}

Step decode_step(std::span<const uint8_t> payload) {
  Reader r(payload, "step");
  Step s;
  s.kind = step_kind(r);
  if (s.kind == StepKind::copy_state) {
    s.src_slot = r.i32("src_slot");
    s.dst_slot = r.i32("dst_slot");
    r.finish();
    return s;
  }
  const uint32_t n = r.u32("chunks");
  r.check_count("chunks", n, 4 + 8 + 1 + 4 + 4);
  s.chunks.resize(n);
  s.tokens.resize(n);
  s.pages.resize(n);
  for (uint32_t i = 0; i < n; ++i) {
    SeqChunk& c = s.chunks[i];
    c.state_slot = r.i32("state_slot");
    c.start_pos = r.i64("start_pos");
    c.want_logits = r.flag("want_logits");
    s.tokens[i] = r.array<int32_t>("tokens");
    s.pages[i] = r.array<int32_t>("page_table");
    c.tokens = s.tokens[i];
    c.page_table = s.pages[i];
  }
  r.finish();
  return s;
}

std::vector<uint8_t> encode_step_reply(const StepReply& reply) {
  Writer w;
  w.flag(reply.ok);
  if (!reply.ok) {
    w.string(reply.error);
    return w.take();
  }
  w.u8(static_cast<uint8_t>(reply.kind));
  if (reply.kind == StepKind::logits) {
    w.u32(static_cast<uint32_t>(reply.logits.size()));
    for (const auto& l : reply.logits) w.array<float>(l);
  } else if (reply.kind == StepKind::argmax) {
    KILN_CHECK(reply.best_values.size() == reply.best_ids.size());
    w.u32(static_cast<uint32_t>(reply.best_ids.size()));
    for (size_t i = 0; i < reply.best_ids.size(); ++i)
      w.array<float>(reply.best_values[i]).array<int32_t>(reply.best_ids[i]);
  }
  return w.take();
}

StepReply decode_step_reply(std::span<const uint8_t> payload) {
  Reader r(payload, "step reply");
  StepReply s;
  s.ok = r.flag("ok");
  if (!s.ok) {
    s.error = r.string("error");
    r.finish();
    return s;
  }
  s.kind = step_kind(r);
  if (s.kind != StepKind::copy_state) {
    const uint32_t ranks = r.u32("ranks");
    r.check_count("ranks", ranks, 4);
    for (uint32_t i = 0; i < ranks; ++i) {
      if (s.kind == StepKind::logits) {
        s.logits.push_back(r.array<float>("logits"));
      } else {
        s.best_values.push_back(r.array<float>("best_values"));
        s.best_ids.push_back(r.array<int32_t>("best_ids"));
        if (s.best_values.back().size() != s.best_ids.back().size())
          r.fail_field("best_ids", fmt::format("{} ids for {} values", s.best_ids.back().size(),
                                               s.best_values.back().size()));
      }
    }
  }
  r.finish();
  return s;
}

// ---- collectives

std::vector<uint8_t> encode_collective(CollectiveOp op, int64_t count,
                                       std::span<const std::span<const uint8_t>> parts) {
  Writer w;
  w.u8(static_cast<uint8_t>(op)).i64(count).u32(static_cast<uint32_t>(parts.size()));
  for (const auto& p : parts) w.bytes(p);
  return w.take();
}

CollectiveView decode_collective(std::span<const uint8_t> payload, const std::string& message) {
  Reader r(payload, message);
  CollectiveView v;
  const uint8_t op = r.u8("op");
  if (op != uint8_t(CollectiveOp::all_reduce) && op != uint8_t(CollectiveOp::all_gather))
    r.fail_field("op", fmt::format("unknown collective {}", op));
  v.op = static_cast<CollectiveOp>(op);
  v.count = r.i64("count");
  const uint32_t n = r.u32("parts");
  r.check_count("parts", n, 8);
  for (uint32_t i = 0; i < n; ++i) v.parts.push_back(r.bytes("part"));
  r.finish();
  return v;
}

}  // namespace kiln::model::wire
