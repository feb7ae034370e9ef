"""Bench: the fused head's dW GEMM, acc[V, H] (fp32) += alpha · dZ[Tg, V]^T @ h[Tg, H] (fp16 operands), once per token
group: cuBLAS against a persistent Triton kernel (kernels/lm_head/triton_backend.py, dw_gemm) whose fp32 C is
updated by a TMA reduce (the add happens in L2 while the program moves on to its next tile) or by a load, add and
store in the epilogue.

Usage: python bench/bench_dw_gemm.py [--vocab 248320 151936] [--hidden 2048] [--group 4096] [--groups 16]
       [--tiles BV,BH,BK,WARPS,STAGES ...]
CPU check of the script: TRITON_INTERPRET=1 python bench/bench_dw_gemm.py --device cpu --vocab 304 --hidden 64
--group 32 --groups 2 --reps 1
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kernels.lm_head import triton_backend as tb  # noqa: E402
from kernels.lm_head.numerics import gemm_acc  # noqa: E402
from kernels.lm_head.tiles import TileConfig  # noqa: E402

DEFAULT_TILE = tb.DW_GEMM_TILES[tb._VENDOR]


def run_groups(method, acc, dz, h, alphas):
    """One step's dW: len(alphas) groups, the first writing acc (beta = 0)."""
    for g, alpha in enumerate(alphas):
        if method == "cublas":
            gemm_acc(acc, dz[g].T, h[g], first=g == 0, alpha=float(alpha))
        else:
            tb.dw_gemm(acc, dz[g], h[g], alpha, first=g == 0, reduce=method == "triton, TMA reduce")


def timed(fn, device, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            fn()
            e.record()
            torch.cuda.synchronize()
            times.append(s.elapsed_time(e))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vocab", type=int, nargs="+", default=[248320, 151936])
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--group", type=int, default=4096, help="tokens per group (K)")
    ap.add_argument("--groups", type=int, default=16, help="groups per step (T = group x groups)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--methods", nargs="+", default=["cublas", "triton, TMA reduce", "triton, load-add-store"])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiles", nargs="+", default=[], metavar="BV,BH,BK,WARPS,STAGES",
                    help="also time the Triton kernel with these tiles (rows 'triton, TMA reduce, <tile>')")
    args = ap.parse_args(argv)
    dev = torch.device(args.device)
    G, Tg, H = args.groups, args.group, args.hidden
    if dev.type == "cuda":
        print(f"# {torch.cuda.get_device_name()} | torch {torch.__version__} | triton {tb.triton.__version__}")
    print("| V | method | ms a step | ms a group | TF/s | rel err vs cuBLAS | ours / cuBLAS |\n|---|---|---|---|---|---|---|")
    for V in args.vocab:
        gen = torch.Generator(device=dev).manual_seed(0)
        dz = (torch.rand(G, Tg, V, device=dev, generator=gen) * 2 - 1).half()
        h = torch.randn(G, Tg, H, device=dev, generator=gen).half()
        alphas = [2.0 ** -(g % 3) for g in range(G)]
        ref = None
        base = None
        methods = [(m, None) for m in args.methods] + [
            ("triton, TMA reduce", tuple(int(x) for x in t.split(","))) for t in args.tiles]
        for m, tile in methods:
            tb.DW_GEMM_TILES[tb._VENDOR] = TileConfig(*tile) if tile else DEFAULT_TILE
            name = m if tile is None else f"{m}, {'x'.join(map(str, tile))}"
            acc = torch.empty(V, H, dtype=torch.float32, device=dev)
            try:
                ms = timed(lambda: run_groups(m, acc, dz, h, alphas), dev, args.reps)
            except Exception as e:  # a variant this Triton cannot build: say so, go on
                print(f"| {V} | {name} | failed: {type(e).__name__}: {str(e).splitlines()[0][:120]} | | | | |")
                continue
            if ref is None:
                ref, base = acc.clone(), ms
            err = float((acc - ref).norm() / ref.norm())
            tf = 2 * G * Tg * V * H / (ms * 1e-3) / 1e12
            print(f"| {V} | {name} | {ms:.2f} | {ms / G:.3f} | {tf:.0f} | {err:.1e} | {ms / base:.3f} |", flush=True)
        del dz, h, ref
    return 0


if __name__ == "__main__":
    sys.exit(main())
