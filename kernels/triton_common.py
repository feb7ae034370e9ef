"""Triton helpers shared by the LM-head kernel modules: the vendor the kernels are built for, the K-loop MMA step,
and launch facts. Imported lazily (never at package import), so the CPU path needs no triton."""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl


def _vendor() -> tuple[str, int]:
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        return "interpreter", 0
    if torch.version.hip is not None:
        return "amd", 9
    if torch.cuda.is_available():
        return "nvidia", torch.cuda.get_device_capability()[0]
    return "nvidia", 9


_VENDOR, _ARCH = _vendor()


def _even_k(args) -> bool:
    return args["H"] % args["BLOCK_K"] == 0


@triton.jit
def _mma_step(h_rows, w_rows, kk, H, acc, DOT_FP32: tl.constexpr, EVEN_K: tl.constexpr):
    """acc += h[rows, kk] @ w[rows_v, kk]^T, fp32 accumulation."""
    if EVEN_K:
        a = tl.load(h_rows + kk[None, :])
        b = tl.load(w_rows + kk[None, :])
    else:
        a = tl.load(h_rows + kk[None, :], mask=kk[None, :] < H, other=0.0)
        b = tl.load(w_rows + kk[None, :], mask=kk[None, :] < H, other=0.0)
    if DOT_FP32:
        return tl.dot(a.to(tl.float32), tl.trans(b.to(tl.float32)), acc, input_precision="ieee")
    return tl.dot(a, tl.trans(b), acc)


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


def _dot_fp32(t: torch.Tensor) -> bool:
    # fp32 inputs take the exact (ieee) fp32 dot; under the interpreter every dot runs in fp32 (bf16 operands to
    # tl.dot give wrong results there).
    return t.dtype == torch.float32 or _VENDOR == "interpreter"


@triton.jit
def _token_rows(pid_t, T, BLOCK_T: tl.constexpr):
    """Token block pid_t: its row indices (int64, so T x stride never overflows), which are < T, and the indices
    clamped to T - 1 (clamped rows load without a mask; their results are never stored)."""
    offs_t = pid_t.to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    return offs_t, offs_t < T, tl.minimum(offs_t, T - 1)


@triton.jit
def _logits_tile(h_ptr, w_ptr, rows, offs_v, V, H, stride_h, stride_w, DOT_FP32: tl.constexpr,
                 EVEN_K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr):
    """The [BLOCK_T, BLOCK_V] tile h[rows] @ w[offs_v]^T in fp32 over the whole hidden size, by pointer loads
    (vocab rows past V are clamped to V - 1 and must be masked by the caller)."""
    h_rows = h_ptr + rows[:, None] * stride_h
    w_rows = w_ptr + tl.minimum(offs_v, V - 1).to(tl.int64)[:, None] * stride_w
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_T, BLOCK_V], tl.float32)
    for k0 in range(0, H, BLOCK_K):
        acc = _mma_step(h_rows, w_rows, k0 + offs_k, H, acc, DOT_FP32, EVEN_K)
    return acc
