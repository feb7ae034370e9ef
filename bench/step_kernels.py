"""Where a training step's GPU time goes, kernel by kernel, for two recompute modes side by side: the diagnostic for a
calibration point whose measured step disagrees with its twin (e.g. a step without recompute slower than the same
step with it).

For each mode a fresh reduced-depth model at full width is built, one warm-up step runs (compilation, autotuning),
then `--steps` timed steps (median), then one step under torch.profiler. The table lists the kernels by their
summed device time in that step, the two modes' times and their difference, largest differences first.

    python bench/step_kernels.py --model qwen3-next-80b --layers 2 --seq 8192          # on the GPU
    python bench/step_kernels.py --model tiny-moe --layers 2 --seq 256 --device cpu      # CPU smoke
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def kernel_times(model_name: str, layers: int, seq: int, recompute: str, device, steps: int) -> tuple[float, dict]:
    """(median step seconds, {kernel name: device seconds in one profiled step})."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from launch.data import synthetic_long_batch
    from launch.model import build_model
    from launch.train import TrainConfig, Trainer
    from recipe.models import resolve_model

    shape = resolve_model(model_name).with_layers(layers)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = build_model(shape, device=device, dtype=dtype, seed=0)
    trainer = Trainer(model, TrainConfig(lr=1e-6), recompute=recompute, lm_head="fused")
    batch = synthetic_long_batch(seq, shape.vocab_size, device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    trainer.step(batch)
    times = []
    for _ in range(steps):
        sync()
        t0 = time.perf_counter()
        trainer.step(batch)
        sync()
        times.append(time.perf_counter() - t0)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        trainer.step(batch)
        sync()
    by_name: dict[str, float] = {}
    for ev in prof.key_averages():
        t = getattr(ev, "device_time_total", None) if device.type == "cuda" else ev.self_cpu_time_total
        if t and (device.type != "cuda" or getattr(ev, "device_type", None) == torch.autograd.DeviceType.CUDA):
            by_name[ev.key] = by_name.get(ev.key, 0.0) + t / 1e6
    del trainer, model, batch
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return statistics.median(times), by_name


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen3-next-80b")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--seq", type=int, default=8192)
    p.add_argument("--modes", default="none,full", help="two recompute modes, comma-separated")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--top", type=int, default=20)
    p.add_argument("--device", default="cuda")
    args = p.parse_args()

    import torch

    device = torch.device(args.device)
    a, b = args.modes.split(",")
    step_a, ka = kernel_times(args.model, args.layers, args.seq, a, device, args.steps)
    step_b, kb = kernel_times(args.model, args.layers, args.seq, b, device, args.steps)
    print(f"{args.model}, {args.layers} layers, {args.seq:,} tokens: step {step_a * 1e3:.1f} ms ({a}) against "
          f"{step_b * 1e3:.1f} ms ({b}); profiled kernels {sum(ka.values()) * 1e3:.1f} against "
          f"{sum(kb.values()) * 1e3:.1f} ms")
    names = sorted(set(ka) | set(kb), key=lambda n: -abs(ka.get(n, 0.0) - kb.get(n, 0.0)))
    print(f"{a + ' ms':>9} {b + ' ms':>9} {'diff':>8}  kernel")
    for n in names[:args.top]:
        x, y = ka.get(n, 0.0) * 1e3, kb.get(n, 0.0) * 1e3
        print(f"{x:9.2f} {y:9.2f} {x - y:+8.2f}  {n[:110]}")


if __name__ == "__main__":
    main()
