// The CUDA backend's expert tiers (see cuda_expert_tier.cuh): the pinned host pool, the VRAM slot
// arena with its device expert table and LRU, and the MoE layer over them, step by step.
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <string>

#include "backend/cuda/cuda_expert_tier.cuh"
#include "backend/expert_provider.h"
#include "core/error.h"
#include "core/files.h"
#include "core/quant.h"

namespace moestream::cuda {

namespace {

bool formats_known(const std::vector<std::vector<std::pair<FormatTag, FormatTag>>>& formats, int layer) {
  return size_t(layer) < formats.size() && !formats[size_t(layer)].empty();
}

// The byte range [lo, hi) of host memory an expert's tensors occupy.
void expert_extent(const MlpWeights& w, const char*& lo, const char*& hi) {
  lo = nullptr;
  hi = nullptr;
  auto span = [&](const void* p, size_t n) {
    if (!p) return;
    const char* c = static_cast<const char*>(p);
    if (!lo || c < lo) lo = c;
    if (!hi || c + n > hi) hi = c + n;
  };
  for (const Matrix* m : {&w.gate, &w.up, &w.down}) {
    if (m->quant.bits) {  // affine, MXFP4 (no biases), FP8 (no biases; a row's last group may be partial)
      const int64_t g = m->quant.group_size;
      span(m->data, size_t(m->rows * m->cols * m->quant.bits / 8));
      const size_t groups = size_t(m->rows * ((m->cols + g - 1) / g));
      span(m->scales, groups * dtype_size(m->quant.scale_dtype));
      span(m->biases, groups * dtype_size(m->quant.scale_dtype));
    } else {
      span(m->data, size_t(m->rows * m->cols) * dtype_size(m->dtype));
    }
  }
  for (const Vector* v : {&w.gate_bias, &w.up_bias, &w.down_bias}) span(v->data, size_t(v->size) * sizeof(float));
}

// w's table entry for its bytes where they are (in the host tier: read in place).
DevExpert entry_of(const MlpWeights& w) {
  DevExpert d;
  d.gate = weight_ref(w.gate);
  d.up = weight_ref(w.up);
  d.down = weight_ref(w.down);
  d.gate_bias = w.gate_bias.data;
  d.up_bias = w.up_bias.data;
  d.down_bias = w.down_bias.data;
  d.formats = format_pair(format_of(w.gate), format_of(w.down));
  return d;
}

// The same entry with every pointer moved from the bytes at `from` to their copy at `to`.
DevExpert moved(const DevExpert& d, const char* from, const char* to) {
  auto move = [&](const void* p) -> const void* { return p ? to + (static_cast<const char*>(p) - from) : nullptr; };
  DevExpert m = d;
  m.in_host = 0;
  for (WeightRef* r : {&m.gate, &m.up, &m.down}) {
    r->data = move(r->data);
    r->scales = move(r->scales);
    r->biases = static_cast<const uint16_t*>(move(r->biases));
  }
  m.gate_bias = static_cast<const float*>(move(d.gate_bias));
  m.up_bias = static_cast<const float*>(move(d.up_bias));
  m.down_bias = static_cast<const float*>(move(d.down_bias));
  return m;
}

// Most promotions started between two steps (MOESTREAM_CUDA_PROMOTIONS overrides). Measured on
// the 48-layer Qwen3-30B-A3B shape at 25% in VRAM (docs/PERFORMANCE.md): 0, 4, 16 a step hold
// the hit rate at 26%, 39%, 58%; from 32 on the policy, not the cap, decides (70-71%).
int promotions_per_step() {
  static const int n = [] {
    const char* v = std::getenv("MOESTREAM_CUDA_PROMOTIONS");
    return v && *v ? std::max(0, std::atoi(v)) : 64;
  }();
  return n;
}

}  // namespace

// --- the pinned host pool ------------------------------------------------------------------------

PinnedPool::~PinnedPool() {
  for (void* c : chunks_) cudaFreeHost(c);
}

void* PinnedPool::alloc(size_t bytes) {
  bytes = (bytes + 4095) / 4096 * 4096;
  auto& free_list = free_[bytes];
  if (!free_list.empty()) {
    void* p = free_list.back();
    free_list.pop_back();
    return p;
  }
  if (chunk_left_ < bytes) {
    const size_t chunk = std::max<size_t>(bytes, size_t(256) << 20);
    void* c = nullptr;
    MS_CUDA_CHECK(cudaHostAlloc(&c, chunk, cudaHostAllocPortable));
    chunks_.push_back(c);
    chunk_next_ = static_cast<char*>(c);
    chunk_left_ = chunk;
    total_ += chunk;
  }
  void* p = chunk_next_;
  chunk_next_ += bytes;
  chunk_left_ -= bytes;
  size_of_[p] = bytes;
  return p;
}

void PinnedPool::free(void* p) {
  auto it = size_of_.find(p);
  if (it == size_of_.end()) fail("cuda: free_host of memory this backend did not hand out");
  free_[it->second].push_back(p);
}

// --- the CPU's share -----------------------------------------------------------------------------

namespace {

// Waits until the count at `done` reaches n (in wrapping order).
__global__ void wait_for_count_kernel(const volatile uint32_t* done, uint32_t n) {
  while (int32_t(*done - n) < 0) __nanosleep(1000);
}

}  // namespace

CpuExpertWorker::CpuExpertWorker(std::unique_ptr<Backend> cpu) : cpu_(std::move(cpu)) {
  MS_CUDA_CHECK(
      cudaHostAlloc(reinterpret_cast<void**>(&done_host_), sizeof(uint32_t), cudaHostAllocMapped));
  *done_host_ = 0;
  MS_CUDA_CHECK(cudaHostGetDevicePointer(reinterpret_cast<void**>(&done_dev_), done_host_, 0));
  thread_ = std::thread([this] { loop(); });
}

CpuExpertWorker::~CpuExpertWorker() {
  {
    std::lock_guard lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  thread_.join();
  cudaFreeHost(done_host_);
}

void CpuExpertWorker::submit(std::function<void(Backend&)> work, cudaStream_t s) {
  const uint32_t n = submitted_.load() + 1;
  {
    std::lock_guard lock(mu_);
    work_ = std::move(work);
    submitted_.store(n);
  }
  cv_.notify_one();
  wait_for_count_kernel<<<1, 1, 0, s>>>(done_dev_, n);
  MS_CUDA_CHECK(cudaGetLastError());
}

void CpuExpertWorker::rethrow() {
  std::exception_ptr e;
  {
    std::lock_guard lock(mu_);
    std::swap(e, error_);
  }
  if (e) std::rethrow_exception(e);
}

// A job is taken while the thread polls for up to 5 ms after the last (a split call comes every few
// hundred us), else after a wake-up.
void CpuExpertWorker::loop() {
  uint32_t taken = 0;
  for (;;) {
    const auto idle = std::chrono::steady_clock::now();
    while (submitted_.load(std::memory_order_acquire) == taken &&
           std::chrono::steady_clock::now() - idle < std::chrono::milliseconds(5))
      std::this_thread::yield();
    std::function<void(Backend&)> work;
    {
      std::unique_lock lock(mu_);
      cv_.wait(lock, [&] { return stop_ || submitted_.load() != taken; });
      if (submitted_.load() == taken) return;  // stopped with nothing in hand
      work = std::move(work_);
      taken = submitted_.load();
    }
    const auto t0 = std::chrono::steady_clock::now();
    try {
      work(*cpu_);
    } catch (...) {
      std::lock_guard lock(mu_);
      error_ = std::current_exception();
    }
    nanos_ +=
        std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0)
            .count();
    __atomic_store_n(done_host_, taken, __ATOMIC_RELEASE);  // the stream's wait ends
  }
}

// --- the tier ------------------------------------------------------------------------------------

ExpertTier::ExpertTier(const CudaOptions& options, cudaStream_t compute, cudaStream_t copy, GemmScratch& gemm,
                       PhaseTimes& times, bool sync_ops, OpProfile& profile)
    : opt_(options), compute_(compute), copy_(copy), gemm_(gemm), times_(times), sync_ops_(sync_ops),
      prof_(profile), policy_(make_eviction_policy(options.policy)) {
  MS_CUDA_CHECK(cudaEventCreate(&copy_start_));
  MS_CUDA_CHECK(cudaEventCreate(&copy_done_));
  MS_CUDA_CHECK(cudaEventCreate(&copies_end_));
  const char* in_place = std::getenv("MOESTREAM_CUDA_IN_PLACE");
  in_place_on_ = !(in_place && std::string(in_place) == "0");
  const char* staging = std::getenv("MOESTREAM_CUDA_EXPERT_STAGING");
  staging_on_ = !(staging && std::string(staging) == "0");
  MS_CUDA_CHECK(cudaMalloc(&route_done_, kGemvMaxTokens * sizeof(unsigned)));
  MS_CUDA_CHECK(cudaMemsetAsync(route_done_, 0, kGemvMaxTokens * sizeof(unsigned), compute_));
  MS_CUDA_CHECK(cudaStreamSynchronize(compute_));
  // Its threads poll between calls for longer than a CPU model's (a MoE call comes every few
  // hundred us, after the GPU's attention): MOESTREAM_CPU_EXPERT_SPIN_US, default 5,000.
  if (opt_.cpu_expert_share > 0) {
    const char* spin = std::getenv("MOESTREAM_CPU_EXPERT_SPIN_US");
    // one core left to the host thread when the count is not given
    const int threads = opt_.cpu_threads > 0
                            ? opt_.cpu_threads
                            : std::max(1, int(std::thread::hardware_concurrency()) - 1);
    cpu_ = std::make_unique<CpuExpertWorker>(
        make_cpu_backend(threads, /*precise=*/true, spin ? std::atoi(spin) : 5000));
    const char* min_misses = std::getenv("MOESTREAM_CPU_EXPERT_MIN_MISSES");
    if (min_misses) split_min_misses_ = std::atof(min_misses);
  }
}

ExpertTier::~ExpertTier() {
  cpu_.reset();  // the job in hand finishes (the compute stream may wait for it)
  cudaStreamSynchronize(compute_);
  cudaStreamSynchronize(copy_);
  for (auto& [ev, batch] : promoting_) cudaEventDestroy(ev);
  for (cudaEvent_t ev : spare_events_) cudaEventDestroy(ev);
  if (log_host_) cudaFreeHost(log_host_);
  if (log_dev_) cudaFree(log_dev_);
  if (route_done_) cudaFree(route_done_);
  if (slot_arena_) cudaFree(slot_arena_);
  if (table_dev_) cudaFree(table_dev_);
  if (table_host_) cudaFreeHost(table_host_);
  cudaEventDestroy(copy_start_);
  cudaEventDestroy(copy_done_);
  cudaEventDestroy(copies_end_);
}

GpuTierStats ExpertTier::stats() {
  digest_log();
  GpuTierStats s = stats_;
  if (cpu_) s.cpu_seconds = cpu_->seconds();
  s.bytes_in_place -=
      std::min(s.bytes_in_place, s.bytes_cpu);  // digest_log counted the CPU's share too
  s.slot_bytes = slot_bytes_;
  s.slots = n_slots_;
  return s;
}

void ExpertTier::init(const MoeParams& p, uint64_t first_expert_bytes) {
  n_experts_ = p.n_experts;
  slot_bytes_ = opt_.max_expert_bytes ? opt_.max_expert_bytes : first_expert_bytes;
  slot_bytes_ = (slot_bytes_ + 255) / 256 * 256;
  double budget;
  if (opt_.gpu_expert_mb >= 0) {
    budget = opt_.gpu_expert_mb * 1e6;
  } else {
    size_t free_b = 0, total_b = 0;
    MS_CUDA_CHECK(cudaMemGetInfo(&free_b, &total_b));
    const double reserve = std::max(2.0e9, 0.06 * double(total_b));  // activations, scratch, later KV caches
    budget = std::max(0.0, double(free_b) - reserve);
  }
  n_slots_ = std::max<uint64_t>(1, uint64_t(budget / double(slot_bytes_)));
  if (opt_.total_experts > 0) n_slots_ = std::min<uint64_t>(n_slots_, uint64_t(opt_.total_experts));
  prefetch_layers_ = opt_.total_experts > 0 && n_slots_ >= uint64_t(opt_.total_experts);
  MS_CUDA_CHECK(cudaMalloc(&slot_arena_, n_slots_ * slot_bytes_));
  slot_owner_.assign(n_slots_, {-1, -1});
  slot_call_.assign(n_slots_, 0);
  slot_busy_.assign(n_slots_, 0);
  tier_ready_ = true;
  pin_hottest();
}

// The profile's hottest experts, up to pin_share of the slots (at least one slot stays free of
// them), marked in hot_; none when the slots hold every expert anyway.
void ExpertTier::pin_hottest() {
  if (opt_.profile.empty() || prefetch_layers_) return;
  for (size_t l = 0; l < opt_.profile.size(); ++l)
    if (!opt_.profile[l].empty() && opt_.profile[l].size() != size_t(n_experts_))
      fail("profile: layer ", l, " has ", opt_.profile[l].size(), " counts, the model's MoE layers have ", n_experts_,
           " experts");
  size_t n = 0;
  hot_ = hottest_experts(opt_.profile, opt_.pin_share, n_slots_, n);
  stats_.pinned = n;
}

void ExpertTier::ensure_table(int layer) {
  if (layer < layers_cap_) return;
  const int cap = std::max(layer + 1, layers_cap_ * 2);
  MS_CUDA_CHECK(cudaStreamSynchronize(compute_));
  DevExpert* dev = nullptr;
  DevExpert* host = nullptr;
  const size_t n = size_t(cap) * size_t(n_experts_);
  MS_CUDA_CHECK(cudaMalloc(&dev, n * sizeof(DevExpert)));
  MS_CUDA_CHECK(cudaHostAlloc(reinterpret_cast<void**>(&host), n * sizeof(DevExpert), cudaHostAllocDefault));
  for (size_t i = 0; i < n; ++i) host[i] = DevExpert{};
  if (table_host_) {
    std::copy(table_host_, table_host_ + size_t(layers_cap_) * n_experts_, host);
    MS_CUDA_CHECK(cudaFreeHost(table_host_));
    MS_CUDA_CHECK(cudaFree(table_dev_));
  }
  MS_CUDA_CHECK(cudaMemcpy(dev, host, n * sizeof(DevExpert), cudaMemcpyHostToDevice));
  table_dev_ = dev;
  table_host_ = host;
  layers_cap_ = cap;
  where_.resize(size_t(cap));
  use_.resize(size_t(cap));
  resident_.resize(size_t(cap), 0);
  formats_.resize(size_t(cap));
  host_.resize(size_t(cap));
  host_known_.resize(size_t(cap), 0);
  preload_failed_.resize(size_t(cap), 0);
}

// Table rows [first, first + count) to the device, on the compute stream.
void ExpertTier::upload_table_rows(int first, int count) {
  const size_t off = size_t(first) * size_t(n_experts_);
  const size_t bytes = size_t(count) * size_t(n_experts_) * sizeof(DevExpert);
  MS_CUDA_CHECK(cudaMemcpyAsync(table_dev_ + off, table_host_ + off, bytes, cudaMemcpyHostToDevice, compute_));
}

void ExpertTier::touch(int slot) { slot_call_[size_t(slot)] = call_; }

ExpertUse& ExpertTier::use_of(int layer, int expert) {
  if (use_.size() <= size_t(layer)) use_.resize(size_t(layer) + 1);
  auto& u = use_[size_t(layer)];
  if (u.empty()) u.assign(size_t(n_experts_), ExpertUse{});
  return u[size_t(expert)];
}

// victims_: the slots this call does not hold (with this_call_too, any slot), never one a
// promotion is filling, the `needed` of lowest priority first in order.
void ExpertTier::rank_victims(size_t needed, bool this_call_too) {
  // The policy ages uses in tokens: a token is one call per MoE layer.
  const double ticks_per_token =
      n_experts_ > 0 && opt_.total_experts > 0 ? std::max(1.0, double(opt_.total_experts) / n_experts_) : 1.0;
  victims_.clear();
  for (uint64_t s = 0; s < n_slots_; ++s) {
    if ((slot_call_[s] == call_ && !this_call_too) || slot_busy_[s]) continue;
    const auto [layer, expert] = slot_owner_[s];
    if (hot(layer, expert)) continue;  // pinned
    const double p = layer < 0 ? -std::numeric_limits<double>::infinity()
                               : policy_->priority(use_of(layer, expert), call_, ticks_per_token);
    victims_.emplace_back(p, int(s));
  }
  needed = std::min(std::max<size_t>(needed, 1), victims_.size());
  if (needed == 0) return;
  std::nth_element(victims_.begin(), victims_.begin() + long(needed) - 1, victims_.end());
  std::sort(victims_.begin(), victims_.begin() + long(needed));
  victims_.resize(needed);
  next_victim_ = 0;
  victims_ranked_ = true;
}

void ExpertTier::load_expert(int layer, int expert, const MlpWeights& w, int slot) {
  const char* lo;
  const char* hi;
  expert_extent(w, lo, hi);
  const uint64_t bytes = uint64_t(hi - lo);
  if (bytes > slot_bytes_)
    fail("cuda: expert ", expert, " of layer ", layer, " takes ", bytes, " bytes, more than a slot (", slot_bytes_, ")");
  note_formats(layer, expert, w, lo);
  char* dst = slot_arena_ + uint64_t(slot) * slot_bytes_;
  evict(slot);
  MS_CUDA_CHECK(cudaMemcpyAsync(dst, lo, bytes, cudaMemcpyHostToDevice, copy_));
  table_host_[size_t(layer) * n_experts_ + size_t(expert)] = moved(entry_of(w), lo, dst);
  slot_owner_[size_t(slot)] = {layer, expert};
  where_[size_t(layer)][size_t(expert)] = slot;
  if (++resident_[size_t(layer)] == n_experts_) ++full_layers_;
  touch(slot);
  stats_.bytes_h2d += bytes;
}

// The expert's (gate/up, down) formats among its layer's, the layer's expert width, and whether
// the staging of the lane kernels takes its arrays where they are and in a slot (copied from lo
// to a multiple of 256 bytes: their offsets from lo kept).
void ExpertTier::note_formats(int layer, int expert, const MlpWeights& w, const char* lo) {
  const FormatTag gu = format_of(w.gate), dn = format_of(w.down);
  if (!(format_of(w.up) == gu)) fail("cuda: expert ", expert, " of layer ", layer, ": gate and up differ in format");
  auto& formats = formats_[size_t(layer)];
  if (std::find(formats.begin(), formats.end(), std::make_pair(gu, dn)) == formats.end()) formats.emplace_back(gu, dn);
  if (int64_t(inter_.size()) <= layer) inter_.resize(size_t(layer) + 1, 0);
  inter_[size_t(layer)] = w.gate.rows;
  if (int64_t(group_shift_.size()) <= layer) group_shift_.resize(size_t(layer) + 1, kNoGroups);
  int& shift = group_shift_[size_t(layer)];
  for (const Matrix* m : {&w.gate, &w.up, &w.down})
    if (is_quant(format_of(*m).kind)) shift = std::min(shift, weight_ref(*m).group_shift);
  if (int64_t(misaligned_.size()) <= layer) misaligned_.resize(size_t(layer) + 1, 0);
  auto off16 = [](const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) != 0; };
  bool off = off16(lo);
  for (const Matrix* m : {&w.gate, &w.up, &w.down}) {
    const WeightRef r = weight_ref(*m);
    off = off || off16(r.data) || off16(r.scales) || off16(r.biases);
  }
  if (off) misaligned_[size_t(layer)] = 1;
}

// The slot's expert leaves VRAM: its table entry points at its host copy where one is known.
void ExpertTier::evict(int slot) {
  const auto [layer, expert] = slot_owner_[size_t(slot)];
  slot_owner_[size_t(slot)] = {-1, -1};
  if (layer < 0) return;
  where_[size_t(layer)][size_t(expert)] = -1;
  if (resident_[size_t(layer)]-- == n_experts_) --full_layers_;
  const HostExpert& h = host_[size_t(layer)].empty() ? HostExpert{} : host_[size_t(layer)][size_t(expert)];
  table_host_[size_t(layer) * n_experts_ + size_t(expert)] = h.lo ? h.dev : DevExpert{};
  mark_dirty(layer);
}

void ExpertTier::settle_copies() {
  if (unsettled_.empty() && !unsettled_timing_) return;
  MS_CUDA_CHECK(cudaEventSynchronize(copies_end_));
  if (unsettled_timing_) {
    float ms = 0;
    MS_CUDA_CHECK(cudaEventElapsedTime(&ms, copy_start_, copies_end_));
    stats_.h2d_seconds += ms / 1e3;  // from the call's first copy's start to its last's end
    unsettled_timing_ = false;
  }
  for (int e : unsettled_) unsettled_provider_->release(e);
  unsettled_.clear();
}

// --- the MoE layer -------------------------------------------------------------------------------

void ExpertTier::moe(const Buffer& x, const Matrix& router, ExpertProvider& experts, const MoeParams& p, Buffer& out) {
  if (x.rows == 0) return;
  fill_layer(p, experts);
  const bool in_place = reads_in_place(p.layer, x.rows, p.n_experts, experts);
  upload_dirty_rows();  // rows an earlier call or a promotion changed
  prof_.begin(compute_);
  Call c = route(x, router, p, out, in_place);
  if (prof_.on()) prof_.end(compute_, weight_label("moe router + top-k", router, x.rows), stored_bytes(router));
  ScopedTimer compute(times_.expert_compute);
  if (c.resident) {
    if (c.in_place && split_step_)
      run_split(c);
    else
      run_resident(c);
    return;
  }
  finish_promotions(true);  // the host path below finds every slot settled
  prof_.begin(compute_);
  read_selection(c);
  HostGroups h = host_groups(c);
  split_hits_and_misses(c);
  launch_hits(c, h);
  fetch_misses(c, h, experts);
  combine_through_host(c, h);
  if (prof_.on()) prof_.end(compute_, op_label("moe experts + combine, tiered (host round trip)", x.rows));
}

// Router logits and each token's top k on the GPU (float32 activations, like the CPU), and the
// call's buffers; the time goes to routing.
ExpertTier::Call ExpertTier::route(const Buffer& x, const Matrix& router, const MoeParams& p, Buffer& out,
                                   bool in_place) {
  Call c;
  c.T = x.rows;
  c.dim = x.cols;
  c.K = p.top_k;
  c.E = p.n_experts;
  c.layer = p.layer;
  c.out = out.data;
  const int64_t T = c.T, dim = c.dim;
  const int E = c.E, layer = c.layer;
  if (router.rows != E || router.cols != dim)
    fail("moe: router ", router.name, " is [", router.rows, ", ", router.cols, "], expected [", E, ", ", dim, "]");
  auto t_start = std::chrono::steady_clock::now();
  const int64_t pairs = c.pairs = T * c.K;
  float* logits = scratch_.get(kLogits, size_t(T * E));
  c.sel_w = scratch_.get(kSelW, size_t(pairs));
  MoeGroups& g = c.g;
  g.n_active = scratch_.get<int>(kNActive, 1);
  g.active = scratch_.get<int>(kActive, size_t(std::min<int64_t>(E, pairs)));
  g.offset = scratch_.get<int>(kOffset, size_t(std::min<int64_t>(E, pairs) + 1));
  g.row_token = scratch_.get<int>(kRowToken, size_t(pairs));
  g.row_of = scratch_.get<int>(kRowOf, size_t(pairs));
  g.row_chunk = scratch_.get<int>(kRowChunk, size_t(pairs));
  if (tier_ready_ && n_experts_ != E) fail("moe: layer ", layer, " has ", E, " experts, an earlier one ", n_experts_);
  const bool in_vram = tier_ready_ && layer < layers_cap_ && resident_[size_t(layer)] == E && formats_known(formats_, layer);
  c.in_place = in_place && !in_vram;
  c.resident = in_vram || c.in_place;
  // A call read in place routes straight into the routing log (no copy in the step).
  int* logged = c.in_place ? log_slot(layer, pairs) : nullptr;
  c.sel_ids = logged ? logged : scratch_.get<int>(kSelIds, size_t(pairs));
  // Routing compares logits: float32 activations, like the CPU. Up to kGemvMaxTokens tokens
  // (decode steps): logits and routing in one launch where the router's format allows, each
  // token's bit for bit as a lone step's.
  const float* bias = p.router_bias ? p.router_bias->data : nullptr;
  MoeGroups* direct = c.resident && T == 1 ? &g : nullptr;
  if (!cuda::route_few(router, x.data, T, p, bias, logits, c.sel_ids, c.sel_w, direct, route_done_, compute_)) {
    cuda::linear(router, x.data, dim, T, nullptr, logits, E, gemm_, compute_, GemmMath::F32);
    cuda::route(logits, T, p, bias, c.sel_ids, c.sel_w, direct, compute_);
  }

  if (!p.ahead.empty() && !c.resident) {  // lookahead: the next layers' logits of the (one) token
    c.next_count = 0;
    for (const LookaheadGuess& a : p.ahead) {
      if (a.router->cols != dim)
        fail("moe: router ", a.router->name, " has ", a.router->cols, " columns, the input ", dim);
      c.next_count += a.router->rows;
    }
    c.next_logits = scratch_.get(kNext, size_t(c.next_count));
    float* logits_at = c.next_logits;
    for (const LookaheadGuess& a : p.ahead) {
      cuda::linear(*a.router, x.data, dim, 1, nullptr, logits_at, a.router->rows, gemm_, compute_, GemmMath::F32);
      logits_at += a.router->rows;
    }
  }

  ExpertBatch& b = c.b;
  b.dim = dim;
  b.x = x.data;
  b.params = &p;
  b.few_tokens = T <= kGemvMaxTokens;
  b.groups = g;
  b.pairs = pairs;
  b.hidden = nullptr;
  b.y = nullptr;
  auto t_routed = std::chrono::steady_clock::now();
  times_.routing += std::chrono::duration<double>(t_routed - t_start).count();
  return c;
}

// The layer's expert table and buffers, once its tier state is known.
void ExpertTier::bind_layer(Call& c) {
  ExpertBatch& b = c.b;
  b.table = table_dev_ + size_t(c.layer) * c.E;
  b.inter = inter_[size_t(c.layer)];
  const int shift = size_t(c.layer) < group_shift_.size() ? group_shift_[size_t(c.layer)] : kNoGroups;
  b.group_shift = shift == kNoGroups ? -1 : shift;
  // with MOESTREAM_CUDA_EXPERT_STAGING=0 no expert is staged (the kernels that check each expert)
  b.staged_aligned = staging_on_ && size_t(c.layer) < misaligned_.size() && !misaligned_[size_t(c.layer)];
  b.hidden = scratch_.get(kHidden, size_t(c.pairs * b.inter));
  b.y = scratch_.get(kY, size_t(c.pairs * c.dim));
  b.gemm = &gemm_;
  b.exact = &exact_scratch_;
  // The opt-in cuBLAS path dequantizes a whole batch in one format.
  b.tensor_cores = formats_[size_t(c.layer)].size() == 1 && use_expert_gemm(c.T, c.K, c.E, c.dim, b.inter);
}

// The batch's experts through the kernels of each of the layer's formats in turn (one pass, and
// no filter, when the layer has one format).
void ExpertTier::run_formats(Call& c) {
  ExpertBatch& b = c.b;
  const auto& formats = formats_[size_t(c.layer)];
  for (const auto& [gu, dn] : formats) {
    b.gate_up = gu;
    b.down = dn;
    b.only_formats = formats.size() > 1 ? format_pair(gu, dn) : -1;
    cuda::run_experts(b, compute_);
  }
}

// Every expert of the layer in VRAM: groups, expert kernels and combine on the GPU.
void ExpertTier::run_resident(Call& c) {
  ExpertBatch& b = c.b;
  if (c.in_place) {
    ++stats_.in_place_calls;
  } else {
    ++stats_.resident_calls;
  }
  bind_layer(c);
  b.in_place = c.in_place && staging_on_;
  if (c.T > 1) {
    if (b.few_tokens) b.rows_per_block = cuda::expert_rows_per_block(c.pairs, c.K, c.dim, b.inter);
    prof_.begin(compute_);
    cuda::group_by_expert(c.sel_ids, c.T, c.K, c.E, b.rows_per_block, c.g, compute_);
    if (prof_.on()) prof_.end(compute_, op_label("moe group by expert", c.T));
  }
  b.count_on_device = true;
  b.a_begin = 0;
  b.a_end = int(std::min<int64_t>(c.E, c.pairs));
  b.profile = &prof_;
  run_formats(c);
  prof_.begin(compute_);
  cuda::combine(b.y, c.sel_w, c.g.row_of, c.T, c.K, c.dim, c.out, compute_);
  if (prof_.on()) prof_.end(compute_, op_label("moe combine", c.T));
  op_done();
}

// A call read in place with a CPU share: its ids and x come back to the host. The experts in VRAM
// and the misses the CPU does not take go to the GPU as one batch (the misses read in place over
// PCIe); the CPU takes misses in ascending id while their bytes stay within cpu_expert_share of
// all the misses' (to the nearest expert) and computes them from their pinned host copies while
// the GPU runs; their rows go up after the GPU's, and the combine sums each token's rows as
// run_resident's does.
void ExpertTier::run_split(Call& c) {
  cpu_->rethrow();
  const int64_t T = c.T, dim = c.dim;
  float* x_host = staging_.get<float>(kXHost, size_t(T * dim), compute_);
  MS_CUDA_CHECK(cudaMemcpyAsync(x_host, c.b.x, size_t(T * dim) * sizeof(float),
                                cudaMemcpyDeviceToHost, compute_));
  const auto t_wait = std::chrono::steady_clock::now();
  read_selection(c);  // waits for the copies
  stats_.split_wait_seconds +=
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t_wait).count();
  ++stats_.in_place_calls;
  const std::vector<int>& where = where_[size_t(c.layer)];
  const std::vector<HostExpert>& host = host_[size_t(c.layer)];
  uint64_t miss_bytes = 0, cpu_bytes = 0;
  int misses = 0;
  for (int e = 0; e < c.E; ++e)
    if (!pairs_of_[size_t(e)].empty() && where[size_t(e)] < 0) {
      miss_bytes += host[size_t(e)].bytes;
      ++misses;
    }
  note_misses(misses);
  const double cpu_share = opt_.cpu_expert_share * double(miss_bytes);
  on_gpu_.clear();
  on_cpu_.clear();
  for (int e = 0; e < c.E; ++e) {
    if (pairs_of_[size_t(e)].empty()) continue;
    const uint64_t bytes = host[size_t(e)].bytes;
    if (where[size_t(e)] < 0 && double(cpu_bytes) + 0.5 * double(bytes) <= cpu_share) {
      on_cpu_.push_back(e);
      cpu_bytes += bytes;
    } else {
      on_gpu_.push_back(e);
    }
  }
  HostGroups h = host_groups(c);
  bind_layer(c);
  c.b.in_place = staging_on_;
  for (int e : on_gpu_) append(h, e);
  launch(c, h);
  const int cpu_first = h.rows;
  cpu_jobs_.resize(on_cpu_.size());
  for (size_t j = 0; j < on_cpu_.size(); ++j) {
    const int e = on_cpu_[j];
    ExpertRows& job = cpu_jobs_[j];
    job.weights = host[size_t(e)].weights;
    job.first_row = h.rows - cpu_first;
    job.tokens.clear();
    for (int i : pairs_of_[size_t(e)]) job.tokens.push_back(i / c.K);
    append(h, e);
  }
  if (!on_cpu_.empty()) {
    const int64_t rows = h.rows - cpu_first;
    float* y_host = staging_.get<float>(kCpuYHost, size_t(rows * dim), compute_);
    const Buffer xb{x_host, T, dim};
    Buffer yb{y_host, rows, dim};
    // x_host, y_host and cpu_jobs_ are not touched again before the stream has waited for the job
    cpu_->submit([xb, yb, params = *c.b.params, jobs = &cpu_jobs_](
                     Backend& cpu) mutable { cpu.expert_rows(xb, *jobs, params, yb); },
                 compute_);
    MS_CUDA_CHECK(cudaMemcpyAsync(c.b.y + int64_t(cpu_first) * dim, y_host,
                                  size_t(rows * dim) * sizeof(float), cudaMemcpyHostToDevice,
                                  compute_));
    stats_.cpu_experts += on_cpu_.size();
    stats_.bytes_cpu += cpu_bytes;
  }
  combine_through_host(c, h);
}

// The chosen experts come back to the host: pairs_of_[e] lists expert e's (token, slot) pairs.
void ExpertTier::read_selection(const Call& c) {
  int* ids_host = staging_.get<int>(kIdsHost, size_t(c.pairs), compute_);
  MS_CUDA_CHECK(cudaMemcpyAsync(ids_host, c.sel_ids, size_t(c.pairs) * sizeof(int), cudaMemcpyDeviceToHost, compute_));
  if (c.next_logits) {
    const size_t n = size_t(c.next_count);
    float* host = staging_.get<float>(kNextHost, n, compute_);
    MS_CUDA_CHECK(
        cudaMemcpyAsync(host, c.next_logits, n * sizeof(float), cudaMemcpyDeviceToHost, compute_));
  }
  MS_CUDA_CHECK(cudaStreamSynchronize(compute_));
  ++call_;
  pairs_of_.resize(size_t(c.E));
  for (auto& v : pairs_of_) v.clear();
  for (int64_t i = 0; i < c.pairs; ++i) {
    const int e = ids_host[i];
    if (e < 0 || e >= c.E) fail("moe: routing produced expert ", e, " for layer ", c.layer);
    pairs_of_[size_t(e)].push_back(int(i));
  }
}

// Host-built groups, uploaded range by range as batches launch.
ExpertTier::HostGroups ExpertTier::host_groups(const Call& c) {
  const int64_t max_active = std::min<int64_t>(c.E, c.pairs);
  HostGroups h;
  h.active = staging_.get<int>(kActiveHost, size_t(max_active), compute_);
  h.offset = staging_.get<int>(kOffsetHost, size_t(max_active + 1), compute_);
  h.row_token = staging_.get<int>(kRowTokenHost, size_t(c.pairs), compute_);
  h.row_of = staging_.get<int>(kRowOfHost, size_t(c.pairs), compute_);
  h.offset[0] = 0;
  return h;
}

// Expert e's rows after those of the experts appended before it.
void ExpertTier::append(HostGroups& h, int e) {
  h.active[h.n_active] = e;
  for (int i : pairs_of_[size_t(e)]) {
    h.row_token[h.rows] = i;
    h.row_of[i] = h.rows;
    ++h.rows;
  }
  ++h.n_active;
  h.offset[h.n_active] = h.rows;
}

// The appended experts not launched yet, as one batch.
void ExpertTier::launch(Call& c, HostGroups& h) {
  if (h.launched == h.n_active) return;
  const int a0 = h.launched, a1 = h.n_active;
  MoeGroups& g = c.g;
  ExpertBatch& b = c.b;
  if (h.copies) {  // the batch reads slots the copy stream fills
    MS_CUDA_CHECK(cudaEventRecord(copy_done_, copy_));
    MS_CUDA_CHECK(cudaStreamWaitEvent(compute_, copy_done_, 0));
  }
  MS_CUDA_CHECK(cudaMemcpyAsync(g.active + a0, h.active + a0, size_t(a1 - a0) * sizeof(int), cudaMemcpyHostToDevice, compute_));
  MS_CUDA_CHECK(cudaMemcpyAsync(g.offset + a0, h.offset + a0, size_t(a1 - a0 + 1) * sizeof(int), cudaMemcpyHostToDevice, compute_));
  MS_CUDA_CHECK(cudaMemcpyAsync(g.row_token + h.offset[a0], h.row_token + h.offset[a0],
                                size_t(h.offset[a1] - h.offset[a0]) * sizeof(int), cudaMemcpyHostToDevice, compute_));
  upload_table_rows(c.layer, 1);
  bind_layer(c);
  b.count_on_device = false;
  b.a_begin = a0;
  b.a_end = a1;
  run_formats(c);
  h.launched = a1;
}

// hits_: the selected experts in VRAM; request_: the selected ones that are not, in id order.
void ExpertTier::split_hits_and_misses(const Call& c) {
  hits_.clear();
  request_.clear();
  if (tier_ready_) ensure_table(c.layer);
  for (int e = 0; e < c.E; ++e) {
    if (pairs_of_[size_t(e)].empty()) continue;
    const bool in_vram = tier_ready_ && !where_[size_t(c.layer)].empty() && where_[size_t(c.layer)][size_t(e)] >= 0;
    if (in_vram) hits_.push_back(e);
    else request_.push_back(e);
  }
  stats_.hits += hits_.size();
  stats_.misses += request_.size();
  if (tier_ready_) {  // the eviction policy's use counts, of hits and misses alike
    for (const auto* ids : {&hits_, &request_})
      for (int e : *ids) {
        ExpertUse& u = use_of(c.layer, e);
        ++u.uses;
        u.last_use = call_;
      }
  }
}

// The hits go first, as one batch.
void ExpertTier::launch_hits(Call& c, HostGroups& h) {
  if (tier_ready_ && !hits_.empty()) {
    for (int e : hits_) {
      touch(where_[size_t(c.layer)][size_t(e)]);
      append(h, e);
    }
    launch(c, h);
  }
}

// The misses from the provider into VRAM slots on the copy stream, launched as one batch once all
// are in. (When the budget holds every expert, fill_layer has made the layer whole before its call:
// such a call never misses.)
void ExpertTier::fetch_misses(Call& c, HostGroups& h, ExpertProvider& experts) {
  const int E = c.E, layer = c.layer;
  std::vector<int>& request = request_;
  const size_t n_misses = request.size();
  if (request.empty()) return guess_next_layer(c, experts);
  settle_copies();
  victims_ranked_ = false;
  experts.request(layer, request);
  guess_next_layer(c, experts);  // its reads queue behind this request's
  deferred_.clear();
  size_t loaded = 0;
  int e;
  MlpWeights w;
  while (next_copied(experts, e, w)) {
    if (!tier_ready_) {
      const char* lo;
      const char* hi;
      expert_extent(w, lo, hi);
      init(*c.b.params, uint64_t(hi - lo));
      ensure_table(layer);
    }
    if (where_[size_t(layer)].empty()) where_[size_t(layer)].assign(size_t(E), -1);
    if (lasting_ == &experts) note_host(layer, e, w);
    const int slot = free_slot(c, h);
    if (!h.copies) MS_CUDA_CHECK(cudaEventRecord(copy_start_, copy_));
    h.copies = true;
    load_expert(layer, e, w, slot);
    defer_release(experts, e);
    append(h, e);
    if (++loaded == n_misses) launch(c, h);
  }
  launch(c, h);
  leave_copies(experts, h.copies, false);  // every slot filled here is read by a launch that waits for it
}

// The provider's next expert of the request. A failed read (next() throws) has made the provider
// drop the request and unpin its slots, so the host slots of this call's copies may be reused by
// its next request: the copies in flight finish first. Experts already copied stay in VRAM (a
// later launch uploads the table row); the failed one took no slot, so its layer is never
// complete after the failure.
bool ExpertTier::next_copied(ExpertProvider& experts, int& e, MlpWeights& w) {
  try {
    return experts.next(e, w);
  } catch (...) {
    cudaStreamSynchronize(copy_);
    deferred_.clear();
    throw;
  }
}

// Expert e's host slot, whose copy was just queued, goes back to the provider once the copy is
// done (the provider may reuse a released slot). Releases are batched: up to a quarter of the
// provider's slots (all, when it is unbounded) wait for one synchronization of the copy stream.
void ExpertTier::defer_release(ExpertProvider& experts, int e) {
  deferred_.push_back(e);
  const double host_slot = double(opt_.max_expert_bytes ? opt_.max_expert_bytes : slot_bytes_);
  const size_t max_deferred =
      opt_.host_expert_mb < 0 ? SIZE_MAX : size_t(std::max(1.0, opt_.host_expert_mb * 1e6 / host_slot) / 4);
  if (deferred_.size() < max_deferred) return;
  MS_CUDA_CHECK(cudaStreamSynchronize(copy_));
  for (int d : deferred_) experts.release(d);
  deferred_.clear();
}

// The end of a call's copies (when it queued any): settled, and the slots still deferred released,
// by the next call that fetches (settle_copies), not waited for by the host here; with
// compute_waits, the compute stream waits for them.
void ExpertTier::leave_copies(ExpertProvider& experts, bool copies, bool compute_waits) {
  if (copies) {
    MS_CUDA_CHECK(cudaEventRecord(copies_end_, copy_));
    unsettled_timing_ = true;
    if (compute_waits) MS_CUDA_CHECK(cudaStreamWaitEvent(compute_, copies_end_, 0));
  }
  unsettled_provider_ = &experts;
  unsettled_.insert(unsettled_.end(), deferred_.begin(), deferred_.end());
  deferred_.clear();
}

// When VRAM holds every expert, a layer that is not yet whole comes in whole before its call
// routes: its missing experts from the provider into empty slots on the copy stream, which the
// compute stream then waits for (the host does not). The call then runs as a resident one, on the
// kernels of a resident layer, instead of the host round trip with the rest of the layer copied
// after it. The tier is sized here on a model's first call when the pack's largest expert is known.
void ExpertTier::fill_layer(const MoeParams& p, ExpertProvider& experts) {
  if (!tier_ready_ && opt_.max_expert_bytes > 0) init(p, opt_.max_expert_bytes);
  const int layer = p.layer, E = p.n_experts;
  if (!prefetch_layers_ || layer < 0 || E != n_experts_) return;  // route() names a mismatch
  ensure_table(layer);
  if (where_[size_t(layer)].empty()) where_[size_t(layer)].assign(size_t(E), -1);
  if (resident_[size_t(layer)] == E) return;
  std::vector<int>& request = request_;
  request.clear();
  for (int e = 0; e < E; ++e)
    if (where_[size_t(layer)][size_t(e)] < 0) request.push_back(e);
  settle_copies();
  rank_victims(request.size(), true);  // the empty slots first: there are enough of them
  experts.request(layer, request);
  deferred_.clear();
  bool copies = false;
  int e;
  MlpWeights w;
  while (next_copied(experts, e, w)) {
    const int slot = next_victim_ < victims_.size() ? victims_[next_victim_++].second : -1;
    if (slot < 0 || slot_owner_[size_t(slot)].first >= 0)
      fail("cuda: no empty VRAM slot for expert ", e, " of layer ", layer, " (", n_slots_, " slots)");
    if (!copies) MS_CUDA_CHECK(cudaEventRecord(copy_start_, copy_));
    copies = true;
    load_expert(layer, e, w, slot);
    ++stats_.prefetched;
    defer_release(experts, e);
  }
  victims_ranked_ = false;
  mark_dirty(layer);
  leave_copies(experts, copies, true);
}

// Lookahead: each next MoE layer's top k by its router on this call's input, less those in VRAM,
// as the provider's guess of that layer's request, nearest layer first.
void ExpertTier::guess_next_layer(const Call& c, ExpertProvider& experts) {
  if (!c.next_logits) return;
  // read_selection filled it
  const float* logits = staging_.get<float>(kNextHost, size_t(c.next_count), compute_);
  for (const LookaheadGuess& a : c.b.params->ahead) {
    const size_t n = size_t(a.router->rows);
    top_k_ids(std::span<const float>(logits, n), a.top_k, guess_);
    logits += n;
    const int next = a.layer;
    if (tier_ready_ && next >= 0 && next < layers_cap_ && !where_[size_t(next)].empty()) {
      const std::vector<int>& where = where_[size_t(next)];
      std::erase_if(guess_, [&](int e) { return size_t(e) < where.size() && where[size_t(e)] >= 0; });
    }
    experts.prefetch(next, guess_);
  }
}

// The slot of lowest priority (an empty one first) that this call does not hold. When every slot
// holds an expert of this call, those are computed first and their slots reused.
int ExpertTier::free_slot(Call& c, HostGroups& h) {
  for (;;) {
    if (!victims_ranked_) rank_victims(request_.size());
    while (next_victim_ < victims_.size()) {
      const int s = victims_[next_victim_++].second;
      if (slot_call_[size_t(s)] != call_) return s;
    }
    victims_ranked_ = false;
    if (victims_.empty()) {  // every slot is this call's
      launch(c, h);
      MS_CUDA_CHECK(cudaStreamSynchronize(compute_));
      for (uint64_t s = 0; s < n_slots_; ++s) slot_call_[s] = 0;
    }
  }
}

// out = the weighted sum of each token's expert rows, through the host-built row_of.
void ExpertTier::combine_through_host(Call& c, HostGroups& h) {
  upload_table_rows(c.layer, 1);
  MS_CUDA_CHECK(cudaMemcpyAsync(c.g.row_of, h.row_of, size_t(c.pairs) * sizeof(int), cudaMemcpyHostToDevice, compute_));
  cuda::combine(c.b.y, c.sel_w, c.g.row_of, c.T, c.K, c.dim, c.out, compute_);
  op_done();
}

// --- reading in place -----------------------------------------------------------------------

// Whether this call reads the experts of `layer` that are not in VRAM from the host tier in place;
// the first call of a layer over a lasting provider preloads the layer into the host tier (for a
// prefill too, so that the decode after it starts in place).
bool ExpertTier::reads_in_place(int layer, int64_t T, int n_experts, ExpertProvider& experts) {
  if (!in_place_on_ || !tier_ready_ || prefetch_layers_ || n_experts != n_experts_ || layer < 0 || !experts.lasting())
    return false;
  if (lasting_ != &experts) {  // another provider: the addresses known so far are not its
    if (lasting_) return false;
    lasting_ = &experts;
  }
  ensure_table(layer);
  if (host_known_[size_t(layer)] < n_experts_) {
    if (!host_fits() || preload_failed_[size_t(layer)]) return false;
    try {
      preload_layer(layer, experts);
    } catch (const Error&) {
      // A damaged expert: the layer keeps to the host path, where only a call choosing that
      // expert fails (naming it), as without reading in place.
      preload_failed_[size_t(layer)] = 1;
      return false;
    }
  }
  return T <= kGemvMaxTokens && host_known_[size_t(layer)] == n_experts_;
}

// Whether pinned host memory can hold every expert: at most 80% of the memory available when
// first asked (else the tier keeps to the host round trip, and the host tier to what it reads).
bool ExpertTier::host_fits() {
  if (host_fit_ < 0) {
    const double need = double(opt_.total_experts) * double(opt_.max_expert_bytes ? opt_.max_expert_bytes : slot_bytes_);
    host_fit_ = opt_.total_experts > 0 && need <= 0.8 * memory_available() ? 1 : 0;
  }
  return host_fit_ == 1;
}

// Every expert of `layer` the tier has no host address for, through the provider's preload.
void ExpertTier::preload_layer(int layer, ExpertProvider& experts) {
  if (!log_host_ || !log_dev_) {  // the routing log, here: never while a step is captured
    log_cap_ = size_t(1) << 18;
    if (!log_host_)
      MS_CUDA_CHECK(cudaHostAlloc(reinterpret_cast<void**>(&log_host_), log_cap_ * sizeof(int), cudaHostAllocDefault));
    MS_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&log_dev_), log_cap_ * sizeof(int)));
  }
  auto& known = host_[size_t(layer)];
  if (known.empty()) known.assign(size_t(n_experts_), HostExpert{});
  if (where_[size_t(layer)].empty()) where_[size_t(layer)].assign(size_t(n_experts_), -1);
  std::vector<int> ids;
  for (int e = 0; e < n_experts_; ++e)
    if (!known[size_t(e)].lo) ids.push_back(e);
  settle_copies();  // the previous miss call's experts are released before a new request
  experts.preload(layer, ids, [&](int e, const MlpWeights& w) { note_host(layer, e, w); });
}

// The lasting host copy of an expert, and its table entry there while it is not in VRAM. Memory
// that is not pinned (not from the backend's pool) stops any further preload: a layer not yet
// mapped then keeps to the host path.
void ExpertTier::note_host(int layer, int expert, const MlpWeights& w) {
  auto& known = host_[size_t(layer)];
  if (known.empty()) known.assign(size_t(n_experts_), HostExpert{});
  HostExpert& h = known[size_t(expert)];
  if (h.lo || host_fit_ == 0) return;
  const char* lo;
  const char* hi;
  expert_extent(w, lo, hi);
  cudaPointerAttributes attr{};
  if (cudaPointerGetAttributes(&attr, lo) != cudaSuccess || attr.type != cudaMemoryTypeHost) {
    cudaGetLastError();
    host_fit_ = 0;
    return;
  }
  note_formats(layer, expert, w, lo);
  h = HostExpert{lo, uint64_t(hi - lo), entry_of(w)};
  h.dev.in_host = 1;
  if (cpu_) h.weights = w;
  if (++host_known_[size_t(layer)] == n_experts_) ++mapped_layers_;
  if (where_[size_t(layer)][size_t(expert)] < 0) {
    table_host_[size_t(layer) * n_experts_ + size_t(expert)] = h.dev;
    mark_dirty(layer);
    if (hot(layer, expert)) candidates_.emplace_back(layer, expert);  // promoted at the next step
  }
}

// Where a call read in place writes its chosen experts: the next pairs of the device log, noted
// for digest_log; null (the call goes uncounted) when the log is full while a step is captured.
int* ExpertTier::log_slot(int layer, int64_t pairs) {
  if (!log_dev_ || size_t(pairs) > log_cap_) return nullptr;
  if (log_used_ + size_t(pairs) > log_cap_) {
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    MS_CUDA_CHECK(cudaStreamIsCapturing(compute_, &capture));
    if (capture != cudaStreamCaptureStatusNone) return nullptr;
    digest_log();
  }
  int* slot = log_dev_ + log_used_;
  log_.push_back({layer, pairs, log_used_});
  log_used_ += size_t(pairs);
  return slot;
}

// The logged calls (the compute stream has finished them): use counts, hits and misses as the
// host path counts them (each distinct expert of a call once), and the misses as candidates for
// promotion.
void ExpertTier::digest_log() {
  if (log_.empty()) return;
  MS_CUDA_CHECK(cudaMemcpyAsync(log_host_, log_dev_, log_used_ * sizeof(int), cudaMemcpyDeviceToHost, compute_));
  MS_CUDA_CHECK(cudaStreamSynchronize(compute_));  // the logged calls and the log's copy are done
  seen_.assign(size_t(n_experts_), 0);
  for (const Logged& l : log_) {
    ++call_;
    const int* ids = log_host_ + l.offset;
    int misses = 0;
    for (int64_t i = 0; i < l.pairs; ++i) {
      const int e = ids[i];
      if (e < 0 || e >= n_experts_ || seen_[size_t(e)]) continue;
      seen_[size_t(e)] = 1;
      ExpertUse& u = use_of(l.layer, e);
      ++u.uses;
      u.last_use = call_;
      const int slot = where_[size_t(l.layer)][size_t(e)];
      if (slot >= 0) {
        ++stats_.hits;
        touch(slot);
      } else {
        ++stats_.misses;
        ++misses;
        stats_.bytes_in_place += host_[size_t(l.layer)][size_t(e)].bytes;
        candidates_.emplace_back(l.layer, e);
      }
    }
    for (int64_t i = 0; i < l.pairs; ++i)
      if (ids[i] >= 0 && ids[i] < n_experts_) seen_[size_t(ids[i])] = 0;
    if (!split_step_) note_misses(misses);  // run_split noted its own
  }
  log_.clear();
  log_used_ = 0;
}

void ExpertTier::step_begins() {
  digest_log();
  if (cpu_) cpu_->rethrow();  // a CPU share that failed in the last step
  split_step_ = cpu_ && misses_per_call_ >= split_min_misses_;
  finish_promotions(false);
  start_promotions();
  upload_dirty_rows();
}

// Promotions whose copies are done (all of them, waiting, with `wait`) take their slots.
void ExpertTier::finish_promotions(bool wait) {
  size_t done = 0;
  for (auto& [ev, batch] : promoting_) {
    if (wait) {
      MS_CUDA_CHECK(cudaEventSynchronize(ev));
    } else {
      const cudaError_t q = cudaEventQuery(ev);
      if (q == cudaErrorNotReady) break;
      MS_CUDA_CHECK(q);
    }
    for (const Promotion& p : batch) {
      slot_busy_[size_t(p.slot)] = 0;
      HostExpert& h = host_[size_t(p.layer)][size_t(p.expert)];
      h.promoting = false;
      if (slot_owner_[size_t(p.slot)] != std::make_pair(p.layer, p.expert)) continue;
      where_[size_t(p.layer)][size_t(p.expert)] = p.slot;
      if (++resident_[size_t(p.layer)] == n_experts_) ++full_layers_;
      table_host_[size_t(p.layer) * n_experts_ + size_t(p.expert)] =
          moved(h.dev, h.lo, slot_arena_ + uint64_t(p.slot) * slot_bytes_);
      mark_dirty(p.layer);
    }
    spare_events_.push_back(ev);
    ++done;
  }
  promoting_.erase(promoting_.begin(), promoting_.begin() + long(done));
}

// The candidates the eviction policy ranks above the lowest-ranked VRAM slots, highest first and
// at most promotions_per_step(), are copied into those slots on the copy stream. Each victim's
// table entry points at its host copy from the next upload on, and the copy waits for that upload.
void ExpertTier::start_promotions() {
  if (candidates_.empty()) return;
  const double ticks_per_token =
      n_experts_ > 0 && opt_.total_experts > 0 ? std::max(1.0, double(opt_.total_experts) / n_experts_) : 1.0;
  std::sort(candidates_.begin(), candidates_.end());
  candidates_.erase(std::unique(candidates_.begin(), candidates_.end()), candidates_.end());
  std::vector<std::pair<double, std::pair<int, int>>> ranked;
  for (const auto& [layer, e] : candidates_) {
    const HostExpert& h = host_[size_t(layer)][size_t(e)];
    if (where_[size_t(layer)][size_t(e)] < 0 && !h.promoting && h.bytes <= slot_bytes_)
      ranked.push_back({hot(layer, e) ? std::numeric_limits<double>::infinity()
                                      : policy_->priority(use_of(layer, e), call_, ticks_per_token),
                        {layer, e}});
  }
  candidates_.clear();
  std::sort(ranked.begin(), ranked.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
  const size_t n = std::min(ranked.size(), size_t(promotions_per_step()));
  if (n == 0) return;
  rank_victims(n, true);
  std::vector<Promotion> batch;
  for (size_t i = 0; i < n && i < victims_.size(); ++i) {
    const auto [victim_priority, slot] = victims_[i];
    if (!(ranked[i].first > victim_priority)) break;
    const auto [layer, e] = ranked[i].second;
    evict(slot);
    slot_owner_[size_t(slot)] = {layer, e};
    slot_busy_[size_t(slot)] = 1;
    host_[size_t(layer)][size_t(e)].promoting = true;
    batch.push_back({layer, e, slot});
  }
  victims_ranked_ = false;
  if (batch.empty()) return;
  upload_dirty_rows();
  cudaEvent_t ev;
  if (spare_events_.empty()) {
    MS_CUDA_CHECK(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
  } else {
    ev = spare_events_.back();
    spare_events_.pop_back();
  }
  MS_CUDA_CHECK(cudaEventRecord(ev, compute_));  // the victims' entries are uploaded
  MS_CUDA_CHECK(cudaStreamWaitEvent(copy_, ev, 0));
  for (const Promotion& p : batch) {
    const HostExpert& h = host_[size_t(p.layer)][size_t(p.expert)];
    MS_CUDA_CHECK(cudaMemcpyAsync(slot_arena_ + uint64_t(p.slot) * slot_bytes_, h.lo, h.bytes, cudaMemcpyHostToDevice,
                                  copy_));
    stats_.bytes_promoted += h.bytes;
  }
  MS_CUDA_CHECK(cudaEventRecord(ev, copy_));
  stats_.promotions += batch.size();
  promoting_.emplace_back(ev, std::move(batch));
}

void ExpertTier::mark_dirty(int layer) { dirty_rows_.push_back(layer); }

// Runs of dirty rows (a row noted twice counts once) go up as one copy each, the clean rows
// between two dirty ones too when at most kUploadGap - 1 of them lie between: a copy's fixed cost
// (a few us on the stream before the step) is worth more than a few rows' bytes (a row of 128
// experts: ~23 KB).
void ExpertTier::upload_dirty_rows() {
  constexpr int kUploadGap = 8;
  std::sort(dirty_rows_.begin(), dirty_rows_.end());
  for (size_t i = 0; i < dirty_rows_.size();) {
    const int first = dirty_rows_[i];
    int last = first;
    while (++i < dirty_rows_.size() && dirty_rows_[i] - last <= kUploadGap) last = dirty_rows_[i];
    upload_table_rows(first, last - first + 1);
  }
  dirty_rows_.clear();
}

}  // namespace moestream::cuda
