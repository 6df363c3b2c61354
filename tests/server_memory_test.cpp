// The server gives freed heap memory back to the system once no request is being answered
// (Transport's trim_when_idle; the soak's RSS, docs/RELIABILITY.md "Soak").
#include <gtest/gtest.h>
#include <httplib.h>

#include <chrono>
#include <string>
#include <thread>

#include "io/pack.h"
#include "served.h"
#include "test_util.h"

namespace moestream {
namespace {

// The value of `name` in a Prometheus text, or -1 when it is not there.
double metric(const std::string& text, const std::string& name) {
  const size_t at = text.find("\n" + name + " ");
  return at == std::string::npos ? -1 : std::stod(text.substr(at + name.size() + 2));
}

TEST(ServerMemory, FreedMemoryIsTrimmedWhenIdle) {
  const std::string dir = ensure_pack(test::tiny_chat_copy("memory-model"), "");
  EngineOptions eo;
  eo.ctx = 512;
  eo.parallel = 1;
  ServeOptions so;
  so.port = 0;
  test::ServedServer s(dir, eo, so);
  auto models = s.client().Get("/v1/models");
  ASSERT_TRUE(models);
  ASSERT_EQ(models->status, 200);
  // The trim follows the answer (the next time round the reactor); /metrics is itself a request,
  // so it may take one more round to see it.
  double trims = -1;
  for (int i = 0; i < 50 && trims < 1; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    auto m = s.client().Get("/metrics");
    ASSERT_TRUE(m);
    trims = metric(m->body, "moestream_memory_trims_total");
  }
  EXPECT_GE(trims, 1);
}

}  // namespace
}  // namespace moestream
