// The CUDA backend's expert tiers and its MoE layer (cuda_expert_tier.cu): routed experts in a
// VRAM slot cache, fed from an ExpertProvider whose host slots are pinned memory from PinnedPool.
//
// Per MoE call of layer L:
//  - every expert of L resident in VRAM: route -> group -> expert kernels -> combine, all on the
//    GPU with no host round trip (the kernels find weights through the device table);
//  - otherwise the chosen ids come back to the host; resident experts (hits) are launched at once,
//    and the misses are requested from the ExpertProvider (its pinned slots are the host tier; it
//    reads from disk what it lacks), copied into free VRAM slots on the copy stream, and launched
//    as one more batch once all have arrived. With a VRAM budget that holds every expert, the
//    rest of layer L is fetched along so that later calls take the first path. With lookahead
//    (MoeParams::ahead), the next MoE layers' routers run on the same input and come back with
//    the choice; each one's top k not in VRAM go to the provider as a guess (ExpertProvider::
//    prefetch), read from disk behind L's own misses;
//  - decode (at most kGemvMaxTokens tokens) over a lasting provider (a host tier that keeps every
//    expert it reads, in pinned memory): the first call of L preloads L's experts into the host
//    tier, and from then on L runs as in the first path, its device table pointing at the VRAM
//    slot of each expert held there and at the pinned host copy of every other one, which the
//    expert kernels read in place over PCIe. Nothing waits for the host, and the step can be a
//    CUDA graph. The routing of the step is logged to the host; between steps (step_begins) it
//    updates the use counts, and misses that the eviction policy ranks above a VRAM slot's expert
//    are copied into that slot on the copy stream, their table entries switched once the copy is
//    done.
//  - the same decode with a CPU share (CudaOptions::cpu_expert_share), in steps whose calls have
//    missed at least split_min_misses_ experts a call of late (a moving mean): the chosen ids and
//    x come back to the host each call; the GPU runs the experts in VRAM and some of those read in
//    place as one batch, while the CPU computes the others from their pinned host copies; their
//    rows go up before the combine (run_split). Such a step is not a CUDA graph: its host round
//    trips cost ~75 us a call, more than a few misses' share saves.
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include "backend/backend.h"
#include "backend/backend_factory.h"
#include "backend/cuda/common.cuh"
#include "backend/cuda/cuda_backend.h"
#include "backend/cuda/linear.h"
#include "backend/cuda/moe.h"
#include "backend/cuda/op_profile.h"
#include "backend/eviction.h"

namespace moestream::cuda {

// Pinned host memory in large chunks, handed out in fixed sizes and reused (cudaHostAlloc is slow,
// and the ExpertStore asks for thousands of equal slots).
class PinnedPool {
 public:
  ~PinnedPool();
  void* alloc(size_t bytes);
  void free(void* p);
  uint64_t total() const { return total_; }

 private:
  std::vector<void*> chunks_;
  char* chunk_next_ = nullptr;
  size_t chunk_left_ = 0;
  uint64_t total_ = 0;
  std::unordered_map<size_t, std::vector<void*>> free_;
  std::unordered_map<void*, size_t> size_of_;
};

// Pinned host staging areas by slot, each grown as needed (the caller orders its reuse). Growing
// waits for `stream` first, whose copies may still read the old area.
class HostStaging {
 public:
  HostStaging() = default;
  HostStaging(const HostStaging&) = delete;
  HostStaging& operator=(const HostStaging&) = delete;
  ~HostStaging() {
    for (auto& [p, n] : areas_) cudaFreeHost(p);
  }
  template <class T>
  T* get(int slot, size_t count, cudaStream_t stream) {
    if (areas_.size() <= size_t(slot)) areas_.resize(size_t(slot) + 1, {nullptr, 0});
    auto& [p, n] = areas_[size_t(slot)];
    const size_t bytes = count * sizeof(T);
    if (n < bytes) {
      MS_CUDA_CHECK(cudaStreamSynchronize(stream));
      if (p) MS_CUDA_CHECK(cudaFreeHost(p));
      p = nullptr;
      MS_CUDA_CHECK(cudaHostAlloc(&p, bytes, cudaHostAllocDefault));
      n = bytes;
    }
    return static_cast<T*>(p);
  }

 private:
  std::vector<std::pair<void*, size_t>> areas_;
};

// The CPU's share of split calls (ExpertTier::run_split) on a thread of its own, so that the host
// thread goes on launching the step while the CPU computes: the compute stream waits for each job
// on a count in mapped pinned memory (wait_for), which the thread raises to the job's number once
// the job's rows are written. One job at a time: the next is submitted after the stream has
// waited for the last.
class CpuExpertWorker {
 public:
  explicit CpuExpertWorker(std::unique_ptr<Backend> cpu);
  ~CpuExpertWorker();  // finishes the job in hand
  CpuExpertWorker(const CpuExpertWorker&) = delete;
  CpuExpertWorker& operator=(const CpuExpertWorker&) = delete;
  // Starts work(cpu) on the thread; the stream `s` then waits until it is done.
  void submit(std::function<void(Backend&)> work, cudaStream_t s);
  double seconds() const { return double(nanos_.load()) * 1e-9; }  // time spent in jobs
  // A failed job's error (its rows are left as they were), thrown once.
  void rethrow();

 private:
  void loop();
  std::unique_ptr<Backend> cpu_;
  uint32_t* done_host_ = nullptr;  // mapped pinned: the number of the last job finished
  uint32_t* done_dev_ = nullptr;
  std::mutex mu_;
  std::condition_variable cv_;
  std::function<void(Backend&)> work_;
  std::atomic<uint32_t> submitted_{0};
  bool stop_ = false;
  std::atomic<int64_t> nanos_{0};
  std::exception_ptr error_;
  std::thread thread_;
};

// The VRAM expert tier and the MoE layer that runs on it. Work goes on the backend's compute
// stream; expert copies on its copy stream. The slot arena is sized at the first expert seen.
class ExpertTier {
 public:
  // gemm, times and profile belong to the backend and outlive the tier. sync_ops: wait for the
  // GPU at the end of each call, as the backend does after every operation (MOESTREAM_CUDA_SYNC).
  ExpertTier(const CudaOptions& options, cudaStream_t compute, cudaStream_t copy, GemmScratch& gemm,
             PhaseTimes& times, bool sync_ops, OpProfile& profile);
  ~ExpertTier();
  ExpertTier(const ExpertTier&) = delete;
  ExpertTier& operator=(const ExpertTier&) = delete;

  // Backend::moe.
  void moe(const Buffer& x, const Matrix& router, ExpertProvider& experts, const MoeParams& p, Buffer& out);

  // Every MoE layer has all its experts in VRAM: a step needs no host round trip.
  bool all_resident() const {
    return tier_ready_ && prefetch_layers_ && n_experts_ > 0 &&
           int64_t(full_layers_) * n_experts_ == opt_.total_experts;
  }
  // A decode step (at most kGemvMaxTokens tokens) needs no host round trip: every expert in VRAM,
  // or every MoE layer read in place (the step can be captured as CUDA graphs).
  bool graph_ready() const {
    return all_resident() ||
           (!split_step_ && in_place_on_ && lasting_ && host_fit_ == 1 && n_experts_ > 0 &&
            opt_.total_experts > 0 && int64_t(mapped_layers_) * n_experts_ == opt_.total_experts);
  }
  // Between steps (the compute stream's work so far may still run): the logged routing of the
  // steps read in place updates use counts and statistics, finished promotions take their slots,
  // and new ones start.
  void step_begins();
  // The statistics so far, with the slot arena's shape (graph steps and pinned bytes are the
  // backend's to fill in). Waits for the compute stream when steps read in place are not yet
  // counted.
  GpuTierStats stats();

 private:
  // One MoE call as it goes through its steps.
  struct Call {
    int64_t T = 0, dim = 0, pairs = 0;
    int K = 0, E = 0, layer = 0;
    bool resident = false;  // the device-only path: every expert of the layer in VRAM, or in_place
    bool in_place = false;  // the layer's experts not in VRAM are read from pinned host memory
    float* sel_w = nullptr;
    int* sel_ids = nullptr;
    // lookahead: the next MoE layers' router logits (MoeParams::ahead), one after another (host path)
    float* next_logits = nullptr;
    int64_t next_count = 0;
    MoeGroups g{};
    ExpertBatch b{};
    float* out = nullptr;
  };
  // The groups of a call through the host, built expert by expert in pinned staging and uploaded
  // range by range as batches launch.
  struct HostGroups {
    int* active = nullptr;
    int* offset = nullptr;
    int* row_token = nullptr;
    int* row_of = nullptr;
    int n_active = 0, rows = 0;
    int launched = 0;     // active experts launched so far
    bool copies = false;  // expert copies issued on the copy stream in this call
  };

  // --- the steps of moe() ---
  Call route(const Buffer& x, const Matrix& router, const MoeParams& p, Buffer& out, bool in_place);
  void run_resident(Call& c);
  void run_split(Call& c);
  void read_selection(const Call& c);
  HostGroups host_groups(const Call& c);
  void split_hits_and_misses(const Call& c);
  void launch_hits(Call& c, HostGroups& h);
  void fetch_misses(Call& c, HostGroups& h, ExpertProvider& experts);
  void fill_layer(const MoeParams& p, ExpertProvider& experts);
  bool next_copied(ExpertProvider& experts, int& e, MlpWeights& w);
  void defer_release(ExpertProvider& experts, int e);
  void leave_copies(ExpertProvider& experts, bool copies, bool compute_waits);
  void guess_next_layer(const Call& c, ExpertProvider& experts);
  int free_slot(Call& c, HostGroups& h);
  void rank_victims(size_t needed, bool this_call_too = false);
  void pin_hottest();
  bool hot(int layer, int expert) const {
    return size_t(layer) < hot_.size() && size_t(expert) < hot_[size_t(layer)].size() && hot_[size_t(layer)][size_t(expert)];
  }
  ExpertUse& use_of(int layer, int expert);
  void combine_through_host(Call& c, HostGroups& h);
  void bind_layer(Call& c);
  void run_formats(Call& c);
  void append(HostGroups& h, int e);
  void launch(Call& c, HostGroups& h);

  // --- reading in place ---
  bool reads_in_place(int layer, int64_t T, int n_experts, ExpertProvider& experts);
  bool host_fits();
  void preload_layer(int layer, ExpertProvider& experts);
  void note_host(int layer, int expert, const MlpWeights& w);
  int* log_slot(int layer, int64_t pairs);
  void digest_log();
  void finish_promotions(bool wait);
  void start_promotions();
  void mark_dirty(int layer);
  void upload_dirty_rows();

  // --- slots and the device table ---
  void init(const MoeParams& p, uint64_t first_expert_bytes);
  void ensure_table(int layer);
  void upload_table_rows(int first, int count);
  void load_expert(int layer, int expert, const MlpWeights& w, int slot);
  void note_formats(int layer, int expert, const MlpWeights& w, const char* lo);
  void evict(int slot);
  void touch(int slot);
  void settle_copies();
  void op_done() {
    if (sync_ops_) MS_CUDA_CHECK(cudaStreamSynchronize(compute_));
  }

  enum ScratchSlot { kLogits, kSelIds, kSelW, kNActive, kActive, kOffset, kRowToken, kRowOf, kRowChunk, kHidden, kY, kNext };
  enum StagingSlot {
    kIdsHost,
    kActiveHost,
    kOffsetHost,
    kRowTokenHost,
    kRowOfHost,
    kNextHost,
    kXHost,
    kCpuYHost
  };

  CudaOptions opt_;
  cudaStream_t compute_ = nullptr, copy_ = nullptr;  // the backend's
  GemmScratch& gemm_;
  PhaseTimes& times_;
  bool sync_ops_ = false;
  OpProfile& prof_;
  Scratch scratch_;
  Scratch exact_scratch_;  // the exact tensor-core expert kernels' (run_experts_exact_mma)
  unsigned* route_done_ = nullptr;  // route_few's counters of finished blocks, one per token
  HostStaging staging_;
  cudaEvent_t copy_start_ = nullptr, copy_done_ = nullptr;
  // A miss call's copies end at copies_end_. The host does not wait for it: the call's host slots
  // are released, and the copy time counted, by settle_copies() at the next miss call, before it
  // asks the provider for anything (a store releases by its current layer).
  cudaEvent_t copies_end_ = nullptr;
  ExpertProvider* unsettled_provider_ = nullptr;
  std::vector<int> unsettled_;
  bool unsettled_timing_ = false;

  // Slots: n_slots_ of slot_bytes_ in one arena; slot_owner_ (layer, expert) or (-1, -1).
  bool tier_ready_ = false;
  uint64_t slot_bytes_ = 0, n_slots_ = 0;
  char* slot_arena_ = nullptr;
  std::vector<std::pair<int, int>> slot_owner_;
  std::vector<uint64_t> slot_call_;       // the call that last used the slot
  // Which slot a miss takes: the policy's priority of each slot's expert (use_: [layer][expert],
  // counted over the calls of the host path and the logged calls read in place, also across
  // evictions), ranked once per host-path miss call or per step's promotions, lowest first; empty
  // slots before all.
  std::unique_ptr<EvictionPolicy> policy_;
  std::vector<std::vector<ExpertUse>> use_;
  std::vector<std::pair<double, int>> victims_;
  size_t next_victim_ = 0;
  bool victims_ranked_ = false;
  std::vector<std::vector<int>> where_;   // [layer][expert] -> slot or -1
  // [layer][expert]: pinned by the profile (CudaOptions::profile): promoted before any other
  // candidate once its host copy is known, never a victim.
  std::vector<std::vector<char>> hot_;
  std::vector<int> resident_;             // experts of each layer in VRAM
  int full_layers_ = 0;                   // layers with every expert in VRAM
  // [layer]: the (gate/up, down) formats of the experts loaded so far, in order of first sight;
  // more than one in a tiered pack (each format's kernels then run over its own experts).
  std::vector<std::vector<std::pair<FormatTag, FormatTag>>> formats_;
  // [layer]: the smallest log2(group size) of the quantized expert matrices loaded so far (-1 once
  // one is not a power of two; kNoGroups while none is quantized).
  static constexpr int kNoGroups = 1 << 30;
  std::vector<int> group_shift_;
  std::vector<char> misaligned_;  // per layer: an expert whose arrays, or copy, the staging cannot take
  int n_experts_ = 0, layers_cap_ = 0;
  DevExpert* table_dev_ = nullptr;        // [layers_cap_][n_experts_]
  DevExpert* table_host_ = nullptr;       // pinned mirror
  bool prefetch_layers_ = false;          // the budget holds every expert: fill whole layers
  uint64_t call_ = 0;
  GpuTierStats stats_;
  std::vector<std::vector<int>> pairs_of_;  // expert -> its (token, slot) pair indices
  std::vector<int64_t> inter_;              // intermediate size of each layer's experts
  std::vector<int> hits_, request_, deferred_, guess_;

  // Reading in place. host_[layer][expert]: the expert's lasting host copy (lo == nullptr until
  // seen), with its table entry pointing there; a layer is mapped once every expert is known.
  struct HostExpert {
    const char* lo = nullptr;
    uint64_t bytes = 0;
    DevExpert dev{};
    bool promoting = false;  // a copy into a VRAM slot is in flight
    MlpWeights weights;      // the matrices at lo, for the CPU share (run_split)
  };
  bool in_place_on_ = true;               // MOESTREAM_CUDA_IN_PLACE=0 turns it off
  // Batched steps copy the lines of experts read in place through shared memory
  // (expert_few_mma.cu); MOESTREAM_CUDA_EXPERT_STAGING=0 reads them directly, for comparison.
  bool staging_on_ = true;
  int host_fit_ = -1;                     // the host tier can hold every expert: 1, 0, -1 unknown
  // The provider whose addresses host_ holds (a model owns its backend, so it outlives the tier's
  // use of them); calls with another provider keep to the host path.
  ExpertProvider* lasting_ = nullptr;
  std::vector<std::vector<HostExpert>> host_;
  std::vector<int> host_known_;           // per layer: experts in host_
  std::vector<char> preload_failed_;      // per layer: a read failed (the layer keeps to the host path)
  int mapped_layers_ = 0;
  // The routing of calls read in place: their routers write the chosen ids into log_dev_, copied
  // to pinned log_host_ once a step, when the log is digested.
  struct Logged {
    int layer;
    int64_t pairs;
    size_t offset;
  };
  int* log_dev_ = nullptr;
  int* log_host_ = nullptr;
  size_t log_cap_ = 0, log_used_ = 0;
  std::vector<Logged> log_;
  std::vector<std::pair<int, int>> candidates_;  // (layer, expert) read in place since the last promotions
  std::vector<char> seen_;
  // Promotions: copies into VRAM slots on the copy stream, a batch per step with its event.
  struct Promotion {
    int layer, expert, slot;
  };
  std::vector<std::pair<cudaEvent_t, std::vector<Promotion>>> promoting_;
  std::vector<cudaEvent_t> spare_events_;
  std::vector<char> slot_busy_;           // a promotion's copy into the slot is in flight
  std::vector<int> dirty_rows_;           // layers whose table rows changed on the host since their upload

  // The CPU share of calls read in place (CudaOptions::cpu_expert_share): the CPU backend's
  // worker that computes it, and a call's experts on each side.
  std::unique_ptr<CpuExpertWorker> cpu_;
  std::vector<int> on_gpu_, on_cpu_;
  // The moving mean of the experts a call read in place missed (of VRAM), and whether this step's
  // calls split (step_begins: when the mean is at least split_min_misses_,
  // MOESTREAM_CPU_EXPERT_MIN_MISSES, default 4).
  void note_misses(int misses) { misses_per_call_ += 0.05 * (double(misses) - misses_per_call_); }
  double misses_per_call_ = 0;
  double split_min_misses_ = 4;
  bool split_step_ = false;
  std::vector<ExpertRows> cpu_jobs_;
};

}  // namespace moestream::cuda
