"""One process as a world of one rank, for the benches that run the distributed code paths on one GPU (FSDP2 and
the expert-parallel dispatch at world size 1): its process group, its layout and meshes, and a plan for
`launch.parallel.parallelize`."""

from __future__ import annotations

import os
import types


def world_of_one(device_type: str, port: int):
    """Start a one-rank process group (env:// on 127.0.0.1:`port`) and return (layout, meshes) of world size 1."""
    import torch

    from launch.parallel import build_meshes, init_distributed

    for k, v in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(port)), ("RANK", "0"), ("WORLD_SIZE", "1")):
        os.environ.setdefault(k, v)
    if device_type == "cuda":
        torch.cuda.set_device(0)
    init_distributed(device_type)
    one = types.SimpleNamespace(pp=1, tp=1, cp=1, ep=1, dp=1, etp=1, edp=1, world=1)
    return one, build_meshes(one, device_type)


def plan_of_one(layout, recompute: str = "full", keep_layers: int = 0):
    """What `parallelize` reads of a plan: the layout, the recompute setting, one EP chunk."""
    return types.SimpleNamespace(layout=layout, train=types.SimpleNamespace(recompute=recompute,
                                                                            keep_layers=keep_layers,
                                                                            ep_overlap_chunks=1))
