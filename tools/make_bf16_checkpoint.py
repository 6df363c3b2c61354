#!/usr/bin/env python3
"""Writes a random bf16 Qwen3-MoE checkpoint in Hugging Face layout (config.json, sharded
safetensors with an index), for measuring `moestream pack` on checkpoint-sized input.

  tools/make_bf16_checkpoint.py OUT [--layers 4] [--shard-gb 4]

The shape is Qwen3-30B-A3B's (hidden 2048, 128 experts of width 768, 32/4 heads of 128, vocab
151936) with the given number of layers. Values are small normal numbers; one random block is
reused for every tensor, since packing speed does not depend on the values. Standard library and
numpy only; the files are written by make_bench_checkpoint.py's writer.
"""
import argparse
import json
import os

import numpy as np

from make_bench_checkpoint import write_bf16_safetensors

HIDDEN, EXPERTS, TOP_K, EXPERT_W, HEADS, KV_HEADS, HEAD_DIM, VOCAB = 2048, 128, 8, 768, 32, 4, 128, 151936


def tensors(layers):
    yield "model.embed_tokens.weight", (VOCAB, HIDDEN)
    for l in range(layers):
        p = f"model.layers.{l}."
        yield p + "input_layernorm.weight", (HIDDEN,)
        yield p + "post_attention_layernorm.weight", (HIDDEN,)
        yield p + "self_attn.q_proj.weight", (HEADS * HEAD_DIM, HIDDEN)
        yield p + "self_attn.k_proj.weight", (KV_HEADS * HEAD_DIM, HIDDEN)
        yield p + "self_attn.v_proj.weight", (KV_HEADS * HEAD_DIM, HIDDEN)
        yield p + "self_attn.o_proj.weight", (HIDDEN, HEADS * HEAD_DIM)
        yield p + "self_attn.q_norm.weight", (HEAD_DIM,)
        yield p + "self_attn.k_norm.weight", (HEAD_DIM,)
        yield p + "mlp.gate.weight", (EXPERTS, HIDDEN)
        for e in range(EXPERTS):
            q = f"{p}mlp.experts.{e}."
            yield q + "gate_proj.weight", (EXPERT_W, HIDDEN)
            yield q + "up_proj.weight", (EXPERT_W, HIDDEN)
            yield q + "down_proj.weight", (HIDDEN, EXPERT_W)
    yield "model.norm.weight", (HIDDEN,)
    yield "lm_head.weight", (VOCAB, HIDDEN)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--shard-gb", type=float, default=4.0)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    rng = np.random.default_rng(0)
    block = (rng.standard_normal(1 << 25, dtype=np.float32) * 0.02).view(np.uint32) >> 16
    block = block.astype(np.uint16).tobytes()  # 64 MB of bf16 values
    ones = np.full(1 << 16, 0x3F80, dtype=np.uint16).tobytes()  # 1.0: norm weights

    def chunks(name, shape, n):  # the one random block (or ones, for norms) repeated
        src = ones if len(shape) == 1 else block
        while n > 0:
            k = min(n, len(src))
            yield src[:k]
            n -= k

    write_bf16_safetensors(args.out, tensors(args.layers), chunks, args.shard_gb)
    config = {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": HIDDEN,
        "intermediate_size": 6144, "moe_intermediate_size": EXPERT_W, "num_hidden_layers": args.layers,
        "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM,
        "num_experts": EXPERTS, "num_experts_per_tok": TOP_K, "norm_topk_prob": True, "vocab_size": VOCAB,
        "max_position_embeddings": 40960, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
        "tie_word_embeddings": False, "decoder_sparse_step": 1, "mlp_only_layers": [],
        "hidden_act": "silu", "torch_dtype": "bfloat16", "bos_token_id": 151643, "eos_token_id": 151645,
    }
    with open(os.path.join(args.out, "config.json"), "w") as f:
        json.dump(config, f, indent=1)


if __name__ == "__main__":
    main()
