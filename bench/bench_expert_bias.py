"""gpt-oss's expert biases: the training step with the bias add on its kernel (kernels/expert_grads.py
`add_expert_bias_`) against torch's gather-and-add (`add_expert_bias_torch`), in one process, alternating rounds so
that both see the same GPU state (at the power cap a step's time drifts between processes by about as much as the
difference). Prints each round's median step and the ratio; the losses must be equal (the two paths are bitwise
the same).

    python bench/bench_expert_bias.py --model gpt-oss-20b --layers 4 --seq 32768 --steps 5 --rounds 2   # GPU
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="gpt-oss-20b")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seq", type=int, default=32768)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--device", default="cuda")
    args = p.parse_args()

    import torch

    import kernels.expert_grads as eg
    import launch.moe as moe
    from bench_train_step import run_ours
    from recipe.models import resolve_model

    shape = resolve_model(args.model).with_layers(args.layers)
    paths = {"kernel": eg.add_expert_bias_,
             "torch": lambda rows, bias, offs, backend=None: eg.add_expert_bias_torch(rows, bias, offs)}
    steps: dict[str, list[float]] = {name: [] for name in paths}
    losses = set()
    print(f"{'round':>5} {'path':>7} {'step s':>8}", flush=True)
    for r in range(args.rounds):
        for name, fn in paths.items():
            moe.add_expert_bias = fn
            out = run_ours(shape, args.seq, torch.device(args.device), args.steps, False)
            steps[name].append(out["step_s"])
            losses.add(out["loss"])
            print(f"{r:>5} {name:>7} {out['step_s']:>8.4f}", flush=True)
            gc.collect()
            if args.device == "cuda":
                torch.cuda.empty_cache()
    k, t = statistics.median(steps["kernel"]), statistics.median(steps["torch"])
    print(f"kernel {k:.4f} s, torch {t:.4f} s: torch / kernel {t / k:.3f}; losses equal: {len(losses) == 1}")


if __name__ == "__main__":
    main()
