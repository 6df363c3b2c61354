#include "text/limits.h"

#include <nlohmann/json.hpp>
#include <utility>
#include <vector>

#include "core/error.h"

namespace moestream {

namespace {

// Depth-first with an explicit stack: the input may be nested far deeper than the call stack.
template <class Json>
void check_depth(const Json& root, std::string_view what) {
  if (!root.is_structured()) return;
  std::vector<std::pair<const Json*, int>> stack{{&root, 1}};
  while (!stack.empty()) {
    auto [j, depth] = stack.back();
    stack.pop_back();
    if (depth > text_limits::kMaxJsonDepth)
      fail(what, " is nested more than ", text_limits::kMaxJsonDepth, " levels deep");
    for (const auto& child : *j)
      if (child.is_structured()) stack.emplace_back(&child, depth + 1);
  }
}

}  // namespace

void check_json_depth(const nlohmann::ordered_json& j, std::string_view what) {
  check_depth(j, what);
}
void check_json_depth(const nlohmann::json& j, std::string_view what) {
  check_depth(j, what);
}

}  // namespace moestream
