#!/usr/bin/env python3
"""Reference fixtures for quantized checkpoints as they are published: gpt-oss with MXFP4 experts,
DeepSeek-V3 / Kimi-K2 with block-wise FP8 weights.

Each fixture is a tiny random-weight model (built like tools/make_family_fixtures.py) whose
weights are quantized here, in torch, into the exact layout of the published checkpoints:

gpt_oss_mxfp4_tiny
    Experts as `mlp.experts.{gate_up_proj,down_proj}_blocks` uint8 [E, N, K/32, 16] and
    `..._scales` uint8 [E, N, K/32], where N is the output dimension (2I interleaved gate/up
    columns for gate_up_proj, H for down_proj) and K the input dimension. Each block of 32
    input values holds FP4 E2M1 codes, two per byte, element 2j in the low nibble of byte j and
    element 2j+1 in the high nibble; the block's scale byte s is an E8M0 exponent: the value is
    FP4_VALUES[code] * 2**(s - 127) (transformers' integrations/mxfp4.py,
    convert_moe_packed_tensors). Biases, attention, router, norms and embeddings stay bf16.
    config.json carries quantization_config {quant_method: mxfp4, modules_to_not_convert: [...]}
    as in openai/gpt-oss-20b.

deepseek_v3_fp8_tiny
    Every linear weight of the decoder layers (attention, dense MLP, experts, shared experts;
    not the router `mlp.gate.weight`, norms, embeddings or lm_head) as float8_e4m3fn with
    `<name>_scale_inv` float32 [ceil(out/128), ceil(in/128)]; the value is
    fp8 * scale_inv[row/128, col/128]. config.json carries quantization_config
    {quant_method: fp8, fmt: e4m3, activation_scheme: dynamic, weight_block_size: [128, 128]}
    as in deepseek-ai/DeepSeek-V3. hidden_size 192 gives one full and one partial block per row.

The reference is transformers run in float32 (eager attention) on the dequantized weights: the
dequantized tensors are written as float32 safetensors to a scratch directory and loaded with
transformers' from_pretrained, so the mapping of checkpoint names onto modules is transformers'
own. The written fixture is then also loaded directly with transformers' quantizers (mxfp4 with
dequantize=True, fine-grained fp8 with dequantize=True); the difference from the reference is
recorded in ref.json (`direct_load`), and for MXFP4, whose dequantized values are exact in bf16,
a direct load that differs is an error (it would mean the layout written here is wrong).

For FP8 the dequantized weights are not exact in bf16; ref_logits_bf16.npy holds the logits of
the same model with every dequantized weight rounded to bf16 (what a loader that dequantizes to
bf16 computes), ref.json its greedy tokens (greedy_tokens_bf16) and by how much the two
references differ (bf16_rounding_max_rel_diff).

Run on the GPU machine:  python3 tools/make_quantized_family_fixtures.py --out tests/fixtures/families
"""

import os

# The models are tiny and the reference runs on the CPU. Hiding the GPU also makes transformers'
# MXFP4 and FP8 quantizers take their documented CPU fallback (dequantize) on a direct load,
# instead of reaching for GPU kernels that are not installed on a machine without internet.
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")

import argparse  # noqa: E402
import glob
import json
import math
import shutil
import sys
import tempfile
import traceback

import numpy as np
import torch
import transformers
from safetensors.torch import load_file, save_file

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import make_family_fixtures as fam  # noqa: E402
import make_fixtures as base  # noqa: E402
import parity_tolerances  # noqa: E402  parity.json beside ref.json

# E2M1 code -> value; code bit 3 is the sign.
FP4_VALUES = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
              -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]
MX_BLOCK = 32
E8M0_BIAS = 127
FP8_BLOCK = 128

FIXTURES = {
    "gpt_oss_mxfp4": dict(
        model_type="gpt_oss", quant="mxfp4",
        cfg=dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=8,
                 num_experts_per_tok=2, sliding_window=8,
                 layer_types=["sliding_attention", "full_attention", "sliding_attention",
                              "full_attention"],
                 rope_scaling={"rope_type": "yarn", "factor": 32.0,
                               "original_max_position_embeddings": 4096, "beta_fast": 32.0,
                               "beta_slow": 1.0, "truncate": False},
                 rope_theta=150000.0, tie_word_embeddings=False)),
    "deepseek_v3_fp8": dict(
        model_type="deepseek_v3", quant="fp8",
        cfg=dict(vocab_size=300, hidden_size=192, intermediate_size=160, moe_intermediate_size=48,
                 num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
                 n_shared_experts=1, n_routed_experts=8, num_experts_per_tok=2, n_group=4,
                 topk_group=2, routed_scaling_factor=2.5, kv_lora_rank=32, q_lora_rank=48,
                 qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
                 first_k_dense_replace=1, norm_topk_prob=True, rope_interleave=True,
                 max_position_embeddings=4096,
                 rope_scaling={"rope_type": "yarn", "factor": 4.0,
                               "original_max_position_embeddings": 1024, "beta_fast": 32,
                               "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
                 rope_theta=10000.0, tie_word_embeddings=False)),
}

MXFP4_QUANT_CONFIG = {
    "quant_method": "mxfp4",
    "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                               "model.embed_tokens", "lm_head"],
}
FP8_QUANT_CONFIG = {
    "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
    "weight_block_size": [FP8_BLOCK, FP8_BLOCK],
}


# ---------------------------------------------------------------------------------------------
# MXFP4

def mxfp4_quantize(w):
    """w float32 [..., N, K] (K a multiple of 32) -> (blocks uint8 [..., N, K/32, 16],
    scales uint8 [..., N, K/32], dequantized float32 [..., N, K]).

    The scale is the smallest power of two that puts the block's largest magnitude within the
    FP4 range (6), so nothing clips; each value then rounds to the nearest FP4 value."""
    *lead, n, k = w.shape
    if k % MX_BLOCK:
        raise ValueError(f"MXFP4 needs the input dimension to be a multiple of 32, got {k}")
    g = w.reshape(*lead, n, k // MX_BLOCK, MX_BLOCK).to(torch.float32)
    amax = g.abs().amax(dim=-1)
    exp = torch.where(amax > 0, torch.ceil(torch.log2(amax / 6.0)), torch.full_like(amax, -127))
    exp = exp.clamp(-127, 127)
    scaled = g / torch.pow(2.0, exp).unsqueeze(-1)
    mags = torch.tensor(FP4_VALUES[:8], dtype=torch.float32)
    mag_code = (scaled.abs().unsqueeze(-1) - mags).abs().argmin(dim=-1)  # nearest magnitude
    code = mag_code | ((scaled < 0).to(torch.long) << 3)
    code = torch.where(mag_code == 0, torch.zeros_like(code), code)  # +0 rather than -0
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32)
    deq = torch.ldexp(lut[code], exp.to(torch.int32).unsqueeze(-1))
    lo = code[..., 0::2]
    hi = code[..., 1::2]
    blocks = (lo | (hi << 4)).to(torch.uint8)
    scales = (exp.to(torch.int32) + E8M0_BIAS).to(torch.uint8)
    return blocks.contiguous(), scales.contiguous(), deq.reshape(*lead, n, k)


def mxfp4_dequantize(blocks, scales):
    """Independent decode of the stored bytes (checks mxfp4_quantize's packing)."""
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32)
    lo = (blocks & 0x0F).to(torch.long)
    hi = (blocks >> 4).to(torch.long)
    vals = torch.stack([lut[lo], lut[hi]], dim=-1).flatten(-2)  # [..., G, 32]
    vals = torch.ldexp(vals, (scales.to(torch.int32) - E8M0_BIAS).unsqueeze(-1))
    return vals.flatten(-2)


def quantize_mxfp4_checkpoint(tensors):
    """Hub-layout bf16 gpt-oss tensors -> (stored tensors, dequantized float32 tensors, stats)."""
    stored, deq, stats = {}, {}, {}
    for name, t in tensors.items():
        if name.endswith("mlp.experts.gate_up_proj") or name.endswith("mlp.experts.down_proj"):
            # Dense layout [E, K, N] (input rows); MXFP4 stores [E, N, K/32, 16].
            w = t.to(torch.float32).transpose(1, 2).contiguous()
            blocks, scales, d = mxfp4_quantize(w)
            again = mxfp4_dequantize(blocks, scales)
            if not torch.equal(again, d):
                raise RuntimeError(f"{name}: MXFP4 packing does not decode to its own values")
            stored[name + "_blocks"] = blocks
            stored[name + "_scales"] = scales
            deq[name] = d.transpose(1, 2).contiguous()
            if not torch.equal(deq[name].to(torch.bfloat16).to(torch.float32), deq[name]):
                raise RuntimeError(f"{name}: dequantized MXFP4 values are not exact in bf16")
            err = float((deq[name] - t.float()).norm() / t.float().norm())
            stats[name] = round(err, 4)
        else:
            stored[name] = t
            deq[name] = t.to(torch.float32)
    return stored, deq, stats


# ---------------------------------------------------------------------------------------------
# FP8 (block-wise, e4m3)

def fp8_quantize(w):
    """w float32 [N, K] -> (fp8 [N, K], scale_inv float32 [ceil(N/128), ceil(K/128)],
    dequantized float32 [N, K]). scale_inv = amax / 448 per 128x128 block (partial at edges)."""
    n, k = w.shape
    bn, bk = math.ceil(n / FP8_BLOCK), math.ceil(k / FP8_BLOCK)
    fmax = torch.finfo(torch.float8_e4m3fn).max
    scale_inv = torch.empty(bn, bk, dtype=torch.float32)
    q = torch.empty(n, k, dtype=torch.float32)  # fp8 values, converted once at the end
    deq = torch.empty(n, k, dtype=torch.float32)
    for i in range(bn):
        for j in range(bk):
            rs = slice(i * FP8_BLOCK, min(n, (i + 1) * FP8_BLOCK))
            cs = slice(j * FP8_BLOCK, min(k, (j + 1) * FP8_BLOCK))
            blk = w[rs, cs]
            amax = float(blk.abs().max())
            s = amax / fmax if amax > 0 else 1.0
            qb = (blk / s).clamp(-fmax, fmax).to(torch.float8_e4m3fn)
            scale_inv[i, j] = s
            q[rs, cs] = qb.to(torch.float32)
            deq[rs, cs] = qb.to(torch.float32) * scale_inv[i, j]
    return q.to(torch.float8_e4m3fn), scale_inv, deq


def fp8_quantized_name(name):
    if not name.startswith("model.layers.") or not name.endswith(".weight"):
        return False
    if "norm" in name or name.endswith("mlp.gate.weight"):
        return False
    return True


def quantize_fp8_checkpoint(tensors):
    stored, deq, stats = {}, {}, {}
    for name, t in tensors.items():
        if fp8_quantized_name(name) and t.dim() == 2:
            q, s, d = fp8_quantize(t.to(torch.float32))
            stored[name] = q.contiguous()
            stored[name + "_scale_inv"] = s.contiguous()
            deq[name] = d
            stats[name] = round(float((d - t.float()).norm() / t.float().norm()), 4)
        else:
            stored[name] = t
            deq[name] = t.to(torch.float32)
    return stored, deq, stats


# ---------------------------------------------------------------------------------------------

def read_tensors(directory):
    tensors = {}
    for path in sorted(glob.glob(os.path.join(directory, "*.safetensors"))):
        tensors.update(load_file(path))
    return tensors


def write_dir(directory, tensors, config, generation_config, quant_config=None):
    os.makedirs(directory, exist_ok=True)
    config.save_pretrained(directory)
    generation_config.save_pretrained(directory)
    for path in glob.glob(os.path.join(directory, "*.safetensors*")):
        os.remove(path)
    save_file(tensors, os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})
    if quant_config is not None:
        path = os.path.join(directory, "config.json")
        with open(path) as f:
            c = json.load(f)
        c["quantization_config"] = quant_config
        with open(path, "w") as f:
            json.dump(c, f, indent=2, sort_keys=True)


def to_float32_(model):
    """Every floating parameter and buffer in float32 (a dequantizing loader may leave bf16)."""
    for p in model.parameters():
        if p.is_floating_point():
            p.data = p.data.to(device="cpu", dtype=torch.float32)
    for b in model.buffers():
        if b.is_floating_point():
            b.data = b.data.to(device="cpu", dtype=torch.float32)
    return model.cpu().eval()


def load_reference(directory, **kwargs):
    model = transformers.AutoModelForCausalLM.from_pretrained(
        directory, dtype=torch.float32, attn_implementation="eager", **kwargs)
    return to_float32_(model)


def logits_of(model, tokens):
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0].float().cpu().numpy()


def rel_diff(a, b):
    return float(np.abs(a - b).max() / np.abs(b).max())


def direct_load(out_dir, quant, logit_tokens):
    """Load the written fixture with transformers' own quantizer, dequantizing."""
    tries = []
    if quant == "mxfp4":
        tries.append(("Mxfp4Config(dequantize=True)",
                      lambda: dict(quantization_config=transformers.Mxfp4Config(dequantize=True))))
    else:
        tries.append(("FineGrainedFP8Config(dequantize=True)",
                      lambda: dict(quantization_config=transformers.FineGrainedFP8Config(
                          weight_block_size=[FP8_BLOCK, FP8_BLOCK], dequantize=True))))
    tries.append(("from_pretrained without options", lambda: {}))
    errors = []
    for how, kwargs in tries:
        try:
            model = load_reference(out_dir, **kwargs())
            return how, logits_of(model, logit_tokens), errors
        except Exception as e:  # noqa: BLE001 - recorded in ref.json
            errors.append(f"{how}: {type(e).__name__}: {str(e).splitlines()[0][:300]}")
    return None, None, errors


def make_one(name, spec, out_root, seed):
    out_dir = os.path.join(out_root, f"{name}_tiny")
    shutil.rmtree(out_dir, ignore_errors=True)
    config = fam.make_config(spec["model_type"], spec["cfg"])
    model = transformers.AutoModelForCausalLM.from_config(config).to(torch.float32).eval()
    n_params = sum(p.numel() for p in model.parameters())
    if n_params > fam.MAX_PARAMS:
        raise RuntimeError(f"{n_params} parameters: a size field was probably not understood")
    base.randomize_(model, seed)

    with tempfile.TemporaryDirectory() as scratch:
        dense_dir = os.path.join(scratch, "dense")
        model.to(torch.bfloat16).save_pretrained(dense_dir)
        hub = read_tensors(dense_dir)
        if spec["quant"] == "mxfp4":
            stored, deq, stats = quantize_mxfp4_checkpoint(hub)
            quant_config = MXFP4_QUANT_CONFIG
        else:
            stored, deq, stats = quantize_fp8_checkpoint(hub)
            quant_config = FP8_QUANT_CONFIG
        if not stats:
            raise RuntimeError(f"no tensor was quantized; names seen: {sorted(hub)[:8]}...")

        # The reference: transformers on the dequantized weights, stored in float32.
        ref_dir = os.path.join(scratch, "dequantized")
        write_dir(ref_dir, deq, config, model.generation_config)
        reference = load_reference(ref_dir)
        bf16_dir = os.path.join(scratch, "dequantized_bf16")
        write_dir(bf16_dir, {k: v.to(torch.bfloat16) for k, v in deq.items()}, config,
                  model.generation_config)
        reference_bf16 = load_reference(bf16_dir)

    rng = np.random.default_rng(seed)
    vocab = config.vocab_size
    logit_tokens = rng.integers(0, vocab, base.N_LOGIT_TOKENS).tolist()
    prompt = rng.integers(0, vocab, base.N_PROMPT).tolist()
    logits = logits_of(reference, logit_tokens)
    logits_bf16 = logits_of(reference_bf16, logit_tokens)
    gen, min_gap = base.greedy(reference, prompt, base.N_GREEDY)
    gen_bf16, min_gap_bf16 = base.greedy(reference_bf16, prompt, base.N_GREEDY)
    unused = [i for i in range(vocab - 1, -1, -1) if i not in gen and i not in gen_bf16]
    config.eos_token_id = unused[0]
    model.generation_config.eos_token_id = [unused[0]]

    write_dir(out_dir, stored, config, model.generation_config, quant_config)

    how, direct, errors = direct_load(out_dir, spec["quant"], logit_tokens)
    direct_info = dict(loaded_with=how, errors=errors)
    if direct is not None:
        direct_info["max_rel_diff_to_ref"] = rel_diff(direct, logits)
        direct_info["max_rel_diff_to_ref_bf16"] = rel_diff(direct, logits_bf16)
        if spec["quant"] == "mxfp4" and direct_info["max_rel_diff_to_ref"] > 1e-4:
            raise RuntimeError(f"{name}: transformers' MXFP4 load differs from the reference by "
                               f"{direct_info['max_rel_diff_to_ref']:.2e}: layout mismatch")

    np.save(os.path.join(out_dir, "ref_logits.npy"), logits.astype(np.float32))
    if spec["quant"] == "fp8":
        np.save(os.path.join(out_dir, "ref_logits_bf16.npy"), logits_bf16.astype(np.float32))
    ref = dict(
        generator="tools/make_quantized_family_fixtures.py",
        versions=dict(transformers=transformers.__version__, torch=torch.__version__,
                      numpy=np.__version__),
        model_type=spec["model_type"], quantization=quant_config, seed=seed, n_params=n_params,
        reference=("transformers (float32, eager attention) on the dequantized weights, "
                   "loaded from float32 safetensors of the values this fixture stores"),
        reference_bf16=("ref_logits_bf16.npy: the same with every dequantized weight rounded "
                        "to bf16" if spec["quant"] == "fp8" else
                        "not written: dequantized MXFP4 values are exact in bf16"),
        bf16_rounding_max_rel_diff=rel_diff(logits_bf16, logits),
        direct_load=direct_info,
        quantization_rel_rms_error=stats,
        logit_tokens=logit_tokens, prompt_tokens=prompt, greedy_tokens=gen,
        greedy_min_top2_gap=min_gap, eos_token_ids=[unused[0]],
        **(dict(greedy_tokens_bf16=gen_bf16, greedy_min_top2_gap_bf16=min_gap_bf16)
           if spec["quant"] == "fp8" else {}),
        files=sorted(os.listdir(out_dir)) + ["ref.json"])
    with open(os.path.join(out_dir, "ref.json"), "w") as f:
        json.dump(ref, f, indent=1)
    parity_tolerances.write(out_dir, spec["model_type"], len(logit_tokens))
    size = sum(os.path.getsize(os.path.join(out_dir, p)) for p in os.listdir(out_dir))
    print(f"{name}_tiny: {n_params} params, {size / 1e6:.2f} MB, greedy {gen[:6]}..., "
          f"min gap {min_gap:.4f}, bf16 rounding {ref['bf16_rounding_max_rel_diff']:.1e}, "
          f"direct load: {how} {direct_info.get('max_rel_diff_to_ref', 'n/a')} {errors}")
    return ref


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="tests/fixtures/families")
    ap.add_argument("--only", default="")
    args = ap.parse_args()
    torch.set_grad_enabled(False)
    only = set(filter(None, args.only.split(",")))
    done, failed = [], []
    for i, (name, spec) in enumerate(FIXTURES.items()):
        if only and name not in only:
            continue
        try:
            make_one(name, spec, args.out, seed=4000 + i)
            done.append(name)
        except Exception:  # noqa: BLE001 - one failure must not stop the others
            traceback.print_exc()
            failed.append(name)
            shutil.rmtree(os.path.join(args.out, f"{name}_tiny"), ignore_errors=True)
    print("summary: written:", done or "none", "failed:", failed or "none")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
