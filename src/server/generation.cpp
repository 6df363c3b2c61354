#include "server/generation.h"

#include <filesystem>

#include "core/error.h"
#include "io/hf_config.h"

namespace moestream {

namespace {
constexpr int64_t kDefaultContext = 4096;  // when not asked for: the model's, at most this
}  // namespace

SamplingParams sampling_defaults(const GenerationDefaults& d) {
  SamplingParams p;
  if (d.do_sample.value_or(false)) {
    p.temperature = d.temperature.value_or(1.0f);
    p.top_k = d.top_k.value_or(0);
    p.top_p = d.top_p.value_or(1.0f);
    p.min_p = d.min_p.value_or(0.0f);
  }
  p.repetition_penalty = d.repetition_penalty.value_or(1.0f);
  return p;
}

std::unique_ptr<ServedModel> ServedModel::load(const std::string& dir, const ModelOptions& model_options,
                                               const EngineOptions& engine_options, std::string id) {
  auto m = std::make_unique<ServedModel>();
  m->dir = dir;
  m->id = id.empty() ? std::filesystem::path(dir).lexically_normal().filename().string() : id;
  if (m->id.empty()) m->id = std::filesystem::path(dir).lexically_normal().parent_path().filename().string();
  m->tokenizer = Tokenizer::load(dir);
  const bool has_template = std::filesystem::exists(dir + "/chat_template.jinja") ||
                            !m->tokenizer->chat_template().empty();
  if (has_template) m->chat_template = ChatTemplate::load(dir);
  const HfConfig config = HfConfig::load(dir + "/config.json").text();
  m->defaults = sampling_defaults(load_generation_defaults(dir, config));
  ModelOptions mo = model_options;
  mo.kv.growable = true;  // the engine's sequences take KV memory as they grow (--kv-mb)
  m->model = load_model(dir, mo);
  m->syntax = output_syntax(m->model->info().model_type);
  EngineOptions eo = engine_options;
  if (eo.ctx <= 0) {
    const int64_t trained = m->model->info().max_position;
    eo.ctx = trained > 0 ? std::min<int64_t>(trained, kDefaultContext) : kDefaultContext;
  }
  m->engine = std::make_unique<Engine>(*m->model, eo);
  return m;
}

std::vector<int32_t> ServedModel::encode_chat(const std::string& rendered) const {
  return tokenizer->encode(rendered);
}

std::shared_ptr<const TokenBytes> ServedModel::token_bytes() {
  std::call_once(token_bytes_once_, [&] { token_bytes_ = TokenBytes::build(*tokenizer, model->info().eos_token_ids); });
  return token_bytes_;
}

std::vector<int32_t> ServedModel::encode_text(const std::string& text) const {
  std::vector<int32_t> ids;
  if (tokenizer->add_bos() && tokenizer->bos_id()) ids.push_back(*tokenizer->bos_id());
  for (int32_t id : tokenizer->encode(text)) ids.push_back(id);
  return ids;
}

bool prompt_opens_reasoning(const std::string& rendered) {
  const size_t open = rendered.rfind("<think>");
  if (open == std::string::npos) return false;
  const size_t close = rendered.rfind("</think>");
  return close == std::string::npos || close < open;
}

namespace {

// Holds back text that may be the start of a stop string; reports the first stop string found.
class StopFilter {
 public:
  explicit StopFilter(const std::vector<std::string>& stops) : stops_(stops) {}
  // The text that is certainly output; sets `hit` when a stop string ended it.
  std::string push(std::string_view text, bool at_end) {
    pending_.append(text);
    size_t first = std::string::npos;
    for (const std::string& s : stops_) {
      if (s.empty()) continue;
      const size_t p = pending_.find(s);
      if (p < first) first = p, hit = s;
    }
    if (first != std::string::npos) {
      std::string out = pending_.substr(0, first);
      pending_.clear();
      return out;
    }
    size_t keep = 0;
    if (!at_end)
      for (const std::string& s : stops_)
        for (size_t n = std::min(pending_.size(), s.size() - 1); n > keep; --n)
          if (pending_.compare(pending_.size() - n, n, s, 0, n) == 0) {
            keep = n;
            break;
          }
    std::string out = pending_.substr(0, pending_.size() - keep);
    pending_.erase(0, pending_.size() - keep);
    return out;
  }
  std::string hit;

 private:
  const std::vector<std::string>& stops_;
  std::string pending_;
};

}  // namespace

JobRequest Generation::request_for(ServedModel& m, const GenerateOptions& o) {
  JobRequest request;
  request.prompt = o.prompt;
  request.sampling = o.sampling;
  request.max_tokens = o.max_tokens;
  request.logprobs = o.logprobs;
  request.ignore_eos = o.ignore_eos;
  if (o.grammar) request.constraint = std::make_shared<GrammarConstraint>(m.token_bytes(), o.grammar);
  else if (o.json_object) request.constraint = std::make_shared<JsonObjectConstraint>(m.token_bytes());
  else if (o.tool_call_grammar)
    request.constraint = std::make_shared<TriggeredConstraint>(m.token_bytes(), "<tool_call>", o.tool_call_grammar);
  return request;
}

Generation::Generation(ServedModel& m, GenerateOptions options) : m_(m), o_(std::move(options)) {
  job_ = m.engine->submit(request_for(m, o_));
}

Generation::Generation(ServedModel& m, GenerateOptions options, std::shared_ptr<Job> job)
    : m_(m), o_(std::move(options)), job_(std::move(job)) {}

std::vector<std::shared_ptr<Generation>> Generation::start_all(ServedModel& m, std::vector<GenerateOptions> options) {
  std::vector<JobRequest> requests;
  for (const GenerateOptions& o : options) requests.push_back(request_for(m, o));
  std::vector<std::shared_ptr<Job>> jobs = m.engine->submit_all(std::move(requests));
  std::vector<std::shared_ptr<Generation>> gens;
  for (size_t i = 0; i < options.size(); ++i)
    gens.push_back(std::shared_ptr<Generation>(new Generation(m, std::move(options[i]), std::move(jobs[i]))));
  return gens;
}

Generation::~Generation() {
  if (job_) job_->cancel();
}

GenerateResult Generation::run(const std::function<bool(const ParsedOutput&)>& on_delta,
                               const std::function<bool()>& alive) {
  ServedModel& m = m_;
  const GenerateOptions& o = o_;
  std::shared_ptr<Job> job = std::move(job_);
  if (!job) fail("a generation can run only once");
  struct CancelOnExit {  // whatever ends this call (a client's write error included)
    Job& job;
    ~CancelOnExit() { job.cancel(); }
  } guard{*job};
  GenerateResult r;
  r.prompt_tokens = int64_t(o.prompt.size());
  StreamDecoder decoder(*m.tokenizer);
  StopFilter stop(o.stop);
  OutputParser parser(o.chat ? m.syntax : OutputSyntax::tagged, o.chat && o.in_reasoning,
                      o.chat && o.parse_tools);
  auto emit = [&](ParsedOutput&& piece) {
    if (piece.empty()) return true;
    const bool keep_going = on_delta ? on_delta(piece) : true;
    r.output.append(std::move(piece));
    return keep_going;
  };
  auto deliver = [&](const std::string& text, bool at_end) {
    std::string certain = stop.push(text, at_end);
    if (!stop.hit.empty()) at_end = true;
    ParsedOutput piece;
    if (o.chat) {
      piece = parser.push(certain);
      if (at_end) piece.append(parser.finish());
    } else {
      piece.content = std::move(certain);
    }
    return emit(std::move(piece));
  };

  std::vector<int32_t> tokens;
  std::vector<TokenLogprob> logprobs;
  const bool want_logprobs = o.logprobs >= 0;
  FinishReason reason = FinishReason::running;
  bool client_gone = false;
  bool one_call = false;  // single_tool_call and the call is complete
  while (reason == FinishReason::running) {
    tokens.clear();
    logprobs.clear();
    reason = job->take(tokens, std::chrono::milliseconds(100), want_logprobs ? &logprobs : nullptr);
    for (size_t i = 0; i < tokens.size(); ++i) {
      const int32_t id = tokens[i];
      ++r.completion_tokens;
      r.tokens.push_back(id);
      if (i < logprobs.size()) {
        r.logprobs.push_back(logprobs[i]);
        pending_logprobs_.push_back(std::move(logprobs[i]));
      }
      if (!deliver(decoder.push(id), false)) client_gone = true;
      if (o.single_tool_call && !r.output.tool_calls.empty()) one_call = true;
      if (client_gone || !stop.hit.empty() || one_call) break;
    }
    if (!client_gone && alive && !alive()) client_gone = true;
    if (client_gone || !stop.hit.empty() || one_call) {
      job->cancel();
      while (job->take(tokens, std::chrono::milliseconds(100)) == FinishReason::running) tokens.clear();
      break;
    }
  }
  if (reason == FinishReason::failed) fail("generation failed: ", job->error());
  if (!client_gone && stop.hit.empty() && !one_call) deliver(decoder.flush(), true);

  r.cached_tokens = job->cached_tokens();
  r.prefill_seconds = job->prefill_seconds();
  r.decode_seconds = job->decode_seconds();
  r.first_token_seconds = job->first_token_seconds();
  r.stop_sequence = stop.hit;
  if (client_gone) r.finish_reason = "cancelled";
  else if (!r.output.tool_calls.empty()) r.finish_reason = "tool_calls";
  else if (!stop.hit.empty() || reason == FinishReason::eos) r.finish_reason = "stop";
  else r.finish_reason = "length";
  return r;
}

}  // namespace moestream
