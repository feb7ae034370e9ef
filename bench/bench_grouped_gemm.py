"""The routed experts' three GEMM kinds (the gate/up projection, the down projection's input gradient and the weight
gradient) for equal rows per expert, as one `torch._grouped_mm` (what the training core runs on Hopper in bf16) and
as a loop of one cuBLAS GEMM per expert, side by side: TF/s of each and their ratio. Where the loop is faster, the
grouped kernel is what the expert term of the step-time model charges too little for (docs/BENCHMARKS.md, "Routed
experts timed alone").

    python bench/bench_grouped_gemm.py                                   # one GPU: Mixtral's and Qwen3-30B's shapes
    python bench/bench_grouped_gemm.py --shapes 8:4096:14336:8192         # experts:hidden:ffn:rows-an-expert
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _rates_common import event_ms  # noqa: E402

SHAPES = "8:4096:14336:2048,8:4096:14336:8192,8:4096:14336:16384,128:2048:768:512,128:2048:768:2048"


def main() -> None:
    import torch

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default=SHAPES, help="experts:hidden:ffn:rows-an-expert, comma-separated")
    p.add_argument("--reps", type=int, default=10)
    args = p.parse_args()
    dev, dt = torch.device("cuda"), torch.bfloat16
    print(f"{'E':>4} {'h':>5} {'f':>6} {'rows/e':>7}  {'GEMM':<14} {'grouped ms':>10} {'TF/s':>6} {'loop ms':>8} "
          f"{'TF/s':>6} {'grouped/loop':>12}")
    for spec in args.shapes.split(","):
        E, h, f, r = (int(x) for x in spec.split(":"))
        M = E * r
        offs = torch.arange(1, E + 1, device=dev, dtype=torch.int32) * r
        x = torch.randn(M, h, device=dev, dtype=dt)
        w1 = torch.randn(E, 2 * f, h, device=dev, dtype=dt) * 0.02
        g = torch.randn(M, 2 * f, device=dev, dtype=dt)
        xs, gs = x.view(E, r, h), g.view(E, r, 2 * f)
        cases = {
            "x @ w1ᵀ": (lambda: torch._grouped_mm(x, w1.transpose(-2, -1), offs=offs),
                        lambda: [torch.mm(xs[e], w1[e].t()) for e in range(E)]),
            "dy @ w1 (dx)": (lambda: torch._grouped_mm(g, w1, offs=offs),
                             lambda: [torch.mm(gs[e], w1[e]) for e in range(E)]),
            "dyᵀ @ x (dW)": (lambda: torch._grouped_mm(g.t(), x, offs=offs),
                             lambda: [torch.mm(gs[e].t(), xs[e]) for e in range(E)]),
        }
        flops = 2 * M * h * 2 * f
        for name, (grouped, loop) in cases.items():
            tg, tl = event_ms(grouped, args.reps) / 1e3, event_ms(loop, args.reps) / 1e3
            print(f"{E:>4} {h:>5} {f:>6} {r:>7}  {name:<14} {tg * 1e3:10.2f} {flops / tg / 1e12:6.0f} {tl * 1e3:8.2f} "
                  f"{flops / tl / 1e12:6.0f} {tg / tl:12.2f}")
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
