"""Fused elementwise steps of the routed experts' backward (launch/moe.py, launch/expert_parallel.py), one kernel
each.

Shape legend: M routed (token, slot) rows on this rank, D model dim, I expert ffn dim, F = 2I (gate, then up).

    slot_grads(dout_MD, w_M, y_MD, out=None) -> (g_MD, dw_M)
        g = dout · w (the gradient of the slot's expert output, rounded to dout's dtype as torch's product is),
        dw = Σ_d dout·y in fp32 (the routing weight's gradient: dL/dw_tk = dL/dout_t · y_tk); `out` (dout itself
        allowed: each row is read before it is written) takes g
    glu_forward(h_MF, glu=SWIGLU) -> a_MI
        the forward's activation, a = glu(gate, up), fp32 inside and rounded once to h's dtype
    swiglu_backward(h_MF, da_MI, glu=SWIGLU) -> (dh_MF, a_MI)
        h = [gate | up], a = silu(gate)·up; with s = sigmoid(gate):
        dgate = da · up · s · (1 + gate (1 − s)),  dup = da · silu(gate);  dh = [dgate | dup]
        fp32 inside, outputs in h's dtype (a is the down projection's input, which its weight gradient needs).
        `glu` another gated activation (`GLU`: gpt-oss's clamped one, Step-3.7's `clamped_swiglu`, Gemma 4's GeGLU
        `GEGLU_TANH`), whose gradient is derived there.
    add_expert_bias_(rows_MN, bias_EN, offs_E) -> rows_MN
        rows += the bias of each row's expert, in place (rows sorted by expert, offs_E the experts' cumulative row
        ends): one pass over the rows, each finding its expert among the offsets, the sum rounded once as torch's
        add rounds it (gpt-oss's expert biases on the grouped GEMMs' outputs)

Why fuse: both are memory-bound over [M, D] and [M, I] rows (M = tokens × top-k: 262,144 rows at 32K tokens and
top-8), and in torch each spends an HBM round trip per op and fp32 temporaries: ~32 bytes an element for the first
(two fp32 copies, their product, its sum, and g) against 6 read and written by one kernel, and ~150 against 12 for
the second. At D = 2048, I = 512 that is ~17 GB and ~20 GB of traffic a layer's backward at 32K tokens, against
3.2 and 1.6 GB. The bias add in torch, without the experts' row counts on the host, gathers a bias row for every row
(an [M, N] tensor) and adds it: 8 bytes an element read and written against 4.

Backends as in kernels/gdn_fused.py: "auto" runs Triton (kernels/expert_grads_triton.py, imported lazily) on
CUDA/ROCm tensors where triton is installed and torch otherwise; the torch versions are the reference, and the ones
the CPU path runs (unchanged arithmetic, so CPU results stay bitwise those of the unfused code).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels.gdn_fused import _pick_backend


@dataclass(frozen=True)
class GLU:
    """The routed experts' gated activation of h = [gate | up] (I channels each):

        a = g · σ(α·g) · (u + c),   g = min(gate, limit),  u = clamp(up, −limit, limit)   (no clamp without a limit)

    SwiGLU (`SWIGLU`: α = 1, c = 0, no limit) is silu(gate)·up; gpt-oss's (`GPT_OSS_GLU`) has α = 1.702, c = 1 and
    limit 7. With s = σ(α·g), glu = g·s and the clamps' gradients passing where their bounds hold (inclusive, as
    torch's clamp passes them):

        ∂a/∂gate = (u + c) · (s + α·glu·(1 − s)) · [gate ≤ limit],   ∂a/∂up = glu · [−limit ≤ up ≤ limit]

    (from dσ(z)/dz = σ(z)(1 − σ(z)); with α = 1, c = 0 the first is up·s·(1 + gate(1 − s)), SwiGLU's).

    `clamp_activated` (a limit needed) moves the gate's clamp after the activation, Step-3.7's placement
    (`clamped_swiglu`; transformers' Step3p7Experts._apply_gate: silu(gate).clamp(max=limit) · up.clamp(±limit)):

        a = min(act, limit) · (u_c + c),   act = gate · σ(α·gate),  u_c = clamp(up, −limit, limit)

    With s = σ(α·gate), ∂act/∂gate = s + α·act·(1 − s), and the clamps passing their gradients inclusively:

        ∂a/∂gate = (u_c + c) · (s + α·act·(1 − s)) · [act ≤ limit],   ∂a/∂up = min(act, limit) · [−limit ≤ up ≤ limit]

    The gate's mask is on a computed value, so it depends on how act rounds at the bound: the torch paths compute
    act with F.silu where α = 1 (bitwise transformers' silu), the Triton kernels as gate·σ(gate) (an ulp apart).

    `gate_act` "gelu_tanh" (`GEGLU_TANH`, Gemma 4's experts and dense MLP; no alpha, limit or offset) is GeGLU with
    the tanh-approximated GELU, torch's F.gelu(approximate="tanh") (transformers' ACT2FN["gelu_pytorch_tanh"]):

        a = gelu(gate) · up,   gelu(g) = ½·g·(1 + t),   t = tanh(v),   v = √(2/π)·(g + β g³),   β = 0.044715

    With dt/dv = 1 − t² and dv/dg = √(2/π)(1 + 3β g²):

        gelu'(g) = ½(1 + t) + ½·g·(1 − t²)·√(2/π)(1 + 3β g²),   ∂a/∂gate = up · gelu'(gate),   ∂a/∂up = gelu(gate)

    As 1 + tanh(v) = 2σ(2v), it is SwiGLU's form with z = 2v in place of α·g: with s = σ(z), gelu(g) = g·s, and as
    1 − t² = 4·σ(z)·σ(−z) (σ(−z) = 1 − s),

        gelu'(g) = s + g·σ(z)·σ(−z)·dz/dg,   z = 2√(2/π)(g + β g³),   dz/dg = 2√(2/π)(1 + 3β g²)

    which both backwards evaluate: in fp32, 1 + t and 1 − t² lose their digits where t nears ∓1 (gelu's tails; the
    tanh form's gradient is off by ~100% at gate −5), σ(z) and σ(−z) keep them. The torch forward is F.gelu
    (bitwise transformers'), and the torch backward's a and ∂a/∂up take it; the Triton kernels (no tanh in Triton)
    take gelu(g) = g·σ(z), an ulp or so from it."""

    alpha: float = 1.0
    limit: float | None = None
    up_offset: float = 0.0
    clamp_activated: bool = False  # the limit clamps the activated gate, not the gate (Step-3.7's form)
    gate_act: str = "silu"  # the gate's activation: "silu" (x·σ(α·x)) or "gelu_tanh" (GeGLU, Gemma 4's)

    def __post_init__(self) -> None:
        if self.gate_act not in GATE_ACTS:
            raise ValueError(f"a GLU's gate_act must be one of {GATE_ACTS}, got {self.gate_act!r}")
        if self.gate_act == "gelu_tanh" and (self.alpha != 1.0 or self.limit is not None or self.up_offset):
            raise ValueError(f"a gelu_tanh GLU (GeGLU) takes no alpha, limit or up_offset, got alpha={self.alpha!r}, "
                             f"limit={self.limit!r}, up_offset={self.up_offset!r}")
        if self.limit is not None and not self.limit > 0:
            raise ValueError(f"a GLU clamp limit must be positive, got {self.limit!r}")
        if self.clamp_activated and self.limit is None:
            raise ValueError("a GLU with clamp_activated needs a limit (the bound of the activated gate)")


GATE_ACTS = ("silu", "gelu_tanh")
SWIGLU = GLU()
GPT_OSS_GLU = GLU(alpha=1.702, limit=7.0, up_offset=1.0)
GEGLU_TANH = GLU(gate_act="gelu_tanh")  # Gemma 4's experts' and dense MLP's: gelu_tanh(gate) · up


def clamped_swiglu(limit: float) -> GLU:
    """Step-3.7-Flash's clamped SwiGLU (its limit varies by layer): a = min(silu(gate), limit) · clamp(up, ±limit),
    transformers' Step3p7Experts._apply_gate."""
    return GLU(alpha=1.0, limit=limit, up_offset=0.0, clamp_activated=True)


def _activated_gate(gate: torch.Tensor, glu: GLU) -> torch.Tensor:
    """gate · σ(α·gate) of a clamp_activated GLU, as its torch forward computes it: F.silu where α = 1 (bitwise
    transformers' silu), else gate · σ(gate·α)."""
    return F.silu(gate) if glu.alpha == 1.0 else gate * torch.sigmoid(gate * glu.alpha)


def glu_forward(h_MF: torch.Tensor, glu: GLU = SWIGLU, backend: str | None = None) -> torch.Tensor:
    """The activation a [M, I] of h = [gate | up] [M, 2I], in h's dtype: one kernel (fp32 inside, rounded once, as
    `swiglu_backward` recomputes it) where Triton runs and no gradient is taken through it; else torch's ops, each
    rounded as torch rounds it (and differentiable)."""
    if not (torch.is_grad_enabled() and h_MF.requires_grad) and _pick_backend(h_MF, backend) != "torch":
        from kernels import expert_grads_triton

        return expert_grads_triton.glu_forward(h_MF, glu)
    return glu_of(*h_MF.chunk(2, dim=-1), glu)


def glu_of(gate: torch.Tensor, up: torch.Tensor, glu: GLU = SWIGLU) -> torch.Tensor:
    """The activation of a gate and an up projection apart (the torch ops, differentiable): the routed experts'
    torch path (`glu_forward`, on the halves of [gate | up]) and a dense gated MLP's (launch/moe.py)."""
    if glu == SWIGLU:
        return F.silu(gate) * up
    if glu.gate_act == "gelu_tanh":  # GeGLU: bitwise transformers' ACT2FN["gelu_pytorch_tanh"](gate) · up
        return F.gelu(gate, approximate="tanh") * up
    if glu.clamp_activated:  # Step-3.7's: min(act, limit) · (clamp(up, ±limit) + c)
        up = up.clamp(min=-glu.limit, max=glu.limit)
        if glu.up_offset:
            up = up + glu.up_offset
        return _activated_gate(gate, glu).clamp(max=glu.limit) * up
    if glu.limit is not None:
        gate, up = gate.clamp(max=glu.limit), up.clamp(min=-glu.limit, max=glu.limit)
    return (up + glu.up_offset) * (gate * torch.sigmoid(gate * glu.alpha))


def slot_grads_torch(dout_MD: torch.Tensor, w_M1: torch.Tensor, y_MD: torch.Tensor):
    return dout_MD * w_M1, (dout_MD.float() * y_MD.float()).sum(-1)


def swiglu_backward_torch(h_MF: torch.Tensor, da_MI: torch.Tensor):
    gate, up = h_MF.float().chunk(2, dim=-1)
    sig = torch.sigmoid(gate)
    silu = gate * sig
    da = da_MI.float()
    dh = torch.cat([da * up * sig * (1 + gate * (1 - sig)), da * silu], dim=-1).to(h_MF.dtype)
    return dh, (silu * up).to(h_MF.dtype)


def glu_backward_torch(h_MF: torch.Tensor, da_MI: torch.Tensor, glu: GLU):
    """`swiglu_backward_torch` of any `GLU` (the derivation is GLU's): (dh [M, 2I], a [M, I]) in h's dtype, fp32
    inside."""
    gate, up = h_MF.float().chunk(2, dim=-1)
    if glu.gate_act == "gelu_tanh":
        return _geglu_backward_torch(gate, up, da_MI.float(), h_MF.dtype)
    g, u = gate, up
    if glu.limit is not None:
        u = up.clamp(min=-glu.limit, max=glu.limit)
        if not glu.clamp_activated:
            g = gate.clamp(max=glu.limit)
    s = torch.sigmoid(glu.alpha * g)
    # clamp_activated: act as the torch forward computes it, so its mask is the forward's clamp's (in fp32)
    act = _activated_gate(gate, glu) if glu.clamp_activated else g * s
    da = da_MI.float()
    u = u + glu.up_offset
    dgate = da * u * (s + glu.alpha * act * (1 - s))
    if glu.clamp_activated:
        dgate = torch.where(act <= glu.limit, dgate, 0.0)
        act = act.clamp(max=glu.limit)
    dup = da * act
    if glu.limit is not None:
        if not glu.clamp_activated:
            dgate = torch.where(gate <= glu.limit, dgate, 0.0)
        dup = torch.where((up >= -glu.limit) & (up <= glu.limit), dup, 0.0)
    return torch.cat([dgate, dup], dim=-1).to(h_MF.dtype), (act * u).to(h_MF.dtype)


_SQRT_2_OVER_PI = 0.7978845608028654  # √(2/π), as torch's gelu tanh kernels spell it
_GELU_BETA = 0.044715


def _geglu_backward_torch(gate: torch.Tensor, up: torch.Tensor, da: torch.Tensor, dtype: torch.dtype):
    """GeGLU's (dh, a) from fp32 gate, up and da (GLU's derivation, its sigmoid form): a as the forward computes it
    (F.gelu)."""
    z = 2 * _SQRT_2_OVER_PI * (gate + _GELU_BETA * gate * gate * gate)
    dz = 2 * _SQRT_2_OVER_PI * (1 + 3 * _GELU_BETA * gate * gate)
    s = torch.sigmoid(z)
    dgelu = s + gate * s * torch.sigmoid(-z) * dz  # ½(1 + t) + ½·g·(1 − t²)·dv/dg, t = tanh(z/2)
    gelu = F.gelu(gate, approximate="tanh")
    return torch.cat([da * up * dgelu, da * gelu], dim=-1).to(dtype), (gelu * up).to(dtype)


def slot_grads(dout_MD: torch.Tensor, w_M1: torch.Tensor, y_MD: torch.Tensor, backend: str | None = None,
               out: torch.Tensor | None = None):
    """(g [M, D] in dout's dtype, dw [M] fp32). dout and w may be column slices of one row buffer (any row
    stride, unit column stride); w is [M, 1]. g goes to `out` when given ([M, D], dout's dtype; dout itself is
    allowed, which saves the [M, D] allocation)."""
    M = dout_MD.shape[0]
    if y_MD.shape != dout_MD.shape or tuple(w_M1.shape) != (M, 1):
        raise ValueError(f"dout {tuple(dout_MD.shape)} and y {tuple(y_MD.shape)} must be one [M, D] shape and w "
                         f"{tuple(w_M1.shape)} [M, 1]")
    if not dout_MD.dtype == w_M1.dtype == y_MD.dtype:
        raise ValueError(f"dout, w and y must share a dtype, got {dout_MD.dtype}, {w_M1.dtype}, {y_MD.dtype}")
    if out is not None and (out.shape != dout_MD.shape or out.dtype != dout_MD.dtype):
        raise ValueError(f"out {tuple(out.shape)} {out.dtype} must be dout's shape and dtype")
    if _pick_backend(dout_MD, backend) == "torch":
        g, dw = slot_grads_torch(dout_MD, w_M1, y_MD)
        return (out.copy_(g) if out is not None else g), dw
    from kernels import expert_grads_triton

    return expert_grads_triton.slot_grads(dout_MD, w_M1, y_MD, out)


def swiglu_backward(h_MF: torch.Tensor, da_MI: torch.Tensor, backend: str | None = None, glu: GLU = SWIGLU):
    """(dh [M, 2I], a [M, I]), both in h's dtype: the backward of the `glu` activation (SwiGLU by default)."""
    if h_MF.shape[-1] != 2 * da_MI.shape[-1] or h_MF.shape[0] != da_MI.shape[0]:
        raise ValueError(f"h {tuple(h_MF.shape)} must be [M, 2I] for da {tuple(da_MI.shape)} [M, I]")
    if _pick_backend(h_MF, backend) == "torch":
        return swiglu_backward_torch(h_MF, da_MI) if glu == SWIGLU else glu_backward_torch(h_MF, da_MI, glu)
    from kernels import expert_grads_triton

    return expert_grads_triton.swiglu_backward(h_MF, da_MI, glu)


def add_expert_bias_torch(rows_MN: torch.Tensor, bias_EN: torch.Tensor, offs_E: torch.Tensor) -> torch.Tensor:
    expert_M = torch.searchsorted(offs_E, torch.arange(rows_MN.shape[0], device=offs_E.device, dtype=offs_E.dtype),
                                  right=True)
    return rows_MN.add_(bias_EN.index_select(0, expert_M))


def add_expert_bias_(rows_MN: torch.Tensor, bias_EN: torch.Tensor, offs_E: torch.Tensor,
                     backend: str | None = None) -> torch.Tensor:
    """rows [M, N] += the bias [E, N] of each row's expert, in place, for rows sorted by expert with offs_E [E]
    (int) the experts' cumulative row ends (the expert of row m: the first end above m); returns rows."""
    if bias_EN.shape[1:] != rows_MN.shape[1:] or offs_E.shape != bias_EN.shape[:1]:
        raise ValueError(f"rows {tuple(rows_MN.shape)}, bias {tuple(bias_EN.shape)} and offsets "
                         f"{tuple(offs_E.shape)} must be [M, N], [E, N] and [E]")
    if bias_EN.dtype != rows_MN.dtype:
        raise ValueError(f"rows and bias must share a dtype, got {rows_MN.dtype} and {bias_EN.dtype}")
    if _pick_backend(rows_MN, backend) == "torch":
        return add_expert_bias_torch(rows_MN, bias_EN, offs_E)
    from kernels import expert_grads_triton

    return expert_grads_triton.add_expert_bias_(rows_MN, bias_EN, offs_E)
