#!/usr/bin/env python3
"""Reference fixtures for moestream's model tests, produced by Hugging Face transformers.

For every shape in SHAPES this script builds a tiny random-weight model with transformers,
writes it in the layout published on the Hub (config.json, generation_config.json, bf16
safetensors with one tensor per expert; one fixture keeps whatever layout this transformers
version's save_pretrained writes, sharded), reloads the written directory with transformers to
prove the files hold the same model, and records:

  ref_logits.npy   float32 [n_tokens, vocab]: logits at every position of `logit_tokens`
  ref.json         the token ids, 24 greedy tokens after `prompt_tokens`, the smallest gap
                   between the best and second-best logit along the greedy path, and the
                   versions of the tools that made it.

Weights are drawn at bf16 precision and the reference runs in float32 with eager attention, so
an exact float32 implementation reading the bf16 files must reproduce the logits to rounding.

Run on the GPU machine (torch and transformers installed):
    python3 tools/make_fixtures.py --out tests/fixtures/models
"""

import argparse
import json
import os
import shutil

import numpy as np
import torch
import transformers
from safetensors.torch import save_file
import parity_tolerances

N_LOGIT_TOKENS = 40
N_PROMPT = 8
N_GREEDY = 24

# Tiny Qwen3-MoE shapes: GQA and MHA, tied and untied, dense layers, norm_topk_prob on/off,
# head_dim independent of hidden/heads, sizes that are not powers of two.
SHAPES = [
    dict(name="qwen3moe_gqa_tied", layout="hub", config_style="v5",
         cfg=dict(vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                  num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
                  tie_word_embeddings=True, decoder_sparse_step=1, mlp_only_layers=[],
                  rope_theta=10000.0)),
    dict(name="qwen3moe_mha_untied_dense", layout="hub", config_style="v4",
         cfg=dict(vocab_size=300, hidden_size=80, intermediate_size=120, moe_intermediate_size=24,
                  num_hidden_layers=3, num_attention_heads=5, num_key_value_heads=5, head_dim=16,
                  num_experts=6, num_experts_per_tok=3, norm_topk_prob=False,
                  tie_word_embeddings=False, decoder_sparse_step=1, mlp_only_layers=[1],
                  attention_bias=True, rope_theta=1000000.0)),
    dict(name="qwen3moe_odd_sparse_step", layout="hub", config_style="v4",
         cfg=dict(vocab_size=333, hidden_size=96, intermediate_size=136, moe_intermediate_size=40,
                  num_hidden_layers=4, num_attention_heads=6, num_key_value_heads=2, head_dim=20,
                  num_experts=12, num_experts_per_tok=4, norm_topk_prob=True,
                  tie_word_embeddings=False, decoder_sparse_step=2, mlp_only_layers=[],
                  rope_theta=500000.0)),
    dict(name="qwen3moe_saved_sharded", layout="save_pretrained", config_style="v5",
         cfg=dict(vocab_size=270, hidden_size=48, intermediate_size=64, moe_intermediate_size=28,
                  num_hidden_layers=2, num_attention_heads=3, num_key_value_heads=1, head_dim=16,
                  num_experts=10, num_experts_per_tok=3, norm_topk_prob=True,
                  tie_word_embeddings=False, decoder_sparse_step=1, mlp_only_layers=[],
                  rope_theta=10000.0)),
]


def make_config(cfg):
    cfg = dict(cfg)
    theta = cfg.pop("rope_theta")
    common = dict(rms_norm_eps=1e-6, max_position_embeddings=4096, bos_token_id=None,
                  eos_token_id=None, pad_token_id=None, use_sliding_window=False)
    try:
        config = transformers.Qwen3MoeConfig(
            **cfg, **common, rope_parameters={"rope_type": "default", "rope_theta": theta})
    except TypeError:
        config = transformers.Qwen3MoeConfig(**cfg, **common, rope_theta=theta)
    config._attn_implementation = "eager"
    return config


def randomize_(model, seed):
    """Weights with O(1) activations, drawn at bf16 precision; decisive routers."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                w = 1.0 + 0.2 * torch.randn(p.shape, generator=gen)
            elif "embed_tokens" in name:
                w = torch.randn(p.shape, generator=gen)
            elif name.endswith(".bias"):
                w = 0.1 * torch.randn(p.shape, generator=gen)
            else:
                fan_in = p.shape[-1]
                scale = 3.0 if name.endswith("mlp.gate.weight") else 1.0
                w = scale * torch.randn(p.shape, generator=gen) / fan_in ** 0.5
            p.copy_(w.to(torch.bfloat16).to(torch.float32))


def hub_state_dict(model, config):
    """The model's tensors under the names published checkpoints use (one tensor per expert).

    transformers 5 keeps experts fused (experts.gate_up_proj [E, 2I, H], experts.down_proj
    [E, H, I]); older versions already use per-expert modules. The reload check in main()
    proves the mapping."""
    out = {}
    inter = config.moe_intermediate_size
    for name, t in model.state_dict().items():
        t = t.detach().to(torch.bfloat16).contiguous()
        if name.endswith("mlp.experts.gate_up_proj"):
            prefix = name[: -len("gate_up_proj")]
            for e in range(t.shape[0]):
                out[f"{prefix}{e}.gate_proj.weight"] = t[e, :inter].clone()
                out[f"{prefix}{e}.up_proj.weight"] = t[e, inter:].clone()
        elif name.endswith("mlp.experts.down_proj"):
            prefix = name[: -len("down_proj")]
            for e in range(t.shape[0]):
                out[f"{prefix}{e}.down_proj.weight"] = t[e].clone()
        else:
            out[name] = t
    if config.tie_word_embeddings:
        out.pop("lm_head.weight", None)
    return out


def to_v4_style(path):
    """Rewrite config.json with the names transformers 4.x wrote (rope_theta, torch_dtype, num_experts)."""
    with open(path) as f:
        c = json.load(f)
    rp = c.pop("rope_parameters", None)
    if rp is not None:
        c["rope_theta"] = rp["rope_theta"]
        c["rope_scaling"] = None
    if "dtype" in c:
        c["torch_dtype"] = c.pop("dtype")
    if "num_local_experts" in c:
        c["num_experts"] = c.pop("num_local_experts")
    with open(path, "w") as f:
        json.dump(c, f, indent=2, sort_keys=True)


@torch.no_grad()
def greedy(model, prompt, n):
    """Greedy continuation by full recomputation; also the smallest top-1/top-2 logit gap."""
    ids = list(prompt)
    min_gap = float("inf")
    for _ in range(n):
        logits = model(torch.tensor([ids])).logits[0, -1]
        top2 = torch.topk(logits, 2).values
        min_gap = min(min_gap, float(top2[0] - top2[1]))
        ids.append(int(torch.argmax(logits)))
    return ids[len(prompt):], min_gap


def make_one(spec, out_root, seed):
    name = spec["name"]
    out_dir = os.path.join(out_root, name)
    shutil.rmtree(out_dir, ignore_errors=True)
    os.makedirs(out_dir)

    config = make_config(spec["cfg"])
    torch.manual_seed(seed)
    model = transformers.Qwen3MoeForCausalLM(config).to(torch.float32).eval()
    randomize_(model, seed)
    if config.tie_word_embeddings:
        model.tie_weights()

    rng = np.random.default_rng(seed)
    vocab = config.vocab_size
    logit_tokens = rng.integers(0, vocab, N_LOGIT_TOKENS).tolist()
    prompt = rng.integers(0, vocab, N_PROMPT).tolist()
    with torch.no_grad():
        logits = model(torch.tensor([logit_tokens])).logits[0].float().numpy()
    gen, min_gap = greedy(model, prompt, N_GREEDY)

    # eos ids that the greedy path never produces, so generation runs the full 24 tokens.
    unused = [i for i in range(vocab - 1, -1, -1) if i not in gen]
    config.eos_token_id = unused[0]
    model.generation_config.eos_token_id = [unused[0], unused[1]]
    model.generation_config.bos_token_id = None
    model.generation_config.pad_token_id = None

    if spec["layout"] == "save_pretrained":
        model.to(torch.bfloat16).save_pretrained(out_dir, max_shard_size="100KB")
        model.to(torch.float32)
    else:
        model.to(torch.bfloat16).save_pretrained(out_dir)
        model.to(torch.float32)
        for f in os.listdir(out_dir):
            if f.endswith(".safetensors") or f.endswith(".safetensors.index.json"):
                os.remove(os.path.join(out_dir, f))
        save_file(hub_state_dict(model, config), os.path.join(out_dir, "model.safetensors"),
                  metadata={"format": "pt"})
    if spec["config_style"] == "v4":
        to_v4_style(os.path.join(out_dir, "config.json"))

    # The written directory must hold exactly this model.
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(
        out_dir, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        again = reloaded(torch.tensor([logit_tokens])).logits[0].float().numpy()
    diff = float(np.abs(again - logits).max())
    assert diff < 1e-5, f"{name}: reloaded model differs from the original by {diff}"

    np.save(os.path.join(out_dir, "ref_logits.npy"), logits.astype(np.float32))
    ref = dict(
        generator="tools/make_fixtures.py",
        versions=dict(transformers=transformers.__version__, torch=torch.__version__,
                      numpy=np.__version__),
        model_type="qwen3_moe", seed=seed, layout=spec["layout"],
        config_style=spec["config_style"],
        logit_tokens=logit_tokens, prompt_tokens=prompt, greedy_tokens=gen,
        greedy_min_top2_gap=min_gap, eos_token_ids=[unused[0], unused[1]],
        files=sorted(os.listdir(out_dir)))
    with open(os.path.join(out_dir, "ref.json"), "w") as f:
        json.dump(ref, f, indent=1)
    # Streaming on these is tests/expert_store_test.cpp's (every budget, policy and I/O mode).
    parity_tolerances.write(out_dir, "qwen3_moe", len(logit_tokens), streaming=False)
    print(f"{name}: logits {logits.shape}, greedy {gen[:6]}..., min gap {min_gap:.4f}, "
          f"reload diff {diff:.2e}, files {ref['files']}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="tests/fixtures/models")
    ap.add_argument("--only", default="", help="comma-separated fixture names")
    args = ap.parse_args()
    torch.set_grad_enabled(False)
    only = set(filter(None, args.only.split(",")))
    for i, spec in enumerate(SHAPES):
        if not only or spec["name"] in only:
            make_one(spec, args.out, seed=1000 + i)


if __name__ == "__main__":
    main()
