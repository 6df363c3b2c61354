// moestream serve under abuse: deeply nested JSON, wrong-typed fields, a damaged expert, slow and
// oversized requests. Each case first shows the fault is answered with a clear JSON error (and no
// crash), then that the server still serves transformers' exact greedy replies.
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <httplib.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <thread>

#include "io/pack.h"
#include "models/model.h"
#include "server/http_server.h"
#include "served.h"
#include "test_util.h"

namespace moestream {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::ordered_json;
using clock_type = std::chrono::steady_clock;

// The serve fixture packed (its own copy: tests here damage it), with the Qwen3 tokenizer.
const std::string& pack_dir() {
  static const std::string dir = ensure_pack(test::tiny_chat_copy("reliability-model"), "");
  return dir;
}

const json& ref() {
  static const json r =
      json::parse(test::read_file(test::fixture("serve/qwen3_tiny_chat/ref.json")));
  return r;
}

ServeOptions quick_options() {
  ServeOptions so;
  so.port = 0;
  so.max_body_bytes = 1 << 20;
  so.header_timeout_s = 1;
  so.body_timeout_s = 1;
  so.idle_timeout_s = 1;
  return so;
}

// 12 workers and a queue of 2: fewer than the slow clients below.
class Served : public test::ServedServer {
 public:
  explicit Served(ServeOptions so = quick_options(), const std::string& dir = pack_dir())
      : ServedServer(dir, engine_options(), so) {}

 private:
  static EngineOptions engine_options() {
    EngineOptions eo;
    eo.ctx = 1024;
    eo.parallel = 2;
    eo.max_queue = 2;
    return eo;
  }
};

json post(const Served& s, const std::string& path, const std::string& body, int expect_status) {
  auto res = s.client().Post(path.c_str(), body, "application/json");
  EXPECT_TRUE(res) << path;
  if (!res) return {};
  EXPECT_EQ(res->status, expect_status) << res->body.substr(0, 400);
  json j = json::parse(res->body, nullptr, false);
  EXPECT_FALSE(j.is_discarded()) << "not JSON: " << res->body.substr(0, 400);
  return j;
}

// Every reference case through /v1/chat/completions: transformers' greedy reply, exactly.
void expect_greedy_replies(const Served& s) {
  for (const json& c : ref()["cases"]) {
    SCOPED_TRACE(c["name"].get<std::string>());
    json body = {{"messages", c["messages"]}, {"temperature", 0}, {"max_tokens", 16}};
    if (!c["tools"].is_null()) body["tools"] = c["tools"];
    json r = post(s, "/v1/chat/completions", body.dump(), 200);
    EXPECT_EQ(r["choices"][0]["message"]["content"], c["reply"]);
  }
}

std::string nested(int depth, const std::string& open, const std::string& close,
                   const std::string& inner) {
  std::string s;
  for (int i = 0; i < depth; ++i) s += open;
  s += inner;
  for (int i = 0; i < depth; ++i) s += close;
  return s;
}

TEST(ServerReliability, DeeplyNestedJsonIsRefusedBeforeAnythingRecurses) {
  Served s;
  const std::string deep = nested(30000, "{\"a\":", "}", "1");  // ~150 KB: 30,000 levels
  const std::string user = R"("messages": [{"role": "user", "content": "hi"}])";
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"/v1/chat/completions", "{" + user + ", \"chat_template_kwargs\": " + deep + "}"},
      {"/v1/chat/completions",
       "{" + user + R"(, "tools": [{"type": "function", "function": {"name": "f", "parameters": )" +
           deep + "}}]}"},
      {"/v1/chat/completions",
       R"({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": null, "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": )" +
           nlohmann::json(deep).dump() + "}}]}]}"},
      {"/v1/messages", "{\"max_tokens\": 4, " + user +
                           R"(, "tools": [{"name": "f", "input_schema": )" + deep + "}]}"},
      {"/v1/chat/completions", nested(30000, "[", "]", "")},
  };
  for (const auto& [path, body] : cases) {
    json r = post(s, path, body, 400);
    const std::string msg = r["error"]["message"].get<std::string>();
    EXPECT_NE(msg.find("nests deeper than 128 levels"), std::string::npos) << msg;
  }
  // Nesting within the limit is fine.
  json ok = post(s, "/v1/chat/completions",
                 "{" + user + ", \"max_tokens\": 2, \"chat_template_kwargs\": {\"x\": " +
                     nested(30, "[", "]", "") + "}}",
                 200);
  EXPECT_EQ(ok["object"], "chat.completion");
  expect_greedy_replies(s);
}

TEST(ServerReliability, WrongTypedFieldsName400) {
  Served s;
  const json base = {{"messages", {{{"role", "user"}, {"content", "hi"}}}}, {"max_tokens", 2}};
  const std::vector<std::tuple<std::string, json, std::string>> cases = {
      {"logit_bias", "x", "must be an object"},
      {"logit_bias", {{"5", "big"}}, "must be a number between -100 and 100"},
      {"logit_bias", {{"5", 101}}, "must be a number between -100 and 100"},
      {"logit_bias", {{"151936", 1}}, "keys must be token ids in [0, 151936)"},
      {"logit_bias", {{"x", 1}}, "keys must be token ids"},
      {"presence_penalty", 2.5, "must be between -2.0 and 2.0"},
      {"frequency_penalty", -3, "must be between -2.0 and 2.0"},
      {"n", 9, "must be between 1 and 8"},
      {"top_logprobs", 21, "must be between 0 and 20"},
      {"store", true, "not supported"},
      {"functions", json::array(), "is not supported by this server"},
      {"web_search_options", json::object(), "is not supported by this server"},
      {"user", 5, "must be a string"},
      {"reasoning_effort", 5, "must be one of"},
      {"reasoning_effort", "extreme", "must be one of"},
      {"parallel_tool_calls", "yes", "must be true or false"},
      {"metadata", 3, "must be an object of strings"},
      {"top_logprobs", "a", "must be an integer"},
      {"response_format", {{"type", 7}}, "response_format"},
  };
  for (const auto& [key, value, expect] : cases) {
    SCOPED_TRACE(key + " = " + value.dump());
    json body = base;
    body[key] = value;
    json r = post(s, "/v1/chat/completions", body.dump(), 400);
    EXPECT_NE(r["error"]["message"].get<std::string>().find(expect), std::string::npos) << r.dump();
    if (key != "response_format") {
      EXPECT_EQ(r["error"]["param"], key);
    }
  }
  const json abase = {{"messages", {{{"role", "user"}, {"content", "hi"}}}}, {"max_tokens", 2}};
  for (const auto& [key, value] :
       std::vector<std::pair<std::string, json>>{{"metadata", 5},
                                                 {"thinking", "yes"},
                                                 {"tool_choice", "auto"},
                                                 {"thinking", {{"type", 1}}}}) {
    SCOPED_TRACE(key + " = " + value.dump());
    json body = abase;
    body[key] = value;
    json r = post(s, "/v1/messages", body.dump(), 400);
    EXPECT_EQ(r["type"], "error");
    EXPECT_NE(r["error"]["message"].get<std::string>().find(key), std::string::npos) << r.dump();
  }
  // A content block whose fields have the wrong types: a 400, not a 500.
  json bad_block = abase;
  bad_block["messages"] = {
      {{"role", "user"}, {"content", {{{"type", "tool_result"}, {"tool_use_id", 5}}}}}};
  post(s, "/v1/messages", bad_block.dump(), 400);
  json bad_part = base;
  bad_part["messages"] = {{{"role", "user"}, {"content", {{{"type", 3}, {"text", "x"}}}}}};
  post(s, "/v1/chat/completions", bad_part.dump(), 400);
  expect_greedy_replies(s);
}

// Flips one byte of layer 0's expert 1 (a second flip puts it back).
void flip_expert_byte(const std::string& dir) {
  const PackManifest m = PackManifest::load(dir);
  const PackedExpert& e = m.expert(0, 1);
  std::fstream f(dir + "/" + m.expert_files[size_t(e.file)],
                 std::ios::in | std::ios::out | std::ios::binary);
  f.seekg(std::streamoff(e.offset + 8));
  char c = 0;
  f.read(&c, 1);
  f.seekp(std::streamoff(e.offset + 8));
  c = char(c ^ 0x5a);  // flipping twice restores the byte
  f.write(&c, 1);
}

TEST(ServerReliability, FailedExpertReadDoesNotWedgeTheServer) {
  const std::string dir = test::temp_dir("reliability-damaged") + "/pack";
  fs::copy(pack_dir(), dir, fs::copy_options::recursive);
  flip_expert_byte(dir);
  Served s(quick_options(), dir);
  const json body = {
      {"messages", ref()["cases"][0]["messages"]}, {"temperature", 0}, {"max_tokens", 4}};
  for (int i = 0; i < 2; ++i) {  // every request touching the expert fails the same clear way
    json r = post(s, "/v1/chat/completions", body.dump(), 500);
    const std::string msg = r["error"]["message"].get<std::string>();
    EXPECT_NE(msg.find("checksum mismatch for layer 0 expert 1"), std::string::npos) << msg;
  }
  auto health = s.client().Get("/health");
  ASSERT_TRUE(health);
  const json h = json::parse(health->body);
  EXPECT_EQ(h["status"], "degraded");
  EXPECT_EQ(h["failed_requests"], 2);
  EXPECT_NE(h["last_error"].get<std::string>().find("checksum mismatch"), std::string::npos)
      << h.dump();
  EXPECT_EQ(h["slots_busy"], 0);
  auto metrics = s.client().Get("/metrics");
  ASSERT_TRUE(metrics);
  EXPECT_NE(metrics->body.find("moestream_generations_failed_total 2\n"), std::string::npos);

  // Once the expert reads correctly again, every reply is exact: nothing of the failed requests
  // (pinned slots, a half-computed sequence state) is left behind.
  flip_expert_byte(dir);
  expect_greedy_replies(s);
}

// A raw connection to the server (for what an HTTP client library would not send).
int connect_to(int port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(uint16_t(port));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  EXPECT_EQ(::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a), 0);
  return fd;
}

void send_all(int fd, const std::string& s) {
  EXPECT_EQ(::send(fd, s.data(), s.size(), MSG_NOSIGNAL), ssize_t(s.size()));
}

// What the server sends until it closes the connection (or `timeout_s` passes).
std::string read_reply(int fd, double timeout_s) {
  std::string out;
  const auto end = clock_type::now() + std::chrono::milliseconds(int(timeout_s * 1000));
  char buf[4096];
  for (;;) {
    const auto left =
        std::chrono::duration_cast<std::chrono::milliseconds>(end - clock_type::now()).count();
    pollfd p{fd, POLLIN, 0};
    if (left <= 0 || ::poll(&p, 1, int(left)) <= 0) break;
    const ssize_t n = ::recv(fd, buf, sizeof buf, 0);
    if (n <= 0) break;
    out.append(buf, size_t(n));
  }
  return out;
}

double seconds_since(clock_type::time_point t0) {
  return std::chrono::duration<double>(clock_type::now() - t0).count();
}

TEST(ServerReliability, SlowClientsDoNotHoldWorkers) {
  Served s;  // 12 workers, 1 s for a head and for a body
  std::vector<int> slow;
  for (int i = 0; i < 40; ++i) {  // more than the workers
    const int fd = connect_to(s.port());
    if (i % 2 == 0)
      send_all(fd, "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n");  // the head never ends
    else
      send_all(
          fd,
          "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n{\"mess");
    slow.push_back(fd);
  }
  for (int i = 0; i < 5; ++i) {
    const auto t0 = clock_type::now();
    auto res = s.client().Get("/health");
    ASSERT_TRUE(res);
    EXPECT_EQ(res->status, 200);
    EXPECT_LT(seconds_since(t0), 0.5);
  }
  // The deadlines are for the whole head and body: a byte now and then does not extend them.
  send_all(slow[0], "X-A: 1\r\n");
  const auto t0 = clock_type::now();
  for (size_t i = 0; i < slow.size(); ++i) {
    const std::string reply = read_reply(slow[i], 5);
    EXPECT_EQ(reply.rfind("HTTP/1.1 408", 0), 0u) << reply;
    EXPECT_NE(
        reply.find(i % 2 == 0 ? "request head was not complete" : "request body was not complete"),
        std::string::npos)
        << reply;
    ::close(slow[i]);
  }
  EXPECT_LT(seconds_since(t0), 3);
  auto metrics = s.client().Get("/metrics");
  ASSERT_TRUE(metrics);
  EXPECT_NE(metrics->body.find("moestream_http_refused_total{reason=\"header_timeout\"} 20"),
            std::string::npos);
  EXPECT_NE(metrics->body.find("moestream_http_refused_total{reason=\"body_timeout\"} 20"),
            std::string::npos);
  expect_greedy_replies(s);
}

TEST(ServerReliability, BadContentLengthIsRefusedAtOnce) {
  Served s;
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"-5", "HTTP/1.1 400"},
      {"9223372036854775807", "HTTP/1.1 413"},
      {"12abc", "HTTP/1.1 400"},
      {"99999999999999999999999", "HTTP/1.1 400"},
      {"2000000", "HTTP/1.1 413"}};
  for (const auto& [length, status] : cases) {
    SCOPED_TRACE(length);
    const int fd = connect_to(s.port());
    const auto t0 = clock_type::now();
    send_all(fd, "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: " + length +
                     "\r\n\r\n{");
    const std::string reply = read_reply(fd, 5);
    EXPECT_LT(seconds_since(t0), 0.5);
    EXPECT_EQ(reply.rfind(status, 0), 0u) << reply;
    EXPECT_NE(reply.find("\"error\""), std::string::npos) << reply;
    ::close(fd);
  }
  expect_greedy_replies(s);
}

TEST(ServerReliability, ChunkedBodyOverTheLimitIsCutShort) {
  Served s;  // at most 1 MiB
  const int fd = connect_to(s.port());
  send_all(fd,
           "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n");
  const std::string chunk(64 << 10, ' ');
  char size[32];
  std::snprintf(size, sizeof size, "%zx\r\n", chunk.size());
  size_t sent = 0;
  // Up to 64 MiB; the server stops reading after 1 MiB, so the sends fail or stall long before.
  while (sent < (64u << 20)) {
    const std::string piece = size + chunk + "\r\n";
    pollfd p{fd, POLLOUT, 0};
    if (::poll(&p, 1, 2000) <= 0 || (p.revents & (POLLERR | POLLHUP))) break;
    const ssize_t n = ::send(fd, piece.data(), piece.size(), MSG_NOSIGNAL);
    if (n <= 0) break;
    sent += size_t(n);
  }
  EXPECT_LT(sent, 24u << 20);
  const std::string reply = read_reply(fd, 3);
  ::close(fd);
  if (!reply.empty()) {  // it may be lost to the reset of a connection still sending
    EXPECT_EQ(reply.rfind("HTTP/1.1 413", 0), 0u) << reply;
    EXPECT_NE(reply.find("chunked request body exceeds"), std::string::npos) << reply;
  }
  // The same through an HTTP client: a 413 with a JSON body.
  httplib::Client c = s.client();
  const std::string big(2 << 20, ' ');
  auto res = c.Post(
      "/v1/chat/completions", big.size(),
      [&](size_t offset, size_t length, httplib::DataSink& sink) {
        sink.write(big.data() + offset, std::min<size_t>(length, 65536));
        return true;
      },
      "application/json");
  if (res) {
    EXPECT_EQ(res->status, 413);
  }
  expect_greedy_replies(s);
}

TEST(ServerReliability, ConnectionsPerClientAreLimited) {
  ServeOptions so = quick_options();
  so.max_connections_per_client = 6;
  Served s(so);
  std::vector<int> held;
  for (int i = 0; i < 6; ++i) held.push_back(connect_to(s.port()));
  const int extra = connect_to(s.port());
  const std::string reply = read_reply(extra, 2);
  EXPECT_EQ(reply.rfind("HTTP/1.1 503", 0), 0u) << reply;
  EXPECT_NE(reply.find("too many open connections from 127.0.0.1"), std::string::npos) << reply;
  ::close(extra);
  for (int fd : held) ::close(fd);
  std::this_thread::sleep_for(std::chrono::milliseconds(200));  // the server sees them close
  expect_greedy_replies(s);
}

}  // namespace
}  // namespace moestream
