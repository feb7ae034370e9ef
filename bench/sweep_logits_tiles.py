"""Sweep: the fused path's logits GEMM with the statistics in its epilogue, tile configurations and kernel variants
against cuBLAS, one group of Tg tokens, one GPU. The variants (pointer loads or the persistent TMA kernel, whole-tile
or two-half epilogue, warp specialization, weights through TMA stores) live in bench/_logits_tiles_variants.py, a
copy of the kernel module with those switches; the library keeps the one the table below picked
(kernels/lm_head/tiles.py).

Rows: cuBLAS bf16-output GEMM (the floor a fused epilogue would like to reach), cuBLAS fp32-output GEMM (the
alternative first step, before a streaming statistics pass of ~1.2 ms), and logits_tiles for each
candidate (fp16 tile weights written, statistics in the epilogue), with registers and spills from the compiled
kernel; then the in-place dz pass over the tile weights. Each candidate's lse and target logit are checked against
the fp32 cuBLAS logits, and its weights for NaN (the buffer is NaN-poisoned first), before it is timed.

--baseline FILE adds rows for an earlier copy of kernels/lm_head/triton_backend.py (its default tile, with and
without the entropy), timed in the same process: an A/B of an epilogue change.

Usage: python bench/sweep_logits_tiles.py [--vocab 248320 151936] [--hidden 2048] [--tokens 4096] [--baseline FILE]
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench import _logits_tiles_variants as kt  # noqa: E402
from bench._lm_head_common import load_module  # noqa: E402
from kernels.lm_head.numerics import logits_fp32  # noqa: E402
from kernels.lm_head.tiles import TileConfig  # noqa: E402

# (tile, TMA persistent kernel, epilogue in two column halves, warp specialization, weights through TMA stores)
CANDIDATES = [
    (TileConfig(128, 128, 64, 8, 4), False, False, False, False),
    (TileConfig(128, 256, 64, 8, 3), False, True, False, False),
    (TileConfig(128, 128, 64, 8, 4), True, False, False, False),
    (TileConfig(128, 256, 64, 8, 3), True, True, False, False),
    (TileConfig(128, 256, 64, 8, 3), True, True, False, True),
    (TileConfig(128, 256, 64, 8, 3), True, True, True, True),
    (TileConfig(128, 256, 64, 8, 4), True, True, False, False),
    (TileConfig(128, 256, 64, 8, 3), True, False, False, False),
    (TileConfig(128, 128, 64, 8, 4), True, False, True, False),
    (TileConfig(128, 256, 64, 8, 3), True, True, True, False),
]


def bench(fn, reps=20):
    return triton.testing.do_bench(fn, warmup=25, rep=reps * 10, return_mode="median")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--vocab", type=int, nargs="+", default=[248320, 151936])
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--tokens", type=int, default=None, help="Tg (default: the fused path's group size)")
    ap.add_argument("--baseline", default=None, help="an earlier kernels/lm_head/triton_backend.py to time beside")
    args = ap.parse_args()
    base = None
    if args.baseline:
        base = load_module(args.baseline)
    from kernels.lm_head.fused import group_size

    dev = torch.device("cuda")
    H = args.hidden
    print(f"# {torch.cuda.get_device_name()} | torch {torch.__version__} | triton {triton.__version__}")
    rows = []
    for V in args.vocab:
        T = args.tokens or group_size(1 << 30, V, None, 2)
        g = torch.Generator(device=dev).manual_seed(V)
        h = torch.randn(T, H, device=dev, generator=g).bfloat16()
        w = (torch.randn(V, H, device=dev, generator=g) * (2.0 / math.sqrt(H))).bfloat16()
        tgt = torch.randint(0, V, (T,), device=dev, generator=g)
        tf = 2 * T * V * H / 1e9
        z = torch.empty(T, V, device=dev)
        logits_fp32(h, w, z)
        ref_lse = torch.logsumexp(z, 1)
        ref_tz = z.gather(1, tgt[:, None])[:, 0]
        ms = bench(lambda: h @ w.T)
        rows.append((V, T, "cuBLAS bf16 out", ms, tf / ms, "", ""))
        ms_z = bench(lambda: logits_fp32(h, w, z))
        f32 = dict(device=dev, dtype=torch.float32)
        rows.append((V, T, "cuBLAS fp32 out", ms_z, tf / ms_z, "", ""))
        del z
        e = torch.empty(T, V, device=dev, dtype=torch.float16)
        for ent_on in (False, True) if base is not None else ():
            e.fill_(float("nan"))
            st = base.logits_tiles(h, w, tgt, 1.0, ent_on, e)
            err = ((st.lse2 * math.log(2) - ref_lse).abs().max().item(), (st.tz - ref_tz).abs().max().item())
            ms = bench(lambda: base.logits_tiles(h, w, tgt, 1.0, ent_on, e))  # noqa: B023
            ck = None
            rows.append((V, T, f"baseline {args.baseline}" + (" +ent" if ent_on else ""), ms, tf / ms,
                         f"err lse {err[0]:.1e} tz {err[1]:.1e}",
                         f"{getattr(ck, 'n_regs', '?')} regs, {getattr(ck, 'n_spills', '?')} spills"))
            print(rows[-1], flush=True)
        for c, tma, sub, ws, e_tma in CANDIDATES:
            for ent_on in (False, True):
                name = (f"{'TMA persistent' if tma else 'pointers'} {c.block_t}x{c.block_v}x{c.block_k} "
                        f"w{c.num_warps} s{c.num_stages}" + (" subtile" if sub else "") + (" ws" if ws else "")
                        + (" e-TMA" if e_tma else "")
                        + (" +ent" if ent_on else ""))
                kw = dict(config=c, tma=tma, subtile=sub, warp_specialize=ws, e_tma=e_tma)
                try:
                    e.fill_(float("nan"))
                    m2, lse2, en, tz2, tile = kt.logits_tiles(h, w, tgt, 1.0, ent_on, e, **kw)
                    err = ((lse2 * math.log(2) - ref_lse).abs().max().item(), (tz2 - ref_tz).abs().max().item())
                    bad = (not torch.isfinite(e).all().item()) or max(err) > 1e-3
                    fn = lambda: kt.logits_tiles(h, w, tgt, 1.0, ent_on, e, **kw)  # noqa: E731
                    ms = bench(fn)
                    ck = kt.logits_tiles.last_kernel
                    regs = f"{getattr(ck, 'n_regs', '?')} regs, {getattr(ck, 'n_spills', '?')} spills"
                    rows.append((V, T, name, ms, tf / ms, f"err lse {err[0]:.1e} tz {err[1]:.1e}" + (
                        " BAD" if bad else ""), regs))
                except Exception as ex:  # a config that does not compile (shared memory) is skipped
                    rows.append((V, T, name, float("nan"), float("nan"), f"{type(ex).__name__}: {str(ex)[:80]}", ""))
                print(rows[-1], flush=True)
        # the dz pass, in place over the weights (the library's)
        from kernels.lm_head import triton_backend
        from kernels.lm_head.numerics import Coefficients

        st = triton_backend.logits_tiles(h, w, tgt, 1.0, False, e)
        tile = st.tile_v
        a = torch.full((T,), 1.0 / T, **f32)
        one = torch.ones((), **f32)
        ms = bench(lambda: triton_backend.dlogits_from_tiles(e, st, tgt, st.lse2, Coefficients(st.lse2, a, None, -a),
                                                             1.0, one))
        rows.append((V, T, f"dz in place (fp16, tile {tile})", ms, float("nan"),
                     f"{T * V * 4 / ms / 1e9:.2f} TB/s", ""))
        print(rows[-1], flush=True)
        del e, h, w
        torch.cuda.empty_cache()
    print("| V | Tg | step | ms | TF/s | note | registers |\n|---|---|---|---|---|---|---|")
    for V, T, name, ms, tfs, note, regs in rows:
        print(f"| {V} | {T} | {name} | {ms:.3f} | {tfs:.0f} | {note} | {regs} |")


if __name__ == "__main__":
    main()
