// The web chat page `serve` answers GET / with: src/server/webui/index.html, compiled into the
// binary by cmake/embed_file.cmake (no build step of its own, no files to install).
#pragma once

#include <cstring>
#include <string_view>

namespace moestream {

extern const char kWebUiPage[];
inline std::string_view web_ui_page() { return {kWebUiPage, std::strlen(kWebUiPage)}; }

}  // namespace moestream
