"""Fused elementwise ops of the Gated DeltaNet block: causal depthwise conv + SiLU, and the gated RMSNorm.

Shape legend: T tokens (one packed sequence), C conv channels (2 key dims + value dim), W conv width (taps),
R rows of the norm (tokens x value heads), D channels per row (head_v_dim).

    causal_conv1d_silu(x_TC, weight_CW, positions_T) = silu(pre),
        pre[t, c] = sum_{s < W} weight[c, W-1-s] x[t-s, c] [positions[t] >= s]
    (a tap reaching before its document's first token, or before t = 0, reads zero; documents are packed back to
    back and positions restart at 0 in each one, so [positions[t] >= s] is "row t-s is in t's document").
    gated_rms_norm(x, gate, weight, eps) = weight * (x * rsqrt(mean(x^2) + eps)) * silu(gate), fp32 inside,
        output in x's dtype (with activation="sigmoid", KDA's output norm: sigmoid(gate), the weight in fp32).

Why fuse: both are memory-bound, and the torch versions make one HBM round trip per op (the conv: four shifted,
masked, weighted copies of x; the norm: a dozen fp32 temporaries of [R, D]). One kernel reads each input once and
writes each output once; docs/training.md ("Fused conv and gated norm") counts the bytes. Backward: only x (and
the small weight and positions) is saved for the conv, x and gate for the norm; pre-activations and the norm's
rstd are recomputed (the model runs under full activation recompute, so nothing of [T, C] size is worth keeping).
Weight gradients are fp32 partial sums per program strip, summed in fp32: no atomics, bitwise reproducible.

Backends: "auto" runs the Triton kernels (kernels/gdn_fused_triton.py, imported lazily: the CPU path never
imports triton) on CUDA/ROCm tensors when triton is installed, and the torch reference otherwise; "torch" and
"triton" force one ("triton" on CPU tensors only under TRITON_INTERPRET=1, set before triton is imported).
"""

from __future__ import annotations

import importlib.util
import os

import torch
import torch.nn.functional as F

_HAS_TRITON = importlib.util.find_spec("triton") is not None
BACKENDS = ("auto", "torch", "triton")
MAX_TRITON_WIDTH = 4  # the conv's backward kernel holds one accumulator per tap; wider convs run in torch


def _pick_backend(x: torch.Tensor, backend: str | None) -> str:
    if backend is None:
        backend = "auto"
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        return "triton" if (x.is_cuda and _HAS_TRITON) else "torch"
    if backend == "triton":
        if not _HAS_TRITON:
            raise ValueError("backend='triton' needs triton installed")
        if not x.is_cuda and os.environ.get("TRITON_INTERPRET", "0") != "1":
            raise ValueError("backend='triton' on CPU tensors needs TRITON_INTERPRET=1 set before triton is imported")
    return backend


def _triton():
    from kernels import gdn_fused_triton  # lazy: the CPU path never imports triton

    return gdn_fused_triton


# ------------------------------------------------------------------------------------------- causal conv + SiLU
def causal_conv1d_silu_torch(x_TC: torch.Tensor, weight_CW: torch.Tensor, positions_T: torch.Tensor) -> torch.Tensor:
    """The torch reference (and CPU path): depthwise causal conv as W shifted, masked, weighted passes, then SiLU."""
    width = weight_CW.shape[1]
    out = x_TC * weight_CW[:, width - 1]
    for shift in range(1, min(width, x_TC.shape[0] + 1)):  # a shift past the first row reads only zeros
        shifted = F.pad(x_TC[:-shift], (0, 0, shift, 0))
        valid_T1 = (positions_T >= shift).unsqueeze(1).to(x_TC.dtype)
        out = out + shifted * valid_T1 * weight_CW[:, width - 1 - shift]
    return F.silu(out)


class _CausalConvSiLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_TC, weight_CW, positions_T):
        x_TC, weight_CW, positions_T = x_TC.contiguous(), weight_CW.contiguous(), positions_T.contiguous()
        out_dtype = torch.promote_types(x_TC.dtype, weight_CW.dtype)  # what the torch reference returns
        y_TC = torch.empty(x_TC.shape, dtype=out_dtype, device=x_TC.device)
        _triton().conv_fwd(x_TC, weight_CW, positions_T, y_TC)
        ctx.save_for_backward(x_TC, weight_CW, positions_T)
        return y_TC

    @staticmethod
    def backward(ctx, dy_TC):
        x_TC, weight_CW, positions_T = ctx.saved_tensors
        need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if not (need_dx or need_dw):
            return None, None, None
        dx_TC, dw_CW = _triton().conv_bwd(x_TC, weight_CW, positions_T, dy_TC.contiguous(), need_dx, need_dw)
        if dw_CW is not None:
            dw_CW = dw_CW.to(weight_CW.dtype)
        return dx_TC, dw_CW, None


def causal_conv1d_silu(x_TC: torch.Tensor, weight_CW: torch.Tensor, positions_T: torch.Tensor, *,
                       backend: str | None = "auto") -> torch.Tensor:
    """silu(causal depthwise conv of x_TC [T, C] with weight_CW [C, W]), taps masked at document starts
    (positions_T [T], restarting at 0 per document). Differentiable in x and weight."""
    if x_TC.dim() != 2 or weight_CW.dim() != 2 or weight_CW.shape[0] != x_TC.shape[1]:
        raise ValueError(f"need x [T, C] and weight [C, W]; got {tuple(x_TC.shape)} and {tuple(weight_CW.shape)}")
    if positions_T.shape != x_TC.shape[:1]:
        raise ValueError(f"positions must be [T] = [{x_TC.shape[0]}], got {tuple(positions_T.shape)}")
    if _pick_backend(x_TC, backend) == "torch" or x_TC.numel() == 0 or weight_CW.shape[1] > MAX_TRITON_WIDTH:
        return causal_conv1d_silu_torch(x_TC, weight_CW, positions_T)
    return _CausalConvSiLU.apply(x_TC, weight_CW, positions_T)


# ----------------------------------------------------------------------------------------------- gated RMSNorm
GATES = ("silu", "sigmoid")  # Gated DeltaNet's output gate, KDA's


def gated_rms_norm_torch(x: torch.Tensor, gate: torch.Tensor, weight_D: torch.Tensor, eps: float,
                         activation: str = "silu") -> torch.Tensor:
    """The torch reference (and CPU path). "silu" (Gated DeltaNet's): the normalized x is cast to x's dtype before
    the weight multiplies it (as transformers' Qwen3-Next/Qwen3.5 gated norm does); that product is in the promoted
    dtype of weight and x (rounded to bf16 when both are bf16), then the fp32 SiLU gate, then x's dtype. "sigmoid"
    (KDA's): all in fp32, the weight on the fp32 normalized x, then the sigmoid gate, rounded once to x's dtype."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    if activation == "sigmoid":
        return (x32 * weight_D.float() * torch.sigmoid(gate.float())).to(x.dtype)
    return (weight_D * x32.type_as(x) * F.silu(gate.float())).type_as(x)


class _GatedRMSNorm(torch.autograd.Function):
    """The sigmoid gate runs the kernels' fp32-weight form (offset 0: n·w in fp32), as its reference does."""

    @staticmethod
    def forward(ctx, x_RD, gate_RD, weight_D, eps, sigmoid):
        x_RD, gate_RD, weight_D = x_RD.contiguous(), gate_RD.contiguous(), weight_D.contiguous()
        y_RD = torch.empty_like(x_RD)
        ctx.offset = 0.0 if sigmoid else None
        _triton().norm_fwd(x_RD, gate_RD, weight_D, eps, y_RD, offset=ctx.offset, sigmoid=sigmoid)
        ctx.save_for_backward(x_RD, gate_RD, weight_D)
        ctx.eps, ctx.sigmoid = eps, sigmoid
        return y_RD

    @staticmethod
    def backward(ctx, dy_RD):
        x_RD, gate_RD, weight_D = ctx.saved_tensors
        need_dx, need_dg, need_dw = ctx.needs_input_grad[:3]
        if not (need_dx or need_dg or need_dw):
            return None, None, None, None, None
        dx, dg, dw = _triton().norm_bwd(x_RD, gate_RD, weight_D, ctx.eps, dy_RD.contiguous(), need_dx, need_dg,
                                        need_dw, offset=ctx.offset, sigmoid=ctx.sigmoid)
        if dw is not None:
            dw = dw.to(weight_D.dtype)
        return dx, dg, dw, None, None


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight_D: torch.Tensor, eps: float, *,
                   backend: str | None = "auto", activation: str = "silu") -> torch.Tensor:
    """weight * rmsnorm(x) * act(gate) over the last dim D, act silu (Gated DeltaNet's) or sigmoid (KDA's); x and
    gate [..., D] of one shape, weight [D]. Differentiable in x, gate and weight; output in x's dtype."""
    D = x.shape[-1]
    if gate.shape != x.shape or weight_D.shape != (D,):
        raise ValueError(f"need x and gate of one shape [..., D] and weight [D]; got {tuple(x.shape)}, "
                         f"{tuple(gate.shape)}, {tuple(weight_D.shape)}")
    if activation not in GATES:
        raise ValueError(f"activation must be one of {GATES}, got {activation!r}")
    if _pick_backend(x, backend) == "torch" or x.numel() == 0:
        return gated_rms_norm_torch(x, gate, weight_D, eps, activation)
    y_RD = _GatedRMSNorm.apply(x.reshape(-1, D), gate.reshape(-1, D), weight_D, float(eps), activation == "sigmoid")
    return y_RD.view(x.shape)
