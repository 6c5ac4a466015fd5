// The block server's queue of control requests (OPEN, CLOSE): one bounded FIFO per session,
// served round robin, so one session's requests cannot starve another's and a flood costs the
// flooder only refusals. The control thread takes one request at a time (the server re-posts its
// serving task after each one, so admin commands queued meanwhile run in between).
//
// Not synchronized: the server guards it with one mutex (IO threads push, the control thread
// pops). Per-key order is FIFO; across keys, each key with work gets one item per round.
#pragma once

#include <cstddef>
#include <deque>
#include <map>
#include <optional>
#include <utility>

namespace ibnbd::server {

template <typename Key, typename Item>
class FairQueue {
 public:
  explicit FairQueue(size_t per_key_max) : per_key_max_(per_key_max) {}

  // Appends `item` to `key`'s queue; false (and `item` untouched) when that queue already holds
  // per_key_max items.
  bool push(const Key& key, Item&& item) {
    auto it = queues_.find(key);
    if (it == queues_.end()) {
      if (per_key_max_ == 0) return false;
      it = queues_.emplace(key, std::deque<Item>{}).first;
      ring_.push_back(key);
    } else if (it->second.size() >= per_key_max_) {
      return false;
    }
    it->second.push_back(std::move(item));
    ++size_;
    return true;
  }

  // The front item of the key whose turn it is; that key goes to the back of the ring if it has
  // more. Nothing when empty.
  std::optional<std::pair<Key, Item>> pop() {
    if (ring_.empty()) return std::nullopt;
    Key k = ring_.front();
    ring_.pop_front();
    auto it = queues_.find(k);
    std::pair<Key, Item> out{k, std::move(it->second.front())};
    it->second.pop_front();
    if (it->second.empty()) {
      queues_.erase(it);
    } else {
      ring_.push_back(k);
    }
    --size_;
    return out;
  }

  size_t size() const { return size_; }
  bool empty() const { return size_ == 0; }
  size_t queued(const Key& key) const {
    auto it = queues_.find(key);
    return it == queues_.end() ? 0 : it->second.size();
  }

 private:
  size_t per_key_max_;
  std::map<Key, std::deque<Item>> queues_;  // keys with at least one item
  std::deque<Key> ring_;                    // each key of queues_ once, in serving order
  size_t size_ = 0;
};

}  // namespace ibnbd::server
