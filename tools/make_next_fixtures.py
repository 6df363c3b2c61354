#!/usr/bin/env python3
"""More Qwen3-Next / Qwen3.5-MoE reference fixtures, produced by transformers.

tools/make_family_fixtures.py makes one 40-token fixture per family. This script adds the shapes
and layouts those leave out, each as tests/fixtures/families/<name>/ with the same records
(config.json, weights, ref_logits.npy: float32 logits of every position of `logit_tokens`,
ref.json: greedy tokens after `prompt_tokens`, by full recomputation, and the smallest top-1/top-2
gap on that path):

  qwen3_next_long        8 layers, 6 linear : 2 full, one dense layer (mlp_only_layers), GQA 3 in
                         the linear layers (6 value heads on 2 key heads) and 4 in the full ones,
                         norm_topk_prob false; 150 logit tokens and a 70-token prompt, so both
                         cross the chunk (64 tokens) of the chunked DeltaNet prefill, then decode.
  qwen3_5_moe_text_long  6 layers, 4 linear : 2 full, GQA 4 in the linear layers (1 key head),
                         140 logit tokens, 66-token prompt.
  qwen3_5_moe_vl         the multimodal checkpoint (Qwen3_5MoeForConditionalGeneration, config in
                         text_config, language model under model.language_model., a tiny vision
                         tower under model.visual.) as save_pretrained writes it, plus mtp.*
                         tensors (as published checkpoints carry) that a reader must ignore.
  qwen3_5_moe_vl_fused   the same model type with the experts as transformers holds them in
                         memory: experts.gate_up_proj [E, 2I, H] (gate rows, then up rows) and
                         experts.down_proj [E, H, I]; transformers loads this layout directly.
  qwen3_next_mlx_q4      an mlx-community-style 4-bit checkpoint in mlx-lm's layout for qwen3_next:
                         experts stacked under mlp.switch_mlp.{gate,up,down}_proj, every Linear
                         and the embedding affine-quantized (4-bit, groups of 64; mlp.gate and
                         mlp.shared_expert_gate at 8 bits, as mlx-lm's quant_predicate does), the
                         zero-centred RMSNorm weights stored as 1 + w (mlx-lm's sanitize), conv1d
                         weights as [channels, kernel, 1], a v4-style config.json with
                         full_attention_interval (mlx-lm reads no layer_types). Reference logits
                         come from transformers running on the *dequantized* weights.
  qwen3_5_moe_mlx_q4     an mlx-community-style 4-bit qwen3_5_moe (multimodal) checkpoint, named as
                         mlx-vlm and mlx-lm (qwen3_5_moe.py) write it: the language model under
                         language_model.model., the head as language_model.lm_head, the vision
                         tower under vision_tower. (bf16, never quantized; the patch conv
                         channels-last), multi-token-prediction weights under language_model.mtp.;
                         experts stacked under mlp.switch_mlp; the same quantization, overrides
                         keyed by the full module path (language_model.model.layers.0.mlp.gate);
                         A_log kept in float32 (mlx-lm's cast_predicate); norms as 1 + w; conv1d
                         [channels, kernel, 1]; config.json as transformers 5 writes it (text_config,
                         layer_types, rope_parameters) plus quantization / quantization_config.

Every fixture is reloaded from the written files by transformers (the reference for MLX is that
reloaded model). The DeltaNet runs transformers' torch implementations (torch_chunk_gated_delta_rule,
chunk size 64) where the optional CUDA packages are absent; ref.json records which were importable. One failing fixture does not stop the others; a summary is printed at the end and
the exit status is non-zero when any failed.

Run on the GPU machine (CPU is used):
    python3 tools/make_next_fixtures.py --out tests/fixtures/families [--only name,name]
"""

import argparse
import json
import os
import shutil
import sys
import tempfile
import traceback

import numpy as np
import torch
import transformers
from safetensors.torch import load_file, save_file

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import make_family_fixtures as fam  # noqa: E402  make_config (rope_parameters, eager attention)
import make_fixtures as base  # noqa: E402  randomize_, greedy
import make_quant_fixtures as quant  # noqa: E402  mlx_quantize, bf16 helpers
import parity_tolerances  # noqa: E402  parity.json beside ref.json

MAX_PARAMS = 1_000_000

QWEN3_NEXT_LONG = dict(
    vocab_size=256, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
    shared_expert_intermediate_size=24, num_hidden_layers=8, num_attention_heads=4,
    num_key_value_heads=1, head_dim=8, partial_rotary_factor=0.5, linear_conv_kernel_dim=4,
    linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2,
    linear_num_value_heads=6, num_experts=6, num_experts_per_tok=2, norm_topk_prob=False,
    decoder_sparse_step=1, mlp_only_layers=[5],
    layer_types=["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3
    + ["full_attention"],
    rope_theta=10000.0, tie_word_embeddings=False)

QWEN3_5_TEXT_LONG = dict(
    vocab_size=200, hidden_size=48, moe_intermediate_size=24, shared_expert_intermediate_size=32,
    num_hidden_layers=6, num_attention_heads=3, num_key_value_heads=1, head_dim=16,
    partial_rotary_factor=0.25, linear_conv_kernel_dim=4, linear_key_head_dim=16,
    linear_value_head_dim=8, linear_num_key_heads=1, linear_num_value_heads=4, num_experts=6,
    num_experts_per_tok=3,
    layer_types=["linear_attention"] * 3 + ["full_attention", "linear_attention",
                                            "full_attention"],
    rope_theta=1000000.0, tie_word_embeddings=False)

QWEN3_5_VL_TEXT = dict(
    vocab_size=160, hidden_size=32, moe_intermediate_size=16, shared_expert_intermediate_size=24,
    num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
    partial_rotary_factor=0.25, linear_conv_kernel_dim=4, linear_key_head_dim=8,
    linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4, num_experts=4,
    num_experts_per_tok=2,
    layer_types=["linear_attention"] * 3 + ["full_attention"],
    rope_theta=10000.0, tie_word_embeddings=False)

QWEN3_5_VL_VISION = dict(
    depth=1, hidden_size=16, intermediate_size=32, num_heads=2, in_channels=3, patch_size=2,
    temporal_patch_size=2, spatial_merge_size=2, num_position_embeddings=16)

# Sizes divisible by 64 wherever MLX quantizes along them (hidden, value_dim, q_dim, expert and
# shared widths), as mlx-lm only quantizes a Linear whose input dimension the group size divides.
QWEN3_NEXT_MLX = dict(
    vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=64,
    shared_expert_intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, partial_rotary_factor=0.25, linear_conv_kernel_dim=4,
    linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2,
    linear_num_value_heads=4, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
    decoder_sparse_step=1, mlp_only_layers=[],
    layer_types=["linear_attention"] * 3 + ["full_attention"],
    rope_theta=10000.0, tie_word_embeddings=False)

# The multimodal Qwen3.5 checkpoint in MLX form: MLX-quantizable widths as above; GQA 2 in the
# linear layers and in the full one.
QWEN3_5_MLX_TEXT = dict(
    vocab_size=256, hidden_size=64, moe_intermediate_size=64, shared_expert_intermediate_size=64,
    num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    partial_rotary_factor=0.25, linear_conv_kernel_dim=4, linear_key_head_dim=16,
    linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, num_experts=8,
    num_experts_per_tok=2,
    layer_types=["linear_attention"] * 3 + ["full_attention"],
    rope_theta=10000000.0, tie_word_embeddings=False)

SPECS = [
    dict(name="qwen3_next_long", model_type="qwen3_next", layout="save_pretrained",
         cfg=QWEN3_NEXT_LONG, n_logits=150, n_prompt=70, n_greedy=12),
    dict(name="qwen3_5_moe_text_long", model_type="qwen3_5_moe_text", layout="save_pretrained",
         cfg=QWEN3_5_TEXT_LONG, n_logits=140, n_prompt=66, n_greedy=12),
    dict(name="qwen3_5_moe_vl", model_type="qwen3_5_moe", layout="save_pretrained",
         cfg=QWEN3_5_VL_TEXT, n_logits=72, n_prompt=20, n_greedy=12),
    dict(name="qwen3_5_moe_vl_fused", model_type="qwen3_5_moe", layout="fused",
         cfg=QWEN3_5_VL_TEXT, n_logits=72, n_prompt=20, n_greedy=12),
    dict(name="qwen3_next_mlx_q4", model_type="qwen3_next", layout="mlx", cfg=QWEN3_NEXT_MLX,
         n_logits=80, n_prompt=68, n_greedy=12, bits=4, group=64,
         overrides={"mlp.gate": (8, 64), "mlp.shared_expert_gate": (8, 64)}),
    dict(name="qwen3_5_moe_mlx_q4", model_type="qwen3_5_moe", layout="mlx", cfg=QWEN3_5_MLX_TEXT,
         n_logits=72, n_prompt=20, n_greedy=12, bits=4, group=64,
         overrides={"mlp.gate": (8, 64), "mlp.shared_expert_gate": (8, 64)},
         mlx_names="language_model", float32=(".A_log",), config_style="v5"),
]

# Norm weights that Qwen3-Next applies as (1 + w); mlx-lm's sanitize stores them as 1 + w.
# (The gated norm of the linear attention, linear_attn.norm, applies w itself.)
ZERO_CENTRED_NORMS = (".input_layernorm.weight", ".post_attention_layernorm.weight",
                      "model.norm.weight", ".q_norm.weight", ".k_norm.weight")


def make_model_config(spec):
    if spec["model_type"] != "qwen3_5_moe":
        return fam.make_config(spec["model_type"], spec["cfg"])
    text = fam.make_config("qwen3_5_moe_text", spec["cfg"])
    vision = dict(QWEN3_5_VL_VISION, out_hidden_size=spec["cfg"]["hidden_size"])
    config = transformers.Qwen3_5MoeConfig(text_config=text, vision_config=vision,
                                           tie_word_embeddings=False)
    config._attn_implementation = "eager"
    return config


def model_class(config):
    if config.model_type == "qwen3_5_moe":
        return transformers.Qwen3_5MoeForConditionalGeneration
    return type(transformers.AutoModelForCausalLM.from_config(config))


def new_model(cls, config):
    try:
        model = cls._from_config(config, attn_implementation="eager")
    except TypeError:
        model = cls(config)
    return model.to(torch.float32).eval()


def torch_kernel(module, fn):
    """transformers' torch implementation `fn` from the module that defines the DeltaNet class
    (or one of its bases), else from qwen3_next's modeling file."""
    names = [c.__module__ for c in type(module).__mro__]
    names.append("transformers.models.qwen3_next.modeling_qwen3_next")
    for name in names:
        src = sys.modules.get(name)
        if src is not None and hasattr(src, fn):
            return getattr(src, fn)
    __import__(names[-1])
    return getattr(sys.modules[names[-1]], fn)


def force_torch_kernels(model):
    """Where the DeltaNet modules keep their kernels as attributes (transformers <= 5.12), point
    them at transformers' torch implementations (chunk 64). Newer versions call module-level
    functions, which are the torch ones unless flash-linear-attention / causal-conv1d are
    installed; kernel_report() records which. Returns the number of modules changed."""
    n = 0
    for module in model.modules():
        if "chunk_gated_delta_rule" not in vars(module):
            continue
        for attr, fn in (("chunk_gated_delta_rule", "torch_chunk_gated_delta_rule"),
                         ("recurrent_gated_delta_rule", "torch_recurrent_gated_delta_rule"),
                         ("causal_conv1d_update", "torch_causal_conv1d_update")):
            if attr in vars(module):
                setattr(module, attr, torch_kernel(module, fn))
        if "causal_conv1d_fn" in vars(module):
            module.causal_conv1d_fn = None
        n += 1
    return n


def kernel_report(model):
    """Which DeltaNet kernels the reference ran: forced attributes, and whether the optional fast
    packages were importable (when neither is, transformers runs its torch functions)."""
    from transformers.utils import import_utils
    report = {"forced_torch_attributes": force_torch_kernels(model)}
    for name in ("is_flash_linear_attention_available", "is_causal_conv1d_available"):
        fn = getattr(import_utils, name, None)
        report[name] = bool(fn()) if fn else None
    return report


def text_config(config):
    """The language model's config: text_config of a multimodal config, else the config."""
    return config.text_config if config.model_type == "qwen3_5_moe" else config


def reload(cls, out_dir):
    model, info = cls.from_pretrained(out_dir, dtype=torch.float32, attn_implementation="eager",
                                      output_loading_info=True)
    missing = list(info.get("missing_keys", []))
    if missing:
        raise RuntimeError(f"{out_dir}: transformers found no tensor for {missing[:8]}")
    force_torch_kernels(model)
    return model.eval(), sorted(info.get("unexpected_keys", []))


def logits_and_greedy(model, spec, vocab, seed):
    rng = np.random.default_rng(seed)
    logit_tokens = rng.integers(0, vocab, spec["n_logits"]).tolist()
    prompt = rng.integers(0, vocab, spec["n_prompt"]).tolist()
    logits = model(input_ids=torch.tensor([logit_tokens])).logits[0].float().numpy()
    gen, min_gap = greedy(model, prompt, spec["n_greedy"])
    return logit_tokens, prompt, logits, gen, min_gap


@torch.no_grad()
def greedy(model, prompt, n):
    """As make_fixtures.greedy (full recomputation, smallest top-1/top-2 gap), with input_ids
    passed by name as the multimodal model's forward needs."""
    ids = list(prompt)
    min_gap = float("inf")
    for _ in range(n):
        logits = model(input_ids=torch.tensor([ids])).logits[0, -1]
        top2 = torch.topk(logits, 2).values
        min_gap = min(min_gap, float(top2[0] - top2[1]))
        ids.append(int(torch.argmax(logits)))
    return ids[len(prompt):], min_gap


def saved_tensors(out_dir):
    """Every tensor of the safetensors files in out_dir (one or sharded)."""
    out = {}
    for f in sorted(os.listdir(out_dir)):
        if f.endswith(".safetensors"):
            out.update(load_file(os.path.join(out_dir, f)))
    return out


def remove_weights(out_dir):
    for f in os.listdir(out_dir):
        if f.endswith(".safetensors") or f.endswith(".safetensors.index.json"):
            os.remove(os.path.join(out_dir, f))


def add_mtp_tensors(out_dir, hidden, seed):
    """Multi-token-prediction weights as published Qwen3.5 checkpoints carry them (transformers
    has no module for them and skips them); a reader must leave them out."""
    gen = torch.Generator().manual_seed(seed)
    path = os.path.join(out_dir, "model.safetensors")
    tensors = load_file(path)
    r = lambda *shape: torch.randn(*shape, generator=gen).to(torch.bfloat16)  # noqa: E731
    tensors["mtp.fc.weight"] = r(hidden, 2 * hidden)
    tensors["mtp.norm.weight"] = r(hidden)
    tensors["mtp.layers.0.mlp.experts.0.gate_proj.weight"] = r(8, hidden)
    tensors["mtp.layers.0.mlp.experts.0.down_proj.weight"] = r(hidden, 8)
    save_file(tensors, path, metadata={"format": "pt"})


def per_expert(tensors, inter):
    """Fused experts (gate_up_proj [E, 2I, H], down_proj [E, H, I]), should this transformers save
    them so, as one tensor per expert under the Hub names."""
    out = {}
    for name, t in tensors.items():
        if name.endswith("mlp.experts.gate_up_proj"):
            prefix = name[: -len("gate_up_proj")]
            for e in range(t.shape[0]):
                out[f"{prefix}{e}.gate_proj.weight"] = t[e, :inter]
                out[f"{prefix}{e}.up_proj.weight"] = t[e, inter:]
        elif name.endswith("mlp.experts.down_proj"):
            prefix = name[: -len("down_proj")]
            for e in range(t.shape[0]):
                out[f"{prefix}{e}.down_proj.weight"] = t[e]
        else:
            out[name] = t
    return out


def to_v4_config(cfg):
    """config.json as transformers 4.x wrote it and mlx-community ships it: rope_theta and
    partial_rotary_factor at the top level, full_attention_interval instead of layer_types."""
    rp = cfg.pop("rope_parameters", None) or {}
    cfg["rope_theta"] = rp.get("rope_theta", cfg.get("rope_theta"))
    cfg["partial_rotary_factor"] = rp.get("partial_rotary_factor",
                                          cfg.get("partial_rotary_factor", 0.25))
    cfg["rope_scaling"] = None
    types = cfg.pop("layer_types", None)
    if types:
        interval = types.index("full_attention") + 1
        expect = ["linear_attention" if (i + 1) % interval else "full_attention"
                  for i in range(len(types))]
        if types != expect:
            raise RuntimeError(f"layer_types {types} is not a full_attention_interval pattern")
        cfg["full_attention_interval"] = interval
    if "dtype" in cfg:
        cfg["torch_dtype"] = cfg.pop("dtype")
    return cfg


def mlx_name(spec, key):
    """The checkpoint name of the Hub tensor `key` in the spec's MLX layout. mlx-lm's qwen3_next
    keeps the Hub names; the multimodal Qwen3.5 checkpoints (mlx-vlm, and mlx-lm's qwen3_5_moe)
    move the language model under language_model. and the vision tower to vision_tower."""
    if spec.get("mlx_names", "hub") == "hub":
        return key
    for hub, mlx in (("model.language_model.", "language_model.model."),
                     ("model.visual.", "vision_tower."), ("lm_head.", "language_model.lm_head.")):
        if key.startswith(hub):
            return mlx + key[len(hub):]
    raise RuntimeError(f"no MLX name for {key}")


def write_mlx(spec, model, config, out_dir, tmp):
    """Writes the MLX checkpoint into out_dir; returns the reference model (transformers on the
    dequantized weights) and the quantization config."""
    hub_dir = os.path.join(tmp, "hub")
    model.to(torch.bfloat16).save_pretrained(hub_dir)
    model.to(torch.float32)
    text = text_config(config)
    hub = per_expert({k: v.to(torch.float32).numpy() for k, v in saved_tensors(hub_dir).items()},
                     text.moe_intermediate_size)
    n_layers, n_exp = text.num_hidden_layers, text.num_experts
    bits, group = spec["bits"], spec["group"]
    layers_prefix = ("model.language_model.layers." if config.model_type == "qwen3_5_moe"
                     else "model.layers.")

    def fmt(module):
        for suffix, bg in spec["overrides"].items():
            if module.endswith(suffix):
                return bg
        return bits, group

    tensors, dequant = {}, {}
    quant_cfg = {"group_size": group, "bits": bits, "mode": "affine"}

    def put_quantized(module, w):
        b, g = fmt(module)
        words, scales, biases, deq = quant.mlx_quantize(w, b, g)
        tensors[module + ".weight"] = torch.from_numpy(np.ascontiguousarray(words))
        tensors[module + ".scales"] = scales
        tensors[module + ".biases"] = biases
        if (b, g) != (bits, group):
            quant_cfg[module] = {"group_size": g, "bits": b}
        return deq

    for key, w in hub.items():
        if ".mlp.experts." in key:
            continue
        name = mlx_name(spec, key)
        if key.startswith("model.visual."):
            # mlx-vlm leaves the vision tower unquantized; its patch conv is channels-last
            # ([out, C, T, H, W] -> [out, T, H, W, C]).
            stored = np.moveaxis(w, 1, -1) if w.ndim == 5 else w
            tensors[name] = quant.bf16_bits(np.ascontiguousarray(stored))
            dequant[key] = w
        elif key.endswith("conv1d.weight"):
            # [channels, 1, kernel] -> mlx-lm's [channels, kernel, 1]; not quantized.
            tensors[name] = quant.bf16_bits(np.ascontiguousarray(np.moveaxis(w, 2, 1)))
            dequant[key] = w
        elif any(key.endswith(s) for s in ZERO_CENTRED_NORMS):
            stored = quant.bf16_round(1.0 + w)  # mlx-lm adds 1 in the checkpoint's bf16
            tensors[name] = quant.bf16_bits(stored)
            dequant[key] = (stored - 1.0).astype(np.float32)
        elif any(key.endswith(s) for s in spec.get("float32", ())):
            tensors[name] = torch.from_numpy(np.ascontiguousarray(w, dtype=np.float32))
            dequant[key] = w
        elif w.ndim == 2 and key.endswith(".weight") and w.shape[-1] % fmt(key[:-7])[1] == 0:
            dequant[key] = put_quantized(name[: -len(".weight")], w)
        else:
            tensors[name] = quant.bf16_bits(w)
            dequant[key] = w
    for layer in range(n_layers):
        prefix = f"{layers_prefix}{layer}.mlp."
        if f"{prefix}experts.0.gate_proj.weight" not in hub:
            continue
        for proj in ("gate_proj", "up_proj", "down_proj"):
            stacked = np.stack([hub[f"{prefix}experts.{e}.{proj}.weight"] for e in range(n_exp)])
            deq = put_quantized(f"{mlx_name(spec, prefix)}switch_mlp.{proj}", stacked)
            for e in range(n_exp):
                dequant[f"{prefix}experts.{e}.{proj}.weight"] = deq[e]
    if set(dequant) != set(hub):
        raise RuntimeError(f"dequantized names differ: {sorted(set(hub) ^ set(dequant))[:8]}")
    if config.model_type == "qwen3_5_moe":
        # Multi-token-prediction weights, where mlx-lm's qwen3_5_moe keeps them (language_model.mtp.);
        # a reader must leave them out.
        gen = torch.Generator().manual_seed(0)
        h = text.hidden_size
        for mtp_name, shape in (("language_model.mtp.fc.weight", (h, 2 * h)),
                                ("language_model.mtp.norm.weight", (h,)),
                                ("language_model.mtp.layers.0.mlp.gate.weight", (n_exp, h))):
            tensors[mtp_name] = torch.randn(*shape, generator=gen).to(torch.bfloat16)

    # The reference: transformers loading the dequantized weights in its own Hub layout.
    deq_dir = os.path.join(tmp, "dequantized")
    shutil.copytree(hub_dir, deq_dir)
    remove_weights(deq_dir)
    save_file({k: torch.from_numpy(np.ascontiguousarray(v, dtype=np.float32))
               for k, v in dequant.items()},
              os.path.join(deq_dir, "model.safetensors"), metadata={"format": "pt"})
    ref, _ = reload(type(model), deq_dir)

    save_file(tensors, os.path.join(out_dir, "model.safetensors"), metadata={"format": "mlx"})
    with open(os.path.join(hub_dir, "config.json")) as f:
        cfg_json = json.load(f)
    if spec.get("config_style", "v4") == "v4":
        cfg_json = to_v4_config(cfg_json)
    cfg_json["quantization"] = quant_cfg
    cfg_json["quantization_config"] = quant_cfg
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(cfg_json, f, indent=2, sort_keys=True)
    return ref, quant_cfg


def make_one(spec, out_root, seed):
    name = spec["name"]
    out_dir = os.path.join(out_root, name)
    shutil.rmtree(out_dir, ignore_errors=True)
    os.makedirs(out_dir)
    config = make_model_config(spec)
    cls = model_class(config)
    model = new_model(cls, config)
    kernels = kernel_report(model)
    n_params = sum(p.numel() for p in model.parameters())
    if n_params > MAX_PARAMS:
        raise RuntimeError(f"{n_params} parameters: a size field was probably not understood")
    base.randomize_(model, seed)
    text = text_config(config)
    vocab = text.vocab_size
    extra = {}

    with tempfile.TemporaryDirectory() as tmp:
        if spec["layout"] == "mlx":
            ref, quant_cfg = write_mlx(spec, model, config, out_dir, tmp)
            extra = dict(layout="mlx", quantization=quant_cfg)
            logit_tokens, prompt, logits, gen, min_gap = logits_and_greedy(ref, spec, vocab, seed)
            unused = [i for i in range(vocab - 1, -1, -1) if i not in gen]
            path = os.path.join(out_dir, "config.json")
            with open(path) as f:
                cfg_json = json.load(f)
            cfg_json["eos_token_id"] = unused[0]
            if "text_config" in cfg_json:
                cfg_json["text_config"]["eos_token_id"] = unused[0]
            with open(path, "w") as f:
                json.dump(cfg_json, f, indent=2, sort_keys=True)
            diff = 0.0
        else:
            logit_tokens, prompt, logits, gen, min_gap = logits_and_greedy(model, spec, vocab,
                                                                            seed)
            unused = [i for i in range(vocab - 1, -1, -1) if i not in gen]
            text.eos_token_id = unused[0]
            model.generation_config.eos_token_id = [unused[0]]
            model.generation_config.bos_token_id = None
            model.generation_config.pad_token_id = None
            model.to(torch.bfloat16).save_pretrained(out_dir)
            model.to(torch.float32)
            if spec["layout"] == "fused":
                # The experts as transformers holds them: experts.gate_up_proj / down_proj.
                remove_weights(out_dir)
                state = {k: v.detach().to(torch.bfloat16).contiguous()
                         for k, v in model.state_dict().items()}
                if not any(k.endswith("mlp.experts.gate_up_proj") for k in state):
                    raise RuntimeError("this transformers keeps no fused experts.gate_up_proj")
                save_file(state, os.path.join(out_dir, "model.safetensors"),
                          metadata={"format": "pt"})
            layout = sorted({("fused" if k.endswith(("experts.gate_up_proj", "experts.down_proj"))
                              else "per_expert")
                             for k in saved_tensors(out_dir) if ".mlp.experts." in k})
            again_model, unexpected = reload(cls, out_dir)
            again = again_model(input_ids=torch.tensor([logit_tokens])).logits[0].float().numpy()
            diff = float(np.abs(again - logits).max())
            # Weights were drawn at bf16 precision, so the bf16 files hold the model exactly.
            if not diff < 1e-4:
                raise RuntimeError(f"{name}: reloaded model differs by {diff}")
            if unexpected:
                raise RuntimeError(f"{name}: transformers did not use {unexpected[:8]}")
            if config.model_type == "qwen3_5_moe":
                add_mtp_tensors(out_dir, text.hidden_size, seed)
            extra = dict(layout=spec["layout"], expert_layout=layout)

    np.save(os.path.join(out_dir, "ref_logits.npy"), logits.astype(np.float32))
    with open(os.path.join(out_dir, "ref.json"), "w") as f:
        json.dump(dict(generator="tools/make_next_fixtures.py",
                       versions=dict(transformers=transformers.__version__,
                                     torch=torch.__version__, numpy=np.__version__),
                       model_type=config.model_type, seed=seed, n_params=n_params,
                       deltanet_kernels=kernels, **extra, logit_tokens=logit_tokens, prompt_tokens=prompt,
                       greedy_tokens=gen, greedy_min_top2_gap=min_gap,
                       eos_token_ids=[unused[0]], files=sorted(os.listdir(out_dir))),
                  f, indent=1)
    parity_tolerances.write(out_dir, text_config(config).model_type, len(logit_tokens))
    size = sum(os.path.getsize(os.path.join(out_dir, f)) for f in os.listdir(out_dir))
    return (f"{n_params} params, logits {logits.shape}, greedy {gen[:6]}..., "
            f"min gap {min_gap:.4f}, reload diff {diff:.1e}, {size / 1e3:.0f} kB, {extra}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="tests/fixtures/families")
    ap.add_argument("--only", default="", help="comma-separated fixture names")
    args = ap.parse_args()
    torch.set_grad_enabled(False)
    only = set(filter(None, args.only.split(",")))
    results = []
    for i, spec in enumerate(SPECS):
        if only and spec["name"] not in only:
            continue
        try:
            results.append((spec["name"], "ok", make_one(spec, args.out, seed=4000 + i)))
        except Exception as e:  # one failing fixture must not stop the others
            traceback.print_exc()
            results.append((spec["name"], "FAILED", f"{type(e).__name__}: {e}"))
            shutil.rmtree(os.path.join(args.out, spec["name"]), ignore_errors=True)
        print(f"{results[-1][0]}: {results[-1][1]}: {results[-1][2]}", flush=True)
    print("\nsummary (transformers %s, torch %s):" % (transformers.__version__, torch.__version__))
    for name, status, msg in results:
        print(f"  {status:6s} {name}: {msg}")
    failed = [name for name, status, _ in results if status != "ok"]
    print("failed:", failed or "none")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
