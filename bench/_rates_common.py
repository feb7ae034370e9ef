"""What bench_expert_rates.py and bench_attention_rates.py share: their command line (cases, the profile compared,
device, output) and the JSON they write (the form of hw_profiles/calibration/<hw>_<what>.json); and the CUDA-event
timer the kernel benches (bench_gdn_fused.py, bench_grouped_gemm.py) use."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def rate_args(doc: str, cases: str, case_form: str, compared: str, extra=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    p.add_argument("--cases", default=cases, help=f"{case_form}, comma-separated")
    p.add_argument("--hw", default="h200", help=f"the profile whose {compared} is compared")
    p.add_argument("--device", default="cuda")
    if extra is not None:
        extra(p)
    p.add_argument("--out", help="write the figures as JSON")
    p.add_argument("--commit", default="", help="the commit measured, recorded in --out")
    return p.parse_args()


def write_rates(args: argparse.Namespace, script: str, what: str, rows: list[dict]) -> None:
    """--out's JSON: what was timed, the profile, the device and torch, the commit, the command, and the rows."""
    if not args.out:
        return
    import torch

    device = torch.device(args.device)
    name = torch.cuda.get_device_name() if device.type == "cuda" else str(device)
    Path(args.out).write_text(json.dumps({
        "what": what, "hw": args.hw, "device": f"{name}, torch {torch.__version__}", "commit": args.commit,
        "command": " ".join([f"python bench/{script}"] + sys.argv[1:]), "rows": rows}, indent=1) + "\n")


def event_ms(fn, reps: int, warmup: int = 1) -> float:
    """Median milliseconds of `fn` on the current CUDA device over `reps` calls after `warmup`, by CUDA events."""
    import statistics

    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)
