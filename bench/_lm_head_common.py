"""What the LM-head bench scripts share: the shape arguments, the bench inputs, and loading an earlier copy of a
kernel module for an A/B in one process."""

from __future__ import annotations

import importlib.util
import math

import torch


def add_shape_args(ap) -> None:
    ap.add_argument("--tokens", type=int, default=65536)
    ap.add_argument("--vocab", type=int, default=248320)
    ap.add_argument("--hidden", type=int, default=2048)


def head_inputs(T: int, V: int, H: int, seed: int = 1, logit_std: float = 2.0, device: str = "cuda"):
    """bf16 hidden [T, H] ~ N(0, 1) and weight [V, H] giving logits of std logit_std, both requiring grad, and random
    targets [T] (none ignored)."""
    g = torch.Generator(device=device).manual_seed(seed)
    h = torch.randn(T, H, device=device, generator=g).bfloat16().requires_grad_()
    w = (torch.randn(V, H, device=device, generator=g) * (logit_std / math.sqrt(H))).bfloat16().requires_grad_()
    t = torch.randint(0, V, (T,), device=device, generator=g)
    return h, w, t


def load_module(path: str, name: str = "lm_head_baseline"):
    """A Python file loaded as a module of its own (an earlier kernels/lm_head_tiles_triton.py, say)."""
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
