"""Bench: the expert-parallel backward's fused elementwise steps (kernels/expert_grads.py) against the torch code
they replace, at the rows one layer's backward sees: M = tokens × top-k routed rows (262,144 at 32K tokens and
top-8), D = 2048, I = 512, bf16. Prints each op's time (median of CUDA-event-timed runs), the bytes its kernel must
move at least and the bandwidth that gives, and the largest difference from the torch path in bf16 ulps.

Usage: python bench/bench_expert_grads.py [--rows 262144] [--dim 2048] [--ffn 512] [--reps 20]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_gdn_fused import _time  # noqa: E402
from kernels.expert_grads import slot_grads, swiglu_backward  # noqa: E402


def _rel(x, ref) -> float:
    x, ref = x.double(), ref.double()
    return ((x - ref).norm() / ref.norm()).item()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=262144)
    ap.add_argument("--dim", type=int, default=2048)
    ap.add_argument("--ffn", type=int, default=512)
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args(argv)
    M, D, I = args.rows, args.dim, args.ffn
    dev, bf = "cuda", torch.bfloat16
    buf = torch.randn(M, D + 8, device=dev).to(bf)
    buf[:, D] = torch.rand(M, device=dev).to(bf)
    dout, w = buf[:, :D], buf[:, D:D + 1]
    y = torch.randn(M, D, device=dev).to(bf)
    h = (torch.randn(M, 2 * I, device=dev) * 3).to(bf)
    da = torch.randn(M, I, device=dev).to(bf)
    rows = []
    for name, fn, min_bytes in [
        ("slot_grads (g = dout·w, dw = dout·y)", lambda b: slot_grads(dout, w, y, backend=b), M * D * 2 * 3 + M * 6),
        ("swiglu_backward (dh, a)", lambda b: swiglu_backward(h, da, backend=b), M * I * 2 * 6),
    ]:
        outs = {b: fn(b) for b in ("torch", "triton")}
        errs = [_rel(o, r) for o, r in zip(outs["triton"], outs["torch"])]
        del outs
        t_torch, t_triton = (_time(lambda b=b: fn(b), args.reps, warmup=1) for b in ("torch", "triton"))
        rows.append((name, t_torch, t_triton, min_bytes / t_triton / 1e9, errs))  # bytes / ms / 1e9 = TB/s
    print(f"# {torch.cuda.get_device_name()} | M={M} D={D} I={I} bf16 | median of {args.reps}")
    print("| op | torch ms | fused ms | torch / fused | fused TB/s (min bytes) | rel. diff of each output |")
    print("|---|---|---|---|---|---|")
    for name, a, b, bw, errs in rows:
        print(f"| {name} | {a:.3f} | {b:.3f} | {a / b:.1f} | {bw:.2f} | {' / '.join(f'{e:.1e}' for e in errs)} |")


if __name__ == "__main__":
    main()
