// The wire of a tensor-parallel group that spans machines (--nnodes > 1): every message the nodes exchange, from the
// startup rendezvous (backend/rendezvous.h) to the steps of TpRunner (tp_runner.h) and the host collectives
// (backend/comm_net.h), in one place: one message enum, one frame header, one writer / reader of typed fields.
//
// Encoding: little-endian fixed-width integers and IEEE floats; a string or array is a u32 count then its elements;
// a byte block is a u64 length then its bytes. A frame on a connection is [type u8][payload length u64][payload].
// Decoding checks every bound: a message cut short, with bytes left over, with an unknown type or enum value, is a
// kiln::Error that names the message, the field and the offsets (the nodes run different kiln versions, or the
// stream is out of step). Nothing here does I/O; node_link.h moves the frames.
#pragma once
#include <array>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "model/model_runner.h"

namespace kiln::model::wire {

// Every message type on the group's connections. A connection carries only these; anything else is a peer that is
// not a kiln node of this version.
enum class Message : uint8_t {
  rendezvous_hello = 0x01,   // node -> node 0, at startup: NodeHello
  rendezvous_answer = 0x02,  // node 0 -> node: RendezvousAnswer (node 0's blob, or why it refused the node)
  capacity = 0x11,           // node -> node 0, after loading: NodeCapacity (node 0 refuses a mismatch)
  ready = 0x12,              // node 0 -> node: the group starts (empty)
  step = 0x13,               // node 0 -> node: a step (encode_step / encode_copy_state)
  reply = 0x14,              // node -> node 0: StepReply
  stop = 0x15,               // node 0 -> node: the group stops (empty)
  collective_up = 0x41,      // node -> node 0: its ranks' inputs of a collective (encode_collective)
  collective_down = 0x42,    // node 0 -> node: the collective's result (encode_collective, one part)
};
// "step", "collective_up", ...; "unknown message 0x7f" for a value outside the enum.
std::string message_name(Message type);
bool is_known_message(uint8_t type);

// ---- frames

inline constexpr size_t kFrameHeaderBytes = 9;
struct FrameHeader {
  Message type = Message::stop;
  uint64_t payload_bytes = 0;
};
std::array<uint8_t, kFrameHeaderBytes> encode_frame_header(Message type, uint64_t payload_bytes);
// kiln::Error when the type is unknown or the payload is longer than max_payload_bytes.
FrameHeader decode_frame_header(std::span<const uint8_t, kFrameHeaderBytes> head, uint64_t max_payload_bytes);

// ---- fields

class Writer {
 public:
  Writer& u8(uint8_t v) { return scalar(v); }
  Writer& flag(bool v) { return u8(v ? 1 : 0); }
  Writer& i32(int32_t v) { return scalar(v); }
  Writer& u32(uint32_t v) { return scalar(v); }
  Writer& i64(int64_t v) { return scalar(v); }
  Writer& string(std::string_view s);
  Writer& bytes(std::span<const uint8_t> b);  // u64 length + bytes
  template <class T>
  Writer& array(std::span<const T> v) {  // u32 count + elements
    u32(static_cast<uint32_t>(v.size()));
    append(v.data(), v.size_bytes());
    return *this;
  }
  const std::vector<uint8_t>& data() const { return out_; }
  std::vector<uint8_t> take() { return std::move(out_); }

 private:
  template <class T>
  Writer& scalar(T v) {
    append(&v, sizeof(T));
    return *this;
  }
  void append(const void* p, size_t n);
  std::vector<uint8_t> out_;
};

// Reads the fields of one message in order. `message` names it in errors ("step from node 0").
class Reader {
 public:
  Reader(std::span<const uint8_t> in, std::string message) : in_(in), message_(std::move(message)) {}
  uint8_t u8(const char* field) { return scalar<uint8_t>(field); }
  bool flag(const char* field);  // a u8 that must be 0 or 1
  int32_t i32(const char* field) { return scalar<int32_t>(field); }
  uint32_t u32(const char* field) { return scalar<uint32_t>(field); }
  int64_t i64(const char* field) { return scalar<int64_t>(field); }
  std::string string(const char* field);
  std::span<const uint8_t> bytes(const char* field);  // a view into the message
  template <class T>
  std::vector<T> array(const char* field) {
    const uint32_t n = u32(field);
    check_count(field, n, sizeof(T));  // before allocating
    std::vector<T> v(n);
    take(v.data(), size_t(n), sizeof(T), field);
    return v;
  }
  // kiln::Error when `count` items of at least min_bytes_each cannot fit in what is left (checked before allocating
  // for a count read from the message).
  void check_count(const char* field, uint32_t count, size_t min_bytes_each) const;
  // kiln::Error when bytes are left over (a longer message than this version writes).
  void finish() const;
  size_t offset() const { return at_; }
  [[noreturn]] void fail_field(const char* field, const std::string& why) const;

 private:
  template <class T>
  T scalar(const char* field) {
    T v;
    take(&v, 1, sizeof(T), field);
    return v;
  }
  void take(void* out, size_t count, size_t size, const char* field);
  std::span<const uint8_t> in_;
  std::string message_;
  size_t at_ = 0;
};

// ---- the messages

// What a node says at the rendezvous; node 0 checks that every node agrees with it.
struct NodeHello {
  int node_rank = 0;
  int nnodes = 1;
  int tp_size = 1;
  std::string fingerprint;  // the model and launch (backend/rendezvous.h)
};
std::vector<uint8_t> encode_node_hello(const NodeHello& hello);
// kiln::Error when it is not a kiln rendezvous hello of this version (magic) or malformed.
NodeHello decode_node_hello(std::span<const uint8_t> payload);

struct RendezvousAnswer {
  bool accepted = false;
  std::vector<uint8_t> blob;  // accepted: node 0's blob (the NCCL unique id, or the CPU group's sizes)
  std::string refusal;        // refused: why
};
std::vector<uint8_t> encode_rendezvous_answer(const RendezvousAnswer& answer);
RendezvousAnswer decode_rendezvous_answer(std::span<const uint8_t> payload);

// What a node allocated after loading; every node must match node 0.
struct NodeCapacity {
  int64_t kv_pages = 0;
  int64_t page_size = 0;
  int64_t state_slots = 0;
  int64_t max_context = 0;
  int64_t vocab = 0;
  bool operator==(const NodeCapacity&) const = default;
  std::string describe() const;  // "N KV pages of T tokens, S state slots, context C, vocabulary V"
};
NodeCapacity node_capacity(const RunnerCapacity& capacity, int64_t vocab);
std::vector<uint8_t> encode_node_capacity(const NodeCapacity& capacity);
NodeCapacity decode_node_capacity(std::span<const uint8_t> payload);

// A step node 0 sends: the chunks and which result it wants, or a state copy.
enum class StepKind : uint8_t { logits = 1, argmax = 2, copy_state = 3 };
std::vector<uint8_t> encode_step(StepKind kind, std::span<const SeqChunk> chunks);
std::vector<uint8_t> encode_copy_state(int src_slot, int dst_slot);
struct Step {
  StepKind kind = StepKind::logits;
  std::vector<SeqChunk> chunks;  // views into tokens / pages below
  std::vector<std::vector<int32_t>> tokens, pages;
  int src_slot = 0, dst_slot = 0;  // copy_state
  int64_t rows() const;            // chunks that want logits
  Step() = default;
  Step(Step&&) = default;  // moving the vectors keeps their buffers: the views stay valid
  Step& operator=(Step&&) = default;
  Step(const Step&) = delete;
};
Step decode_step(std::span<const uint8_t> payload);

// A node's answer to a step: its local ranks' results in rank order, or why it failed.
struct StepReply {
  bool ok = true;
  std::string error;  // !ok
  StepKind kind = StepKind::logits;
  std::vector<std::vector<float>> logits;  // logits: rank i's rows x its vocabulary slice
  std::vector<std::vector<float>> best_values;  // argmax: rank i's best logit per row
  std::vector<std::vector<int32_t>> best_ids;   // argmax: rank i's best (global) id per row
};
std::vector<uint8_t> encode_step_reply(const StepReply& reply);
StepReply decode_step_reply(std::span<const uint8_t> payload);

// A host collective across nodes (backend/comm_net.h): up, a node's ranks' inputs (one part per local rank); down,
// node 0's result (one part). op and count let node 0 catch nodes in different collectives.
enum class CollectiveOp : uint8_t { all_reduce = 1, all_gather = 2 };
std::vector<uint8_t> encode_collective(CollectiveOp op, int64_t count, std::span<const std::span<const uint8_t>> parts);
struct CollectiveView {
  CollectiveOp op = CollectiveOp::all_reduce;
  int64_t count = 0;
  std::vector<std::span<const uint8_t>> parts;  // views into the decoded message
};
CollectiveView decode_collective(std::span<const uint8_t> payload, const std::string& message);

}  // namespace kiln::model::wire
