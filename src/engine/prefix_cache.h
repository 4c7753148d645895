// Prefix cache for hybrid models (full attention + Gated DeltaNet): a radix tree over full KV pages, plus
// snapshots of the recurrent / conv state at page boundaries. Pure host bookkeeping over page and slot ids.
//
//  - Every edge is one full page of tokens (page_size ids); a node holds that page's KV page id. The last,
//    partial page of a sequence is never cached (a sequence keeps writing into it).
//  - A node may hold a state snapshot: a state slot with the DeltaNet state after the node's last token. A
//    linear-attention layer's state cannot be rebuilt from pages, so a match counts only up to the deepest
//    node with a snapshot (when the model has such state; otherwise up to the deepest node).
//  - A running sequence that matched a path locks it (lock_ref): locked pages are never evicted. Snapshots
//    may be evicted at any time: a sequence copies the snapshot into its own slot when it is admitted.
//  - Eviction is LRU, in two lists: leaves with no lock (their pages; leaves without a snapshot first, as no
//    match can stop at them), and snapshots.
#pragma once
#include <cstdint>
#include <map>
#include <memory>
#include <set>
#include <span>
#include <unordered_map>
#include <vector>

namespace kiln::engine {

class PrefixCache {
 public:
  struct Node;

  struct Match {
    std::vector<Node*> path;  // the matched nodes, root's child first (lock these)
    int64_t tokens = 0;       // path.size() * page_size
    int snapshot_slot = -1;   // state to restore (-1: none; needs_state false or no match)
  };

  struct Counters {
    uint64_t evicted_pages = 0;
    uint64_t evicted_snapshots = 0;
    uint64_t inserted_pages = 0;
  };

  PrefixCache(int page_size, bool needs_state);
  ~PrefixCache();
  PrefixCache(const PrefixCache&) = delete;
  PrefixCache& operator=(const PrefixCache&) = delete;

  int page_size() const { return page_size_; }

  // The longest cached prefix of tokens[0, max_tokens) usable as is: whole pages, ending at a node with a
  // snapshot when needs_state. Marks the path as used (LRU).
  Match match(std::span<const int32_t> tokens, int64_t max_tokens);
  void lock(const std::vector<Node*>& path);
  void unlock(const std::vector<Node*>& path);

  // Hands a sequence's first pages.size() full pages (tokens[0, pages.size() * page_size)) to the tree, and
  // optionally the snapshot of the state after them (snapshot_slot, -1: none). Pages and a snapshot the tree
  // already holds for those tokens are returned in free_pages / free_slots (the caller frees them); pages that
  // are the tree's own (the sequence matched them) are left alone.
  void insert(std::span<const int32_t> tokens, std::span<const int32_t> pages, int snapshot_slot,
              std::vector<int32_t>& free_pages, std::vector<int32_t>& free_slots);
  // The same with several snapshots along the path: (pages from the root, slot), 1 <= pages <= pages.size();
  // `demote`: file it as the first to be evicted (as demote_snapshot does).
  struct SnapshotAt {
    int64_t pages = 0;
    int slot = -1;
    bool demote = false;
  };
  void insert(std::span<const int32_t> tokens, std::span<const int32_t> pages, std::span<const SnapshotAt> snapshots,
              std::vector<int32_t>& free_pages, std::vector<int32_t>& free_slots);

  // Makes n's snapshot the first to be evicted (a sequence that started from it has cached a deeper one on the
  // same path; a later match makes it recent again).
  void demote_snapshot(Node* n);
  // Evicts up to n pages (LRU unlocked leaves, with their snapshots); returns how many were evicted.
  int64_t evict_pages(int64_t n, std::vector<int32_t>& free_pages, std::vector<int32_t>& free_slots);
  // Evicts up to n snapshots (LRU); returns how many.
  int64_t evict_snapshots(int64_t n, std::vector<int32_t>& free_slots);
  // Drops everything (no node may be locked): returns every page and slot.
  void clear(std::vector<int32_t>& free_pages, std::vector<int32_t>& free_slots);

  int64_t num_pages() const { return num_nodes_; }
  int64_t num_snapshots() const { return static_cast<int64_t>(snapshots_.size()); }
  int64_t evictable_pages() const;  // pages no running sequence locks
  int64_t num_locked_nodes() const { return locked_nodes_; }
  const Counters& counters() const { return counters_; }

  // Debug / tests: checks every invariant (parent links, lock counts, LRU sets); throws on a broken one.
  void check_invariants() const;

 private:
  struct Key {
    bool operator()(const std::vector<int32_t>& a, const std::vector<int32_t>& b) const { return a < b; }
  };
  using LruKey = std::pair<uint64_t, uint64_t>;  // (order, node id)

 public:
  struct Node {
    uint64_t id = 0;
    Node* parent = nullptr;
    std::vector<int32_t> tokens;                                     // page_size ids (empty for the root)
    std::map<std::vector<int32_t>, std::unique_ptr<Node>, Key> children;
    int32_t page = -1;
    int snapshot = -1;
    int64_t lock_ref = 0;
    uint64_t last_access = 0;
    int depth = 0;  // pages from the root
  };

 private:
  uint64_t leaf_order(const Node* n) const;
  void touch(Node* n);
  void update_leaf(Node* n);   // (re)files n in leaves_ as its state says
  void drop_snapshot(Node* n, std::vector<int32_t>& free_slots);
  void remove_leaf(Node* n, std::vector<int32_t>& free_pages, std::vector<int32_t>& free_slots);
  void check_node(const Node* n, int64_t& nodes, int64_t& snaps, int64_t& locked) const;

  int page_size_;
  bool needs_state_;
  Node root_;
  uint64_t tick_ = 0, next_id_ = 1;
  int64_t num_nodes_ = 0, locked_nodes_ = 0, locked_pages_ = 0;
  std::map<LruKey, Node*> leaves_;     // evictable leaves: unlocked, no children
  std::map<LruKey, Node*> snapshots_;  // nodes holding a snapshot, by last access
  std::unordered_map<uint64_t, LruKey> leaf_key_, snap_key_;
  Counters counters_;
};

}  // namespace kiln::engine
