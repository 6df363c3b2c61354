#include "server/engine.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "backend/backend.h"
#include "core/error.h"

namespace moestream {

using clock_type = std::chrono::steady_clock;

namespace {

// A state's KV memory now, and with `positions` committed (beyond its fixed part).
int64_t kv_held(const SequenceState& s) {
  return s.held_bytes() - s.bytes_at(0);
}
int64_t kv_at(const SequenceState& s, int64_t positions) {
  return s.bytes_at(positions) - s.bytes_at(0);
}

}  // namespace

TokenLogprob token_logprob(std::span<const float> logits, int32_t token, int top) {
  float mx = -std::numeric_limits<float>::infinity();
  for (float x : logits) mx = std::max(mx, x);
  double sum = 0;
  for (float x : logits) sum += std::exp(double(x - mx));
  const float lse = mx + float(std::log(sum));
  TokenLogprob t;
  t.token = token;
  t.logprob = logits[size_t(token)] - lse;
  if (top > 0) {
    std::vector<int32_t> ids(logits.size());
    for (size_t i = 0; i < ids.size(); ++i) ids[i] = int32_t(i);
    const size_t k = std::min(ids.size(), size_t(top));
    std::partial_sort(ids.begin(), ids.begin() + long(k), ids.end(), [&](int32_t a, int32_t b) {
      return logits[size_t(a)] > logits[size_t(b)] || (logits[size_t(a)] == logits[size_t(b)] && a < b);
    });
    for (size_t i = 0; i < k; ++i) t.top.emplace_back(ids[i], logits[size_t(ids[i])] - lse);
  }
  return t;
}

FinishReason Job::take(std::vector<int32_t>& out, std::chrono::milliseconds timeout,
                       std::vector<TokenLogprob>* logprobs) {
  std::unique_lock lock(mu_);
  if (pending_.empty() && reason_ == FinishReason::running)
    cv_.wait_for(lock, timeout, [&] { return !pending_.empty() || reason_ != FinishReason::running; });
  out.insert(out.end(), pending_.begin(), pending_.end());
  pending_.clear();
  if (logprobs)
    for (auto& l : pending_logprobs_) logprobs->push_back(std::move(l));
  pending_logprobs_.clear();
  return reason_;
}

std::string Job::error() const {
  std::lock_guard lock(mu_);
  return error_;
}

void Job::push(int32_t token, TokenLogprob* logprob) {
  if (first_token_seconds_.load() == 0)
    first_token_seconds_.store(
        std::max(1e-9, std::chrono::duration<double>(std::chrono::steady_clock::now() - submitted_).count()));
  {
    std::lock_guard lock(mu_);
    pending_.push_back(token);
    if (logprob) pending_logprobs_.push_back(std::move(*logprob));
  }
  cv_.notify_all();
}

void Job::finish(FinishReason reason, std::string error) {
  {
    std::lock_guard lock(mu_);
    reason_ = reason;
    error_ = std::move(error);
  }
  cv_.notify_all();
}

Engine::Engine(Model& model, const EngineOptions& options)
    : model_(model), options_(options), cache_(options.kv_slots) {
  if (options_.parallel < 1) fail("--parallel must be >= 1, got ", options_.parallel);
  if (options_.max_queue < 0) fail("the queue limit must be >= 0, got ", options_.max_queue);
  if (options_.ctx < 2) fail("--ctx must be >= 2, got ", options_.ctx);
  if (options_.kv_slots < 0) fail("--kv-slots must be >= 0, got ", options_.kv_slots);
  if (options_.kv_budget < 0) fail("--kv-mb must be >= 0, got ", options_.kv_budget);
  slots_.resize(size_t(options_.parallel));
  for (Slot& s : slots_) {
    s.state = model_.new_sequence(options_.ctx);
    s.state->trim();  // memory as it grows
    s.logits.resize(size_t(model_.info().vocab_size));
  }
  probe_ = model_.new_sequence(options_.ctx);
  probe_->trim();
  budget_ = options_.kv_budget > 0 ? options_.kv_budget
                                   : int64_t(options_.parallel) * kv_at(*probe_, options_.ctx);
  // A sequence alone must fit: the context shrinks to what the budget holds.
  if (kv_at(*probe_, options_.ctx) > budget_) {
    int64_t lo = 0, hi = options_.ctx;  // the most positions whose KV memory fits
    while (lo < hi) {
      const int64_t mid = (lo + hi + 1) / 2;
      if (kv_at(*probe_, mid) <= budget_)
        lo = mid;
      else
        hi = mid - 1;
    }
    if (lo < 2)
      fail("--kv-mb: ", budget_ >> 20, " MiB hold less than 2 positions of this model's KV caches");
    options_.ctx = lo;
  }
  // Set aside before the first forward pass, which sizes the GPU's expert cache by the memory left.
  model_.backend().reserve_growable_pool(budget_);
  stats_.kv_budget = budget_;
  thread_ = std::thread([this] { loop(); });
}

Engine::~Engine() {
  {
    std::lock_guard lock(mu_);
    stopping_ = true;
  }
  cv_.notify_all();
  thread_.join();
  for (auto& job : queue_) job->finish(FinishReason::cancelled);
}

void Engine::check(const JobRequest& request) const {
  if (request.prompt.empty()) fail("the prompt is empty");
  // Checked here, not in the batch, so that one request's bad token fails only that request.
  const int64_t vocab = model_.info().vocab_size;
  for (int32_t t : request.prompt)
    if (t < 0 || t >= vocab) fail("token id ", t, " out of range [0, ", vocab, ")");
  if (int64_t(request.prompt.size()) + request.max_tokens > options_.ctx)
    fail("the prompt (", request.prompt.size(), " tokens) plus max_tokens (", request.max_tokens,
         ") exceeds the context of ", options_.ctx, " tokens");
  // Alone, a request must fit the KV memory.
  const int64_t need = kv_at(*probe_, int64_t(request.prompt.size()) + request.max_tokens);
  if (need > budget_)
    fail("the prompt (", request.prompt.size(), " tokens) plus max_tokens (", request.max_tokens,
         ") needs ", (need + (1 << 20) - 1) >> 20, " MiB of KV cache, more than the ",
         budget_ >> 20, " MiB of --kv-mb");
}

std::shared_ptr<Job> Engine::submit(JobRequest request) {
  std::vector<JobRequest> one;
  one.push_back(std::move(request));
  return submit_all(std::move(one)).front();
}

std::vector<std::shared_ptr<Job>> Engine::submit_all(std::vector<JobRequest> requests) {
  for (const JobRequest& r : requests) check(r);
  std::vector<std::shared_ptr<Job>> jobs;
  for (JobRequest& r : requests) jobs.push_back(std::make_shared<Job>(std::move(r)));
  {
    std::lock_guard lock(mu_);
    // Requests in the system: waiting, plus those in slots (counted once the loop admits them).
    if (int(queue_.size() + jobs.size()) - 1 + stats_.active >= options_.parallel + options_.max_queue)
      throw QueueFull();
    queue_.insert(queue_.end(), jobs.begin(), jobs.end());
    stats_.queued = int(queue_.size());
  }
  cv_.notify_all();
  return jobs;
}

EngineStats Engine::stats() const {
  std::lock_guard lock(mu_);
  return stats_;
}

void Engine::loop() {
  for (;;) {
    {
      std::unique_lock lock(mu_);
      auto idle = [&] {
        return std::none_of(slots_.begin(), slots_.end(), [](const Slot& s) { return bool(s.job); });
      };
      cv_.wait(lock, [&] { return stopping_ || !queue_.empty() || !idle(); });
      if (stopping_) break;
    }
    resume_paused();
    admit();
    for (Slot& s : slots_) {
      if (!s.job || s.sampler) continue;
      try {
        start(s);
      } catch (const std::exception& e) {
        finish(s, FinishReason::failed, e.what());
      }
    }
    step();
    const ExpertStats experts = model_.expert_stats();
    const int64_t kv = kv_bytes(false);
    std::lock_guard lock(mu_);
    stats_.experts = experts;
    stats_.kv_bytes = kv;
    stats_.paused =
        int(std::count_if(slots_.begin(), slots_.end(), [](const Slot& s) { return s.paused; }));
  }
  for (Slot& s : slots_)
    if (s.job) finish(s, FinishReason::cancelled);
}

void Engine::admit() {
  std::lock_guard lock(mu_);
  const bool paused =
      std::any_of(slots_.begin(), slots_.end(), [](const Slot& s) { return s.paused; });
  for (Slot& s : slots_) {
    if (paused || queue_.empty()) break;
    if (s.job) continue;
    // Room for its prompt (restored or computed) and its first token, the others as they are.
    if (!make_room(kv_at(*probe_, int64_t(queue_.front()->request().prompt.size()) + 1))) break;
    s.job = std::move(queue_.front());
    queue_.pop_front();
    s.admitted = ++admissions_;
  }
  stats_.queued = int(queue_.size());
  stats_.active =
      int(std::count_if(slots_.begin(), slots_.end(), [](const Slot& s) { return bool(s.job); }));
}

void Engine::start(Slot& s) {
  const JobRequest& r = s.job->request();
  s.sampler = std::make_unique<Sampler>(r.sampling);
  s.greedy = plain_greedy(r.sampling) && !r.constraint && r.logprobs < 0;
  const int64_t reused = cache_.restore(r.prompt, *s.state);
  s.tokens.assign(r.prompt.begin(), r.prompt.begin() + reused);
  s.context = r.prompt;
  s.generated_ids.clear();
  s.feed = r.prompt;
  s.feed_done = reused;
  s.sample_after_feed = true;
  s.paused = false;
  s.generated = 0;
  s.next = -1;
  s.job->cached_tokens_.store(reused);
  std::lock_guard lock(mu_);
  ++stats_.requests_started;
  stats_.prompt_tokens += int64_t(r.prompt.size());
  stats_.cached_prompt_tokens += reused;
  stats_.cache = cache_.stats();
}

int64_t Engine::kv_bytes(bool grow) const {
  int64_t n = cache_.kv_bytes();
  for (const Slot& s : slots_) n += kv_held(*s.state);
  if (grow)
    for (size_t i = 0; i < items_.size(); ++i) {
      const SequenceState& st = *items_[i].state;
      n += std::max<int64_t>(
          0, st.bytes_at(st.n_past + int64_t(items_[i].tokens.size())) - st.held_bytes());
    }
  return n;
}

bool Engine::make_room(int64_t extra) {
  while (kv_bytes(false) + extra > budget_)
    if (!cache_.drop_oldest()) return false;
  return true;
}

void Engine::preempt(Slot& s) {
  // The state is dropped and rebuilt later from s.tokens (what it holds): recomputing costs less
  // than the memory it would keep while it waits.
  s.state->truncate(0);
  s.state->trim();
  // What to process again: the prompt when nothing was sampled yet, else every token so far.
  if (s.next >= 0 && s.feed_done == int64_t(s.feed.size())) s.feed = s.tokens;
  s.feed_done = 0;
  s.sample_after_feed = s.next < 0;
  s.tokens.clear();
  s.paused = true;
  s.chunk = 0;
  std::lock_guard lock(mu_);
  ++stats_.preemptions;
}

// The paused sequences, oldest first, resume while they fit: each with its tokens so far (or its
// prompt, if it had not sampled yet) to process again, reusing what the prefix cache holds.
void Engine::resume_paused() {
  for (;;) {
    Slot* oldest = nullptr;
    for (Slot& s : slots_)
      if (s.paused && s.job && (!oldest || s.admitted < oldest->admitted)) oldest = &s;
    if (!oldest) return;
    Slot& s = *oldest;
    if (s.job->cancelled()) {
      finish(s, FinishReason::cancelled);
      continue;
    }
    // Its whole feed and a step of every running sequence must fit.
    int64_t growth = kv_at(*probe_, int64_t(s.feed.size()) + 1);
    for (const Slot& o : slots_)
      if (o.job && !o.paused)
        growth +=
            std::max<int64_t>(0, o.state->bytes_at(o.state->n_past + 1) - o.state->held_bytes());
    if (!make_room(growth)) return;
    try {
      const int64_t reused = cache_.restore(s.feed, *s.state);
      s.tokens.assign(s.feed.begin(), s.feed.begin() + reused);
      s.feed_done = reused;
      s.paused = false;
    } catch (const std::exception& e) {
      finish(s, FinishReason::failed, e.what());
    }
  }
}

bool Engine::plan_step() {
  items_.clear();
  batch_.clear();
  for (Slot& s : slots_) {
    if (!s.job || s.paused) continue;
    if (s.job->cancelled()) {
      finish(s, FinishReason::cancelled);
      continue;
    }
    s.chunk = 0;
    if (s.feed_done == int64_t(s.feed.size())) {
      items_.push_back(s.greedy ? SequenceBatch{std::span<const int32_t>(&s.next, 1), s.state.get(), {}, &s.greedy_id}
                                : SequenceBatch{std::span<const int32_t>(&s.next, 1), s.state.get(), s.logits});
      batch_.push_back(&s);
    }
  }
  // Feed chunks share what is left of prefill_chunk rows after the decode tokens, in slot order.
  const int64_t step_rows = options_.prefill_chunk > 0 ? options_.prefill_chunk : model_.info().max_batch;
  int64_t budget = std::max<int64_t>(1, step_rows - int64_t(items_.size()));
  for (Slot& s : slots_) {
    const int64_t left = s.job && !s.paused ? int64_t(s.feed.size()) - s.feed_done : 0;
    if (left <= 0 || budget <= 0) continue;
    s.chunk = std::min(budget, left);
    budget -= s.chunk;
    const auto chunk = std::span(s.feed).subspan(size_t(s.feed_done), size_t(s.chunk));
    items_.push_back(s.greedy ? SequenceBatch{chunk, s.state.get(), {}, &s.greedy_id}
                              : SequenceBatch{chunk, s.state.get(), s.logits});
    batch_.push_back(&s);
  }
  return !items_.empty();
}

void Engine::step() {
  // Within the KV budget: the prefix cache gives up states first, then the newest sequence of the
  // step is preempted, never the last one (a request alone always fits: submit() checks it).
  for (;;) {
    if (!plan_step()) return;
    if (kv_bytes(true) <= budget_) break;
    if (cache_.drop_oldest()) continue;
    Slot* newest = nullptr;
    for (Slot* s : batch_)
      if (!newest || s->admitted > newest->admitted) newest = s;
    if (batch_.size() < 2) break;
    preempt(*newest);
  }
  const auto t0 = clock_type::now();
  try {
    model_.forward_batch(items_);
  } catch (const std::exception& e) {
    // A pass stopped part way (an expert read, the backend): every sequence in it is suspect.
    for (Slot* s : batch_) finish(*s, FinishReason::failed, e.what());
    return;
  }
  const double dt = std::chrono::duration<double>(clock_type::now() - t0).count();
  int64_t prompt_tokens = 0;
  for (Slot* s : batch_) prompt_tokens += s->chunk;
  const int64_t rows = prompt_tokens + int64_t(batch_.size()) - std::count_if(batch_.begin(), batch_.end(),
                                                                             [](Slot* s) { return s->chunk > 0; });
  {
    // The step's time split between prefill and decode by their rows.
    std::lock_guard lock(mu_);
    stats_.prefill_seconds += dt * double(prompt_tokens) / double(rows);
    stats_.decode_seconds += dt * double(rows - prompt_tokens) / double(rows);
  }
  for (Slot* s : batch_) {
    Job& job = *s->job;
    try {
      if (s->chunk > 0) {
        s->tokens.insert(s->tokens.end(), s->feed.begin() + s->feed_done,
                         s->feed.begin() + s->feed_done + s->chunk);
        s->feed_done += s->chunk;
        job.prefill_seconds_.store(job.prefill_seconds_.load() + dt);
        if (s->feed_done == int64_t(s->feed.size()) && s->sample_after_feed) sample_and_emit(*s);
      } else {
        s->tokens.push_back(s->next);
        job.decode_seconds_.store(job.decode_seconds_.load() + dt);
        sample_and_emit(*s);
      }
    } catch (const std::exception& e) {
      finish(*s, FinishReason::failed, e.what());
    }
  }
}

void Engine::sample_and_emit(Slot& s) {
  Job& job = *s.job;
  const JobRequest& r = job.request();
  // The model's distribution for logprobs is kept before anything changes the logits.
  if (r.logprobs >= 0) raw_logits_ = s.logits;
  if (r.constraint) r.constraint->mask(s.logits);
  int32_t next = s.greedy_id;
  if (!s.greedy) {
    ScopedTimer timer(model_.backend().times().sampling);
    next = s.sampler->sample(s.logits, s.context, s.generated_ids);
  }
  const auto& eos = model_.info().eos_token_ids;
  if (!r.ignore_eos && std::find(eos.begin(), eos.end(), next) != eos.end()) return finish(s, FinishReason::eos);
  if (r.constraint) r.constraint->accept(next);
  s.next = next;
  s.context.push_back(next);
  s.generated_ids.push_back(next);
  ++s.generated;
  if (r.logprobs >= 0) {
    TokenLogprob lp = token_logprob(raw_logits_, next, r.logprobs);
    job.push(next, &lp);
  } else {
    job.push(next, nullptr);
  }
  {
    std::lock_guard lock(mu_);
    ++stats_.generated_tokens;
  }
  if (s.generated >= r.max_tokens) finish(s, FinishReason::length);
}

void Engine::finish(Slot& s, FinishReason reason, std::string error) {
  // The state holds exactly s.tokens (the last sampled token was never forwarded), whatever
  // stopped the request, so it can always be kept for the next one -- unless the request failed:
  // then a forward pass stopped part way and the state is dropped (the next request in this slot
  // starts from the prefix cache or from nothing).
  try {
    if (reason != FinishReason::failed && !s.paused &&
        s.state->n_past == int64_t(s.tokens.size()) && make_room(kv_at(*s.state, s.state->n_past)))
      cache_.store(s.tokens, *s.state);
  } catch (const std::exception&) {
    // Keeping the state is an optimisation; a failure here must not fail the request.
  }
  try {
    // The slot's memory goes back (the next request restores from the prefix cache).
    s.state->truncate(0);
    s.state->trim();
  } catch (const std::exception&) {
  }
  s.paused = false;
  s.tokens.clear();
  s.feed.clear();
  std::shared_ptr<Job> job = std::move(s.job);
  s.sampler.reset();
  {
    // Counted before the caller hears of the end, so what it sees next includes this request.
    std::lock_guard lock(mu_);
    ++stats_.requests_finished;
    if (reason == FinishReason::cancelled) ++stats_.requests_cancelled;
    if (reason == FinishReason::failed) {
      ++stats_.requests_failed;
      stats_.last_error = error;
    }
    stats_.cache = cache_.stats();
    stats_.active = int(std::count_if(slots_.begin(), slots_.end(), [](const Slot& x) { return bool(x.job); }));
  }
  job->finish(reason, std::move(error));
}

}  // namespace moestream
