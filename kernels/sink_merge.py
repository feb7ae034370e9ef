"""The sink merge's two passes over an attention output (launch/attention_parts.py), each one kernel:

    scale_rows(o, w)   o ← o · w, one fp32 weight per row (head and token), in place: the forward's merge of the
                       kernel's output with the sink, o' = o · e^(l − l')
    row_dots(g, o)     D = rowsum(g ∘ o) in fp32: the backward's D of the sink's gradient, ∂L/∂σ_h = −Σ_t p·D

o and g are [..., D] with their rows at any strides (the kernels' own output layouts) and the channels contiguous.

Why fuse: torch runs the first as a broadcast multiply of a bf16 tensor by an fp32 one and the second as an fp32
copy, a mixed-dtype product and a reduction, all on its generic strided elementwise kernels: on an H200 they take
most of the ~3.4 ms a gpt-oss-120b full layer's merge costs forward and backward at 32K tokens, where the bytes
they must move take ~0.3 ms. The kernels read each row once, in fp32 registers, with one rounding (scale_rows) or
none (row_dots). Backends as in kernels/gdn_fused.py: "auto" runs Triton on CUDA/ROCm tensors when triton is
installed and the torch path otherwise; "torch" and "triton" force one ("triton" on CPU tensors only under
TRITON_INTERPRET=1).
"""

from __future__ import annotations

import torch

from kernels.gdn_fused import _pick_backend


def scale_rows_torch(o: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The torch path (the CPU path, and the kernel's reference): fp32 arithmetic, one rounding."""
    return o.mul_(w[..., None])


def row_dots_torch(g: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
    acc = torch.promote_types(o.dtype, torch.float32)
    return (g.to(acc) * o).sum(-1)


def _rows(x: torch.Tensor) -> torch.Tensor | None:
    """x as [R1, R2, D] by a view (leading dims of size 1 dropped, a single row dim given a leading 1), or None
    where its rows are not two strided dims or its channels are not contiguous."""
    while x.dim() > 3 and x.shape[0] == 1:
        x = x[0]
    if x.dim() == 2:
        x = x[None]
    return x if x.dim() == 3 and x.stride(-1) == 1 else None


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


def row_dots(g: torch.Tensor, o: torch.Tensor, backend: str = "auto") -> torch.Tensor:
    """rowsum(g ∘ o) [...] in fp32 (in o's dtype where that is wider) for g, o [..., D]."""
    _check(o, g, False)
    g3, o3 = _rows(g), _rows(o)
    if _pick_backend(o, backend) == "torch" or g3 is None or o3 is None or o.numel() == 0 \
            or o.dtype == torch.float64:
        return row_dots_torch(g, o)
    from kernels import sink_merge_triton

    return sink_merge_triton.row_dots(g3, o3).reshape(o.shape[:-1])
