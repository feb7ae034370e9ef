"""The LM head's Triton kernels: under the interpreter on CPU (every check of tests/lm_head_interpreter.py, one
test each, from one subprocess), and on a GPU (marked `gpu`, skipped without one)."""

from __future__ import annotations

import pytest
import torch

import interpreter
import kernels
from lm_head_checks import REPO, check_cross_entropy, check_logprobs, check_policy_loss, inputs
from lm_head_interpreter import CHECKS


interpreter_results, test_triton_kernels_interpreter = interpreter.pytest_cases(
    REPO / "tests" / "lm_head_interpreter.py", CHECKS)


# ------------------------------------------------------------------------------------------ GPU (bf16)
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA/ROCm GPU")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("mode,reduction", [("fused", "mean"), ("fused", "none"), ("lean", "mean")])
@pytest.mark.parametrize("T,H,V", [(1000, 256, 5003), (4099, 512, 32771)])
def test_gpu_bf16_cross_entropy(T, H, V, mode, reduction):
    # bf16 operands, fp32 logits and accumulators: loss at fp32 accuracy; gradients limited by the fp16 dlogits
    # tile and the bf16 output rounding (the accuracy goal: dH 7e-3, dW 2e-3).
    up = dict(chunk_vocab=4096) if reduction == "none" else {}
    errs = check_cross_entropy(T, H, V, backend="triton", tol=1e-5, device="cuda", dtype=torch.bfloat16,
                               z_loss=1e-4, chunk_tokens=1024, grad_tol=2e-3, mode=mode, reduction=reduction, **up)
    print(errs)


@pytest.mark.gpu
@needs_cuda
def test_gpu_lean_holds_its_outputs_and_a_few_mib():
    # mode="lean": the peak above the inputs over forward + backward is dH + dW (the gradients autograd returns)
    # plus the tail buffer (0.2 MiB at H = 1024), [T] vectors and per-chunk statistics; the fused path holds an fp32
    # dW accumulator beside them
    from kernels.lm_head import lean, triton_backend

    T, H, V = 8192, 1024, 50257
    hidden, weight, target = inputs(T, H, V, device="cuda", dtype=torch.bfloat16)
    outputs = (T + V) * H * 2
    need_direct = lean._needs(H, 2, True, triton_backend.tile_vocab(hidden))[1]
    peaks = {}
    for mode in ("lean", "fused"):
        for _ in range(2):  # the first run warms up (compilation, cuBLAS workspaces)
            hidden.grad = weight.grad = None
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            kernels.linear_cross_entropy(hidden, weight, target, mode=mode).backward()
            torch.cuda.synchronize()
            peaks[mode] = torch.cuda.max_memory_allocated() - base
    print({k: f"{(v - outputs) / 2**20:.2f} MiB above the outputs" for k, v in peaks.items()})
    assert peaks["lean"] <= outputs + need_direct(*lean.tail_chunks(T, V)) + 2 * 2**20
    assert peaks["fused"] > outputs + V * H * 4  # (the comparison is meaningful: fp32 dW beside the outputs)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_logprobs_entropy(dtype):
    # logits of size ~90 (logit_scale 30): fp32 rounding of the logits shows in the entropy at ~2e-5
    grad_tol = 5e-5 if dtype == torch.float32 else 2e-3
    print(check_logprobs(3001, 256, 20011, backend="triton", tol=1e-4, device="cuda", dtype=dtype,
                         temperature=0.9, logit_scale=30.0, grad_tol=grad_tol))


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_policy_loss(dtype):
    # fp32: the entropy term's gradient is a cancellation (x - lse + ent at |x| ~ 30); its error is 4.6e-5 with p
    # from exp(x - lse) and 5.1e-5 with p = e exp(m - lse) from the tile weights (measured on the torch path, which
    # runs the same arithmetic, at this shape)
    grad_tol = 7e-5 if dtype == torch.float32 else 2e-3
    print(check_policy_loss(3001, 256, 20011, backend="triton", tol=1e-4, device="cuda", dtype=dtype,
                            temperature=0.9, logit_scale=30.0, grad_tol=grad_tol, adv_spread=100.0,
                            chunk_tokens=1024))
