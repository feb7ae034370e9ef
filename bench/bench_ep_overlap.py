"""Chunked expert-parallel overlap at world size N: torchrun, one process a GPU, the layout a plan gives an MoE stack
at EP = N (FSDP2 over the same N ranks, expert-DP 1), or any EP that divides N (`--ep 1`: FSDP2 alone, the experts
sharded like every other weight, tokens routed locally). A model of the chosen shape at full width and reduced depth
trains one packed sequence of T tokens on every rank; for each T and each chunk count k of the all-to-all overlap it
reports, beside the cost model's prediction for the same layout, hardware profile and k (`recipe.cost.estimate`):

- the step time (median over --steps, after a warm-up step) and its speedup over k = 1;
- the all-to-all time a profiler trace of one step shows exposed: all-to-all kernel time during which no kernel runs
  on another stream (CUDA only), against the model's `ep_exposed`;
- every rank's peak memory against the model's per-GPU peak, like with like (`launch.job.peak_memory_gb`): the
  allocator's peak allocated against the peak less the profile's overhead term (CUDA context, NCCL buffers,
  allocator slack), and the device's peak (reserved plus what lies outside the allocator) against the whole peak.

Every k runs on the same weights and data (the chunked dispatch is swapped in), so the rows differ only in the
schedule. Before timing each T, one forward and backward per k on the same weights checks that it computes what
the first k does (loss and gradient norm within 1e-3): the CPU tests cannot see a race between the communication
and compute streams, and the bench exits non-zero, after its table, if any k is off. The step holds one sequence
a rank (rank r runs the one drawn with seed r, at loss weight 1/world), so routing and all-to-all volumes are those
of a real step, not a copy to self, and every rank's rows reach the gradients the check compares.

    torchrun --nproc-per-node 2 bench/bench_ep_overlap.py --tokens 16384,32768,65536 --chunks 1,2,4,8 \\
        --hw h200 --out ep_overlap.json
    torchrun --nproc-per-node 2 bench/bench_ep_overlap.py --ep 1 --tokens 16384,65536 --hw h200  # FSDP2 alone
    torchrun --nproc-per-node 2 bench/bench_ep_overlap.py --model tiny-moe --tokens 256 --chunks 1,2 \\
        --device cpu --hw cpu --steps 1                                           # smoke (gloo)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from bench_ep_path import PARITY_TOL, check_parity, chunked_dispatchers, install, stream_summary  # noqa: E402
from bench_train_step import _sync, _time  # noqa: E402


def predict(shape, hw_name: str, world: int, ep: int, tokens: int, chunks: int) -> dict:
    """The cost model's figures for this layout: step time, exposed all-to-all and expert FSDP time, per-GPU peak."""
    from recipe.cost import Layout, TrainOptions, estimate
    from recipe.hw import load_profile

    opts = TrainOptions(micro_batch_tokens=tokens, recompute="full", lm_head="fused", ep_overlap_chunks=chunks)
    est = estimate(shape, load_profile(hw_name), world, Layout(ep=ep), opts)
    return {"step_s": est.step_time_s, "ep_exposed_s": est.time_s["ep_exposed"],
            "fsdp_exposed_s": est.time_s["fsdp_exposed"], "peak_gb": est.memory_gb["total"],
            "allocated_gb": est.memory_gb["total"] - est.memory_gb["overhead"]}


def exposed_all_to_all_s(summary: dict) -> float | None:
    share = summary["all_to_all_overlapped_share"]
    return None if share is None else summary["all_to_all_ms"] * (1.0 - share) / 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen35-35b")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--tokens", default="16384,32768,65536", help="tokens per GPU, comma-separated")
    p.add_argument("--chunks", default="1,2,4,8", help="all-to-all chunk counts (EP > 1)")
    p.add_argument("--ep", type=int, default=None, help="expert-parallel degree (default: the world size)")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--hw", default="h200", help="hardware profile of the prediction")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--no-trace", action="store_true", help="skip the profiler step (no exposed all-to-all figure)")
    p.add_argument("--out", help="rank 0 writes the rows as JSON here")
    args = p.parse_args()

    from launch.data import synthetic_long_batch
    from launch.job import build_parallel_model, peak_memory_gb
    from launch.parallel import build_meshes, init_distributed, moe_layers
    from launch.train import TrainConfig, Trainer
    from recipe.models import resolve_model
    from recipe.plan import LayoutSpec

    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    device = torch.device(args.device)
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    init_distributed(device.type)
    shape = resolve_model(args.model).with_layers(args.layers)
    ep = args.ep or world
    if world % ep or shape.num_experts % ep:
        raise SystemExit(f"error: ep={ep} must divide the world size {world} and the {shape.num_experts} experts")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    chunks = [int(c) for c in args.chunks.split(",")] if ep > 1 else [1]
    layout = LayoutSpec(pp=1, tp=1, cp=1, ep=ep, dp=world, etp=1, edp=world // ep)
    plan = types.SimpleNamespace(layout=layout, train=types.SimpleNamespace(
        recompute="full", ep_overlap_chunks=chunks[0], lm_head="fused", pp_stages=None))
    meshes = build_meshes(layout, device.type)
    model = build_parallel_model(shape, plan, meshes, device, dtype, seed=0, ep_dispatch=ep > 1)
    trainer = Trainer(model, TrainConfig(lr=1e-6), recompute="full", lm_head="fused", dp_rank=meshes.dp_rank,
                      dp_size=meshes.dp_size, dp_group=meshes.dp_group, metrics_group=meshes.data_group)
    experts = moe_layers(model)
    dispatchers = chunked_dispatchers(experts, chunks) if ep > 1 else {1: None}

    rows, off = [], []
    for T in [int(t) for t in args.tokens.split(",")]:
        # the step's micro-batches, one a rank (the same list on every rank; rank r runs the r-th, weight 1/world)
        batch = [synthetic_long_batch(T, shape.vocab_size, device, seed=r) for r in range(world)]
        if len(chunks) > 1:  # every k against the first on the same weights: a timing of a wrong schedule is void
            off += [f"{name} at {T:,} tokens" for name in
                    check_parity(trainer, batch, experts, [(f"k={k}", dispatchers[k]) for k in chunks], rank == 0)[1]]
        for k in chunks:
            install(experts, dispatchers[k])
            trainer.step(batch)  # warm-up: compilation, autotuning, allocator growth
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            step_s = _time(lambda: trainer.step(batch), device, args.steps)
            mine = {"step_s": step_s}
            if device.type == "cuda":
                mem = peak_memory_gb(device)
                mine.update(peak_allocated_gb=mem["peak_mem_gb"], peak_device_gb=mem["peak_device_gb"],
                            peak_reserved_gb=torch.cuda.max_memory_reserved(device) / 1e9)
            if device.type == "cuda" and not args.no_trace:
                from torch.profiler import ProfilerActivity, profile

                with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                    trainer.step(batch)
                    _sync(device)
                summary = stream_summary(prof)
                mine.update(all_to_all_s=summary["all_to_all_ms"] / 1e3,
                            exposed_all_to_all_s=exposed_all_to_all_s(summary))
            every = [None] * world
            dist.all_gather_object(every, mine)
            row = {"tokens_per_gpu": T, "chunks": k, "world": world, "ep": ep, "ranks": every,
                   "step_s": max(r["step_s"] for r in every),
                   "predicted": predict(shape, args.hw, world, ep, T, k)}
            exp = [r.get("exposed_all_to_all_s") for r in every]
            row["exposed_all_to_all_s"] = max(exp) if all(e is not None for e in exp) else None
            rows.append(row)
            if rank == 0:
                print(json.dumps(row), flush=True)
    if rank == 0:
        report(rows, shape, args)
        if args.out:
            Path(args.out).write_text(json.dumps({"model": shape.name, "layers": args.layers, "hw": args.hw,
                                                  "device": torch.cuda.get_device_name(device)
                                                  if device.type == "cuda" else "cpu", "rows": rows}, indent=1))
    dist.destroy_process_group()
    if off:
        raise SystemExit(f"parity FAILED: {', '.join(off)} off k = {chunks[0]} by more than {PARITY_TOL:g} (loss or "
                         f"gradient norm); those rows time a wrong computation")


def report(rows: list[dict], shape, args) -> None:
    """The table: measured beside predicted, speedups over k = 1 of the same T."""
    base = {r["tokens_per_gpu"]: r for r in rows if r["chunks"] == 1}
    print(f"\n{shape.name} ({args.layers} layers), world {rows[0]['world']}, EP = {rows[0]['ep']}, {args.device}, "
          f"prediction for {args.hw}")
    print("| tokens/GPU | k | step s | × vs k=1 | predicted step s | predicted × | exposed a2a ms | predicted ms | "
          "allocated GB (max rank) | predicted | on device GB (max rank) | predicted |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        b = base.get(r["tokens_per_gpu"])
        speed = b["step_s"] / r["step_s"] if b else float("nan")
        pspeed = b["predicted"]["step_s"] / r["predicted"]["step_s"] if b else float("nan")
        exp = r["exposed_all_to_all_s"]
        alloc = [x["peak_allocated_gb"] for x in r["ranks"] if "peak_allocated_gb" in x]
        dev = [x["peak_device_gb"] for x in r["ranks"] if "peak_device_gb" in x]
        print(f"| {r['tokens_per_gpu']:,} | {r['chunks']} | {r['step_s']:.3f} | {speed:.3f} | "
              f"{r['predicted']['step_s']:.3f} | {pspeed:.3f} | "
              f"{'—' if exp is None else f'{exp * 1e3:.1f}'} | {r['predicted']['ep_exposed_s'] * 1e3:.1f} | "
              f"{f'{max(alloc):.1f}' if alloc else '—'} | {r['predicted']['allocated_gb']:.1f} | "
              f"{f'{max(dev):.1f}' if dev else '—'} | {r['predicted']['peak_gb']:.1f} |", flush=True)


if __name__ == "__main__":
    main()
