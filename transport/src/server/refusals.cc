#include "ibtrs/refusals.h"

#include <string>

#include "base/log.h"

namespace ibtrs {

void Refusals::declare(std::initializer_list<std::string_view> reasons) {
  std::lock_guard lock(mu_);
  for (std::string_view r : reasons)
    if (entries_.find(r) == entries_.end()) entries_.emplace(std::string(r), Entry{});
}

void Refusals::refuse(std::string_view reason, std::string_view detail, uint64_t n) {
  if (n == 0) return;
  const auto now = std::chrono::steady_clock::now();
  const int64_t unix_ms = std::chrono::duration_cast<std::chrono::milliseconds>(
                              std::chrono::system_clock::now().time_since_epoch())
                              .count();
  uint64_t unlogged = 0;
  {
    std::lock_guard lock(mu_);
    auto it = entries_.find(reason);
    if (it == entries_.end()) it = entries_.emplace(std::string(reason), Entry{}).first;
    Entry& e = it->second;
    e.count += n;
    e.last.assign(detail);
    e.last_unix_ms = unix_ms;
    if (e.ever_logged && now - e.logged < kLogInterval) {
      e.unlogged += n;
      return;
    }
    e.ever_logged = true;
    e.logged = now;
    unlogged = e.unlogged + (n - 1);
    e.unlogged = 0;
  }
  const std::string r(reason), d(detail);
  if (unlogged == 0) {
    BASE_LOG(warn, "refused (%s): %s", r.c_str(), d.c_str());
  } else {
    BASE_LOG(warn, "refused (%s): %s (and %llu more not logged)", r.c_str(), d.c_str(),
              static_cast<unsigned long long>(unlogged));
  }
}

std::vector<RefusalCount> Refusals::snapshot() const {
  std::lock_guard lock(mu_);
  std::vector<RefusalCount> out;
  out.reserve(entries_.size());
  for (const auto& [reason, e] : entries_) out.push_back({reason, e.count, e.last, e.last_unix_ms});
  return out;
}

uint64_t Refusals::count(std::string_view reason) const {
  std::lock_guard lock(mu_);
  auto it = entries_.find(reason);
  return it == entries_.end() ? 0 : it->second.count;
}

void Refusals::reset() {
  std::lock_guard lock(mu_);
  for (auto& [reason, e] : entries_) e = Entry{};
}

}  // namespace ibtrs
