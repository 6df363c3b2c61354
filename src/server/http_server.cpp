#include "server/http_server.h"
#include "server/webui.h"

#include <httplib.h>
#include <sys/socket.h>

#include <sstream>

#include "core/error.h"

namespace moestream {

struct HttpServer::Impl {
  Impl(ServedModel& m, const ServeOptions& o) : options(o), ctx{m, o.api_key} {}
  ServeOptions options;
  ServerContext ctx;
  httplib::Server server;
  int port = -1;
  int listen_fd = -1;
};

namespace {

// Prometheus text exposition.
std::string metrics_text(ServerContext& ctx) {
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
  metric("moestream_prefix_cache_entries", "gauge", "Sequence states held by the prefix cache.", s.cache.entries);
  metric("moestream_expert_hits_total", "counter", "Expert lookups served from the cache.", double(s.experts.hits));
  metric("moestream_expert_misses_total", "counter", "Expert lookups read from disk.", double(s.experts.misses));
  metric("moestream_expert_hit_rate", "gauge", "Expert cache hit rate since start.", s.experts.hit_rate());
  metric("moestream_expert_bytes_read_total", "counter", "Bytes of expert weights read from disk.", double(s.experts.bytes_read));
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
  const EngineOptions& eo = model.engine->options();
  // Enough connection threads that every request the engine could queue gets one, and one more
  // beyond that is answered 503 instead of waiting unseen.
  const size_t threads = size_t(eo.parallel + eo.max_queue + 8);
  svr.new_task_queue = [threads] { return new httplib::ThreadPool(threads); };
  // httplib listens with a backlog of 5, so a burst of clients finds the accept queue full and
  // some of their connections die. Remember the listening socket to widen the backlog after bind.
  svr.set_socket_options([this](socket_t sock) {
    httplib::default_socket_options(sock);
    if (impl_->listen_fd < 0) impl_->listen_fd = sock;
  });
  svr.set_payload_max_length(options.max_body_bytes);
  svr.set_keep_alive_max_count(100);
  svr.set_read_timeout(60, 0);
  svr.set_write_timeout(60, 0);

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
  svr.Get("/health", [&ctx](const httplib::Request&, httplib::Response& res) {
    const EngineStats s = ctx.model.engine->stats();
    const EngineOptions& o = ctx.model.engine->options();
    res.set_content(ojson{{"status", "ok"}, {"model", ctx.model.id}, {"slots_total", o.parallel},
                          {"slots_busy", s.active}, {"queued", s.queued},
                          {"prefix_cache_entries", s.cache.entries}}.dump(),
                    "application/json");
  });
  svr.Get("/metrics", [&ctx](const httplib::Request&, httplib::Response& res) {
    res.set_content(metrics_text(ctx), "text/plain; version=0.0.4");
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
  const ServeOptions& o = impl_->options;
  impl_->port = o.port == 0 ? impl_->server.bind_to_any_port(o.host)
                            : (impl_->server.bind_to_port(o.host, o.port) ? o.port : -1);
  if (impl_->port < 0) fail("serve: cannot listen on ", o.host, ":", o.port, " (address in use or not available)");
  if (impl_->listen_fd >= 0) ::listen(impl_->listen_fd, SOMAXCONN);  // listen again: a longer queue
  return impl_->port;
}

void HttpServer::listen() {
  if (impl_->port < 0) bind();
  impl_->server.listen_after_bind();
}

void HttpServer::stop() { impl_->server.stop(); }

}  // namespace moestream
