"""Worker for tests/test_parallel.py: every layout case of one world size in one spawned process group (gloo).

Each case runs the same steps twice on every rank: once on one process (the reference: the whole step's
micro-batches, no process group), once under the layout (FSDP2 / expert parallel, each data-parallel rank its
share). Rank 0 writes, per case, the largest relative differences of every step's loss and of every gradient after
step 1 (full tensors gathered from the shards), plus the expert loads the EP path saw.
"""

from __future__ import annotations

import json
import os
import sys
import types
from datetime import timedelta

import torch
import torch.distributed as dist


def _plan(dp: int, ep: int, chunks: int, recompute: str = "full"):
    from recipe.plan import LayoutSpec

    world = dp
    layout = LayoutSpec(pp=1, tp=1, cp=1, ep=ep, dp=dp, etp=1, edp=world // ep)
    return types.SimpleNamespace(layout=layout, train=types.SimpleNamespace(recompute=recompute,
                                                                            ep_overlap_chunks=chunks))


def _steps_data(vocab: int):
    """Two steps of packed multi-document micro-batches of uneven sizes (5 micro-batches: dp=2 and dp=4 both pad)."""
    from launch.data import make_batch, pack_rollouts, synthetic_rollouts

    rollouts = synthetic_rollouts(5, 3, vocab, prompt_len=(2, 12), response_len=(2, 30), seed=3)
    steps = []
    for s in range(2):
        chosen = rollouts[s * 7:s * 7 + 8]
        steps.append([make_batch(g) for g in pack_rollouts(chosen, 64)])
    return steps


def _run(model, trainer, steps):
    losses, grads = [], None
    for i, batches in enumerate(steps):
        trainer.optimizer.zero_grad()
        metrics = trainer.forward_backward(batches)
        losses.append(metrics["loss"])
        if i == 0:
            grads = {n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).detach().clone()
                     for n, p in zip(trainer.optimizer.names, trainer.optimizer.params)}
        trainer.optimizer.step()
    return losses, grads


def _rel(a: torch.Tensor, b: torch.Tensor, floor: float) -> float:
    """Largest difference relative to the reference tensor's largest entry, or to `floor` (a thousandth of the
    largest gradient anywhere) for a gradient that is itself a near-cancelling sum (A_log, dt_bias)."""
    return float((a - b).abs().max() / max(float(b.abs().max()), floor))


def run_case(name: str, dp: int, ep: int, chunks: int, steps, reference) -> dict:
    from launch.model import build_model
    from launch.parallel import build_meshes, moe_layers, parallelize
    from launch.train import TrainConfig, Trainer
    from recipe.models import PRESETS

    shape = PRESETS["tiny-moe"]
    cfg = TrainConfig(lr=3e-3, objective="rl", weight_decay=0.01)
    plan = _plan(dp, ep, chunks)
    meshes = build_meshes(plan.layout, "cpu")
    model = parallelize(build_model(shape, seed=1), plan, meshes, param_dtype=torch.float32)
    trainer = Trainer(model, cfg, recompute="full", lm_head="fused", dp_rank=meshes.dp_rank, dp_size=meshes.dp_size,
                      dp_group=meshes.dp_group)
    loads, calls = [], [0]
    layers = moe_layers(model)
    for experts in layers:
        if experts.token_dispatch is not None:
            dispatch = experts.token_dispatch
            orig, orig_a2a = dispatch.route, dispatch.all_to_all

            def route(top_e, orig=orig):
                out = orig(top_e)
                loads.append(out.recv_RCEl.tolist())  # rows per (source rank, chunk, local expert) this rank received
                return out

            def all_to_all(*a, orig_a2a=orig_a2a, **kw):
                calls[0] += 1
                return orig_a2a(*a, **kw)
            dispatch.route, dispatch.all_to_all = route, all_to_all
    losses, grads = _run(model, trainer, steps)
    forwards = sum(-(-len(b) // dp) for b in steps)  # micro-batches this rank ran, padding included
    ref_losses, ref_grads = reference
    out = {"name": name, "loss_rel": [abs(a - b) / abs(b) for a, b in zip(losses, ref_losses)],
           "losses": losses, "ref_losses": ref_losses,
           "grad_rel": max(_rel(grads[n], ref_grads[n], 1e-3 * max(float(g.abs().max()) for g in ref_grads.values()))
                           for n in ref_grads),
           "zero_rows_for_an_expert": any(0 in per_expert for load in loads for src in load for per_expert in src),
           "num_micro_batches": [len(b) for b in steps],
           "all_to_alls_per_layer_chunk_micro_batch": calls[0] / (len(layers) * forwards * chunks) if ep > 1 else None,
           "grads": {n: g for n, g in grads.items()}}
    return out


def main(rank: int, world: int, port: int, cases: list, out_path: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=120))
    from launch.model import build_model
    from launch.train import TrainConfig, Trainer
    from recipe.models import PRESETS

    shape = PRESETS["tiny-moe"]
    steps = _steps_data(shape.vocab_size)
    ref_trainer = Trainer(build_model(shape, seed=1), TrainConfig(lr=3e-3, objective="rl", weight_decay=0.01),
                          recompute="full", lm_head="fused")
    reference = _run(ref_trainer.model, ref_trainer, steps)
    results = []
    for case in cases:
        r = run_case(*case, steps=steps, reference=reference)
        results.append(r)
    if rank == 0:
        by_name = {r["name"]: r for r in results}
        bitwise = {}
        for r in results:  # chunked EP against its one-chunk twin: bitwise
            if r["name"].endswith("_k1"):
                continue
            twin = r["name"].rsplit("_k", 1)[0] + "_k1"
            if twin in by_name:
                t = by_name[twin]
                bitwise[r["name"]] = (r["losses"] == t["losses"]
                                      and all(torch.equal(r["grads"][n], t["grads"][n]) for n in r["grads"]))
        for r in results:
            r.pop("grads")
            r["bitwise_equal_k1"] = bitwise.get(r["name"])
        with open(out_path, "w") as f:
            json.dump(results, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), json.loads(sys.argv[4]), sys.argv[5])
