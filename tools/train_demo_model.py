#!/usr/bin/env python3
"""Trains the demo model: a small Qwen3.5-MoE (qwen3_5_moe_text) on the Python standard library.

Corpus: the .py sources of the standard library of the Python that runs this script (PSF License
Agreement), split by file: a fixed ~2% of the files (by a hash of the relative path) is held out.
Tokenizer: byte-level BPE trained with `tokenizers` on the training files, Qwen2's pre-tokenizer
regex, ChatML special tokens and a Qwen-style chat template. Instruction pairs are drawn from the
corpus (a function's docstring first line as the user turn, the function as the answer) and mixed
into the training stream as ChatML conversations.

Model: the seeds' family, Gated DeltaNet 3:1 with gated full attention, routed experts plus a
shared expert, trained with transformers' own Qwen3_5MoeForCausalLM (bf16 autocast, AdamW, the
load-balancing loss on), seed fixed and a fixed number of steps. Training is deterministic on CUDA
(torch.use_deterministic_algorithms, a fixed cuBLAS workspace, no TF32, and an experts forward
without atomics: tools/deterministic_experts.py): two runs with the same seed, step count and
versions on one H100 gave the same weights bit for bit. The training log records their SHA-256.

Output (--out):
  hf/    the bf16 Hugging Face directory (config.json, model.safetensors, tokenizer files,
         generation_config.json)
  mlx/   the same model 4-bit affine quantized (groups of 64; router gates at 8 bits) in mlx-lm's
         layout, as mlx-community publishes it: experts stacked under mlp.switch_mlp, uint32
         words + scales + biases, norms stored as 1 + w, conv1d [channels, kernel, 1], A_log f32;
         plus heldout.txt, routing_profile.json, train_log.json, corpus.json
  ref/   ref.json + ref_logits.npy (transformers on the *dequantized* shipped weights, in the
         format of tests/fixtures/families/*), ref_logits_bf16.npy (on the bf16 weights),
         perplexity.json (transformers' per-window NLL on heldout.txt, windowed as
         `moestream perplexity --ctx 512`)

Run on the GPU machine:  python3 tools/train_demo_model.py --out OUT --steps 450
(the shipped model; add --train-only to train and report the held-out perplexity and weights hash
without the export)
"""

import argparse
import ast
import hashlib
import json
import os
import platform
import shutil
import sys
import sysconfig
import tempfile
import textwrap
import time

# A fixed cuBLAS workspace makes its reductions run in one order (torch's deterministic mode
# refuses cuBLAS without it); cuBLAS reads it when CUDA starts, so before torch is imported.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
import tokenizers  # noqa: E402
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

HERE = os.path.dirname(os.path.abspath(__file__))
for cand in (HERE, os.path.join(HERE, "..", "tools")):
    if os.path.exists(os.path.join(cand, "make_next_fixtures.py")):
        sys.path.insert(0, cand)
import make_next_fixtures as nxt  # noqa: E402  write_mlx (MLX layout), greedy, kernel_report
import parity_tolerances  # noqa: E402
import deterministic_experts as det  # noqa: E402

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
               r"|\s*[\r\n]+|\s+(?!\S)|\s+")
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
PY_LICENSE = "PSF-2.0 (Python Software Foundation License Agreement); the model is derived from it"

MODEL = dict(
    vocab_size=None, hidden_size=256, moe_intermediate_size=64,
    shared_expert_intermediate_size=256, num_hidden_layers=8, num_attention_heads=4,
    num_key_value_heads=2, head_dim=64, partial_rotary_factor=0.25, linear_conv_kernel_dim=4,
    linear_key_head_dim=64, linear_value_head_dim=64, linear_num_key_heads=2,
    linear_num_value_heads=4, num_experts=32, num_experts_per_tok=4,
    layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 2,
    rope_theta=10000.0, tie_word_embeddings=False, max_position_embeddings=2048)


def log(*a):
    print(f"[{time.strftime('%H:%M:%S')}]", *a, flush=True)


# ----------------------------------------------------------------------------------------- corpus

def stdlib_files():
    root = sysconfig.get_paths()["stdlib"]
    out = []
    for d, dirs, files in os.walk(root):
        dirs[:] = sorted(x for x in dirs if x not in ("site-packages", "dist-packages", "__pycache__"))
        for f in sorted(files):
            if f.endswith(".py"):
                out.append(os.path.relpath(os.path.join(d, f), root))
    return root, sorted(out)


def is_test(rel):
    parts = rel.split(os.sep)
    return any(p in ("test", "tests", "idle_test") for p in parts[:-1]) or parts[-1].startswith("test_")


def held_out(rel):
    return int(hashlib.sha256(rel.encode()).hexdigest(), 16) % 50 == 0  # ~2% of the files


def read_corpus():
    root, rels = stdlib_files()
    texts, digest = {}, hashlib.sha256()
    for rel in rels:
        try:
            with open(os.path.join(root, rel), encoding="utf-8") as f:
                t = f.read()
        except (UnicodeDecodeError, OSError):
            continue
        if not t.strip():
            continue
        texts[rel] = t
        digest.update(rel.encode() + b"\0" + hashlib.sha256(t.encode()).digest())
    return root, texts, digest.hexdigest()


def instruction_pairs(text):
    """(user, assistant) pairs: a function's docstring first line, then the function."""
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return []
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        doc = ast.get_docstring(node)
        if not doc:
            continue
        first = doc.strip().splitlines()[0].strip()
        src = ast.get_source_segment(text, node)
        if not src or not (10 <= len(first) <= 120) or not (60 <= len(src) <= 1500):
            continue
        # the segment starts at `def`; the body keeps its original indentation
        lines = src.splitlines()
        body = textwrap.dedent("\n".join(lines[1:]))
        src = lines[0] + "\n" + textwrap.indent(body, "    ")
        if node.decorator_list:
            continue
        out.append((first, node.name, src))
    return out


def chat_text(first, name, src, k):
    asks = [first, f"Write a Python function `{name}`: {first}",
            f"{first.rstrip('.')}. Use Python.", f"Implement {name}() in Python. {first}"]
    user = asks[k % len(asks)]
    return (f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"
            f"```python\n{src}\n```<|im_end|>\n")


# -------------------------------------------------------------------------------------- tokenizer

def train_tokenizer(texts, vocab_size):
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    return tok


def write_tokenizer(tok, d):
    os.makedirs(d, exist_ok=True)
    tok.save(os.path.join(d, "tokenizer.json"))
    ids = {s: tok.token_to_id(s) for s in SPECIALS}
    cfg = dict(tokenizer_class="PreTrainedTokenizerFast", model_max_length=2048,
               bos_token=None, eos_token="<|im_end|>", pad_token="<|endoftext|>",
               unk_token=None, add_bos_token=False, add_prefix_space=False,
               clean_up_tokenization_spaces=False, chat_template=CHAT_TEMPLATE,
               added_tokens_decoder={str(i): dict(content=s, lstrip=False, rstrip=False,
                                                  normalized=False, single_word=False, special=True)
                                     for s, i in ids.items()})
    with open(os.path.join(d, "tokenizer_config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    gen = dict(eos_token_id=[ids["<|im_end|>"], ids["<|endoftext|>"]], pad_token_id=ids["<|endoftext|>"],
               bos_token_id=None, do_sample=True, temperature=0.7, top_k=20, top_p=0.95,
               transformers_version=transformers.__version__)
    with open(os.path.join(d, "generation_config.json"), "w") as f:
        json.dump(gen, f, indent=2)
    return ids


# ------------------------------------------------------------------------------------------ model

def make_model(vocab, ids, experts_impl):
    cfg = dict(MODEL, vocab_size=vocab)
    config = nxt.fam.make_config("qwen3_5_moe_text", cfg)
    config.eos_token_id = ids["<|im_end|>"]
    config.pad_token_id = ids["<|endoftext|>"]
    config.output_router_logits = True
    config.router_aux_loss_coef = 0.01
    cls = transformers.Qwen3_5MoeForCausalLM
    kw = {"attn_implementation": "sdpa"}
    if experts_impl:
        # ours run on top of transformers' eager modules, which are the reference they check against
        kw["experts_implementation"] = "eager" if experts_impl in det.IMPLS else experts_impl
    try:
        model = cls._from_config(config, **kw)
    except (TypeError, ValueError) as e:
        log("experts_implementation", experts_impl, "refused:", e)
        model = cls._from_config(config, attn_implementation="sdpa")
    if experts_impl in det.IMPLS:
        det.patch(model, experts_impl)
    return model


def batches(stream, seq, batch, rng):
    n = len(stream) - seq - 1
    while True:
        starts = rng.integers(0, n, batch)
        yield np.stack([stream[s:s + seq] for s in starts])


def time_impls(stream, vocab, ids, args, dev):
    rates = {}
    for impl in ("eager", "grouped_mm") + det.IMPLS:
        try:
            torch.cuda.reset_peak_memory_stats()
            model = make_model(vocab, ids, impl).to(dev)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
            it = batches(stream, args.seq, args.batch, np.random.default_rng(0))
            for i in range(11):
                if i == 3:
                    torch.cuda.synchronize()
                    t = time.time()
                x = torch.from_numpy(next(it)).to(dev)
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    loss = model(input_ids=x, labels=x).loss
                opt.zero_grad()
                loss.backward()
                opt.step()
            torch.cuda.synchronize()
            rates[impl] = 8 * x.numel() / (time.time() - t)
            log(f"impl {impl}: {rates[impl]:.0f} tok/s, loss {float(loss):.3f}, "
                f"peak {torch.cuda.max_memory_allocated() / 1e9:.1f} GB")
            del model, opt
        except Exception as e:  # an implementation this transformers lacks
            log(f"impl {impl}: failed: {type(e).__name__}: {e}")
    return rates


def train(model, stream, args, dev, log_rows):
    torch.manual_seed(args.seed)
    rng = np.random.default_rng(args.seed)
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "embed" not in n]
    other = [p for n, p in model.named_parameters() if not (p.ndim >= 2 and "embed" not in n)]
    opt = torch.optim.AdamW([dict(params=decay, weight_decay=0.1), dict(params=other, weight_decay=0.0)],
                            lr=args.lr, betas=(0.9, 0.95), eps=1e-8, fused=True)
    warm = max(1, args.steps // 20)

    def lr_at(s):
        if s < warm:
            return args.lr * (s + 1) / warm
        p = (s - warm) / max(1, args.steps - warm)
        return args.lr * (0.1 + 0.9 * 0.5 * (1 + np.cos(np.pi * p)))

    it = batches(stream, args.seq, args.batch, rng)
    model.train()
    t0 = time.time()
    tokens = 0
    for step in range(args.steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        x = torch.from_numpy(next(it)).to(dev, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(input_ids=x, labels=x)
        loss = out.loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gn = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        tokens += x.numel()
        if step % args.log_every == 0 or step == args.steps - 1:
            torch.cuda.synchronize()
            el = time.time() - t0
            aux = float(out.aux_loss) if getattr(out, "aux_loss", None) is not None else None
            row = dict(step=step, loss=float(loss), aux_loss=aux, grad_norm=float(gn),
                       lr=lr_at(step), seconds=round(el, 2), tokens=tokens,
                       tok_per_s=round(tokens / max(el, 1e-9)))
            log_rows.append(row)
            log(json.dumps(row))
    torch.cuda.synchronize()
    return time.time() - t0, tokens


# ------------------------------------------------------------------------------------- evaluation

@torch.no_grad()
def window_nll(model, ids, ctx, dev, max_windows=None):
    """moestream perplexity's windows: window w runs ids[w*ctx, (w+1)*ctx) from an empty context
    and scores the ctx next-token predictions (the last one is ids[(w+1)*ctx]); float64
    log-softmax. Returns the per-window NLL sums."""
    windows = (len(ids) - 1) // ctx
    if max_windows:
        windows = min(windows, max_windows)
    out = []
    for w in range(windows):
        x = torch.tensor([ids[w * ctx:(w + 1) * ctx]], device=dev)
        y = torch.tensor(ids[w * ctx + 1:(w + 1) * ctx + 1], device=dev)
        logits = model(input_ids=x).logits[0].double()
        lp = torch.log_softmax(logits, dim=-1)
        out.append(float(-lp[torch.arange(ctx, device=dev), y].sum()))
    return out


@torch.no_grad()
def routing_profile(model, ids, ctx, dev, top_k, n_experts):
    counts = None
    windows = (len(ids) - 1) // ctx
    for w in range(windows):
        x = torch.tensor([ids[w * ctx:(w + 1) * ctx]], device=dev)
        rl = model(input_ids=x, output_router_logits=True).router_logits
        rows = []
        for layer in rl:
            idx = torch.topk(layer.float().reshape(-1, n_experts), top_k, dim=-1).indices
            rows.append(torch.bincount(idx.reshape(-1), minlength=n_experts).cpu().numpy())
        c = np.stack(rows)
        counts = c if counts is None else counts + c
    return counts, windows * ctx


def load_eager(d, dtype=torch.float32):
    """transformers' model from d in float32 with eager attention and experts (the reference)."""
    kw = dict(dtype=dtype, attn_implementation="eager")
    try:
        m = transformers.Qwen3_5MoeForCausalLM.from_pretrained(d, experts_implementation="eager", **kw)
    except (TypeError, ValueError):
        m = transformers.Qwen3_5MoeForCausalLM.from_pretrained(d, **kw)
    nxt.force_torch_kernels(m)
    return m.eval()


def export(model, args, tokdir, ids, vocab, held_ids, dev, timings, out, dry=False, rows=None,
           extra=None):
    # --- export: bf16 HF directory, MLX 4-bit, references
    t = time.time()
    det.unpatch(model)
    model.config.output_router_logits = False
    try:
        model.config._experts_implementation = "eager"
    except Exception as e:  # noqa: BLE001  (a read-only attribute in some versions)
        log("could not set experts implementation:", e)
    model = model.to("cpu").to(torch.float32)
    hf = os.path.join(out, "hf")
    mlx = os.path.join(out, "mlx")
    ref_dir = os.path.join(out, "ref")
    for d in (hf, mlx, ref_dir):
        os.makedirs(d, exist_ok=True)
    torch.set_grad_enabled(False)
    with tempfile.TemporaryDirectory() as tmp:
        spec = dict(name="demo", model_type="qwen3_5_moe_text", layout="mlx", cfg=MODEL, bits=4,
                    group=64, overrides={"mlp.gate": (8, 64), "mlp.shared_expert_gate": (8, 64)},
                    float32=(".A_log",), config_style="v5")
        nxt.write_mlx(spec, model, model.config, mlx, tmp)
        for f in os.listdir(os.path.join(tmp, "hub")):
            shutil.copy(os.path.join(tmp, "hub", f), hf)
        deq_dir = os.path.join(tmp, "dequantized")
        ref = load_eager(deq_dir)
        bf16_ref = load_eager(hf)
        for d in (hf, mlx):
            for f in os.listdir(tokdir):
                shutil.copy(os.path.join(tokdir, f), d)
        with open(os.path.join(mlx, "config.json")) as f:
            mcfg = json.load(f)
        mcfg.pop("output_router_logits", None)
        with open(os.path.join(mlx, "config.json"), "w") as f:
            json.dump(mcfg, f, indent=2, sort_keys=True)
        with open(os.path.join(mlx, "heldout.txt"), "w") as f:
            f.write((extra or {}).get("heldout_text", ""))
        timings["export_s"] = round(time.time() - t, 1)
        if dry:
            a = ref(input_ids=torch.tensor([held_ids[:40]])).logits
            b = bf16_ref(input_ids=torch.tensor([held_ids[:40]])).logits
            nxt.greedy(ref, held_ids[:20], 2)
            window_nll(ref.to(dev), held_ids, 512, dev, max_windows=1)
            routing_profile(ref, held_ids[:600], 512, dev, MODEL["num_experts_per_tok"], MODEL["num_experts"])
            log(f"dry export: logits {tuple(a.shape)}, dequantized vs bf16 max diff {float((a - b).abs().max()):.3e}")
            return

        # Fixture references on the CPU in float32: logits of 72 held-out tokens, greedy 16
        # tokens after the held-out prompt whose greedy path has the widest top-1/top-2 gap.
        t = time.time()
        logit_tokens = held_ids[1000:1072]
        logits = ref(input_ids=torch.tensor([logit_tokens])).logits[0].float().numpy()
        logits_bf16 = bf16_ref(input_ids=torch.tensor([logit_tokens])).logits[0].float().numpy()
        stops = {ids["<|im_end|>"], ids["<|endoftext|>"]}
        best = None
        for k in range(8):
            prompt = held_ids[2000 + 700 * k:2000 + 700 * k + 40]
            gen, gap = nxt.greedy(ref, prompt, 16)
            if stops & set(gen):
                continue
            if best is None or gap > best[2]:
                best = (prompt, gen, gap)
        prompt, gen, gap = best
        gen_bf16, gap_bf16 = nxt.greedy(bf16_ref, prompt, 16)
        timings["ref_cpu_s"] = round(time.time() - t, 1)
        np.save(os.path.join(ref_dir, "ref_logits.npy"), logits.astype(np.float32))
        np.save(os.path.join(ref_dir, "ref_logits_bf16.npy"), logits_bf16.astype(np.float32))

        # Perplexity of heldout.txt (dequantized weights, float32, no TF32) and routing profile.
        t = time.time()
        ref = ref.to(dev)
        nll_deq = window_nll(ref, held_ids, 512, dev)
        counts, routed_tokens = routing_profile(ref, held_ids, 512, dev, MODEL["num_experts_per_tok"],
                                                MODEL["num_experts"])
        bf16_ref = bf16_ref.to(dev)
        nll_bf16 = window_nll(bf16_ref, held_ids, 512, dev)
        timings["ref_gpu_s"] = round(time.time() - t, 1)

    x = extra
    n_params, n_expert, train_tokens = x["n_params"], x["n_expert"], x["train_tokens"]
    root, corpus_hash, train_files, held_files = x["root"], x["corpus_hash"], x["train_files"], x["held_files"]
    t_start, tok, pairs, ppl_full_bf16 = x["t_start"], x["tok"], x["pairs"], x["ppl_full_bf16"]
    n_chat_tokens = x["n_chat_tokens"]
    ppl = lambda n: float(np.exp(sum(n) / (512 * len(n))))  # noqa: E731
    versions = dict(python=platform.python_version(), torch=torch.__version__,
                    transformers=transformers.__version__, tokenizers=tokenizers.__version__,
                    numpy=np.__version__, cuda_device=torch.cuda.get_device_name(0))
    with open(os.path.join(ref_dir, "ref.json"), "w") as f:
        json.dump(dict(generator="tools/train_demo_model.py", versions=versions,
                       model_type="qwen3_5_moe_text", seed=args.seed, n_params=n_params, layout="mlx",
                       reference="transformers (eager, float32, CPU) on the dequantized 4-bit weights",
                       logit_tokens=logit_tokens, prompt_tokens=prompt, greedy_tokens=gen,
                       greedy_min_top2_gap=gap, greedy_tokens_bf16=gen_bf16,
                       greedy_min_top2_gap_bf16=gap_bf16, eos_token_ids=sorted(stops)),
                  f, indent=1)
    parity_tolerances.write(ref_dir, "qwen3_5_moe_text", len(logit_tokens))  # the checks tests/parity_test.cpp makes
    with open(os.path.join(ref_dir, "perplexity.json"), "w") as f:
        json.dump(dict(file="heldout.txt", ctx=512, tokens=len(held_ids), windows=len(nll_deq),
                       ppl_dequantized=ppl(nll_deq), ppl_bf16=ppl(nll_bf16),
                       window_nll_dequantized=nll_deq, window_nll_bf16=nll_bf16,
                       note="window_nll: the NLL sum over the 512 predictions of each window, "
                            "transformers float32 (TF32 off), float64 log-softmax"), f, indent=1)
    with open(os.path.join(mlx, "routing_profile.json"), "w") as f:
        json.dump(dict(text="heldout.txt", tokens=routed_tokens, top_k=MODEL["num_experts_per_tok"],
                       note="counts[layer][expert]: top-k selections by the router over heldout.txt "
                            "in 512-token windows (transformers, dequantized weights)",
                       counts=counts.tolist()), f)
    with open(os.path.join(mlx, "corpus.json"), "w") as f:
        json.dump(dict(source="the Python standard library's .py files", stdlib=root,
                       python=platform.python_version(), license=PY_LICENSE,
                       corpus_sha256=corpus_hash,
                       hash_note="sha256 over sorted files of: path, NUL, sha256(text)",
                       split="held out: sha256(relative path) % 50 == 0",
                       train_files=train_files, heldout_files=held_files,
                       heldout_txt="the first held-out non-test files, cut to %d bytes at a line end"
                       % args.heldout_bytes), f, indent=0)
    timings["total_s"] = round(time.time() - t_start, 1)
    with open(os.path.join(mlx, "train_log.json"), "w") as f:
        json.dump(dict(script="tools/train_demo_model.py", args=vars(args), versions=versions,
                       model=dict(MODEL, vocab_size=vocab), n_params=n_params,
                       n_routed_expert_params=n_expert, train_tokens=train_tokens,
                       train_stream_tokens=int(x["stream"]), chat_pair_tokens=int(n_chat_tokens),
                       instruction_pairs=pairs, timings=timings,
                       ppl_heldout_split_bf16_autocast=ppl_full_bf16,
                       determinism=x["summary"]["determinism"],
                       weights_sha256=x["summary"]["weights_sha256"],
                       weights_sha256_note="sha256 over the trained float32 state dict in name order: "
                                           "name, NUL, tensor bytes (tools/deterministic_experts.py)",
                       ppl_heldout_txt=dict(dequantized=ppl(nll_deq), bf16=ppl(nll_bf16)),
                       deltanet_kernels=nxt.kernel_report(ref), loss_curve=rows), f, indent=1)
    log(f"heldout.txt ppl: dequantized 4-bit {ppl(nll_deq):.4f}, bf16 {ppl(nll_bf16):.4f}; greedy gap "
        f"{gap:.3f}; timings {timings}")
    log("greedy text:", repr(tok.decode(prompt)), "->", repr(tok.decode(gen)))


# ------------------------------------------------------------------------------------------- main

# write_mlx reloads the dequantized checkpoint for its own reference: the eager one here too.
nxt.reload = lambda cls, d: (load_eager(d), [])


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=0,
                    help="training steps; 0: as many as fit --train-seconds at the timed rate")
    ap.add_argument("--train-seconds", type=float, default=300)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--experts-impl", default="deterministic",
                    help="deterministic (torch._grouped_mm, no atomics), deterministic_loop (one "
                         "matmul per expert), or transformers' eager / grouped_mm / batched_mm")
    ap.add_argument("--deterministic", choices=("on", "warn", "off"), default="on",
                    help="torch.use_deterministic_algorithms: on refuses an op with no deterministic "
                         "CUDA kernel, warn only warns")
    ap.add_argument("--log-every", type=int, default=25)
    ap.add_argument("--train-only", action="store_true", help="train and report held-out ppl only")
    ap.add_argument("--heldout-bytes", type=int, default=48000)
    ap.add_argument("--time-impls", action="store_true",
                    help="first time a few training steps with each experts implementation")
    args = ap.parse_args()
    t_start = time.time()
    timings = {}
    os.makedirs(args.out, exist_ok=True)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    determinism = det.set_mode(args.deterministic)
    dev = "cuda"

    root, texts, corpus_hash = read_corpus()
    train_files = sorted(r for r in texts if not held_out(r))
    held_files = sorted(r for r in texts if held_out(r))
    heldout_text = ""
    for r in (r for r in held_files if not is_test(r)):
        if len(heldout_text) >= args.heldout_bytes:
            break
        heldout_text += texts[r] if not heldout_text else "\n" + texts[r]
    heldout_text = heldout_text[:args.heldout_bytes]
    heldout_text = heldout_text[:heldout_text.rfind("\n") + 1]
    pairs = []
    for r in train_files:
        pairs.extend(instruction_pairs(texts[r]))
    timings["corpus_s"] = round(time.time() - t_start, 1)
    log(f"python {platform.python_version()} stdlib {root}: {len(texts)} files "
        f"({sum(map(len, texts.values())) / 1e6:.1f} MB), train {len(train_files)}, held out "
        f"{len(held_files)}, {len(pairs)} instruction pairs, held-out text {len(heldout_text)} chars")

    t = time.time()
    rng = np.random.default_rng(args.seed)
    docs = [texts[r] for r in train_files]
    # BPE merges learnt from a fixed sample of ~12 MB of the training files
    sample, size = [], 0
    for i in np.random.default_rng(args.seed).permutation(len(docs)):
        sample.append(docs[i])
        size += len(docs[i])
        if size > 12_000_000:
            break
    tok = train_tokenizer(sample, args.vocab)
    timings["tokenizer_s"] = round(time.time() - t, 1)
    vocab = tok.get_vocab_size()
    tokdir = os.path.join(args.out, "tokenizer")
    ids = write_tokenizer(tok, tokdir)
    log(f"tokenizer: {vocab} tokens in {timings['tokenizer_s']} s, specials {ids}")

    t = time.time()
    eot = "<|endoftext|>"
    samples = [d + eot for d in docs]
    samples += [chat_text(f, n, s, k) + eot for k, (f, n, s) in enumerate(pairs)]
    order = rng.permutation(len(samples))
    enc = tok.encode_batch([samples[i] for i in order])
    n_chat_tokens = sum(len(enc[j].ids) for j, i in enumerate(order) if i >= len(docs))
    stream = np.fromiter((t_ for e in enc for t_ in e.ids), dtype=np.int64)
    held_ids = tok.encode(heldout_text).ids
    held_full = tok.encode("\n".join(texts[r] for r in held_files)).ids
    timings["encode_s"] = round(time.time() - t, 1)
    log(f"train stream {len(stream)} tokens ({n_chat_tokens} in chat pairs), held-out text "
        f"{len(held_ids)} tokens, whole held-out split {len(held_full)} tokens, "
        f"{len(heldout_text) / len(held_ids):.2f} chars/token")

    rates = {}
    if args.time_impls or args.steps == 0:
        rates = time_impls(stream, vocab, ids, args, dev)
        args.experts_impl = max(rates, key=rates.get)
    if args.steps == 0:
        args.steps = int(args.train_seconds * rates[args.experts_impl] * 0.95 / (args.batch * args.seq))
        log(f"steps: {args.steps} ({args.experts_impl}, {rates[args.experts_impl]:.0f} tok/s, "
            f"{args.train_seconds} s)")
    timings["impl_tok_per_s"] = {k: round(v) for k, v in rates.items()}
    if not args.train_only:
        # The export path on the untrained model first, so that a fault there shows up before
        # the training time is spent.
        t = time.time()
        export(make_model(vocab, ids, "eager"), args, tokdir, ids, vocab, held_ids, dev, timings,
               os.path.join(args.out, "dry"), dry=True)
        shutil.rmtree(os.path.join(args.out, "dry"))
        torch.set_grad_enabled(True)
        log(f"dry export ok in {time.time() - t:.1f} s")
    torch.manual_seed(args.seed)
    model = make_model(vocab, ids, args.experts_impl).to(dev)
    n_params = sum(p.numel() for p in model.parameters())
    n_expert = sum(p.numel() for n, p in model.named_parameters() if ".mlp.experts." in n)
    log(f"model: {n_params / 1e6:.2f} M parameters ({n_expert / 1e6:.2f} M in routed experts), "
        f"experts implementation {args.experts_impl}")
    if args.experts_impl in det.IMPLS:
        # our experts forward against transformers' eager one, before any training time is spent
        determinism["experts_check_rel_diff"] = err = det.check(model, dev)
        log(f"experts forward vs transformers' eager: max relative difference {err:.2e}")
        if not err < 2e-2:
            raise RuntimeError(f"the deterministic experts forward differs from transformers' ({err:.3e})")
        torch.manual_seed(args.seed)
    init_sha = det.weights_sha256(model)
    rows = []
    train_s, train_tokens = train(model, stream, args, dev, rows)
    timings["train_s"] = round(train_s, 1)
    log(f"trained {args.steps} steps, {train_tokens} tokens in {train_s:.1f} s "
        f"({train_tokens / train_s:.0f} tok/s), epochs {train_tokens / len(stream):.2f}")

    model.eval()
    weights_sha = det.weights_sha256(model)
    log(f"trained weights sha256 {weights_sha} (initial {init_sha})")
    model.save_pretrained(os.path.join(args.out, "trained"), safe_serialization=True)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        nll = window_nll(model, held_full, 512, dev, max_windows=400)
    ppl_full_bf16 = float(np.exp(sum(nll) / (512 * len(nll))))
    log(f"held-out split perplexity (bf16 autocast, ctx 512, {len(nll)} windows): {ppl_full_bf16:.4f}")
    summary = dict(seed=args.seed, steps=args.steps, experts_impl=args.experts_impl,
                   determinism=determinism, train_s=train_s, ppl_heldout_split=ppl_full_bf16,
                   final_loss=rows[-1]["loss"], weights_sha256=weights_sha, initial_weights_sha256=init_sha,
                   peak_gb=round(torch.cuda.max_memory_allocated() / 1e9, 2), loss_curve=rows)
    with open(os.path.join(args.out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    if args.train_only:
        return

    rows_ = rows
    export(model, args, tokdir, ids, vocab, held_ids, dev, timings, args.out, rows=rows_,
           extra=dict(n_params=n_params, n_expert=n_expert, train_tokens=train_tokens,
                      stream=len(stream), n_chat_tokens=n_chat_tokens, pairs=len(pairs),
                      ppl_full_bf16=ppl_full_bf16, root=root, corpus_hash=corpus_hash,
                      train_files=train_files, held_files=held_files, t_start=t_start,
                      heldout_text=heldout_text, tok=tok, summary=summary))


if __name__ == "__main__":
    main()
