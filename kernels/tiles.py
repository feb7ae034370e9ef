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


# Streaming kernels over an fp32 logits chunk already in memory (from a cuBLAS GEMM): pure bandwidth.
# Stats kernel: candidates (rows, cols, warps) timed once per vocab size by triton.autotune. Each lane keeps four
# running accumulators (max, sum, entropy sum, target), so the tiles hold 32 values per thread (4 x 32 = 128
# accumulator registers, under the 255 cap with the loaded tile beside them):
#   NVIDIA: 8 x 1024 over 8 warps (256 threads), 4 x 1024 over 4 warps, 16 x 512 over 8 warps; each thread's 32
#     fp32 values are 8 x 16-byte loads. With 2+ programs resident an SM has >= 32 KiB of loads in flight, what
#     HBM3e's bandwidth x latency per SM asks for (~4.8 TB/s / 132 SMs x ~1 us = 36 KiB).
#   AMD: the same tiles; 8 wavefronts are 512 lanes, 16 values a lane (4 x 16-byte loads), within the
#     1024-lane workgroup limit.
#   Interpreter: small, so the tests cross row and column tile edges.
STREAM_TILES = {
    "nvidia": ((8, 1024, 8), (4, 1024, 4), (16, 512, 8)),
    "amd": ((8, 1024, 8), (4, 1024, 4), (16, 512, 8)),
    "interpreter": ((8, 64, 1),),
}  # (rows, cols, warps)
# dlogits kernel (rows swept left to right by one program, in place; fixed, not autotuned): 4 rows x 1024 columns
# over 8 warps = 16 values a thread (4 x 16-byte loads); T = 2048 rows give 512 programs, ~4 per SM on a 132-SM
# H100/H200 (64 KiB in flight per SM); AMD: 8 wavefronts x 64 lanes, 8 values a lane.
DZ_ROWS_TILE = {"nvidia": (4, 1024, 8), "amd": (4, 1024, 8), "interpreter": (4, 64, 1)}


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
