#!/usr/bin/env python3
"""MLX-format and perplexity reference fixtures for moestream, produced with transformers.

1. MLX-quantized tiny Qwen3-MoE checkpoints in the layout mlx-community publishes (mlx-lm's
   naming): experts stacked under mlp.switch_mlp.{gate,up,down}_proj with a leading expert
   dimension, every Linear and the embedding stored as affine group-wise quantized weights
   (.weight uint32, .scales, .biases in bf16), and config.json's "quantization" holding a default
   plus per-module overrides. Quantization follows MLX's affine rule (see mlx_quantize). The
   reference logits and greedy tokens are computed by transformers (float32, eager attention)
   from the *dequantized* weights, so an exact reader of the quantized files must match them.
     qwen3moe_mlx_q4_router8   4-bit g64 everywhere, 8-bit routers (as mlx-community ships)
     qwen3moe_mlx_g32          4-bit, group size 32 for the expert down projections, whose
                               input dimension (96) is not a multiple of 64; 8-bit embedding
2. qwen3moe_ppl: a bf16 tiny Qwen3-MoE with a byte-level BPE tokenizer, a text file, and the
   perplexity transformers computes over non-overlapping windows of ctx+1 tokens (window i =
   tokens[i*ctx, (i+1)*ctx + 1)), scoring the ctx next-token predictions of each window.

Run on the GPU machine:  python3 tools/make_quant_fixtures.py --out tests/fixtures/models
"""

import argparse
import json
import math
import os
import shutil

import numpy as np
import tokenizers
import torch
import transformers
from safetensors.torch import save_file

import make_fixtures as base
import parity_tolerances

PPL_CTX = 64
PPL_CHUNKS = 3


def to_bf16(a):
    return torch.from_numpy(np.ascontiguousarray(a, dtype=np.float32)).to(torch.bfloat16)


def bf16_round(a):
    return to_bf16(a).to(torch.float32).numpy()


def bf16_bits(a):
    """float32 array -> a bf16 tensor (stored as BF16 in safetensors, as mlx-community does)."""
    return to_bf16(a).contiguous()


def mlx_quantize(w, bits, group):
    """MLX's affine quantization of w [..., in] along the last axis.

    Per group: the end point of larger magnitude is kept exact; scale = (max - min) / (2^bits - 1)
    signed so that q = round((w - bias) / scale) is in [0, 2^bits - 1]. Returns packed uint32 words
    (element j of a word in bits [j*bits, (j+1)*bits), little-endian), scales and biases rounded
    to bf16, and the dequantized float32 weight q * scale + bias computed from the rounded values.
    """
    shape = w.shape
    g = w.reshape(-1, shape[-1] // group, group).astype(np.float32)
    n_bins = (1 << bits) - 1
    w_max = g.max(axis=-1, keepdims=True)
    w_min = g.min(axis=-1, keepdims=True)
    mask = np.abs(w_min) > np.abs(w_max)
    scale = np.maximum((w_max - w_min) / n_bins, 1e-7)
    scale = np.where(mask, scale, -scale)
    edge = np.where(mask, w_min, w_max)
    q0 = np.round(edge / scale)
    scale = np.where(q0 != 0, edge / np.where(q0 != 0, q0, 1), scale)
    bias = np.where(q0 == 0, 0.0, edge)
    scale = bf16_round(scale)
    bias = bf16_round(bias)
    q = np.clip(np.round((g - bias) / scale), 0, n_bins).astype(np.uint32)
    deq = (q * scale + bias).astype(np.float32).reshape(shape)
    per_word = 32 // bits
    q = q.reshape(-1, per_word)
    words = np.zeros(q.shape[0], dtype=np.uint32)
    for j in range(per_word):
        words |= q[:, j] << np.uint32(j * bits)
    words = words.reshape(*shape[:-1], shape[-1] * bits // 32)
    sb_shape = (*shape[:-1], shape[-1] // group)
    return words, bf16_bits(scale.reshape(sb_shape)), bf16_bits(bias.reshape(sb_shape)), deq


def mlx_fixture(name, cfg, default_bits, default_group, overrides, out_root, seed):
    """overrides: {module_suffix: (bits, group)} matched against module names (regex-free)."""
    out_dir = os.path.join(out_root, name)
    shutil.rmtree(out_dir, ignore_errors=True)
    os.makedirs(out_dir)
    config = base.make_config(cfg)
    model = transformers.Qwen3MoeForCausalLM(config).to(torch.float32).eval()
    base.randomize_(model, seed)
    hub = {k: v.to(torch.float32).numpy() for k, v in base.hub_state_dict(model, config).items()}
    n_layers, n_exp = config.num_hidden_layers, config.num_experts

    def fmt(module):
        for suffix, bg in overrides.items():
            if module.endswith(suffix):
                return bg
        return default_bits, default_group

    tensors, dequant, quant_cfg = {}, {}, {"group_size": default_group, "bits": default_bits}

    def put_quantized(module, w):
        bits, group = fmt(module)
        words, scales, biases, deq = mlx_quantize(w, bits, group)
        tensors[module + ".weight"] = torch.from_numpy(np.ascontiguousarray(words))
        tensors[module + ".scales"] = scales
        tensors[module + ".biases"] = biases
        if (bits, group) != (default_bits, default_group):
            quant_cfg[module] = {"group_size": group, "bits": bits}
        return deq

    for key, w in hub.items():
        if ".mlp.experts." in key:
            continue
        module = key[: -len(".weight")] if key.endswith(".weight") else key
        if w.ndim == 2 and key.endswith(".weight"):
            dequant[key] = put_quantized(module, w)
        else:
            tensors[key] = bf16_bits(w)
            dequant[key] = w
    for layer in range(n_layers):
        prefix = f"model.layers.{layer}.mlp."
        if f"{prefix}experts.0.gate_proj.weight" not in hub:
            continue
        for proj in ("gate_proj", "up_proj", "down_proj"):
            stacked = np.stack([hub[f"{prefix}experts.{e}.{proj}.weight"] for e in range(n_exp)])
            deq = put_quantized(f"{prefix}switch_mlp.{proj}", stacked)
            for e in range(n_exp):
                dequant[f"{prefix}experts.{e}.{proj}.weight"] = deq[e]

    # The reference model holds exactly the dequantized weights.
    ref = transformers.Qwen3MoeForCausalLM(config).to(torch.float32).eval()
    sd = ref.state_dict()
    with torch.no_grad():
        for key, value in sd.items():
            src = key
            if ".mlp.experts.gate_up_proj" in key:
                prefix = key[: -len("gate_up_proj")]
                value.copy_(torch.from_numpy(np.stack([np.concatenate(
                    [dequant[f"{prefix}{e}.gate_proj.weight"], dequant[f"{prefix}{e}.up_proj.weight"]])
                    for e in range(n_exp)])))
                continue
            if ".mlp.experts.down_proj" in key:
                prefix = key[: -len("down_proj")]
                value.copy_(torch.from_numpy(np.stack(
                    [dequant[f"{prefix}{e}.down_proj.weight"] for e in range(n_exp)])))
                continue
            if src == "lm_head.weight" and config.tie_word_embeddings:
                src = "model.embed_tokens.weight"
            value.copy_(torch.from_numpy(dequant[src]))

    rng = np.random.default_rng(seed)
    logit_tokens = rng.integers(0, config.vocab_size, base.N_LOGIT_TOKENS).tolist()
    prompt = rng.integers(0, config.vocab_size, base.N_PROMPT).tolist()
    with torch.no_grad():
        logits = ref(torch.tensor([logit_tokens])).logits[0].float().numpy()
    gen, min_gap = base.greedy(ref, prompt, base.N_GREEDY)
    unused = [i for i in range(config.vocab_size - 1, -1, -1) if i not in gen]

    save_file(tensors, os.path.join(out_dir, "model.safetensors"), metadata={"format": "mlx"})
    cfg_json = config.to_dict()
    cfg_json["eos_token_id"] = unused[0]
    cfg_json["quantization"] = quant_cfg
    cfg_json["quantization_config"] = quant_cfg
    cfg_json.pop("_attn_implementation_autoset", None)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(cfg_json, f, indent=2, sort_keys=True, default=str)
    np.save(os.path.join(out_dir, "ref_logits.npy"), logits.astype(np.float32))
    with open(os.path.join(out_dir, "ref.json"), "w") as f:
        json.dump(dict(generator="tools/make_quant_fixtures.py",
                       versions=dict(transformers=transformers.__version__, torch=torch.__version__,
                                     numpy=np.__version__),
                       model_type="qwen3_moe", layout="mlx", quantization=quant_cfg, seed=seed,
                       logit_tokens=logit_tokens, prompt_tokens=prompt, greedy_tokens=gen,
                       greedy_min_top2_gap=min_gap, eos_token_ids=[unused[0]],
                       files=sorted(os.listdir(out_dir))), f, indent=1)
    # int8 activations on the fixture whose routing margins allow them (no near-tie flips).
    parity_tolerances.write(out_dir, "qwen3_moe", len(logit_tokens), streaming=False,
                            int8_activations=name == "qwen3moe_mlx_q4_router8")
    print(f"{name}: logits {logits.shape}, greedy {gen[:6]}..., min gap {min_gap:.4f}, "
          f"{len(tensors)} tensors, quantization {quant_cfg}")


def byte_level_tokenizer_json(vocab_size):
    """256 byte tokens (GPT-2 alphabet), no merges, 3 special tokens: every text round-trips."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    alphabet = {b: chr(c) for b, c in zip(bs, cs)}
    vocab = {alphabet[b]: b for b in range(256)}
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    added = [dict(id=256 + i, content=t, single_word=False, lstrip=False, rstrip=False,
                  normalized=False, special=True) for i, t in enumerate(specials)]
    assert vocab_size >= 259
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False,
                  "use_regex": True}
    return {"version": "1.0", "truncation": None, "padding": None, "added_tokens": added,
            "normalizer": {"type": "NFC"}, "pre_tokenizer": byte_level, "post_processor": None,
            "decoder": byte_level,
            "model": {"type": "BPE", "dropout": None, "unk_token": None,
                      "continuing_subword_prefix": "", "end_of_word_suffix": "",
                      "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                      "vocab": vocab, "merges": []}}


PPL_TEXT = (
    "The expert cache holds the weights that the next token is most likely to need. When the "
    "router picks an expert that is not in memory, the engine reads it from the packed file on "
    "disk, and computes with the experts it already has while the read is in flight.\n"
    "Perplexity is the exponential of the mean negative log-likelihood of each token given the "
    "tokens before it; lower is better, and a quantized model is judged by how much it rises.\n"
    "def route(logits, k):\n    probs = softmax(logits)\n    return top_k(probs, k)\n"
    "Numbers: 3.14159 2.71828 1.41421; dates: 2026-11-21; symbols: <>[]{}()#@!?\n"
) * 2


def ppl_fixture(out_root, seed):
    name = "qwen3moe_ppl"
    out_dir = os.path.join(out_root, name)
    shutil.rmtree(out_dir, ignore_errors=True)
    os.makedirs(out_dir)
    cfg = dict(vocab_size=264, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
               num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
               tie_word_embeddings=False, decoder_sparse_step=1, mlp_only_layers=[],
               rope_theta=10000.0)
    config = base.make_config(cfg)
    model = transformers.Qwen3MoeForCausalLM(config).to(torch.float32).eval()
    base.randomize_(model, seed)
    config.eos_token_id = 258
    model.to(torch.bfloat16).save_pretrained(out_dir)
    model.to(torch.float32)
    for f in os.listdir(out_dir):
        if f.endswith(".safetensors") or f.endswith(".index.json"):
            os.remove(os.path.join(out_dir, f))
    save_file(base.hub_state_dict(model, config), os.path.join(out_dir, "model.safetensors"),
               metadata={"format": "pt"})
    with open(os.path.join(out_dir, "tokenizer.json"), "w") as f:
        json.dump(byte_level_tokenizer_json(cfg["vocab_size"]), f, ensure_ascii=False)
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump({"add_bos_token": False, "bos_token": None, "eos_token": "<|im_end|>"}, f)
    with open(os.path.join(out_dir, "text.txt"), "w") as f:
        f.write(PPL_TEXT)

    tok = tokenizers.Tokenizer.from_file(os.path.join(out_dir, "tokenizer.json"))
    ids = tok.encode(PPL_TEXT, add_special_tokens=False).ids
    assert tok.decode(ids) == PPL_TEXT
    n_windows = min(PPL_CHUNKS, (len(ids) - 1) // PPL_CTX)
    nll, count = 0.0, 0
    with torch.no_grad():
        for i in range(n_windows):
            window = ids[i * PPL_CTX:(i + 1) * PPL_CTX + 1]
            logits = model(torch.tensor([window[:-1]])).logits[0].double()
            logp = torch.log_softmax(logits, dim=-1)
            target = torch.tensor(window[1:])
            nll -= float(logp[torch.arange(PPL_CTX), target].sum())
            count += PPL_CTX
    ppl = math.exp(nll / count)
    with open(os.path.join(out_dir, "ref.json"), "w") as f:
        json.dump(dict(generator="tools/make_quant_fixtures.py",
                       versions=dict(transformers=transformers.__version__, torch=torch.__version__,
                                     tokenizers=tokenizers.__version__),
                       model_type="qwen3_moe", layout="hub", seed=seed, text="text.txt",
                       text_tokens=ids, perplexity=dict(ctx=PPL_CTX, chunks=n_windows,
                                                        tokens_scored=count, ppl=ppl),
                       files=sorted(os.listdir(out_dir))), f, indent=1)
    print(f"{name}: {len(ids)} tokens, {n_windows} windows of {PPL_CTX}, ppl {ppl:.6f}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="tests/fixtures/models")
    args = ap.parse_args()
    torch.set_grad_enabled(False)
    common = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
                  tie_word_embeddings=False, decoder_sparse_step=1, mlp_only_layers=[],
                  rope_theta=10000.0)
    mlx_fixture("qwen3moe_mlx_q4_router8", dict(common, vocab_size=256, moe_intermediate_size=64),
                4, 64, {"mlp.gate": (8, 64)}, args.out, seed=2000)
    mlx_fixture("qwen3moe_mlx_g32", dict(common, vocab_size=320, moe_intermediate_size=96),
                4, 64, {"switch_mlp.down_proj": (4, 32), "embed_tokens": (8, 64),
                        "mlp.gate": (8, 64)}, args.out, seed=2001)
    ppl_fixture(args.out, seed=2002)


if __name__ == "__main__":
    main()
