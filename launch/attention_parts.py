"""Softmax attention over several key parts, each one kernel call, merged exactly; optionally with a sink logit.

Under context parallelism a rank's piece of a document has n queries at global positions [a, a + n) and attends to
the document's keys [start, a + n): a lower-right causal mask. On an H200 (torch 2.11) SDPA runs that shape only
in its flash kernel, while the whole-sequence causal shape runs in cuDNN's, 1.5-1.7 times faster
(bench/bench_attention.py, docs/BENCHMARKS.md). The piece splits into two shapes cuDNN takes:

    prefix   queries [a, a + n) against keys [start, a): every key visible, no mask
    square   queries [a, a + n) against keys [a, a + n): causal, top-left = bottom-right for a square

Each part returns its output o_i (normalized over its own keys) and the log-sum-exp l_i of its scaled scores per
query. The whole piece's softmax is over the union of the keys, so

    l = log(Σ_i e^l_i),    o = Σ_i e^(l_i − l) · o_i

(the merge of partial softmaxes; docs/context_parallel.md). The backward needs no merge of its own: a flash
kernel's backward rebuilds the probabilities of its keys as exp(s − l) from the l it is given and takes
D = rowsum(dO ∘ O) from the O it is given, so each part's backward called with the *merged* O and l yields
exactly that part's share of dQ (summed over the parts) and its keys' dK, dV.

A sink (gpt-oss: one logit σ_h per query head in every query's softmax, with no value) is one more part with
l = σ_h and o = 0: it joins l and adds nothing to o, so no kernel runs for it and the heads keep their own size.
Its gradient is that of a score whose value is zero, dS = P ∘ (dP − D) with dP = dO·0: ∂L/∂σ_h = −Σ_i p_i D_i,
p_i = e^(σ_h − l_i) (docs/training.md, "gpt-oss: attention sinks and sliding windows").

Kernels: cuDNN's (`aten._scaled_dot_product_cudnn_attention`) on CUDA, SDPA's CPU flash kernel on CPU (what the
CPU tests check the merge with).
"""

from __future__ import annotations

import torch

from kernels.sink_merge import grad_rows, scale_rows

aten = torch.ops.aten


def _cudnn_forward(q, k, v, causal: bool, scale: float):
    o, lse, cq, ck, mq, mk, seed, offset, _ = aten._scaled_dot_product_cudnn_attention(
        q, k, v, None, True, 0.0, causal, False, scale=scale)
    return o, lse, (cq, ck, mq, mk, seed, offset)


def _cudnn_backward(do, q, k, v, o, lse, aux, causal: bool, scale: float):
    cq, ck, mq, mk, seed, offset = aux
    return aten._scaled_dot_product_cudnn_attention_backward(do, q, k, v, o, lse, seed, offset, None, cq, ck, mq, mk,
                                                             0.0, causal, scale=scale)


def _cpu_forward(q, k, v, causal: bool, scale: float):
    o, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
    return o, lse, ()


def _cpu_backward(do, q, k, v, o, lse, aux, causal: bool, scale: float):
    return aten._scaled_dot_product_flash_attention_for_cpu_backward(do, q, k, v, o, lse, 0.0, causal, scale=scale)


_KERNELS = {"cudnn": (_cudnn_forward, _cudnn_backward), "cpu": (_cpu_forward, _cpu_backward)}


def kernel_for(q: torch.Tensor, parts) -> str | None:
    """The kernel `merged_attention` runs for queries q [1, Hq, n, D] and key parts ((k, v, causal), …) with k, v
    [1, Hkv, ·, D(v)], or None where none takes every part (the caller keeps its one-call path): cuDNN on a CUDA GPU
    where torch says it takes each part as it is (without a mask, or causal); the CPU flash kernel for CPU tensors of
    equal q·k and v head sizes."""
    if q.is_cuda:
        if q.dtype not in (torch.bfloat16, torch.float16):
            return None
        try:
            ok = all(torch.backends.cuda.can_use_cudnn_attention(
                torch.backends.cuda.SDPAParams(q, k, v, None, 0.0, causal, k.shape[1] != q.shape[1]))
                for k, v, causal in parts)
        except (AttributeError, RuntimeError, TypeError):
            return None
        return "cudnn" if ok else None
    if q.device.type == "cpu" and all(q.shape[-1] == v.shape[-1] for _, v, _ in parts):
        return "cpu"
    return None


def _per_head(sink_H: torch.Tensor, shape, dtype) -> torch.Tensor:
    """σ [H] broadcast over `shape` (an output's shape less its channels, the heads on dim 1)."""
    view = [1] * len(shape)
    view[1] = -1
    return sink_H.to(dtype).view(view).expand(shape)


def _merge(outs, lses, sink_H):
    """The merged output (in the last part's dtype and layout) and log-sum-exp (in the last part's lse shape) of
    partial softmaxes (o_i, l_i), with the sink logits σ [H] as one more part whose output is zero. Each l_i holds
    o_i's elements less its channels (the heads on dim 1)."""
    o_last = outs[-1]
    shape, acc = o_last.shape[:-1], torch.promote_types(o_last.dtype, torch.float32)
    ls = [lse.reshape(shape).to(acc) for lse in lses]
    terms = torch.stack(ls + ([_per_head(sink_H, shape, acc)] if sink_H is not None else []))
    lse = torch.logsumexp(terms, dim=0)
    # each part's weight e^(l_i − l) applied as its output is read (in fp32, no copy of it), one rounding: with
    # one part (and the sink) its output is scaled in place (kernels/sink_merge.py)
    weights = [torch.exp(li - lse) for li in ls]
    if len(outs) == 1:
        return scale_rows(o_last, weights[0]), lse.to(lses[-1].dtype)
    total = outs[0] * weights[0][..., None]
    for o_i, w_i in zip(outs[1:], weights[1:]):
        total += o_i * w_i[..., None]
    o = torch.empty_like(o_last)
    o.copy_(total)
    return o, lse.to(lses[-1].dtype)


def _sink_grad(D: torch.Tensor, lse: torch.Tensor, sink_H: torch.Tensor) -> torch.Tensor:
    """∂L/∂σ_h = Σ_i ∂L/∂s_i,sink = −Σ_i p_i,sink · D_i, the sink's value being 0, from D = rowsum(dO ∘ O) of the
    merged output (`grad_rows`, fp32) and its log-sum-exp (the output's elements less its channels, the heads on
    dim 1)."""
    p = torch.exp(_per_head(sink_H, D.shape, D.dtype) - lse.reshape(D.shape).to(D.dtype))
    return (-(p * D).sum(dim=[d for d in range(D.dim()) if d != 1])).to(sink_H.dtype)


class _Merged(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, sink_H, scale: float, kernel: str, causal: tuple, *kv):
        fwd, _ = _KERNELS[kernel]
        outs, lses, aux = [], [], []
        for i, c in enumerate(causal):
            o_i, l_i, aux_i = fwd(q, kv[2 * i], kv[2 * i + 1], c, scale)
            outs.append(o_i)
            lses.append(l_i)
            aux.append(aux_i)
        o, lse = _merge(outs, lses, sink_H)
        ctx.scale, ctx.kernel, ctx.causal, ctx.aux = scale, kernel, causal, aux
        ctx.lse_shapes = [l_i.shape for l_i in lses]
        ctx.has_sink = sink_H is not None
        ctx.save_for_backward(q, o, lse, sink_H if sink_H is not None else lse.new_empty(0), *kv)
        return o

    @staticmethod
    def backward(ctx, do):
        q, o, lse, sink_H, *kv = ctx.saved_tensors
        _, bwd = _KERNELS[ctx.kernel]
        # dO in the output's own layout, which the kernels' backward expects of it; with a sink, D in the same pass
        if ctx.has_sink:
            g, D = grad_rows(do, o)
        else:
            g = torch.empty_like(o)
            g.copy_(do)
        dq, dkv = None, []
        for i, c in enumerate(ctx.causal):
            dq_i, dk_i, dv_i = bwd(g, q, kv[2 * i], kv[2 * i + 1], o, lse.reshape(ctx.lse_shapes[i]).contiguous(),
                                   ctx.aux[i], c, ctx.scale)
            dq = dq_i if dq is None else dq + dq_i
            dkv += [dk_i, dv_i]
        d_sink = _sink_grad(D, lse, sink_H) if ctx.has_sink else None
        return (dq, d_sink, None, None, None, *dkv)


def merged_attention(q: torch.Tensor, parts, scale: float, kernel: str,
                     sink_H: torch.Tensor | None = None) -> torch.Tensor:
    """softmax(scale · q [k_1 | k_2 | …]ᵀ + mask) [v_1 | v_2 | …] over key parts ((k, v, causal), …), each part's
    keys all visible or causal (a part of the queries' own length), with an optional sink logit σ_h per query head
    in every query's softmax (a term e^σ in the denominator that takes no value). q [1, H, n, D], k/v
    [1, Hkv, ·, D(v)]; `kernel` from `kernel_for`. Returns [1, H, n, Dv]."""
    if kernel not in _KERNELS:
        raise ValueError(f"unknown attention kernel {kernel!r} ({', '.join(_KERNELS)})")
    if kernel == "cpu" and parts[0][0].shape[1] < q.shape[1]:  # the CPU kernel has no GQA: K/V repeated
        rep = q.shape[1] // parts[0][0].shape[1]
        parts = [(k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), c) for k, v, c in parts]
    kv = [x for k, v, _ in parts for x in (k, v)]
    return _Merged.apply(q, sink_H, scale, kernel, tuple(c for _, _, c in parts), *kv)


class _FlashWindow(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cu, max_len: int, window: int, sink_H, scale: float):
        o, lse, rng, unused, _ = aten._flash_attention_forward(
            q, k, v, cu, cu, max_len, max_len, 0.0, True, False, scale=scale, window_size_left=window - 1,
            window_size_right=0)
        if sink_H is not None:  # o [T, H, D], lse [H, T]: the sink as one more part with output 0
            o, lse_TH = _merge([o], [lse.t()], sink_H)
            lse = lse_TH.t().contiguous()
        ctx.meta = (max_len, window, scale, sink_H is not None)
        ctx.save_for_backward(q, k, v, cu, o, lse, rng, unused,
                              sink_H if sink_H is not None else lse.new_empty(0))
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, cu, o, lse, rng, unused, sink_H = ctx.saved_tensors
        max_len, window, scale, has_sink = ctx.meta
        g, D = grad_rows(do, o) if has_sink else (do.contiguous(), None)
        dq, dk, dv = aten._flash_attention_backward(g, q, k, v, o, lse, cu, cu, max_len, max_len, 0.0, True, rng,
                                                    unused, scale=scale, window_size_left=window - 1,
                                                    window_size_right=0)
        d_sink = _sink_grad(D, lse.t(), sink_H) if has_sink else None
        return dq, dk, dv, None, None, None, d_sink, None


def flash_window_takes(q_THD: torch.Tensor, k_THD: torch.Tensor, v_THD: torch.Tensor) -> bool:
    """Whether `window_attention` runs: a CUDA GPU in bf16/fp16 whose SDPA flash kernel takes these head shapes."""
    if not q_THD.is_cuda or q_THD.dtype not in (torch.bfloat16, torch.float16):
        return False
    q, k, v = (x.transpose(0, 1)[None] for x in (q_THD, k_THD, v_THD))
    try:
        return torch.backends.cuda.can_use_flash_attention(
            torch.backends.cuda.SDPAParams(q, k, v, None, 0.0, True, k.shape[1] != q.shape[1]))
    except (AttributeError, RuntimeError, TypeError):
        return False


def window_attention(q_THD: torch.Tensor, k_THD: torch.Tensor, v_THD: torch.Tensor, cu_seqlens: torch.Tensor,
                     max_len: int, window: int, scale: float, sink_H: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention inside each packed document (`cu_seqlens` int32 [docs + 1], the longest `max_len`) to the
    keys less than `window` positions back, with an optional sink logit per query head merged in by its log-sum-exp:
    one call of the flash kernel's variable-length form with its window (keys [i − window + 1, i]), GQA inside it.
    q [T, Hq, D], k/v [T, Hkv, D] (`flash_window_takes`). Returns [T, Hq, D]."""
    return _FlashWindow.apply(q_THD.contiguous(), k_THD.contiguous(), v_THD.contiguous(), cu_seqlens, max_len,
                              window, sink_H, scale)
