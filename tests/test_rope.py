"""RoPE (kernels.rope): the Triton kernel against the torch path, forward and backward, in both forms (halves with
partial rotary and pass-through channels; DeepSeek's and ERNIE's pairs), on strided views as the model hands them
(Qwen3.5's queries beside their gates, MLA's rope slice of each head), and the torch path by hand.

The kernel runs on CPU tensors under TRITON_INTERPRET=1, in one subprocess (tests/interpreter.py). fp32: output and
dx within 1e-6 (relative L2) of autograd through the torch path. bf16: within bf16 rounding of an fp64 reference and
no worse than the torch path (which rounds its intermediates); the kernel rounds once. The GPU run of the same
checks at a real shape is in tests/test_model_gpu.py.
"""

from __future__ import annotations

import math
import os
import sys

import pytest
import torch

import interpreter
from kernels.rope import rope, rope_torch


def _rel(x, ref) -> float:
    x, ref = x.double(), ref.double()
    return ((x - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def _angles(T: int, R: int, repeated: bool = True, dtype=torch.float32):
    """cos, sin [T, R] as launch.model.rope_cos_sin builds them (the half-row of angles repeated), or (repeated
    False) independent halves, so a kernel that read one half for both would be caught."""
    half = R // 2
    inv = 1.0 / (10000 ** (torch.arange(half, dtype=torch.float64) / half))
    ang = torch.arange(T, dtype=torch.float64)[:, None] * inv[None]
    ang = torch.cat([ang, ang if repeated else ang * 1.7 + 0.3], dim=-1)
    return ang.cos().to(dtype), ang.sin().to(dtype)


def _grad(fn, x, dy, *args, **kw):
    x = x.detach().requires_grad_(True)
    y = fn(x, *args, **kw)
    y.backward(dy)
    return y.detach(), x.grad


def _cases():
    """(name, x [T, H, D] (possibly a strided view), cos, sin, pairs)."""
    g = torch.Generator().manual_seed(0)
    T = 37
    out = []
    # Qwen3.5: 4 heads of 32 whose queries sit beside their gates ([T, H, 2·32], the first half), rotary 8 of 32
    qg = torch.randn(T, 4, 64, generator=g)
    out.append(("halves, partial, strided", qg[..., :32], *_angles(T, 8), False))
    # full rotary, 3 heads (not a power of two), independent cos/sin halves
    out.append(("halves, full, odd heads", torch.randn(T, 3, 16, generator=g), *_angles(T, 16, repeated=False),
                False))
    # MLA: the rope slice of each head [T, H, 8 + 4] → [T, H, 4], and the shared key [T, 1, 4]; angles wider than
    # D/2 are fine (only the first D/2 are read)
    q = torch.randn(T, 5, 12, generator=g)
    out.append(("pairs, MLA query slice", q[..., 8:], *_angles(T, 4), True))
    out.append(("pairs, one head", torch.randn(T, 1, 6, generator=g), *_angles(T, 8), True))
    return out


# ---- checks run by the interpreter subprocess ------------------------------------------------------------------
def fp32_checks() -> None:
    for name, x, cos, sin, pairs in _cases():
        dy = torch.randn(x.shape, generator=torch.Generator().manual_seed(1))
        y, dx = _grad(rope, x, dy, cos, sin, pairs=pairs, backend="triton")
        y_ref, dx_ref = _grad(rope_torch, x, dy, cos, sin, pairs)
        assert y.is_contiguous() and y.shape == x.shape, name
        assert _rel(y, y_ref) <= 1e-6 and _rel(dx, dx_ref) <= 1e-6, (name, _rel(y, y_ref), _rel(dx, dx_ref))


def bf16_checks() -> None:
    for name, x, cos, sin, pairs in _cases():
        x16, c16, s16 = x.bfloat16(), cos.bfloat16(), sin.bfloat16()
        dy = torch.randn(x.shape, generator=torch.Generator().manual_seed(1)).bfloat16()
        y, dx = _grad(rope, x16, dy, c16, s16, pairs=pairs, backend="triton")
        assert y.dtype == dx.dtype == torch.bfloat16, name
        y64, dx64 = _grad(rope_torch, x16.double(), dy.double(), c16.double(), s16.double(), pairs)
        yt, dxt = _grad(rope_torch, x16, dy, c16, s16, pairs)
        for ours, ref, theirs in ((y, y64, yt), (dx, dx64, dxt)):
            e, et = _rel(ours, ref), _rel(theirs, ref)
            assert e <= 4e-3 and e <= et * 1.05 + 1e-4, (name, e, et)


def pass_through_is_exact() -> None:
    """The channels past the rotary ones are copied bit for bit."""
    x = torch.randn(9, 2, 24).bfloat16()
    cos, sin = _angles(9, 8, dtype=torch.bfloat16)
    y = rope(x, cos, sin, backend="triton")
    assert torch.equal(y[..., 8:], x[..., 8:])


CHECKS = {f.__name__: f for f in (fp32_checks, bf16_checks, pass_through_is_exact)}
interpreter_results, test_triton_kernel_interpreter = interpreter.pytest_cases(__file__, CHECKS)


# ---- the torch path and the dispatcher (no triton) -------------------------------------------------------------
def test_torch_path_by_hand():
    """A quarter turn: (a, b) → (−b, a) in halves; pairs (1, 0) and (0, 1) at 90° → halves layout [0, −1 | 1, 0]."""
    cos, sin = torch.tensor([[0.0, 0.0]]), torch.tensor([[1.0, 1.0]])
    x = torch.tensor([[[3.0, 5.0, 7.0]]])  # R = 2 of D = 3: (3, 5) → (−5, 3), 7 passes
    assert torch.equal(rope(x, cos, sin), torch.tensor([[[-5.0, 3.0, 7.0]]]))
    c, s = math.cos(math.pi / 2), math.sin(math.pi / 2)
    x = torch.tensor([[[1.0, 0.0, 0.0, 1.0]]])  # pairs (1, 0) and (0, 1)
    y = rope(x, torch.full((1, 2), c), torch.full((1, 2), s), pairs=True)
    assert torch.allclose(y, torch.tensor([[[0.0, -1.0, 1.0, 0.0]]]), atol=1e-7)


def test_the_rotation_keeps_q_dot_k_a_function_of_the_offset():
    """RoPE's point: q·k after rotation depends on the positions' difference only, in both forms."""
    g = torch.Generator().manual_seed(3)
    q, k = (torch.randn(1, 1, 8, generator=g, dtype=torch.float64) for _ in range(2))
    cos, sin = _angles(12, 8, dtype=torch.float64)
    for pairs in (False, True):
        dots = {}
        for i, j in ((2, 5), (6, 9), (0, 3)):
            qi = rope(q, cos[i:i + 1], sin[i:i + 1], pairs=pairs)
            kj = rope(k, cos[j:j + 1], sin[j:j + 1], pairs=pairs)
            dots[(i, j)] = float((qi * kj).sum())
        assert max(dots.values()) - min(dots.values()) < 1e-12, (pairs, dots)


def test_bad_arguments():
    x = torch.randn(4, 2, 8)
    cos, sin = _angles(4, 8)
    with pytest.raises(ValueError, match="cos and sin"):
        rope(x, cos[:3], sin[:3])
    with pytest.raises(ValueError, match="cos and sin"):
        rope(x, *_angles(4, 10))  # more rotary channels than the head has
    with pytest.raises(ValueError, match="cos and sin"):
        rope(x, cos[:, :2], sin[:, :2], pairs=True)  # pairs need D/2 angles
    with pytest.raises(ValueError, match="backend"):
        rope(x, cos, sin, backend="cuda")
    if os.environ.get("TRITON_INTERPRET", "0") != "1":
        with pytest.raises(ValueError, match="TRITON_INTERPRET"):
            rope(x, cos, sin, backend="triton")


if __name__ == "__main__" and sys.argv[1:2] == ["interpreter"]:
    from interpreter import main

    main(CHECKS, sys.argv[2:])
