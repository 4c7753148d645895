#include "engine/grammar/grammar.h"

#include <algorithm>
#include <cstring>
#include <functional>
#include <unordered_set>

#include "core/error.h"

namespace kiln::grammar {

void Grammar::set_limits(const CompileLimits& limits) {
  max_nodes_ = limits.max_nodes;
  max_time_ = limits.max_time;
  deadline_ = std::chrono::steady_clock::now() + limits.max_time;
}

int32_t Grammar::add_node() {
  if (nodes_.size() >= max_nodes_)
    fail("the grammar is too large: more than {} automaton nodes (kiln's limit per request; simplify the schema or "
         "pattern: fewer nested, repeated or bounded-repeat parts)",
         max_nodes_);
  if ((nodes_.size() & 1023) == 0 && std::chrono::steady_clock::now() > deadline_)
    fail("the grammar took longer than {} ms to compile (kiln's limit per request; simplify the schema or pattern)",
         max_time_.count());
  nodes_.emplace_back();
  return static_cast<int32_t>(nodes_.size() - 1);
}

int32_t Grammar::new_rule(std::string name) {
  int32_t r = static_cast<int32_t>(rule_start_.size());
  int32_t start = add_node();
  int32_t end = add_node();
  nodes_[static_cast<size_t>(end)].end_of_rule = r;
  rule_start_.push_back(start);
  rule_end_.push_back(end);
  rule_names_.push_back(std::move(name));
  return r;
}

void Grammar::define_rule(int32_t rule, Frag body) {
  KILN_CHECK(rule >= 0 && static_cast<size_t>(rule) < rule_start_.size(), "no rule {}", rule);
  int32_t start = rule_start_[static_cast<size_t>(rule)];
  KILN_CHECK(nodes_[static_cast<size_t>(start)].edges.empty(), "rule {} defined twice", rule_names_[static_cast<size_t>(rule)]);
  link(start, body.start);
  link(body.end, rule_end_[static_cast<size_t>(rule)]);
}

void Grammar::validate() const {
  KILN_CHECK(root_ >= 0 && static_cast<size_t>(root_) < rule_start_.size(), "grammar has no root rule");
  for (size_t r = 0; r < rule_start_.size(); ++r)
    KILN_CHECK(!nodes_[static_cast<size_t>(rule_start_[r])].edges.empty(), "grammar rule {} is not defined",
               rule_names_[r]);
}

void Grammar::prune_unproductive() {
  validate();
  // Fixpoint: a rule is productive when its end is reachable from its start over range and epsilon edges and
  // calls of productive rules (counted bounds aside).
  const size_t n_rules = rule_start_.size();
  std::vector<char> productive(n_rules, 0);
  std::vector<char> seen(nodes_.size(), 0);
  std::vector<int32_t> todo, visited;
  for (bool changed = true; changed;) {
    changed = false;
    for (size_t r = n_rules; r-- > 0;) {  // callees are mostly made after their callers: last first
      if (productive[r]) continue;
      // A rule's walk stays inside its own body (calls are not followed), so a pass costs O(nodes) in all.
      for (int32_t n : visited) seen[static_cast<size_t>(n)] = 0;
      visited.clear();
      todo.assign(1, rule_start_[r]);
      bool ends = false;
      while (!todo.empty() && !ends) {
        const int32_t n = todo.back();
        todo.pop_back();
        if (seen[static_cast<size_t>(n)]) continue;
        seen[static_cast<size_t>(n)] = 1;
        visited.push_back(n);
        if (n == rule_end_[r]) ends = true;
        for (const Edge& e : nodes_[static_cast<size_t>(n)].edges)
          if (e.kind != Edge::call || productive[static_cast<size_t>(e.rule)]) todo.push_back(e.target);
      }
      if (ends) productive[r] = 1, changed = true;
    }
  }
  if (!productive[static_cast<size_t>(root_)])
    fail("no finite text matches this grammar (a schema that requires itself, or a pattern that matches nothing)");
  for (Node& n : nodes_)
    n.edges.erase(std::remove_if(n.edges.begin(), n.edges.end(),
                                 [&](const Edge& e) { return e.kind == Edge::call && !productive[static_cast<size_t>(e.rule)]; }),
                  n.edges.end());
  // Nullable rules (their end reachable from their start without a byte), then the rules each one can call before
  // its first byte; a cycle there is left recursion.
  std::vector<char> nullable(n_rules, 0);
  auto walk_epsilon = [&](size_t r, const std::function<void(int32_t callee)>& on_call) {
    for (int32_t n : visited) seen[static_cast<size_t>(n)] = 0;
    visited.clear();
    todo.assign(1, rule_start_[r]);
    bool ends = false;
    while (!todo.empty()) {
      const int32_t n = todo.back();
      todo.pop_back();
      if (seen[static_cast<size_t>(n)]) continue;
      seen[static_cast<size_t>(n)] = 1;
      visited.push_back(n);
      if (n == rule_end_[r]) ends = true;
      for (const Edge& e : nodes_[static_cast<size_t>(n)].edges) {
        if (e.kind == Edge::epsilon) todo.push_back(e.target);
        if (e.kind != Edge::call) continue;
        if (on_call) on_call(e.rule);
        if (nullable[static_cast<size_t>(e.rule)]) todo.push_back(e.target);
      }
    }
    return ends;
  };
  for (bool changed = true; changed;) {
    changed = false;
    for (size_t r = n_rules; r-- > 0;)
      if (!nullable[r] && walk_epsilon(r, nullptr)) nullable[r] = 1, changed = true;
  }
  std::vector<std::vector<int32_t>> left_calls(n_rules);
  for (size_t r = 0; r < n_rules; ++r) walk_epsilon(r, [&](int32_t callee) { left_calls[r].push_back(callee); });
  std::vector<char> color(n_rules, 0);  // 0 new, 1 on the DFS path, 2 done
  for (size_t start = 0; start < n_rules; ++start) {
    if (color[start]) continue;
    std::vector<std::pair<int32_t, size_t>> stack{{static_cast<int32_t>(start), 0}};
    color[start] = 1;
    while (!stack.empty()) {
      auto& [r, i] = stack.back();
      const auto& next = left_calls[static_cast<size_t>(r)];
      if (i == next.size()) {
        color[static_cast<size_t>(r)] = 2;
        stack.pop_back();
        continue;
      }
      const int32_t c = next[i++];
      if (color[static_cast<size_t>(c)] == 1)
        fail("the grammar is left-recursive: rule '{}' can reach itself before any text (a schema or rule that refers "
             "to itself without anything written first)",
             rule_names_[static_cast<size_t>(c)]);
      if (color[static_cast<size_t>(c)] == 0) {
        color[static_cast<size_t>(c)] = 1;
        stack.push_back({c, 0});
      }
    }
  }
}

Frag Grammar::empty() {
  int32_t n = add_node();
  return {n, n};
}

Frag Grammar::bytes(uint8_t lo, uint8_t hi) {
  int32_t a = add_node(), b = add_node();
  add_edge(a, {Edge::range, lo, hi, -1, b});
  return {a, b};
}

Frag Grammar::byte_set(const std::array<bool, 256>& allowed) {
  int32_t a = add_node(), b = add_node();
  for (int i = 0; i < 256;) {
    if (!allowed[static_cast<size_t>(i)]) {
      ++i;
      continue;
    }
    int j = i;
    while (j + 1 < 256 && allowed[static_cast<size_t>(j + 1)]) ++j;
    add_edge(a, {Edge::range, static_cast<uint8_t>(i), static_cast<uint8_t>(j), -1, b});
    i = j + 1;
  }
  return {a, b};
}

Frag Grammar::literal(std::string_view s) {
  int32_t a = add_node(), cur = a;
  for (char ch : s) {
    int32_t n = add_node();
    auto b = static_cast<uint8_t>(ch);
    add_edge(cur, {Edge::range, b, b, -1, n});
    cur = n;
  }
  return {a, cur};
}

Frag Grammar::call(int32_t rule) {
  int32_t a = add_node(), b = add_node();
  add_edge(a, {Edge::call, 0, 0, rule, b});
  return {a, b};
}

Frag Grammar::counted_call(int32_t rule, int64_t min, int64_t max) {
  KILN_CHECK(min >= 0 && min < (int64_t(1) << 30) && max < (int64_t(1) << 30) && (max < 0 || max >= min),
             "bad counted call bounds {}..{}", min, max);
  bounds_.push_back({static_cast<int32_t>(min), max < 0 ? -1 : static_cast<int32_t>(max)});
  int32_t a = add_node(), b = add_node();
  Edge e{Edge::call, 0, 0, rule, b, static_cast<int32_t>(bounds_.size() - 1), false};
  add_edge(a, e);
  return {a, b};
}

Frag Grammar::count_units(Frag f) {
  std::vector<int32_t> todo{f.start};
  std::unordered_set<int32_t> seen;
  while (!todo.empty()) {
    int32_t n = todo.back();
    todo.pop_back();
    if (!seen.insert(n).second) continue;
    KILN_CHECK(n != f.end, "count_units over a fragment that can be empty");
    for (Edge& e : nodes_[static_cast<size_t>(n)].edges) {
      KILN_CHECK(e.kind != Edge::call, "count_units over a fragment that starts with a call");
      if (e.kind == Edge::range) e.counts = true;
      else todo.push_back(e.target);
    }
  }
  return f;
}

std::string Grammar::structure_key() const {
  std::vector<int32_t> v{root_, static_cast<int32_t>(nodes_.size()), static_cast<int32_t>(rule_start_.size()),
                         static_cast<int32_t>(bounds_.size())};
  for (size_t r = 0; r < rule_start_.size(); ++r) v.insert(v.end(), {rule_start_[r], rule_end_[r]});
  for (const CountBound& b : bounds_) v.insert(v.end(), {b.min, b.max});
  for (const Node& n : nodes_) {
    v.insert(v.end(), {n.end_of_rule, static_cast<int32_t>(n.edges.size())});
    for (const Edge& e : n.edges)
      v.insert(v.end(), {static_cast<int32_t>(e.kind) | (e.lo << 8) | (e.hi << 16) | (e.counts ? 1 << 24 : 0), e.rule,
                         e.target, e.bound});
  }
  return std::string(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(int32_t));
}

Frag Grammar::seq(std::vector<Frag> parts) {
  if (parts.empty()) return empty();
  for (size_t i = 0; i + 1 < parts.size(); ++i) link(parts[i].end, parts[i + 1].start);
  return {parts.front().start, parts.back().end};
}

Frag Grammar::alt(std::vector<Frag> options) {
  int32_t a = add_node(), b = add_node();
  for (const Frag& f : options) {
    link(a, f.start);
    link(f.end, b);
  }
  return {a, b};
}

Frag Grammar::opt(Frag f) {
  int32_t a = add_node(), b = add_node();
  link(a, f.start);
  link(a, b);
  link(f.end, b);
  return {a, b};
}

Frag Grammar::star(Frag f) {
  int32_t a = add_node(), b = add_node();
  link(a, f.start);
  link(a, b);
  link(f.end, a);
  return {a, b};
}

Frag Grammar::repeat(const std::function<Frag()>& make, int64_t min, int64_t max) {
  KILN_CHECK(min >= 0 && (max < 0 || max >= min), "bad repeat bounds {}..{}", min, max);
  std::vector<Frag> parts;
  for (int64_t i = 0; i < min; ++i) parts.push_back(make());
  if (max < 0) {
    parts.push_back(star(make()));
  } else if (max > min) {
    // Nested optionals: x (x (x)?)? -- each copy may only follow the previous one.
    Frag tail = opt(make());
    for (int64_t i = min + 1; i < max; ++i) tail = opt(seq({make(), tail}));
    parts.push_back(tail);
  }
  return seq(std::move(parts));
}

// ---------------------------------------------------------------------------------------------------

Automaton::Automaton(std::shared_ptr<const Grammar> grammar) : grammar_(std::move(grammar)) {
  grammar_->validate();
  stacks_.push_back({-1, -1});  // the opaque bottom: never returned to
  opaque_bottom_ = 0;
  std::vector<Config> seeds{{grammar_->rule_start(grammar_->root()), -1}};
  initial_ = close_and_intern(seeds);
  if (initial_ == kDead) fail("grammar: the root rule can match nothing");
}

int32_t Automaton::push(int32_t ret, int32_t parent, int32_t bound, int32_t count) {
  auto [it, fresh] = stack_ids_.emplace(std::array<int32_t, 4>{ret, parent, bound, count}, static_cast<int32_t>(stacks_.size()));
  if (fresh) stacks_.push_back({ret, parent, bound, count});
  return it->second;
}

int32_t Automaton::close_and_intern(std::vector<Config>& seeds) {
  const Grammar& g = *grammar_;
  work_.assign(seeds.begin(), seeds.end());
  out_.clear();
  std::unordered_set<uint64_t>& seen = seen_;
  seen.clear();
  bool accepting = false, popped = false;
  size_t steps = 0;
  auto key_of = [](const Config& c) {
    return (static_cast<uint64_t>(static_cast<uint32_t>(c.node)) << 32) | static_cast<uint32_t>(c.stack);
  };
  while (!work_.empty()) {
    Config c = work_.back();
    work_.pop_back();
    if (!seen.insert(key_of(c)).second) continue;
    if (++steps > 2'000'000) fail("grammar: the closure of a state does not end (a left-recursive rule?)");
    const Node& n = g.node(c.node);
    if (n.end_of_rule >= 0) {
      if (c.stack < 0) {
        if (n.end_of_rule == g.root()) accepting = true;
      } else if (c.stack == opaque_bottom_) {
        popped = true;
      } else {
        const StackEntry e = stacks_[static_cast<size_t>(c.stack)];
        // A counted frame returns only once it has counted min units.
        if (e.bound >= 0 && e.count < g.bounds()[static_cast<size_t>(e.bound)].min) continue;
        work_.push_back({e.ret, e.parent});
      }
      continue;
    }
    bool consumes = false;
    for (const Edge& e : n.edges) {
      switch (e.kind) {
        case Edge::range: consumes = true; break;
        case Edge::epsilon: work_.push_back({e.target, c.stack}); break;
        case Edge::call: work_.push_back({g.rule_start(e.rule), push(e.target, c.stack, e.bound, 0)}); break;
      }
    }
    if (consumes) out_.push_back(c);
  }
  // Nothing consumes, accepts or returns (every path failed a counted frame's minimum): dead.
  if (out_.empty() && !accepting && !popped) return kDead;
  std::sort(out_.begin(), out_.end());
  std::string key(out_.size() * sizeof(Config) + 1, '\0');
  if (!out_.empty()) std::memcpy(key.data(), out_.data(), out_.size() * sizeof(Config));
  key.back() = static_cast<char>((accepting ? 1 : 0) | (popped ? 2 : 0));
  auto [it, fresh] = state_ids_.emplace(std::move(key), static_cast<int32_t>(states_.size()));
  if (fresh) {
    State s;
    s.configs = out_;
    s.accepting = accepting;
    s.popped = popped;
    states_.push_back(std::move(s));
  }
  return it->second;
}

int32_t Automaton::step(int32_t s, uint8_t b) { return step_counted(s, b).next; }

Automaton::Step Automaton::step_counted(int32_t s, uint8_t b) {
  if (s < 0) return {kDead, kNoCount};
  State& st = states_[static_cast<size_t>(s)];
  if (!st.trans) {
    st.trans = std::make_unique<State::Transitions>();
    st.trans->next.fill(kUnknown);
    st.trans->delta.fill(kNoCount);
  }
  const int32_t known = st.trans->next[b];
  if (known != kUnknown) return {known, st.trans->delta[b]};
  const Grammar& g = *grammar_;
  std::vector<Config>& seeds = seeds_;
  seeds.clear();
  size_t counting = 0;
  for (const Config& c : st.configs)
    for (const Edge& e : g.node(c.node).edges) {
      if (e.kind != Edge::range || b < e.lo || b > e.hi) continue;
      int32_t stack = c.stack;
      bool bottom_count = false;
      if (e.counts && stack >= 0) {
        if (stack == opaque_bottom_) {
          bottom_count = true;  // counted in the real frame, whatever it is: the view only reports it
        } else {
          const StackEntry top = stacks_[static_cast<size_t>(stack)];
          if (top.bound >= 0) {
            const int32_t max = g.bounds()[static_cast<size_t>(top.bound)].max;
            if (max >= 0 && top.count >= max) continue;  // one unit too many
            stack = push(top.ret, top.parent, top.bound, top.count + 1);
          }
        }
      }
      seeds.push_back({e.target, stack});
      counting += bottom_count ? 1 : 0;
    }
  const int32_t next = seeds.empty() ? kDead : close_and_intern(seeds);
  const uint8_t delta = counting == 0 ? kNoCount : counting == seeds.size() ? kCount : kMixedCount;
  State::Transitions& t = *states_[static_cast<size_t>(s)].trans;  // states_ may have grown
  t.next[b] = next;
  t.delta[b] = delta;
  return {next, delta};
}

Automaton::CountedFrame Automaton::counted_frame(int32_t s) const {
  CountedFrame f;
  int32_t frame = -1;
  bool one_frame = true;
  for (const Config& c : states_[static_cast<size_t>(s)].configs) {
    if (c.stack < 0) continue;
    if (frame < 0) frame = c.stack;
    else if (c.stack != frame) one_frame = false;
    if (stacks_[static_cast<size_t>(c.stack)].bound >= 0) f.counted = true;
  }
  if (one_frame) f.frame = frame;
  if (!f.counted || !one_frame) return f;
  const StackEntry& top = stacks_[static_cast<size_t>(frame)];
  const int32_t max = grammar_->bounds()[static_cast<size_t>(top.bound)].max;
  f.uniform = true;
  f.remaining = max < 0 ? -1 : max - top.count;
  return f;
}

int32_t Automaton::rebase(int32_t real, int32_t view_state, int32_t units) {
  const std::array<int32_t, 3> key{real, view_state, units};
  if (auto it = rebased_.find(key); it != rebased_.end()) return it->second;
  const CountedFrame f = counted_frame(real);
  KILN_CHECK(f.frame >= 0, "grammar: rebase from a state without one frame");
  int32_t base = f.frame;
  const StackEntry top = stacks_[static_cast<size_t>(base)];
  int32_t result = kDead;
  if (top.bound >= 0 && units > 0) {
    const int32_t max = grammar_->bounds()[static_cast<size_t>(top.bound)].max;
    base = max >= 0 && top.count + units > max ? -2 : push(top.ret, top.parent, top.bound, top.count + units);
  }
  if (base != -2) {
    // Stacks above the opaque bottom are pushed again onto the real frame.
    std::unordered_map<int32_t, int32_t> mapped{{opaque_bottom_, base}, {-1, -1}};
    std::function<int32_t(int32_t)> map = [&](int32_t id) {
      auto it = mapped.find(id);
      if (it != mapped.end()) return it->second;
      const StackEntry e = stacks_[static_cast<size_t>(id)];
      const int32_t m = push(e.ret, map(e.parent), e.bound, e.count);
      mapped.emplace(id, m);
      return m;
    };
    std::vector<Config> seeds;
    for (const Config& c : states_[static_cast<size_t>(view_state)].configs) seeds.push_back({c.node, map(c.stack)});
    result = seeds.empty() ? kDead : close_and_intern(seeds);
  }
  rebased_.emplace(key, result);
  return result;
}

std::string Automaton::view_key(int32_t s, size_t max_nodes) {
  const Grammar& g = *grammar_;
  const State& st = states_[static_cast<size_t>(s)];
  std::vector<int32_t> out{static_cast<int32_t>(st.configs.size())};
  if (key_index_.size() != g.nodes().size()) key_index_.assign(g.nodes().size(), -1);
  std::vector<int32_t>& order = key_order_;
  order.clear();
  struct Reset {  // leaves key_index_ all -1 again, whichever way this returns
    std::vector<int32_t>& index;
    std::vector<int32_t>& order;
    ~Reset() {
      for (int32_t n : order) index[static_cast<size_t>(n)] = -1;
    }
  } reset{key_index_, order};
  auto id_of = [&](int32_t node) {
    int32_t& id = key_index_[static_cast<size_t>(node)];
    if (id < 0) {
      id = static_cast<int32_t>(order.size());
      order.push_back(node);
    }
    return id;
  };
  for (const Config& c : st.configs) {
    if (c.stack != -1 && c.stack != opaque_bottom_) return "";  // not an opaque view
    out.insert(out.end(), {id_of(c.node), c.stack == -1 ? 0 : 1});
  }
  for (size_t i = 0; i < order.size(); ++i) {
    if (order.size() > max_nodes) return "";
    const Node& n = g.node(order[i]);
    if (n.end_of_rule >= 0) {
      out.push_back(n.end_of_rule == g.root() ? -2 : -3);
      continue;
    }
    out.push_back(static_cast<int32_t>(n.edges.size()));
    for (const Edge& e : n.edges) {
      out.insert(out.end(), {static_cast<int32_t>(e.kind) | (e.lo << 8) | (e.hi << 16) | (e.counts ? 1 << 24 : 0),
                             id_of(e.target)});
      if (e.kind == Edge::call) {
        const CountBound b = e.bound >= 0 ? g.bounds()[static_cast<size_t>(e.bound)] : CountBound{-1, -1};
        out.insert(out.end(), {id_of(g.rule_start(e.rule)), b.min, b.max});
      }
    }
  }
  return std::string(reinterpret_cast<const char*>(out.data()), out.size() * sizeof(int32_t));
}

int32_t Automaton::opaque_view(int32_t s) {
  State& st = states_[static_cast<size_t>(s)];
  if (st.opaque >= 0) return st.opaque;
  // Each configuration inside a call keeps its node and loses its whole stack, the return node included: the
  // view of a string value is then the same wherever the string rule was called from.
  std::vector<Config> seeds;
  bool inside = false;
  for (const Config& c : st.configs) {
    if (c.stack < 0) {
      seeds.push_back(c);
    } else {
      seeds.push_back({c.node, opaque_bottom_});
      inside = true;
    }
  }
  int32_t o = inside ? close_and_intern(seeds) : s;
  states_[static_cast<size_t>(s)].opaque = o;
  return o;
}

int32_t Automaton::step_bytes(int32_t s, std::string_view bytes) {
  for (char ch : bytes) {
    s = step(s, static_cast<uint8_t>(ch));
    if (s < 0) return kDead;
  }
  return s;
}

}  // namespace kiln::grammar
