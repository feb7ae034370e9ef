"""Fused LM head: cross-entropy and per-token log-probs of hidden @ weight.T without [T x V] logits.

Shape legend: T tokens, H hidden size, V vocab rows on this rank (V_global = V * tp when vocab-parallel),
Tc/Vc backward chunk sizes. x = logits / temperature ("scaled logits").

One autograd function, `_TokenStats`, maps (hidden, weight) to three per-token vectors over the scaled logits x:
    tz  = x[target]                  (0 where the target is not a valid index)
    lse = log sum_v exp(x_v)
    ent = -sum_v p_v log p_v         (entropy of p = softmax(x); zeros unless asked for)
Losses (CE, z-loss, log-probs, RL objectives) compose on these vectors in plain torch. Its backward gets the
upstream gradients (g_tz, g_lse, g_ent) and, per logit, dloss/dx_v = p_v (a + b x_v) + c [v == target] with
    a = g_lse + g_ent (lse - ent),   b = -g_ent,   c = g_tz
(d lse/dx = p; d ent/dx_v = -p_v (x_v - lse + ent)). dloss/dlogit = that / temperature.

Forward: one pass over vocab tiles per token block (online lse with a running max; one logits GEMM).
Backward: vocab-outer loop. For each vocab chunk Vc, for each token chunk Tc: recompute the logits tile and
write dZ [Tc, Vc] (Triton; fp16 with a power-of-two scale for 16-bit inputs), then two cuBLAS GEMMs:
    dW[Vc]  = sum over token chunks of dZ^T h    (fp32 accumulator for the chunk, written to dW once)
    dH32   += dZ w[Vc]                           (fp32 [T, H] accumulator, cast to the input dtype once)
No bf16 read-modify-write anywhere; 3 logits-sized GEMMs in the backward, 4 in all. When the loss itself is known
in the forward (mean/sum cross-entropy, linear_policy_loss) kernels/lm_head_eager.py does it in 3.
Vocab-parallel: stats are combined over tp_group (max/sum of exp), dH is all-reduced over it.
"""

from __future__ import annotations

import importlib.util
import os
import warnings

import torch
import torch.distributed as dist

from kernels import lm_head_chunked

BACKWARD_SCRATCH_BYTES = 128 * 2**20  # the dZ tile's budget; see _chunk_sizes
FORWARD_PARTS_BYTES = 256 * 2**20  # the split forward's per-tile statistics of one token chunk
DEFAULT_CHUNK_VOCAB = 8192
# On CUDA: "split" (forward: the logits GEMM with the statistics in its epilogue, kernels/lm_head_tiles_triton.py;
# backward: cuBLAS fp32 logits chunks + the streaming dlogits kernel) measured 116 / 70.5 ms for no-grad log-probs
# at T = 65,536, V = 248,320 / 151,936 on an H200 against the fused Triton kernels' 144 / 91 ms, and 486 / 296 ms
# against 499 / 308 ms for log-probs + autograd (docs/BENCHMARKS.md); its forward holds 0.25 GiB of tile
# statistics where "fused" holds nothing of [T, V] size.
DEFAULT_IMPL = "split"
_HAS_TRITON = importlib.util.find_spec("triton") is not None


def _backend_module(name: str):
    if name == "triton":
        from kernels import lm_head_triton  # lazy: the CPU path never imports triton

        return lm_head_triton
    return lm_head_chunked


def _pick_backend(hidden: torch.Tensor, backend: str | None) -> str:
    if backend is None:
        if hidden.is_cuda and _HAS_TRITON:
            return "triton"
        return "torch"
    if backend not in ("triton", "torch"):
        raise ValueError(f"backend must be 'triton', 'torch' or None, got {backend!r}")
    if backend == "triton" and not hidden.is_cuda and os.environ.get("TRITON_INTERPRET", "0") != "1":
        raise ValueError("backend='triton' on CPU tensors needs TRITON_INTERPRET=1 set before triton is imported")
    return backend


def _pick_impl(hidden: torch.Tensor, backend: str, impl: str | None) -> str:
    """"fused": the logits GEMM runs inside the Triton kernels (nothing of [T, V] size in memory, not even a
    chunk, in the forward). "split": the GEMM library writes an fp32 logits chunk and a streaming Triton kernel
    reads it once (faster where cuBLAS outruns Triton's GEMM: the CUDA default). "lean": split's forward and a
    backward in two passes that holds nothing beside dH and dW but a few MiB (kernels/lm_head_lean.py; five
    logits-sized GEMMs in all). All exist in both backends."""
    if impl is None:
        impl = DEFAULT_IMPL if (backend == "triton" and hidden.is_cuda) else "fused"
    if impl not in ("fused", "split", "lean"):
        raise ValueError(f"impl must be 'fused', 'split', 'lean' or None here ('eager' is for losses: "
                         f"linear_cross_entropy with reduction mean or sum, linear_policy_loss), got {impl!r}")
    return impl


def _tp_info(tp_group) -> tuple[int, int]:
    if tp_group is None:
        return 0, 1
    return dist.get_rank(tp_group), dist.get_world_size(tp_group)


def _combine_over_group(lse_T, ent_T, tz_T, tp_group):
    """Vocab-parallel: lse = log sum_r exp(lse_r); with q_r = exp(lse_r - lse) rank r's share of the softmax
    mass, entropy = sum_r q_r (ent_r - log q_r); the target's x lives on one rank (zero elsewhere): a sum."""
    max_T = lse_T.clone()
    dist.all_reduce(max_T, op=dist.ReduceOp.MAX, group=tp_group)
    scale_T = torch.exp(lse_T - max_T)
    rel_T = torch.where(scale_T > 0, lse_T - max_T, 0.0)
    packed_4T = torch.stack([scale_T, scale_T * ent_T, scale_T * rel_T, tz_T])
    dist.all_reduce(packed_4T, op=dist.ReduceOp.SUM, group=tp_group)
    sum_T, ent_sum_T, rel_sum_T, tz_T = packed_4T.unbind(0)
    log_sum_T = torch.log(sum_T)
    # sum_r q_r log q_r = sum_r q_r (lse_r - max) - log sum
    return max_T + log_sum_T, ent_sum_T / sum_T - rel_sum_T / sum_T + log_sum_T, tz_T


def _downcast_in_place(x32: torch.Tensor, dtype: torch.dtype, chunk: int = 1 << 24) -> torch.Tensor:
    """Cast an fp32 tensor to a 2-byte dtype inside its own storage, chunk by chunk from the front: the bytes
    written for elements [i, j) cover fp32 elements [i/2, j/2), all read already (earlier chunks, or this
    chunk's temporary). Saves the [T, H] half-precision copy at the backward's peak."""
    n = x32.numel()
    out = torch.empty(0, dtype=dtype, device=x32.device).set_(x32.untyped_storage(), 0, (n,), (1,))
    flat = x32.view(-1)
    for i in range(0, n, chunk):
        j = min(i + chunk, n)
        out[i:j].copy_(flat[i:j].to(dtype))
    return out.view(x32.shape)


_MIXED_ADDMM_OK = True  # torch.addmm(..., out_dtype=fp32) with 16-bit operands (CUDA, torch >= 2.8)


def _gemm_acc(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor, first: bool, alpha: float = 1.0) -> None:
    """acc (fp32) = alpha a @ b (first) or acc += alpha a @ b, a and b in the input dtype, fp32 accumulation
    throughout: one cuBLAS call with a 16-bit A/B and an fp32 C, so no 16-bit partial result is ever rounded and
    re-read."""
    global _MIXED_ADDMM_OK
    beta = 0.0 if first else 1.0  # beta = 0: the GEMM never reads acc (no memset, no read of C)
    if a.dtype == torch.float32:
        acc.addmm_(a, b, beta=beta, alpha=alpha)
        return
    if acc.is_cuda and _MIXED_ADDMM_OK:
        try:
            torch.addmm(acc, a, b, out_dtype=torch.float32, beta=beta, alpha=alpha, out=acc)
            return
        except (TypeError, RuntimeError) as e:
            _MIXED_ADDMM_OK = False
            warnings.warn(f"addmm with out_dtype=float32 unavailable ({e}); falling back to fp32 GEMMs (slow)")
    acc.addmm_(a.float(), b.float(), beta=beta, alpha=alpha)


class _TokenStats(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden_TH, weight_VH, target_T, temperature, with_entropy, tp_group, backend, impl,
                chunk_tokens, chunk_vocab):
        rank, _ = _tp_info(tp_group)
        V = weight_VH.shape[0]
        vocab_start = rank * V  # equal shards (V_global = V * tp), as vocab-parallel layers pad the vocab
        tgt_T = target_T.long() - vocab_start if vocab_start else target_T.long()  # (no copy of an int64 target)
        inv_temp = 1.0 / temperature
        kmod = _backend_module(backend)
        if impl in ("split", "lean"):
            lse_T, ent_T, tz_T = _split_token_stats(kmod, hidden_TH, weight_VH, tgt_T, inv_temp, with_entropy,
                                                    chunk_tokens, chunk_vocab)
        else:
            lse_T, ent_T, tz_T = kmod.token_stats(hidden_TH, weight_VH, tgt_T, inv_temp, with_entropy)
        if tp_group is not None:
            lse_T, ent_T, tz_T = _combine_over_group(lse_T, ent_T, tz_T, tp_group)
        if not with_entropy:
            ent_T = torch.zeros_like(lse_T)
        ctx.save_for_backward(hidden_TH, weight_VH, tgt_T, lse_T, ent_T if with_entropy else None)
        ctx.cfg = (inv_temp, with_entropy, tp_group, backend, impl, chunk_tokens, chunk_vocab)
        if not with_entropy:
            ctx.mark_non_differentiable(ent_T)
        return tz_T, lse_T, ent_T

    @staticmethod
    def backward(ctx, g_tz, g_lse, g_ent):
        hidden_TH, weight_VH, tgt_T, lse_T, ent_T = ctx.saved_tensors
        inv_temp, with_entropy, tp_group, backend, impl, chunk_tokens, chunk_vocab = ctx.cfg
        # dloss/dx = p (a + b x) + c [target]; without an entropy gradient b = 0 and a = g_lse itself (no [T] copies:
        # the lean backward counts every MiB)
        g_tz = torch.zeros_like(lse_T) if g_tz is None else g_tz.float().contiguous()
        g_lse = torch.zeros_like(lse_T) if g_lse is None else g_lse.float().contiguous()
        has_b = with_entropy and g_ent is not None
        a_T = (g_lse + g_ent.float() * (lse_T - ent_T)).contiguous() if has_b else g_lse
        b_T = (-g_ent.float()).contiguous() if has_b else None
        c_T = g_tz
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if impl == "lean":
            from kernels.lm_head_lean import lean_backward

            dH_TH, dW_VH = lean_backward(hidden_TH, weight_VH, tgt_T, lse_T, a_T, b_T, c_T, inv_temp, backend,
                                         need_h, need_w, tp_group)
        else:  # (its dlogits kernels read b whatever it is)
            dH_TH, dW_VH = _backward_chunks(hidden_TH, weight_VH, tgt_T, lse_T, a_T,
                                            torch.zeros_like(lse_T) if b_T is None else b_T, c_T, inv_temp, backend,
                                            impl, chunk_tokens, chunk_vocab, need_h, need_w, tp_group)
        return dH_TH, dW_VH, None, None, None, None, None, None, None, None


def _chunk_sizes(T: int, V: int, impl: str, chunk_tokens, chunk_vocab) -> tuple[int, int]:
    # Worked example (bf16, T=65,536, V=248,320, H=2048), fused: Vc = 8192, Tc = 128 MiB / (8192 x 2 B) = 8192:
    # dZ is 128 MiB, the dW chunk accumulator 8192 x 2048 x 4 B = 64 MiB; both GEMMs are 8192 x 2048 x 8192
    # (275 GFLOP, ~0.35 ms), large enough for cuBLAS to run near peak, and the fp32 dH accumulator is read and
    # written once per vocab chunk: 31 x 2 x 0.5 GiB = 31 GiB of traffic, ~7 ms at 4.3 TB/s.
    # Split: the fp32 logits chunk (4 B) sits beside dZ (2 B), so Tc = 128 MiB / (8192 x 4 B) = 4096: 128 MiB of
    # logits + 64 MiB of dZ; the GEMMs are 4096 x 8192 x 2048 (137 GFLOP), still cuBLAS-sized.
    Vc = min(V, chunk_vocab or DEFAULT_CHUNK_VOCAB)
    if chunk_tokens is None:
        per_elem = 4 if impl == "split" else 2
        chunk_tokens = max(256, BACKWARD_SCRATCH_BYTES // (Vc * per_elem) // 256 * 256)
    return max(1, min(T, chunk_tokens)), Vc


_LOGITS_MM = None  # which fp32-output GEMM call works here; found on first use


def _logits_fp32(h_tH: torch.Tensor, w_vH: torch.Tensor, out_tv: torch.Tensor) -> None:
    """out = h @ w.T in fp32 from 16-bit operands (cuBLAS accumulates in fp32; only the output width differs
    from a plain bf16 GEMM), or from fp32 operands."""
    global _LOGITS_MM
    if h_tH.dtype == torch.float32 or not h_tH.is_cuda:
        torch.mm(h_tH.float(), w_vH.float().T, out=out_tv)
        return
    if _LOGITS_MM in (None, "mm_out_dtype"):
        try:
            torch.mm(h_tH, w_vH.T, out_dtype=torch.float32, out=out_tv)
            _LOGITS_MM = "mm_out_dtype"
            return
        except (TypeError, RuntimeError):
            _LOGITS_MM = "addmm_out_dtype"
    out_tv.zero_()
    _gemm_acc(out_tv, h_tH, w_vH.T, first=False)


def _split_token_stats(kmod, hidden_TH, weight_VH, tgt_T, inv_temp, with_entropy, chunk_tokens, chunk_vocab):
    """Forward of the split path: the logits GEMM with the statistics in its epilogue (logits_tiles, the eager
    path's kernel, here writing no logits), per token chunk of whole vocabulary rows (or per vocab chunk when
    chunk_vocab is given); chunks are merged like vocab splits."""
    T, V = hidden_TH.shape[0], weight_VH.shape[0]
    Vc = V if chunk_vocab is None else min(V, int(chunk_vocab))
    if chunk_tokens is None:
        # the per-tile statistics [3, num_tiles, Tc] fill FORWARD_PARTS_BYTES: V = 248,320 in 256-wide tiles is 970
        # tiles, Tc = 256 MiB / (12 B x 970) -> 23,040 tokens: GEMMs of 23,040 x 248,320 x H
        parts_bytes = 4 * lm_head_chunked.PARTS_PER_TILE
        Tc = max(256, FORWARD_PARTS_BYTES // (parts_bytes * -(-Vc // 256)) // 256 * 256)
    else:
        Tc = int(chunk_tokens)
    Tc = max(1, min(T, Tc))
    num_splits = -(-V // Vc)
    # three separate [S, T] arrays: the loss may keep lse alone (the lean backward counts MiB)
    lse_ST, ent_ST, tz_ST = (torch.empty((num_splits, T), dtype=torch.float32, device=hidden_TH.device)
                             for _ in range(3))
    for si, v0 in enumerate(range(0, V, Vc)):
        v1 = min(v0 + Vc, V)
        for t0 in range(0, T, Tc):
            t1 = min(t0 + Tc, T)
            _, lse2, ent, tz, _ = kmod.logits_tiles(hidden_TH[t0:t1], weight_VH[v0:v1], tgt_T[t0:t1] - v0, inv_temp,
                                                    with_entropy)
            torch.mul(lse2, lm_head_chunked.LN2, out=lse_ST[si, t0:t1])
            ent_ST[si, t0:t1] = ent
            tz_ST[si, t0:t1] = tz
    if num_splits == 1:
        return lse_ST[0], ent_ST[0], tz_ST[0]
    return lm_head_chunked.combine_splits(lse_ST, ent_ST, tz_ST)


def _pow2_scale(max_abs: torch.Tensor, target: float = 2.0**14) -> torch.Tensor:
    """A power of two s (0-dim fp32 tensor, no host sync) with max_abs * s in (target/2, target]: multiplying
    by it is exact, and it moves values into fp16's range (max 65504, full precision down to 6.1e-5)."""
    max_abs = max_abs.float()
    safe = torch.where(max_abs > 0, max_abs, torch.ones_like(max_abs))
    return torch.exp2(torch.floor(torch.log2(target / safe))).clamp(2.0**-100, 2.0**100).reshape(())


def _amax(x: torch.Tensor) -> torch.Tensor:
    if x.numel() == 0:  # (the inf norm has no identity; nothing to bound)
        return torch.zeros((), dtype=torch.float32, device=x.device)
    return torch.linalg.vector_norm(x, float("inf"))  # max |x| in one pass, no |x| temporary


def _backward_operands(hidden_TH, weight_VH, lse_T, a_T, b_T, c_T, inv_temp):
    """(GEMM dtype, dZ scale, h scale, w scale) of a backward: fp32 inputs run in fp32 with unit scales; 16-bit
    inputs give fp16 dZ, h and w operands, each times a power of two (0-dim tensors, no host sync) that moves it
    into fp16's range: |dlogit| <= (|a| + |b| (|lse| + 1) + |c|) / temperature, since p |x| <= |lse| + 1."""
    one = torch.ones((), dtype=torch.float32, device=hidden_TH.device)
    if hidden_TH.dtype == torch.float32:
        return torch.float32, one, one, one
    dz_scale = _dz_scale(lse_T, a_T, b_T, c_T, inv_temp)
    if hidden_TH.dtype == torch.float16:  # the inputs are the GEMM operands as they are: no conversion, no scale
        return torch.float16, dz_scale, one, one
    return torch.float16, dz_scale, _pow2_scale(_amax(hidden_TH)), _pow2_scale(_amax(weight_VH))


def _dz_scale(lse_T, a_T, b_T, c_T, inv_temp: float) -> torch.Tensor:
    """The power-of-two scale of an fp16 dZ for these tokens (0-dim, no host sync): |dlogit| <= (|a| + |b| (|lse| + 1)
    + |c|) / temperature, since p |x| <= |lse| + 1. b_T None: b = 0."""
    bound = _amax(a_T) + _amax(c_T)
    if b_T is not None:
        bound = bound + _amax(b_T) * (_amax(lse_T) + 1)
    return _pow2_scale(bound * inv_temp)


def _backward_chunks(hidden_TH, weight_VH, tgt_T, lse_T, a_T, b_T, c_T, inv_temp, backend, impl,
                     chunk_tokens, chunk_vocab, need_h, need_w, tp_group):
    """Vocab-outer, token-inner. For 16-bit inputs the dZ tile and both GEMMs run in fp16 with power-of-two
    scales (exact to apply and undo): fp16 keeps 11 significant bits where bf16 keeps 8, so the dZ operand
    rounds 8x finer; the scales keep every operand inside fp16's range. fp32 inputs run in fp32 throughout."""
    T, H = hidden_TH.shape
    V = weight_VH.shape[0]
    if T == 0:  # no tokens: the chunk loops below never write their accumulators
        return (torch.zeros_like(hidden_TH) if need_h else None), (torch.zeros_like(weight_VH) if need_w else None)
    kmod = _backend_module(backend)
    Tc, Vc = _chunk_sizes(T, V, impl, chunk_tokens, chunk_vocab)
    dev = hidden_TH.device
    f32 = dict(dtype=torch.float32, device=dev)
    gemm_dtype, dz_scale, h_scale, w_scale = _backward_operands(hidden_TH, weight_VH, lse_T, a_T, b_T, c_T, inv_temp)
    if gemm_dtype != torch.float32:
        # 16-bit operands of the backward GEMMs, scaled by a power of two and converted in one pass each
        h_buf = torch.empty((Tc, H), dtype=gemm_dtype, device=dev)
        w_buf = torch.empty((Vc, H), dtype=gemm_dtype, device=dev)
        # (bf16 x 0-dim fp32 computes in bf16, exact for a power of two, then casts to fp16 on the write)
    dH32_TH = torch.empty((T, H), **f32) if need_h else None
    dW_VH = torch.empty_like(weight_VH) if need_w else None
    dZ_buf = torch.empty((Tc, Vc), dtype=gemm_dtype, device=dev)
    z_buf = torch.empty((Tc, Vc), **f32) if impl == "split" else None
    dW32_buf = torch.empty((Vc, H), **f32) if need_w else None
    for v0 in range(0, V, Vc):
        v1 = min(v0 + Vc, V)
        w_vH = weight_VH[v0:v1]
        w_g = w_vH if gemm_dtype == w_vH.dtype else torch.mul(w_vH, w_scale, out=w_buf[: v1 - v0])
        for t0 in range(0, T, Tc):
            t1 = min(t0 + Tc, T)
            h_tH = hidden_TH[t0:t1]
            dZ_tv = dZ_buf[: t1 - t0, : v1 - v0]
            rows = (tgt_T[t0:t1], v0, lse_T[t0:t1], a_T[t0:t1], b_T[t0:t1], c_T[t0:t1], inv_temp, dz_scale)
            if impl == "split":
                z_tv = z_buf[: t1 - t0, : v1 - v0]
                _logits_fp32(h_tH, w_vH, z_tv)
                kmod.dlogits_from_logits(z_tv, *rows, dZ_tv)
            else:
                kmod.dlogits(h_tH, w_vH, *rows, dZ_tv)
            if need_w:
                h_g = h_tH if gemm_dtype == h_tH.dtype else torch.mul(h_tH, h_scale, out=h_buf[: t1 - t0])
                _gemm_acc(dW32_buf[: v1 - v0], dZ_tv.T, h_g, first=(t0 == 0))
            if need_h:
                _gemm_acc(dH32_TH[t0:t1], dZ_tv, w_g, first=(v0 == 0))
        if need_w:
            dW_VH[v0:v1].copy_(dW32_buf[: v1 - v0].mul_(1.0 / (dz_scale * h_scale)))
    del dZ_buf, dW32_buf, z_buf
    dH_TH = None
    if need_h:
        dH32_TH.mul_(1.0 / (dz_scale * w_scale))
        if tp_group is not None:
            dist.all_reduce(dH32_TH, group=tp_group)  # hidden is replicated over the group: sum the partials
        if hidden_TH.dtype == torch.float32:
            dH_TH = dH32_TH
        elif hidden_TH.element_size() == 2:
            dH_TH = _downcast_in_place(dH32_TH, hidden_TH.dtype)
        else:
            dH_TH = dH32_TH.to(hidden_TH.dtype)
    return dH_TH, dW_VH


def _check_inputs(hidden, weight, target, temperature):
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"need hidden [T, H] and weight [V, H]; got {tuple(hidden.shape)} and "
                         f"{tuple(weight.shape)}")
    if target.shape != hidden.shape[:1]:
        raise ValueError(f"target must be [T] = [{hidden.shape[0]}], got {tuple(target.shape)}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if hidden.dtype != weight.dtype:
        hidden = hidden.to(weight.dtype)
    return hidden.contiguous(), weight.contiguous()


def _token_stats(hidden, weight, target, temperature, with_entropy, tp_group, backend, impl, chunk_tokens,
                 chunk_vocab):
    hidden, weight = _check_inputs(hidden, weight, target, temperature)
    backend = _pick_backend(hidden, backend)
    impl = _pick_impl(hidden, backend, impl)
    return _TokenStats.apply(hidden, weight, target, float(temperature), bool(with_entropy), tp_group,
                             backend, impl, chunk_tokens, chunk_vocab)


def linear_cross_entropy(hidden, weight, target, *, ignore_index: int = -100, reduction: str = "mean",
                         z_loss: float = 0.0, temperature: float = 1.0, tp_group=None, backend=None, impl=None,
                         chunk_tokens=None, chunk_vocab=None):
    """Cross-entropy of softmax(hidden @ weight.T / temperature) against target, plus z_loss * lse^2.

    hidden [T, H], weight [V, H] (this rank's V / tp rows when tp_group is given; equal shards), target [T]
    global vocab indices. reduction "mean" (over non-ignored tokens; 0 when all are ignored), "sum" or "none"
    ([T], 0 at ignored tokens). backend None picks triton on CUDA, chunked torch elsewhere.
    """
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
    if impl is None and reduction != "none":
        impl = "eager"
    if impl == "eager" or (impl == "lean" and reduction != "none"):  # the loss handed to the head
        if reduction == "none":
            raise ValueError("impl='eager' needs reduction 'mean' or 'sum' (the per-token gradient must be known "
                             "in the forward)")
        from kernels.lm_head_eager import eager_loss

        valid_T = target != ignore_index
        weight_T = valid_T.float()
        if reduction == "mean":
            weight_T = weight_T / valid_T.sum().clamp_min(1)

        def token_loss(tz, lse, ent, t0, t1):
            per = lse - tz
            if z_loss:
                per = per + z_loss * lse.square()
            return per * weight_T[t0:t1]

        loss, *_ = eager_loss(hidden, weight, target, token_loss, temperature=temperature, tp_group=tp_group,
                              backend=backend, chunk_tokens=chunk_tokens, lean=impl == "lean")
        return loss
    tz_T, lse_T, _ = _token_stats(hidden, weight, target, temperature, False, tp_group, backend, impl,
                                  chunk_tokens, chunk_vocab)
    valid_T = target != ignore_index
    loss_T = lse_T - tz_T
    if z_loss:
        loss_T = loss_T + z_loss * lse_T.square()
    loss_T = torch.where(valid_T, loss_T, torch.zeros_like(loss_T))
    if reduction == "none":
        return loss_T
    if reduction == "sum":
        return loss_T.sum()
    return loss_T.sum() / valid_T.sum().clamp_min(1)


def linear_logprobs(hidden, weight, target, *, temperature: float = 1.0, with_entropy: bool = False,
                    tp_group=None, backend=None, impl=None, chunk_tokens=None, chunk_vocab=None):
    """Per-token log p(target) under softmax(hidden @ weight.T / temperature), fp32 [T], differentiable.

    Negative targets (padding) give 0 and no gradient. with_entropy=True also returns the per-token entropy
    [T] (differentiable): (logprobs, entropy).
    """
    tz_T, lse_T, ent_T = _token_stats(hidden, weight, target, temperature, with_entropy, tp_group, backend,
                                      impl, chunk_tokens, chunk_vocab)
    valid_T = target >= 0
    logp_T = torch.where(valid_T, tz_T - lse_T, torch.zeros_like(lse_T))
    if with_entropy:
        return logp_T, ent_T
    return logp_T


def linear_policy_loss(hidden, weight, target, token_loss, *, temperature: float = 1.0, with_entropy: bool = False,
                       tp_group=None, backend=None, chunk_tokens=None, impl=None):
    """A loss on per-token log-probs (and entropies) of softmax(hidden @ weight.T / temperature), fused into the
    head: three logits-sized GEMMs instead of four (kernels/lm_head_eager.py). impl="lean": four GEMMs and nothing
    beside the two gradients but a few MiB (kernels/lm_head_lean.py, lean_eager_run); None or "eager": three.

    token_loss(logp, ent, t0, t1) -> [t1 - t0] per-token contributions for tokens [t0, t1), whose sum over all
    tokens is the loss: logp and ent are fp32 [t1 - t0] (ent None unless with_entropy), differentiable; any
    normalizer must be fixed beforehand (token-mean: divide by the mask's sum). It is called once per chunk, in
    token order, under autograd. Negative targets (padding) give logp 0 and no gradient.
    Returns (loss, logp [T], entropy [T] or None); loss is differentiable in hidden and weight, logp and entropy
    are detached (for metrics).
    """
    from kernels.lm_head_eager import eager_loss

    if impl not in (None, "eager", "lean"):
        raise ValueError(f"linear_policy_loss: impl must be 'eager' or 'lean', got {impl!r}")
    valid_T = target >= 0

    def on_stats(tz, lse, ent, t0, t1):
        logp = torch.where(valid_T[t0:t1], tz - lse, torch.zeros_like(lse))
        return token_loss(logp, ent, t0, t1)

    loss, tz_T, lse_T, ent_T = eager_loss(hidden, weight, target, on_stats, temperature=temperature,
                                          with_entropy=with_entropy, tp_group=tp_group, backend=backend,
                                          chunk_tokens=chunk_tokens, lean=impl == "lean")
    logp_T = torch.where(valid_T, tz_T - lse_T, torch.zeros_like(lse_T))
    return loss, logp_T, (ent_T if with_entropy else None)
