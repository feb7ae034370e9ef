"""Device memory outside the caching allocator, and the CUDA stack limit behind it: one training step of a
reduced-depth, full-width model on one GPU (its first, which tunes the Triton kernels where their cache is cold),
then the stack limit set back the way `recipe launch` does after its first step (launch/job.py: StackLimit), then
more steps. Prints, at each point, what the device holds beyond the allocator's reserved bytes and the limit.

    python3 bench/stack_limit.py --model qwen35-35b --layers 1 --seq 8192
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen35-35b")
    p.add_argument("--layers", type=int, default=1)
    p.add_argument("--seq", type=int, default=8192)
    p.add_argument("--steps", type=int, default=3, help="steps after the limit is set back")
    args = p.parse_args()

    import torch

    from kernels.lm_head.api import linear_cross_entropy
    from launch.job import StackLimit
    from launch.model import Packing, build_model
    from recipe.models import resolve_model

    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")

    def outside_gb() -> float:
        torch.cuda.synchronize()
        free, total = torch.cuda.mem_get_info()
        return (total - free - torch.cuda.memory_reserved()) / 1e9

    model = build_model(resolve_model(args.model).with_layers(args.layers), "cuda", torch.bfloat16)
    ids = torch.randint(0, 1000, (args.seq,), device="cuda")
    packing = Packing.from_lengths([args.seq], "cuda")

    def step() -> None:
        h = model(ids, packing)
        linear_cross_entropy(h, model.lm_head.weight, ids).backward()

    limit = StackLimit.of_this_process()
    print(f"{args.model} x {args.layers} layers, {args.seq} tokens")
    print(f"{'moment':<28}{'outside GB':>11}{'stack B/thread':>16}")
    print(f"{'model built':<28}{outside_gb():>11.2f}{limit.get()!s:>16}")
    step()
    print(f"{'after the first step':<28}{outside_gb():>11.2f}{limit.get()!s:>16}")
    grown = limit.restore()
    print(f"{'limit set back':<28}{outside_gb():>11.2f}{limit.get()!s:>16}   (it had grown by {grown} B a thread)")
    for _ in range(args.steps):
        step()
    print(f"{f'after {args.steps} more steps':<28}{outside_gb():>11.2f}{limit.get()!s:>16}")


if __name__ == "__main__":
    main()
