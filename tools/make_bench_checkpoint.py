#!/usr/bin/env python3
"""Writes the peer benchmark's model: a random-weight Qwen3-MoE checkpoint in the layout
published on the Hugging Face Hub, with the real Qwen3 tokenizer, for scripts/peer-bench.

  tools/make_bench_checkpoint.py OUT [--layers 16] [--seed 0] [--tiny] [--tokenizer DIR]
                                     [--writer transformers|numpy] [--device cpu|cuda] [--shard-gb 4]

The shape is Qwen3-30B-A3B's (hidden 2048, 32 query / 4 KV heads of 128, 128 experts of width
768 of which 8 per token, vocabulary 151936, untied output head) with --layers of its 48 layers
(16: 10.6 B parameters, 21 GB in bf16). --tiny is a small model of the same family for a quick
CPU check (2 layers, hidden 256, 16 experts of width 128, top-4); it keeps the full vocabulary,
since llama.cpp's converter requires every tokenizer id to be below vocab_size.

The default writer builds the model with transformers (Qwen3MoeForCausalLM from a config, its
own random initialization after torch.manual_seed(SEED)) and writes its bf16 tensors one per
expert, the names of the published checkpoints, which every llama.cpp converter reads (recent
transformers keep experts fused in memory and in save_pretrained). --writer numpy draws the
same tensors (normal, sd = initializer_range; norms 1) with numpy's generator from SEED, for
machines without torch; the values differ from the transformers writer's, the layout does not.

The tokenizer files (tokenizer.json, tokenizer_config.json) are copied from --tokenizer, by
default the Qwen3 tokenizer that scripts/setup --test puts in .cache/tokenizer-qwen3.
"""
import argparse
import json
import os
import shutil
import struct
import sys

QWEN3_30B_A3B = dict(hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                     num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                     num_experts=128, num_experts_per_tok=8, vocab_size=151936)
TINY = dict(hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
            num_attention_heads=4, num_key_value_heads=2, head_dim=64,
            num_experts=16, num_experts_per_tok=4, vocab_size=151936)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def config_dict(shape, layers):
    """config.json as Qwen3-30B-A3B's (the names transformers 4.x wrote, which every reader takes)."""
    return dict(shape, architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe",
                num_hidden_layers=layers, norm_topk_prob=True, decoder_sparse_step=1,
                mlp_only_layers=[], tie_word_embeddings=False, hidden_act="silu",
                max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1000000.0,
                rope_scaling=None, attention_bias=False, attention_dropout=0.0,
                use_sliding_window=False, sliding_window=None, initializer_range=0.02,
                bos_token_id=151643, eos_token_id=151645, torch_dtype="bfloat16",
                output_router_logits=False, router_aux_loss_coef=0.001, use_cache=True)


def tensor_shapes(c):
    """(name, shape) of every tensor, in the Hub's naming: one tensor per expert."""
    h, q, kv, e, w = (c["hidden_size"], c["num_attention_heads"] * c["head_dim"],
                      c["num_key_value_heads"] * c["head_dim"], c["num_experts"], c["moe_intermediate_size"])
    yield "model.embed_tokens.weight", (c["vocab_size"], h)
    for l in range(c["num_hidden_layers"]):
        p = f"model.layers.{l}."
        yield p + "input_layernorm.weight", (h,)
        yield p + "post_attention_layernorm.weight", (h,)
        yield p + "self_attn.q_proj.weight", (q, h)
        yield p + "self_attn.k_proj.weight", (kv, h)
        yield p + "self_attn.v_proj.weight", (kv, h)
        yield p + "self_attn.o_proj.weight", (h, q)
        yield p + "self_attn.q_norm.weight", (c["head_dim"],)
        yield p + "self_attn.k_norm.weight", (c["head_dim"],)
        yield p + "mlp.gate.weight", (e, h)
        for x in range(e):
            yield f"{p}mlp.experts.{x}.gate_proj.weight", (w, h)
            yield f"{p}mlp.experts.{x}.up_proj.weight", (w, h)
            yield f"{p}mlp.experts.{x}.down_proj.weight", (h, w)
    yield "model.norm.weight", (h,)
    yield "lm_head.weight", (c["vocab_size"], h)


def numpy_tensors(c, seed):
    """name -> bf16 bytes producer, drawn like transformers' initialization (normal, sd 0.02; norms 1)."""
    import numpy as np
    rng = np.random.default_rng(seed)

    def draw(shape):
        x = (rng.standard_normal(shape, dtype=np.float32) * c["initializer_range"]).view(np.uint32)
        return ((x + 0x7FFF + ((x >> 16) & 1)) >> 16).astype(np.uint16).tobytes()  # round to nearest even

    def make(name, shape):
        if name.endswith("norm.weight"):
            return lambda: np.full(shape, 0x3F80, dtype=np.uint16).tobytes()  # 1.0
        return lambda: draw(shape)
    return {name: make(name, shape) for name, shape in tensor_shapes(c)}


def transformers_tensors(c, seed, device):
    """name -> bf16 bytes producer of a Qwen3MoeForCausalLM built by transformers from SEED."""
    import torch
    import transformers
    cfg = {k: v for k, v in c.items() if k not in ("architectures", "model_type", "torch_dtype")}
    theta = cfg.pop("rope_theta")
    cfg.pop("rope_scaling")
    try:  # transformers 5 names the RoPE settings rope_parameters, 4.x rope_theta
        config = transformers.Qwen3MoeConfig(**cfg, rope_parameters={"rope_type": "default", "rope_theta": theta})
    except TypeError:
        config = transformers.Qwen3MoeConfig(**cfg, rope_theta=theta)
    torch.manual_seed(seed)
    torch.set_default_dtype(torch.bfloat16)  # initialize in bf16: 21 GB for 16 layers, not 42
    with torch.device(device):
        model = transformers.Qwen3MoeForCausalLM(config)
    torch.set_default_dtype(torch.float32)

    def as_bytes(t):
        return lambda: t.detach().to("cpu", torch.bfloat16).contiguous().view(torch.int16).numpy().tobytes()

    w = c["moe_intermediate_size"]
    out = {}
    for name, t in model.state_dict().items():
        if name.endswith("mlp.experts.gate_up_proj"):  # transformers 5: [E, 2I, H], gate rows first
            prefix = name[: -len("gate_up_proj")]
            for x in range(t.shape[0]):
                out[f"{prefix}{x}.gate_proj.weight"] = as_bytes(t[x, :w])
                out[f"{prefix}{x}.up_proj.weight"] = as_bytes(t[x, w:])
        elif name.endswith("mlp.experts.down_proj"):  # [E, H, I]
            prefix = name[: -len("down_proj")]
            for x in range(t.shape[0]):
                out[f"{prefix}{x}.down_proj.weight"] = as_bytes(t[x])
        else:
            out[name] = as_bytes(t)
    return out, transformers.__version__


def write_bf16_safetensors(out_dir, shapes, chunks, shard_gb):
    """bf16 safetensors shards of at most shard_gb each, in the Hub's layout, and their index.
    shapes: (name, shape) in file order; chunks(name, shape, n): the tensor's n bytes, as pieces.
    Returns (bytes, shards). tools/make_bf16_checkpoint.py writes its files with it too."""
    shards, current, size = [], [], 0
    for name, shape in shapes:
        n = 2
        for d in shape:
            n *= d
        if current and size + n > shard_gb * 1e9:
            shards.append(current)
            current, size = [], 0
        current.append((name, shape, n))
        size += n
    shards.append(current)
    weight_map, total = {}, 0
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        header, offset = {"__metadata__": {"format": "pt"}}, 0
        for name, shape, n in shard:
            header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + n]}
            offset += n
            weight_map[name] = fname
        head = json.dumps(header).encode()
        head += b" " * (-len(head) % 8)
        with open(os.path.join(out_dir, fname), "wb") as f:
            f.write(struct.pack("<Q", len(head)) + head)
            for name, shape, n in shard:
                written = 0
                for piece in chunks(name, shape, n):
                    f.write(piece)
                    written += len(piece)
                assert written == n, name
        total += offset
    with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=1)
    return total, len(shards)


def write_shards(out_dir, c, tensors, shard_gb):
    """The model's tensors (name -> bytes producer) as bf16 safetensors shards and their index."""
    shapes = list(tensor_shapes(c))
    names = {n for n, _ in shapes}
    if set(tensors) != names:
        missing, extra = sorted(names - set(tensors))[:3], sorted(set(tensors) - names)[:3]
        sys.exit(f"make_bench_checkpoint: the model's tensors differ from the expected ones "
                 f"(missing {missing}, unexpected {extra})")
    return write_bf16_safetensors(out_dir, shapes, lambda name, shape, n: [tensors[name]()], shard_gb)


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", help="output directory (created; must be empty or absent)")
    ap.add_argument("--layers", type=int, default=None, help="decoder layers (default 16; --tiny: 2)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tiny", action="store_true", help="a small model of the same family, for a CPU check")
    ap.add_argument("--tokenizer", default=os.path.join(here, "..", ".cache", "tokenizer-qwen3"),
                    help="directory with the Qwen3 tokenizer.json and tokenizer_config.json")
    ap.add_argument("--writer", choices=("transformers", "numpy"), default="transformers")
    ap.add_argument("--device", default="cpu",
                    help="where transformers initializes the weights (cuda is faster; other values for the same seed)")
    ap.add_argument("--shard-gb", type=float, default=4.0)
    a = ap.parse_args()
    layers = a.layers if a.layers is not None else (2 if a.tiny else 16)
    if layers < 1:
        sys.exit("make_bench_checkpoint: --layers must be at least 1")
    for f in TOKENIZER_FILES:
        if not os.path.isfile(os.path.join(a.tokenizer, f)):
            sys.exit(f"make_bench_checkpoint: {os.path.join(a.tokenizer, f)} not found "
                     f"(scripts/setup --test fetches the Qwen3 tokenizer; or pass --tokenizer DIR)")
    if os.path.exists(a.out) and os.listdir(a.out):
        sys.exit(f"make_bench_checkpoint: {a.out} exists and is not empty")

    c = config_dict(TINY if a.tiny else QWEN3_30B_A3B, layers)
    made_by = {"writer": a.writer, "seed": a.seed}
    if a.writer == "transformers":
        made_by["device"] = a.device
    if a.writer == "transformers":
        try:
            tensors, version = transformers_tensors(c, a.seed, a.device)
        except ImportError as e:
            sys.exit(f"make_bench_checkpoint: the transformers writer needs torch and transformers ({e}); "
                     f"--writer numpy needs only numpy")
        made_by["transformers"] = version
    else:
        tensors = numpy_tensors(c, a.seed)
    os.makedirs(a.out, exist_ok=True)
    total, n_shards = write_shards(a.out, c, tensors, a.shard_gb)
    with open(os.path.join(a.out, "config.json"), "w") as f:
        json.dump(c, f, indent=1)
    with open(os.path.join(a.out, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": c["bos_token_id"], "eos_token_id": [151645, 151643]}, f, indent=1)
    for f in TOKENIZER_FILES:
        shutil.copy(os.path.join(a.tokenizer, f), os.path.join(a.out, f))
    with open(os.path.join(a.out, "made_by.json"), "w") as f:
        json.dump(dict(made_by, generator="tools/make_bench_checkpoint.py"), f, indent=1)
    print(f"wrote {a.out}: {layers} layers, {c['num_experts']} experts of width {c['moe_intermediate_size']}, "
          f"hidden {c['hidden_size']}, {total / 1e9:.2f} GB of bf16 in {n_shards} shards ({a.writer}, seed {a.seed})")


if __name__ == "__main__":
    main()
