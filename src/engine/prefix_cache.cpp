#include "engine/prefix_cache.h"

#include "core/error.h"

namespace kiln::engine {

PrefixCache::PrefixCache(int page_size, bool needs_state) : page_size_(page_size), needs_state_(needs_state) {
  KILN_CHECK(page_size > 0, "prefix cache: page size {}", page_size);
}

PrefixCache::~PrefixCache() = default;

uint64_t PrefixCache::leaf_order(const Node* n) const {
  // Leaves without a snapshot first: no match can end at them.
  return (n->snapshot >= 0 ? (uint64_t(1) << 62) : 0) + n->last_access;
}

void PrefixCache::update_leaf(Node* n) {
  if (n == &root_) return;
  auto it = leaf_key_.find(n->id);
  if (it != leaf_key_.end()) {
    leaves_.erase(it->second);
    leaf_key_.erase(it);
  }
  if (n->lock_ref == 0 && n->children.empty()) {
    LruKey k{leaf_order(n), n->id};
    leaves_.emplace(k, n);
    leaf_key_[n->id] = k;
  }
}

void PrefixCache::touch(Node* n) {
  n->last_access = ++tick_;
  if (n->snapshot >= 0) {
    auto it = snap_key_.find(n->id);
    KILN_CHECK(it != snap_key_.end(), "prefix cache: snapshot of node {} not listed", n->id);
    snapshots_.erase(it->second);
    it->second = LruKey{n->last_access, n->id};
    snapshots_.emplace(it->second, n);
  }
  update_leaf(n);
}

PrefixCache::Match PrefixCache::match(std::span<const int32_t> tokens, int64_t max_tokens) {
  Match m;
  const int64_t pages = std::min<int64_t>(max_tokens, static_cast<int64_t>(tokens.size())) / page_size_;
  Node* n = &root_;
  std::vector<Node*> walked;
  std::vector<int32_t> key(static_cast<size_t>(page_size_));
  size_t usable = 0;
  int slot = -1;
  for (int64_t p = 0; p < pages; ++p) {
    key.assign(tokens.begin() + p * page_size_, tokens.begin() + (p + 1) * page_size_);
    auto it = n->children.find(key);
    if (it == n->children.end()) break;
    n = it->second.get();
    walked.push_back(n);
    if (!needs_state_ || n->snapshot >= 0) {
      usable = walked.size();
      slot = n->snapshot;
    }
  }
  walked.resize(usable);
  for (Node* w : walked) touch(w);
  m.path = std::move(walked);
  m.tokens = static_cast<int64_t>(m.path.size()) * page_size_;
  m.snapshot_slot = needs_state_ ? slot : -1;
  return m;
}

void PrefixCache::lock(const std::vector<Node*>& path) {
  for (Node* n : path) {
    if (n->lock_ref++ == 0) {
      ++locked_nodes_;
      update_leaf(n);
    }
  }
}

void PrefixCache::unlock(const std::vector<Node*>& path) {
  for (Node* n : path) {
    KILN_CHECK(n->lock_ref > 0, "prefix cache: unlock of node {} that is not locked", n->id);
    if (--n->lock_ref == 0) {
      --locked_nodes_;
      update_leaf(n);
    }
  }
}

void PrefixCache::insert(std::span<const int32_t> tokens, std::span<const int32_t> pages, int snapshot_slot,
                         std::vector<int32_t>& free_pages, std::vector<int32_t>& free_slots) {
  std::vector<SnapshotAt> snaps;
  if (snapshot_slot >= 0) {
    if (pages.empty()) free_slots.push_back(snapshot_slot);  // the root holds no snapshot
    else snaps.push_back({static_cast<int64_t>(pages.size()), snapshot_slot});
  }
  insert(tokens, pages, snaps, free_pages, free_slots);
}

void PrefixCache::insert(std::span<const int32_t> tokens, std::span<const int32_t> pages,
                         std::span<const SnapshotAt> snapshots, std::vector<int32_t>& free_pages,
                         std::vector<int32_t>& free_slots) {
  KILN_CHECK(static_cast<int64_t>(tokens.size()) >= static_cast<int64_t>(pages.size()) * page_size_,
             "prefix cache: insert of {} pages with {} tokens", pages.size(), tokens.size());
  for (const SnapshotAt& s : snapshots)
    KILN_CHECK(s.slot >= 0 && s.pages >= 1 && s.pages <= static_cast<int64_t>(pages.size()),
               "prefix cache: snapshot after {} pages (slot {}) on an insert of {} pages", s.pages, s.slot,
               pages.size());
  Node* n = &root_;
  std::vector<int32_t> key;
  std::vector<Node*> path;  // root's child first
  for (size_t p = 0; p < pages.size(); ++p) {
    key.assign(tokens.begin() + static_cast<int64_t>(p) * page_size_,
               tokens.begin() + static_cast<int64_t>(p + 1) * page_size_);
    auto it = n->children.find(key);
    if (it != n->children.end()) {
      Node* c = it->second.get();
      if (c->page != pages[p]) free_pages.push_back(pages[p]);  // the tree has these tokens already
      n = c;
    } else {
      auto node = std::make_unique<Node>();
      node->id = next_id_++;
      node->parent = n;
      node->tokens = key;
      node->page = pages[p];
      node->depth = n->depth + 1;
      Node* c = node.get();
      n->children.emplace(key, std::move(node));
      ++num_nodes_;
      ++counters_.inserted_pages;
      update_leaf(n);  // n has a child now: no longer a leaf
      n = c;
    }
    path.push_back(n);
  }
  for (const SnapshotAt& s : snapshots) {
    Node* at = path[static_cast<size_t>(s.pages - 1)];
    if (at->snapshot >= 0) {
      free_slots.push_back(s.slot);  // the tree has the state there already
    } else {
      at->snapshot = s.slot;
      LruKey k{at->last_access, at->id};
      snapshots_.emplace(k, at);
      snap_key_[at->id] = k;
      update_leaf(at);
    }
  }
  // Root first: a deeper node is never older than its ancestors.
  for (Node* w : path) touch(w);
  for (const SnapshotAt& s : snapshots) {
    Node* at = path[static_cast<size_t>(s.pages - 1)];
    if (s.demote && at->snapshot == s.slot) demote_snapshot(at);
  }
}

void PrefixCache::demote_snapshot(Node* n) {
  if (n == nullptr || n->snapshot < 0) return;
  auto it = snap_key_.find(n->id);
  KILN_CHECK(it != snap_key_.end(), "prefix cache: snapshot of node {} not listed", n->id);
  snapshots_.erase(it->second);
  it->second = LruKey{0, n->id};
  snapshots_.emplace(it->second, n);
}

void PrefixCache::drop_snapshot(Node* n, std::vector<int32_t>& free_slots) {
  if (n->snapshot < 0) return;
  auto it = snap_key_.find(n->id);
  KILN_CHECK(it != snap_key_.end(), "prefix cache: snapshot of node {} not listed", n->id);
  snapshots_.erase(it->second);
  snap_key_.erase(it);
  free_slots.push_back(n->snapshot);
  n->snapshot = -1;
  ++counters_.evicted_snapshots;
  update_leaf(n);
}

void PrefixCache::remove_leaf(Node* n, std::vector<int32_t>& free_pages, std::vector<int32_t>& free_slots) {
  KILN_CHECK(n != &root_ && n->children.empty() && n->lock_ref == 0, "prefix cache: evicting node {} in use", n->id);
  drop_snapshot(n, free_slots);
  auto it = leaf_key_.find(n->id);
  if (it != leaf_key_.end()) {
    leaves_.erase(it->second);
    leaf_key_.erase(it);
  }
  free_pages.push_back(n->page);
  ++counters_.evicted_pages;
  --num_nodes_;
  Node* parent = n->parent;
  parent->children.erase(n->tokens);  // destroys n
  update_leaf(parent);
}

int64_t PrefixCache::evict_pages(int64_t n, std::vector<int32_t>& free_pages, std::vector<int32_t>& free_slots) {
  int64_t done = 0;
  while (done < n && !leaves_.empty()) {
    Node* leaf = leaves_.begin()->second;
    remove_leaf(leaf, free_pages, free_slots);
    ++done;
  }
  return done;
}

int64_t PrefixCache::evict_snapshots(int64_t n, std::vector<int32_t>& free_slots) {
  int64_t done = 0;
  while (done < n && !snapshots_.empty()) {
    drop_snapshot(snapshots_.begin()->second, free_slots);
    ++done;
  }
  return done;
}

void PrefixCache::clear(std::vector<int32_t>& free_pages, std::vector<int32_t>& free_slots) {
  KILN_CHECK(locked_nodes_ == 0, "prefix cache: clear with {} locked nodes", locked_nodes_);
  while (!leaves_.empty()) remove_leaf(leaves_.begin()->second, free_pages, free_slots);
  KILN_CHECK(num_nodes_ == 0, "prefix cache: {} nodes left after clear", num_nodes_);
}

int64_t PrefixCache::evictable_pages() const { return num_nodes_ - locked_nodes_; }

void PrefixCache::check_node(const Node* n, int64_t& nodes, int64_t& snaps, int64_t& locked) const {
  int64_t child_locks = 0;
  for (const auto& [key, c] : n->children) {
    KILN_CHECK(c->parent == n, "prefix cache: node {} has a wrong parent", c->id);
    KILN_CHECK(c->tokens == key && static_cast<int>(key.size()) == page_size_, "prefix cache: node {} key", c->id);
    KILN_CHECK(c->depth == n->depth + 1, "prefix cache: node {} depth", c->id);
    KILN_CHECK(c->lock_ref >= 0, "prefix cache: node {} negative lock", c->id);
    KILN_CHECK(n == &root_ || n->lock_ref >= c->lock_ref, "prefix cache: node {} locked more than its parent", c->id);
    child_locks += c->lock_ref;
    ++nodes;
    if (c->snapshot >= 0) {
      ++snaps;
      KILN_CHECK(snap_key_.count(c->id) == 1, "prefix cache: snapshot of node {} not listed", c->id);
    } else {
      KILN_CHECK(snap_key_.count(c->id) == 0, "prefix cache: node {} listed without a snapshot", c->id);
    }
    if (c->lock_ref > 0) ++locked;
    const bool leaf = c->lock_ref == 0 && c->children.empty();
    KILN_CHECK(leaf_key_.count(c->id) == (leaf ? 1u : 0u), "prefix cache: node {} leaf listing", c->id);
    if (leaf) KILN_CHECK(leaves_.count(leaf_key_.at(c->id)) == 1, "prefix cache: node {} not in the leaf list", c->id);
    check_node(c.get(), nodes, snaps, locked);
  }
  (void)child_locks;
}

void PrefixCache::check_invariants() const {
  int64_t nodes = 0, snaps = 0, locked = 0;
  check_node(&root_, nodes, snaps, locked);
  KILN_CHECK(nodes == num_nodes_, "prefix cache: {} nodes counted, {} recorded", nodes, num_nodes_);
  KILN_CHECK(snaps == static_cast<int64_t>(snapshots_.size()) && snaps == static_cast<int64_t>(snap_key_.size()),
             "prefix cache: {} snapshots counted, {} listed", snaps, snapshots_.size());
  KILN_CHECK(locked == locked_nodes_, "prefix cache: {} locked nodes counted, {} recorded", locked, locked_nodes_);
  KILN_CHECK(leaves_.size() == leaf_key_.size(), "prefix cache: leaf lists differ");
}

}  // namespace kiln::engine
