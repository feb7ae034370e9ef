"""The optimizer step alone: MasterAdamW (launch/optim.py) with PyTorch's fused AdamW against its foreach form, on
the model as one process holds it (bf16 parameters, fp32 masters cast a group at a time) and as FSDP2 holds it
(fp32 DTensor shards that are their own masters; `parallelize` at world size 1, the expert-parallel path included),
with every gradient scaled so that the step clips (norm 10 over the limit 1) and so that it does not. Beside them,
the peer a plain trainer uses: torch.optim.AdamW (foreach) on bf16 parameters after clip_grad_norm_ (bf16 moments,
half our state). Rounds alternate the variants in one process; prints each variant's median step, its HBM rate at
MasterAdamW's 40 bytes a parameter (recipe/cost.py ADAM_BYTES_MOVED) and its ratio to the fused step.

    python bench/bench_optimizer.py --model qwen35-35b --layers 2 --steps 5 --rounds 2     # GPU
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen35-35b")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--device", default="cuda")
    args = p.parse_args()

    import torch

    from launch.model import build_model
    from launch.optim import MasterAdamW
    from _world_one import plan_of_one, world_of_one
    from launch.parallel import parallelize
    from recipe.cost import ADAM_BYTES_MOVED
    from recipe.models import resolve_model

    device = torch.device(args.device)
    shape = resolve_model(args.model).with_layers(args.layers)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32

    def timed(fn) -> float:
        fn()  # warm-up (the fused kernels' first launch, the allocator)
        out = []
        for _ in range(args.steps):
            if device.type == "cuda":
                torch.cuda.synchronize()
            t = time.perf_counter()
            fn()
            if device.type == "cuda":
                torch.cuda.synchronize()
            out.append(time.perf_counter() - t)
        return statistics.median(out)

    def set_grads(model, norm: float) -> None:
        params = [q for q in model.parameters() if q.requires_grad]
        for q in params:
            q.grad = torch.ones_like(q)
        total = sum(q.numel() for q in params) ** 0.5  # every gradient 1: the norm is √N
        for q in params:
            q.grad.mul_(norm / total)

    results: dict[str, list[float]] = {}
    n_params = 0

    def run(label: str, model, make_opt, norm: float) -> None:
        opt = make_opt(model)
        set_grads(model, norm)
        results.setdefault(label, []).append(timed(opt.step))
        del opt

    # one process: bf16 parameters, fp32 masters
    local = build_model(shape, device=device, dtype=dtype, seed=0)
    n_params = sum(q.numel() for q in local.parameters())
    peer_opt = None

    def peer_step():
        torch.nn.utils.clip_grad_norm_(local.parameters(), 1.0)
        peer_opt.step()

    for r in range(args.rounds):
        for fused in (True, False):
            for norm, what in ((10.0, "clipped"), (0.5, "unclipped")):
                run(f"one process, {'fused' if fused else 'foreach'}, {what}", local,
                    lambda m, f=fused: MasterAdamW(m.named_parameters(), lr=1e-6, fused=f), norm)
        peer_opt = torch.optim.AdamW(local.parameters(), lr=1e-6, foreach=True)
        set_grads(local, 10.0)
        results.setdefault("peer: torch AdamW foreach, bf16 state, clipped", []).append(timed(peer_step))
        peer_opt = None
        torch.cuda.empty_cache() if device.type == "cuda" else None
    del local

    # FSDP2 at world size 1 (the expert-parallel path): fp32 shards, their own masters
    one, meshes = world_of_one(device.type, 29533)
    sharded = parallelize(build_model(shape, device=device, dtype=dtype, seed=0), plan_of_one(one), meshes,
                          ep_dispatch=True)
    for r in range(args.rounds):
        for fused in (True, False):
            for norm, what in ((10.0, "clipped"), (0.5, "unclipped")):
                run(f"FSDP2 world 1, {'fused' if fused else 'foreach'}, {what}", sharded,
                    lambda m, f=fused: MasterAdamW(m.named_parameters(), lr=1e-6, fused=f), norm)

    print(f"\n{shape.name}: {n_params / 1e9:.2f}B parameters, {args.steps} steps a round, {args.rounds} rounds")
    print(f"{'variant':52} {'step ms':>9} {'TB/s at 40 B':>13} {'vs fused':>9}")
    for label, ts in results.items():
        t = statistics.median(ts)
        where = "FSDP2 world 1" if label.startswith("FSDP2") else "one process"
        base = results[f"{where}, fused, {label.rsplit(', ', 1)[-1]}"]  # the fused step of the same clipping
        print(f"{label:52} {t * 1e3:9.2f} {n_params * ADAM_BYTES_MOVED / t / 1e12:13.2f} "
              f"{t / statistics.median(base):9.2f}")
    import torch.distributed as dist

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
