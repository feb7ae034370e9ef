"""Tile configurations for the LM-head kernels, one table per vendor, each value derived in a comment.

Two kernels (kernels/lm_head_triton.py):
  stats   -- per token block, loop over vocab tiles: logits tile = h[BT, H] @ w[BV, H]^T in fp32 registers,
             then online log-sum-exp. Its K loop runs over the whole hidden size H.
  dlogits -- one [BT, BV] logits tile per program, recomputed, turned into dlogits and stored (bf16 for bf16
             inputs). A plain GEMM with an elementwise epilogue.

Pure Python: no torch or triton import, so the tables can be read (and tested) anywhere.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TileConfig:
    block_t: int  # tokens per tile (rows of the logits tile)
    block_v: int  # vocab entries per tile (columns)
    block_k: int  # hidden-size slice per MMA step
    num_warps: int
    num_stages: int
    elem_bytes: int = 2  # operand width the tile is sized for: 2 (bf16/fp16) or 4 (fp32, exact ieee dot)

    def smem_bytes(self, elem_bytes: int = 2) -> int:
        """Shared memory the software pipeline holds: one A and one B slice per stage."""
        return (self.block_t + self.block_v) * self.block_k * elem_bytes * self.num_stages


# ---------------------------------------------------------------------------------------------------------------
# NVIDIA Hopper (sm_90: H100/H200). Warps are 32 threads; a warpgroup (4 warps, 128 threads) issues one wgmma.
#   block_t = 128: two warpgroups (num_warps=8) each own a 64-row wgmma slice (wgmma M is fixed at 64 per group).
#   block_v = 128 (stats): the fp32 accumulator is 128x128 = 16,384 values / 256 threads = 64 registers a thread,
#     leaving room for the online-softmax epilogue (exp tile, row max, row sums) without spilling under the
#     255-register cap. block_v = 256 doubles that to 128 registers: kept as the second candidate, timed at first use.
#   block_v = 256 (dlogits): a pure GEMM tile; 128x256 halves the L2->SMEM traffic per FLOP against 128x128
#     (arithmetic intensity 2*128*256/((128+256)*2) = 85 FLOP/B vs 64), the usual best Hopper GEMM tile.
#   block_k = 64: 64 bf16 = 128 bytes, one full 128-byte swizzle row for the TMA/ldmatrix path.
#   num_stages: SMEM per stage = (BT+BV)*BK*2 B: 128x128 -> 32 KiB, 4 stages = 128 KiB; 128x256 -> 48 KiB,
#     3 stages = 144 KiB; both under the 227 KiB a Hopper CTA may use, one CTA per SM.
#   fp32 operands (exact ieee dot on the FMA units, no tensor cores): 4-byte operands double the SMEM per stage,
#     so 128x128 with block_k = 32 and 2 stages = (128+128)*32*4*2 = 64 KiB.
HOPPER_FP32 = TileConfig(128, 128, 32, 8, 2, elem_bytes=4)
HOPPER_STATS = (TileConfig(128, 128, 64, 8, 4), TileConfig(128, 256, 64, 8, 3), HOPPER_FP32)
HOPPER_DLOGITS = (TileConfig(128, 256, 64, 8, 3), TileConfig(128, 128, 64, 8, 4), HOPPER_FP32)

# NVIDIA Ampere/Ada (sm_80/89): mma.sync, 32-thread warps, up to 164 KiB (A100) / 99 KiB (Ada) SMEM per CTA.
#   128x128 tile over 4 warps = 2x2 warps of 64x64 each; accumulator 16,384 / 128 threads = 128 registers.
#   block_k = 32, 3 stages: (128+128)*32*2*3 = 48 KiB, fits Ada's 99 KiB with two CTAs per SM.
#   fp32 operands: 64x64, block_k = 32, 2 stages = (64+64)*32*4*2 = 32 KiB.
AMPERE_FP32 = TileConfig(64, 64, 32, 4, 2, elem_bytes=4)
AMPERE_STATS = (TileConfig(128, 128, 32, 4, 3), AMPERE_FP32)
AMPERE_DLOGITS = (TileConfig(128, 128, 32, 4, 3), AMPERE_FP32)

# AMD CDNA3 (MI300X/MI325X): wavefronts are 64 lanes; a workgroup holds at most 1024 threads = 16 wavefronts,
# so num_warps (= wavefronts here) <= 16. LDS is 64 KiB per CU.
#   num_warps = 8: 512 lanes; the 128x128 fp32 accumulator is 16,384 / 512 = 32 VGPRs a lane, which keeps
#     occupancy at 2 workgroups per CU (512 VGPRs per SIMD lane budget / ~128 used).
#   block_k = 32: (128+128)*32*2 B = 16 KiB per stage; num_stages = 2 (the AMD pipeliner's double buffer)
#     = 32 KiB, half the LDS, so two workgroups fit per CU.
#   fp32 operands: 64x64 over 4 wavefronts (256 lanes, 16 accumulator VGPRs a lane), block_k = 32, 2 stages =
#     (64+64)*32*4*2 = 32 KiB of LDS.
CDNA_FP32 = TileConfig(64, 64, 32, 4, 2, elem_bytes=4)
CDNA_STATS = (TileConfig(128, 128, 32, 8, 2), CDNA_FP32)
CDNA_DLOGITS = (TileConfig(128, 128, 32, 8, 2), CDNA_FP32)

# Triton's CPU interpreter (TRITON_INTERPRET=1): numpy executes whole tiles, so bigger tiles run faster; these
# stay small enough that the test shapes (V of a few hundred, H of ~50) still span several vocab and K tiles,
# which exercises the running max across tiles and the masked tails.
INTERPRETER_STATS = (TileConfig(16, 64, 32, 1, 1),)
INTERPRETER_DLOGITS = (TileConfig(16, 64, 32, 1, 1),)


# dlogits from an fp32 logits chunk already in memory (from a cuBLAS GEMM; the split backward), pure bandwidth; rows
# swept left to right by one program (fixed, not autotuned): 4 rows x 1024 columns over 8 warps = 16 values a thread
# (4 x 16-byte loads); 4096 rows give 1024 programs, ~8 per SM on a 132-SM H100/H200; AMD: 8 wavefronts x 64
# lanes, 8 values a lane.
DZ_ROWS_TILE = {"nvidia": (4, 1024, 8), "amd": (4, 1024, 8), "interpreter": (4, 64, 1)}


# Logits GEMM with the statistics in its epilogue (kernels/lm_head_tiles_triton.py, _logits_tiles_kernel and, on Hopper
# with 16-bit operands, the persistent TMA variant _logits_tiles_tma_kernel): a GEMM tile whose epilogue reduces
# each row of the tile (max, sum of exp, entropy sum) and stores the fp16 weights.
#   NVIDIA Hopper, 16-bit operands: 128 x 256 x 64 over 8 warps (two warpgroups of 64 rows), 3 stages:
#     (128 + 256) * 64 * 2 B * 3 = 144 KiB of SMEM. 128 x 256 reads 2*128*256 / ((128 + 256) * 2) = 85 FLOP per
#     operand byte against 64 for 128 x 128. Its accumulator is 128 registers a thread, so the epilogue takes the
#     tile in two 128-column halves (SUBTILE) to keep the exp tile beside it under the 255 cap: 0 spills where the
#     whole-tile epilogue spilled 64 registers. Measured (bench/sweep_logits_tiles.py, H200, Tg x V x 2048):
#     6.41 ms at 4096 x 248,320 (649 TF/s; cuBLAS bf16-output GEMM alone 6.13 ms; the first epilogue, ~25
#     instructions a logit against ~9 now, 6.84 ms) against 8.54 ms for 128 x 128 pointer loads and 7.77 ms for
#     cuBLAS fp32 output + a streaming statistics pass.
#   fp32 operands (exact ieee dot, FMA units): the stats kernel's fp32 tile.
#   AMD CDNA3: the stats kernel's tile (8 wavefronts, 32 accumulator VGPRs a lane, 32 KiB of the 64 KiB LDS).
#   Interpreter: the test shapes span several vocab tiles, so the tile merge is exercised.
LOGITS_TILES = {
    ("nvidia", 2): TileConfig(128, 256, 64, 8, 3),
    ("nvidia", 4): HOPPER_FP32,
    ("amd", 2): TileConfig(128, 128, 32, 8, 2),
    ("amd", 4): CDNA_FP32,
    ("interpreter", 2): TileConfig(16, 64, 32, 1, 1),
}
# In-place dz pass over the tile weights (elementwise; columns of one program inside one stats tile): 16 rows x
# 256 columns over 4 warps = 32 values a thread, 4 x 16-byte loads of fp16; AMD: 4 wavefronts x 64 lanes, 16 values
# a lane. The column width is capped at the stats tile's (both powers of two, so it divides it).
DZ_TILES = {"nvidia": (16, 256, 4), "amd": (16, 256, 4), "interpreter": (4, 32, 1)}  # (rows, cols, warps)
# Merge of the per-tile statistics ([num_tiles, T] arrays, rows contiguous): one program per 64 rows walks the tiles
# 32 at a time, a [32, 64] block = 2048 values over 4 warps, 16 a thread (4 x 16-byte loads of each array); 4096
# rows are 64 programs, each reading 3 x 970 x 64 x 4 B = 745 KB at V = 248,320. Interpreter: small, so the loop
# crosses several blocks and a masked tail.
MERGE_TILES = {"nvidia": (32, 64, 4), "amd": (32, 64, 4), "interpreter": (4, 8, 1)}  # (tiles, rows, warps)
# Target logits (one gathered dot a token, h . w[target]): 16 rows x 256 columns over 4 warps = 32 bf16 values a
# thread of each operand (4 x 16-byte loads); 4096 rows are 256 programs, two per SM; each row of w is one 4 KiB read
# at H = 2048. AMD: 4 wavefronts x 64 lanes, 16 values a lane. Interpreter: H of ~50 crosses two K blocks.
TARGET_TILES = {"nvidia": (16, 256, 4), "amd": (16, 256, 4), "interpreter": (4, 32, 1)}  # (rows, cols, warps)


# dW accumulation of the lean backward's small chunks (kernels/lm_head_triton.py, _dw_acc_kernel): acc[Vc, H] +=
# dZ[Tc, Vc]^T (h[Tc, H] x s), h converted to fp16 in registers. A plain GEMM tile over (vocab, hidden) with K = tokens:
#   NVIDIA: 128 x 128 x 64 over 8 warps (two 64-row wgmma slices), 3 stages = (128 + 128) x 64 x 2 B x 3 = 96 KiB of
#     SMEM; at Vc = 1024, H = 2048 that is 8 x 16 = 128 programs, one wave on a 132-SM H100/H200.
#   AMD CDNA3: 128 x 128 x 32 over 8 wavefronts, 2 stages = 32 KiB of the 64 KiB LDS (the stats tile's shape).
#   Interpreter: small, so the test shapes cross several K steps and masked edges.
DW_ACC_TILES = {"nvidia": TileConfig(128, 128, 64, 8, 3), "amd": TileConfig(128, 128, 32, 8, 2),
                "interpreter": TileConfig(16, 16, 16, 1, 1)}  # (block_v, block_h, block_k = tokens, ...)


def logits_tile_config(vendor: str, elem_bytes: int) -> TileConfig:
    """The epilogue-statistics GEMM's tile for a vendor ("nvidia", "amd", "interpreter") and operand width."""
    if vendor == "interpreter":
        return LOGITS_TILES[("interpreter", 2)]
    return LOGITS_TILES[(vendor, 4 if elem_bytes == 4 else 2)]


def tile_configs(vendor: str, arch_major: int, kernel: str) -> tuple[TileConfig, ...]:
    """Candidate tiles for `kernel` ("stats" | "dlogits"), both operand widths (filter on elem_bytes); vendor is
    "nvidia", "amd" or "interpreter" (whose one tile serves both widths)."""
    if kernel not in ("stats", "dlogits"):
        raise ValueError(f"kernel must be 'stats' or 'dlogits', got {kernel!r}")
    stats = kernel == "stats"
    if vendor == "interpreter":
        return INTERPRETER_STATS if stats else INTERPRETER_DLOGITS
    if vendor == "amd":
        return CDNA_STATS if stats else CDNA_DLOGITS
    if vendor == "nvidia":
        if arch_major >= 9:
            return HOPPER_STATS if stats else HOPPER_DLOGITS
        return AMPERE_STATS if stats else AMPERE_DLOGITS
    raise ValueError(f"vendor must be 'nvidia', 'amd' or 'interpreter', got {vendor!r}")
