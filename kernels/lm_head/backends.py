"""Which backend runs the head's kernels: Triton on CUDA tensors when triton is installed, torch elsewhere (or as
asked). Both modules, kernels/lm_head/triton_backend.py and kernels/lm_head/torch_backend.py, offer the same
functions: tile_vocab, logits_tiles, merge_tiles, target_logits, dlogits_from_tiles, dlogits_from_logits, dw_acc.
"""

from __future__ import annotations

import importlib.util
import os

import torch

BACKENDS = ("triton", "torch")
_HAS_TRITON = importlib.util.find_spec("triton") is not None


def backend_module(hidden: torch.Tensor, backend: str | None):
    """The backend module for these inputs: `backend` as asked ("triton" or "torch"), or None for triton on CUDA
    and torch elsewhere. The triton module is imported here, at first use, never at package import."""
    if backend is None:
        backend = "triton" if hidden.is_cuda and _HAS_TRITON else "torch"
    if backend not in BACKENDS:
        raise ValueError(f"backend must be 'triton', 'torch' or None, got {backend!r}")
    if backend == "torch":
        from kernels.lm_head import torch_backend

        return torch_backend
    if not hidden.is_cuda and os.environ.get("TRITON_INTERPRET", "0") != "1":
        raise ValueError("backend='triton' on CPU tensors needs TRITON_INTERPRET=1 set before triton is imported")
    from kernels.lm_head import triton_backend

    return triton_backend
