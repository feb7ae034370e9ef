"""The head when the loss is not known in the forward (linear_logprobs, per-token cross-entropy): an autograd
function from (hidden, weight) to the per-token tz, lse and ent, whose backward recomputes the logits. Four
logits-sized GEMMs in all: one in the forward, three in the backward.

Shape legend: T tokens, H hidden size, V vocab rows on this rank, Tc/Vc chunk sizes. x = logits / temperature (the
logits soft-capped first when head.softcap is set: numerics.py).

Forward: per token chunk of whole vocabulary rows, the logits GEMM with the statistics in its epilogue
(kmod.logits_tiles, writing no logits); chunks of the vocabulary (chunk_vocab) are merged like vocab splits.
Backward: vocab-outer loop. For each vocab chunk Vc, for each token chunk Tc: the GEMM library writes the fp32 logits
chunk and a streaming kernel turns it into dZ [Tc, Vc] (fp16 with a power-of-two scale for 16-bit inputs), then two
GEMMs with fp32 accumulation:
    dW[Vc]  = sum over token chunks of dZ^T h    (fp32 accumulator for the chunk, written to dW once)
    dH32   += dZ w[Vc]                           (fp32 [T, H] accumulator, cast to the input dtype once)
No 16-bit read-modify-write anywhere. Vocab-parallel: statistics combined over tp_group, dH all-reduced over it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from kernels.lm_head.numerics import (
    GEMM_ALIGN, LN2, PARTS_PER_TILE, Coefficients, Head, backward_operands, cap_target_term, combine_over_group,
    combine_splits, downcast_in_place, gemm_acc, logits_fp32)

BACKWARD_SCRATCH_BYTES = 128 * 2**20  # the fp32 logits chunk's budget; see chunk_sizes
FORWARD_PARTS_BYTES = 256 * 2**20  # the forward's per-tile statistics of one token chunk
DEFAULT_CHUNK_VOCAB = 8192


def forward_stats(head: Head, with_entropy: bool, chunk_tokens, chunk_vocab):
    """(lse, ent, tz) [T]: the logits GEMM with the statistics in its epilogue, per token chunk of whole vocabulary
    rows (or per vocab chunk when chunk_vocab is given); chunks are merged like vocab splits."""
    hidden_TH, weight_VH, tgt_T = head.hidden, head.weight, head.tgt
    T, V = hidden_TH.shape[0], weight_VH.shape[0]
    Vc = V if chunk_vocab is None else min(V, int(chunk_vocab))
    if chunk_tokens is None:
        # the per-tile statistics [3, num_tiles, Tc] fill FORWARD_PARTS_BYTES: V = 248,320 in 256-wide tiles is 970
        # tiles, Tc = 256 MiB / (12 B x 970) -> 23,040 tokens: GEMMs of 23,040 x 248,320 x H
        Tc = max(256, FORWARD_PARTS_BYTES // (4 * PARTS_PER_TILE * -(-Vc // 256)) // 256 * 256)
    else:
        Tc = int(chunk_tokens)
    Tc = max(1, min(T, Tc))
    num_splits = -(-V // Vc)
    # three separate [S, T] arrays: the loss may keep lse alone
    lse_ST, ent_ST, tz_ST = (torch.empty((num_splits, T), dtype=torch.float32, device=hidden_TH.device)
                             for _ in range(3))
    for si, v0 in enumerate(range(0, V, Vc)):
        v1 = min(v0 + Vc, V)
        for t0 in range(0, T, Tc):
            t1 = min(t0 + Tc, T)
            st = head.kmod.logits_tiles(hidden_TH[t0:t1], weight_VH[v0:v1], tgt_T[t0:t1] - v0, head.inv_temp,
                                        with_entropy, softcap=head.softcap)
            torch.mul(st.lse2, LN2, out=lse_ST[si, t0:t1])
            ent_ST[si, t0:t1] = st.ent
            tz_ST[si, t0:t1] = st.tz
    if num_splits == 1:
        return lse_ST[0], ent_ST[0], tz_ST[0]
    return combine_splits(lse_ST, ent_ST, tz_ST)


def chunk_sizes(T: int, V: int, chunk_tokens, chunk_vocab) -> tuple[int, int]:
    """(Tc, Vc) of the backward. Worked example (bf16, T = 65,536, V = 248,320, H = 2048): Vc = 8192; the fp32 logits
    chunk (4 B) sits beside dZ (2 B), so Tc = 128 MiB / (8192 x 4 B) = 4096: 128 MiB of logits + 64 MiB of dZ + the
    dW chunk accumulator 8192 x 2048 x 4 B = 64 MiB; the GEMMs are 4096 x 8192 x 2048 (137 GFLOP), large enough for
    cuBLAS to run near peak."""
    Vc = min(V, chunk_vocab or DEFAULT_CHUNK_VOCAB)
    if chunk_tokens is None:
        chunk_tokens = max(256, BACKWARD_SCRATCH_BYTES // (Vc * 4) // 256 * 256)
    return max(1, min(T, chunk_tokens)), Vc


def vocab_chunks(V: int, Vc: int) -> list[tuple[int, int]]:
    """The backward's vocabulary chunks [(v0, v1)]: Vc rows each, the last one split where its rows stop being a
    multiple of GEMM_ALIGN, so that every chunk but a last one of fewer than GEMM_ALIGN rows gives cuBLAS aligned
    extents (numerics.aligned_width: an odd vocabulary otherwise runs the last chunk's GEMMs on align-1 kernels).
    V = 128,167, Vc = 8192: 15 chunks of 8192, then 5,248 and 39."""
    cuts = list(range(0, V, Vc)) + [V]
    last = cuts[-2] + (V - cuts[-2]) // GEMM_ALIGN * GEMM_ALIGN
    if cuts[-2] < last < V and Vc % GEMM_ALIGN == 0:
        cuts.insert(-1, last)
    return list(zip(cuts[:-1], cuts[1:]))


def backward_chunks(head: Head, coef: Coefficients, need_h: bool, need_w: bool, chunk_tokens, chunk_vocab):
    """(dH, dW), each None unless needed. Vocab-outer, token-inner. For 16-bit inputs dZ and both GEMMs run in fp16
    with power-of-two scales (exact to apply and undo): fp16 keeps 11 significant bits where bf16 keeps 8, so the dZ
    operand rounds 8x finer; the scales keep every operand inside fp16's range. fp32 inputs run in fp32."""
    hidden_TH, weight_VH, tgt_T = head.hidden, head.weight, head.tgt
    T, H = hidden_TH.shape
    V = weight_VH.shape[0]
    if T == 0:  # no tokens: the chunk loops below never write their accumulators
        return (torch.zeros_like(hidden_TH) if need_h else None), (torch.zeros_like(weight_VH) if need_w else None)
    Tc, Vc = chunk_sizes(T, V, chunk_tokens, chunk_vocab)
    dev = hidden_TH.device
    f32 = dict(dtype=torch.float32, device=dev)
    ops = backward_operands(head, coef)
    if ops.dtype != torch.float32:
        # 16-bit operands of the backward GEMMs, scaled by a power of two and converted in one pass each
        h_buf = torch.empty((Tc, H), dtype=ops.dtype, device=dev)
        w_buf = torch.empty((Vc, H), dtype=ops.dtype, device=dev)
        # (bf16 x 0-dim fp32 computes in bf16, exact for a power of two, then casts to fp16 on the write)
    dH32_TH = torch.empty((T, H), **f32) if need_h else None
    dW_VH = torch.empty_like(weight_VH) if need_w else None
    dZ_buf = torch.empty((Tc, Vc), dtype=ops.dtype, device=dev)
    z_buf = torch.empty((Tc, Vc), **f32)
    dW32_buf = torch.empty((Vc, H), **f32) if need_w else None
    for v0, v1 in vocab_chunks(V, Vc):
        w_vH = weight_VH[v0:v1]
        w_g = w_vH if ops.dtype == w_vH.dtype else torch.mul(w_vH, ops.w_scale, out=w_buf[: v1 - v0])
        for t0 in range(0, T, Tc):
            t1 = min(t0 + Tc, T)
            h_tH = hidden_TH[t0:t1]
            dZ_tv = dZ_buf[: t1 - t0, : v1 - v0]
            z_tv = z_buf[: t1 - t0, : v1 - v0]
            logits_fp32(h_tH, w_vH, z_tv)
            head.kmod.dlogits_from_logits(z_tv, tgt_T[t0:t1], v0, coef.rows(t0, t1), head.inv_temp, ops.dz_scale,
                                          dZ_tv, softcap=head.softcap)
            if need_w:
                h_g = h_tH if ops.dtype == h_tH.dtype else torch.mul(h_tH, ops.h_scale, out=h_buf[: t1 - t0])
                gemm_acc(dW32_buf[: v1 - v0], dZ_tv.T, h_g, first=(t0 == 0))
            if need_h:
                gemm_acc(dH32_TH[t0:t1], dZ_tv, w_g, first=(v0 == 0))
        if need_w:
            dW_VH[v0:v1].copy_(dW32_buf[: v1 - v0].mul_(1.0 / (ops.dz_scale * ops.h_scale)))
    del dZ_buf, dW32_buf, z_buf
    dH_TH = None
    if need_h:
        dH32_TH.mul_(1.0 / (ops.dz_scale * ops.w_scale))
        if head.tp_group is not None:
            dist.all_reduce(dH32_TH, group=head.tp_group)  # hidden is replicated over the group: sum the partials
        if hidden_TH.dtype == torch.float32:
            dH_TH = dH32_TH
        elif hidden_TH.element_size() == 2:
            dH_TH = downcast_in_place(dH32_TH, hidden_TH.dtype)
        else:
            dH_TH = dH32_TH.to(hidden_TH.dtype)
    return dH_TH, dW_VH


class TokenStats(torch.autograd.Function):
    """(hidden, weight, head, with_entropy, chunks) -> (tz, lse, ent) [T] fp32; `head` carries the local target,
    1 / temperature, the group, the backend and the cap (its hidden and weight are the same tensors as the
    inputs)."""

    @staticmethod
    def forward(ctx, hidden_TH, weight_VH, head: Head, with_entropy, chunk_tokens, chunk_vocab):
        lse_T, ent_T, tz_T = forward_stats(head, with_entropy, chunk_tokens, chunk_vocab)
        if head.tp_group is not None:
            lse_T, ent_T, tz_T = combine_over_group(lse_T, ent_T, tz_T, head.tp_group)
        if not with_entropy:
            ent_T = torch.zeros_like(lse_T)
        # tz for the cap's slope at the target (numerics.cap_target_term)
        ctx.save_for_backward(hidden_TH, weight_VH, head.tgt, lse_T, ent_T if with_entropy else None,
                              tz_T if head.softcap is not None else None)
        ctx.cfg = (head.inv_temp, head.tp_group, head.kmod, head.softcap, with_entropy, chunk_tokens, chunk_vocab)
        if not with_entropy:
            ctx.mark_non_differentiable(ent_T)
        return tz_T, lse_T, ent_T

    @staticmethod
    def backward(ctx, g_tz, g_lse, g_ent):
        hidden_TH, weight_VH, tgt_T, lse_T, ent_T, tz_T = ctx.saved_tensors
        inv_temp, tp_group, kmod, softcap, with_entropy, chunk_tokens, chunk_vocab = ctx.cfg
        # dloss/dx = p (a + b x) + c [target]; without an entropy gradient b = 0 and a = g_lse itself
        g_tz = torch.zeros_like(lse_T) if g_tz is None else g_tz.float().contiguous()
        g_lse = torch.zeros_like(lse_T) if g_lse is None else g_lse.float().contiguous()
        has_b = with_entropy and g_ent is not None
        a_T = (g_lse + g_ent.float() * (lse_T - ent_T)).contiguous() if has_b else g_lse
        b_T = (-g_ent.float()).contiguous() if has_b else torch.zeros_like(lse_T)  # (the dZ kernel reads b)
        head = Head(hidden_TH, weight_VH, tgt_T, inv_temp, tp_group, kmod, softcap)
        coef = cap_target_term(Coefficients(lse_T, a_T, b_T, g_tz), tz_T, softcap, inv_temp)
        dH_TH, dW_VH = backward_chunks(head, coef, ctx.needs_input_grad[0], ctx.needs_input_grad[1], chunk_tokens,
                                       chunk_vocab)
        return dH_TH, dW_VH, None, None, None, None
