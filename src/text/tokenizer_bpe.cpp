// The BPE model: a piece is split into characters (their vocab ids, with byte fallback or the
// unknown token for characters outside the vocab), then adjacent pairs are merged, always the
// pair of lowest merge rank first (leftmost among equals), until no listed pair is left. This is
// the order `tokenizers` uses, so ids match it exactly. Results are cached per piece.
#include <xxhash.h>

#include <array>
#include <cstdio>
#include <mutex>
#include <queue>
#include <shared_mutex>
#include <unordered_map>

#include "text/tokenizer_components.h"
#include "text/tokenizer_json.h"
#include "text/unicode.h"

namespace moestream::tok {

namespace {

struct StringHash {
  using is_transparent = void;
  size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
};

template <class V>
using StringMap = std::unordered_map<std::string, V, StringHash, std::equal_to<>>;

// Token string <-> id. An open-addressing table over one vector of entries: building and
// probing it is several times faster than a node-based map for a 150k-token vocab.
class TokenIndex {
 public:
  explicit TokenIndex(std::vector<std::pair<std::string, int32_t>> entries)
      : entries_(std::move(entries)) {
    size_t capacity = 16;
    while (capacity < entries_.size() * 2) capacity *= 2;
    slots_.assign(capacity, -1);
    mask_ = capacity - 1;
    int32_t max_id = -1;
    for (size_t i = 0; i < entries_.size(); ++i) {
      int32_t& slot = slots_[slot_index(entries_[i].first)];
      if (slot >= 0)
        entries_[slot].second = entries_[i].second;  // repeated key: last one wins
      else
        slot = static_cast<int32_t>(i);
      max_id = std::max(max_id, entries_[i].second);
    }
    by_id_.assign(static_cast<size_t>(max_id + 1), -1);
    for (int32_t slot : slots_)
      if (slot >= 0) by_id_[entries_[slot].second] = slot;
  }

  std::optional<int32_t> find(std::string_view token) const {
    int32_t slot = slots_[slot_index(token)];
    if (slot < 0) return std::nullopt;
    return entries_[slot].second;
  }
  const std::string* token(int32_t id) const {
    if (id < 0 || static_cast<size_t>(id) >= by_id_.size() || by_id_[id] < 0) return nullptr;
    return &entries_[by_id_[id]].first;
  }
  int32_t max_id() const { return static_cast<int32_t>(by_id_.size()) - 1; }

 private:
  // The slot holding token, or the empty slot where it would go.
  size_t slot_index(std::string_view token) const {
    size_t i = XXH3_64bits(token.data(), token.size()) & mask_;
    while (slots_[i] >= 0 && entries_[slots_[i]].first != token) i = (i + 1) & mask_;
    return i;
  }

  std::vector<std::pair<std::string, int32_t>> entries_;
  std::vector<int32_t> slots_;  // index into entries_, -1 when empty
  std::vector<int32_t> by_id_;  // id -> index into entries_, -1 for unused ids
  size_t mask_ = 0;
};

// Piece -> ids, shared by all threads. Once full it stops growing; later pieces are computed
// each time (common words arrive early, so the hit rate stays high).
class WordCache {
 public:
  bool lookup(std::string_view piece, std::vector<int32_t>& ids) const {
    std::shared_lock lock(mutex_);
    auto it = map_.find(piece);
    if (it == map_.end()) return false;
    ids.insert(ids.end(), it->second.begin(), it->second.end());
    return true;
  }
  void store(std::string_view piece, const int32_t* ids, size_t count) {
    if (piece.size() > kMaxPieceBytes) return;
    std::unique_lock lock(mutex_);
    if (map_.size() >= kCapacity) return;
    map_.emplace(std::string(piece), std::vector<int32_t>(ids, ids + count));
  }

 private:
  static constexpr size_t kCapacity = 1 << 16;
  static constexpr size_t kMaxPieceBytes = 256;
  mutable std::shared_mutex mutex_;
  StringMap<std::vector<int32_t>> map_;
};

// (left id, right id) -> the merge's rank and the merged token's id. Open addressing, sized
// once for the number of merges.
class MergeTable {
 public:
  struct Merge {
    uint32_t rank;
    int32_t new_id;
  };

  explicit MergeTable(size_t count) {
    int bits = 4;
    while ((size_t{1} << bits) < count * 2) ++bits;
    shift_ = 64 - bits;
    slots_.assign(size_t{1} << bits, Slot{kEmpty, {}});
  }
  void set(int32_t a, int32_t b, Merge merge) {  // a pair set twice keeps the later merge
    Slot& slot = slots_[slot_index(key(a, b))];
    slot = Slot{key(a, b), merge};
  }
  const Merge* find(int32_t a, int32_t b) const {
    const Slot& slot = slots_[slot_index(key(a, b))];
    return slot.key == kEmpty ? nullptr : &slot.merge;
  }

 private:
  static constexpr uint64_t kEmpty = ~uint64_t{0};  // ids are below 2^31, so never a real key
  struct Slot {
    uint64_t key;
    Merge merge;
  };
  static uint64_t key(int32_t a, int32_t b) {
    return (static_cast<uint64_t>(static_cast<uint32_t>(a)) << 32) | static_cast<uint32_t>(b);
  }
  size_t slot_index(uint64_t k) const {
    size_t mask = slots_.size() - 1;
    size_t i = static_cast<size_t>((k * 0x9E3779B97F4A7C15ull) >> shift_);
    while (slots_[i].key != kEmpty && slots_[i].key != k) i = (i + 1) & mask;
    return i;
  }

  std::vector<Slot> slots_;
  int shift_ = 60;
};

class Bpe final : public Model {
 public:
  Bpe(const json& spec, VocabAndMerges tables, const Where& where);

  void tokenize(std::string_view piece, std::vector<int32_t>& ids) const override;
  std::optional<int32_t> token_to_id(std::string_view token) const override {
    return vocab_.find(token);
  }
  const std::string* id_to_token(int32_t id) const override { return vocab_.token(id); }
  int32_t max_id() const override { return vocab_.max_id(); }

 private:
  using Merge = MergeTable::Merge;
  const Merge* find_merge(int32_t a, int32_t b) const { return merges_.find(a, b); }
  void add_merge(const std::string& a, const std::string& b, uint32_t rank, const Where& where);
  void merge_piece(std::string_view piece, std::vector<int32_t>& ids) const;

  TokenIndex vocab_;
  MergeTable merges_;
  std::string unk_token_;  // "" when none
  std::optional<int32_t> unk_id_;
  std::string prefix_;  // continuing_subword_prefix
  std::string suffix_;  // end_of_word_suffix
  bool fuse_unk_ = false;
  bool byte_fallback_ = false;
  bool ignore_merges_ = false;
  std::array<int32_t, 256> byte_ids_{};  // "<0xNN>" tokens for byte_fallback, -1 if absent
  mutable WordCache cache_;
};

Bpe::Bpe(const json& spec, VocabAndMerges tables, const Where& where)
    : vocab_(std::move(tables.vocab)), merges_(tables.merges.size()) {
  if (auto it = spec.find("dropout"); it != spec.end() && !it->is_null() && it->get<double>() > 0)
    fail(where.str(), ": dropout is not supported (it makes encoding random)");
  if (!tables.has_vocab) fail(where.str(), ": missing field 'vocab'");
  if (!tables.has_merges) fail(where.str(), ": missing field 'merges'");
  unk_token_ = get_string(spec, "unk_token", where, "");
  prefix_ = get_string(spec, "continuing_subword_prefix", where, "");
  suffix_ = get_string(spec, "end_of_word_suffix", where, "");
  fuse_unk_ = get_bool(spec, "fuse_unk", where, false);
  byte_fallback_ = get_bool(spec, "byte_fallback", where, false);
  ignore_merges_ = get_bool(spec, "ignore_merges", where, false);

  for (size_t rank = 0; rank < tables.merges.size(); ++rank) {
    const auto& [a, b] = tables.merges[rank];
    add_merge(a, b, static_cast<uint32_t>(rank), where);
  }

  if (!unk_token_.empty()) unk_id_ = token_to_id(unk_token_);
  static const std::array<std::string, 256> byte_names = [] {  // "<0x00>" .. "<0xFF>"
    std::array<std::string, 256> names;
    for (int b = 0; b < 256; ++b) {
      char name[8];
      std::snprintf(name, sizeof(name), "<0x%02X>", b);
      names[b] = name;
    }
    return names;
  }();
  for (int b = 0; b < 256; ++b) byte_ids_[b] = token_to_id(byte_names[b]).value_or(-1);
}

void Bpe::add_merge(const std::string& a, const std::string& b, uint32_t rank, const Where& where) {
  auto id_a = token_to_id(a), id_b = token_to_id(b);
  // The merged token drops b's continuing-subword prefix: "hel" + "##lo" -> "hello".
  std::string joined =
      a + (b.compare(0, prefix_.size(), prefix_) == 0 ? b.substr(prefix_.size()) : b);
  auto id_joined = token_to_id(joined);
  if (!id_a || !id_b || !id_joined) {
    const std::string& missing = !id_a ? a : !id_b ? b : joined;
    fail(where.str(), ": merge ", rank, " ('", a, "', '", b, "') uses a token not in the vocab ('",
         missing, "')");
  }
  // A pair listed twice keeps its later rank, as a map insert does in `tokenizers`.
  merges_.set(*id_a, *id_b, Merge{rank, *id_joined});
}

void Bpe::tokenize(std::string_view piece, std::vector<int32_t>& ids) const {
  if (piece.empty()) return;
  if (ignore_merges_) {
    if (auto id = token_to_id(piece)) {
      ids.push_back(*id);
      return;
    }
  }
  if (cache_.lookup(piece, ids)) return;
  size_t first = ids.size();
  merge_piece(piece, ids);
  cache_.store(piece, ids.data() + first, ids.size() - first);
}

void Bpe::merge_piece(std::string_view piece, std::vector<int32_t>& ids) const {
  // Symbols form a doubly linked list over a vector; a merged-away symbol gets len 0.
  struct Symbol {
    int32_t id;
    int32_t prev, next;
    uint32_t len;
  };
  std::vector<Symbol> symbols;
  symbols.reserve(piece.size());
  auto add = [&](int32_t id, size_t len) {
    int32_t index = static_cast<int32_t>(symbols.size());
    if (!symbols.empty()) symbols.back().next = index;
    symbols.push_back({id, index - 1, -1, static_cast<uint32_t>(len)});
  };

  // An unknown-token symbol not added yet (fuse_unk extends it over following unknowns).
  int32_t pending_unk = -1;
  size_t pending_unk_len = 0;
  auto add_pending_unk = [&] {
    if (pending_unk >= 0) add(pending_unk, pending_unk_len);
    pending_unk = -1;
  };
  std::string scratch;
  for (size_t pos = 0; pos < piece.size();) {
    size_t begin = pos;
    unicode::next_code_point(piece, pos);
    std::string_view ch = piece.substr(begin, pos - begin);
    std::string_view symbol = ch;
    if ((begin > 0 && !prefix_.empty()) || (pos == piece.size() && !suffix_.empty())) {
      scratch.assign(begin > 0 ? prefix_ : "");
      scratch.append(ch);
      if (pos == piece.size()) scratch.append(suffix_);
      symbol = scratch;
    }
    if (auto id = token_to_id(symbol)) {
      add_pending_unk();
      add(*id, ch.size());
      continue;
    }
    if (byte_fallback_) {
      bool all = true;
      for (unsigned char b : symbol) all = all && byte_ids_[b] >= 0;
      if (all) {
        for (unsigned char b : symbol) add(byte_ids_[b], 1);
        continue;
      }
    }
    if (unk_token_.empty()) continue;  // no unknown token: the character is dropped
    if (!unk_id_) fail("BPE: unk_token '", unk_token_, "' is not in the vocab");
    if (pending_unk >= 0 && fuse_unk_) {
      pending_unk_len += ch.size();
    } else {
      add_pending_unk();
      pending_unk = *unk_id_;
      pending_unk_len = ch.size();
    }
  }
  add_pending_unk();

  struct Candidate {
    uint32_t rank;
    int32_t pos;
    int32_t new_id;
    bool operator>(const Candidate& o) const {
      return rank != o.rank ? rank > o.rank : pos > o.pos;
    }
  };
  std::priority_queue<Candidate, std::vector<Candidate>, std::greater<>> queue;
  for (size_t i = 0; i + 1 < symbols.size(); ++i)
    if (const Merge* m = find_merge(symbols[i].id, symbols[i + 1].id))
      queue.push({m->rank, static_cast<int32_t>(i), m->new_id});

  while (!queue.empty()) {
    Candidate top = queue.top();
    queue.pop();
    Symbol& left = symbols[top.pos];
    if (left.len == 0 || left.next < 0) continue;
    Symbol right = symbols[left.next];
    // Entries go stale when a neighbour was merged first; the pair must still yield new_id.
    const Merge* current = find_merge(left.id, right.id);
    if (!current || current->new_id != top.new_id) continue;

    symbols[left.next].len = 0;
    left.id = top.new_id;
    left.len += right.len;
    left.next = right.next;
    if (right.next >= 0) symbols[right.next].prev = top.pos;

    if (left.prev >= 0)
      if (const Merge* m = find_merge(symbols[left.prev].id, left.id))
        queue.push({m->rank, left.prev, m->new_id});
    if (left.next >= 0)
      if (const Merge* m = find_merge(left.id, symbols[left.next].id))
        queue.push({m->rank, top.pos, m->new_id});
  }
  for (const Symbol& s : symbols)
    if (s.len != 0) ids.push_back(s.id);
}

}  // namespace

std::unique_ptr<Model> make_model(const json& spec, VocabAndMerges tables,
                                  const std::string& file) {
  Where where{file, "model"};
  if (!spec.is_object()) fail(where.str(), ": expected an object");
  // Early files leave out "type"; a model with merges is BPE.
  std::string type = spec.contains("type") ? get_string(spec, "type", where)
                     : tables.has_merges   ? "BPE"
                                           : "";
  where.component += " " + type;
  if (type == "BPE") return std::make_unique<Bpe>(spec, std::move(tables), where);
  fail(file, ": unsupported model type '", type, "'");
}

}  // namespace moestream::tok
