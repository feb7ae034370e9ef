"""RMSNorm over the last dimension, fp32 inside: the decoder layers' input norms, the per-head q/k norms and the
norms over a whole projection (OLMoE, MiniMax-M2), in the two orders the model families use:

    offset = 0 (Qwen3-MoE, OLMoE, DeepSeek, ...):   y = w ⊙ round(n)                 in promote(w, x)'s dtype
    offset ≠ 0 (Qwen3.5, Qwen3-Next: 1 + w):       y = round(n ⊙ (offset + w))      in x's dtype
    n = x · r,  r = 1 / sqrt(mean(x²) + eps)       (fp32; round = to x's dtype)

Backward, with n recomputed from the saved x and r (from ∂n_i/∂x_j = r·(δ_ij − n_i n_j / d)):

    dn = dy ⊙ (offset + w)  or  dy ⊙ w;   dw = Σ_rows dy ⊙ n;   dx = r · (dn − n · mean(dn ⊙ n))

Only x (and r, or nothing on the fused path) is kept for the backward: autograd's graph of the same forward keeps an
fp32 copy of x and the fp32 n, 8 bytes an element (10 with the offset's), over a GB a norm at 128K tokens.

Why fuse: the norm is memory-bound and the torch ops make a dozen HBM round trips of fp32 temporaries ([rows, D]
each: the cast, the square, the mean, the products, the cast back; the backward twice that). On CUDA/ROCm the
Triton kernels (kernels/gdn_fused_triton.py, the same kernels as the gated norm without the gate) read x once and
write y once, and the backward reads x and dy and writes dx, recomputing r: per element 4 bytes forward and 6
backward in bf16, against ~34 and ~50 through the torch ops. A norm whose row is split across tensor-parallel ranks
(`sum_over_ranks`: OLMoE's and MiniMax-M2's q/k norms under TP, whose sums of squares are added over the ranks) runs
the torch path, which takes that callable.

Backends as in kernels/gdn_fused.py: "auto" runs Triton on CUDA/ROCm tensors when triton is installed and the torch
path otherwise; "torch" and "triton" force one ("triton" on CPU tensors only under TRITON_INTERPRET=1).
"""

from __future__ import annotations

import torch

from kernels.gdn_fused import _pick_backend, _triton

MAX_TRITON_WIDTH = 16384  # rows wider than this run the torch path (one program holds a whole row)


def _row_mean(t: torch.Tensor, sum_over_ranks, width: int | None) -> torch.Tensor:
    """The mean of each row of `t` over its last dimension; given `width`, over that many channels of which `t` holds
    this rank's, its sum added over the ranks by `sum_over_ranks` (None: every channel is here)."""
    if width is None:
        return t.mean(-1, keepdim=True)
    total = t.sum(-1, keepdim=True)
    return (total if sum_over_ranks is None else sum_over_ranks(total)) / width


class _RMSNormTorch(torch.autograd.Function):
    """The torch path: keeps x and r. `sum_over_ranks` (a norm over a width split across tensor-parallel ranks):
    x holds `width / tp` of a row's channels, so the row's sum of squares in the forward and Σ dn ⊙ n in the
    backward are each this rank's sum added over the ranks (the callable), and the means divide by the whole
    `width`. Each quantity is computed in the precision transformers' modules compute it in."""

    @staticmethod
    def forward(ctx, x, weight, eps: float, offset: float, sum_over_ranks=None, width: int | None = None):
        x32 = x.float()
        r = torch.rsqrt(_row_mean(x32.pow(2), sum_over_ranks, width) + eps)
        n = x32 * r
        ctx.save_for_backward(x, weight, r)
        ctx.offset, ctx.sum_over_ranks, ctx.width = offset, sum_over_ranks, width
        if offset:
            return (n * (offset + weight.float())).to(x.dtype)
        return weight * n.to(x.dtype)

    @staticmethod
    def backward(ctx, dy):
        x, weight, r = ctx.saved_tensors
        n = x.float() * r
        rows = tuple(range(dy.dim() - 1))
        if ctx.offset:
            dy32 = dy.float()
            dw = (dy32 * n).sum(rows).to(weight.dtype)
            dn = dy32 * (ctx.offset + weight.float())
        else:
            dw = (dy * n.to(x.dtype)).sum(rows).to(weight.dtype)
            dn = (dy * weight).float()
        del dy
        dx = r * (dn - n * _row_mean(dn * n, ctx.sum_over_ranks, ctx.width))
        return dx.to(x.dtype), dw, None, None, None, None


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 0.0, sum_over_ranks=None,
                   width: int | None = None) -> torch.Tensor:
    """The torch path (and the CPU path, and the reference the kernels are tested against)."""
    return _RMSNormTorch.apply(x, weight, eps, offset, sum_over_ranks, width)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as [rows, D] without a copy where its rows are evenly spaced (a per-head view of a wider projection, such
    as Qwen3.5's queries beside their gates), else a contiguous copy."""
    D = x.shape[-1]
    even = x.stride(-1) == 1 and all(x.stride(i) == x.stride(i + 1) * x.shape[i + 1] for i in range(x.dim() - 2))
    if not even:
        return x.contiguous().view(-1, D)
    return x.as_strided((x.numel() // D, D), (x.stride(-2) if x.dim() > 1 else D, 1))


class _RMSNormTriton(torch.autograd.Function):
    """x [..., D] in, y [..., D] (contiguous) out; the rows are read where they lie (`_rows`), and dx comes back
    contiguous in x's shape."""

    @staticmethod
    def forward(ctx, x, weight_D, eps: float, offset: float, out_dtype):
        x_RD = _rows(x)
        y_RD = torch.empty(x_RD.shape, dtype=out_dtype, device=x.device)
        _triton().norm_fwd(x_RD, None, weight_D, eps, y_RD, offset=offset or None)
        ctx.save_for_backward(x_RD, weight_D)
        ctx.eps, ctx.offset, ctx.shape = eps, offset, x.shape
        return y_RD.view(x.shape)

    @staticmethod
    def backward(ctx, dy):
        x_RD, weight_D = ctx.saved_tensors
        need_dx, need_dw = ctx.needs_input_grad[:2]
        if not (need_dx or need_dw):
            return None, None, None, None, None
        dx, _, dw = _triton().norm_bwd(x_RD, None, weight_D, ctx.eps, dy.reshape(x_RD.shape).contiguous(), need_dx,
                                       False, need_dw, offset=ctx.offset or None)
        return (dx.view(ctx.shape) if dx is not None else None), (dw.to(weight_D.dtype) if dw is not None else None), \
            None, None, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 0.0, *, sum_over_ranks=None,
             width: int | None = None, backend: str | None = "auto") -> torch.Tensor:
    """RMSNorm of x [..., D] with weight [D] (offset: the scale is offset + w); `width` and `sum_over_ranks` for a
    row split across tensor-parallel ranks (module docstring). Differentiable in x and weight."""
    D = x.shape[-1]
    if weight.shape != (D,):
        raise ValueError(f"need weight [D] = [{D}] for x [..., D], got {tuple(weight.shape)}")
    split = sum_over_ranks is not None or (width is not None and width != D)
    if split or D > MAX_TRITON_WIDTH or x.numel() == 0 or _pick_backend(x, backend) == "torch":
        return rms_norm_torch(x, weight, eps, offset, sum_over_ranks, width)
    out_dtype = x.dtype if offset else torch.promote_types(x.dtype, weight.dtype)
    return _RMSNormTriton.apply(x, weight, float(eps), float(offset), out_dtype)
