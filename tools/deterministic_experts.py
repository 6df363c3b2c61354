"""Deterministic training for tools/train_demo_model.py: the same seed gives the same weights.

transformers' experts implementations sum the experts' outputs into their tokens with
index_add_, whose CUDA kernel adds with atomics in whatever order the threads arrive, and count
tokens per expert with histc, which torch's deterministic mode refuses on CUDA. The forward here
computes the same thing (the same parameters, the same routed experts, the same SwiGLU) with no
scatter: the (token, slot) rows are sorted by expert with a stable sort, each expert's rows go
through its matrices (torch._grouped_mm, or one matmul per expert), the rows are put back in
(token, slot) order with the inverse permutation, and each token's top-k rows are summed as a
[tokens, k, hidden] reduction, which runs in a fixed order.
"""

import hashlib
import os
import types

import torch
import torch.nn.functional as F

IMPLS = ("deterministic", "deterministic_loop")


def set_mode(mode):
    """mode: 'on' (torch refuses any op without a deterministic CUDA kernel), 'warn' (it warns
    instead) or 'off'. Returns what was set, for the training log."""
    if mode == "off":
        return dict(mode=mode)
    if not os.environ.get("CUBLAS_WORKSPACE_CONFIG"):
        raise RuntimeError("CUBLAS_WORKSPACE_CONFIG must be set before CUDA starts")
    torch.use_deterministic_algorithms(True, warn_only=mode == "warn")
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    return dict(mode=mode, cublas_workspace_config=os.environ["CUBLAS_WORKSPACE_CONFIG"],
                cudnn_deterministic=True, tf32=False)


def _compute_dtype(x):
    dev = x.device.type
    if dev in ("cuda", "cpu") and torch.is_autocast_enabled(dev):
        return torch.get_autocast_dtype(dev)
    return x.dtype


def experts_forward(self, hidden_states, top_k_index, top_k_weights):
    """Qwen3_5MoeExperts.forward (gate_up_proj [E, 2I, H], down_proj [E, H, I]) without atomics."""
    tokens, hidden = hidden_states.shape
    k = top_k_index.shape[-1]
    n_exp = self.gate_up_proj.shape[0]
    dt = _compute_dtype(hidden_states)
    ids = top_k_index.reshape(-1)
    ids_sorted, perm = torch.sort(ids, stable=True)
    inv = torch.argsort(perm)
    # Row r of the (token, slot) order is token r // k; expand + reshape copies, so the backward
    # sums each token's k rows as a reduction, and the gather by perm has no repeated index.
    rows = hidden_states.to(dt).unsqueeze(1).expand(tokens, k, hidden).reshape(tokens * k, hidden)
    x = rows[perm]
    w1 = self.gate_up_proj.to(dt)
    w2 = self.down_proj.to(dt)
    bounds = torch.arange(1, n_exp + 1, device=ids.device, dtype=ids_sorted.dtype)
    ends = torch.searchsorted(ids_sorted, bounds)  # rows of experts 0..e, as a cumulative count
    if self.deterministic_impl == "deterministic" and dt == torch.bfloat16 and hasattr(torch, "_grouped_mm"):
        offs = ends.to(torch.int32)
        gate, up = torch._grouped_mm(x, w1.transpose(-2, -1), offs=offs).chunk(2, dim=-1)
        y = torch._grouped_mm(self.act_fn(gate) * up, w2.transpose(-2, -1), offs=offs)
    else:
        outs, start = [], 0
        for e, end in enumerate(ends.tolist()):
            if end > start:
                gate, up = F.linear(x[start:end], w1[e]).chunk(2, dim=-1)
                outs.append(F.linear(self.act_fn(gate) * up, w2[e]))
            start = end
        y = torch.cat(outs)
    y = y[inv].view(tokens, k, hidden).float() * top_k_weights.float().unsqueeze(-1)
    return y.sum(dim=1).to(hidden_states.dtype)


def experts_modules(model):
    return [m for m in model.modules() if hasattr(m, "gate_up_proj") and hasattr(m, "down_proj")]


def patch(model, impl):
    """Every experts module of model runs experts_forward (impl: one of IMPLS)."""
    mods = experts_modules(model)
    if not mods:
        raise RuntimeError("no experts module with gate_up_proj / down_proj: this transformers differs")
    for m in mods:
        m.deterministic_impl = impl
        m.forward = types.MethodType(experts_forward, m)
    return len(mods)


def unpatch(model):
    for m in experts_modules(model):
        if "forward" in vars(m):
            del m.forward


@torch.no_grad()
def check(model, dev, seed=0):
    """experts_forward against the module's own (transformers') forward on random routing, under
    the training's autocast: the largest difference relative to the largest output."""
    m = experts_modules(model)[0]
    g = torch.Generator(device="cpu").manual_seed(seed)
    tokens, hidden = 512, m.gate_up_proj.shape[-1]
    n_exp = m.gate_up_proj.shape[0]
    k = 4
    x = torch.randn(tokens, hidden, generator=g).to(dev)
    idx = torch.stack([torch.randperm(n_exp, generator=g)[:k] for _ in range(tokens)]).to(dev)
    w = torch.softmax(torch.randn(tokens, k, generator=g), -1).to(dev)
    with torch.autocast(dev, dtype=torch.bfloat16, enabled=dev == "cuda"):
        ours = experts_forward(m, x, idx, w).float()
        theirs = type(m).forward(m, x, idx, w).float()
    return float((ours - theirs).abs().max() / theirs.abs().max())


def weights_sha256(model):
    """SHA-256 over the state dict in name order: each name, NUL, the tensor's float32 bytes."""
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        h.update(name.encode() + b"\0")
        h.update(t.detach().to("cpu", torch.float32).contiguous().numpy().tobytes())
    return h.hexdigest()
