// `moestream serve`: the HTTP server. OpenAI-compatible /v1/chat/completions, /v1/completions and
// /v1/models; Anthropic-compatible /v1/messages; /health and /metrics (Prometheus text).
#pragma once

#include <cstddef>
#include <memory>
#include <string>

#include "server/api.h"

namespace moestream {

struct ServeOptions {
  std::string host = "127.0.0.1";
  int port = 8080;              // 0: any free port (see HttpServer::port)
  std::string api_key;          // non-empty: /v1/* requires "Authorization: Bearer KEY" or "x-api-key"
  size_t max_body_bytes = 16u << 20;
  bool log_requests = true;     // one line per request on stderr (id, endpoint, tokens, timing)
  // Slow or abusive clients (see server/transport.h): deadlines for a request's whole head and
  // whole body, for an idle kept-alive connection and for a stalled write; connection limits.
  double header_timeout_s = 10;
  double body_timeout_s = 60;
  double idle_timeout_s = 5;
  double write_timeout_s = 60;
  int max_connections = 512;
  int max_connections_per_client = 64;
};

class HttpServer {
 public:
  HttpServer(ServedModel& model, const ServeOptions& options);
  ~HttpServer();
  int bind();    // binds the socket; returns the port
  void listen(); // serves until stop()
  void stop();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace moestream
