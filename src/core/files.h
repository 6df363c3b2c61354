// Reading a whole file: the one copy the loaders, the tokenizer and the CLI share.
#pragma once

#include <optional>
#include <string>

namespace moestream {

// The bytes of the file at `path`; nullopt when it cannot be opened or read (the caller words the
// error, e.g. naming the flag that gave the path, or goes on without the file).
std::optional<std::string> try_read_file(const std::string& path);

// The bytes of the file at `path`; an Error "<path>: cannot open for reading: <reason>" when it
// cannot be opened or read.
std::string read_file(const std::string& path);

}  // namespace moestream
