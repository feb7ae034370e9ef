"""The sink merge's two passes over an attention output (launch/attention_parts.py), each one kernel:

    scale_rows(o, w)    o ← o · w, one fp32 weight per row (head and token), in place: the forward's merge of the
                        kernel's output with the sink, o' = o · e^(l − l')
    grad_rows(do, o)    (g, D): dO in o's layout, which the attention kernels' backward takes, and D = rowsum(dO ∘ o)
                        in fp32, the sink's gradient being ∂L/∂σ_h = −Σ_t p·D

o and dO are [..., D] with their rows at any strides (the kernels' own output layouts, the gradient as the layers
above hand it) and the channels contiguous.

Why fuse: torch runs the first as a broadcast multiply of a bf16 tensor by an fp32 one, and the second as a strided
copy, an fp32 copy, a mixed-dtype product and a reduction, all on its generic strided elementwise kernels: on an
H200 the sinks then cost a gpt-oss-120b full layer 7.1 ms of its step at 32K tokens, and 1.6 ms on these kernels
(docs/BENCHMARKS.md, "Attention at width 64, and the sinks"). The kernels read each row once, in fp32 registers,
with one rounding (scale_rows) or none.
Backends as in kernels/gdn_fused.py: "auto" runs Triton on CUDA/ROCm tensors when triton is installed and the torch
path otherwise; "torch" and "triton" force one ("triton" on CPU tensors only under TRITON_INTERPRET=1).
"""

from __future__ import annotations

import torch

from kernels.gdn_fused import _pick_backend


def scale_rows_torch(o: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The torch path (the CPU path, and the kernel's reference): fp32 arithmetic, one rounding."""
    return o.mul_(w[..., None])


def grad_rows_torch(do: torch.Tensor, o: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    g = do if do.stride() == o.stride() else torch.empty_like(o).copy_(do)
    acc = torch.promote_types(o.dtype, torch.float32)
    return g, (g.to(acc) * o).sum(-1)


# the kernels' grid takes R2 in blocks of 64 rows on its second axis, which holds at most 65,535 blocks
MAX_R2 = 64 * 65535


def _rows(x: torch.Tensor) -> torch.Tensor | None:
    """x as [R1, R2, D] by a view (leading dims of size 1 dropped, a single row dim given a leading 1), or None
    where its rows are not two strided dims, its channels are not contiguous or R2 exceeds the grid (MAX_R2)."""
    while x.dim() > 3 and x.shape[0] == 1:
        x = x[0]
    if x.dim() == 2:
        x = x[None]
    return x if x.dim() == 3 and x.stride(-1) == 1 and x.shape[1] <= MAX_R2 else None


def _check(o: torch.Tensor, other: torch.Tensor, rows_only: bool) -> None:
    shape = o.shape[:-1] if rows_only else o.shape
    if other.shape != shape:
        raise ValueError(f"expected {'one weight per row ' if rows_only else ''}of shape {tuple(shape)}, "
                         f"got {tuple(other.shape)}")


def scale_rows(o: torch.Tensor, w: torch.Tensor, backend: str = "auto") -> torch.Tensor:
    """o [..., D] scaled in place by w [...] (fp32, one per row) in fp32 arithmetic, rounded once; returns o."""
    _check(o, w, True)
    o3 = _rows(o)
    if _pick_backend(o, backend) == "torch" or o3 is None or o.numel() == 0:
        return scale_rows_torch(o, w)
    from kernels import sink_merge_triton

    sink_merge_triton.scale_rows(o3, w.to(torch.float32).reshape(o3.shape[:-1]))
    return o


def grad_rows(do: torch.Tensor, o: torch.Tensor, backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """(g, D) for the gradient dO and the output o [..., D]: g = dO at o's strides (dO itself where they are
    already o's), D = rowsum(dO ∘ o) [...] in fp32 (in o's dtype where that is wider)."""
    _check(o, do, False)
    d3, o3 = _rows(do), _rows(o)
    if _pick_backend(o, backend) == "torch" or None in (d3, o3) or o.numel() == 0 or o.dtype == torch.float64:
        return grad_rows_torch(do, o)
    from kernels import sink_merge_triton

    if do.stride() == o.stride():
        return do, sink_merge_triton.grad_rows(d3, o3, None).reshape(o.shape[:-1])
    g = torch.empty_like(o)  # o's strides, or contiguous where o is not dense: rows as _rows takes them either way
    return g, sink_merge_triton.grad_rows(d3, o3, _rows(g)).reshape(o.shape[:-1])
