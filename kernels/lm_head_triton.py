"""Triton kernels of the fused LM head: per-token logit statistics and recomputed dlogits tiles.

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
from kernels.tiles import DZ_ROWS_TILE, DZ_TILES, MERGE_TILES, logits_tile_config, tile_configs

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453


def _vendor() -> tuple[str, int]:
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        return "interpreter", 0
    if torch.version.hip is not None:
        return "amd", 9
    if torch.cuda.is_available():
        return "nvidia", torch.cuda.get_device_capability()[0]
    return "nvidia", 9


_VENDOR, _ARCH = _vendor()


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


def _even_k(args) -> bool:
    return args["H"] % args["BLOCK_K"] == 0


@triton.jit
def _mma_step(h_rows, w_rows, kk, H, acc, DOT_FP32: tl.constexpr, EVEN_K: tl.constexpr):
    """acc += h[rows, kk] @ w[rows_v, kk]^T, fp32 accumulation."""
    if EVEN_K:
        a = tl.load(h_rows + kk[None, :])
        b = tl.load(w_rows + kk[None, :])
    else:
        a = tl.load(h_rows + kk[None, :], mask=kk[None, :] < H, other=0.0)
        b = tl.load(w_rows + kk[None, :], mask=kk[None, :] < H, other=0.0)
    if DOT_FP32:
        return tl.dot(a.to(tl.float32), tl.trans(b.to(tl.float32)), acc, input_precision="ieee")
    return tl.dot(a, tl.trans(b), acc)


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

    offs_t = pid_t.to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_mask = offs_t < T
    rows = tl.minimum(offs_t, T - 1)  # clamped rows load without a mask; their results are never stored
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

    offs_t = pid_t.to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_v = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
    t_mask = offs_t < T
    v_mask = offs_v < V
    rows = tl.minimum(offs_t, T - 1)
    h_rows = h_ptr + rows[:, None] * stride_h
    w_rows = w_ptr + tl.minimum(offs_v, V - 1).to(tl.int64)[:, None] * stride_w
    offs_k = tl.arange(0, BLOCK_K)

    acc = tl.zeros([BLOCK_T, BLOCK_V], tl.float32)
    for k0 in range(0, H, BLOCK_K):
        acc = _mma_step(h_rows, w_rows, k0 + offs_k, H, acc, DOT_FP32, EVEN_K)

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
    offs_t = pid.to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_mask = offs_t < T
    rows = tl.minimum(offs_t, T - 1)
    for v0 in range(0, V, BLOCK_V):
        offs_v = v0 + tl.arange(0, BLOCK_V)
        v_mask = offs_v < V
        z = tl.load(z_ptr + rows[:, None] * stride_z + offs_v[None, :], mask=v_mask[None, :], other=0.0)
        tl.debug_barrier()
        _dlogits_epilogue(z, rows, offs_t, offs_v, t_mask, v_mask, tgt_ptr, lse_ptr, a_ptr, b_ptr, c_ptr,
                          scale_ptr, dz_ptr, stride_dz, v_off, inv_temp)


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


def _dot_fp32(t: torch.Tensor) -> bool:
    # fp32 inputs take the exact (ieee) fp32 dot; under the interpreter every dot runs in fp32 (bf16 operands to
    # tl.dot give wrong results there).
    return t.dtype == torch.float32 or _VENDOR == "interpreter"


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


# ---------------------------------------------------------------------------------------------------------------
# Logits GEMM with the statistics in its epilogue (the eager path, kernels/lm_head_eager.py; docs/kernels.md,
# "Tile statistics in the GEMM epilogue").


@triton.heuristics({"EVEN_K": _even_k})
@triton.jit
def _logits_tiles_kernel(
    h_ptr, w_ptr, tgt_ptr, e_ptr, m2_ptr, lse2_ptr, ent_ptr, tz_ptr,
    T, V, H, stride_h, stride_w, stride_e, inv_temp,
    WRITE_E: tl.constexpr, WITH_ENTROPY: tl.constexpr, DOT_FP32: tl.constexpr, EVEN_K: tl.constexpr,
    SUBTILE: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """One [BLOCK_T, BLOCK_V] logits tile per program, x = (h . w) * inv_temp in fp32 registers, then per row of the
    tile: its max and the lse of the tile's own softmax (both in log2 units, x2 = x log2 e), its entropy and the
    target's x if the tile holds it, stored at [tile, row] ([num_tiles, T] arrays, merged like vocab splits); and,
    if WRITE_E, the tile's weights 2^14 e, e = exp(x - tile max) in (0, 1], in e's dtype (fp16 keeps 11
    significant bits at any magnitude: unlike x itself, whose fp16 rounding would grow with |x|). The token blocks
    of one vocab tile are adjacent program ids: the weight tile comes from HBM once and the [T, H] hidden block
    (16 MiB at T = 4096) stays in L2. (The persistent TMA variant below is what Hopper runs.)"""
    pid = tl.program_id(0)
    num_t = tl.cdiv(T, BLOCK_T)
    pid_v = pid // num_t
    pid_t = pid % num_t
    offs_t = pid_t.to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_mask = offs_t < T
    rows = tl.minimum(offs_t, T - 1)
    offs_v = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
    h_rows = h_ptr + rows[:, None] * stride_h
    w_rows = w_ptr + tl.minimum(offs_v, V - 1).to(tl.int64)[:, None] * stride_w
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_T, BLOCK_V], tl.float32)
    for k0 in range(0, H, BLOCK_K):
        acc = _mma_step(h_rows, w_rows, k0 + offs_k, H, acc, DOT_FP32, EVEN_K)
    _tile_epilogue(acc, pid_v, 0, offs_t, t_mask, rows, T, V, tgt_ptr, e_ptr, stride_e, m2_ptr, lse2_ptr, ent_ptr,
                   tz_ptr, inv_temp, WRITE_E, False, WITH_ENTROPY, SUBTILE, BLOCK_V)


@triton.jit
def _half_tile(acc, offs_v, V, inv_temp):
    """x, and x2 = x log2 e with columns past V at -inf, for one column block of a tile."""
    x = acc * inv_temp
    return x, tl.where((offs_v < V)[None, :], x * 1.4426950408889634, float("-inf"))


@triton.jit
def _tile_epilogue(acc, pid_v, t0, offs_t, t_mask, rows, T, V, tgt_ptr, e_ptr, stride_e, m2_ptr, lse2_ptr,
                   ent_ptr, tz_ptr, inv_temp, WRITE_E: tl.constexpr, E_TMA: tl.constexpr,
                   WITH_ENTROPY: tl.constexpr, SUBTILE: tl.constexpr, BLOCK_V: tl.constexpr):
    """Per row of the [BLOCK_T, BLOCK_V] tile: max m2 and lse2 of the tile's softmax (log2 units, x2 = x log2 e),
    its entropy, the target's x; 2^14 e = 2^(x2 - m2 + 14) stored when WRITE_E (in (0, 2^14]: fp16 keeps full
    precision down to e = 2^-28, as far below the tile's max as the scaled dZ keeps below the group's).
    SUBTILE: the tile is taken in two column halves, so the exp tile beside the accumulator is half as large
    (fewer live registers). E_TMA: e_ptr is a TMA descriptor of e (fp16) and the weights leave through TMA stores
    from row t0 (rows past T and columns past V are clipped by the copy engine)."""
    tgt = tl.load(tgt_ptr + rows)
    if SUBTILE:
        acc0, acc1 = tl.split(tl.permute(tl.reshape(acc, [acc.shape[0], 2, BLOCK_V // 2]), [0, 2, 1]))
        offs_v0 = pid_v * BLOCK_V + tl.arange(0, BLOCK_V // 2)
        offs_v1 = offs_v0 + BLOCK_V // 2
        x0, x2_0 = _half_tile(acc0, offs_v0, V, inv_temp)
        x1, x2_1 = _half_tile(acc1, offs_v1, V, inv_temp)
        m2 = tl.maximum(tl.max(x2_0, 1), tl.max(x2_1, 1))
        e0 = tl.exp2(x2_0 - m2[:, None])
        e1 = tl.exp2(x2_1 - m2[:, None])
        s = tl.sum(e0, 1) + tl.sum(e1, 1)
        tz = tl.sum(tl.where(offs_v0[None, :] == tgt[:, None], x0, 0.0), 1)
        tz += tl.sum(tl.where(offs_v1[None, :] == tgt[:, None], x1, 0.0), 1)
        if WITH_ENTROPY:
            wy = tl.sum(e0 * tl.where((offs_v0 < V)[None, :], x2_0 - m2[:, None], 0.0), 1)
            wy += tl.sum(e1 * tl.where((offs_v1 < V)[None, :], x2_1 - m2[:, None], 0.0), 1)
        if WRITE_E:
            if E_TMA:
                e_ptr.store([t0, pid_v * BLOCK_V], (e0 * 16384.0).to(tl.float16))
                e_ptr.store([t0, pid_v * BLOCK_V + BLOCK_V // 2], (e1 * 16384.0).to(tl.float16))
            else:
                row_ptrs = e_ptr + offs_t[:, None] * stride_e
                tl.store(row_ptrs + offs_v0[None, :], (e0 * 16384.0).to(e_ptr.dtype.element_ty),
                         mask=t_mask[:, None] & (offs_v0 < V)[None, :])
                tl.store(row_ptrs + offs_v1[None, :], (e1 * 16384.0).to(e_ptr.dtype.element_ty),
                         mask=t_mask[:, None] & (offs_v1 < V)[None, :])
    else:
        offs_v = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
        x, x2 = _half_tile(acc, offs_v, V, inv_temp)
        m2 = tl.max(x2, 1)  # finite: every tile holds at least one column
        e = tl.exp2(x2 - m2[:, None])
        s = tl.sum(e, 1)  # >= 1 (the max itself)
        tz = tl.sum(tl.where(offs_v[None, :] == tgt[:, None], x, 0.0), 1)
        if WITH_ENTROPY:
            wy = tl.sum(e * tl.where((offs_v < V)[None, :], x2 - m2[:, None], 0.0), 1)
        if WRITE_E:
            if E_TMA:
                e_ptr.store([t0, pid_v * BLOCK_V], (e * 16384.0).to(tl.float16))
            else:
                ptrs = e_ptr + offs_t[:, None] * stride_e + offs_v[None, :]
                tl.store(ptrs, (e * 16384.0).to(e_ptr.dtype.element_ty),
                         mask=t_mask[:, None] & (offs_v < V)[None, :])
    out = pid_v.to(tl.int64) * T + offs_t
    tl.store(m2_ptr + out, m2, mask=t_mask)
    tl.store(lse2_ptr + out, m2 + tl.log2(s), mask=t_mask)
    tl.store(tz_ptr + out, tz, mask=t_mask)
    if WITH_ENTROPY:  # the weights' own log2 units (see _online_update), then ln 2 once per row
        tl.store(ent_ptr + out, tl.log(s) - wy * 0.6931471805599453 / s, mask=t_mask)


@triton.jit
def _logits_tiles_tma_kernel(
    h_desc, w_desc, tgt_ptr, e_ptr, m2_ptr, lse2_ptr, ent_ptr, tz_ptr,
    T, V, H, stride_e, inv_temp, NUM_PROGRAMS,
    WRITE_E: tl.constexpr, E_TMA: tl.constexpr, WITH_ENTROPY: tl.constexpr, SUBTILE: tl.constexpr,
    WARP_SPECIALIZE: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """_logits_tiles_kernel for Hopper: persistent (one program per SM walks tiles NUM_PROGRAMS apart, the token
    blocks of a vocab tile consecutive), operands through TMA descriptors (no address arithmetic or load
    registers; rows past T or V read as zeros). The tile loop and the K loop are one flattened loop, so the next
    tile's loads are in flight during this tile's epilogue."""
    pid = tl.program_id(0)
    num_t = tl.cdiv(T, BLOCK_T)
    num_tiles = num_t * tl.cdiv(V, BLOCK_V)
    for tile in tl.range(pid, num_tiles, NUM_PROGRAMS, flatten=True, warp_specialize=WARP_SPECIALIZE):
        pid_v = tile // num_t
        pid_t = tile % num_t
        acc = tl.zeros([BLOCK_T, BLOCK_V], tl.float32)
        for k0 in range(0, H, BLOCK_K):
            a = h_desc.load([pid_t * BLOCK_T, k0])
            b = w_desc.load([pid_v * BLOCK_V, k0])
            acc = tl.dot(a, b.T, acc)
        offs_t = pid_t.to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
        t_mask = offs_t < T
        rows = tl.minimum(offs_t, T - 1)
        _tile_epilogue(acc, pid_v, pid_t * BLOCK_T, offs_t, t_mask, rows, T, V, tgt_ptr, e_ptr, stride_e, m2_ptr,
                       lse2_ptr, ent_ptr, tz_ptr, inv_temp, WRITE_E, E_TMA, WITH_ENTROPY, SUBTILE, BLOCK_V)


@triton.jit
def _tiles_dz_kernel(
    e_ptr, stride_e, m2_ptr, tgt_ptr, lse2_ptr, a_ptr, b_ptr, c_ptr, scale_ptr, T, V, inv_temp,
    HAS_B: tl.constexpr, TILE_V: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr,
):
    """In place: the tile weights (2^14 e) -> dz = scale * (p (a + b x) + c [v == target]) * inv_temp, with
    p = e * exp2(m2 - lse2) and (only when b is used) x = (m2 + log2 e) ln 2 (m2: the tile's max, log2 units).
    BLOCK_V divides TILE_V, so each program's columns share one tile max per row. Elementwise: each element is
    read and written by one program."""
    pid = tl.program_id(0)
    num_v = tl.cdiv(V, BLOCK_V)
    pid_t = pid // num_v
    pid_v = pid % num_v
    offs_t = pid_t.to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_mask = offs_t < T
    rows = tl.minimum(offs_t, T - 1)
    offs_v = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
    mask = t_mask[:, None] & (offs_v < V)[None, :]
    m2 = tl.load(m2_ptr + ((pid_v * BLOCK_V) // TILE_V).to(tl.int64) * T + rows)
    lse2 = tl.load(lse2_ptr + rows)
    ptrs = e_ptr + offs_t[:, None] * stride_e + offs_v[None, :]
    e = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    p = e * tl.exp2(m2 - lse2 - 14.0)[:, None]  # e is stored times 2^14
    coef = tl.load(a_ptr + rows)[:, None]
    if HAS_B:
        x = tl.where(e > 0, (m2[:, None] + tl.log2(e) - 14.0) * 0.6931471805599453, 0.0)  # e = 0: p x = 0
        coef = coef + tl.load(b_ptr + rows)[:, None] * x
    dz = p * coef
    tgt = tl.load(tgt_ptr + rows)
    dz += tl.where(offs_v[None, :] == tgt[:, None], tl.load(c_ptr + rows)[:, None], 0.0)
    dz = dz * (inv_temp * tl.load(scale_ptr))
    tl.store(ptrs, dz.to(e_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _merge_tiles_kernel(lse2_ptr, ent_ptr, tz_ptr, out_lse2_ptr, out_ent_ptr, out_tz_ptr, T, N,
                        WITH_ENTROPY: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_T: tl.constexpr):
    """Per row, merge the N tiles' (lse2, entropy, target x) ([N, T] arrays, rows contiguous) like vocab splits, in
    one pass: running max m, S = sum 2^(l - m), A = sum 2^(l - m) ent, B = sum 2^(l - m) (l - m); then
    lse2 = m + log2 S and, with q = 2^(l - lse2) a tile's share, entropy = sum q ent - sum q ln q
    = A / S - (B / S - log2 S) ln 2."""
    pid = tl.program_id(0)
    offs_t = pid.to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_mask = offs_t < T
    m = tl.full([BLOCK_T], float("-inf"), tl.float32)
    S = tl.zeros([BLOCK_T], tl.float32)
    A = tl.zeros([BLOCK_T], tl.float32)
    B = tl.zeros([BLOCK_T], tl.float32)
    tz = tl.zeros([BLOCK_T], tl.float32)
    for n0 in range(0, N, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask = (offs_n < N)[:, None] & t_mask[None, :]
        idx = offs_n.to(tl.int64)[:, None] * T + offs_t[None, :]
        l = tl.load(lse2_ptr + idx, mask=mask, other=float("-inf"))
        tz += tl.sum(tl.load(tz_ptr + idx, mask=mask, other=0.0), 0)
        m_new = tl.maximum(m, tl.max(l, 0))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # no tile with mass yet: no -inf - -inf
        alpha = tl.exp2(m - m_ref)  # 0 while m = -inf
        w = tl.exp2(l - m_ref[None, :])  # masked or empty tiles: 0
        if WITH_ENTROPY:
            d = tl.where(w > 0, l - m_ref[None, :], 0.0)
            ent = tl.load(ent_ptr + idx, mask=mask, other=0.0)
            B = alpha * (B + tl.where(S > 0, m - m_ref, 0.0) * S) + tl.sum(w * d, 0)
            A = alpha * A + tl.sum(w * ent, 0)
        S = alpha * S + tl.sum(w, 0)
        m = m_new
    log2_s = tl.log2(S)
    tl.store(out_lse2_ptr + offs_t, m + log2_s, mask=t_mask)
    tl.store(out_tz_ptr + offs_t, tz, mask=t_mask)
    if WITH_ENTROPY:
        tl.store(out_ent_ptr + offs_t, A / S - (B / S - log2_s) * 0.6931471805599453, mask=t_mask)
    else:
        tl.store(out_ent_ptr + offs_t, tl.zeros([BLOCK_T], tl.float32), mask=t_mask)


def merge_tiles(lse2_NT, ent_NT, tz_NT, with_entropy: bool):
    """combine_tiles in one Triton pass: (lse2 [T], entropy [T] or zeros, tz [T])."""
    N, T = lse2_NT.shape
    out = torch.empty((3, T), dtype=torch.float32, device=lse2_NT.device)
    bn, bt, warps = MERGE_TILES[_VENDOR]
    _merge_tiles_kernel[(triton.cdiv(T, bt),)](lse2_NT, ent_NT, tz_NT, out[0], out[1], out[2], T, N,
                                              WITH_ENTROPY=with_entropy, BLOCK_N=bn, BLOCK_T=bt, num_warps=warps)
    return out[0], out[1], out[2]


def _use_tma(hidden_TH, weight_VH, dot_fp32: bool) -> bool:
    """TMA descriptors: NVIDIA Hopper or later, 16-bit operands, rows 16-byte aligned (H a multiple of 8)."""
    return (_VENDOR == "nvidia" and _ARCH >= 9 and not dot_fp32 and hidden_TH.shape[1] % 8 == 0
            and hidden_TH.data_ptr() % 16 == 0 and weight_VH.data_ptr() % 16 == 0)


def logits_tiles(hidden_TH, weight_VH, tgt_T, inv_temp: float, with_entropy: bool, e_TV=None, config=None,
                 tma=None, subtile=None, warp_specialize=False, e_tma=False):
    """One logits GEMM with the statistics in its epilogue. Returns (m2 [num_tiles, T] tile maxima and lse2 [T],
    both in log2 units; ent [T] (zeros unless with_entropy), tz [T], tile width); writes the tile weights into e_TV
    (fp16 or fp32, row stride free) when given. config, tma, subtile, warp_specialize, e_tma (the weights leave
    through TMA stores: an fp16 e_TV with 16-byte aligned rows; not yet timed): overrides for benchmarks."""
    T, H = hidden_TH.shape
    V = weight_VH.shape[0]
    dot_fp32 = _dot_fp32(hidden_TH)
    c = config or logits_tile_config(_VENDOR, 4 if dot_fp32 and _VENDOR != "interpreter" else 2)
    n_tiles = triton.cdiv(V, c.block_v)
    parts = torch.empty((4, n_tiles, T), dtype=torch.float32, device=hidden_TH.device)
    m2_NT, lse2_NT, ent_NT, tz_NT = parts.unbind(0)
    e_arg = e_TV if e_TV is not None else parts
    grid_tiles = triton.cdiv(T, c.block_t) * n_tiles
    meta = dict(WRITE_E=e_TV is not None, WITH_ENTROPY=with_entropy,
                SUBTILE=c.block_v >= 256 if subtile is None else subtile,  # 128-register accumulators: halves
                BLOCK_T=c.block_t, BLOCK_V=c.block_v, BLOCK_K=c.block_k, num_warps=c.num_warps,
                num_stages=c.num_stages)
    outs = (tgt_T, e_arg, m2_NT, lse2_NT, ent_NT, tz_NT)
    if _use_tma(hidden_TH, weight_VH, dot_fp32) if tma is None else tma:
        from triton.tools.tensor_descriptor import TensorDescriptor

        h_desc = TensorDescriptor.from_tensor(hidden_TH, [c.block_t, c.block_k])
        w_desc = TensorDescriptor.from_tensor(weight_VH, [c.block_v, c.block_k])
        progs = min(grid_tiles, _num_sms(hidden_TH.device))
        e_tma = e_tma and e_TV is not None and e_TV.dtype == torch.float16 and (e_TV.stride(0) * 2) % 16 == 0
        if e_tma:
            e_desc = TensorDescriptor.from_tensor(e_TV, [c.block_t, c.block_v // 2 if meta["SUBTILE"] else c.block_v])
            outs = (tgt_T, e_desc) + outs[2:]
        logits_tiles.last_kernel = _logits_tiles_tma_kernel[(progs,)](
            h_desc, w_desc, *outs, T, V, H, e_arg.stride(0), inv_temp, progs,
            E_TMA=e_tma, WARP_SPECIALIZE=warp_specialize, **meta)
    else:
        logits_tiles.last_kernel = _logits_tiles_kernel[(grid_tiles,)](
            hidden_TH, weight_VH, *outs, T, V, H, hidden_TH.stride(0), weight_VH.stride(0), e_arg.stride(0),
            inv_temp, DOT_FP32=dot_fp32, **meta)
    lse2_T, ent_T, tz_T = merge_tiles(lse2_NT, ent_NT, tz_NT, with_entropy)
    return m2_NT, lse2_T, ent_T, tz_T, c.block_v


logits_tiles.last_kernel = None  # the compiled kernel of the latest call (registers and spills, for benchmarks)


def dlogits_from_tiles(e_TV, m2_NT, tile_v: int, tgt_T, lse2_T, a_T, b_T, c_T, inv_temp: float, scale,
                       has_b: bool = True) -> None:
    """In place over e_TV (logits_tiles' weights): scale * dloss/dlogit."""
    T, V = e_TV.shape
    bt, bv, warps = DZ_TILES[_VENDOR]
    bv = min(bv, tile_v)
    _tiles_dz_kernel[(triton.cdiv(T, bt) * triton.cdiv(V, bv),)](
        e_TV, e_TV.stride(0), m2_NT, tgt_T, lse2_T, a_T, b_T, c_T, scale, T, V, inv_temp,
        HAS_B=has_b, TILE_V=tile_v, BLOCK_T=bt, BLOCK_V=bv, num_warps=warps,
    )
