// Byte-level context-free grammars for constrained decoding, and the pushdown automaton that runs them.
//
// A Grammar is a set of rules; each rule is a small NFA over bytes (Thompson construction) whose edges
// consume a byte range, move without input (epsilon) or call another rule (push the return node, run the
// callee, pop at its end node). Recursion (nested JSON values, $ref) goes through calls; everything else
// is inlined. The automaton state is the set of live configurations (node, call stack) after the epsilon
// closure, so ambiguous grammars (anyOf, enum alternatives with a common prefix) need no backtracking.
//
// Runtime states are interned (equal configuration sets get one id) and byte transitions between them are
// memoised, so the token-mask walk over the vocabulary trie (token_mask.h) is mostly table lookups.
//
// Counted calls (string lengths): a call may carry bounds [min, max] on the number of "counting" range edges its
// callee's own frame consumes (a JSON string's characters: each character's first byte is a counting edge). The
// count lives in the call's stack entry, not in the callee's nodes, so every bounded string runs the one shared
// string rule: a byte that would start character max + 1 is dead, and the callee cannot end (return) below min.
//
// Compile limits: a Grammar may carry a node budget and a deadline (set_limits); a builder that passes either fails
// with a kiln::Error naming the limit, so no request can make a grammar of unbounded size or compile time.
#pragma once
#include <array>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <unordered_map>
#include <unordered_set>
#include <vector>

namespace kiln::grammar {

struct Edge {
  enum Kind : uint8_t { range, epsilon, call } kind = epsilon;
  uint8_t lo = 0, hi = 0;  // range: bytes lo..hi inclusive
  int32_t rule = -1;       // call: the callee
  int32_t target = -1;     // the next node (call: the return node)
  int32_t bound = -1;      // call: index into Grammar::bounds() (-1: the callee's frame is not counted)
  bool counts = false;     // range: consuming this byte starts one counted unit (see counted_call)
};

// Bounds of a counted call: the callee's frame consumes between min and max counting edges (max < 0: no upper bound).
struct CountBound {
  int32_t min = 0, max = -1;
};

struct Node {
  std::vector<Edge> edges;
  int32_t end_of_rule = -1;  // >= 0: this node is the end of that rule (returns to the caller)
};

// A fragment of a rule under construction: enter at start, leave from end.
struct Frag {
  int32_t start = -1, end = -1;
};

// Bounds on one grammar's construction. Defaults: 1M nodes (about 60 MB of nodes and edges at most), 1 s.
struct CompileLimits {
  size_t max_nodes = size_t(1) << 20;
  std::chrono::milliseconds max_time{1000};
};

class Grammar {
 public:
  // Starts the clock: from now on, building past limits.max_nodes nodes or past limits.max_time is a kiln::Error.
  // Without a call, a grammar has no limits (hand-built grammars in tests and tools).
  void set_limits(const CompileLimits& limits);
  // Rules: new_rule() reserves one (so that rules may call each other before they are defined);
  // define_rule() sets its body. root is the rule the automaton starts in.
  int32_t new_rule(std::string name);
  void define_rule(int32_t rule, Frag body);
  void set_root(int32_t rule) { root_ = rule; }
  int32_t root() const { return root_; }

  // Fragment builders (each call makes fresh nodes; a fragment is used once).
  Frag empty();
  void link(int32_t from, int32_t to) { add_edge(from, {Edge::epsilon, 0, 0, -1, to}); }  // epsilon edge
  Frag bytes(uint8_t lo, uint8_t hi);
  Frag byte_set(const std::array<bool, 256>& allowed);  // one byte from a set (merged into ranges)
  Frag literal(std::string_view s);
  Frag call(int32_t rule);
  // A call whose frame must consume between min and max (< 0: unbounded) counting edges before it returns.
  Frag counted_call(int32_t rule, int64_t min, int64_t max);
  // Marks the range edges that f can consume first (reachable from f.start through epsilon edges only) as counting
  // edges: each pass through f is one counted unit. f must not be nullable and must not be linked yet.
  Frag count_units(Frag f);
  Frag seq(std::vector<Frag> parts);
  Frag alt(std::vector<Frag> options);
  Frag opt(Frag f);
  Frag star(Frag f);  // zero or more
  // Between min and max (max < 0: unbounded) copies of make().
  Frag repeat(const std::function<Frag()>& make, int64_t min, int64_t max);

  const std::vector<Node>& nodes() const { return nodes_; }
  const Node& node(int32_t i) const { return nodes_[static_cast<size_t>(i)]; }
  int32_t rule_start(int32_t r) const { return rule_start_[static_cast<size_t>(r)]; }
  const std::string& rule_name(int32_t r) const { return rule_names_[static_cast<size_t>(r)]; }
  size_t num_rules() const { return rule_start_.size(); }
  const std::vector<CountBound>& bounds() const { return bounds_; }
  // Every node, edge, rule and bound as bytes: two grammars with equal keys run identically (GrammarCache's key).
  std::string structure_key() const;
  // Checks every rule is defined and the root is set; a broken grammar is an InternalError.
  void validate() const;
  // Removes the calls of rules that can never end (no finite text gets from their start to their end, e.g. a schema
  // that requires itself), so that no path can start one and never finish. A kiln::Error when the root is one, and
  // when a rule can call itself before consuming a byte (left recursion: the automaton's closure would not end).
  void prune_unproductive();

 private:
  int32_t add_node();
  void add_edge(int32_t from, Edge e) { nodes_[static_cast<size_t>(from)].edges.push_back(e); }

  std::vector<Node> nodes_;
  std::vector<int32_t> rule_start_, rule_end_;
  std::vector<std::string> rule_names_;
  std::vector<CountBound> bounds_;
  int32_t root_ = -1;
  size_t max_nodes_ = SIZE_MAX;
  std::chrono::milliseconds max_time_{0};
  std::chrono::steady_clock::time_point deadline_{std::chrono::steady_clock::time_point::max()};
};

// The pushdown automaton over one grammar. Not thread-safe: one per sequence (or per thread).
class Automaton {
 public:
  static constexpr int32_t kDead = -1;

  explicit Automaton(std::shared_ptr<const Grammar> grammar);

  int32_t initial_state() const { return initial_; }
  // The state after consuming byte b from state s, or kDead. Memoised.
  int32_t step(int32_t s, uint8_t b);
  // With step(s, b): how the byte counted for configurations whose frame is the opaque bottom (opaque_view states):
  // kNoCount (no seed came through a counting edge consumed in the bottom frame), kCount (every seed did),
  // kMixedCount (some did, some did not: the configurations' counts diverge). Memoised with the transition.
  enum CountDelta : uint8_t { kNoCount = 0, kCount = 1, kMixedCount = 2 };
  struct Step {
    int32_t next;
    uint8_t delta;
  };
  Step step_counted(int32_t s, uint8_t b);
  int32_t step_bytes(int32_t s, std::string_view bytes);  // kDead as soon as a byte does not fit
  // The grammar's root rule has ended on some configuration: the text so far is a complete sentence.
  bool accepting(int32_t s) const { return states_[static_cast<size_t>(s)].accepting; }
  // Some byte can follow.
  bool can_continue(int32_t s) const { return !states_[static_cast<size_t>(s)].configs.empty(); }
  size_t num_states() const { return states_.size(); }
  // Context-independent view of s: each configuration inside a call keeps its node, its whole stack (the return
  // node included) becomes an opaque bottom (a return into it sets popped_context). Bytes that never return from
  // the innermost rule behave the same from either state. Returns s when no configuration is inside a call.
  int32_t opaque_view(int32_t s);
  bool popped_context(int32_t s) const { return states_[static_cast<size_t>(s)].popped; }
  // The counted frame a state is in. counted: some configuration's innermost frame is a counted call. uniform: every
  // configuration inside a call has the same innermost frame, that counted one (then its opaque view's tokens that
  // stay in the frame fit exactly when the units they count are at most `remaining`). remaining: max - count so
  // far (-1: no upper bound).
  struct CountedFrame {
    bool counted = false, uniform = false;
    int32_t remaining = -1;
    int32_t frame = -1;  // the one stack every configuration inside a call has (-1: none, or several)
  };
  CountedFrame counted_frame(int32_t s) const;
  // The state real + p, from view_state = opaque_view(real) + p for a p that neither returns below the innermost
  // frame nor counts differently on two paths (a prefix the view walk followed), and the units p counted there:
  // the view's configurations with the opaque bottom replaced by real's one frame (its count + units). Needs
  // counted_frame(real).frame >= 0. kDead when the count passes the frame's max. Memoised. Equal to
  // step_bytes(real, p) but for the accepting flag (not kept: only the transitions matter to a mask walk).
  int32_t rebase(int32_t real, int32_t view_state, int32_t units);
  // The structure an opaque_view state can reach (its configurations, and every node, edge and callee reachable from
  // them, renumbered in discovery order) as bytes: two views with equal keys, in any grammars, allow the same tokens
  // with the same exits and counts. Empty when more than max_nodes nodes are reachable.
  std::string view_key(int32_t s, size_t max_nodes);
  const Grammar& grammar() const { return *grammar_; }

 private:
  struct Config {
    int32_t node;
    int32_t stack;  // index into stacks_, -1 = empty
    bool operator==(const Config& o) const { return node == o.node && stack == o.stack; }
    bool operator<(const Config& o) const { return node != o.node ? node < o.node : stack < o.stack; }
  };
  struct StackEntry {
    int32_t ret;        // node to continue at after the callee ends
    int32_t parent;     // -1 = bottom
    int32_t bound = -1; // counted call: index into the grammar's bounds
    int32_t count = 0;  // counted call: counting edges consumed in this frame so far
  };
  struct State {
    std::vector<Config> configs;  // sorted; only nodes with range edges
    bool accepting = false;
    bool popped = false;   // the closure returned into an opaque bottom (opaque_view states only)
    int32_t opaque = -1;   // memoised opaque_view (-1: not computed)
    struct Transitions {
      std::array<int32_t, 256> next;  // kUnknown until computed
      std::array<uint8_t, 256> delta;
    };
    std::unique_ptr<Transitions> trans;  // memoised transitions
  };
  static constexpr int32_t kUnknown = -2;

  int32_t push(int32_t ret, int32_t parent, int32_t bound = -1, int32_t count = 0);
  // The epsilon / call / return closure of seeds, interned; kDead when nothing is left to consume, accept or return.
  int32_t close_and_intern(std::vector<Config>& seeds);

  std::shared_ptr<const Grammar> grammar_;
  std::vector<StackEntry> stacks_;
  struct StackKeyHash {
    size_t operator()(const std::array<int32_t, 4>& k) const {
      uint64_t h = 0x9e3779b97f4a7c15ull;
      for (int32_t x : k) h = (h ^ static_cast<uint32_t>(x)) * 0x100000001b3ull;
      return static_cast<size_t>(h ^ (h >> 29));
    }
  };
  std::unordered_map<std::array<int32_t, 4>, int32_t, StackKeyHash> stack_ids_;  // key: ret, parent, bound, count
  std::vector<State> states_;
  std::unordered_map<std::string, int32_t> state_ids_;  // key: the sorted configs' bytes + accepting
  int32_t initial_ = kDead;
  int32_t opaque_bottom_ = -1;  // the stack entry that stands for an unknown context
  // closure scratch
  std::vector<Config> work_, out_;
  struct RebaseKeyHash {
    size_t operator()(const std::array<int32_t, 3>& k) const {
      uint64_t h = 0x9e3779b97f4a7c15ull;
      for (int32_t x : k) h = (h ^ static_cast<uint32_t>(x)) * 0x100000001b3ull;
      return static_cast<size_t>(h ^ (h >> 29));
    }
  };
  std::unordered_map<std::array<int32_t, 3>, int32_t, RebaseKeyHash> rebased_;  // (real, view state, units) -> state
  // view_key scratch: canonical index per grammar node (-1: not reached), the nodes in discovery order
  std::vector<int32_t> key_index_, key_order_;
  std::unordered_set<uint64_t> seen_;
  std::vector<Config> seeds_;  // step scratch
};

}  // namespace kiln::grammar
