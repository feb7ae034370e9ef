"""Tile configurations of the LM head's Triton kernels (kernels/lm_head/triton_backend.py), one table per kernel
and vendor, each value derived in a comment.

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


# dlogits from an fp32 logits chunk already in memory (from a cuBLAS GEMM: the backward of token_stats.py), pure
# bandwidth; rows swept left to right by one program (fixed, not autotuned): 4 rows x 1024 columns over 8 warps = 16
# values a thread (4 x 16-byte loads); 4096 rows give 1024 programs, ~8 per SM on a 132-SM H100/H200; AMD: 8
# wavefronts x 64 lanes, 8 values a lane.
DZ_ROWS_TILE = {"nvidia": (4, 1024, 8), "amd": (4, 1024, 8), "interpreter": (4, 64, 1)}


# Logits GEMM with the statistics in its epilogue (triton_backend.py: _logits_tiles_kernel and, on Hopper
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
#   NVIDIA, fp32 operands (exact ieee dot on the FMA units, no tensor cores): 4-byte operands double the SMEM per
#     stage, so 128 x 128 with block_k = 32 and 2 stages = (128 + 128) * 32 * 4 * 2 = 64 KiB.
#   AMD CDNA3 (MI300X/MI325X): wavefronts are 64 lanes, a workgroup at most 16 of them, 64 KiB of LDS per CU.
#     128 x 128 x 32 over 8 wavefronts: the fp32 accumulator is 16,384 / 512 lanes = 32 VGPRs a lane (two
#     workgroups per CU); (128 + 128) * 32 * 2 B = 16 KiB a stage, 2 stages (the AMD pipeliner's double buffer) =
#     32 KiB, half the LDS. fp32 operands: 64 x 64 over 4 wavefronts (16 accumulator VGPRs a lane), block_k = 32,
#     2 stages = (64 + 64) * 32 * 4 * 2 = 32 KiB of LDS.
#   Interpreter: the test shapes span several vocab tiles, so the tile merge is exercised.
LOGITS_TILES = {
    ("nvidia", 2): TileConfig(128, 256, 64, 8, 3),
    ("nvidia", 4): TileConfig(128, 128, 32, 8, 2, elem_bytes=4),
    ("amd", 2): TileConfig(128, 128, 32, 8, 2),
    ("amd", 4): TileConfig(64, 64, 32, 4, 2, elem_bytes=4),
    ("interpreter", 2): TileConfig(16, 64, 32, 1, 1),
}
# In-place dz pass over the tile weights (elementwise; columns of one program inside one logits tile): 16 rows x
# 256 columns over 4 warps = 32 values a thread, 4 x 16-byte loads of fp16; AMD: 4 wavefronts x 64 lanes, 16 values
# a lane. The column width is capped at the logits tile's (both powers of two, so it divides it).
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


# dW accumulation of the lean backward's small chunks (triton_backend.py, _dw_acc_kernel): acc[Vc, H] +=
# dZ[Tc, Vc]^T (h[Tc, H] x s), h converted to fp16 in registers. A plain GEMM tile over (vocab, hidden) with K = tokens:
#   NVIDIA: 128 x 128 x 64 over 8 warps (two 64-row wgmma slices), 3 stages = (128 + 128) x 64 x 2 B x 3 = 96 KiB of
#     SMEM; at Vc = 1024, H = 2048 that is 8 x 16 = 128 programs, one wave on a 132-SM H100/H200.
#   AMD CDNA3: 128 x 128 x 32 over 8 wavefronts, 2 stages = 32 KiB of the 64 KiB LDS (the logits tile's shape).
#   Interpreter: small, so the test shapes cross several K steps and masked edges.
DW_ACC_TILES = {"nvidia": TileConfig(128, 128, 64, 8, 3), "amd": TileConfig(128, 128, 32, 8, 2),
                "interpreter": TileConfig(16, 16, 16, 1, 1)}  # (block_v, block_h, block_k = tokens, ...)


def logits_tile_config(vendor: str, elem_bytes: int) -> TileConfig:
    """The epilogue-statistics GEMM's tile for a vendor ("nvidia", "amd", "interpreter") and operand width."""
    if vendor == "interpreter":
        return LOGITS_TILES[("interpreter", 2)]
    return LOGITS_TILES[(vendor, 4 if elem_bytes == 4 else 2)]

