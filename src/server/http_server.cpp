#include "server/http_server.h"
#include "server/webui.h"

#include <httplib.h>
#include <poll.h>
#include <sys/socket.h>

#include <atomic>
#include <cstring>
#include <sstream>

#include "core/error.h"
#include "server/transport.h"

namespace moestream {

namespace {

// httplib parses, routes and writes; the Transport does the reading. process_request() is the
// part of httplib that answers one request from a Stream.
class RoutedServer : public httplib::Server {
 public:
  using httplib::Server::process_request;
  // Streamed responses stop when this is invalid (httplib's sign of shutting down).
  void set_serving_socket(int fd) { svr_sock_ = fd; }
};

// One complete request, read by the Transport; the response goes straight to the socket.
class RequestStream final : public httplib::Stream {
 public:
  RequestStream(const Exchange& x, double write_timeout_s, const std::atomic<bool>& stopping)
      : x_(x), write_timeout_s_(write_timeout_s), stopping_(stopping) {}
  bool is_readable() const override { return pos_ < x_.request.size(); }
  // The client is still there: no error on the socket, and it has not closed its side.
  bool is_writable() const override {
    if (stopping_) return false;
    pollfd p{x_.fd, POLLOUT, 0};
    if (::poll(&p, 1, int(write_timeout_s_ * 1000)) <= 0 || (p.revents & (POLLERR | POLLHUP | POLLNVAL))) return false;
    char c;
    return ::recv(x_.fd, &c, 1, MSG_PEEK | MSG_DONTWAIT) != 0;
  }
  ssize_t read(char* ptr, size_t size) override {
    const size_t n = std::min(size, x_.request.size() - pos_);
    std::memcpy(ptr, x_.request.data() + pos_, n);
    pos_ += n;
    return ssize_t(n);
  }
  ssize_t write(const char* ptr, size_t size) override {
    return write_all(x_.fd, ptr, size, write_timeout_s_) ? ssize_t(size) : -1;
  }
  void get_remote_ip_and_port(std::string& ip, int& port) const override {
    ip = x_.peer_ip;
    port = x_.peer_port;
  }
  void get_local_ip_and_port(std::string& ip, int& port) const override {
    ip = "";
    port = 0;
  }
  socket_t socket() const override { return x_.fd; }

 private:
  const Exchange& x_;
  double write_timeout_s_;
  const std::atomic<bool>& stopping_;
  size_t pos_ = 0;
};

TransportOptions transport_options(const ServeOptions& o, const EngineOptions& eo) {
  TransportOptions t;
  t.max_body_bytes = o.max_body_bytes;
  t.header_timeout_s = o.header_timeout_s;
  t.body_timeout_s = o.body_timeout_s;
  t.idle_timeout_s = o.idle_timeout_s;
  t.write_timeout_s = o.write_timeout_s;
  t.max_connections = o.max_connections;
  t.max_connections_per_client = o.max_connections_per_client;
  // Enough workers that every request the engine could queue gets one, and some more for the
  // requests that need no generation (/health, errors), which are answered at once.
  t.workers = eo.parallel + eo.max_queue + 8;
  return t;
}

}  // namespace

struct HttpServer::Impl {
  Impl(ServedModel& m, const ServeOptions& o)
      : options(o),
        ctx{m, o.api_key, o.log_requests},
        transport(transport_options(o, m.engine->options()), [this](const Exchange& x) { return answer(x); }) {}
  bool answer(const Exchange& x) {
    RequestStream stream(x, options.write_timeout_s, stopping);
    bool closed = false;
    const bool ok = server.process_request(stream, x.close, closed, nullptr);
    return ok && !closed;
  }
  ServeOptions options;
  ServerContext ctx;
  RoutedServer server;
  std::atomic<bool> stopping{false};
  Transport transport;
  int port = -1;
};

namespace {

// Prometheus text exposition.
std::string metrics_text(ServerContext& ctx, const TransportStats& t) {
  const EngineStats s = ctx.model.engine->stats();
  std::ostringstream o;
  auto metric = [&](const char* name, const char* type, const char* help, double value) {
    o << "# HELP " << name << ' ' << help << "\n# TYPE " << name << ' ' << type << '\n' << name << ' ' << value << '\n';
  };
  o << "# HELP moestream_http_requests_total HTTP requests by endpoint and status.\n"
       "# TYPE moestream_http_requests_total counter\n";
  {
    std::lock_guard lock(ctx.mu);
    for (const auto& [key, n] : ctx.requests)
      o << "moestream_http_requests_total{endpoint=\"" << key.first << "\",status=\"" << key.second << "\"} " << n << '\n';
  }
  metric("moestream_generations_total", "counter", "Generations started.", double(s.requests_started));
  metric("moestream_generations_failed_total", "counter",
         "Generations that failed on the server's side (e.g. an expert read failed its checksum).",
         double(s.requests_failed));
  metric("moestream_generations_cancelled_total", "counter", "Generations stopped early (client gone, stop string).", double(s.requests_cancelled));
  metric("moestream_prompt_tokens_total", "counter", "Prompt tokens received.", double(s.prompt_tokens));
  metric("moestream_prompt_tokens_cached_total", "counter", "Prompt tokens reused from the prefix cache.", double(s.cached_prompt_tokens));
  metric("moestream_generated_tokens_total", "counter", "Tokens generated.", double(s.generated_tokens));
  metric("moestream_prefill_seconds_total", "counter", "Time spent on prompt processing.", s.prefill_seconds);
  metric("moestream_decode_seconds_total", "counter", "Time spent decoding.", s.decode_seconds);
  metric("moestream_decode_tokens_per_second", "gauge", "Generated tokens per second of decoding, since start.",
         s.decode_seconds > 0 ? double(s.generated_tokens) / s.decode_seconds : 0.0);
  metric("moestream_prefill_tokens_per_second", "gauge", "Prompt tokens processed per second of prefill, since start.",
         s.prefill_seconds > 0 ? double(s.prompt_tokens - s.cached_prompt_tokens) / s.prefill_seconds : 0.0);
  metric("moestream_requests_active", "gauge", "Generations in flight.", s.active);
  metric("moestream_requests_queued", "gauge", "Generations waiting for a slot.", s.queued);
  metric("moestream_batch_size", "gauge", "Sequences the engine is generating for (each has a turn per step).", s.active);
  metric("moestream_prefix_cache_entries", "gauge", "Sequence states held by the prefix cache.", s.cache.entries);
  metric("moestream_requests_paused", "gauge",
         "Generations preempted for KV memory, waiting to resume.", s.paused);
  metric("moestream_preemptions_total", "counter",
         "Generations preempted for KV memory (recomputed later).", double(s.preemptions));
  metric("moestream_kv_cache_bytes", "gauge", "KV memory held by sequences and the prefix cache.",
         double(s.kv_bytes));
  metric("moestream_kv_cache_budget_bytes", "gauge", "KV memory they may hold (--kv-mb).",
         double(s.kv_budget));
  metric("moestream_expert_hits_total", "counter", "Expert lookups served from the cache.", double(s.experts.hits));
  metric("moestream_expert_misses_total", "counter", "Expert lookups read from disk.", double(s.experts.misses));
  metric("moestream_expert_hit_rate", "gauge", "Expert cache hit rate since start.", s.experts.hit_rate());
  metric("moestream_expert_bytes_read_total", "counter", "Bytes of expert weights read from disk.", double(s.experts.bytes_read));
  metric("moestream_http_connections_open", "gauge", "Client connections open.", double(t.open));
  metric("moestream_http_connections_total", "counter", "Client connections accepted.", double(t.accepted));
  metric("moestream_memory_trims_total", "counter",
         "Times freed heap memory was given back to the system when no request was being answered.",
         double(t.memory_trims));
  o << "# HELP moestream_http_refused_total Requests or connections refused before routing (timeouts, limits).\n"
       "# TYPE moestream_http_refused_total counter\n";
  for (const auto& [reason, n] : t.rejected) o << "moestream_http_refused_total{reason=\"" << reason << "\"} " << n << '\n';
  return o.str();
}

bool authorized(const httplib::Request& req, const std::string& key) {
  if (key.empty()) return true;
  if (req.get_header_value("Authorization") == "Bearer " + key) return true;
  return req.get_header_value("x-api-key") == key;
}

}  // namespace

HttpServer::HttpServer(ServedModel& model, const ServeOptions& options)
    : impl_(std::make_unique<Impl>(model, options)) {
  httplib::Server& svr = impl_->server;
  ServerContext& ctx = impl_->ctx;
  // The Transport has checked the body's size and read it whole; these are a second line.
  svr.set_payload_max_length(options.max_body_bytes);
  svr.set_keep_alive_max_count(100);

  svr.set_pre_routing_handler([&ctx](const httplib::Request& req, httplib::Response& res) {
    if (req.path.rfind("/v1/", 0) == 0 && !authorized(req, ctx.api_key)) {
      res.status = 401;
      res.set_header("WWW-Authenticate", "Bearer");
      res.set_content(ojson{{"error", {{"message", "a valid API key is required (Authorization: Bearer KEY)"},
                                       {"type", "authentication_error"}, {"param", nullptr},
                                       {"code", "invalid_api_key"}}}}.dump(),
                      "application/json");
      ctx.count(req.path, 401);
      return httplib::Server::HandlerResponse::Handled;
    }
    return httplib::Server::HandlerResponse::Unhandled;
  });
  // Errors httplib produces itself (404, 413, 400 on a broken request line) get a JSON body too.
  svr.set_error_handler([&ctx](const httplib::Request& req, httplib::Response& res) {
    if (!res.body.empty()) return;
    std::string message = res.status == 404   ? "no such endpoint: " + req.method + " " + req.path
                          : res.status == 413 ? "the request body is too large"
                                              : "the request could not be handled (HTTP " + std::to_string(res.status) + ")";
    res.set_content(ojson{{"error", {{"message", message}, {"type", "invalid_request_error"},
                                     {"param", nullptr}, {"code", res.status}}}}.dump(),
                    "application/json");
    ctx.count(res.status == 404 ? "other" : req.path, res.status);
  });
  svr.set_exception_handler([](const httplib::Request&, httplib::Response& res, std::exception_ptr ep) {
    std::string message = "internal error";
    try {
      std::rethrow_exception(ep);
    } catch (const std::exception& e) {
      message = e.what();
    } catch (...) {
    }
    res.status = 500;
    res.set_content(ojson{{"error", {{"message", message}, {"type", "server_error"}, {"param", nullptr},
                                     {"code", 500}}}}.dump(),
                    "application/json");
  });

  svr.Get("/", [&ctx](const httplib::Request&, httplib::Response& res) {
    const std::string_view page = web_ui_page();
    res.set_content(page.data(), page.size(), "text/html; charset=utf-8");
    ctx.count("/", 200);
  });
  // "degraded" once a generation failed on the server's side (a damaged pack, an I/O error): the
  // server still answers, but some requests may fail the same way.
  svr.Get("/health", [&ctx, this](const httplib::Request&, httplib::Response& res) {
    const EngineStats s = ctx.model.engine->stats();
    const EngineOptions& o = ctx.model.engine->options();
    ojson h = {{"status", s.requests_failed ? "degraded" : "ok"},
               {"model", ctx.model.id},
               {"slots_total", o.parallel},
               {"slots_busy", s.active},
               {"active_requests", s.active},
               {"batch_size", s.active},
               {"queued", s.queued},
               {"paused", s.paused},
               {"preemptions", s.preemptions},
               {"kv_bytes", s.kv_bytes},
               {"kv_budget_bytes", s.kv_budget},
               {"prefix_cache_entries", s.cache.entries},
               {"failed_requests", s.requests_failed},
               {"connections", impl_->transport.stats().open}};
    if (s.requests_failed) h["last_error"] = s.last_error;
    res.set_content(h.dump(-1, ' ', false, ojson::error_handler_t::replace), "application/json");
  });
  svr.Get("/metrics", [&ctx, this](const httplib::Request&, httplib::Response& res) {
    res.set_content(metrics_text(ctx, impl_->transport.stats()), "text/plain; version=0.0.4");
  });
  auto models = [&ctx](const httplib::Request&, httplib::Response& res) {
    const ojson entry = {{"id", ctx.model.id}, {"object", "model"}, {"created", unix_time()},
                         {"owned_by", "moestream"}, {"context_length", ctx.model.engine->options().ctx}};
    res.set_content(ojson{{"object", "list"}, {"data", ojson::array({entry})}}.dump(), "application/json");
    ctx.count("/v1/models", 200);
  };
  svr.Get("/v1/models", models);
  add_openai_routes(svr, ctx);
  add_anthropic_routes(svr, ctx);
}

HttpServer::~HttpServer() { stop(); }

int HttpServer::bind() {
  impl_->port = impl_->transport.bind(impl_->options.host, impl_->options.port);
  impl_->server.set_serving_socket(impl_->transport.listen_fd());
  return impl_->port;
}

void HttpServer::listen() {
  if (impl_->port < 0) bind();
  if (impl_->stopping) return;
  impl_->transport.run();
}

void HttpServer::stop() {
  impl_->stopping = true;
  impl_->server.set_serving_socket(-1);
  impl_->transport.stop();
}

}  // namespace moestream
