"""Triton kernels of the fused LM head's generic path: per-token logit statistics and recomputed dlogits tiles. The
triton backend module: it also re-exports the eager path's kernels (kernels/lm_head_tiles_triton.py).

Imported lazily by kernels/lm_head.py (never at package import), so the CPU path needs no triton.

Shape legend: T tokens, H hidden size, V vocab rows held by this rank, S vocab splits of the stats kernel,
BT/BV/BK tile sizes (kernels/tiles.py). Scaled logits x = (h . w_v) / temperature, always fp32 in registers.

stats:   grid = ceil(T/BT) * S programs on axis 0 (axis 0 allows 2^31-1 programs, so T of millions is fine).
         Program (t, s) walks vocab split s tile by tile with a running max (online log-sum-exp) and writes
         per-split lse, the entropy of the split's own softmax, and the target's x if this split holds it.
         Splits of one token block are adjacent program ids, so programs resident together read the same
         hidden rows and L2 serves them: the hidden block is re-read once per vocab tile, from L2, not HBM.
dlogits: one [BT, BV] tile per program (grouped ordering for L2 reuse of the weight tile), recomputes x and
         writes dlogits = (p * (a + b * x) + c * onehot) / temperature with p = exp(x - lse); a, b, c are
         per-token coefficients built by the autograd function from the upstream gradients.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from kernels.lm_head_chunked import combine_splits
# the eager path's kernels, under the same backend module (kmod.logits_tiles, kmod.dlogits_from_tiles)
from kernels.lm_head_tiles_triton import (  # noqa: F401
    dlogits_from_tiles, logits_tiles, merge_tiles, target_logits, tile_vocab)
from kernels.tiles import DW_ACC_TILES, DZ_ROWS_TILE, tile_configs
from kernels.triton_common import _ARCH, _VENDOR, _dot_fp32, _even_k, _logits_tile, _mma_step, _num_sms, _token_rows


def _configs(kernel: str) -> list[triton.Config]:
    # The stats kernel is tried with nested and flattened loops (FLATTEN); the autotuner keeps the faster.
    flatten = (False, True) if kernel == "stats" else (None,)
    if _VENDOR == "interpreter":  # one config, no timing: the loop shape comes from the environment (tests)
        flatten = (os.environ.get("KERNELS_LM_HEAD_FLATTEN", "1") == "1",) if kernel == "stats" else (None,)
    configs = []
    for c in tile_configs(_VENDOR, _ARCH, kernel):
        for f in flatten:
            cfg = triton.Config(
                {"BLOCK_T": c.block_t, "BLOCK_V": c.block_v, "BLOCK_K": c.block_k}
                | ({} if f is None else {"FLATTEN": f}),
                num_warps=c.num_warps,
                num_stages=c.num_stages,
            )
            cfg.elem_bytes = c.elem_bytes
            configs.append(cfg)
    return configs


def _prune_by_width(configs, named_args, **kwargs):
    """Keep the tiles sized for this operand width (fp32 tiles would waste a bf16 run; bf16 tiles overflow SMEM
    with fp32 operands)."""
    if _VENDOR == "interpreter":
        return configs
    width = 4 if kwargs.get("DOT_FP32", named_args.get("DOT_FP32")) else 2
    return [c for c in configs if c.elem_bytes == width]


@triton.jit
def _online_update(acc, offs_v, v_end, tgt, inv_temp, m2, s, wy, tz, WITH_ENTROPY: tl.constexpr):
    """Fold one [BT, BV] logits tile into the running (max, sum exp, sum exp * (x - max), target x) of each row.

    With y = x - max, entropy = log s - wy / s: both terms are small when p is peaked, where lse - sum p x
    would cancel two numbers of the size of the logits (|x| ~ 100 leaves no digits)."""
    v_mask = offs_v < v_end
    x = acc * inv_temp
    x2 = tl.where(v_mask[None, :], x * 1.4426950408889634, float("-inf"))
    m2_new = tl.maximum(m2, tl.max(x2, 1))
    alpha = tl.exp2(m2 - m2_new)  # rescales the old sums to the new max; exp2(-inf) = 0 on the first tile
    e = tl.exp2(x2 - m2_new[:, None])  # masked columns: exp2(-inf) = 0
    if WITH_ENTROPY:
        shift = tl.where(s > 0, (m2 - m2_new) * 0.6931471805599453, 0.0)  # old y are measured from the old max
        # y in the same log2 units as e = exp2(x2 - m2): ln e exactly, so log s - sum(e y)/s is the entropy of the
        # very weights summed (x - max in natural units would carry the rounding of max * ln 2, ~3e-5 at |x| ~ 300,
        # as an absolute entropy error: 1e-2 relative on a peaked row)
        y = tl.where(v_mask[None, :], (x2 - m2_new[:, None]) * 0.6931471805599453, 0.0)
        wy = alpha * (wy + shift * s) + tl.sum(e * y, 1)
    s = s * alpha + tl.sum(e, 1)
    tz += tl.sum(tl.where(offs_v[None, :] == tgt[:, None], x, 0.0), 1)
    return m2_new, s, wy, tz


@triton.autotune(configs=_configs("stats"), key=["H", "DOT_FP32", "WITH_ENTROPY"],
                 prune_configs_by={"early_config_prune": _prune_by_width})
@triton.heuristics({"EVEN_K": _even_k})
@triton.jit
def _stats_kernel(
    h_ptr, w_ptr, tgt_ptr, lse_ptr, ent_ptr, tz_ptr,
    T, V, H, stride_h, stride_w, inv_temp, NUM_SPLITS,
    WITH_ENTROPY: tl.constexpr, DOT_FP32: tl.constexpr, EVEN_K: tl.constexpr, FLATTEN: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid = tl.program_id(0)
    pid_s = pid % NUM_SPLITS
    pid_t = pid // NUM_SPLITS

    offs_t, t_mask, rows = _token_rows(pid_t, T, BLOCK_T)
    tgt = tl.load(tgt_ptr + rows)
    offs_k = tl.arange(0, BLOCK_K)
    h_rows = h_ptr + rows[:, None] * stride_h

    per_split = tl.cdiv(tl.cdiv(V, NUM_SPLITS), BLOCK_V) * BLOCK_V
    v_begin = pid_s * per_split
    v_end = tl.minimum(v_begin + per_split, V)

    m2 = tl.full([BLOCK_T], float("-inf"), tl.float32)  # running max of x in log2 units (x * log2 e)
    s = tl.zeros([BLOCK_T], tl.float32)  # sum of exp2(x2 - m2)
    wy = tl.zeros([BLOCK_T], tl.float32)  # sum of exp2(x2 - m2) * (x - max x): the entropy without cancellation
    tz = tl.zeros([BLOCK_T], tl.float32)  # x at the target, if this split holds it
    acc = tl.zeros([BLOCK_T, BLOCK_V], tl.float32)

    if FLATTEN:
        # One loop over (vocab tile, k step) pairs: the software pipeline keeps loads in flight across vocab-tile
        # boundaries instead of draining and refilling once per tile.
        k_tiles = tl.cdiv(H, BLOCK_K)
        num_v_tiles = tl.cdiv(tl.maximum(v_end - v_begin, 0), BLOCK_V)
        for it in range(0, num_v_tiles * k_tiles):
            ki = it % k_tiles
            v0 = v_begin + (it // k_tiles) * BLOCK_V
            offs_v = v0 + tl.arange(0, BLOCK_V)
            w_rows = w_ptr + tl.minimum(offs_v, V - 1).to(tl.int64)[:, None] * stride_w
            acc = _mma_step(h_rows, w_rows, ki * BLOCK_K + offs_k, H, acc, DOT_FP32, EVEN_K)
            if ki == k_tiles - 1:
                m2, s, wy, tz = _online_update(acc, offs_v, v_end, tgt, inv_temp, m2, s, wy, tz, WITH_ENTROPY)
                acc = tl.zeros([BLOCK_T, BLOCK_V], tl.float32)
    else:
        for v0 in range(v_begin, v_end, BLOCK_V):
            offs_v = v0 + tl.arange(0, BLOCK_V)
            w_rows = w_ptr + tl.minimum(offs_v, V - 1).to(tl.int64)[:, None] * stride_w
            acc = tl.zeros([BLOCK_T, BLOCK_V], tl.float32)
            for k0 in range(0, H, BLOCK_K):
                acc = _mma_step(h_rows, w_rows, k0 + offs_k, H, acc, DOT_FP32, EVEN_K)
            m2, s, wy, tz = _online_update(acc, offs_v, v_end, tgt, inv_temp, m2, s, wy, tz, WITH_ENTROPY)

    lse = (m2 + tl.log2(s)) * 0.6931471805599453  # -inf for an empty split
    ent = tl.where(s > 0, tl.log(s) - wy / s, 0.0)  # entropy of this split's own softmax
    out = pid_s.to(tl.int64) * T + offs_t
    tl.store(lse_ptr + out, lse, mask=t_mask)
    tl.store(ent_ptr + out, ent, mask=t_mask)
    tl.store(tz_ptr + out, tz, mask=t_mask)


@triton.autotune(configs=_configs("dlogits"), key=["H", "DOT_FP32"],
                 prune_configs_by={"early_config_prune": _prune_by_width})
@triton.heuristics({"EVEN_K": _even_k})
@triton.jit
def _dlogits_kernel(
    h_ptr, w_ptr, tgt_ptr, lse_ptr, a_ptr, b_ptr, c_ptr, scale_ptr, dz_ptr,
    T, V, H, stride_h, stride_w, stride_dz, v_off, inv_temp,
    DOT_FP32: tl.constexpr, EVEN_K: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_T: tl.constexpr = 8,
):
    # Grouped ordering: GROUP_T token blocks sweep one band of vocab tiles together, so a weight tile is read
    # from HBM once per group and served from L2 to the rest.
    pid = tl.program_id(0)
    num_t = tl.cdiv(T, BLOCK_T)
    num_v = tl.cdiv(V, BLOCK_V)
    group = pid // (GROUP_T * num_v)
    first_t = group * GROUP_T
    group_size = tl.minimum(num_t - first_t, GROUP_T)
    pid_t = first_t + (pid % group_size)
    pid_v = (pid % (GROUP_T * num_v)) // group_size

    offs_t, t_mask, rows = _token_rows(pid_t, T, BLOCK_T)
    offs_v = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
    v_mask = offs_v < V
    acc = _logits_tile(h_ptr, w_ptr, rows, offs_v, V, H, stride_h, stride_w, DOT_FP32, EVEN_K, BLOCK_T, BLOCK_V,
                       BLOCK_K)

    _dlogits_epilogue(acc, rows, offs_t, offs_v, t_mask, v_mask, tgt_ptr, lse_ptr, a_ptr, b_ptr, c_ptr, scale_ptr,
                      dz_ptr, stride_dz, v_off, inv_temp)


@triton.jit
def _dlogits_epilogue(acc, rows, offs_t, offs_v, t_mask, v_mask, tgt_ptr, lse_ptr, a_ptr, b_ptr, c_ptr, scale_ptr,
                      dz_ptr, stride_dz, v_off, inv_temp):
    """dz = scale * (p (a + b x) + c [v == target]) / temperature, stored in dz's dtype. `scale` is a power of
    two that moves the tile's values into fp16's range (undone, exactly, after the GEMMs); 1 otherwise."""
    lse = tl.load(lse_ptr + rows)
    ca = tl.load(a_ptr + rows)
    cb = tl.load(b_ptr + rows)
    cc = tl.load(c_ptr + rows)
    tgt = tl.load(tgt_ptr + rows) - v_off
    x = acc * inv_temp
    p = tl.exp2((x - lse[:, None]) * 1.4426950408889634)
    dz = p * (ca[:, None] + cb[:, None] * x)
    dz += tl.where(offs_v[None, :] == tgt[:, None], cc[:, None], 0.0)
    dz = dz * (inv_temp * tl.load(scale_ptr))
    ptrs = dz_ptr + offs_t[:, None] * stride_dz + offs_v[None, :]
    tl.store(ptrs, dz.to(dz_ptr.dtype.element_ty), mask=t_mask[:, None] & v_mask[None, :])


@triton.jit
def _logits_dz_kernel(
    z_ptr, stride_z, tgt_ptr, lse_ptr, a_ptr, b_ptr, c_ptr, scale_ptr, dz_ptr, stride_dz, T, V, v_off, inv_temp,
    BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr,
):
    """fp32 logits [T, V] (from cuBLAS) -> dlogits, elementwise; the output may be the input's own storage.

    One program owns BLOCK_T whole rows and sweeps them left to right. In place with a 2-byte output (row stride
    2V, the eager path), tile [v0, v0 + BV) is stored over fp32 elements [v0/2, (v0 + BV)/2) of the same rows,
    all read by this program already (this tile or earlier ones); the barrier makes every thread's load of the
    tile land before any thread's store. Not autotuned: timing configs would run an in-place kernel repeatedly."""
    pid = tl.program_id(0)
    offs_t, t_mask, rows = _token_rows(pid, T, BLOCK_T)
    for v0 in range(0, V, BLOCK_V):
        offs_v = v0 + tl.arange(0, BLOCK_V)
        v_mask = offs_v < V
        z = tl.load(z_ptr + rows[:, None] * stride_z + offs_v[None, :], mask=v_mask[None, :], other=0.0)
        tl.debug_barrier()
        _dlogits_epilogue(z, rows, offs_t, offs_v, t_mask, v_mask, tgt_ptr, lse_ptr, a_ptr, b_ptr, c_ptr,
                          scale_ptr, dz_ptr, stride_dz, v_off, inv_temp)


def num_vocab_splits(num_tokens: int, num_vocab: int, device: torch.device) -> int:
    """Vocab splits of the stats kernel: enough programs to fill the GPU several times over at small T, and at
    least 8 splits of >= 4096 rows each when V allows, so resident programs share hidden rows in L2."""
    token_blocks = triton.cdiv(num_tokens, 128)
    wanted = max(8, triton.cdiv(4 * _num_sms(device), token_blocks))
    return max(1, min(wanted, 16, triton.cdiv(num_vocab, 4096)))


def token_stats(hidden_TH, weight_VH, tgt_T, inv_temp: float, with_entropy: bool):
    """Per-token (lse, entropy, target x) over this rank's V rows; tgt_T is the local target index (outside
    [0, V) matches nothing). The entropy is zeros unless with_entropy."""
    T, H = hidden_TH.shape
    V = weight_VH.shape[0]
    S = num_vocab_splits(T, V, hidden_TH.device)
    f32 = dict(dtype=torch.float32, device=hidden_TH.device)
    lse_ST = torch.empty((S, T), **f32)
    ent_ST = torch.empty((S, T), **f32)
    tz_ST = torch.empty((S, T), **f32)
    grid = lambda meta: (triton.cdiv(T, meta["BLOCK_T"]) * S,)  # noqa: E731
    _stats_kernel[grid](
        hidden_TH, weight_VH, tgt_T, lse_ST, ent_ST, tz_ST,
        T, V, H, hidden_TH.stride(0), weight_VH.stride(0), inv_temp, S,
        WITH_ENTROPY=with_entropy, DOT_FP32=_dot_fp32(hidden_TH),
    )
    if S == 1:
        return lse_ST[0], ent_ST[0], tz_ST[0]
    return combine_splits(lse_ST, ent_ST, tz_ST)


def dlogits(hidden_TH, weight_VH, tgt_T, v_off: int, lse_T, a_T, b_T, c_T, inv_temp: float, scale, out_TV):
    """out_TV[t, v] = scale * dloss/dlogit for this token chunk and vocab chunk (weight_VH is the chunk's rows;
    tgt_T is the target index local to the rank, v_off the chunk's first row; scale a 1-element fp32 tensor)."""
    T, H = hidden_TH.shape
    V = weight_VH.shape[0]
    grid = lambda meta: (triton.cdiv(T, meta["BLOCK_T"]) * triton.cdiv(V, meta["BLOCK_V"]),)  # noqa: E731
    _dlogits_kernel[grid](
        hidden_TH, weight_VH, tgt_T, lse_T, a_T, b_T, c_T, scale, out_TV,
        T, V, H, hidden_TH.stride(0), weight_VH.stride(0), out_TV.stride(0), v_off, inv_temp,
        DOT_FP32=_dot_fp32(hidden_TH),
    )
    return out_TV


def dlogits_from_logits(z_TV, tgt_T, v_off: int, lse_T, a_T, b_T, c_T, inv_temp: float, scale, out_TV):
    """out_TV = scale * dloss/dlogit from an fp32 logits chunk. out_TV may have any row stride and may be z_TV
    itself, or a 2-byte view of z_TV's storage with row stride 2V (in place, see _logits_dz_kernel)."""
    T, V = z_TV.shape
    bt, bv, warps = DZ_ROWS_TILE[_VENDOR]
    _logits_dz_kernel[(triton.cdiv(T, bt),)](
        z_TV, z_TV.stride(0), tgt_T, lse_T, a_T, b_T, c_T, scale, out_TV, out_TV.stride(0), T, V, v_off, inv_temp,
        BLOCK_T=bt, BLOCK_V=bv, num_warps=warps,
    )
    return out_TV


@triton.jit
def _dw_acc_kernel(dz_ptr, h_ptr, acc_ptr, scale_ptr, T, V, H, stride_dz, stride_h, stride_acc,
                   FIRST: tl.constexpr, DOT_FP32: tl.constexpr,
                   BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr):
    """acc[V, H] (fp32) = or += dz[T, V]^T @ (h[T, H] x scale): dz fp16, h bf16/fp16 converted in registers
    (times a power of two: exact), fp32 accumulation over all T inside the program, one fp32 read-modify-write."""
    pid_v = tl.program_id(0)
    pid_h = tl.program_id(1)
    offs_v = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
    offs_h = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    v_mask = offs_v < V
    h_mask = offs_h < H
    scale = tl.load(scale_ptr)
    acc = tl.zeros([BLOCK_V, BLOCK_H], tl.float32)
    for k0 in range(0, T, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < T
        rows = offs_k.to(tl.int64)[:, None]
        a = tl.load(dz_ptr + rows * stride_dz + offs_v[None, :], mask=k_mask[:, None] & v_mask[None, :], other=0.0)
        b = tl.load(h_ptr + rows * stride_h + offs_h[None, :], mask=k_mask[:, None] & h_mask[None, :], other=0.0)
        b = b.to(tl.float32) * scale
        if DOT_FP32:
            acc = tl.dot(tl.trans(a.to(tl.float32)), b, acc, input_precision="ieee")
        else:
            acc = tl.dot(tl.trans(a), b.to(tl.float16), acc)
    ptrs = acc_ptr + offs_v.to(tl.int64)[:, None] * stride_acc + offs_h[None, :]
    mask = v_mask[:, None] & h_mask[None, :]
    if not FIRST:
        acc += tl.load(ptrs, mask=mask, other=0.0)
    tl.store(ptrs, acc, mask=mask)


def dw_acc(acc_VH, dz_TV, h_TH, scale, first: bool) -> None:
    """acc (fp32 [V, H]) = (first) or += dz^T @ (h * scale), with dz fp16 and h 16-bit: the dW GEMM of the lean
    backward without an fp16 copy of h (kernels/lm_head_lean.py)."""
    T, V = dz_TV.shape
    H = h_TH.shape[1]
    c = DW_ACC_TILES[_VENDOR]
    grid = (triton.cdiv(V, c.block_t), triton.cdiv(H, c.block_v))
    _dw_acc_kernel[grid](dz_TV, h_TH, acc_VH, scale, T, V, H, dz_TV.stride(0), h_TH.stride(0), acc_VH.stride(0),
                         FIRST=first, DOT_FP32=_VENDOR == "interpreter", BLOCK_V=c.block_t, BLOCK_H=c.block_v,
                         BLOCK_K=c.block_k, num_warps=c.num_warps, num_stages=c.num_stages)
