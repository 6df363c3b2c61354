// moestream's packed model layout (docs/FORMATS.md): non-expert weights in one safetensors file
// that is memory-mapped, and the routed experts of each layer in one file per layer, each expert's
// tensors contiguous and 4 KiB aligned so that one read fetches one expert. A JSON manifest gives
// every expert's offset, size, storage format and xxh64 checksum, so experts of different
// precision can live side by side, and the checksums of every resident tensor and of itself.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "core/quant_format.h"
#include "core/dtype.h"
#include "io/safetensors.h"

namespace moestream {

constexpr uint64_t kPackAlignment = 4096;
constexpr const char* kPackManifestName = "moestream-pack.json";
// Bumped whenever write_pack lays out the same source differently, so that packs cached from an
// older layout are not reused (2: FP8 weights stay FP8 instead of becoming bf16; 3: checksums of
// the resident tensors and the manifest, pack format 2).
constexpr int kPackerRevision = 3;

// One tensor inside an expert's block, e.g. role "gate" (later "gate.scales", ...).
struct PackedTensor {
  std::string role;             // gate | up | down (+ ".scales" / ".biases" for quantized formats),
                                // or gate_bias | up_bias | down_bias: F32 [1, out] added to the output
  DType dtype = DType::BF16;
  std::vector<int64_t> shape;   // as stored: [out, in], [out, in * bits / 32] words (affine) or
                                // [out, in / 2] bytes (MXFP4)
  uint64_t offset = 0;          // bytes from the start of the expert's block
  uint64_t nbytes = 0;
  int bits = 0, group_size = 0; // quantized weight codes; 0 otherwise
  QuantScheme scheme = QuantScheme::Affine;  // manifest "scheme": absent (affine) or "mxfp4"
};

struct PackedExpert {
  int file = 0;                 // index into PackManifest::expert_files
  uint64_t offset = 0;          // 4 KiB aligned, in that file
  uint64_t size = 0;            // bytes of the block (a multiple of 4 KiB, padding included)
  uint64_t checksum = 0;        // xxh64 (seed 0) of the whole block
  std::string format;           // "bf16", "f16", "f32", "q<bits>g<group>" (affine, MLX layout),
                                // "mxfp4", "mixed"
  std::vector<PackedTensor> tensors;

  const PackedTensor* find(const std::string& role) const;
  // Logical [out, in] of a weight role ("gate", "up", "down"), unpacking quantized codes.
  std::vector<int64_t> logical_shape(const std::string& role) const;
  // The stored format of a weight role (bits 0: plain).
  QuantFormat quant_format(const std::string& role) const;
};

struct PackManifest {
  std::string dir;                          // the pack directory
  std::string model_type;
  std::string weights_file;                 // non-expert tensors (safetensors), relative to dir
  std::vector<std::string> expert_files;    // relative to dir
  std::vector<std::vector<PackedExpert>> layers;  // [layer][expert]; empty for layers without experts
  int n_experts = 0;                        // routed experts per MoE layer
  int version = 0;                          // pack format: 2, or 1 (no checksums but the experts')
  std::map<std::string, uint64_t> weight_checksums;  // xxh3-64 of each resident tensor's bytes

  // Validates every field, the manifest's checksum and weights_file's header checksum; Error
  // names the file and the field. A format 1 pack is read with a warning on stderr (unless
  // warn_unchecked is false).
  static PackManifest load(const std::string& dir, bool warn_unchecked = true);
  // weights_file, every tensor checked against its checksum (Error naming the tensor).
  WeightSet open_weights() const;
  // One line per tensor of `weights` whose bytes do not match their checksum.
  std::vector<std::string> weight_problems(const WeightSet& weights) const;
  bool has_checksums() const { return version >= 2; }
  uint64_t total_expert_bytes() const;
  uint64_t max_expert_size() const;
  const PackedExpert& expert(int layer, int expert) const;  // Error when out of range
};

bool is_pack_dir(const std::string& dir);

// What verify_pack found: one line per problem (naming the file and the tensor or expert), and
// how much it checked.
struct PackCheck {
  std::vector<std::string> problems;
  int64_t tensors = 0, experts = 0;
  uint64_t tensor_bytes = 0, expert_bytes = 0;
};
// Checks a whole pack: the manifest, every resident tensor and every expert against their checksums.
PackCheck verify_pack(const std::string& dir);

// How a checkpoint's expert tensor is laid out, when not as the pack stores it ([out, in] weights).
enum class ExpertLayout {
  OutIn,              // as the pack stores it
  InOut,              // transposed: the model computes x @ W (gpt-oss down_proj [inter, hidden])
  GateUpInterleaved,  // gpt-oss gate_up_proj [hidden, 2 * inter] (x @ W) or its bias [2 * inter]:
                      // gate in the even columns, up in the odd ones
  GateUpInterleavedRows,  // gpt-oss MXFP4 gate_up_proj_blocks [2 * inter, hidden / 32, 16] and
                          // _scales [2 * inter, hidden / 32]: gate in the even rows, up in the odd
  GateUpRows,         // transformers' fused experts.gate_up_proj, per expert [2 * inter, hidden]:
                      // the gate rows, then the up rows (role gate_up)
};

// Which tensors of a checkpoint are routed-expert weights, and what they are.
struct ExpertTensorRef {
  int layer = 0, expert = 0;
  std::string role;      // gate | up | down, or gate.scales, gate.biases, ... (quantized), or
                         // gate_up, gate_up.scales (GateUp*), or
                         // gate_bias | up_bias | down_bias | gate_up_bias
  bool stacked = false;  // one tensor holds every expert of the layer along dimension 0 (MLX);
                         // an expert's dimensions after its rows are flattened (MXFP4 blocks)
  ExpertLayout layout = ExpertLayout::OutIn;
};
using ExpertTensorParser = std::function<std::optional<ExpertTensorRef>(const std::string& name)>;

struct PackOptions {
  std::string quant = "keep";  // keep | bf16 | q8 | q6 | q4 | q3 | q2 (affine, MLX layout)
  int group_size = 64;         // for quantized formats
  bool quant_all = false;      // also quantize the other linear layers and the embedding
  bool clip_search = false;    // per-group clipping by least squared error
  bool progress = true;        // progress on stderr: a bar on a terminal, else a line every few seconds
  int threads = 0;             // experts converted at once; <= 0: one per hardware thread (same bytes)
  // Batches of experts read from the source ahead of the one being converted (0: each batch is
  // read when its turn comes); the bytes of the pack do not depend on it.
  int read_ahead = 2;
  // How the source is read: "direct" (preads with O_DIRECT, through the page cache where the
  // filesystem refuses it), "auto" (direct, but what the page cache holds is mapped from it),
  // "buffered" (preads through the page cache) or "mmap" (the kernel's readahead through the
  // mapping), by read_threads threads, each one request of up to 8 MiB at
  // a time (16: about 130 MB in flight; on the lent GPU machines bench's raw O_DIRECT reads got
  // 1.25 GB/s with 8 expert reads in flight, 1.56-1.80 with 32). The pack's bytes depend on neither.
  std::string read_io = "auto";
  int read_threads = 16;
  // GPTQ (pack --gptq): experts quantized with error compensation under Hessians collected by
  // running the model on this calibration text (io/gptq.h); empty: round to nearest.
  std::string gptq_text;
  int64_t gptq_tokens = 65536;   // calibration tokens at most (<= 0: the whole text)
  int64_t gptq_min_tokens = 64;  // experts routed fewer tokens than this are rounded to nearest
  // Calibration runs (io/gptq.h): pass 1 on the bf16 model, each later one on the pack quantized
  // under the previous pass's Hessians, so that later layers see their quantized inputs.
  int gptq_passes = 1;
  // Calibration inputs kept per expert for reconstruct_expert (io/gptq.h) after GPTQ; 0: none.
  int64_t gptq_expert_tokens = 1024;
  // Per-expert bits (pack --tiered, io/expert_tiers.h): expert_bits[layer][expert] replaces the
  // bits of --quant for that expert; empty: every expert at --quant.
  std::vector<std::vector<int>> expert_bits;
  // Checkpoint tensors the architecture never reads (a multimodal checkpoint's vision tower,
  // multi-token-prediction layers), left out of the pack; empty: keep every tensor.
  std::function<bool(const std::string& name)> skip;
  // Test hook: runs once the checkpoint is open, before any of its tensors is read.
  std::function<void()> opened;
};

// What a pack is made from, for resuming (PackWriter::resume): field -> value ("source": a
// fingerprint of the source's files, "quant": "q4", ...). Equal keys, equal bytes.
using PackKey = std::map<std::string, std::string>;
PackKey pack_key(const std::string& src, const PackOptions& options);

// Writes a pack: non-expert weights, then experts layer by layer (experts of a layer in order),
// then finish() writes the manifest and renames the temporary directory into place. Destroyed
// before finish() (an error), it removes the temporary directory. A process killed before
// finish() leaves it, with a journal of the files it completed, for resume() to continue from.
class PackWriter {
 public:
  struct Part {  // one tensor of an expert
    std::string role;  // gate | up | down (+ ".scales" / ".biases")
    DType dtype;
    std::vector<int64_t> shape;
    const void* data;
    uint64_t nbytes;
    int bits = 0, group_size = 0;  // quantized weight codes
    QuantScheme scheme = QuantScheme::Affine;
  };
  PackWriter(const std::string& out, const std::string& model_type, const std::string& source);
  ~PackWriter();
  const std::string& tmp_dir() const { return tmp_; }  // configs and tokenizer files go here

  // Before anything is written: temporaries of this destination that dead writers left
  // (`OUT.tmp-PID`, `OUT.calib.tmp-PID`) are removed, one line each on stderr, except one made
  // with the same `key`: it becomes this writer's temporary directory, and the files it had
  // completed are verified against their checksums (`threads` at once) and kept, the rest
  // removed. From then on each completed file is noted in the temporary directory's journal.
  void resume(const PackKey& key, int threads);
  // weights.safetensors was kept by resume(): not to be written again. Its note (what
  // weights_written was given) comes with it.
  bool kept_weights() const { return kept_weights_; }
  const std::string& weights_note() const { return weights_note_; }
  // The experts of this layer were kept by resume(): add_expert must not be called for it.
  bool kept_layer(int layer) const { return kept_layers_.count(layer) > 0; }
  // Called once weights.safetensors is written: its checksums are computed and journaled with
  // `note` (anything the caller needs again to resume without rewriting it).
  void weights_written(const std::string& note = "");
  void add_expert(int layer, const std::string& format, const std::vector<Part>& parts);
  void finish(int n_layers);

 private:
  void close_layer();
  void next_layer(int layer);
  void journal(const std::string& line);
  std::string out_, tmp_, model_type_, source_;
  std::vector<std::string> files_;
  std::vector<std::vector<std::string>> layers_json_;  // [layer] serialized expert entries
  int layer_ = -1, n_experts_ = 0;
  int fd_ = -1;
  uint64_t pos_ = 0;
  std::vector<char> block_;
  bool finished_ = false;
  bool journaling_ = false;          // resume() was called
  int journaled_ = 0;                // files completed by this process (MOESTREAM_PACK_STOP_AFTER)
  std::string weights_checksums_;    // JSON: header and tensor checksums, once known
  bool kept_weights_ = false;
  std::string weights_note_;
  std::map<int, std::vector<std::string>> kept_layers_;  // layer -> serialized expert entries
};

// Temporary directories (`OUT.tmp-PID`) that PackWriters left in `dir` when their process died
// (killed, interrupted) before finishing: the paths, and their writers' PIDs.
struct AbandonedPack {
  std::string path;
  int pid = 0;
  bool writer_alive = false;  // the PID still runs (then it is not abandoned yet)
};
std::vector<AbandonedPack> pack_temporaries(const std::string& dir);
// Removes the temporaries of dead writers in `dir`, but those of the pack `except` (a path in
// `dir`), which its writer resumes from; returns what it removed.
std::vector<AbandonedPack> remove_abandoned_packs(const std::string& dir, const std::string& except = "");

// Converts the Hugging Face model directory `src` into a pack at `out` (which must not exist),
// through a temporary directory renamed into place at the end; `src` is never modified.
// `experts` says which tensors are routed-expert weights (the architecture knows).
void write_pack(const std::string& src, const std::string& out, const ExpertTensorParser& experts,
                const PackOptions& options);

}  // namespace moestream
