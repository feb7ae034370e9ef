"""Fused steps of the expert-parallel backward (kernels.expert_grads): the Triton kernels against the torch
reference and against hand-derived gradients.

The Triton kernels run on CPU tensors under TRITON_INTERPRET=1 in one subprocess (tests/interpreter.py), one test
per check. Shapes are odd (not multiples of the tiles), the row operands are column slices of one wider buffer as
the backward passes them, and an empty chunk (M = 0) returns empty outputs.
fp32: within 1e-6 (relative L2) of the torch reference. bf16: every output element within one bf16 rounding
(2^-7 relative, whichever way it rounds: the interpreter truncates where the GPU rounds to nearest) of the fp32
reference on the same bf16 inputs, and dw within 1e-6 of an fp64 reference. The activation's forward kernel
gives the backward kernel's activation bitwise. The activation backward also in
gpt-oss's clamped form (kernels.expert_grads.GPT_OSS_GLU), with gate and up values across and exactly at ±7; its
torch reference against autograd through the forward's own ops. Step-3.7's placement (clamped_swiglu: the limit
clamps silu(gate), not the gate) likewise, its torch path against transformers' formula written out by hand. Gemma
4's GeGLU (GEGLU_TANH: gelu_tanh(gate)·up) in both kernels (in the forward checks' and the activation backward's
launches), its torch forward bitwise F.gelu(approximate="tanh")·up (and transformers' ACT2FN["gelu_pytorch_tanh"]),
its torch backward against autograd through that expression. The experts' bias add equals the torch path bitwise
(one rounding of the fp32 sum, as torch's add), idle experts and rows in the middle of a tile included.
"""

from __future__ import annotations

import sys

import pytest
import torch
import torch.nn.functional as F

import interpreter
from kernels.expert_grads import (GEGLU_TANH, GPT_OSS_GLU, GLU, SWIGLU, add_expert_bias_, add_expert_bias_torch,
                                   clamped_swiglu, glu_backward_torch, glu_forward, glu_of, slot_grads,
                                   slot_grads_torch, swiglu_backward, swiglu_backward_torch)


def _rel(x, ref) -> float:
    x, ref = x.double(), ref.double()
    return ((x - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def _rows(M: int, D: int, dtype, extra: int = 8):
    """A received row buffer [M, D + extra]: the output gradient in columns :D, the routing weight in column D."""
    buf = torch.randn(M, D + extra).to(dtype)
    buf[:, D] = torch.rand(M).to(dtype)
    return buf[:, :D], buf[:, D:D + 1]


def _one_rounding(ours: torch.Tensor, ref32: torch.Tensor) -> bool:
    """Every element of a 16-bit output within one bf16 rounding of the fp32 value (plus fp32 noise)."""
    return bool(((ours.float() - ref32).abs() <= ref32.abs() * 2.0 ** -7 + 1e-6).all())


def slot_checks():
    for M, D in [(37, 45), (5, 16), (1, 3)]:
        for dtype in (torch.float32, torch.bfloat16):
            dout, w = _rows(M, D, dtype)
            y = torch.randn(M, D).to(dtype)
            g, dw = slot_grads(dout, w, y, backend="triton")
            g_ref = slot_grads_torch(dout, w, y)[0]
            assert g.dtype == dtype and dw.dtype == torch.float32 and dw.shape == (M,)
            dw64 = (dout.double() * y.double()).sum(-1)
            assert _rel(dw, dw64) <= 1e-6, (M, D, dtype, _rel(dw, dw64))
            if dtype == torch.float32:
                assert _rel(g, g_ref) <= 1e-6
            else:
                assert _one_rounding(g, slot_grads_torch(dout.float(), w.float(), y.float())[0]), (M, D)
            # g written over dout itself (a column slice of the row buffer): the same values, bitwise
            for backend in ("triton", "torch"):
                inplace = dout.clone() if backend == "torch" else _rows(M, D, dtype)[0].copy_(dout)
                g2, dw2 = slot_grads(inplace, w, y, backend=backend, out=inplace)
                ref_g, ref_dw = (g, dw) if backend == "triton" else slot_grads_torch(dout, w, y)
                assert g2.data_ptr() == inplace.data_ptr() and torch.equal(g2, ref_g) and torch.equal(dw2, ref_dw)
    g, dw = slot_grads(torch.empty(0, 8), torch.empty(0, 1), torch.empty(0, 8), backend="triton")
    assert g.shape == (0, 8) and dw.shape == (0,)


def swiglu_checks():
    for M, I in [(37, 21), (3, 16), (1, 1)]:
        for dtype in (torch.float32, torch.bfloat16):
            h = (torch.randn(M, 2 * I) * 3).to(dtype)
            da = torch.randn(M, I).to(dtype)
            dh, a = swiglu_backward(h, da, backend="triton")
            dh_ref, a_ref = swiglu_backward_torch(h, da)
            assert dh.dtype == a.dtype == dtype and dh.shape == (M, 2 * I) and a.shape == (M, I)
            if dtype == torch.float32:
                assert _rel(dh, dh_ref) <= 1e-6 and _rel(a, a_ref) <= 1e-6, (_rel(dh, dh_ref), _rel(a, a_ref))
            else:
                dh32, a32 = swiglu_backward_torch(h.float(), da.float())
                assert _one_rounding(dh, dh32) and _one_rounding(a, a32), (M, I)
    dh, a = swiglu_backward(torch.empty(0, 6), torch.empty(0, 3), backend="triton")
    assert dh.shape == (0, 6) and a.shape == (0, 3)


def _clamped_h(M: int, I: int) -> torch.Tensor:
    """[gate | up] of std 5 (a third beyond ±7) with a few values exactly at the clamp's bounds."""
    h = torch.randn(M, 2 * I) * 5
    h[0, 0], h[-1, I], h[M // 2, -1] = 7.0, -7.0, 7.0
    return h


def glu_checks():
    """The activation backward kernel against the torch reference: gpt-oss's clamped GLU and GeGLU (whose kernel
    forms tanh from a sigmoid, the reference with torch's tanh)."""
    for glu in (GPT_OSS_GLU, GEGLU_TANH):
        for M, I in [(37, 21), (3, 16), (1, 1)]:
            for dtype in (torch.float32, torch.bfloat16):
                h, da = _clamped_h(M, I).to(dtype), torch.randn(M, I).to(dtype)
                dh, a = swiglu_backward(h, da, backend="triton", glu=glu)
                assert dh.dtype == a.dtype == dtype and dh.shape == (M, 2 * I) and a.shape == (M, I)
                if dtype == torch.float32:
                    dh_ref, a_ref = glu_backward_torch(h, da, glu)
                    assert _rel(dh, dh_ref) <= 1e-6 and _rel(a, a_ref) <= 1e-6, (glu, _rel(dh, dh_ref), _rel(a, a_ref))
                else:
                    dh32, a32 = glu_backward_torch(h.float(), da.float(), glu)
                    assert _one_rounding(dh, dh32) and _one_rounding(a, a32), (glu, M, I)
    # SwiGLU through the same entry point keeps its own arithmetic, bitwise
    h, da = torch.randn(9, 10), torch.randn(9, 5)
    assert all(torch.equal(x, y) for x, y in zip(swiglu_backward(h, da, backend="triton", glu=GLU()),
                                                  swiglu_backward(h, da, backend="triton")))


def glu_forward_checks():
    """The forward kernel: the backward kernel's a bitwise (the activation the down projection's weight gradient
    takes is the one the forward multiplied), and within one rounding of fp32, SwiGLU, the clamped form and GeGLU."""
    for glu in (GLU(), GPT_OSS_GLU, GEGLU_TANH):
        for M, I in [(37, 21), (3, 16), (1, 1)]:
            for dtype in (torch.float32, torch.bfloat16):
                h, da = _clamped_h(M, I).to(dtype), torch.randn(M, I).to(dtype)
                a = glu_forward(h, glu, backend="triton")
                assert a.dtype == dtype and a.shape == (M, I)
                assert torch.equal(a, swiglu_backward(h, da, backend="triton", glu=glu)[1]), (glu, M, I, dtype)
                assert _one_rounding(a, glu_forward(h.float(), glu, backend="torch")), (glu, M, I, dtype)
    assert glu_forward(torch.empty(0, 6), GPT_OSS_GLU, backend="triton").shape == (0, 3)
    assert glu_forward(torch.empty(0, 6), GEGLU_TANH, backend="triton").shape == (0, 3)


def clamped_swiglu_checks():
    """Step-3.7's clamped SwiGLU (the limit on silu(gate)): both kernels against the torch path, the forward kernel
    the backward kernel's a bitwise; at limit 7 (ups exactly at ±7) and 2.5 (most activated gates beyond it). The
    kernels do take the activated-gate placement: its results differ from the gate-clamped GLU's here."""
    for limit in (7.0, 2.5):
        glu = clamped_swiglu(limit)
        for M, I in [(37, 21), (3, 16), (1, 1)]:
            for dtype in (torch.float32, torch.bfloat16):
                h, da = _clamped_h(M, I).to(dtype), torch.randn(M, I).to(dtype)
                dh, a = swiglu_backward(h, da, backend="triton", glu=glu)
                assert dh.dtype == a.dtype == dtype and dh.shape == (M, 2 * I) and a.shape == (M, I)
                assert torch.equal(glu_forward(h, glu, backend="triton"), a), (limit, M, I, dtype)
                if dtype == torch.float32:
                    dh_ref, a_ref = glu_backward_torch(h, da, glu)
                    assert _rel(dh, dh_ref) <= 1e-6 and _rel(a, a_ref) <= 1e-6, (_rel(dh, dh_ref), _rel(a, a_ref))
                    assert _rel(a, glu_forward(h, glu, backend="torch")) <= 1e-6
                else:
                    dh32, a32 = glu_backward_torch(h.float(), da.float(), glu)
                    assert _one_rounding(dh, dh32) and _one_rounding(a, a32), (limit, M, I)
                    assert _one_rounding(a, glu_forward(h.float(), glu, backend="torch")), (limit, M, I)
        h, da = _clamped_h(37, 21), torch.randn(37, 21)
        gate_clamped = GLU(limit=limit)
        # (at limit 7 they differ only where the gate passes 7: by up to (7 − silu(7))·|up|, ~0.006·|up|)
        assert (glu_forward(h, glu, backend="triton") - glu_forward(h, gate_clamped, backend="triton")).abs().max() > 1e-3
        assert (swiglu_backward(h, da, backend="triton", glu=glu)[0]
                - swiglu_backward(h, da, backend="triton", glu=gate_clamped)[0]).abs().max() > 1e-3, limit
    assert glu_forward(torch.empty(0, 6), clamped_swiglu(7.0), backend="triton").shape == (0, 3)


def bias_checks():
    """rows += bias[expert of the row], in place, bitwise the torch path's: 5 experts (not a power of two), two of
    them idle (an offset repeated), on a column slice of a wider buffer; none of an empty row block."""
    counts = [3, 0, 7, 0, 4]
    offs = torch.cumsum(torch.tensor(counts), 0).to(torch.int32)
    for dtype in (torch.float32, torch.bfloat16):
        rows = torch.randn(sum(counts), 40).to(dtype)[:, :37]
        bias = torch.randn(5, 37).to(dtype)
        want = add_expert_bias_torch(rows.clone(), bias, offs)
        got = rows.clone()
        assert add_expert_bias_(got, bias, offs, backend="triton") is got
        assert torch.equal(got, want), dtype
        # by hand: rows 0-2 take bias 0, rows 3-9 bias 2, rows 10-13 bias 4
        assert torch.equal(got[3:10], (rows[3:10].float() + bias[2].float()).to(dtype))
    assert add_expert_bias_(torch.empty(0, 6), torch.randn(2, 6), torch.zeros(2, dtype=torch.int32),
                            backend="triton").shape == (0, 6)


INTERPRETER_CHECKS = {f.__name__: f for f in (slot_checks, swiglu_checks, glu_checks, glu_forward_checks,
                                              clamped_swiglu_checks, bias_checks)}


interpreter_results, test_triton_kernels_interpreter = interpreter.pytest_cases(__file__, INTERPRETER_CHECKS)


def test_expert_bias_by_hand_and_bad_arguments():
    """Rows sorted by expert: offsets [2, 2, 3] put rows 0-1 on expert 0 and row 2 on expert 2 (expert 1 idle)."""
    rows = torch.zeros(3, 2)
    got = add_expert_bias_(rows, torch.tensor([[1.0, 2.0], [5.0, 5.0], [3.0, 4.0]]), torch.tensor([2, 2, 3]))
    assert got is rows and torch.equal(rows, torch.tensor([[1.0, 2.0], [1.0, 2.0], [3.0, 4.0]]))
    with pytest.raises(ValueError, match=r"\[M, N\], \[E, N\] and \[E\]"):
        add_expert_bias_(rows, torch.zeros(3, 5), torch.tensor([2, 2, 3]))
    with pytest.raises(ValueError, match="share a dtype"):
        add_expert_bias_(rows, torch.zeros(3, 2, dtype=torch.float64), torch.tensor([2, 2, 3]))


def test_swiglu_backward_is_the_gradient_of_swiglu():
    """The reference against autograd through silu(gate) · up, from fp64 inputs: dh is the input gradient,
    a the output (to the fp32 the reference computes in)."""
    g = torch.Generator().manual_seed(3)
    h = torch.randn(7, 10, generator=g, dtype=torch.float64, requires_grad=True)
    da = torch.randn(7, 5, generator=g, dtype=torch.float64)
    gate, up = h.chunk(2, dim=-1)
    out = torch.nn.functional.silu(gate) * up
    out.backward(da)
    dh, a = swiglu_backward(h.detach(), da)
    assert torch.allclose(dh, h.grad, rtol=1e-6, atol=1e-6)  # fp32 inside
    assert torch.allclose(a, out.detach(), rtol=1e-6, atol=1e-6)


def test_clamped_glu_backward_is_the_gradient_of_the_forward():
    """gpt-oss's activation: the torch reference's dh against autograd through `glu_forward` (the ops the forward
    runs: clamp, sigmoid, products) from fp64 inputs, with values beyond and exactly at ±7 (the clamps' gradients
    pass at their bounds, as torch's clamp passes them); a is the forward's output; and the forward is the
    definition, (clamp(up) + 1) · g · σ(1.702 g), g = min(gate, 7)."""
    g = torch.Generator().manual_seed(4)
    h = (torch.randn(11, 12, generator=g, dtype=torch.float64) * 5)
    h[0, 0], h[1, 6], h[2, 11] = 7.0, -7.0, 7.0
    h.requires_grad_()
    da = torch.randn(11, 6, generator=g, dtype=torch.float64)
    out = glu_forward(h, GPT_OSS_GLU)
    out.backward(da)
    dh, a = swiglu_backward(h.detach(), da, glu=GPT_OSS_GLU)
    assert torch.allclose(dh, h.grad, rtol=1e-6, atol=1e-6) and torch.allclose(a, out.detach(), rtol=1e-6, atol=1e-6)
    gate, up = h.detach().chunk(2, dim=-1)
    clamped = gate.clamp(max=7.0)
    assert torch.allclose(out.detach(), (up.clamp(-7.0, 7.0) + 1) * clamped * torch.sigmoid(1.702 * clamped))
    assert (gate > 7).any() and (up.abs() > 7).any() and (h.grad == 0).any()  # the clamps act, and cut gradients
    with pytest.raises(ValueError, match="limit must be positive"):
        GLU(limit=0.0)


def _step3p7_h(limit: float) -> torch.Tensor:
    """fp32 [gate | up] [11, 12] of std 5: activated gates beyond `limit` and ups beyond ±limit, with gates of 5
    (whose silu is the limit the tests take: exactly at the bound) and ups exactly at ±limit."""
    g = torch.Generator().manual_seed(5)
    h = torch.randn(11, 12, generator=g) * 5
    h[0, 0], h[3, 2], h[5, 5] = 5.0, 5.0, 5.0
    h[1, 6], h[2, 11], h[4, 8] = -limit, limit, limit
    return h


def _step3p7_by_hand(h: torch.Tensor, limit: float) -> torch.Tensor:
    """transformers' Step3p7Experts._apply_gate, written out."""
    gate, up = h.chunk(2, dim=-1)
    gate = torch.nn.functional.silu(gate).clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return gate * up


def test_clamped_swiglu_forward_is_step3p7s():
    """clamped_swiglu's torch forward is Step-3.7's activation bitwise (fp32 and bf16), and differs from clamping
    the gate before the activation (gpt-oss's placement) on these inputs."""
    limit = torch.nn.functional.silu(torch.tensor(5.0)).item()
    glu = clamped_swiglu(limit)
    assert glu == GLU(alpha=1.0, limit=limit, up_offset=0.0, clamp_activated=True) and glu.clamp_activated
    h = _step3p7_h(limit)
    gate, up = h.chunk(2, dim=-1)
    assert (torch.nn.functional.silu(gate) > limit).any() and (up.abs() > limit).any()
    for dtype in (torch.float32, torch.bfloat16):
        x = h.to(dtype)
        a = glu_forward(x, glu, backend="torch")
        assert a.dtype == dtype and torch.equal(a, _step3p7_by_hand(x, limit)), dtype
    assert not torch.allclose(glu_forward(h, glu), glu_forward(h, GLU(limit=limit)), rtol=1e-3, atol=1e-3)


def test_clamped_swiglu_backward_is_the_gradient_of_step3p7s():
    """glu_backward_torch of clamped_swiglu against autograd through transformers' formula (fp32): dh is the input
    gradient, gates whose silu is exactly the limit and ups exactly at ±limit passing theirs (torch's clamp is
    inclusive), gates whose silu is beyond it and ups beyond ±limit getting none; a is the formula's output
    bitwise; the dispatcher's torch path is the same."""
    limit = torch.nn.functional.silu(torch.tensor(5.0)).item()
    glu = clamped_swiglu(limit)
    h = _step3p7_h(limit).requires_grad_()
    da = torch.randn(11, 6, generator=torch.Generator().manual_seed(6))
    out = _step3p7_by_hand(h, limit)
    out.backward(da)
    dh, a = glu_backward_torch(h.detach(), da, glu)
    assert dh.dtype == a.dtype == torch.float32
    assert torch.allclose(dh, h.grad, rtol=1e-5, atol=1e-6), (dh - h.grad).abs().max()
    assert torch.equal(a, out.detach())
    assert all(torch.equal(x, y) for x, y in zip(swiglu_backward(h.detach(), da, backend="torch", glu=glu), (dh, a)))
    gate, up = h.detach().chunk(2, dim=-1)
    silu = torch.nn.functional.silu(gate)
    at_bound = (silu == limit) | (up.abs() == limit)
    assert at_bound.sum() == 6 and (h.grad.chunk(2, dim=-1)[0][silu == limit] != 0).all()
    assert (h.grad.chunk(2, dim=-1)[1][up.abs() == limit] != 0).all()
    assert (dh[:, :6][silu > limit] == 0).all() and (dh[:, 6:][up.abs() > limit] == 0).all()
    assert (silu > limit).any() and (gate < 5.0).any()
    # the gate-first placement's gradient is another one on these inputs
    assert not torch.allclose(glu_backward_torch(h.detach(), da, GLU(limit=limit))[0], dh, rtol=1e-3, atol=1e-3)


def test_gpt_oss_glu_unchanged():
    """gpt-oss's GLU (the gate clamped before the activation) is what it was, bitwise: its forward's ops and its
    backward's, written out as they were before the activated-gate placement was added."""
    assert GPT_OSS_GLU == GLU(alpha=1.702, limit=7.0, up_offset=1.0) and not GPT_OSS_GLU.clamp_activated
    h, da = _clamped_h(13, 10), torch.randn(13, 10)
    gate, up = h.chunk(2, dim=-1)
    g, u = gate.clamp(max=7.0), up.clamp(min=-7.0, max=7.0)
    assert torch.equal(glu_forward(h, GPT_OSS_GLU, backend="torch"), (u + 1.0) * (g * torch.sigmoid(g * 1.702)))
    s = torch.sigmoid(1.702 * g)
    act = g * s
    dgate = torch.where(gate <= 7.0, da * (u + 1.0) * (s + 1.702 * act * (1 - s)), 0.0)
    dup = torch.where((up >= -7.0) & (up <= 7.0), da * act, 0.0)
    dh, a = glu_backward_torch(h, da, GPT_OSS_GLU)
    assert torch.equal(dh, torch.cat([dgate, dup], dim=-1)) and torch.equal(a, act * (u + 1.0))


def test_clamp_activated_needs_a_limit():
    with pytest.raises(ValueError, match="clamp_activated needs a limit"):
        GLU(limit=None, clamp_activated=True)
    with pytest.raises(ValueError, match="limit must be positive"):
        clamped_swiglu(0.0)


def _geglu_h(dtype=torch.float32) -> torch.Tensor:
    """[gate | up] [13, 16] of std 3 (gelu's negative tail, its minimum near −0.75 and its linear side), a few gates
    exactly 0 (gelu(0) = 0, gelu'(0) = ½)."""
    h = torch.randn(13, 16, generator=torch.Generator().manual_seed(7)) * 3
    h[0, 0], h[5, 3], h[12, 7] = 0.0, 0.0, 0.0
    return h.to(dtype)


def test_geglu_forward_is_gelu_tanh_times_up():
    """GEGLU_TANH's torch forward (glu_of, as the dense MLP calls it, and glu_forward's torch path) is
    F.gelu(gate, approximate="tanh") · up bitwise, fp32 and bf16; that is the tanh formula (fp64, to rounding), not
    the erf GELU; and the other GLUs keep the silu gate."""
    assert GEGLU_TANH == GLU(gate_act="gelu_tanh") and GEGLU_TANH.gate_act == "gelu_tanh"
    assert SWIGLU.gate_act == GPT_OSS_GLU.gate_act == clamped_swiglu(7.0).gate_act == "silu" and SWIGLU == GLU()
    for dtype in (torch.float32, torch.bfloat16):
        h = _geglu_h(dtype)
        gate, up = h.chunk(2, dim=-1)
        want = F.gelu(gate, approximate="tanh") * up
        assert glu_of(gate, up, GEGLU_TANH).dtype == dtype
        assert torch.equal(glu_of(gate, up, GEGLU_TANH), want), dtype
        assert torch.equal(glu_forward(h, GEGLU_TANH, backend="torch"), want), dtype
    gate, up = _geglu_h(torch.float64).chunk(2, dim=-1)
    by_hand = 0.5 * gate * (1 + torch.tanh((2 / torch.pi) ** 0.5 * (gate + 0.044715 * gate ** 3))) * up
    a = glu_of(gate, up, GEGLU_TANH)
    assert torch.allclose(a, by_hand, rtol=1e-12, atol=1e-12)
    assert (a - F.gelu(gate) * up).abs().max() > 1e-4  # the tanh approximation, not erf's GELU
    assert not torch.allclose(a, glu_of(gate, up, SWIGLU), rtol=1e-2, atol=1e-2)


def test_geglu_forward_is_transformers_gelu_pytorch_tanh():
    """Bitwise transformers' Gemma 4 activation (ACT2FN["gelu_pytorch_tanh"](gate) · up), fp32 and bf16."""
    activations = pytest.importorskip("transformers.activations")
    for dtype in (torch.float32, torch.bfloat16):
        gate, up = _geglu_h(dtype).chunk(2, dim=-1)
        assert torch.equal(glu_of(gate, up, GEGLU_TANH), activations.ACT2FN["gelu_pytorch_tanh"](gate) * up), dtype


def test_geglu_backward_is_the_gradient_of_the_forward():
    """GEGLU_TANH's torch backward (through the dispatcher and glu_backward_torch) against fp64 autograd through
    F.gelu(gate, approximate="tanh") · up on the same inputs: fp32 inputs within 1e-6 (relative L2; fp32 inside);
    bf16 inputs every element within one bf16 rounding, a the fp32 forward rounded once. By hand at gate 0:
    dgate = da·up/2, dup = 0, a = 0."""
    da = torch.randn(13, 8, generator=torch.Generator().manual_seed(8))
    for dtype in (torch.float32, torch.bfloat16):
        h, da_t = _geglu_h(dtype), da.to(dtype)
        h64 = h.double().requires_grad_()
        gate, up = h64.chunk(2, dim=-1)
        out = F.gelu(gate, approximate="tanh") * up
        out.backward(da_t.double())
        dh, a = swiglu_backward(h, da_t, backend="torch", glu=GEGLU_TANH)
        assert dh.dtype == a.dtype == dtype and dh.shape == (13, 16) and a.shape == (13, 8)
        assert all(torch.equal(x, y) for x, y in zip(glu_backward_torch(h, da_t, GEGLU_TANH), (dh, a)))
        if dtype == torch.float32:
            # elementwise: fp32's cancellation in gelu's tails (1 ± tanh near 0) costs up to ~1e-6 absolute here, as
            # in torch's own fp32 backward of the same expression
            assert _rel(dh, h64.grad) <= 1e-6, _rel(dh, h64.grad)
            assert torch.allclose(dh.double(), h64.grad, rtol=1e-5, atol=1e-5), (dh.double() - h64.grad).abs().max()
            assert torch.allclose(a.double(), out.detach(), rtol=1e-6, atol=1e-6)
        else:
            assert _one_rounding(dh, h64.grad.float()) and _one_rounding(a, out.detach().float())
            g32, u32 = h.float().chunk(2, dim=-1)
            assert torch.equal(a, (F.gelu(g32, approximate="tanh") * u32).to(dtype))
        zero = h.chunk(2, dim=-1)[0] == 0
        assert zero.sum() == 3 and (a[zero] == 0).all() and (dh[:, 8:][zero] == 0).all()
        assert torch.equal(dh[:, :8][zero], (da_t.float() * h[:, 8:].float() * 0.5)[zero].to(dtype))
    # another gradient than SwiGLU's on these inputs
    assert not torch.allclose(dh.float(), swiglu_backward(h, da_t, backend="torch")[0].float(), rtol=1e-2, atol=1e-2)


def test_geglu_refuses_what_it_does_not_implement():
    for bad in (dict(alpha=1.702), dict(limit=7.0), dict(up_offset=1.0), dict(limit=7.0, clamp_activated=True)):
        with pytest.raises(ValueError, match="gelu_tanh GLU .GeGLU. takes no alpha, limit or up_offset"):
            GLU(gate_act="gelu_tanh", **bad)
    with pytest.raises(ValueError, match="gate_act must be one of"):
        GLU(gate_act="gelu")


def test_slot_grads_by_hand():
    """g = dout · w per row, dw = the row dot of dout and y (worked by hand)."""
    dout = torch.tensor([[1.0, 2.0], [3.0, -1.0]])
    w = torch.tensor([[0.5], [2.0]])
    y = torch.tensor([[4.0, 1.0], [1.0, 5.0]])
    g, dw = slot_grads(dout, w, y)
    assert torch.equal(g, torch.tensor([[0.5, 1.0], [6.0, -2.0]]))
    assert torch.equal(dw, torch.tensor([6.0, -2.0]))


def test_bad_shapes():
    with pytest.raises(ValueError, match=r"\[M, 2I\]"):
        swiglu_backward(torch.randn(3, 5), torch.randn(3, 2))


if __name__ == "__main__" and sys.argv[1:2] == ["interpreter"]:
    from interpreter import main

    main(INTERPRETER_CHECKS, sys.argv[2:])
