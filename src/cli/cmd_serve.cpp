// moestream serve: the OpenAI- and Anthropic-compatible HTTP server.
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <thread>

#include "cli/cli.h"
#include "core/error.h"
#include "server/http_server.h"

namespace moestream::cli {

namespace {

struct ServeFlags {
  ModelFlags model;
  ServeOptions serve;
  EngineOptions engine;
  std::string name;
  double max_body_mb = 16;
  double kv_mb = 0;
};

void serve(ServeFlags& f) {
  if (f.max_body_mb <= 0) fail("--max-body-mb must be > 0, got ", f.max_body_mb);
  f.serve.max_body_bytes = size_t(f.max_body_mb * 1024 * 1024);
  f.engine.kv_budget = int64_t(f.kv_mb * 1024 * 1024);
  if (f.serve.api_key.empty())
    if (const char* key = std::getenv("MOESTREAM_API_KEY")) f.serve.api_key = key;

  // SIGINT/SIGTERM stop the server from a thread that waits for them, so the handlers run no
  // code in signal context. Blocked before any thread starts, so every thread inherits the mask.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGINT);
  sigaddset(&signals, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);

  f.engine.ctx = f.model.ctx;
  auto served = ServedModel::load(f.model.dir, f.model.options, f.engine, f.name);
  HttpServer server(*served, f.serve);
  const int port = server.bind();
  std::fprintf(stderr,
               "moestream serve: model '%s' on http://%s:%d (context %lld, %d in parallel, %d "
               "queued at most, "
               "%d cached sequences, %lld MiB of KV memory%s)\n",
               served->id.c_str(), f.serve.host.c_str(), port,
               (long long)served->engine->options().ctx, f.engine.parallel, f.engine.max_queue,
               f.engine.kv_slots, (long long)(served->engine->stats().kv_budget >> 20),
               f.serve.api_key.empty() ? "" : ", API key required");
  std::thread waiter([&] {
    int sig = 0;
    sigwait(&signals, &sig);
    std::fprintf(stderr, "moestream serve: stopping (%s)\n", sig == SIGINT ? "SIGINT" : "SIGTERM");
    server.stop();
  });
  server.listen();
  // listen() also returns when the socket fails; wake the waiter so it can be joined.
  pthread_kill(waiter.native_handle(), SIGTERM);
  waiter.join();
}

}  // namespace

void add_serve(CLI::App& app) {
  auto flags = std::make_shared<ServeFlags>();
  CLI::App* cmd = app.add_subcommand("serve", "Serve the model over HTTP (OpenAI and Anthropic APIs)");
  flags->model.add_to(*cmd);
  cmd->add_option("--host", flags->serve.host, "Address to bind (default 127.0.0.1)");
  cmd->add_option("--port", flags->serve.port, "Port (default 8080; 0 = any free port)")->check(CLI::Range(0, 65535));
  cmd->add_option("--api-key", flags->serve.api_key,
                  "Require this key (Authorization: Bearer KEY, or x-api-key); default $MOESTREAM_API_KEY");
  cmd->add_option("--name", flags->name, "Model id clients see (default: the directory's name)");
  cmd->add_option("--parallel", flags->engine.parallel, "Requests generated at once (default 4)")->check(kPositive);
  cmd->add_option("--queue", flags->engine.max_queue, "Requests that may wait beyond those; more get 503 (default 64)")
      ->check(kNonNegative);
  cmd->add_option("--kv-slots", flags->engine.kv_slots,
                  "Sequence states the prefix cache keeps for reuse (default 8; 0 = off)")
      ->check(kNonNegative);
  cmd->add_option(
         "--kv-mb", flags->kv_mb,
         "KV memory in MB for the requests in flight and the prefix cache together; when full, the "
         "newest request is preempted and recomputed later (default: --parallel x --ctx)")
      ->check(kNonNegative);
  cmd->add_option("--max-body-mb", flags->max_body_mb, "Largest request body in MB, chunked or not (default 16)");
  cmd->add_option("--header-timeout", flags->serve.header_timeout_s,
                  "Seconds a client has to send a request's whole head (default 10)")
      ->check(kPositive);
  cmd->add_option("--body-timeout", flags->serve.body_timeout_s,
                  "Seconds a client has to send a request's whole body (default 60)")
      ->check(kPositive);
  cmd->add_option("--idle-timeout", flags->serve.idle_timeout_s,
                  "Seconds a kept-alive connection may wait for its next request (default 5)")
      ->check(kPositive);
  cmd->add_option("--max-connections", flags->serve.max_connections,
                  "Client connections open at once; more get 503 (default 512)")
      ->check(kPositive);
  cmd->add_option("--max-connections-per-client", flags->serve.max_connections_per_client,
                  "Connections open at once from one address; more get 503 (default 64)")
      ->check(kPositive);
  cmd->callback([flags] { serve(*flags); });
}

}  // namespace moestream::cli
