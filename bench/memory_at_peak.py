"""What is live at a training step's peak: one step of a reduced-depth, full-width model on one GPU with the caching
allocator's history recorded, the allocation trace replayed to the moment of the peak allocated bytes, and the
tensors live then grouped by the line of `launch/` or `kernels/` that allocated them. The cost model's memory terms
for the same configuration print beside it, so a term that is over- or under-predicted shows which tensors it
misses.

    python bench/memory_at_peak.py --model qwen35-35b --layers 2 --seq 32768            # on the GPU
    python bench/memory_at_peak.py --model qwen3-30b-a3b --layers 2 --seq 131072 --json out.json

The step recorded is the third: the first compiles and tunes the kernels and makes the gradients, the second gives the
plain peak the recorded one is checked against. Tensors that exist before the step (weights, gradients, fp32 masters,
moments) are counted as `persistent`, from torch.cuda.memory_allocated() when the recording starts.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

OWN = ("launch/", "kernels/")  # frames of these folders name an allocation's site


def site(frames: list[dict], own=OWN) -> str:
    """The innermost frame of this repository's code (`file:line function`), else the innermost frame at all."""
    for f in frames:
        name = f.get("filename", "").replace("\\", "/")
        for d in own:
            i = name.rfind("/" + d)
            if i >= 0 or name.startswith(d):
                rel = name[i + 1:] if i >= 0 else name
                return f"{rel}:{f.get('line')} {f.get('name')}"
    if frames:
        f = frames[0]
        return f"{f.get('filename')}:{f.get('line')} {f.get('name')}"
    return "(no frame)"


def live_at_peak(trace: list[dict], baseline: int = 0) -> tuple[int, int, dict[int, dict]]:
    """Replays one device's allocator trace (torch.cuda.memory._snapshot()['device_traces'][d]): `alloc` adds a
    block, `free_requested` removes it (the allocator's allocated bytes drop there). Returns the peak of
    baseline + live bytes, the index of the event that reached it (-1: the baseline itself) and the blocks live
    then, by address. Frees of blocks allocated before the trace began lower the total below the baseline."""
    cur = peak = baseline
    at = -1
    for i, e in enumerate(trace):
        a = e.get("action")
        if a == "alloc":
            cur += e["size"]
            if cur > peak:
                peak, at = cur, i
        elif a == "free_requested":
            cur -= e["size"]
    live: dict[int, dict] = {}
    for e in trace[:at + 1]:
        a = e.get("action")
        if a == "alloc":
            live[e["addr"]] = e
        elif a == "free_requested":
            live.pop(e["addr"], None)
    return peak, at, live


def group_by_site(live: dict[int, dict], own=OWN) -> list[tuple[str, int, int]]:
    """[(site, bytes, count)] of the live blocks, largest first."""
    agg: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for e in live.values():
        g = agg[site(e.get("frames", []), own)]
        g[0] += e["size"]
        g[1] += 1
    return sorted(((k, v[0], v[1]) for k, v in agg.items()), key=lambda r: -r[1])


def predicted_terms(model: str, layers: int, seq: int, recompute: str, head: str, hw: str) -> dict[str, float]:
    """The cost model's memory terms for the point (GB), with the activation term's parts."""
    from recipe.cost import BF16, Layout, TrainOptions, estimate, layer_params, layer_saved, layer_working_set
    from recipe.hw import load_profile
    from recipe.models import resolve_model

    m = resolve_model(model).with_layers(layers)
    opts = TrainOptions(micro_batch_tokens=seq, recompute=recompute, lm_head=head)
    e = estimate(m, load_profile(hw), 1, Layout(), opts)
    out = {k: v for k, v in e.memory_gb.items() if k not in ("total", "usable")}
    mixer, ffn = layer_saved(m, seq, 1, 1)
    out["  of which: a layer's saved mixer"] = mixer / 1e9
    out["  of which: a layer's saved FFN"] = ffn / 1e9
    # at world size 1 the layer's expert gradients are whole; the estimate takes them off the backward's peak
    out["  of which: the working set"] = layer_working_set(m, seq, 1, 1, expert_grad=layer_params(m)[1] * BF16) / 1e9
    if recompute == "full":
        out["  of which: checkpoints (L·s·h·2)"] = layers * seq * m.hidden_size * 2 / 1e9
    out["allocated (total less overhead)"] = e.total_gb - e.memory_gb["overhead"]
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen35-35b")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--seq", type=int, default=32768)
    p.add_argument("--recompute", choices=["full", "none"], default="full")
    p.add_argument("--lm-head", choices=["fused", "lean", "naive"], default="fused")
    p.add_argument("--hw", default="h200", help="the profile the prediction is made for")
    p.add_argument("--top", type=int, default=25, help="rows of the live-tensor table")
    p.add_argument("--json", help="also write the table and the prediction here")
    args = p.parse_args()

    import torch

    if not torch.cuda.is_available():
        sys.exit("memory_at_peak: needs a CUDA or ROCm device (the caching allocator's history)")
    from launch.data import synthetic_long_batch
    from launch.model import build_model
    from launch.train import TrainConfig, Trainer
    from recipe.models import resolve_model

    device = torch.device("cuda")
    shape = resolve_model(args.model).with_layers(args.layers)
    model = build_model(shape, device=device, dtype=torch.bfloat16, seed=0)
    trainer = Trainer(model, TrainConfig(lr=1e-6), recompute=args.recompute, lm_head=args.lm_head)
    batch = synthetic_long_batch(args.seq, shape.vocab_size, device)
    trainer.step(batch)  # compiles, tunes, makes the gradients

    def fresh_peak():
        torch.cuda.synchronize()
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()

    fresh_peak()
    trainer.step(batch)
    plain = torch.cuda.max_memory_allocated()
    fresh_peak()
    baseline = torch.cuda.memory_allocated()
    # torch 2.11 fails a recompute that stops early inside a custom autograd Function (the routed experts, last in
    # a layer without a shared expert) while the history is recorded (pytorch#179536): the recorded step runs the
    # recompute to its end, which can add a transient the plain step does not have; both peaks are printed
    torch.cuda.memory._record_memory_history(max_entries=2_000_000, stacks="python")
    with torch.utils.checkpoint.set_checkpoint_early_stop(False):
        trainer.step(batch)
    torch.cuda.synchronize()
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    measured = torch.cuda.max_memory_allocated()
    trace = snap["device_traces"][torch.cuda.current_device()]
    peak, at, live = live_at_peak(trace, baseline)
    rows = group_by_site(live)
    pred = predicted_terms(args.model, args.layers, args.seq, args.recompute, args.lm_head, args.hw)

    print(f"{args.model} × {args.layers} layers, {args.seq} tokens, recompute {args.recompute}, head {args.lm_head}")
    print(f"peak allocated {plain / 1e9:.2f} GB in a plain step, {measured / 1e9:.2f} GB in the recorded one "
          f"(replayed: {peak / 1e9:.2f} GB at event {at} of {len(trace)}); persistent before the step "
          f"{baseline / 1e9:.2f} GB")
    kept = peak - sum(e["size"] for e in live.values())  # of the blocks that predate the step, those still live
    print("\n| live at the peak | GB | blocks |\n|---|---|---|")
    print(f"| from before the step (of {baseline / 1e9:.2f} GB) | {kept / 1e9:.2f} | |")
    for s, b, n in rows[:args.top]:
        print(f"| {s} | {b / 1e9:.3f} | {n} |")
    rest = rows[args.top:]
    if rest:
        print(f"| {len(rest)} other sites | {sum(r[1] for r in rest) / 1e9:.3f} | {sum(r[2] for r in rest)} |")
    print(f"\n| predicted ({args.hw}) | GB |\n|---|---|")
    for k, v in pred.items():
        print(f"| {k} | {v:.2f} |")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "point": vars(args), "peak_allocated_gb": plain / 1e9, "recorded_peak_gb": measured / 1e9,
            "replayed_gb": peak / 1e9,
            "persistent_gb": baseline / 1e9, "persistent_live_gb": kept / 1e9,
            "live": [{"site": s, "gb": b / 1e9, "blocks": n} for s, b, n in rows],
            "predicted_gb": pred}, indent=1) + "\n")


if __name__ == "__main__":
    main()
