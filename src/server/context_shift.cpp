#include "server/context_shift.h"

#include <set>
#include <string>

namespace moestream {

namespace {
std::string role_of(const nlohmann::ordered_json& m) {
  if (!m.is_object()) return "";
  auto it = m.find("role");
  return it != m.end() && it->is_string() ? it->get<std::string>() : "";
}
}  // namespace

ContextShift::ContextShift(const nlohmann::ordered_json& messages, std::vector<size_t> origin)
    : messages_(messages), origin_(std::move(origin)) {
  const size_t n = messages.is_array() ? messages.size() : 0;
  if (origin_.size() != n) {
    origin_.resize(n);
    for (size_t i = 0; i < n; ++i) origin_[i] = i;
  }
  while (system_end_ < n && role_of(messages[system_end_]) == "system") ++system_end_;
  std::vector<size_t> starts;  // where exchanges start
  for (size_t i = system_end_; i < n; ++i)
    if (role_of(messages[i]) == "user" && (i == 0 || origin_[i] != origin_[i - 1])) starts.push_back(i);
  if (starts.empty()) {
    cuts_ = {system_end_};
    return;
  }
  // Whatever precedes the first user message (an assistant's greeting) goes with the first cut.
  cuts_.push_back(system_end_);
  for (size_t s : starts)
    if (s > system_end_) cuts_.push_back(s);
}

nlohmann::ordered_json ContextShift::kept(int k) const {
  nlohmann::ordered_json out = nlohmann::ordered_json::array();
  const size_t n = messages_.is_array() ? messages_.size() : 0;
  for (size_t i = 0; i < system_end_; ++i) out.push_back(messages_[i]);
  for (size_t i = cuts_.at(size_t(k)); i < n; ++i) out.push_back(messages_[i]);
  return out;
}

int ContextShift::dropped_messages(int k) const {
  std::set<size_t> origins;
  for (size_t i = system_end_; i < cuts_.at(size_t(k)); ++i) origins.insert(origin_[i]);
  return int(origins.size());
}

int fewest_to_drop(int n, const std::function<bool(int)>& fits) {
  if (fits(0)) return 0;
  int lo = 1, hi = n;  // the answer is in [lo, hi]; hi is taken when nothing fits
  while (lo < hi) {
    const int mid = lo + (hi - lo) / 2;
    if (fits(mid)) hi = mid;
    else lo = mid + 1;
  }
  return hi;
}

}  // namespace moestream
