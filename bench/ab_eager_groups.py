"""A/B in one process: the eager path's group buffers (kernels.lm_head_eager: EAGER_SCRATCH_BYTES, PIPELINE) for
mean CE forward + backward, the variants interleaved round by round so that clock drift hits them alike.

Usage: python bench/ab_eager_groups.py [--tokens 65536] [--vocab 248320 151936] [--rounds 4] [--reps 3]
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import kernels  # noqa: E402
from kernels import lm_head_eager  # noqa: E402

VARIANTS = [("2 GiB, pipelined", 2, True), ("2 GiB, one buffer", 2, False), ("4 GiB, pipelined", 4, True),
            ("4 GiB, one buffer", 4, False)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=65536)
    ap.add_argument("--vocab", type=int, nargs="+", default=[248320, 151936])
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    dev = torch.device("cuda")
    T, H = args.tokens, args.hidden
    print(f"# {torch.cuda.get_device_name()} | torch {torch.__version__}", flush=True)
    print("| V | variant | median ms | min ms | peak GiB above inputs |\n|---|---|---|---|---|")
    for V in args.vocab:
        g = torch.Generator(device=dev).manual_seed(V)
        h = torch.randn(T, H, device=dev, generator=g).bfloat16().requires_grad_()
        w = (torch.randn(V, H, device=dev, generator=g) * (2.0 / math.sqrt(H))).bfloat16().requires_grad_()
        t = torch.randint(0, V, (T,), device=dev, generator=g)
        times = {name: [] for name, _, _ in VARIANTS}
        peaks = {}

        def once():
            h.grad = w.grad = None
            kernels.linear_cross_entropy(h, w, t).backward()

        for r in range(args.rounds):
            for name, gib, pipe in VARIANTS:
                lm_head_eager.EAGER_SCRATCH_BYTES, lm_head_eager.PIPELINE = int(gib * 2**30), pipe
                once()
                torch.cuda.synchronize()
                if r == 0:
                    h.grad = w.grad = None
                    base = torch.cuda.memory_allocated()
                    torch.cuda.reset_peak_memory_stats()
                    once()
                    torch.cuda.synchronize()
                    peaks[name] = (torch.cuda.max_memory_allocated() - base) / 2**30
                for _ in range(args.reps):
                    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    a.record()
                    once()
                    b.record()
                    torch.cuda.synchronize()
                    times[name].append(a.elapsed_time(b))
        for name, _, _ in VARIANTS:
            print(f"| {V} | {name} | {statistics.median(times[name]):.1f} | {min(times[name]):.1f} | "
                  f"{peaks[name]:.2f} |", flush=True)
        del h, w, t
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
