"""The sink merge's kernels (kernels.sink_merge): scale_rows and grad_rows against the torch path, on the layouts
the attention kernels hand them (cuDNN's [1, H, T, D] output whose memory is [T, H, D]; the windowed flash call's
[T, H, D]; rows strided past their channels) with gradients at other strides and at the output's own, and the torch
path by hand.

The kernels run on CPU tensors under TRITON_INTERPRET=1, in one subprocess (tests/interpreter.py). fp32: equal to
the torch path within 1e-6. bf16: scale_rows rounds once from fp32 arithmetic, so it equals the torch path (fp32
arithmetic, one rounding) bit for bit; grad_rows' copy is dO bit for bit at the output's strides and its fp32 sums
agree with an fp64 reference to fp32 rounding. The GPU run of the merged attention is in tests/test_model_gpu.py.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

import interpreter
from kernels.sink_merge import grad_rows, grad_rows_torch, scale_rows, scale_rows_torch


def _layouts(dtype):
    """(name, o, g, w): o and g [..., D] at the kernels' strides, w one fp32 weight per row."""
    g = torch.Generator().manual_seed(0)
    H, T, D = 3, 70, 64  # T past one block of 64 rows, a head count that is not a power of two
    out = []
    o = torch.randn(T, H, D, generator=g).to(dtype).transpose(0, 1)[None]  # [1, H, T, D], memory [T, H, D]
    grad = torch.randn(1, H, T, D, generator=g).to(dtype)  # contiguous as [1, H, T, D]: other strides than o
    out.append(("cuDNN's [1, H, T, D]", o, grad, torch.rand(1, H, T, generator=g)))
    o = torch.randn(T, H, D, generator=g).to(dtype)
    out.append(("window's [T, H, D]", o, torch.randn(T, H, D, generator=g).to(dtype), torch.rand(T, H, generator=g)))
    o = torch.randn(T, H, 2 * 40, generator=g).to(dtype)[..., :40]  # rows strided past D = 40 (not a power of two)
    out.append(("strided rows, D = 40", o, torch.randn(T, H, 40, generator=g).to(dtype), torch.rand(T, H, generator=g)))
    return out


# ---- checks run by the interpreter subprocess ------------------------------------------------------------------
def _grads(o, g):
    """The gradient as the layers above hand it (other strides than o) and in o's layout (`empty_like`: o's strides
    where o is dense, which the kernels' outputs are)."""
    return (("other strides", g), ("o's strides", torch.empty_like(o).copy_(g)))


def fp32_checks() -> None:
    for name, o, g, w in _layouts(torch.float32):
        want = scale_rows_torch(o.clone(), w)
        got = o.clone()
        assert scale_rows(got, w, backend="triton") is got, name
        assert torch.allclose(got, want, rtol=1e-6, atol=0), name
        for how, do in _grads(o, g):
            g_out, d = grad_rows(do, o, backend="triton")
            g_ref, d_ref = grad_rows_torch(do, o)
            assert g_out.stride() == torch.empty_like(o).stride() and torch.equal(g_out, do), (name, how)
            assert (g_out is do) == (do.stride() == o.stride()), (name, how)
            assert d.dtype == torch.float32 and d.shape == o.shape[:-1], (name, how)
            assert torch.allclose(d, d_ref, rtol=1e-5, atol=1e-5), (name, how)


def bf16_checks() -> None:
    for name, o, g, w in _layouts(torch.bfloat16):
        want = scale_rows_torch(o.clone(), w)
        got = o.clone()
        scale_rows(got, w, backend="triton")
        assert torch.equal(got, want), name  # fp32 arithmetic and one round to nearest even, as torch's
        for how, do in _grads(o, g):
            g_out, d = grad_rows(do, o, backend="triton")
            assert g_out.stride() == torch.empty_like(o).stride() and torch.equal(g_out, do), (name, how)
            ref = (do.double() * o.double()).sum(-1)
            assert d.dtype == torch.float32 and torch.allclose(d.double(), ref, rtol=1e-5, atol=1e-5), (name, how)


CHECKS = {f.__name__: f for f in (fp32_checks, bf16_checks)}
interpreter_results, test_triton_kernel_interpreter = interpreter.pytest_cases(__file__, CHECKS)


# ---- the torch path and the dispatcher (no triton) -------------------------------------------------------------
def test_torch_path_by_hand():
    """Rows (1, 2) and (3, 4) weighted 0.5 and 2 become (0.5, 1) and (6, 8); their dots with (1, 1) and (2, 0.5)
    are 3 and 8, in fp32 for bf16 inputs; a gradient at the output's strides is returned as it is, one at others is
    copied to them."""
    o = torch.tensor([[1.0, 2.0], [3.0, 4.0]], dtype=torch.bfloat16)
    assert torch.equal(scale_rows(o, torch.tensor([0.5, 2.0])), torch.tensor([[0.5, 1.0], [6.0, 8.0]]).bfloat16())
    o = torch.tensor([[1.0, 2.0], [3.0, 4.0]], dtype=torch.bfloat16)
    do = torch.tensor([[1.0, 1.0], [2.0, 0.5]], dtype=torch.bfloat16)
    g, d = grad_rows(do, o)
    assert g is do and d.dtype == torch.float32 and torch.equal(d, torch.tensor([3.0, 8.0]))
    o_t = o.t().contiguous().t()  # column-major rows
    g, d = grad_rows(do, o_t)
    assert g is not do and g.stride() == o_t.stride() and torch.equal(g, do)
    assert torch.equal(d, torch.tensor([3.0, 8.0]))


def test_rows_past_the_grid_are_not_handed_to_the_kernels(monkeypatch):
    """A row dimension past the kernels' grid (MAX_R2) is not handed to them (the callers then run the torch path);
    the limit lowered here, so the test needs no 4M-row tensor."""
    import kernels.sink_merge as sm

    o = torch.randn(2, 9, 8)
    assert sm._rows(o) is not None and sm._rows(o[None]) is not None
    monkeypatch.setattr(sm, "MAX_R2", 8)
    assert sm._rows(o) is None and sm._rows(o[:, :8]) is not None


def test_bad_arguments():
    o = torch.randn(4, 2, 8)
    with pytest.raises(ValueError, match="one weight per row"):
        scale_rows(o, torch.rand(4, 2, 8))
    with pytest.raises(ValueError, match="of shape"):
        grad_rows(torch.randn(4, 2, 7), o)
    with pytest.raises(ValueError, match="backend"):
        scale_rows(o, torch.rand(4, 2), backend="cuda")
    if os.environ.get("TRITON_INTERPRET", "0") != "1":
        with pytest.raises(ValueError, match="TRITON_INTERPRET"):
            grad_rows(o, o, backend="triton")


if __name__ == "__main__" and sys.argv[1:2] == ["interpreter"]:
    from interpreter import main

    main(CHECKS, sys.argv[2:])
