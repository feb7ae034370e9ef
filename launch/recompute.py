"""Activation recompute, applied from outside the model (as torchtitan does): each decoder layer is wrapped in a
non-reentrant `torch.utils.checkpoint`, so between layers only each layer's input is kept and the layer's forward
runs again inside its backward. Parameter names are unchanged (the wrapper's state-dict hooks drop its prefix), so
checkpoints and the optimizer see the same keys with recompute on or off. Partial recompute (the plan's
`train.keep_layers`) leaves the last layers of each stage unwrapped: they keep what their forward saved, and their
backward, the first to run, frees it before any recomputed layer's backward needs its working set
(docs/cost_model.md, "Partial recompute").

Under `parallelize()` this runs after TP/CP/EP and before FSDP2 (launch/parallel.py): the wrapper must sit inside the FSDP
unit so the recomputed forward re-gathers parameters through FSDP's own hooks.
"""

from __future__ import annotations

import torch.nn as nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper

RECOMPUTE_MODES = ("full", "none")


def apply_recompute(model: nn.Module, mode: str, keep_layers: int = 0, keep_selections: bool = False) -> nn.Module:
    """`full`: checkpoint every decoder layer but the last `keep_layers` of each pipeline stage (of the model without
    a pipeline), which keep their activations (partial recompute); `none`: leave the model as is. Idempotent.
    `keep_selections` (DeepSeek sparse attention, under `full`): each checkpointed layer's indexer runs in its
    forward only, its selection kept on the micro-batch's packing for the recomputed forward (launch/model.py,
    MLAttention.keeps_for_recompute).

    A pipeline rank's StageGroup (launch/pipeline.py) is taken stage by stage, so with v stages a rank each keeps
    its own last layers."""
    if mode not in RECOMPUTE_MODES:
        raise ValueError(f"recompute must be one of {RECOMPUTE_MODES}, got {mode!r}")
    if isinstance(keep_layers, bool) or not isinstance(keep_layers, int) or keep_layers < 0:
        raise ValueError(f"keep_layers must be a non-negative integer, got {keep_layers!r}")
    if keep_layers and mode != "full":
        raise ValueError(f"keep_layers = {keep_layers} needs recompute 'full'")
    if keep_selections and mode != "full":
        raise ValueError("keep_selections needs recompute 'full'")
    if mode == "none":
        return model
    stages = getattr(model, "stages", None)
    for unit in (stages if stages else [model]):
        # a pipeline stage holds its layers by their global index (launch/pipeline.py: a ModuleDict)
        layers = list(unit.layers.items() if isinstance(unit.layers, nn.ModuleDict) else enumerate(unit.layers))
        for i, layer in layers[:max(0, len(layers) - keep_layers)]:
            if not is_checkpointed(layer):
                # preserve_rng_state=False: the layers draw no random numbers (no dropout), and saving RNG state
                # costs a device sync per layer
                unit.layers[i] = checkpoint_wrapper(layer, checkpoint_impl=CheckpointImpl.NO_REENTRANT,
                                                    preserve_rng_state=False)
            for mod in unit.layers[i].modules():
                if getattr(mod, "indexer", None) is not None:
                    mod.keeps_for_recompute = keep_selections
    if stages:
        model.sync()  # the group's view of its stages' layers
    return model


def is_checkpointed(layer: nn.Module) -> bool:
    return hasattr(layer, "_checkpoint_wrapped_module")
