#include "server/response_store.h"

namespace kiln::server {

void ResponseStore::set_options(ResponseStoreOptions options) {
  std::lock_guard<std::mutex> lock(mu_);
  opts_ = options;
}

void ResponseStore::erase(const std::string& id) {
  auto it = items_.find(id);
  if (it == items_.end()) return;
  bytes_ -= it->second.bytes;
  by_age_.erase(it->second.age_pos);
  items_.erase(it);
}

void ResponseStore::evict_expired(Clock::time_point now) {
  const auto max_age = std::chrono::seconds(opts_.max_age_s);
  while (!by_age_.empty()) {
    auto it = items_.find(by_age_.front());
    if (now - it->second.stored < max_age) break;
    erase(by_age_.front());
  }
}

bool ResponseStore::put(const std::string& id, Entry entry, Clock::time_point now) {
  const size_t size = entry.conversation.dump().size() + entry.response.dump().size() + id.size();
  std::lock_guard<std::mutex> lock(mu_);
  erase(id);
  if (opts_.max_entries == 0 || size > opts_.max_bytes) return false;
  evict_expired(now);
  while (!by_age_.empty() && (items_.size() >= opts_.max_entries || bytes_ + size > opts_.max_bytes))
    erase(by_age_.front());
  by_age_.push_back(id);
  Item item{std::move(entry), size, now, std::prev(by_age_.end())};
  items_.emplace(id, std::move(item));
  bytes_ += size;
  return true;
}

std::optional<ResponseStore::Entry> ResponseStore::get(const std::string& id, Clock::time_point now) {
  std::lock_guard<std::mutex> lock(mu_);
  evict_expired(now);
  auto it = items_.find(id);
  if (it == items_.end()) return std::nullopt;
  return it->second.entry;
}

size_t ResponseStore::size() const {
  std::lock_guard<std::mutex> lock(mu_);
  return items_.size();
}

size_t ResponseStore::bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  return bytes_;
}

}  // namespace kiln::server
