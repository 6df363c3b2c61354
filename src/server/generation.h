// One request's generation as the server and the terminal chat run it: the prompt goes to the
// engine, tokens come back as text (whole UTF-8 characters), stop strings end it, and the text is
// split into answer, reasoning and tool calls as it streams.
#pragma once

#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "io/hf_config.h"
#include "models/model.h"
#include "server/engine.h"
#include "server/json_constraint.h"
#include "server/output_parser.h"
#include "text/chat_template.h"
#include "text/sampler.h"
#include "text/tokenizer.h"

namespace moestream {

// A loaded model with everything the server needs around it.
struct ServedModel {
  std::string id;  // the name clients use ("model" field); the directory's name by default
  std::string dir;
  std::unique_ptr<Model> model;
  std::unique_ptr<Tokenizer> tokenizer;
  std::optional<ChatTemplate> chat_template;  // absent: chat endpoints answer 400
  OutputSyntax syntax = OutputSyntax::tagged;
  SamplingParams defaults;                    // from generation_config.json
  std::unique_ptr<Engine> engine;

  static std::unique_ptr<ServedModel> load(const std::string& dir, const ModelOptions& model_options,
                                           const EngineOptions& engine_options, std::string id = "");
  // Prompt ids of a rendered chat prompt (special tokens in the text become their ids; no BOS is
  // added, as transformers' apply_chat_template(tokenize=True) does).
  std::vector<int32_t> encode_chat(const std::string& rendered) const;
  // Prompt ids of raw text (BOS added when the tokenizer says so).
  std::vector<int32_t> encode_text(const std::string& text) const;
  // The bytes of every token, for output constraints; made on first use (a pass over the vocabulary).
  std::shared_ptr<const TokenBytes> token_bytes();

 private:
  std::once_flag token_bytes_once_;
  std::shared_ptr<const TokenBytes> token_bytes_;
};

struct GenerateOptions {
  std::vector<int32_t> prompt;
  SamplingParams sampling;
  int max_tokens = 16;
  std::vector<std::string> stop;  // stop strings (not included in the output)
  bool json_object = false;       // constrain the output to a JSON object
  std::shared_ptr<const JsonGrammar> grammar;  // or to this grammar (json_schema, a forced tool call)
  // Or: free text, but what follows a "<tool_call>" the model writes follows this grammar
  // (tool_choice auto with strict tools).
  std::shared_ptr<const JsonGrammar> tool_call_grammar;
  int logprobs = -1;              // -1: none; else report logprobs with this many alternatives
  bool ignore_eos = false;        // generate past end-of-sequence ids, up to max_tokens or a stop string
  bool chat = false;              // split reasoning and tool calls out of the text
  bool parse_tools = false;
  bool single_tool_call = false;  // end the reply after its first tool call
  bool in_reasoning = false;      // the prompt ends inside an open reasoning block
};

struct GenerateResult {
  ParsedOutput output;             // everything, also when it was streamed
  std::string finish_reason;       // "stop", "length", "tool_calls" or "cancelled"
  std::string stop_sequence;       // the stop string that ended it, if one did
  int64_t prompt_tokens = 0, completion_tokens = 0, cached_tokens = 0;
  double prefill_seconds = 0, decode_seconds = 0;
  double first_token_seconds = 0;  // from queueing to the first generated token
  std::vector<TokenLogprob> logprobs;  // of every generated token, when asked for
  std::vector<int32_t> tokens;         // the generated ids (moestream chat continues a reply from them)
};

// One request. The constructor queues it (throws QueueFull when the queue is full, Error when it
// does not fit the context), so a server can answer 503/400 before it starts a streamed reply.
class Generation {
 public:
  Generation(ServedModel& m, GenerateOptions options);
  // Several generations queued at once (Engine::submit_all): a request's choices.
  static std::vector<std::shared_ptr<Generation>> start_all(ServedModel& m, std::vector<GenerateOptions> options);
  ~Generation();  // a request not run to its end is cancelled
  Generation(const Generation&) = delete;
  Generation& operator=(const Generation&) = delete;

  // Runs it to its end. on_delta receives each newly decided piece as it is generated (never an
  // empty one) and returns false when the client has gone, which stops generation; alive() is
  // polled while waiting and may do the same. Throws Error when generation failed.
  GenerateResult run(const std::function<bool(const ParsedOutput&)>& on_delta,
                     const std::function<bool()>& alive = {});
  // The logprobs of the tokens delivered since the last call (from inside on_delta: those of the
  // piece it got, and of tokens whose text is still held back).
  std::vector<TokenLogprob> take_logprobs() { return std::exchange(pending_logprobs_, {}); }

 private:
  Generation(ServedModel& m, GenerateOptions options, std::shared_ptr<Job> job);
  static JobRequest request_for(ServedModel& m, const GenerateOptions& o);

  ServedModel& m_;
  GenerateOptions o_;
  std::shared_ptr<Job> job_;
  std::vector<TokenLogprob> pending_logprobs_;
};

// Sampling parameters from generation_config.json (greedy unless it says do_sample).
SamplingParams sampling_defaults(const GenerationDefaults& d);

// Whether a rendered prompt ends inside an open <think> block (the template opened it).
bool prompt_opens_reasoning(const std::string& rendered);

}  // namespace moestream
