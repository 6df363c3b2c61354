// Reading a whole file: the one copy the loaders, the tokenizer and the CLI share; and the memory
// the system has available (/proc/meminfo).
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

// MemAvailable of /proc/meminfo in bytes (0 when it cannot be read).
double memory_available();

}  // namespace moestream
