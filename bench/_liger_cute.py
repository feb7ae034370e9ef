"""Liger's native CUTLASS + NVSHMEM fused linear cross-entropy (liger-cute-kernels, "LCK") as a bench peer.

`liger_cute_peers()` gives name → fn(h, w, t) → mean-CE loss (differentiable: backward fills h.grad and w.grad).

What runs: LCK 0.8.5's SM90 core (libliger_cute_kernels_sm90a.so, CUTLASS C++ built with CUDA 12.9, loaded through
TVM FFI) — the tensor-parallel "fused scaled linear cross entropy": one fused GEMM + online-softmax forward (per-token
NLL and LSE, logits never stored) and a fused dZ → dX + dW backward. It is the kernel behind Liger-Kernel 0.8.5's
`LigerFusedLinearScaledCrossEntropyTPFunction` on Hopper; here it runs with a 1-rank tensor-parallel group (the whole
vocabulary on this GPU, vocab_start 0, temperature 1, ignore_index -100, tiles_per_reduce 1), and this file's small
autograd wrapper makes the same native calls as that frontend (liger-kernel itself is not needed). The loss is the
mean of the per-token NLL over the targets that are not ignore_index.

Setup, once, inside `liger_cute_peers()`: a 1-rank gloo process group (file:// store, loopback) when
torch.distributed is not initialised; NVSHMEM environment defaults (NVLS/multicast off, no remote transport, no NCCL
inside NVSHMEM, bootstrap on `lo`, a 6 GiB symmetric heap); then `liger_cute_kernels.configure(flsce=...)` with
capacities max_tokens 65536, hidden 2048, local vocab 248320 (the arguments), which bootstraps a 1-PE NVSHMEM job and
reserves the FLSCE workspaces (about 2.6 GiB at those capacities, outside PyTorch's allocator, so the bench's
peak-memory figure does not include it). With NVLink multicast off, as it must stay on these hosts, LCK has no NVLS
team and takes its DirectPeer reduction backend; its NVLS-only clustered dX backward kernel should not run.

How it travels (no network on the GPU machine): `.whl_lck/lck.tar.xz` (~31 MB, xz -9), unpacked to a folder DIR
that goes on PYTHONPATH (or is named by LCK_DIR; /tmp/lck is tried last). It holds the pure-Python package
`liger_cute_kernels` with only the SM90 core from the 0.8.5 wheel (not the SM100 core, not the 209 MB MoE cubin,
which only MoE setup loads), beside it libnvshmem_host.so.3 and nvshmem_bootstrap_uid.so.3 from
nvidia-nvshmem-cu12 3.6.5 (found first there by LCK's loader) and libcudart.so.12 from nvidia-cuda-runtime-cu12
12.9.79 (the core's NEEDED; a cu130 torch has only libcudart.so.13), which this file preloads by path, so no
LD_LIBRARY_PATH is needed. apache-tvm-ffi (0.1.15 in `.whl/`) must be importable too.

Empty, with a printed one-line reason, where it does not import or set up (no CUDA, not SM90, a multi-rank job, a
native failure)."""

from __future__ import annotations

import atexit
import ctypes
import os
import sys
import tempfile

import torch

_DONE: dict | None = None  # what the first call returned (setup is once per process)
_STATE: dict = {}

# Set before NVSHMEM starts (it reads them in nvshmem init). NVSHMEM_DISABLE_NVLS is forced: NVLink multicast must stay
# off on the shared GPU hosts; the rest are defaults a caller may override.
_NVSHMEM_FORCED = {"NVSHMEM_DISABLE_NVLS": "1"}
_NVSHMEM_DEFAULTS = {
    "NVSHMEM_REMOTE_TRANSPORT": "none",  # one GPU: no IB/UCX/libfabric plugin
    "NVSHMEM_DISABLE_NCCL": "1",  # NVSHMEM would dlopen a CUDA 13 libnccl for its collectives; not needed
    "NVSHMEM_DISABLE_MNNVL": "1",
    "NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME": "lo",  # the unique-id bootstrap's socket; 1 PE, loopback is enough
    "NVSHMEM_SYMMETRIC_SIZE": str(6 << 30),  # FLSCE backward: ~2.6 GiB (symmetric + private) at 64k x 2k x 248k
    "GLOO_SOCKET_IFNAME": "lo",
}


def _import_lck():
    try:
        import liger_cute_kernels  # noqa: F401
    except ImportError:
        for d in (os.environ.get("LCK_DIR"), "/tmp/lck"):
            if d and os.path.isdir(os.path.join(d, "liger_cute_kernels")) and d not in sys.path:
                sys.path.append(d)
                break
        import liger_cute_kernels  # noqa: F401
    from liger_cute_kernels import nvshmem, tvm_ffi  # noqa: F401

    return liger_cute_kernels


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("liger-cute-kernels")
    except Exception:
        return "?"


def _setup(max_tokens: int, hidden: int, max_vocab: int) -> None:
    import torch.distributed as dist

    lck = _import_lck()
    from liger_cute_kernels import tvm_ffi as lck_tvm

    pkg = os.path.dirname(lck.__file__)
    for k, v in _NVSHMEM_FORCED.items():
        os.environ[k] = v
    for k, v in _NVSHMEM_DEFAULTS.items():
        os.environ.setdefault(k, v)
    cudart = os.path.join(pkg, "libcudart.so.12")
    if os.path.isfile(cudart):  # matched by soname when the core is loaded; RTLD_LOCAL keeps it off the global scope
        ctypes.CDLL(cudart, mode=os.RTLD_LAZY | os.RTLD_LOCAL)
    own_pg = not dist.is_initialized()
    if own_pg:
        store = os.path.join(tempfile.mkdtemp(prefix="lck_pg_"), "store")
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    elif dist.get_world_size() != 1:
        raise RuntimeError(f"torch.distributed already has {dist.get_world_size()} ranks; this peer runs on one GPU")
    dev = torch.device("cuda", torch.cuda.current_device())
    lck.configure(device=dev, flsce=lck.FusedLinearCrossEntropyConfig(
        max_tokens=max_tokens, hidden_size=hidden, local_vocab_size=max_vocab))
    from liger_cute_kernels import nvshmem

    _STATE.update(tvm=lck_tvm, team=nvshmem.resolve_team(dist.group.WORLD, create=False),
                  cap=(max_tokens, (hidden + 7) // 8 * 8, max_vocab))
    atexit.register(_teardown, own_pg)


def _teardown(own_pg: bool) -> None:
    """LCK's documented order: all work finished, NVSHMEM finalized, then the process group destroyed."""
    try:
        import torch.distributed as dist
        from liger_cute_kernels import nvshmem

        torch.cuda.synchronize()
        nvshmem.finalize()
        if own_pg and dist.is_initialized():
            dist.destroy_process_group()
    except Exception:
        pass


class _LigerCuteCE(torch.autograd.Function):
    """Per-token NLL [T] (fp32) of logits h @ w.T through LCK's native TP forward/backward with a 1-rank team."""

    @staticmethod
    def forward(ctx, h, w, t):
        tvm, team = _STATE["tvm"], _STATE["team"]
        T, H = h.shape
        V = w.shape[0]
        Hp = (H + 7) // 8 * 8
        cap = _STATE["cap"]
        if T > cap[0] or Hp > cap[1] or V > cap[2]:
            raise ValueError(f"liger-cute: T={T}, H={H}, V={V} exceed the configured capacity {cap}")
        x, wt = h.contiguous(), w.contiguous()
        if Hp != H:  # the frontend's TMA alignment padding (zero columns change nothing)
            x, wt = torch.nn.functional.pad(x, (0, Hp - H)), torch.nn.functional.pad(wt, (0, Hp - H))
        t64 = t.to(torch.int64).contiguous()
        with torch.cuda.device(x.device):
            # what Liger's frontend does on every call: checks against the reserved capacity, no new allocation
            tvm.fused_linear_scaled_cross_entropy_configure_backward(T, Hp, V, 1, team)
            tvm.fused_linear_scaled_cross_entropy_configure_forward(T, V, team)
            nll, lse, ent = tvm.fused_linear_scaled_cross_entropy_forward(x, wt, t64, 0, -100, 1.0, team, False)
        ctx.save_for_backward(x, wt, t64, lse, ent)
        ctx.H = H
        return nll

    @staticmethod
    def backward(ctx, g):
        x, wt, t64, lse, ent = ctx.saved_tensors
        g = g.detach().to(torch.float32).contiguous()
        zeros = torch.zeros_like(g)  # entropy gradient (no entropy output)
        with torch.cuda.device(x.device):
            dx, dw = _STATE["tvm"].fused_linear_scaled_cross_entropy_backward(
                g, zeros, x, wt, t64, lse, ent, 0, -100, 1.0, _STATE["team"], 1, False)
        if ctx.H != x.shape[1]:
            dx, dw = dx[:, :ctx.H].contiguous(), dw[:, :ctx.H].contiguous()
        return dx, dw, None


def liger_cute_ce(h, w, t, ignore_index: int = -100):
    """Mean CE over the targets that are not ignore_index (-100, as the native kernel zeroes those rows)."""
    nll = _LigerCuteCE.apply(h, w, t)
    return nll.sum() / (t != ignore_index).sum().clamp_min(1)


def liger_cute_peers(max_tokens: int = 65536, hidden: int = 2048, max_vocab: int = 248320) -> dict:
    """name → fn(h, w, t) → mean-CE loss; empty with a printed reason where LCK does not import or set up. The
    capacities are reserved once (the first call's), so pass the largest T, H and V the run will use."""
    global _DONE
    if _DONE is not None:
        return dict(_DONE)
    try:
        _import_lck()
    except Exception as e:  # ImportError, or tvm_ffi missing
        print(f"liger-cute-kernels not importable: {type(e).__name__}: {str(e)[:160]}", flush=True)
        return {}
    if not torch.cuda.is_available():
        print("liger-cute-kernels: no CUDA device (its native core needs an SM90 GPU)", flush=True)
        return {}
    cap = torch.cuda.get_device_capability()
    if cap != (9, 0):
        print(f"liger-cute-kernels: SM{cap[0]}{cap[1]}; only its SM90 core travels here", flush=True)
        return {}
    try:
        _setup(max_tokens, hidden, max_vocab)
    except Exception as e:
        print(f"liger-cute-kernels setup failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
        return {}
    _DONE = {f"liger-cute {_version()}": liger_cute_ce}
    return dict(_DONE)


if __name__ == "__main__":  # smoke test on the GPU machine: python bench/_liger_cute.py [T V H]
    T, V, H = (int(a) for a in (sys.argv[1:4] if len(sys.argv) >= 4 else (4096, 32768, 2048)))
    peers = liger_cute_peers(max_tokens=max(T, 65536), hidden=max(H, 2048), max_vocab=max(V, 248320))
    if not peers:
        raise SystemExit(1)
    (name, fn), = peers.items()
    g = torch.Generator(device="cuda").manual_seed(0)
    h = torch.randn(T, H, device="cuda", generator=g).bfloat16().requires_grad_()
    w = (torch.randn(V, H, device="cuda", generator=g) * (2.0 / H ** 0.5)).bfloat16().requires_grad_()
    t = torch.randint(0, V, (T,), device="cuda", generator=g)
    loss = fn(h, w, t)
    loss.backward()
    hf, wf = h.detach().float().requires_grad_(), w.detach().float().requires_grad_()
    ref = torch.nn.functional.cross_entropy(hf @ wf.T, t)
    ref.backward()

    def rel(a, b):
        return ((a.float() - b).norm() / b.norm()).item()

    print(f"{name}: T={T} V={V} H={H} loss {loss.item():.6f} ref {ref.item():.6f} "
          f"rel err dH {rel(h.grad, hf.grad):.2e} dW {rel(w.grad, wf.grad):.2e}", flush=True)
    for _ in range(2):
        h.grad = w.grad = None
        fn(h, w, t).backward()
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(5):
        h.grad = w.grad = None
        fn(h, w, t).backward()
    e.record()
    torch.cuda.synchronize()
    ms = s.elapsed_time(e) / 5
    print(f"{name}: fwd+bwd {ms:.2f} ms, {6 * T * V * H / ms / 1e9:.0f} TF/s", flush=True)
