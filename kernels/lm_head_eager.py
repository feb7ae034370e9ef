"""Eager-gradient LM head: a loss whose per-token gradient is known as soon as the token's statistics are, in
three logits-sized GEMMs instead of four (docs/kernels.md, "Three GEMMs: the eager path").

Shape legend: T tokens, H hidden size, V vocab rows on this rank, Tg tokens per gradient group (K of the dW GEMM),
Tl tokens per logits chunk (Tg = n·Tl). x = logits / temperature.

The generic path (kernels/lm_head.py) cannot know dloss/dx until autograd calls its backward, so it runs the logits
GEMM twice: once for the statistics in the forward and once, recomputed, for dx. Here the loss is given to the
kernel as a per-token function `token_loss(tz, lse, ent, t0, t1) -> [t1 - t0]` whose contributions sum to the loss
(every loss of launch/rl.py and mean/sum cross-entropy is of this form: the normalizers are fixed by the masks
before the head runs). Then, per group of Tg tokens:

    for each logits chunk of Tl tokens:
        z    = h_chunk @ W^T                    fp32 [Tl, V]      cuBLAS (GEMM 1)
        stats (lse, ent, tz) of z               streaming Triton kernel, vocab-split, one read of z
        g    = autograd of token_loss on the chunk's [Tl] vectors (a, b, c coefficients, as in lm_head.py)
        dZ   = s · dloss/dz                     fp16 with a power-of-two scale s, into the group's [Tg, V] buffer
    dH[group] = dZ @ W16                        cuBLAS, fp32 accumulation inside one call  (GEMM 2)
    dW32     += dZ^T @ h16                      cuBLAS, fp32 C: the only cross-group accumulation (GEMM 3)

Exactness is the generic path's: fp32 logits and statistics, fp16 dZ / h / W operands with exact power-of-two
scales (11 significant bits, 8x finer than bf16), fp32 accumulation everywhere, no 16-bit read-modify-write.
What it costs: an fp32 [V, H] dW accumulator (1.9 GiB at V = 248,320, H = 2048), an fp16 copy of W (0.95 GiB)
and the chunk buffers (EAGER_SCRATCH_BYTES), all freed before the forward returns except dH and dW, which the
backward scales by the upstream gradient of the loss (a scalar).
Vocab-parallel: the statistics of each chunk are combined over tp_group before the loss sees them (all ranks run
the same token_loss on the same numbers), and dH is summed over the group at the end.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist

from kernels import lm_head as _lh

EAGER_SCRATCH_BYTES = 1536 * 2**20  # dZ group [Tg, V] fp16 + logits chunk [Tl, V] fp32, Tl = Tg / 4

TokenLoss = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int, int], torch.Tensor]


def chunk_sizes(T: int, V: int, chunk_tokens: int | None) -> tuple[int, int]:
    """(Tg, Tl). Worked example, V = 248,320: 3·Tg·V bytes <= 1.5 GiB gives Tg = 2048 (a multiple of 512), Tl =
    512: dZ 0.95 GiB + logits 0.47 GiB. The dW GEMM then has K = 2048 (2.1 TFLOP a call, cuBLAS-sized) and its
    fp32 C (1.9 GiB read + written) is touched T / 2048 = 32 times at T = 65,536: 121 GB, mostly hidden under
    the GEMM's own compute. V = 151,936: Tg = 3072, Tl = 768."""
    if chunk_tokens is None:
        Tg = max(512, EAGER_SCRATCH_BYTES // (3 * V) // 512 * 512)
    else:
        Tg = int(chunk_tokens)
    Tg = max(1, min(T, Tg))
    return Tg, max(1, -(-Tg // 4))


def _coefficients(token_loss: TokenLoss, tz, lse, ent, t0: int, t1: int, with_entropy: bool):
    """Per-token (a, b, c) of dloss/dx_v = p_v (a + b x_v) + c [v == target] (kernels/lm_head.py), from the
    gradients of the chunk's loss contributions with respect to tz, lse and ent; and the contributions' sum."""
    leaves = [tz.detach().requires_grad_(), lse.detach().requires_grad_(), ent.detach().requires_grad_()]
    with torch.enable_grad():
        contrib = token_loss(leaves[0], leaves[1], leaves[2] if with_entropy else None, t0, t1)
        total = contrib.sum()
        grads = torch.autograd.grad(total, leaves if with_entropy else leaves[:2], allow_unused=True)
    g_tz, g_lse = (torch.zeros_like(lse) if g is None else g.float() for g in grads[:2])
    g_ent = grads[2] if with_entropy and grads[2] is not None else torch.zeros_like(lse)
    a = (g_lse + g_ent * (lse - ent)).contiguous()
    b = (-g_ent).contiguous()
    return a, b, g_tz.contiguous(), total.detach().float()


def eager_run(hidden_TH, weight_VH, tgt_T, token_loss: TokenLoss, inv_temp: float, with_entropy: bool, tp_group,
              backend: str, chunk_tokens, need_h: bool, need_w: bool):
    """The loss and its gradients in one pass. tgt_T: local target index (outside [0, V) matches nothing).
    Returns loss (0-d fp32), tz, lse, ent [T] (combined over tp_group), dH [T, H] or None, dW [V, H] or None."""
    T, H = hidden_TH.shape
    V = weight_VH.shape[0]
    kmod = _lh._backend_module(backend)
    dev = hidden_TH.device
    f32 = dict(dtype=torch.float32, device=dev)
    Tg, Tl = chunk_sizes(T, V, chunk_tokens)
    half = hidden_TH.dtype != torch.float32
    if half:
        gemm_dtype = torch.float16
        h_scale = _lh._pow2_scale(_lh._amax(hidden_TH))
        w_scale = _lh._pow2_scale(_lh._amax(weight_VH))
        w_g = torch.mul(weight_VH, w_scale).to(gemm_dtype) if need_h else None  # exact: a power of two
        h_buf = torch.empty((Tg, H), dtype=gemm_dtype, device=dev) if need_w else None
        h_scale_f, w_scale_f = float(h_scale), float(w_scale)
    else:
        gemm_dtype, w_g, h_buf, h_scale_f, w_scale_f = torch.float32, weight_VH, None, 1.0, 1.0
    dW32 = torch.zeros((V, H), **f32) if need_w else None
    dH32 = torch.empty((T, H), **f32) if (need_h and tp_group is not None) else None
    dH = torch.empty_like(hidden_TH) if (need_h and tp_group is None) else None
    z_buf = torch.empty((Tl, V), **f32)
    dZ_buf = torch.empty((Tg, V), dtype=gemm_dtype, device=dev)
    tz_T, lse_T, ent_T = (torch.empty(T, **f32) for _ in range(3))
    loss = torch.zeros((), **f32)
    for g0 in range(0, T, Tg):
        g1 = min(g0 + Tg, T)
        scales = []
        for t0 in range(g0, g1, Tl):
            t1 = min(t0 + Tl, g1)
            z_tV = z_buf[: t1 - t0]
            _lh._logits_fp32(hidden_TH[t0:t1], weight_VH, z_tV)
            lse, ent, tz = lse_T[t0:t1], ent_T[t0:t1], tz_T[t0:t1]
            kmod.stats_from_logits(z_tV, tgt_T[t0:t1], inv_temp, with_entropy, lse, ent, tz)
            if tp_group is not None:
                lse_c, ent_c, tz_c = _lh._combine_over_group(lse, ent, tz, tp_group)
                lse.copy_(lse_c)
                ent.copy_(ent_c)
                tz.copy_(tz_c)
            if not with_entropy:
                ent.zero_()
            a, b, c, part = _coefficients(token_loss, tz, lse, ent, t0, t1, with_entropy)
            loss += part
            if half:  # |dlogit| <= (|a| + |b| (|lse| + 1) + |c|) / temperature (p |x| <= |lse| + 1)
                scale = _lh._pow2_scale((_lh._amax(a) + _lh._amax(b) * (_lh._amax(lse) + 1) + _lh._amax(c))
                                        * inv_temp)
            else:
                scale = torch.ones((), **f32)
            scales.append(scale)
            kmod.dlogits_from_logits(z_tV, tgt_T[t0:t1], 0, lse, a, b, c, inv_temp, scale, dZ_buf[t0 - g0:t1 - g0])
        # One power of two for the group: chunks scaled higher are brought down to the smallest scale (exact but
        # for values that fall below fp16's subnormals, 2^-24 of the group's largest), one host sync per group.
        s_list = torch.stack(scales).tolist()
        s_min = min(s_list)
        for i, s in enumerate(s_list):
            if s != s_min:
                dZ_buf[i * Tl: min((i + 1) * Tl, g1 - g0)].mul_(s_min / s)
        dZ = dZ_buf[: g1 - g0]
        if need_h:
            if dH32 is not None:
                _lh._gemm_acc(dH32[g0:g1], dZ, w_g, first=True, alpha=1.0 / (s_min * w_scale_f))
            else:
                out = torch.zeros((g1 - g0, H), **f32)
                _lh._gemm_acc(out, dZ, w_g, first=False, alpha=1.0 / (s_min * w_scale_f))
                dH[g0:g1].copy_(out)
        if need_w:
            h_g = hidden_TH[g0:g1] if not half else torch.mul(hidden_TH[g0:g1], h_scale, out=h_buf[: g1 - g0])
            _lh._gemm_acc(dW32, dZ.T, h_g, first=False, alpha=1.0 / (s_min * h_scale_f))
    del z_buf, dZ_buf, w_g, h_buf
    if dH32 is not None:
        dist.all_reduce(dH32, group=tp_group)
        dH = dH32 if hidden_TH.dtype == torch.float32 else dH32.to(hidden_TH.dtype)
    dW = None
    if need_w:
        dW = dW32 if weight_VH.dtype == torch.float32 else dW32.to(weight_VH.dtype)
    return loss, tz_T, lse_T, ent_T, dH, dW


class _EagerLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden_TH, weight_VH, target_T, token_loss, temperature, with_entropy, tp_group, backend,
                chunk_tokens):
        rank, _ = _lh._tp_info(tp_group)
        V = weight_VH.shape[0]
        tgt_T = target_T.long() - rank * V  # equal vocab shards
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        loss, tz_T, lse_T, ent_T, dH, dW = eager_run(hidden_TH, weight_VH, tgt_T, token_loss, 1.0 / temperature,
                                                     with_entropy, tp_group, backend, chunk_tokens, need_h, need_w)
        ctx.grads = (dH, dW)  # intermediates, not inputs or outputs: held on ctx until the backward
        ctx.mark_non_differentiable(tz_T, lse_T, ent_T)
        return loss, tz_T, lse_T, ent_T

    @staticmethod
    def backward(ctx, g_loss, *_):
        dH, dW = ctx.grads
        ctx.grads = None
        g = float(g_loss)  # one sync; a Python scalar multiplies in fp32 and rounds once
        if g != 1.0:
            dH = None if dH is None else dH.mul_(g)
            dW = None if dW is None else dW.mul_(g)
        return dH, dW, None, None, None, None, None, None, None


def eager_loss(hidden, weight, target, token_loss: TokenLoss, *, temperature=1.0, with_entropy=False,
               tp_group=None, backend=None, chunk_tokens=None):
    """(loss, tz, lse, ent): loss = sum of token_loss over chunks, differentiable in hidden and weight; tz, lse,
    ent [T] fp32 detached (ent zeros unless with_entropy)."""
    hidden, weight = _lh._check_inputs(hidden, weight, target, temperature)
    backend = _lh._pick_backend(hidden, backend)
    return _EagerLoss.apply(hidden, weight, target, token_loss, float(temperature), bool(with_entropy), tp_group,
                            backend, chunk_tokens)
