"""Numerics every path of the LM head shares: the named types passed between them, the fp16 scaling of the
backward's operands, the fp32-accumulating GEMM calls, and the merge of statistics over vocabulary parts.

Shape legend: T tokens, H hidden size, V vocab rows on this rank, N vocab tiles or splits. z = hidden @ weight.T,
x = z / temperature, or with a soft cap c (Gemma's final_logit_softcapping) x = c tanh(z / c) / temperature.

The head maps (hidden, weight) to three per-token vectors over x: tz = x[target] (0 where the target is not a row
here), lse = log sum_v exp(x_v), ent = -sum_v p_v log p_v (p = softmax(x)). Any loss on them has, per logit,
    dloss/dx_v = p_v (a + b x_v) + c [v == target],  a = g_lse + g_ent (lse - ent),  b = -g_ent,  c = g_tz
(g_* the loss's gradients with respect to tz, lse and ent; d lse/dx = p, d ent/dx_v = -p_v (x_v - lse + ent)), and
dloss/dz is that divided by the temperature (times the cap's slope, below). `Coefficients` carries (lse, a, b, c).

With a cap, dx/dz = (1 - tanh^2(z / c)) / temperature, and tanh(z / c) = x temperature / c: the slope
1 - (x temperature / c)^2 (`softcap_slope`) is formed from x wherever the dZ kernels have it. They apply it to the
p term of every logit; the target's term takes it from tz (exact fp32), folded into c (`cap_target_term`), since the
target's tile weight may have underflowed where its x cannot be read back from it. |slope| <= 1, so every bound on
dZ below holds with the cap, and |x| <= c / temperature.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
# logits_tiles stores its tile weights times 2^14: e in (0, 1] lands in (0, 2^14], inside fp16's normal range down
# to e = 2^-28 (unscaled, fp16 would go subnormal, losing bits, below e = 2^-14)
E_LOG2 = 14.0
E_SCALE = 2.0**E_LOG2
# logits_tiles' per-tile statistics, fp32 [num_tiles, T] each: the tile's max, its own lse, its entropy
PARTS_PER_TILE = 3


@dataclass(frozen=True)
class Head:
    """One call's operands: hidden [T, H] and weight [V, H] (same dtype, contiguous), the target as a row index of
    this weight (outside [0, V) matches nothing: ignored, or on another rank), 1 / temperature, the vocab-parallel
    group (None: the whole vocabulary is here), the backend module (torch_backend or triton_backend) and the soft
    cap c of the logits (None: none; see `softcap_value`). Derived heads are made with dataclasses.replace."""

    hidden: torch.Tensor
    weight: torch.Tensor
    tgt: torch.Tensor
    inv_temp: float
    tp_group: object
    kmod: object
    softcap: float | None


@dataclass(frozen=True)
class Coefficients:
    """Per-token lse and (a, b, c) of dloss/dx_v = p_v (a + b x_v) + c [v == target], fp32 [T]; b None: b = 0."""

    lse: torch.Tensor
    a: torch.Tensor
    b: torch.Tensor | None
    c: torch.Tensor

    def rows(self, t0: int, t1: int) -> "Coefficients":
        return Coefficients(self.lse[t0:t1], self.a[t0:t1], None if self.b is None else self.b[t0:t1],
                            self.c[t0:t1])

    def b_or_a(self) -> torch.Tensor:
        """b for a kernel argument that is not read when b is None (has_b False)."""
        return self.a if self.b is None else self.b


@dataclass(frozen=True)
class TileStats:
    """What logits_tiles returns: m2 [N, T] each tile's row maxima (log2 units, x2 = x log2 e) and the tile width;
    merged over the tiles, lse2 [T] (log2 units), ent [T] (zeros unless asked for) and tz [T] (the target logit).
    The merged three are None when the caller asked for the tile maxima only (merge=False)."""

    m2: torch.Tensor
    tile_v: int
    lse2: torch.Tensor | None = None
    ent: torch.Tensor | None = None
    tz: torch.Tensor | None = None


def tp_info(tp_group) -> tuple[int, int]:
    if tp_group is None:
        return 0, 1
    return dist.get_rank(tp_group), dist.get_world_size(tp_group)


def local_target(target_T: torch.Tensor, V: int, tp_group) -> torch.Tensor:
    """Global vocab indices -> row indices of this rank's equal share (V_global = V * tp, as vocab-parallel layers
    pad the vocabulary); no copy of an int64 target on one rank."""
    rank, _ = tp_info(tp_group)
    return target_T.long() - rank * V if rank else target_T.long()


def softcap_value(softcap) -> float | None:
    """The cap as the kernels take it: None for None or 0 (no cap: the uncapped code paths), else a positive float."""
    if softcap is None or softcap == 0:
        return None
    softcap = float(softcap)
    if not 0 < softcap < math.inf:
        raise ValueError(f"softcap must be a positive number, 0 or None, got {softcap}")
    return softcap


def softcap_slope(x: torch.Tensor, softcap: float, inv_temp: float) -> torch.Tensor:
    """1 - tanh^2(z / c) from x = c tanh(z / c) / temperature: t = x temperature / c, (1 - t)(1 + t)."""
    t = x * (1.0 / (softcap * inv_temp))
    return (1.0 - t) * (1.0 + t)


def cap_target_term(coef: Coefficients, tz: torch.Tensor, softcap: float | None, inv_temp: float) -> Coefficients:
    """The coefficients with the target's slope folded into c (c [v == target] is dloss/dx at the target only):
    temperature dloss/dz_v = p_v (a + b x_v) slope_v + c slope(tz) [v == target]. tz is the exact fp32 target x (0
    where the target is ignored: c is 0 there). No cap: coef itself."""
    if softcap is None:
        return coef
    return Coefficients(coef.lse, coef.a, coef.b, (coef.c * softcap_slope(tz, softcap, inv_temp)).contiguous())


def check_inputs(hidden, weight, target, temperature):
    """(hidden, weight) contiguous in weight's dtype, or ValueError naming what is wrong."""
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


def combine_over_group(lse_T, ent_T, tz_T, tp_group):
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


def combine_splits(lse_ST, ent_ST, tz_ST):
    """Merge per-split stats over dim 0 (vocab splits): with q_s = exp(lse_s - lse) the split's share of the
    mass, entropy = sum_s q_s ent_s - sum_s q_s log q_s. Empty splits carry lse = -inf and drop out."""
    max_T = lse_ST.amax(0)
    scale_ST = torch.exp(lse_ST - max_T)
    sum_T = scale_ST.sum(0)
    lse_T = max_T + torch.log(sum_T)
    log_q_ST = torch.where(scale_ST > 0, lse_ST - lse_T, 0.0)
    ent_T = (scale_ST * (ent_ST - log_q_ST)).sum(0) / sum_T
    return lse_T, ent_T, tz_ST.sum(0)


def downcast_in_place(x32: torch.Tensor, dtype: torch.dtype, chunk: int = 1 << 24) -> torch.Tensor:
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


GEMM_ALIGN = 64  # elements: the vocabulary extent of the gradient GEMMs' operands is padded to a multiple of it


def aligned_width(n: int, tile: int | None = None) -> int:
    """n rounded up to a multiple of GEMM_ALIGN, or of gcd(GEMM_ALIGN, tile) where the padding has to stay inside
    the last logits tile of width `tile` (every kernel tile of the GPU backends is a multiple of GEMM_ALIGN). cuBLAS
    takes its Hopper kernels only when the operands' leading dimensions and contiguous extents are 16-byte
    multiples; a vocabulary that is not (Hunyuan-A13B's 128,167, Granite's 49,155) otherwise sends both gradient
    GEMMs, whose K or M is the vocabulary, to align-1 kernels that run ~4x slower. The heads pad instead: zero
    columns of dZ against zero rows of W, exact (docs/kernels.md, "An odd vocabulary")."""
    step = math.gcd(GEMM_ALIGN, tile) if tile else GEMM_ALIGN
    return -(-n // step) * step


def weight_columns(e_TV: torch.Tensor | None, V: int, tile_end: int) -> int:
    """The columns logits_tiles writes its tile weights into: e_TV's width, from V (the vocabulary) up to tile_end
    (the last tile's end; those past V are written as zeros), or V without e_TV."""
    if e_TV is None:
        return V
    if not V <= e_TV.shape[1] <= tile_end:
        raise ValueError(f"e_TV has {e_TV.shape[1]} columns: it needs V = {V} to {tile_end} (the last tile's end)")
    return e_TV.shape[1]


_MIXED_ADDMM_OK = True  # torch.addmm(..., out_dtype=fp32) with 16-bit operands (CUDA, torch >= 2.8)


def gemm_acc(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor, first: bool, alpha: float = 1.0) -> None:
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


_LOGITS_MM = None  # which fp32-output GEMM call works here; found on first use


def logits_fp32(h_tH: torch.Tensor, w_vH: torch.Tensor, out_tv: torch.Tensor) -> None:
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
    gemm_acc(out_tv, h_tH, w_vH.T, first=False)


def pow2_scale(max_abs: torch.Tensor, target: float = 2.0**14) -> torch.Tensor:
    """A power of two s (0-dim fp32 tensor, no host sync) with max_abs * s in (target/2, target]: multiplying
    by it is exact, and it moves values into fp16's range (max 65504, full precision down to 6.1e-5)."""
    max_abs = max_abs.float()
    safe = torch.where(max_abs > 0, max_abs, torch.ones_like(max_abs))
    return torch.exp2(torch.floor(torch.log2(target / safe))).clamp(2.0**-100, 2.0**100).reshape(())


def amax(x: torch.Tensor) -> torch.Tensor:
    if x.numel() == 0:  # (the inf norm has no identity; nothing to bound)
        return torch.zeros((), dtype=torch.float32, device=x.device)
    return torch.linalg.vector_norm(x, float("inf"))  # max |x| in one pass, no |x| temporary


def dz_scale(coef: Coefficients, inv_temp: float) -> torch.Tensor:
    """The power-of-two scale of an fp16 dZ for these tokens (0-dim, no host sync): |dlogit| <= (|a| + |b| (|lse| + 1)
    + |c|) / temperature, since p |x| <= |lse| + 1 (and a cap's slope is at most 1)."""
    bound = amax(coef.a) + amax(coef.c)
    if coef.b is not None:
        bound = bound + amax(coef.b) * (amax(coef.lse) + 1)
    return pow2_scale(bound * inv_temp)


@dataclass(frozen=True)
class Operands:
    """The backward GEMMs' operand dtype and the power-of-two scales of dZ, h and w (0-dim fp32 tensors)."""

    dtype: torch.dtype
    dz_scale: torch.Tensor
    h_scale: torch.Tensor
    w_scale: torch.Tensor


def backward_operands(head: Head, coef: Coefficients) -> Operands:
    """fp32 inputs run in fp32 with unit scales; 16-bit inputs give fp16 dZ, h and w operands, each times a power
    of two (no host sync) that moves it into fp16's range."""
    one = torch.ones((), dtype=torch.float32, device=head.hidden.device)
    if head.hidden.dtype == torch.float32:
        return Operands(torch.float32, one, one, one)
    scale = dz_scale(coef, head.inv_temp)
    if head.hidden.dtype == torch.float16:  # the inputs are the GEMM operands as they are: no conversion, no scale
        return Operands(torch.float16, scale, one, one)
    return Operands(torch.float16, scale, pow2_scale(amax(head.hidden)), pow2_scale(amax(head.weight)))
