"""Fused Gated DeltaNet ops (kernels.gdn_fused) and the plain RMSNorm (kernels.rms_norm, the same Triton kernels
without the gate): the Triton kernels against the torch reference, forward and backward.

The Triton kernels run on CPU tensors under TRITON_INTERPRET=1, all in one subprocess and one test each
(tests/interpreter.py: the variable must be set before triton is imported).
fp32 inputs: outputs and every gradient within 1e-5 (relative L2) of torch autograd through the fp32 reference.
bf16 inputs: within bf16 rounding of an fp64 reference, and no worse than the torch path itself on the same
inputs; the gated norm's bf16 output matches the torch path bit for bit (same roundings, same order).
Shapes: odd T and C (not multiples of the tiles), packed documents with lengths 1 and < W, document starts inside
a tile, a shard whose first token is mid-document, T < W, non-contiguous inputs, and partial requires_grad.
The GPU comparison at the real shape (T = C = 8192, bf16) is in tests/test_model_gpu.py.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

import interpreter
from kernels.gdn_fused import (causal_conv1d_silu, causal_conv1d_silu_torch, gated_rms_norm,
                               gated_rms_norm_torch)
from kernels.rms_norm import rms_norm, rms_norm_torch


def _rel(x, ref) -> float:
    x, ref = x.double(), ref.double()
    return ((x - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def _positions(lengths) -> torch.Tensor:
    return torch.cat([torch.arange(n) for n in lengths])


def _run(fn, leaves, dy, *args, **kw):
    """Output and gradients of the leaves that require them (None for the others)."""
    leaves = [x.detach().requires_grad_(x.requires_grad) for x in leaves]  # detach keeps strides (views)
    y = fn(*leaves, *args, **kw)
    y.backward(dy.to(y.dtype))
    return [y.detach()] + [x.grad for x in leaves]


def _compare(fn_ours, fn_ref, leaves, dy, args, dtype, tol32, name):
    """Triton (interpreter) vs the torch reference on `leaves` cast to dtype; returns the errors."""
    cast = [x.detach().to(dtype).requires_grad_(x.requires_grad) for x in leaves]
    ours = _run(fn_ours, cast, dy, *args, backend="triton")
    names = ["out"] + [f"d{i}" for i in range(len(leaves))]
    if dtype == torch.float32:
        ref = _run(fn_ref, cast, dy, *args)
        errs = {n: _rel(a, b) for n, a, b in zip(names, ours, ref) if b is not None}
        assert all(e <= tol32 for e in errs.values()), f"{name} fp32: {errs}"
        assert all(a is None for a, b in zip(ours, ref) if b is None)
        return errs
    # 16-bit: fp64 reference from the same (rounded) inputs; the torch path on the 16-bit inputs sets the bar
    ref64 = _run(fn_ref, [x.detach().double().requires_grad_(x.requires_grad) for x in cast], dy.double(), *args)
    torch16 = _run(fn_ref, cast, dy, *args)
    errs = {}
    for n, a, b, t in zip(names, ours, ref64, torch16):
        if b is None:
            assert a is None
            continue
        assert a.dtype == t.dtype, f"{name} {n}: dtype {a.dtype} != torch path's {t.dtype}"
        errs[n] = (_rel(a, b), _rel(t, b))
        assert errs[n][0] <= max(1.25 * errs[n][1], 4e-3), f"{name} bf16 {n}: ours, torch vs fp64 = {errs[n]}"
    return errs


def conv_checks() -> None:
    g = torch.Generator().manual_seed(0)
    cases = [  # (name, positions, C, W)
        ("packed", _positions([1, 2, 5, 3, 1, 12, 13]), 19, 4),  # len-1 docs, docs < W, starts inside 8-row tiles
        ("one doc", _positions([29]), 8, 4),                     # C a tile multiple
        ("mid-doc shard", torch.arange(10) + 2, 11, 4),          # first row's taps reach before t = 0
        ("T < W", _positions([2]), 5, 3),
        ("W = 2", _positions([6, 1, 9]), 13, 2),
    ]
    for name, pos, C, W in cases:
        T = pos.shape[0]
        x_big = torch.randn(T, 2 * C, generator=g)
        x = x_big[:, ::2]  # non-contiguous view
        w = torch.randn(C, W, generator=g) * 0.6
        dy = torch.randn(T, C, generator=g)
        for dtype in (torch.float32, torch.bfloat16):
            partial = ((True, False), (False, True)) if (name == "packed" and dtype == torch.float32) else ()
            for rg in ((True, True),) + partial:
                leaves = [x.detach().requires_grad_(rg[0]), w.clone().requires_grad_(rg[1])]
                errs = _compare(causal_conv1d_silu, causal_conv1d_silu_torch, leaves, dy, (pos,), dtype, 1e-5,
                                f"conv {name} {rg}")
                if rg == (True, True):
                    print("conv", name, dtype, errs)


def norm_checks() -> None:
    g = torch.Generator().manual_seed(1)
    for shape in ((13, 3, 24), (7, 128), (1, 5)):
        D = shape[-1]
        x = torch.randn(shape, generator=g) * 3.0
        gate_big = torch.randn(*shape[:-1], 2 * D, generator=g) * 2.0
        gate = gate_big[..., D:]  # non-contiguous view (z is a slice of a projection in some layouts)
        w = 1.0 + 0.3 * torch.randn(D, generator=g)
        dy = torch.randn(shape, generator=g)
        for act in ("silu", "sigmoid"):  # Gated DeltaNet's gate, KDA's
            ours_fn = lambda *a, act=act, **k: gated_rms_norm(*a, activation=act, **k)  # noqa: E731
            ref_fn = lambda *a, act=act: gated_rms_norm_torch(*a, activation=act)  # noqa: E731
            for dtype in (torch.float32, torch.bfloat16):
                partial = ((True, False, True), (False, True, False)) if (D == 24 and dtype == torch.float32) else ()
                for rg in ((True, True, True),) + partial:
                    leaves = [x.clone().requires_grad_(rg[0]), gate.detach().requires_grad_(rg[1]),
                              w.clone().requires_grad_(rg[2])]
                    errs = _compare(ours_fn, ref_fn, leaves, dy, (1e-6,), dtype, 1e-5, f"norm {act} {shape} {rg}")
                    if rg == (True, True, True):
                        print("norm", act, shape, dtype, errs)
            # bf16 output bit for bit (silu: normalized x and weight product rounded to bf16 as the reference does;
            # sigmoid: fp32 throughout, rounded once), with a bf16 weight (the model's) and an fp32 one
            for w_dtype in (torch.bfloat16, torch.float32):
                xb, gb = x.bfloat16(), gate.bfloat16()
                ours = gated_rms_norm(xb, gb, w.to(w_dtype), 1e-6, backend="triton", activation=act)
                ref = gated_rms_norm_torch(xb, gb, w.to(w_dtype), 1e-6, act)
                assert ours.dtype == ref.dtype == torch.bfloat16
                frac = (ours == ref).float().mean().item()
                assert frac >= 0.995, f"norm {act} {shape} weight {w_dtype}: {frac:.4f} of bf16 outputs equal"
                assert _rel(ours, ref) < 2e-3
    # the two gates differ (the sigmoid path is not the silu one)
    x, gate, w = torch.randn(4, 8, generator=g), torch.randn(4, 8, generator=g), torch.ones(8)
    assert _rel(gated_rms_norm(x, gate, w, 1e-6, backend="triton", activation="sigmoid"),
                gated_rms_norm_torch(x, gate, w, 1e-6, "silu")) > 0.1


def rms_norm_checks() -> None:
    """The plain RMSNorm in both orders (offset 0: w·round(n); offset 1: round(n·(1 + w))): rows of a per-head
    norm ([T, H, Dh]) and of a hidden-size norm wider than one tile's 128 channels, fp32 and bf16, the weight in
    x's dtype or fp32 (the output then fp32 at offset 0, as the torch path's promotion gives); bf16 outputs equal
    to the torch path's; a per-head view of a wider projection (Qwen3.5's queries beside their gates) read in place
    and a transposed view copied, each equal to the contiguous input's result; x and the weight kept alone."""
    g = torch.Generator().manual_seed(2)
    for shape in ((13, 3, 24), (7, 300)):
        D = shape[-1]
        x = torch.randn(shape, generator=g) * 3.0
        dy = torch.randn(shape, generator=g)
        for offset in (0.0, 1.0):
            w = (0.0 if offset else 1.0) + 0.3 * torch.randn(D, generator=g)
            for dtype in (torch.float32, torch.bfloat16):
                for rg in ((True, True),) + (((True, False), (False, True)) if dtype == torch.float32 else ()):
                    leaves = [x.clone().requires_grad_(rg[0]), w.clone().requires_grad_(rg[1])]
                    errs = _compare(rms_norm, rms_norm_torch, leaves, dy, (1e-6, offset), dtype, 1e-5,
                                    f"rms_norm {shape} offset {offset} {rg}")
                    if rg == (True, True):
                        print("rms_norm", shape, offset, dtype, errs)
                xb = x.to(dtype)
                for w_dtype in (dtype, torch.float32):
                    ours = rms_norm(xb, w.to(w_dtype), 1e-6, offset, backend="triton")
                    ref = rms_norm_torch(xb, w.to(w_dtype), 1e-6, offset)
                    assert ours.dtype == ref.dtype and ours.shape == ref.shape, (ours.dtype, ref.dtype)
                    if ours.dtype == torch.bfloat16:  # the same roundings in the same order
                        frac = (ours == ref).float().mean().item()
                        assert frac >= 0.995, f"{shape} {offset}: {frac:.4f} of bf16 outputs equal"
                    assert _rel(ours, ref) < (2e-3 if dtype == torch.bfloat16 else 1e-6)
    # views: a per-head slice of a [T, H, 2·Dh] projection (rows evenly spaced), a transposed [H, T, Dh] one
    base = torch.randn(9, 3, 32, generator=g)
    w = 1.0 + 0.3 * torch.randn(16, generator=g)
    dy = torch.randn(9, 3, 16, generator=g)
    for view in (base[..., :16], base[..., 16:].transpose(0, 1).transpose(0, 1)):
        xs = view.detach().requires_grad_()
        xc = view.detach().contiguous().requires_grad_()
        ys, yc = (rms_norm(t, w, 1e-6, 1.0, backend="triton") for t in (xs, xc))
        ys.backward(dy), yc.backward(dy)
        assert torch.equal(ys, yc) and torch.equal(xs.grad, xc.grad) and xs.grad.shape == xs.shape
    xt = base[..., :16].transpose(0, 1)  # rows not evenly spaced: copied
    assert torch.equal(rms_norm(xt, w, 1e-6, backend="triton"), rms_norm(xt.contiguous(), w, 1e-6, backend="triton"))
    x = torch.randn(6, 32, dtype=torch.bfloat16, requires_grad=True)
    wb = torch.ones(32, dtype=torch.bfloat16, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        rms_norm(x, wb, 1e-6, backend="triton")
    assert sorted(tuple(t.shape) for t in saved) == [(6, 32), (32,)]
    assert any(t.data_ptr() == x.data_ptr() for t in saved)


def cpu_path_never_imports_triton() -> None:
    """The CPU path (backend "auto", also through the model) never imports triton (run first, in a fresh process)."""
    import launch.model  # noqa: F401  (the model module imports kernels.gdn_fused too)
    causal_conv1d_silu(torch.randn(5, 3), torch.randn(3, 4), torch.arange(5))
    gated_rms_norm(torch.randn(5, 3), torch.randn(5, 3), torch.ones(3), 1e-6)
    rms_norm(torch.randn(5, 3), torch.ones(3), 1e-6)
    from kernels.rope import rope

    rope(torch.randn(5, 2, 4), torch.ones(5, 4), torch.zeros(5, 4))
    assert "triton" not in sys.modules, "the CPU path imported triton"


INTERPRETER_CHECKS = {f.__name__: f for f in (cpu_path_never_imports_triton, conv_checks, norm_checks,
                                                rms_norm_checks)}


interpreter_results, test_triton_kernels_interpreter = interpreter.pytest_cases(__file__, INTERPRETER_CHECKS)


def test_torch_path_is_the_model_conv():
    """The dispatcher's CPU path is the reference, including T < W (the shift loop stops at T)."""
    g = torch.Generator().manual_seed(2)
    x, w = torch.randn(2, 6, generator=g), torch.randn(6, 4, generator=g)
    pos = torch.tensor([0, 1])
    y = causal_conv1d_silu(x, w, pos)
    expect = torch.nn.functional.silu(x * w[:, 3] + torch.cat([torch.zeros(1, 6), x[:1] * w[:, 2]]))
    assert torch.allclose(y, expect, atol=1e-6)


def test_bad_arguments():
    x, w, pos = torch.randn(5, 3), torch.randn(3, 4), torch.arange(5)
    with pytest.raises(ValueError, match="backend"):
        causal_conv1d_silu(x, w, pos, backend="cuda")
    with pytest.raises(ValueError, match=r"\[C, W\]"):
        causal_conv1d_silu(x, w[:2], pos)
    with pytest.raises(ValueError, match="positions"):
        causal_conv1d_silu(x, w, pos[:4])
    with pytest.raises(ValueError, match="one shape"):
        gated_rms_norm(x, x[:, :2], torch.ones(3), 1e-6)
    if os.environ.get("TRITON_INTERPRET", "0") != "1":
        with pytest.raises(ValueError, match="TRITON_INTERPRET"):
            gated_rms_norm(x, x, torch.ones(3), 1e-6, backend="triton")


if __name__ == "__main__" and sys.argv[1:2] == ["interpreter"]:
    from interpreter import main

    main(INTERPRETER_CHECKS, sys.argv[2:])
