"""Layout parity on NCCL: every layout case of tests/dist_cases.py for a world size (FSDP2, expert parallel with k
chunks, context, tensor and pipeline parallel, and their combinations, on tiny-moe and a tiny dense model) run with
one GPU a rank over NCCL, each against the same two steps on one GPU alone: every step's loss, step 1's metrics and
every gradient of step 1. In fp32 (TF32 off) and in bf16 (bf16 parameters and compute, fp32 masters and
accumulation, as `recipe launch` runs), one launch per dtype.

The figures are relative: a loss or metric against the one-GPU value, a gradient's largest difference against that
tensor's largest entry (tests/dist_cases.py `_rel`). The table marks each case against the tolerance of its dtype:
in fp32, losses and metrics within 1e-5 and gradients within 1e-4; in bf16, every step's loss and step 1's metrics
within 2e-2 (bf16 keeps 8 bits: the same additions in another order, as a split over ranks makes them, move a sum by a
few 2^-8). bf16 gradients are reported, not judged: a split layout rounds the router's inputs apart from one GPU's, a
token near a tie between two experts can go to the other one, and that expert's gradient moves by far more than any
rounding (tensor parallel on gloo: 0.4–0.7 of the largest entry of an expert's down_proj, with losses within 4e-4,
where the same split of the dense model stays within 1.9e-2 on every tensor).
The CPU suite holds the same cases on gloo to 1e-6 / 1e-5 in fp32 (tests/test_parallel.py).

    python bench/bench_parity_nccl.py --gpus 2 --out parity.json        # worlds 1 and 2, fp32 and bf16
    python bench/bench_parity_nccl.py --gpus 8 --worlds 8 --dtypes fp32
    python bench/bench_parity_nccl.py --device cpu --gpus 2 --dtypes fp32   # the driver itself, on gloo
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

import torch  # noqa: E402

import dist_cases  # noqa: E402

TOLERANCE = {"fp32": (1e-5, 1e-4), "bf16": (2e-2, None)}  # (losses and metrics, gradients; None: not judged)


def run_world(world: int, dtype: str, device: str) -> list[dict]:
    # the CP exchanges alone ("pieces") are fp64 function checks on CPU tensors: the CPU suite's
    cases = [c for c in dist_cases.CASES[world] if c[1] != "pieces"]
    with tempfile.TemporaryDirectory() as d:
        return dist_cases.spawn(world, cases, Path(d) / "results.json", device, dtype)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gpus", type=int, default=2, help="GPUs on this host (or CPU processes with --device cpu)")
    p.add_argument("--worlds", default=None, help="world sizes, comma-separated (default: 1 and every size of "
                                                  "tests/dist_cases.CASES up to --gpus)")
    p.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"], choices=sorted(TOLERANCE))
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--out", help="write every case's figures as JSON here")
    args = p.parse_args()
    if args.device == "cuda" and torch.cuda.device_count() < args.gpus:
        print(f"error: --gpus {args.gpus} but {torch.cuda.device_count()} CUDA devices are visible", file=sys.stderr)
        return 2
    worlds = ([int(w) for w in args.worlds.split(",")] if args.worlds
              else [w for w in sorted(dist_cases.CASES) if w <= args.gpus])
    rows, failed = [], 0
    print("| world | dtype | case | loss, max over steps | metrics | gradients (worst tensor) | within tolerance |")
    print("|---|---|---|---|---|---|---|")
    for dtype in args.dtypes:
        loss_tol, grad_tol = TOLERANCE[dtype]
        for world in worlds:
            t0 = time.perf_counter()
            for r in run_world(world, dtype, args.device):
                ok = (max(r["loss_rel"]) <= loss_tol and max(r["metric_rel"].values()) <= loss_tol
                      and (grad_tol is None or r["grad_rel"] <= grad_tol))
                failed += not ok
                rows.append({"world": world, "dtype": dtype, **r})
                print(f"| {world} | {dtype} | {r['name']} | {max(r['loss_rel']):.1e} | "
                      f"{max(r['metric_rel'].values()):.1e} | {r['grad_rel']:.1e} ({r['worst_grad']}) | "
                      f"{'yes' if ok else 'NO'} |", flush=True)
            print(f"# world {world}, {dtype}: {time.perf_counter() - t0:.0f} s", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"device": torch.cuda.get_device_name(0) if args.device == "cuda"
                                              else "cpu", "rows": rows}, indent=1))
    print(f"# {len(rows) - failed} of {len(rows)} cases within tolerance")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
