// A moestream server for a test: the model loaded from a directory, HttpServer listening on a free
// loopback port on its own thread, stopped and joined when destroyed.
#pragma once

#include <httplib.h>

#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>

#include "server/generation.h"
#include "server/http_server.h"
#include "test_util.h"

namespace moestream::test {

class ServedServer {
 public:
  ServedServer(const std::string& dir, const EngineOptions& eo, ServeOptions so) {
    const ModelOptions mo;
    model_ = ServedModel::load(dir, mo, eo, "tiny");
    so.port = 0;
    server_ = std::make_unique<HttpServer>(*model_, so);
    port_ = server_->bind();
    thread_ = std::thread([this] { server_->listen(); });
  }
  ~ServedServer() {
    server_->stop();
    thread_.join();
  }
  httplib::Client client() const {
    httplib::Client c("127.0.0.1", port_);
    c.set_read_timeout(60, 0);
    return c;
  }
  int port() const { return port_; }

 private:
  std::unique_ptr<ServedModel> model_;
  std::unique_ptr<HttpServer> server_;
  int port_ = 0;
  std::thread thread_;
};

// transformers' greedy replies on the serve fixture (tests/fixtures/serve/qwen3_tiny_chat/ref.json),
// in its key order.
inline const nlohmann::ordered_json& serve_ref() {
  static const nlohmann::ordered_json r =
      nlohmann::ordered_json::parse(read_file(fixture("serve/qwen3_tiny_chat/ref.json")));
  return r;
}

}  // namespace moestream::test
