"""The lean head (kernels/lm_head/lean.py: the loss handed to the head, nothing beside the two gradients but a few
MiB, the scratch carved out of dW's own storage) on the torch backend: its chunk plans, worked by hand at the
target shape, and its results against the float64 reference with chunks small enough to cross every kind."""

from __future__ import annotations

import pytest
import torch

import kernels
from kernels.lm_head.reference import linear_cross_entropy_reference
from lm_head_checks import check_cross_entropy, check_policy_loss, inputs, ref_grads, rel, small_lean_chunks

H, V, T = 2048, 248320, 65536  # the target shape: Qwen3.5's vocabulary, 64K tokens


def test_weight_pass_uses_own_rows_then_a_small_tail():
    # pass W runs in its own rows except the last rows, whose scratch is the one external buffer (1.6 MiB at most)
    from kernels.lm_head import lean as L

    need_w, need_direct = L._needs(H, 2, True, 256)
    plan = L.plan_vocab_pass(V, T, H * 2, need_w, need_direct)
    assert plan[0][:3] == (0, 8192, 8192) and plan[-1][1] == V
    assert all(a[1] == b[0] for a, b in zip(plan, plan[1:]))  # contiguous, in order
    for v0, v1, tc, own, direct in plan:  # an own chunk's scratch fits in the rows after it
        assert (not own) or (need_direct if direct else need_w)(tc, v1 - v0) <= (V - v1) * H * 2
    kinds = [(own, direct) for _, _, _, own, direct in plan]
    assert kinds.index((True, True)) > kinds.index((True, False)) and kinds[-1] == (False, True)
    tail = [c for c in plan if not c[3]]
    assert 0 < sum(c[1] - c[0] for c in tail) <= 2048 and need_direct(*L.tail_chunks(T, V)) < 1.6 * 2**20
    assert sum(-(-T // c[2]) for c in plan) < 1100  # launches: chunks x token chunks


def test_group_fits_in_the_weight_gradient():
    # 4096-token groups do not fit dW's 0.95 GiB, 1536 do (e 1536 x 248,320 x 2 B = 0.763 GB + 17.9 MB of statistics
    # + 12.6 MB of dH32 + a 134 MB fp16 chunk of W = 0.928 GB <= 1.017 GB; 1792: 1.060 GB); a tiny budget falls to
    # the last few tokens
    from kernels.lm_head import lean as L

    shape = L.GroupShape(V, H, 2, 256, True, L.GROUP_DH_VOCAB)
    tg = shape.tokens(V * H * 2, T, None)
    assert tg == 1536 and shape.need(tg) <= V * H * 2 < shape.need(1792)
    assert shape.tokens(V * H * 2, 300, None) == 300  # a short batch: one group
    # 10 tokens' weights of budget, no dH: each token also has 970 tiles x 12 B of statistics, so 9 fit (9.77)
    assert L.GroupShape(V, H, 2, 256, False, 0).tokens(10 * V * 2, T, None) == 9
    # a frozen head (no dW to borrow): EXTERNAL_BYTES of tokens at 516,472 B each (weights, statistics, dH32): 129,
    # beside a 32 MiB chunk of W
    ext = L.GroupShape(V, H, 2, 256, True, L.EXTERNAL_DH_VOCAB)
    assert ext.tokens(L.EXTERNAL_BYTES + ext.need(0), T, None) == 129


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_lean_against_the_reference_torch(dtype, monkeypatch):
    # mean CE and a policy loss: pass 1 in token groups inside dW's bytes (W converted a chunk at a time for the dH
    # GEMM), then pass W over every kind of chunk (own rows with cuBLAS, own rows direct, the tail); several groups
    from kernels.lm_head import lean as L

    small_lean_chunks(monkeypatch)
    kinds = {c[3:] for c in L.plan_vocab_pass(301, 37, 48 * 2, *L._needs(48, 2, True, 16))}  # the bf16 case
    assert kinds == {(True, False), (True, True), (False, True)}  # cuBLAS in own rows, direct, tail
    gt = {torch.bfloat16: 3e-3, torch.float16: 5e-4}.get(dtype)  # 16-bit: the outputs' own rounding
    f32 = dtype in (torch.float32, torch.float64)  # (fp64 inputs run in fp32)
    errs = check_cross_entropy(37, 48, 301, backend="torch", tol=2e-6 if f32 else 1e-5, grad_tol=gt, mode="lean",
                               chunk_tokens=12, reduction="mean", z_loss=1e-3, temperature=0.7, dtype=dtype)
    check_cross_entropy(37, 48, 301, backend="torch", tol=2e-6 if f32 else 1e-5, grad_tol=gt, mode="lean",
                        reduction="sum", dtype=dtype)
    check_policy_loss(29, 40, 257, backend="torch", tol=2e-5, grad_tol=gt, chunk_tokens=8, temperature=1.3,
                      dtype=dtype, mode="lean", adv_spread=1e3)
    monkeypatch.setattr(L, "GROUP_DH_VOCAB", 64)  # the dH GEMM over 5 chunks of W, the last partial
    monkeypatch.setattr(L, "EXTERNAL_DH_VOCAB", 64)
    errs2 = check_cross_entropy(37, 48, 301, backend="torch", tol=2e-6 if f32 else 1e-5, grad_tol=gt, mode="lean",
                                chunk_tokens=12, dtype=dtype)
    assert errs["dH"] < (gt or 2e-6) and errs2["dH"] < (gt or 2e-6)
    # and a frozen head, whose group scratch is a buffer of its own
    hidden, weight, target = inputs(37, 48, 301, dtype=dtype)
    w = weight.detach().requires_grad_(False)
    kernels.linear_cross_entropy(hidden, w, target, mode="lean", backend="torch", chunk_tokens=12).backward()
    _, rdh, _ = ref_grads(linear_cross_entropy_reference, hidden, weight, target)
    assert rel(hidden.grad, rdh) < (gt or 2e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lean_softcap_torch(dtype, monkeypatch):
    # logits c tanh(z / c) before the temperature, z of std 3 against a cap of 3 (the checks assert the capped and
    # uncapped references differ by far more than their limits): pass 1's dH and pass W's recomputed dZ both carry the
    # slope, over every kind of chunk
    small_lean_chunks(monkeypatch)
    gt = 3e-3 if dtype == torch.bfloat16 else None
    check_cross_entropy(37, 48, 301, backend="torch", tol=2e-6 if gt is None else 1e-5, grad_tol=gt, mode="lean",
                        chunk_tokens=12, temperature=0.7, softcap=3.0, dtype=dtype)
    check_policy_loss(29, 40, 257, backend="torch", tol=2e-5, grad_tol=gt, chunk_tokens=8, temperature=1.3,
                      dtype=dtype, mode="lean", softcap=3.0)


@pytest.mark.parametrize("frozen", ["weight", "hidden"])
def test_one_gradient_only_torch(frozen, monkeypatch):
    # dH alone (a frozen head) borrows no storage; dW alone skips the dH GEMM
    small_lean_chunks(monkeypatch)
    hidden, weight, target = inputs(23, 16, 77)
    ref_loss, rdh, rdw = ref_grads(linear_cross_entropy_reference, hidden, weight, target)
    h = hidden.detach().clone().requires_grad_(frozen != "hidden")
    w = weight.detach().clone().requires_grad_(frozen != "weight")
    loss = kernels.linear_cross_entropy(h, w, target, mode="lean", backend="torch", chunk_tokens=8)
    loss.backward()
    got, ref = (h.grad, rdh) if frozen == "weight" else (w.grad, rdw)
    assert rel(got, ref) < 2e-6 and (w.grad if frozen == "weight" else h.grad) is None
    assert rel(loss, ref_loss) < 1e-6
