"""What the LM-head bench scripts share: the shape arguments, the bench inputs, and loading an earlier copy of a
kernel module for an A/B in one process."""

from __future__ import annotations

import dataclasses
import datetime
import importlib.util
import math
import statistics
import subprocess
import time

import torch

SMI_QUERY = "timestamp,power.draw,clocks.sm,clocks_event_reasons.active"
REASONS = "# reasons: 0x4 = the software power cap (nvidia-smi -q -d PERFORMANCE names each bit)"


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


@dataclasses.dataclass
class Sustained:
    """One method's sustained run: mean ms a call, and nvidia-smi's samples (unix time, W, SM MHz, reasons)
    taken while it ran (its first 0.5 s skipped)."""
    name: str
    ms: float
    samples: list

    def power_cells(self) -> str:
        """'power W (median, max) | SM MHz (median) | clock-event reasons' as table cells."""
        if not self.samples:
            return "(no samples) | |"
        p = [s[1] for s in self.samples]
        return (f"{statistics.median(p):.0f}, {max(p):.0f} | {statistics.median(s[2] for s in self.samples):.0f} | "
                f"{' '.join(sorted(set(s[3] for s in self.samples)))}")


def sustained(methods: dict, order: list, seconds: float) -> list[Sustained]:
    """Run methods[name]() back to back for `seconds` each, in `order` (names may repeat: interleaved rounds), a
    second's rest between, while nvidia-smi samples power, SM clock and clock-event reasons every 50 ms."""
    smi = subprocess.Popen(["nvidia-smi", f"--query-gpu={SMI_QUERY}", "--format=csv,noheader,nounits", "-lms", "50"],
                           stdout=subprocess.PIPE, text=True)
    marks = []
    for name in order:
        fn = methods[name]
        fn()
        torch.cuda.synchronize()
        t0, n = time.time(), 0
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        while time.time() - t0 < seconds:
            fn()
            n += 1
        end.record()
        torch.cuda.synchronize()
        marks.append((name, t0 + 0.5, time.time(), start.elapsed_time(end) / n))
        time.sleep(1.0)
    smi.terminate()
    samples = []
    for line in smi.communicate()[0].strip().splitlines():
        ts, p, c, r = (x.strip() for x in line.split(","))
        # nvidia-smi prints local wall time, as naive datetime.timestamp() reads it
        samples.append((datetime.datetime.strptime(ts, "%Y/%m/%d %H:%M:%S.%f").timestamp(), float(p), float(c), r))
    return [Sustained(name, ms, [s for s in samples if a0 <= s[0] <= a1]) for name, a0, a1, ms in marks]


def load_module(path: str, name: str = "lm_head_baseline"):
    """A Python file loaded as a module of its own (an earlier kernels/lm_head_tiles_triton.py, say)."""
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def quack_peers() -> dict:
    """QuACK's linear cross-entropy (quack-kernels, CuTe-DSL; SM90/SM100), mean CE: name → fn(h, w, t) → loss.
    `scaled-exp` is its default on SM90 with bf16 (GEMM epilogues that fuse the softmax statistics), `base` its
    chunked pipeline. Empty, with a printed reason, where it does not import.

    quack-kernels 0.6.5 wants nvidia-cutlass-dsl 4.7.x (4.8 breaks it) and apache-tvm-ffi, torch-c-dlpack-ext and
    einops. On a machine without a network they travel as files: the small packages unpacked on PYTHONPATH, and
    nvidia-cutlass-dsl with its libs-base and libs-cu13 4.7.1 wheels merged into one `nvidia_cutlass_dsl/` tree
    (without `cu13/lib/stubs`), `xz -9`-compressed (60 MB), unpacked there to a folder DIR; then PYTHONPATH takes
    DIR and DIR/nvidia_cutlass_dsl/dsl_packages (what the wheel's .pth file would add). nvidia-cutlass-dsl 4.7.1
    also needs nvidia-cutlass-dsl-libs-core 4.7.1 (the DSL's Python: `cutlass.cute`, `cutlass.cutlass_dsl`),
    cuda-python with cuda-bindings, cuda-pathfinder and nvidia-cuda-nvdisasm: their wheels unzip into the same DIR.

    quack 0.6.5 keys its compiled epilogues by a fingerprint of every value the epilogue function reaches, and
    refuses a value it cannot fingerprint; with nvidia-cutlass-dsl 4.7.1 that value is the DSL's module logger, so
    the import fails ("epilogue fn depends on <Logger CUTE_DSL …>"). A logger does not change the traced math, so
    loggers get a fingerprint of their name (quack's documented `__quack_semantic_key__` hook) before the import."""
    import logging

    if not hasattr(logging.Logger, "__quack_semantic_key__"):
        logging.Logger.__quack_semantic_key__ = lambda self: ("logging.Logger", self.name)
    try:
        import quack
        from quack.linear_cross_entropy import chunked_linear_cross_entropy
    except Exception as e:  # ImportError, or the DSL failing to load its libraries
        print(f"quack-kernels not importable: {type(e).__name__}: {str(e)[:160]}", flush=True)
        return {}
    version = getattr(quack, "__version__", "?")
    return {f"quack {version} scaled-exp": lambda h, w, t: chunked_linear_cross_entropy(h, w, t),
            f"quack {version} base": lambda h, w, t: chunked_linear_cross_entropy(h, w, t, use_scaled_exp=False)}


def liger_cutedsl_peers() -> dict:
    """Liger-Kernel 0.8.5's CuTe-DSL Hopper kernels (`liger_kernel.ops.cutedsl`, opt-in there through
    LIGER_KERNEL_IMPL=cutedsl): name → {mode: fn(h, w, t, adv)}. Empty, with a printed reason, where they do not
    import (they need `cutlass.cute`, nvidia-cutlass-dsl ≥ 4.6: the same tree QuACK travels with).

    - `flce-sm90`: logits GEMM writing bf16 logits [T, V] once, a CE kernel turning them into dZ in place, dX in the
      forward and dW in the backward (T a multiple of 128, V of 256; mean CE only).
    - `scaled-ce`: one fused GEMM + online softmax (logits never stored) returning the per-token NLL, and a fused
      backward taking the per-token upstream gradient: mean CE, the RL loss and log-probs."""
    try:
        from liger_kernel.ops.cutedsl.ops.fused_linear_cross_entropy_sm90 import liger_fused_linear_cross_entropy_sm90
        from liger_kernel.ops.cutedsl.ops.fused_scaled_cross_entropy_sm90 import (
            LigerFusedScaledCrossEntropySM90Function as Scaled)
    except Exception as e:  # ImportError, or the DSL failing to load its libraries
        print(f"liger-kernel CuTe DSL not importable: {type(e).__name__}: {str(e)[:160]}", flush=True)
        return {}

    def nll(h, w, t):
        return Scaled.apply(h, w, t.long())

    def scaled_rl(h, w, t, adv):
        lp = -nll(h, w, t)
        return lp, (lp * adv).sum()

    return {"liger 0.8.5 cutedsl flce-sm90": {"ce": lambda h, w, t, adv: liger_fused_linear_cross_entropy_sm90(
                h, w, t.long())},
            "liger 0.8.5 cutedsl scaled-ce": {"ce": lambda h, w, t, adv: nll(h, w, t).mean(), "rl": scaled_rl,
                                              "fwd": lambda h, w, t, adv: -nll(h, w, t)}}
