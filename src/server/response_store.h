// The responses /v1/responses keeps for previous_response_id: per response id, the conversation up to and
// including that response (chat messages in OpenAI form, without the request's instructions, which OpenAI does
// not carry over) and the response object. Bounded by a count, a total size and an age: an entry older than
// max_age is gone, and adding past max_entries or max_bytes evicts the oldest. Thread-safe.
#pragma once
#include <chrono>
#include <cstdint>
#include <list>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <unordered_map>

namespace kiln::server {

struct ResponseStoreOptions {
  size_t max_entries = 1024;          // 0: nothing is stored (store: true requests answer as if store were false)
  size_t max_bytes = size_t(256) << 20;  // the stored JSON text, summed
  int64_t max_age_s = 3600;
};

class ResponseStore {
 public:
  using Clock = std::chrono::steady_clock;
  struct Entry {
    nlohmann::ordered_json conversation;  // chat messages
    nlohmann::json response;              // the response object as answered
  };

  explicit ResponseStore(ResponseStoreOptions options = {}) : opts_(options) {}
  void set_options(ResponseStoreOptions options);
  const ResponseStoreOptions& options() const { return opts_; }

  // Stores (or replaces) an entry; false when it is larger than max_bytes on its own or the store is off.
  bool put(const std::string& id, Entry entry, Clock::time_point now = Clock::now());
  // The entry, or nullopt when it was never stored, was evicted or has expired.
  std::optional<Entry> get(const std::string& id, Clock::time_point now = Clock::now());
  size_t size() const;
  size_t bytes() const;

 private:
  struct Item {
    Entry entry;
    size_t bytes = 0;
    Clock::time_point stored;
    std::list<std::string>::iterator age_pos;
  };
  void evict_expired(Clock::time_point now);
  void erase(const std::string& id);

  ResponseStoreOptions opts_;
  mutable std::mutex mu_;
  std::unordered_map<std::string, Item> items_;
  std::list<std::string> by_age_;  // oldest first
  size_t bytes_ = 0;
};

}  // namespace kiln::server
