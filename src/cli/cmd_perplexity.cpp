// moestream perplexity: exp of the mean negative log-likelihood over non-overlapping windows of a
// text, as transformers computes it; optionally the KL divergence against a stored run.
//
// Window i is tokens[i*ctx, (i+1)*ctx + 1): its first ctx tokens are run from an empty context
// and the ctx next-token predictions are scored. --kl-save stores each scored position's
// log-probabilities (f16); --kl-base compares the run against such a file.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <cstdio>
#include <fstream>
#include <sstream>

#include "cli/cli.h"
#include "core/dtype.h"
#include "core/error.h"
#include "core/files.h"
#include "text/tokenizer.h"

namespace moestream::cli {

namespace {

constexpr char kKlMagic[8] = {'M', 'S', 'K', 'L', 'v', '1', 0, 0};

struct KlHeader {
  char magic[8];
  int64_t ctx, windows, vocab;
};

// log-softmax of one row, in double precision.
void log_softmax(const float* logits, int64_t n, std::vector<double>& out) {
  out.resize(size_t(n));
  double mx = logits[0];
  for (int64_t i = 1; i < n; ++i) mx = std::max(mx, double(logits[i]));
  double sum = 0;
  for (int64_t i = 0; i < n; ++i) sum += std::exp(double(logits[i]) - mx);
  const double lse = mx + std::log(sum);
  for (int64_t i = 0; i < n; ++i) out[size_t(i)] = double(logits[i]) - lse;
}

}  // namespace

void add_perplexity(CLI::App& app) {
  struct Flags {
    ModelFlags model;
    std::string file, kl_save, kl_base;
    int chunks = 0;
    bool one_token = false;
  };
  auto f = std::make_shared<Flags>();
  CLI::App* cmd = app.add_subcommand("perplexity", "Perplexity of a text file (and KL divergence against a stored run)");
  f->model.add_to(*cmd);
  cmd->add_option("-f,--file", f->file, "Text file")->required();
  cmd->add_option("--chunks", f->chunks, "Windows to score (default: all that fit)")->check(kNonNegative);
  cmd->add_option("--kl-save", f->kl_save, "Store the log-probabilities of every scored position");
  cmd->add_option("--kl-base", f->kl_base, "Report KL divergence and top-1 agreement against a --kl-save file");
  cmd->add_flag("--one-token", f->one_token,
                "Run each window one token per forward call, as decoding does (measures options that act on "
                "decode steps only: --miss-fallback, --cache-bias)");
  cmd->callback([f] {
    const std::string text = read_file(f->file);
    auto tok = Tokenizer::load(ensure_pack(f->model.dir, f->model.options.cache_dir));
    const std::vector<int32_t> ids = tok->encode(text);
    const int64_t ctx = f->model.ctx > 0 ? f->model.ctx : 512;  // -c: tokens per window
    int64_t windows = (int64_t(ids.size()) - 1) / ctx;
    if (f->chunks > 0) windows = std::min<int64_t>(windows, f->chunks);
    if (windows <= 0)
      fail(f->file, ": ", ids.size(), " tokens are too few for one window of --ctx ", ctx, " (need ", ctx + 1, ")");

    auto model = load_model(f->model.dir, f->model.options);
    check_profile_out(f->model, *model);
    const int64_t vocab = model->info().vocab_size;
    std::ofstream save;
    if (!f->kl_save.empty()) {
      save.open(f->kl_save + ".tmp", std::ios::binary);
      if (!save) fail(f->kl_save, ": cannot open for writing");
      KlHeader h{};
      std::memcpy(h.magic, kKlMagic, 8);
      h.ctx = ctx;
      h.windows = windows;
      h.vocab = vocab;
      save.write(reinterpret_cast<const char*>(&h), sizeof h);
    }
    std::ifstream base;
    if (!f->kl_base.empty()) {
      base.open(f->kl_base, std::ios::binary);
      if (!base) fail(f->kl_base, ": cannot open for reading");
      KlHeader h{};
      base.read(reinterpret_cast<char*>(&h), sizeof h);
      if (!base || std::memcmp(h.magic, kKlMagic, 8) != 0) fail(f->kl_base, ": not a moestream --kl-save file");
      if (h.ctx != ctx || h.vocab != vocab || h.windows < windows)
        fail(f->kl_base, ": made with ctx ", h.ctx, ", vocab ", h.vocab, ", ", h.windows,
             " windows; this run has ctx ", ctx, ", vocab ", vocab, ", ", windows, " windows");
    }

    std::vector<float> logits(size_t(ctx * vocab));
    std::vector<double> logp;
    std::vector<uint16_t> row16(static_cast<size_t>(vocab));
    double nll = 0, kl = 0;
    int64_t scored = 0, agree = 0;
    std::vector<double> token_nll, token_kl;  // per scored position, for the error estimates
    auto t0 = std::chrono::steady_clock::now();
    for (int64_t w = 0; w < windows; ++w) {
      auto seq = model->new_sequence(ctx);
      const auto window = std::span(ids).subspan(size_t(w * ctx), size_t(ctx));
      if (f->one_token)
        for (int64_t i = 0; i < ctx; ++i)
          model->forward(window.subspan(size_t(i), 1), *seq, std::span(logits).subspan(size_t(i * vocab), size_t(vocab)));
      else
        model->forward(window, *seq, logits);
      for (int64_t i = 0; i < ctx; ++i) {
        log_softmax(logits.data() + i * vocab, vocab, logp);
        nll -= logp[size_t(ids[size_t(w * ctx + i + 1)])];
        token_nll.push_back(-logp[size_t(ids[size_t(w * ctx + i + 1)])]);
        ++scored;
        if (save.is_open()) {
          for (int64_t v = 0; v < vocab; ++v) row16[size_t(v)] = f32_to_f16(float(logp[size_t(v)]));
          save.write(reinterpret_cast<const char*>(row16.data()), std::streamsize(vocab * 2));
        }
        if (base.is_open()) {
          base.read(reinterpret_cast<char*>(row16.data()), std::streamsize(vocab * 2));
          if (!base) fail(f->kl_base, ": truncated");
          double d = 0;
          int64_t best_base = 0, best = 0;
          for (int64_t v = 0; v < vocab; ++v) {
            const double lb = f16_to_f32(row16[size_t(v)]);
            d += std::exp(lb) * (lb - logp[size_t(v)]);
            if (lb > f16_to_f32(row16[size_t(best_base)])) best_base = v;
            if (logp[size_t(v)] > logp[size_t(best)]) best = v;
          }
          kl += d;
          token_kl.push_back(d);
          agree += best == best_base;
        }
      }
      std::fprintf(stderr, "\rwindow %lld/%lld: ppl so far %.4f", (long long)(w + 1),
                   (long long)windows, std::exp(nll / double(scored)));
    }
    std::fprintf(stderr, "\n");
    const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (save.is_open()) {
      save.close();
      if (!save) fail(f->kl_save, ": write failed");
      std::filesystem::rename(f->kl_save + ".tmp", f->kl_save);
    }
    // Error estimates as llama-perplexity gives them: the standard error of the mean
    // negative log-likelihood carried to the perplexity (ppl * se), of the mean KL, and of the
    // agreement rate; tokens are treated as independent, so these are lower bounds.
    const double n = double(scored);
    auto standard_error = [n](const std::vector<double>& v, double mean) {
      if (v.size() < 2) return 0.0;
      double ss = 0;
      for (double x : v) ss += (x - mean) * (x - mean);
      return std::sqrt(ss / (n - 1) / n);
    };
    const double mean_nll = nll / n, ppl = std::exp(mean_nll);
    std::printf("ppl = %.6f +/- %.6f\n", ppl, ppl * standard_error(token_nll, mean_nll));
    std::printf("tokens scored: %lld (%lld windows of %lld)\n", (long long)scored, (long long)windows, (long long)ctx);
    if (base.is_open()) {
      const double mean_kl = kl / n, p_agree = double(agree) / n;
      std::printf("kl divergence (base || this run) = %.6f +/- %.6f\n", mean_kl, standard_error(token_kl, mean_kl));
      std::sort(token_kl.begin(), token_kl.end());
      auto pct = [&](double q) { return token_kl[std::min(token_kl.size() - 1, size_t(q * double(token_kl.size() - 1) + 0.5))]; };
      std::printf("kl percentiles: median %.6f, 90%% %.6f, 99%% %.6f, 99.9%% %.6f, max %.6f\n", pct(0.5), pct(0.9),
                  pct(0.99), pct(0.999), token_kl.back());
      std::printf("top-1 agreement = %.2f%% +/- %.2f%%\n", 100.0 * p_agree, 100.0 * std::sqrt(p_agree * (1 - p_agree) / n));
    }
    std::fprintf(stderr, "%.1f tokens/s\n", double(scored) / secs);
    report(f->model, *model, {scored, 0, secs, 0});
  });
}

}  // namespace moestream::cli
