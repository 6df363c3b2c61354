// The server's connection layer: one thread accepts connections and reads requests without
// blocking, so a slow or malicious client costs a descriptor and a buffer, never a worker thread.
// Only a complete request (head and body, read within their deadlines and under the size limits)
// goes to a worker; the worker answers it and hands the connection back for the next request.
//
// What it refuses itself, with a JSON error and a closed connection: a head not complete within
// header_timeout (408) or larger than max_header_bytes (431), a body not complete within
// body_timeout (408), a Content-Length that is not a plain number (400), a body larger than
// max_body_bytes, chunked or not (413, as soon as the length or the chunks show it), and a
// connection beyond max_connections in total or max_connections_per_client from one address (503).
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>

namespace moestream {

struct TransportOptions {
  size_t max_body_bytes = 16u << 20;
  size_t max_header_bytes = 64u << 10;
  double header_timeout_s = 10;  // from a request's first byte (or the accept) to its blank line
  double body_timeout_s = 60;    // from the end of the head to the last byte of the body
  double idle_timeout_s = 5;     // a kept-alive connection waiting for its next request
  double write_timeout_s = 60;   // one write of the response making no progress
  int max_connections = 512;
  int max_connections_per_client = 64;
  int workers = 16;
  int keep_alive_max = 100;  // requests per connection
};

// Answers one complete request (its raw bytes) on the connection `fd`, writing the response to it.
// Returns whether the connection may stay open for another request.
struct Exchange {
  int fd;
  std::string request;
  std::string peer_ip;
  int peer_port;
  bool close;  // the last request this connection may send
};
using RequestHandler = std::function<bool(const Exchange&)>;

struct TransportStats {
  int64_t open = 0;  // connections open now
  int64_t accepted = 0;
  std::map<std::string, int64_t> rejected;  // reason -> count (timeouts and limits)
  int64_t memory_trims = 0;  // malloc_trim calls when the server went idle (Impl::reactor)
};

class Transport {
 public:
  Transport(const TransportOptions& options, RequestHandler handler);
  ~Transport();
  int bind(const std::string& host, int port);  // returns the port (0: any free one)
  int listen_fd() const;
  void run();   // serves until stop(); returns once every worker is idle and joined
  void stop();  // from any thread
  TransportStats stats() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// Writes all of `data` to the non-blocking socket `fd`, waiting up to `timeout_s` for each step of
// progress. Returns false when the peer is gone or stalls.
bool write_all(int fd, const char* data, size_t size, double timeout_s);

}  // namespace moestream
