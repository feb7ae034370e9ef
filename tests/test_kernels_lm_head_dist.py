"""The LM head vocabulary-parallel over two gloo processes (each rank V / 2 rows of the weight: statistics and dH
combined over the group; the fused, autograd and lean paths), and under FSDP2 (the weight a sharded parameter),
against the float64 reference of the whole head. One spawn of two processes."""

from __future__ import annotations

import os

import pytest
import torch

import kernels
from kernels.lm_head.reference import linear_cross_entropy_reference, linear_logprobs_reference
from lm_head_checks import assert_cap_matters, inputs, ref_grads, rel


def _dist_worker(rank: int, world: int, port: int) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        # Vocab-parallel: each rank holds V/2 rows; stats and dH combine over the group.
        hidden, weight, target = inputs(33, 40, 2 * 151, seed=1234)  # same inputs on both ranks
        target[:4] = -100
        up_lp, up_ent = torch.randn(33, generator=torch.Generator().manual_seed(7)), torch.randn(33)
        dist.broadcast(up_ent, src=0)
        V_local = weight.shape[0] // world
        w_local = weight.detach()[rank * V_local:(rank + 1) * V_local].clone().requires_grad_()
        # softcap: each rank caps its own rows' logits before the temperature (fused and autograd paths)
        capped = (dict(softcap=3.0, temperature=0.9), dict(softcap=3.0, reduction="none"))
        for kw in (dict(z_loss=1e-3, temperature=0.9), dict(reduction="none")) + capped:
            loss = kernels.linear_cross_entropy(hidden, w_local, target, tp_group=dist.group.WORLD, **kw)
            up = [up_lp] if kw.get("reduction") == "none" else None
            hidden.grad = None
            torch.autograd.backward([loss], up or [torch.ones_like(loss)])
            ref, rdh, rdw = ref_grads(linear_cross_entropy_reference, hidden, weight, target, upstream=up, **kw)
            rdw_local = rdw[rank * V_local:(rank + 1) * V_local]
            errs = (rel(loss, ref), rel(hidden.grad, rdh), rel(w_local.grad, rdw_local))
            assert max(errs) < 1e-5, f"TP CE rank {rank} {kw}: {errs}"
            assert_cap_matters(linear_cross_entropy_reference, hidden, weight, target, limits={"all": 1e-5},
                               upstream=up, **kw)  # (a no-op without softcap)
            w_local.grad = None
        lp, ent = kernels.linear_logprobs(hidden, w_local, target, with_entropy=True, temperature=1.2,
                                          tp_group=dist.group.WORLD)
        hidden.grad = None
        torch.autograd.backward([lp, ent], [up_lp, up_ent])
        ref, rdh, rdw = ref_grads(linear_logprobs_reference, hidden, weight, target, upstream=[up_lp, up_ent],
                                   with_entropy=True, temperature=1.2)
        errs = (rel(lp, ref[0]), rel(ent, ref[1]), rel(hidden.grad, rdh),
                rel(w_local.grad, rdw[rank * V_local:(rank + 1) * V_local]))
        assert max(errs) < 1e-5, f"TP logprobs rank {rank}: {errs}"
        # the policy loss in the head, vocab-parallel, fused and lean: same numbers on both ranks, each its own dW
        # rows (the lean head's first pass combines each group's statistics and sums dH over the group)
        for mode in ("fused", "lean"):
            hidden.grad = w_local.grad = None
            loss, lp2, ent2 = kernels.linear_policy_loss(
                hidden, w_local, target, lambda lp, en, a, b: lp * up_lp[a:b] + en * up_ent[a:b], with_entropy=True,
                temperature=1.2, tp_group=dist.group.WORLD, chunk_tokens=8, mode=mode)
            loss.backward()
            errs = (rel(lp2, ref[0]), rel(ent2, ref[1]), rel(hidden.grad, rdh),
                    rel(w_local.grad, rdw[rank * V_local:(rank + 1) * V_local]))
            assert max(errs) < 1e-5, f"TP {mode} policy loss rank {rank}: {errs}"

        # FSDP2: the head's weight is a sharded DTensor parameter; inside forward FSDP hands the kernel the
        # gathered plain tensor (no .full_tensor()), and the reduce-scatter of its gradient is FSDP's.
        class Head(torch.nn.Module):
            def __init__(self, w):
                super().__init__()
                self.weight = torch.nn.Parameter(w.detach().clone())

            def forward(self, h, t):
                return kernels.linear_cross_entropy(h, self.weight, t)

        head = Head(weight)
        fully_shard(head, mesh=init_device_mesh("cpu", (world,)))
        h_r, t_r = hidden.detach()[rank::world], target[rank::world]  # each rank its own tokens
        head(h_r, t_r).backward()
        full_grad = head.weight.grad.full_tensor()
        ref_grad = torch.zeros_like(weight, dtype=torch.float64)
        for r in range(world):
            _, _, g = ref_grads(linear_cross_entropy_reference, hidden[r::world], weight, target[r::world])
            ref_grad += g / world  # FSDP2 averages gradients over the data-parallel group
        assert rel(full_grad, ref_grad) < 1e-5, f"FSDP2 rank {rank}: {rel(full_grad, ref_grad)}"
        dist.barrier()  # neither rank tears gloo's pairs down while the other still uses them
    finally:
        dist.destroy_process_group()


@pytest.mark.dist
@pytest.mark.slow
def test_vocab_parallel_tp2_and_fsdp2_gloo():
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_dist_worker, args=(2, port), nprocs=2, join=True)
