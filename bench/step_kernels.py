"""Where a training step's GPU time goes, kernel by kernel, for two configurations side by side: two recompute modes
at one depth (the diagnostic for a calibration point whose measured step disagrees with its twin, e.g. a step without
recompute slower than the same step with it), or one mode at two depths (what a step costs per decoder layer and
what it costs whatever the depth).

For each configuration a fresh reduced-depth model at full width is built, one warm-up step runs (compilation,
autotuning), then `--steps` timed steps (median), then one step under torch.profiler. The table lists the kernels
by their summed device time in that step, the two configurations' times and their difference, largest differences
first. Above it: each configuration's step, the GPU's busy time in the profiled step (the union of its kernels'
intervals) and the rest, idle; at two depths also the per-layer slope and the intercept of each, beside the cost
model's (recipe.calibration.predict_point on the profile `--hw`).

    python bench/step_kernels.py --model qwen3-next-80b --layers 2 --seq 8192          # on the GPU
    python bench/step_kernels.py --model qwen35-35b --layers 2,8 --modes full --seq 8192
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


def kernel_times(model_name: str, layers: int, seq: int, recompute: str, device, steps: int
                 ) -> tuple[float, dict, float]:
    """(median step seconds, {kernel name: device seconds in one profiled step}, the GPU's busy seconds in that step:
    the union of its kernels' intervals; on CPU the sum of the operators' own time)."""
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
    busy = sum(by_name.values())
    if device.type == "cuda":
        spans = sorted((ev.time_range.start, ev.time_range.end) for ev in prof.events()
                       if getattr(ev, "device_type", None) == torch.autograd.DeviceType.CUDA)
        busy, end = 0.0, float("-inf")
        for a, b in spans:  # microseconds; the union of the kernels' intervals
            if b > end:
                busy += b - max(a, end)
                end = b
        busy /= 1e6
    del trainer, model, batch
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return statistics.median(times), by_name, busy


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen3-next-80b")
    p.add_argument("--layers", default="2", help="a depth, or two depths comma-separated (then one mode)")
    p.add_argument("--seq", type=int, default=8192)
    p.add_argument("--modes", default="none,full", help="two recompute modes comma-separated, or one at two depths")
    p.add_argument("--hw", default="h200", help="the profile the cost model's slope and intercept are read on")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--top", type=int, default=20)
    p.add_argument("--device", default="cuda")
    args = p.parse_args()

    import torch

    device = torch.device(args.device)
    depths = [int(x) for x in args.layers.split(",")]
    modes = args.modes.split(",")
    if len(depths) == 2:
        configs = [(depths[0], modes[0]), (depths[1], modes[0])]
    else:
        configs = [(depths[0], modes[0]), (depths[0], modes[1])]
    (la, a), (lb, b) = configs
    step_a, ka, busy_a = kernel_times(args.model, la, args.seq, a, device, args.steps)
    step_b, kb, busy_b = kernel_times(args.model, lb, args.seq, b, device, args.steps)
    a, b = f"{la}L {a}", f"{lb}L {b}"
    print(f"{args.model}, {args.seq:,} tokens: step {step_a * 1e3:.1f} ms ({a}) against {step_b * 1e3:.1f} ms ({b}); "
          f"profiled kernels {sum(ka.values()) * 1e3:.1f} against {sum(kb.values()) * 1e3:.1f} ms")
    print(f"GPU busy {busy_a * 1e3:.1f} against {busy_b * 1e3:.1f} ms; idle (step less busy) "
          f"{(step_a - busy_a) * 1e3:.1f} against {(step_b - busy_b) * 1e3:.1f} ms")
    if lb != la:
        from recipe.calibration import predict_point

        pred = [predict_point({"model": args.model, "layers": n, "seq": args.seq, "recompute": modes[0],
                               "lm_head": "fused"}, args.hw)["step_s"] for n in (la, lb)]
        print(f"{'per step':>22} {'a layer':>9} {'whatever the depth':>20}")
        for name, x, y in (("step", step_a, step_b), ("GPU busy", busy_a, busy_b),
                           ("idle", step_a - busy_a, step_b - busy_b), (f"cost model ({args.hw})", *pred)):
            slope = (y - x) / (lb - la)
            print(f"{name:>22} {slope * 1e3:8.2f}  {(x - la * slope) * 1e3:19.2f}   ms")
    names = sorted(set(ka) | set(kb), key=lambda n: -abs(ka.get(n, 0.0) - kb.get(n, 0.0)))
    print(f"{a + ' ms':>9} {b + ' ms':>9} {'diff':>8}  kernel")
    for n in names[:args.top]:
        x, y = ka.get(n, 0.0) * 1e3, kb.get(n, 0.0) * 1e3
        print(f"{x:9.2f} {y:9.2f} {x - y:+8.2f}  {n[:110]}")


if __name__ == "__main__":
    main()
