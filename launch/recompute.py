"""Activation recompute, applied from outside the model (as torchtitan does): each decoder layer is wrapped in a
non-reentrant `torch.utils.checkpoint`, so between layers only each layer's input is kept and the layer's forward
runs again inside its backward. Parameter names are unchanged (the wrapper's state-dict hooks drop its prefix), so
checkpoints and the optimizer see the same keys with recompute on or off.

Under `parallelize()` this runs after TP/CP/EP and before FSDP2 (launch/parallel.py): the wrapper must sit inside the FSDP
unit so the recomputed forward re-gathers parameters through FSDP's own hooks.
"""

from __future__ import annotations

import torch.nn as nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper

from launch.model import Transformer

RECOMPUTE_MODES = ("full", "none")


def apply_recompute(model: Transformer, mode: str) -> Transformer:
    """`full`: checkpoint every decoder layer; `none`: leave the model as is. Idempotent."""
    if mode not in RECOMPUTE_MODES:
        raise ValueError(f"recompute must be one of {RECOMPUTE_MODES}, got {mode!r}")
    if mode == "none":
        return model
    # a pipeline stage holds its layers by their global index (launch/pipeline.py: a ModuleDict)
    layers = model.layers.items() if isinstance(model.layers, nn.ModuleDict) else enumerate(model.layers)
    for i, layer in list(layers):
        if not is_checkpointed(layer):
            # preserve_rng_state=False: the layers draw no random numbers (no dropout), and saving RNG state costs a
            # device sync per layer
            model.layers[i] = checkpoint_wrapper(layer, checkpoint_impl=CheckpointImpl.NO_REENTRANT,
                                                 preserve_rng_state=False)
    return model


def is_checkpointed(layer: nn.Module) -> bool:
    return hasattr(layer, "_checkpoint_wrapped_module")
