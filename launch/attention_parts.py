"""Causal attention of queries that sit at the end of their keys, as two kernel calls merged exactly.

Under context parallelism a rank's piece of a document has n queries at global positions [a, a + n) and attends to
the document's keys [start, a + n): a lower-right causal mask. On an H200 (torch 2.11) SDPA runs that shape only
in its flash kernel, while the whole-sequence causal shape runs in cuDNN's, 1.5-1.7 times faster
(bench/bench_attention.py, docs/BENCHMARKS.md). The piece splits into two shapes cuDNN takes:

    prefix   queries [a, a + n) against keys [start, a): every key visible, no mask
    square   queries [a, a + n) against keys [a, a + n): causal, top-left = bottom-right for a square

Each part returns its output o_i (normalized over its own keys) and the log-sum-exp l_i of its scaled scores per
query. The whole piece's softmax is over the union of the keys, so

    l = log(e^l_p + e^l_s),    o = e^(l_p − l) · o_p + e^(l_s − l) · o_s

(the merge of two partial softmaxes; docs/context_parallel.md). The backward needs no merge of its own: a flash
kernel's backward rebuilds the probabilities of its keys as exp(s − l) from the l it is given and takes
D = rowsum(dO ∘ O) from the O it is given, so each part's backward called with the *merged* O and l yields
exactly that part's share of dQ (summed over the parts) and its keys' dK, dV.

Kernels: cuDNN's (`aten._scaled_dot_product_cudnn_attention`) on CUDA, SDPA's CPU flash kernel on CPU (what the
CPU tests check the merge with).
"""

from __future__ import annotations

import torch

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


def split_kernel(q: torch.Tensor, k_p: torch.Tensor, v_p: torch.Tensor, k_s: torch.Tensor,
                 v_s: torch.Tensor) -> str | None:
    """The kernel `prefix_square_attention` runs for queries q [1, Hq, n, D], prefix keys k_p, v_p and square keys
    k_s, v_s [1, Hkv, ·, D(v)], or None where neither takes the shapes (the caller keeps one lower-right SDPA call):
    cuDNN on a CUDA GPU where torch says it takes both parts (the prefix without a mask, the square causal); the CPU
    flash kernel for CPU tensors of equal q·k and v head sizes."""
    if q.is_cuda:
        if q.dtype not in (torch.bfloat16, torch.float16):
            return None
        gqa = k_p.shape[1] != q.shape[1]
        try:
            ok = all(torch.backends.cuda.can_use_cudnn_attention(
                torch.backends.cuda.SDPAParams(q, k, v, None, 0.0, causal, gqa))
                for k, v, causal in ((k_p, v_p, False), (k_s, v_s, True)))
        except (AttributeError, RuntimeError, TypeError):
            return None
        return "cudnn" if ok else None
    if q.device.type == "cpu" and q.shape[-1] == v_p.shape[-1]:
        return "cpu"
    return None


def _lse_merge(o_p, l_p, o_s, l_s):
    """The merged output (in o_s's dtype and layout) and log-sum-exp (in l_s's shape) of two partial softmaxes."""
    shape, acc = o_s.shape[:-1], torch.promote_types(o_s.dtype, torch.float32)
    lp, ls = l_p.reshape(shape).to(acc), l_s.reshape(shape).to(acc)
    lse = torch.logaddexp(lp, ls)
    o = torch.empty_like(o_s)
    o.copy_(o_p.to(acc) * torch.exp(lp - lse)[..., None] + o_s.to(acc) * torch.exp(ls - lse)[..., None])
    return o, lse.to(l_s.dtype)


class _PrefixSquare(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k_p, v_p, k_s, v_s, scale: float, kernel: str):
        fwd, _ = _KERNELS[kernel]
        o_p, l_p, aux_p = fwd(q, k_p, v_p, False, scale)
        o_s, l_s, aux_s = fwd(q, k_s, v_s, True, scale)
        o, lse = _lse_merge(o_p, l_p, o_s, l_s)
        del o_p, o_s
        ctx.scale, ctx.kernel, ctx.aux = scale, kernel, (aux_p, aux_s)
        ctx.lse_shapes = (l_p.shape, l_s.shape)
        ctx.save_for_backward(q, k_p, v_p, k_s, v_s, o, lse)
        return o

    @staticmethod
    def backward(ctx, do):
        q, k_p, v_p, k_s, v_s, o, lse = ctx.saved_tensors
        _, bwd = _KERNELS[ctx.kernel]
        g = torch.empty_like(o)  # the output's own layout, which the kernels' backward expects of dO
        g.copy_(do)
        (aux_p, aux_s), (shape_p, shape_s) = ctx.aux, ctx.lse_shapes
        dq_p, dk_p, dv_p = bwd(g, q, k_p, v_p, o, lse.reshape(shape_p).contiguous(), aux_p, False, ctx.scale)
        dq_s, dk_s, dv_s = bwd(g, q, k_s, v_s, o, lse.reshape(shape_s).contiguous(), aux_s, True, ctx.scale)
        return dq_p + dq_s, dk_p, dv_p, dk_s, dv_s, None, None


def prefix_square_attention(q: torch.Tensor, k_p: torch.Tensor, v_p: torch.Tensor, k_s: torch.Tensor,
                            v_s: torch.Tensor, scale: float, kernel: str) -> torch.Tensor:
    """softmax(scale · q [k_p | k_s]ᵀ + mask) [v_p | v_s] with every prefix key visible and the square part
    causal: q [1, H, n, D], prefix k_p/v_p [1, Hkv, m, D], square k_s/v_s [1, Hkv, n, D]. `kernel` from
    `split_kernel`. Returns [1, H, n, Dv]."""
    if kernel not in _KERNELS:
        raise ValueError(f"unknown attention kernel {kernel!r} ({', '.join(_KERNELS)})")
    if kernel == "cpu" and k_p.shape[1] < q.shape[1]:  # the CPU kernel has no GQA: K/V repeated (gradients summed)
        rep = q.shape[1] // k_p.shape[1]
        k_p, v_p, k_s, v_s = (x.repeat_interleave(rep, 1) for x in (k_p, v_p, k_s, v_s))
    return _PrefixSquare.apply(q, k_p, v_p, k_s, v_s, scale, kernel)
