// The generation engine behind `serve` and `chat`: one thread owns the model and runs the
// admitted requests together, one batched forward pass per step (Model::forward_batch) holding
// every decoding request's next token and a share of the prompt chunks, so up to `parallel`
// requests make progress together, none waits for another to finish, and each expert is read
// once per step for all of them. Requests beyond that wait
// in a bounded FIFO queue. Each request starts from the longest usable prefix held in the prefix
// cache and leaves its final sequence state there.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <span>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "models/model.h"
#include "server/prefix_cache.h"
#include "text/sampler.h"

namespace moestream {

// Restricts which tokens may come next (e.g. JSON output). Called on the engine thread only.
class TokenConstraint {
 public:
  virtual ~TokenConstraint() = default;
  virtual void mask(std::span<float> logits) = 0;  // disallowed tokens -> -infinity
  virtual void accept(int32_t token) = 0;
};

// The log-probability of a generated token and of the most likely alternatives at its position:
// log-softmax of the model's own logits, before penalties, logit bias, constraints and temperature
// (what OpenAI reports: the model's distribution, not the sampler's).
struct TokenLogprob {
  int32_t token = -1;
  float logprob = 0;
  std::vector<std::pair<int32_t, float>> top;  // most likely first
};

struct JobRequest {
  std::vector<int32_t> prompt;
  SamplingParams sampling;
  int max_tokens = 0;                           // >= 1
  std::shared_ptr<TokenConstraint> constraint;  // optional
  int logprobs = -1;                            // -1: none; else also this many alternatives (<= 20)
  bool ignore_eos = false;  // an end-of-sequence id is a token like any other (vLLM's and llama.cpp's field)
};

// Log-probabilities at one position from the model's logits (see TokenLogprob); `top` alternatives.
TokenLogprob token_logprob(std::span<const float> logits, int32_t token, int top);

enum class FinishReason { running, eos, length, cancelled, failed };

// One request in flight: the engine appends tokens, the caller takes them. Thread-safe.
class Job {
 public:
  explicit Job(JobRequest request) : request_(std::move(request)) {}
  const JobRequest& request() const { return request_; }

  // Moves newly generated tokens into `out` (appending). Waits up to `timeout` when there are
  // none yet. Returns the finish reason (running while more may come).
  FinishReason take(std::vector<int32_t>& out, std::chrono::milliseconds timeout,
                    std::vector<TokenLogprob>* logprobs = nullptr);
  // Stops generation at the next step (client gone, stop string found). Idempotent.
  void cancel() { cancelled_.store(true); }
  bool cancelled() const { return cancelled_.load(); }
  std::string error() const;

  int64_t cached_tokens() const { return cached_tokens_.load(); }  // prompt tokens reused
  double prefill_seconds() const { return prefill_seconds_.load(); }
  double decode_seconds() const { return decode_seconds_.load(); }
  // Seconds from submit() to the first generated token (0 until there is one).
  double first_token_seconds() const { return first_token_seconds_.load(); }

 private:
  friend class Engine;
  void push(int32_t token, TokenLogprob* logprob);
  void finish(FinishReason reason, std::string error = {});

  JobRequest request_;
  std::atomic<bool> cancelled_{false};
  std::atomic<int64_t> cached_tokens_{0};
  std::atomic<double> prefill_seconds_{0}, decode_seconds_{0}, first_token_seconds_{0};
  std::chrono::steady_clock::time_point submitted_ = std::chrono::steady_clock::now();
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::vector<int32_t> pending_;
  std::vector<TokenLogprob> pending_logprobs_;
  FinishReason reason_ = FinishReason::running;
  std::string error_;
};

struct EngineOptions {
  int parallel = 4;            // requests in flight at once: the sequences of a batch
  int max_queue = 64;          // requests waiting beyond those; more are refused
  int64_t ctx = 4096;          // positions per sequence (prompt + generated); ServedModel::load
                               // takes 0 as the model's own, at most 4096; the engine lowers it
                               // to what kv_budget holds for one sequence
  int kv_slots = 8;            // sequence states kept by the prefix cache
  // Bytes of KV memory (the caches of attention layers; not the fixed recurrent states of hybrid
  // models) for the sequences in flight and the prefix cache's states together (--kv-mb). Sequences
  // take it as they grow; when a step would need more, the prefix cache gives up states (least
  // recently used first), then the newest sequence is preempted: its memory is given back and it
  // waits, to be recomputed from its tokens once there is room, before new requests are admitted.
  // 0: parallel sequences of ctx positions (every slot can fill its context).
  int64_t kv_budget = 0;
  // Rows per step: the decoding requests' tokens, then prompt tokens of those still reading their
  // prompts up to this many in all (at least one), so a long prompt does not stall the decoding
  // ones; 0 (the default) takes the model's pass, ModelInfo::max_batch (128 rows on the CPU, 512
  // on CUDA), so that a step is one pass.
  int64_t prefill_chunk = 0;
};

struct EngineStats {
  int64_t requests_started = 0, requests_finished = 0, requests_cancelled = 0;
  int64_t requests_failed = 0;  // failed on the server's side (an expert read, the backend)
  std::string last_error;       // of the last failed request
  int64_t prompt_tokens = 0, cached_prompt_tokens = 0, generated_tokens = 0;
  double prefill_seconds = 0, decode_seconds = 0;
  int active = 0, queued = 0;
  int paused = 0;  // preempted sequences waiting for KV memory
  int64_t preemptions = 0;
  int64_t kv_bytes = 0, kv_budget = 0;  // KV memory held (sequences and prefix cache) and allowed
  PrefixCache::Stats cache;
  ExpertStats experts;  // of the model, refreshed after every engine turn
};

class QueueFull : public std::runtime_error {
 public:
  QueueFull() : std::runtime_error("the server is busy: the request queue is full") {}
};

class Engine {
 public:
  Engine(Model& model, const EngineOptions& options);
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // Queues a request; throws QueueFull when max_queue requests already wait.
  std::shared_ptr<Job> submit(JobRequest request);
  // Queues several requests at once (a request's n choices): the loop admits them in the same
  // turn when slots are free, so their batches, and so their tokens, do not depend on timing.
  std::vector<std::shared_ptr<Job>> submit_all(std::vector<JobRequest> requests);
  EngineStats stats() const;
  const EngineOptions& options() const { return options_; }
  Model& model() { return model_; }

 private:
  void check(const JobRequest& request) const;  // the errors submit() throws for one request

  struct Slot {
    std::unique_ptr<SequenceState> state;
    std::shared_ptr<Job> job;
    std::vector<int32_t> tokens;  // tokens whose state is in `state` (n_past of them)
    std::vector<int32_t> context; // prompt + generated, for the repetition penalty
    std::vector<int32_t> generated_ids;  // for the presence and frequency penalties
    std::unique_ptr<Sampler> sampler;
    // Tokens to process before decoding: the prompt, or after a preemption the sequence so far
    // (then `next` was sampled already, and the feed's end samples nothing).
    std::vector<int32_t> feed;
    int64_t feed_done = 0;  // feed tokens processed
    bool sample_after_feed = true;
    bool paused = false;    // preempted: its KV memory given back, waiting for room
    uint64_t admitted = 0;  // admission order: the newest is preempted first
    int generated = 0;
    int32_t next = -1;            // sampled, not yet forwarded
    std::vector<float> logits;    // of this step's last position
    // A plain greedy request (no penalties, bias, constraint or logprobs) takes the model's greedy
    // id (SequenceBatch::greedy) instead of the logits.
    bool greedy = false;
    int32_t greedy_id = -1;
    int64_t chunk = 0;            // prompt tokens in this step (0: a decode token, or not in it)
  };

  void loop();
  // Moves queued jobs into free slots while memory allows (none while a sequence is paused).
  void admit();
  void start(Slot& slot);
  // KV memory held by the slots' states and the prefix cache; `grow` adds what the items of the
  // step being planned (items_) commit for their new positions.
  int64_t kv_bytes(bool grow) const;
  // Drops prefix-cache states (least recently used first) until `extra` more bytes fit the budget.
  bool make_room(int64_t extra);
  void preempt(Slot& slot);
  void resume_paused();
  // The step's items: decode tokens, then feed chunks; false when there is nothing to run.
  bool plan_step();
  // One forward_batch over the active slots; then each samples and emits.
  void step();
  void sample_and_emit(Slot& slot);
  void finish(Slot& slot, FinishReason reason, std::string error = {});

  Model& model_;
  EngineOptions options_;
  PrefixCache cache_;
  std::unique_ptr<SequenceState>
      probe_;           // never run: sizes a sequence's memory (bytes_at) for submit()
  int64_t budget_ = 0;  // resolved kv_budget
  uint64_t admissions_ = 0;
  std::vector<Slot> slots_;
  std::vector<float> raw_logits_;  // the model's, for logprobs
  std::vector<SequenceBatch> items_;
  std::vector<Slot*> batch_;       // the slot of each item

  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::shared_ptr<Job>> queue_;
  bool stopping_ = false;
  EngineStats stats_;
  std::thread thread_;
};

}  // namespace moestream
