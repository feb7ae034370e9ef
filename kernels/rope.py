"""Rotary position embedding of the attention heads, in the two forms the model families use:

    halves (Llama, Qwen, Mixtral, GLM, gpt-oss, ...): the first R channels of a head as halves (a, b) = (x[:R/2],
        x[R/2:R]), y = [a·cos₁ − b·sin₁ | b·cos₂ + a·sin₂] (cos₁, cos₂ the two halves of the angle row, equal for
        every standard RoPE), the channels past R (partial rotary) unchanged
    pairs (DeepSeek's MLA, ERNIE-4.5): every channel of the head in pairs (a, b) = (x[2i], x[2i+1]),
        y = [a·cos − b·sin | b·cos + a·sin] with the angles of the first half: the pairs' first channels, then their
        second ones (the same layout for q and k, so q·k is the pairs' rotation)

cos and sin are [T, R] rows of the token's angles (launch.model.rope_cos_sin). The rotation is orthogonal, so the
backward is the rotation by the opposite angles (the transpose), applied to dy: it needs no saved activation.

Why fuse: the torch ops (slices, a negation, a concatenation, two products, a sum, and for partial rotary another
concatenation) write five to seven [T, H, D] temporaries forward and as many backward; the kernel reads x and
writes y (forward), reads dy and writes dx (backward), in fp32 registers with one rounding. Backends as in
kernels/gdn_fused.py: "auto" runs Triton on CUDA/ROCm tensors when triton is installed and the torch path
otherwise; "torch" and "triton" force one ("triton" on CPU tensors only under TRITON_INTERPRET=1).
"""

from __future__ import annotations

import torch

from kernels.gdn_fused import _pick_backend


def rope_torch(x_THD: torch.Tensor, cos_TR: torch.Tensor, sin_TR: torch.Tensor, pairs: bool = False) -> torch.Tensor:
    """The torch path (the CPU path, and the reference the kernel is tested against)."""
    if pairs:
        r = x_THD.shape[-1] // 2
        cos, sin = cos_TR[:, None, :r], sin_TR[:, None, :r]
        x1, x2 = x_THD[..., 0::2], x_THD[..., 1::2]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    r = cos_TR.shape[-1]
    x_rot, x_pass = x_THD[..., :r], x_THD[..., r:]
    x1, x2 = x_rot[..., : r // 2], x_rot[..., r // 2:]
    rotated = torch.cat([-x2, x1], dim=-1)
    out = x_rot * cos_TR[:, None] + rotated * sin_TR[:, None]
    return torch.cat([out, x_pass], dim=-1) if x_pass.shape[-1] else out


def _triton():
    from kernels import rope_triton  # lazy: the CPU path never imports triton

    return rope_triton


class _RopeTriton(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_THD, cos_TR, sin_TR, rotary: int, pairs: bool):
        ctx.save_for_backward(cos_TR, sin_TR)
        ctx.rotary, ctx.pairs = rotary, pairs
        return _triton().rope(x_THD, cos_TR, sin_TR, rotary, pairs, backward=False)

    @staticmethod
    def backward(ctx, dy):
        cos_TR, sin_TR = ctx.saved_tensors
        dx = _triton().rope(dy if dy.stride(-1) == 1 else dy.contiguous(), cos_TR, sin_TR, ctx.rotary, ctx.pairs,
                            backward=True)
        return dx, None, None, None, None


def rope(x_THD: torch.Tensor, cos_TR: torch.Tensor, sin_TR: torch.Tensor, pairs: bool = False,
         backend: str | None = "auto") -> torch.Tensor:
    """RoPE of x [T, H, D] with the angle rows cos, sin [T, R]: halves of the first R channels, or (`pairs`) pairs
    of all D (module docstring). Returns a new [T, H, D] tensor; differentiable in x (not in the angles)."""
    T, H, D = x_THD.shape
    rotary = D if pairs else cos_TR.shape[-1]
    need = D // 2 if pairs else rotary
    if cos_TR.shape != sin_TR.shape or cos_TR.shape[0] != T or cos_TR.shape[-1] < need or rotary % 2 \
            or rotary > D:
        raise ValueError(f"RoPE of x {tuple(x_THD.shape)} needs cos and sin [T, R] with T = {T} and an even R "
                         f"{'of at least D/2' if pairs else 'up to D'}, got {tuple(cos_TR.shape)} and "
                         f"{tuple(sin_TR.shape)}")
    if (_pick_backend(x_THD, backend) == "torch" or cos_TR.requires_grad or sin_TR.requires_grad
            or x_THD.stride(-1) != 1 or x_THD.numel() == 0):
        return rope_torch(x_THD, cos_TR, sin_TR, pairs)
    return _RopeTriton.apply(x_THD, cos_TR.contiguous(), sin_TR.contiguous(), rotary, pairs)
