"""The fused head: a loss whose per-token gradient is known as soon as the token's statistics are, in three
logits-sized GEMMs instead of four (docs/kernels.md, "Three GEMMs: the fused path"). The default of
linear_cross_entropy (mean or sum) and linear_policy_loss, and what the trainer runs (`lm_head: fused`).

Shape legend: T tokens, H hidden size, V vocab rows on this rank, Tg tokens per group (M of the logits GEMM, K of
the dW GEMM). x = logits / temperature (the logits soft-capped first when head.softcap is set: numerics.py).

The autograd path (kernels/lm_head/token_stats.py) cannot know dloss/dx until autograd calls its backward, so it
runs the logits GEMM twice: once for the statistics in the forward and once, recomputed, for dx. Here the loss is
given to the kernel as a per-token function `token_loss(tz, lse, ent, t0, t1) -> [t1 - t0]` whose contributions sum
to the loss (every loss of launch/rl.py and mean/sum cross-entropy is of this form: the normalizers are fixed by the
masks before the head runs). Then, per group of Tg tokens:

    z -> tile stats, e     h_group @ W^T in fp32 registers (GEMM 1, Triton, persistent TMA kernel on Hopper); per
                           [128, 256] tile, the epilogue keeps each row's max m, log-sum-exp, entropy and target x
                           ([num_tiles, Tg] arrays, merged like vocab splits) and stores 2^14 e, e = exp(x - m),
                           in fp16 (e is in (0, 1]: 11 significant bits whatever |x| is)
    (a, b, c)              autograd of token_loss on the group's [Tg] vectors (kernels/lm_head/numerics.py)
    dZ = s . dloss/dz      p = e exp(m - lse), fp16 with a power-of-two scale s, written over e in place
    dH[group] = dZ @ W16   cuBLAS, fp32 accumulation inside one call  (GEMM 2)
    dW32 += dZ^T @ h16     cuBLAS, fp32 C: the only cross-group accumulation (GEMM 3)

Exactness is the autograd path's: fp32 logits and statistics, fp16 e / dZ / h / W operands with exact power-of-two
scales (11 significant bits, 8x finer than bf16), fp32 accumulation everywhere, no 16-bit read-modify-write.
What it costs: an fp32 [V, H] dW accumulator (1.9 GiB at V = 248,320, H = 2048), an fp16 copy of W (0.95 GiB)
and the group buffer (SCRATCH_BYTES), all freed before the forward returns except dH and dW, which the
backward scales by the upstream gradient of the loss (a scalar).
Vocab-parallel: the statistics of each group are combined over tp_group before the loss sees them (all ranks run
the same token_loss on the same numbers), and dH is summed over the group at the end.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

import torch
import torch.distributed as dist

from kernels.lm_head.numerics import (
    LN2, LOG2E, Coefficients, Head, TileStats, aligned_width, amax, cap_target_term, combine_over_group, dz_scale,
    gemm_acc, pow2_scale)

SCRATCH_BYTES = 2 * 2**30  # the most the group buffer of tile weights [Tg, V] holds (dZ is written over them)
# The most tokens a group: the logits GEMM keeps the group's hidden block in L2 while it sweeps the vocabulary, and
# at H = 2048 4096 rows (16 MiB) measured best on an H200: at V = 151,936 a 6912-token group (the 2 GiB budget)
# ran its GEMM at 612 TF/s against 647 for 4096, and the whole mean CE 0.5% slower sustained; 2048 tokens, whose dW
# GEMM reads and writes its fp32 C twice as often, 2.6 to 3% slower at both vocab sizes (docs/BENCHMARKS.md).
GROUP_TOKENS = 4096

TokenLoss = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int, int], torch.Tensor]


@dataclass(frozen=True)
class Totals:
    """What a run gathers over its token groups: tz, lse, ent fp32 [T] (combined over tp_group; ent zeros unless
    asked for) and the loss (0-d fp32, the sum of every group's contributions)."""

    tz: torch.Tensor
    lse: torch.Tensor
    ent: torch.Tensor
    loss: torch.Tensor

    @staticmethod
    def empty(T: int, with_entropy: bool, device) -> "Totals":
        f32 = dict(dtype=torch.float32, device=device)
        ent = (torch.empty if with_entropy else torch.zeros)(T, **f32)
        return Totals(torch.empty(T, **f32), torch.empty(T, **f32), ent, torch.zeros((), **f32))


class HostScalar:
    """A 0-d fp32 device tensor's value on the host without draining the stream: start() queues its copy into
    pinned memory and an event after it; wait() blocks only until that copy is done, so the work queued between the
    two keeps the GPU busy while the host waits. One value in flight at a time. (On CPU: a plain read.)"""

    def __init__(self, device):
        self.cuda = torch.device(device).type == "cuda"
        self.buf = torch.empty((), dtype=torch.float32, pin_memory=True) if self.cuda else None
        self.event = torch.cuda.Event() if self.cuda else None
        self.value = None

    def start(self, t: torch.Tensor) -> None:
        if self.cuda:
            self.buf.copy_(t, non_blocking=True)
            self.event.record()
        else:
            self.value = t

    def wait(self) -> float:
        if self.cuda:
            self.event.synchronize()
            return float(self.buf)
        return float(self.value)


def group_size(T: int, V: int, chunk_tokens: int | None, elem_bytes: int = 2) -> int:
    """Tg, tokens per group: GROUP_TOKENS, or fewer (multiples of 256) where the group's tile weights [Tg, V]
    (elem_bytes each: 2 for 16-bit inputs, 4 for fp32) would not fit SCRATCH_BYTES. Worked example,
    V = 248,320, bf16: 2 B x 4096 x V = 1.9 GiB fits, so Tg = 4096: the logits GEMM is 4096 x 248,320 x 2048
    (4.2 TFLOP), and so are the dH and dW GEMMs; the dW GEMM's fp32 C (1.9 GiB read + written) is touched
    T / 4096 = 16 times at T = 65,536. V = 151,936: also 4096 (1.16 GiB)."""
    if chunk_tokens is None:
        Tg = min(GROUP_TOKENS, max(256, SCRATCH_BYTES // (elem_bytes * V) // 256 * 256))
    else:
        Tg = int(chunk_tokens)
    return max(1, min(T, Tg))


def _coefficients(token_loss: TokenLoss, tz, lse, ent, t0: int, t1: int, with_entropy: bool):
    """The group's Coefficients (a, b, c of dloss/dx_v = p_v (a + b x_v) + c [v == target]) from the gradients of
    its loss contributions with respect to tz, lse and ent, and the contributions' sum. Without the entropy b = 0
    and is None (a = g_lse: nothing else to form)."""
    leaves = [tz.detach().requires_grad_(), lse.detach().requires_grad_(), ent.detach().requires_grad_()]
    with torch.enable_grad():
        contrib = token_loss(leaves[0], leaves[1], leaves[2] if with_entropy else None, t0, t1)
        total = contrib.sum()
        wrt = leaves if with_entropy else leaves[:2]
        # a loss that does not depend on the head's outputs (a constant) has no gradient
        grads = torch.autograd.grad(total, wrt, allow_unused=True) if total.requires_grad else [None] * len(wrt)
    g_tz, g_lse = (torch.zeros_like(lse) if g is None else g.float().contiguous() for g in grads[:2])
    if not with_entropy or grads[2] is None:
        return Coefficients(lse, g_lse, None, g_tz), total.detach().float()
    g_ent = grads[2].float()
    return (Coefficients(lse, (g_lse + g_ent * (lse - ent)).contiguous(), (-g_ent).contiguous(), g_tz),
            total.detach().float())


def group_statistics(head: Head, g0: int, g1: int, with_entropy: bool, token_loss: TokenLoss, e_gV,
                     totals: Totals, parts=None) -> tuple[TileStats, Coefficients]:
    """The first steps of a token group [g0, g1): the logits GEMM with its tile statistics (the weights into e_gV),
    the rows' lse, entropy and target logit (combined over tp_group) into totals[g0:g1], the loss's coefficients,
    and its contribution added to totals.loss. Returns the tile statistics (lse2 combined over the group) and the
    coefficients (with a cap, c times the target's slope: numerics.cap_target_term)."""
    st = head.kmod.logits_tiles(head.hidden[g0:g1], head.weight, head.tgt[g0:g1], head.inv_temp, with_entropy, e_gV,
                                parts=parts, softcap=head.softcap)
    lse = torch.mul(st.lse2, LN2, out=totals.lse[g0:g1])
    lse2, ent, tz = st.lse2, st.ent, st.tz
    if head.tp_group is not None:
        lse_c, ent, tz = combine_over_group(lse, ent, tz, head.tp_group)
        lse.copy_(lse_c)
        lse2 = lse * LOG2E
    if with_entropy:
        totals.ent[g0:g1].copy_(ent)
    totals.tz[g0:g1].copy_(tz)
    coef, part = _coefficients(token_loss, totals.tz[g0:g1], lse, totals.ent[g0:g1], g0, g1, with_entropy)
    totals.loss.add_(part)
    return TileStats(st.m2, st.tile_v, lse2), cap_target_term(coef, totals.tz[g0:g1], head.softcap, head.inv_temp)


def fused_run(head: Head, token_loss: TokenLoss, with_entropy: bool, chunk_tokens, need_h: bool, need_w: bool):
    """The loss and its gradients in one pass. Returns (Totals, dH [T, H] or None, dW [V, H] or None)."""
    hidden_TH, weight_VH = head.hidden, head.weight
    T, H = hidden_TH.shape
    V = weight_VH.shape[0]
    in_dtype = hidden_TH.dtype
    half = hidden_TH.element_size() == 2
    if not half and in_dtype != torch.float32:  # fp64 and the like: the kernels compute in fp32
        hidden_TH, weight_VH = hidden_TH.float(), weight_VH.float()
        head = replace(head, hidden=hidden_TH, weight=weight_VH)
    dev = hidden_TH.device
    f32 = dict(dtype=torch.float32, device=dev)
    e_dtype = torch.float16 if half else torch.float32
    elem = 2 if half else 4
    # the group's tile weights e = exp(x - tile max), then its dZ in the same place (fp16 for 16-bit inputs); for
    # 16-bit inputs the vocabulary extent of the gradient GEMMs is padded to Vp: the logits GEMM writes e = 0 past
    # V, so dZ's extra columns are 0, W16's extra rows are zeros and dW32's extra rows come out 0 (aligned_width)
    Tg = group_size(T, V, chunk_tokens, elem)
    Vp = aligned_width(V, head.kmod.tile_vocab(hidden_TH)) if half else V
    e_buf = torch.empty((Tg, Vp), dtype=e_dtype, device=dev)
    if half:
        h_scale_f = float(pow2_scale(amax(hidden_TH)))
        w_scale_f = float(pow2_scale(amax(weight_VH)))
        w_g = None
        if need_h:  # one pass, bf16 x a power of two (exact) stored as fp16
            w_g = torch.empty((Vp, H), dtype=torch.float16, device=dev)
            w_g[V:].zero_()
            torch.mul(weight_VH, w_scale_f, out=w_g[:V])
        h_buf = torch.empty((Tg, H), dtype=torch.float16, device=dev) if need_w else None
    else:
        w_g, h_buf, h_scale_f, w_scale_f = weight_VH, None, 1.0, 1.0
    # the first group's GEMM writes it (beta = 0); no tokens, no group: zeros
    dW32 = (torch.empty if T else torch.zeros)((Vp, H), **f32) if need_w else None
    dH32 = torch.empty((T, H), **f32) if (need_h and head.tp_group is not None) else None
    dH = torch.empty_like(hidden_TH) if (need_h and head.tp_group is None) else None
    dH_buf = torch.empty((Tg, H), **f32) if dH is not None else None  # one group's fp32 dH, cast into dH
    totals = Totals.empty(T, with_entropy, dev)

    scale_host = HostScalar(dev)
    for g0 in range(0, T, Tg):
        g1 = min(g0 + Tg, T)
        dz_gV = e_buf[: g1 - g0]  # [rows, Vp]: the zero columns past V are the GEMMs' padding
        tiles, coef = group_statistics(head, g0, g1, with_entropy, token_loss, dz_gV, totals)
        scale = dz_scale(coef, head.inv_temp) if half else torch.ones((), **f32)
        # cuBLAS takes alpha from the host: the scale's copy is queued before the dZ pass and the h operand, so the
        # host has it while the GPU runs them and queues the GEMMs before the GPU runs dry
        scale_host.start(scale)
        head.kmod.dlogits_from_tiles(dz_gV, tiles, head.tgt[g0:g1], tiles.lse2, coef, head.inv_temp, scale,
                                     softcap=head.softcap)
        if need_w:
            h_g = hidden_TH[g0:g1] if not half else torch.mul(hidden_TH[g0:g1], h_scale_f, out=h_buf[: g1 - g0])
        s = scale_host.wait()
        if need_h:
            dh_out = dH32[g0:g1] if dH32 is not None else dH_buf[: g1 - g0]  # the group's dH rows, fp32
            gemm_acc(dh_out, dz_gV, w_g, first=True, alpha=1.0 / (s * w_scale_f))
            if dH is not None:
                dH[g0:g1].copy_(dh_out)
        if need_w:
            gemm_acc(dW32, dz_gV.T, h_g, first=(g0 == 0), alpha=1.0 / (s * h_scale_f))
    del e_buf, w_g, h_buf, dH_buf
    if dH32 is not None:
        dist.all_reduce(dH32, group=head.tp_group)
        dH = dH32
    dW = None if dW32 is None else dW32[:V].to(in_dtype)  # (a no-op for fp32)
    if dH is not None:
        dH = dH.to(in_dtype)
    return totals, dH, dW


class LossInHead(torch.autograd.Function):
    """(hidden, weight, head, run) -> (loss, tz, lse, ent): `run(need_h, need_w)` computes the loss and both
    gradients in the forward (fused_run, or kernels/lm_head/lean.py's lean_run); the backward scales the stored
    gradients by the upstream gradient of the loss."""

    @staticmethod
    def forward(ctx, hidden_TH, weight_VH, run):
        totals, dH, dW = run(ctx.needs_input_grad[0], ctx.needs_input_grad[1])
        ctx.grads = (dH, dW)  # intermediates, not inputs or outputs: held on ctx until the backward
        ctx.mark_non_differentiable(totals.tz, totals.lse, totals.ent)
        return totals.loss, totals.tz, totals.lse, totals.ent

    @staticmethod
    def backward(ctx, g_loss, *_):
        dH, dW = ctx.grads
        ctx.grads = None
        g = float(g_loss)  # one sync; a Python scalar multiplies in fp32 and rounds once
        if g != 1.0:
            dH = None if dH is None else dH.mul_(g)
            dW = None if dW is None else dW.mul_(g)
        return dH, dW, None
