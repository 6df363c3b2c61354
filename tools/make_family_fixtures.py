#!/usr/bin/env python3
"""Reference fixtures for the MoE families beyond Qwen3-MoE, produced by transformers.

For each family in FAMILIES: a tiny random-weight model built from its transformers config class,
written by save_pretrained (bf16 safetensors in the layout this transformers version saves, which
is the Hub layout), reloaded to prove the files hold the same model, and the same records as
tools/make_fixtures.py: float32 logits (eager attention) of 40 tokens in ref_logits.npy, 24 greedy
tokens in ref.json. Sequences (40 tokens) are longer than every sliding window used here (8), and
long enough to cross from prefill into decode in the tests.

A family whose config this transformers version does not know is reported and skipped; a model
with more than MAX_PARAMS parameters (a misnamed size field falling back to a large default) is an
error.

Run on the GPU machine:  python3 tools/make_family_fixtures.py --out tests/fixtures/families
"""

import argparse
import json
import os
import shutil
import traceback

import numpy as np
import torch
import transformers

import make_fixtures as base
import parity_tolerances

MAX_PARAMS = 3_000_000

FAMILIES = {
    "qwen3_next": dict(
        vocab_size=300, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        shared_expert_intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, partial_rotary_factor=0.25,
        linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=24,
        linear_num_key_heads=2, linear_num_value_heads=4, num_experts=8, num_experts_per_tok=2,
        norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
        layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
        rope_theta=10000.0, tie_word_embeddings=False),
    "qwen3_5_moe_text": dict(
        vocab_size=300, hidden_size=64, moe_intermediate_size=32,
        shared_expert_intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, partial_rotary_factor=0.25,
        linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=24,
        linear_num_key_heads=2, linear_num_value_heads=4, num_experts=8, num_experts_per_tok=2,
        layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
        rope_theta=10000.0, tie_word_embeddings=False),
    "mixtral": dict(
        vocab_size=300, hidden_size=64, intermediate_size=48, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=6,
        num_experts_per_tok=2, sliding_window=8, rope_theta=1000000.0, tie_word_embeddings=False),
    "olmoe": dict(
        vocab_size=300, hidden_size=64, intermediate_size=48, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=4, num_experts=8, num_experts_per_tok=2,
        norm_topk_prob=False, clip_qkv=3.0, rope_theta=10000.0, tie_word_embeddings=False),
    "deepseek_v3": dict(
        vocab_size=300, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1,
        n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2,
        routed_scaling_factor=2.5, kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=8,
        qk_nope_head_dim=16, v_head_dim=16, first_k_dense_replace=1, norm_topk_prob=True,
        rope_interleave=True, max_position_embeddings=4096,
        rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024,
                      "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
        rope_theta=10000.0, tie_word_embeddings=False),
    "gpt_oss": dict(
        vocab_size=300, hidden_size=64, intermediate_size=48, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=8,
        num_experts_per_tok=2, sliding_window=8,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        rope_scaling={"rope_type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096,
                      "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False},
        rope_theta=150000.0, tie_word_embeddings=False),
    "glm4_moe": dict(
        vocab_size=300, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        partial_rotary_factor=0.5, n_shared_experts=1, n_routed_experts=8, num_experts_per_tok=2,
        n_group=1, topk_group=1, routed_scaling_factor=1.5, first_k_dense_replace=1,
        norm_topk_prob=True, use_qk_norm=True, attention_bias=True, rope_theta=10000.0,
        tie_word_embeddings=False),
}


def make_config(model_type, kwargs):
    kwargs = dict(kwargs)
    theta = kwargs.pop("rope_theta")
    scaling = kwargs.pop("rope_scaling", None)
    rope = {"rope_type": "default", "rope_theta": theta}
    if scaling:
        rope = dict(scaling, rope_theta=theta)
    common = dict(rms_norm_eps=1e-6, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    common.setdefault("max_position_embeddings", kwargs.pop("max_position_embeddings", 4096))
    config = transformers.AutoConfig.for_model(model_type, **kwargs, **common,
                                               rope_parameters=rope)
    config._attn_implementation = "eager"
    return config


def make_one(model_type, kwargs, out_root, seed):
    name = f"{model_type}_tiny"
    out_dir = os.path.join(out_root, name)
    shutil.rmtree(out_dir, ignore_errors=True)
    os.makedirs(out_dir)
    config = make_config(model_type, kwargs)
    model = transformers.AutoModelForCausalLM.from_config(config).to(torch.float32).eval()
    n_params = sum(p.numel() for p in model.parameters())
    if n_params > MAX_PARAMS:
        raise RuntimeError(f"{n_params} parameters: a size field was probably not understood")
    base.randomize_(model, seed)

    rng = np.random.default_rng(seed)
    vocab = config.vocab_size
    logit_tokens = rng.integers(0, vocab, base.N_LOGIT_TOKENS).tolist()
    prompt = rng.integers(0, vocab, base.N_PROMPT).tolist()
    with torch.no_grad():
        logits = model(torch.tensor([logit_tokens])).logits[0].float().numpy()
    gen, min_gap = base.greedy(model, prompt, base.N_GREEDY)
    unused = [i for i in range(vocab - 1, -1, -1) if i not in gen]
    config.eos_token_id = unused[0]
    model.generation_config.eos_token_id = [unused[0]]

    model.to(torch.bfloat16).save_pretrained(out_dir)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(
        out_dir, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        again = reloaded(torch.tensor([logit_tokens])).logits[0].float().numpy()
    diff = float(np.abs(again - logits).max())
    # Weights were drawn at bf16 precision, so the bf16 files hold the model exactly; buffers
    # that are not saved (none expected) would show up here.
    assert diff < 1e-4, f"{name}: reloaded model differs by {diff}"

    np.save(os.path.join(out_dir, "ref_logits.npy"), logits.astype(np.float32))
    with open(os.path.join(out_dir, "ref.json"), "w") as f:
        json.dump(dict(generator="tools/make_family_fixtures.py",
                       versions=dict(transformers=transformers.__version__,
                                     torch=torch.__version__, numpy=np.__version__),
                       model_type=model_type, seed=seed, n_params=n_params,
                       logit_tokens=logit_tokens, prompt_tokens=prompt, greedy_tokens=gen,
                       greedy_min_top2_gap=min_gap, eos_token_ids=[unused[0]],
                       files=sorted(os.listdir(out_dir))), f, indent=1)
    parity_tolerances.write(out_dir, model_type, len(logit_tokens))
    print(f"{name}: {n_params} params, logits {logits.shape}, greedy {gen[:6]}..., "
          f"min gap {min_gap:.4f}, reload diff {diff:.1e}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="tests/fixtures/families")
    ap.add_argument("--only", default="")
    args = ap.parse_args()
    torch.set_grad_enabled(False)
    only = set(filter(None, args.only.split(",")))
    failed = []
    for i, (model_type, kwargs) in enumerate(FAMILIES.items()):
        if only and model_type not in only:
            continue
        try:
            make_one(model_type, kwargs, args.out, seed=3000 + i)
        except Exception:
            traceback.print_exc()
            failed.append(model_type)
            shutil.rmtree(os.path.join(args.out, f"{model_type}_tiny"), ignore_errors=True)
    print("failed:", failed or "none")


if __name__ == "__main__":
    main()
