// OpenAI-compatible endpoints: /v1/chat/completions and /v1/completions, plain and streamed
// (server-sent events ending with "data: [DONE]").
#include <httplib.h>

#include <chrono>
#include <functional>

#include "core/error.h"
#include "server/api.h"
#include "server/requests.h"

namespace moestream {

namespace {

// Runs a handler, turning every failure into an OpenAI-style JSON error.
template <typename F>
void guarded(ServerContext& ctx, const std::string& endpoint, const httplib::Request& req,
             httplib::Response& res, F&& handle) {
  try {
    handle(req, res);
  } catch (const ApiError& e) {
    res.status = e.status;
    res.set_content(openai_error_body(e.what(), "invalid_request_error", e.param, nullptr).dump(), "application/json");
  } catch (const nlohmann::json::exception&) {
    // A field read without its own check met a value of another type: still the client's error.
    res.status = 400;
    res.set_content(openai_error_body("a field of the request has the wrong type", "invalid_request_error", "", nullptr).dump(),
                    "application/json");
  } catch (const QueueFull& e) {
    res.status = 503;
    res.set_header("Retry-After", "1");
    res.set_content(openai_error_body(e.what(), "server_overloaded", "", 503).dump(), "application/json");
  } catch (const std::exception& e) {
    res.status = 500;
    res.set_content(openai_error_body(e.what(), "server_error", "", 500).dump(), "application/json");
  }
  const int status = res.status == -1 ? 200 : res.status;  // httplib sets 200 after the handler
  ctx.count(endpoint, status);
  if (status != 200) log_request(ctx, endpoint, "", status, {}, 0);  // successes log their own line
}

ojson tool_calls_json(const std::vector<ToolCall>& calls, size_t first_index, bool with_index) {
  ojson out = ojson::array();
  for (size_t i = 0; i < calls.size(); ++i) {
    ojson c = {{"id", calls[i].id}, {"type", "function"},
               {"function", {{"name", calls[i].name}, {"arguments", calls[i].arguments}}}};
    if (with_index) c["index"] = first_index + i;
    out.push_back(std::move(c));
  }
  return out;
}

ojson usage_json(const GenerateResult& r) {
  return {{"prompt_tokens", r.prompt_tokens}, {"completion_tokens", r.completion_tokens},
          {"total_tokens", r.prompt_tokens + r.completion_tokens},
          {"prompt_tokens_details", {{"cached_tokens", r.cached_tokens}}}};
}

bool is_blank(const std::string& s) { return s.find_first_not_of(" \t\r\n") == std::string::npos; }

// The n generations of a request, queued at once (the engine admits them in one turn and runs
// them side by side, so their batches do not depend on timing). Choice i samples with its own
// seed derived from the request's, so sampled choices differ and a seeded request repeats
// exactly; greedy choices are identical.
std::vector<std::shared_ptr<Generation>> start_choices(ServedModel& m, const GenerateOptions& o, int n) {
  std::vector<GenerateOptions> options;
  for (int i = 0; i < n; ++i) {
    options.push_back(o);
    options.back().sampling.seed = o.sampling.seed + uint64_t(i) * 0x9E3779B97F4A7C15ull;
  }
  return Generation::start_all(m, std::move(options));
}

void write_event(httplib::DataSink& sink, const ojson& j) {
  const std::string s = "data: " + j.dump(-1, ' ', false, ojson::error_handler_t::replace) + "\n\n";
  sink.write(s.data(), s.size());
}

ojson usage_json(const std::vector<GenerateResult>& rs) {
  GenerateResult sum = rs.at(0);
  for (size_t i = 1; i < rs.size(); ++i) sum.completion_tokens += rs[i].completion_tokens;
  return usage_json(sum);
}

std::vector<const GenerateResult*> pointers(const std::vector<GenerateResult>& rs) {
  std::vector<const GenerateResult*> out;
  for (const auto& r : rs) out.push_back(&r);
  return out;
}

double since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

struct StreamSpec {
  ojson envelope;                                                    // id, object, created, model
  std::function<ojson(size_t)> first;                                // a choice opening choice i, or null
  std::function<ojson(size_t, Generation&, const ParsedOutput&)> pieces;  // choices for a piece
  std::function<ojson(size_t, Generation&, const GenerateResult&)> last;  // choice i's closing choice
};

// Streams the choices' generations, one after another, as server-sent events: each event is the
// envelope with "choices" holding one choice (its "index" tells them apart); then the usage event
// when asked for, and "data: [DONE]". Logs the request when it ends.
void stream_events(ServerContext& ctx, const std::string& endpoint, httplib::Response& res,
                   std::vector<std::shared_ptr<Generation>> gens, bool include_usage, StreamSpec spec,
                   std::string user, std::chrono::steady_clock::time_point t0) {
  res.set_header("Cache-Control", "no-cache");
  ServerContext* context = &ctx;
  res.set_chunked_content_provider("text/event-stream", [=](size_t, httplib::DataSink& sink) {
    const std::string id = spec.envelope["id"];
    auto event = [&](ojson choice) {
      ojson e = spec.envelope;
      e["choices"] = ojson::array({std::move(choice)});
      write_event(sink, e);
    };
    std::vector<GenerateResult> results;
    try {
      for (size_t i = 0; i < gens.size(); ++i) {
        ojson first = spec.first ? spec.first(i) : ojson();
        if (!first.is_null()) event(std::move(first));
        Generation& gen = *gens[i];
        GenerateResult r = gen.run(
            [&](const ParsedOutput& piece) {
              for (ojson& c : spec.pieces(i, gen, piece)) event(std::move(c));
              return sink.is_writable();
            },
            [&] { return sink.is_writable(); });
        if (r.finish_reason == "cancelled") {
          results.push_back(std::move(r));
          log_request(*context, endpoint, id, 499, pointers(results), since(t0), user);
          return false;
        }
        event(spec.last(i, gen, r));
        results.push_back(std::move(r));
      }
      if (include_usage) {
        ojson e = spec.envelope;
        e["choices"] = ojson::array();
        e["usage"] = usage_json(results);
        write_event(sink, e);
      }
      log_request(*context, endpoint, id, 200, pointers(results), since(t0), user);
    } catch (const std::exception& e) {
      write_event(sink, openai_error_body(e.what(), "server_error", "", 500));
      log_request(*context, endpoint, id, 500, pointers(results), since(t0), user);
    }
    const std::string done = "data: [DONE]\n\n";
    sink.write(done.data(), done.size());
    sink.done();
    return true;
  });
}

void chat_completions(ServerContext& ctx, const httplib::Request& req, httplib::Response& res) {
  const auto t0 = std::chrono::steady_clock::now();
  ServedModel& m = ctx.model;
  const ojson body = parse_body(req.body);
  const ChatRequest c = parse_chat_request(m, body, m.engine->options().ctx);
  const bool logprobs = c.logprobs;
  if (c.shift.dropped_messages > 0) res.set_header(kShiftHeader, std::to_string(c.shift.dropped_messages));
  auto gens = start_choices(m, c.options, c.n);
  const std::string id = random_id("chatcmpl-");
  const int64_t created = unix_time();
  const std::string model_id = m.id;
  const Tokenizer* tok = m.tokenizer.get();

  if (!c.stream) {
    std::vector<GenerateResult> results;
    ojson choices = ojson::array();
    for (size_t i = 0; i < gens.size(); ++i) {
      GenerateResult r = gens[i]->run(nullptr);
      ojson message = {{"role", "assistant"}};
      const bool calls = !r.output.tool_calls.empty();
      message["content"] = calls && is_blank(r.output.content) ? ojson(nullptr) : ojson(r.output.content);
      if (!r.output.reasoning.empty()) message["reasoning_content"] = r.output.reasoning;
      if (calls) message["tool_calls"] = tool_calls_json(r.output.tool_calls, 0, false);
      choices.push_back({{"index", i}, {"message", message},
                         {"logprobs", logprobs ? chat_logprobs(*tok, r.logprobs) : ojson(nullptr)},
                         {"finish_reason", r.finish_reason}});
      results.push_back(std::move(r));
    }
    ojson out = {{"id", id}, {"object", "chat.completion"}, {"created", created}, {"model", model_id},
                 {"choices", choices}, {"usage", usage_json(results)}};
    if (c.shift.dropped_messages > 0) out["context_shift"] = c.shift.json();
    res.set_content(out.dump(-1, ' ', false, ojson::error_handler_t::replace), "application/json");
    log_request(ctx, "/v1/chat/completions", id, 200, pointers(results), since(t0), c.user);
    return;
  }

  auto choice = [](size_t i, ojson delta, ojson finish, ojson lp) {
    return ojson{{"index", i}, {"delta", std::move(delta)}, {"logprobs", std::move(lp)}, {"finish_reason", std::move(finish)}};
  };
  auto lp_of = [logprobs, tok](Generation& gen) {
    if (!logprobs) return ojson(nullptr);
    std::vector<TokenLogprob> lps = gen.take_logprobs();
    return lps.empty() ? ojson(nullptr) : chat_logprobs(*tok, lps);
  };
  auto n_calls = std::make_shared<std::vector<size_t>>(gens.size(), 0);
  StreamSpec spec;
  spec.envelope = {{"id", id}, {"object", "chat.completion.chunk"}, {"created", created}, {"model", model_id}};
  // A context shift is noted in every chunk: a client reading any of them learns of it.
  if (c.shift.dropped_messages > 0) spec.envelope["context_shift"] = c.shift.json();
  spec.first = [=](size_t i) { return choice(i, {{"role", "assistant"}, {"content", ""}}, nullptr, nullptr); };
  spec.pieces = [=](size_t i, Generation& gen, const ParsedOutput& piece) {
    ojson out = ojson::array();
    if (!piece.reasoning.empty()) out.push_back(choice(i, {{"reasoning_content", piece.reasoning}}, nullptr, nullptr));
    if (!piece.content.empty()) out.push_back(choice(i, {{"content", piece.content}}, nullptr, nullptr));
    if (!piece.tool_calls.empty()) {
      out.push_back(choice(i, {{"tool_calls", tool_calls_json(piece.tool_calls, (*n_calls)[i], true)}}, nullptr, nullptr));
      (*n_calls)[i] += piece.tool_calls.size();
    }
    if (!out.empty()) out[0]["logprobs"] = lp_of(gen);  // the tokens of this piece
    return out;
  };
  spec.last = [=](size_t i, Generation& gen, const GenerateResult& r) {
    return choice(i, ojson::object(), r.finish_reason, lp_of(gen));
  };
  stream_events(ctx, "/v1/chat/completions", res, std::move(gens), c.include_usage, std::move(spec), c.user, t0);
}

void completions(ServerContext& ctx, const httplib::Request& req, httplib::Response& res) {
  const auto t0 = std::chrono::steady_clock::now();
  ServedModel& m = ctx.model;
  const ojson body = parse_body(req.body);
  const CompletionRequest c = parse_completion_request(m, body, m.engine->options().ctx);
  const int logprobs = c.options.logprobs;
  auto gens = start_choices(m, c.options, c.n);
  const std::string id = random_id("cmpl-");
  const int64_t created = unix_time();
  const std::string model_id = m.id;
  const Tokenizer* tok = m.tokenizer.get();
  auto choice = [](size_t i, const std::string& text, ojson finish, ojson lp) {
    return ojson{{"text", text}, {"index", i}, {"logprobs", std::move(lp)}, {"finish_reason", std::move(finish)}};
  };
  if (!c.stream) {
    std::vector<GenerateResult> results;
    ojson choices = ojson::array();
    for (size_t i = 0; i < gens.size(); ++i) {
      GenerateResult r = gens[i]->run(nullptr);
      size_t offset = 0;
      choices.push_back(choice(i, r.output.content, r.finish_reason,
                               logprobs >= 0 ? completion_logprobs(*tok, r.logprobs, offset) : ojson(nullptr)));
      results.push_back(std::move(r));
    }
    ojson out = {{"id", id}, {"object", "text_completion"}, {"created", created}, {"model", model_id},
                 {"choices", choices}, {"usage", usage_json(results)}};
    res.set_content(out.dump(-1, ' ', false, ojson::error_handler_t::replace), "application/json");
    log_request(ctx, "/v1/completions", id, 200, pointers(results), since(t0), c.user);
    return;
  }
  auto offsets = std::make_shared<std::vector<size_t>>(gens.size(), 0);
  auto lp_of = [=](size_t i, Generation& gen) {
    if (logprobs < 0) return ojson(nullptr);
    std::vector<TokenLogprob> lps = gen.take_logprobs();
    return lps.empty() ? ojson(nullptr) : completion_logprobs(*tok, lps, (*offsets)[i]);
  };
  StreamSpec spec;
  spec.envelope = {{"id", id}, {"object", "text_completion"}, {"created", created}, {"model", model_id}};
  spec.pieces = [=](size_t i, Generation& gen, const ParsedOutput& piece) {
    return ojson::array({choice(i, piece.content, nullptr, lp_of(i, gen))});
  };
  spec.last = [=](size_t i, Generation& gen, const GenerateResult& r) { return choice(i, "", r.finish_reason, lp_of(i, gen)); };
  stream_events(ctx, "/v1/completions", res, std::move(gens), c.include_usage, std::move(spec), c.user, t0);
}

}  // namespace

void add_openai_routes(httplib::Server& svr, ServerContext& ctx) {
  svr.Post("/v1/chat/completions", [&ctx](const httplib::Request& req, httplib::Response& res) {
    guarded(ctx, "/v1/chat/completions", req, res,
            [&](const httplib::Request& q, httplib::Response& r) { chat_completions(ctx, q, r); });
  });
  svr.Post("/v1/completions", [&ctx](const httplib::Request& req, httplib::Response& res) {
    guarded(ctx, "/v1/completions", req, res,
            [&](const httplib::Request& q, httplib::Response& r) { completions(ctx, q, r); });
  });
}

}  // namespace moestream
