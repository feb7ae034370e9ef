"""Context parallel's Gated DeltaNet state combine, simulated on one device: every cp rank's shard of one packed
micro-batch computed in this process (no process group: the all-gather of the segment maps is a stack), checked
against the whole sequence, and one rank's cost timed against the plain delta rule on the same local tokens.

Per rank and layer the combine runs (docs/context_parallel.md): one delta-rule pass over its two segments with
values [v | 0] from [0 | I] (value width V + K: outputs and outgoing states as affine functions of the incoming
states), the fold of all 2·cp maps, and the outputs completed with the true incoming states (O_0 + Q_eff S_in) —
where one process runs one pass at width V over its tokens. This script measures that ratio, forward + backward, at
cp = 2/4/8 equivalents (the local length fixed, the micro-batch cp times longer), beside the cost model's charge for
the same layer's compute (docs/cost_model.md, CP; the collectives are not simulated).

    python bench/bench_cp_gdn.py --local 32768 --cps 2,4,8            # H200: exactness + timing table
    python bench/bench_cp_gdn.py --local 32768 --cps 2,4,8 --time-only --breakdown   # timing, and where it goes
    python bench/bench_cp_gdn.py --device cpu --local 256 --cps 2,4 --check-only   # CPU smoke (torch path)

flash-linear-attention autotunes its kernels afresh for the combine's value width V + K = 256, which can take
longer than one device call allows. With TRITON_CACHE_AUTOTUNING=1 Triton keeps the tuning on disk, so a first call
with --warm-only (one forward + backward at the timing shape, every path) leaves the second call only the timing:

    TRITON_CACHE_AUTOTUNING=1 python bench/bench_cp_gdn.py --local 32768 --warm-only
    TRITON_CACHE_AUTOTUNING=1 python bench/bench_cp_gdn.py --local 32768 --cps 2,4,8

The tuning lives in TRITON_CACHE_DIR (~/.triton/cache by default); a copy of that folder from an earlier run with the
same Triton, fla and GPU skips it. The fp32 exactness check tunes its own kernels (fp32 operands): --time-only skips
it, --check-only runs it alone.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from launch.context_parallel import (delta_rule_on_one_device, local_segment_pass, segment_owner,  # noqa: E402
                                     shard_batch)
from launch.data import Batch  # noqa: E402
from launch.gated_delta import (chunk_gated_delta_rule_fla, chunk_gated_delta_rule_torch, fla_status,  # noqa: E402
                                fold_state_maps, with_incoming_states)
from launch.model import Packing  # noqa: E402

CHUNK = 64


def inputs(T: int, G: int, H: int, K: int, V: int, device, dtype, seed: int = 0):
    gen = torch.Generator(device="cpu").manual_seed(seed)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(device=device, dtype=dtype)

    q, k, v = rnd(T, G, K), rnd(T, G, K), rnd(T, H, V)
    g = -F.softplus(rnd(T, H).float() + 2.0) * 0.2  # log decay ≤ 0, typical magnitudes
    beta = torch.sigmoid(rnd(T, H)).to(dtype)
    return [x.requires_grad_() for x in (q, k, v, g, beta)]


def whole(xs, doc_lengths, path: str):
    q, k, v, g, beta = xs
    packing = Packing.from_lengths(doc_lengths, q.device)
    if path == "fla":
        return chunk_gated_delta_rule_fla(q, k, v, g, beta, packing.cu_seqlens, CHUNK)
    return chunk_gated_delta_rule_torch(q, k, v, g, beta, packing.positions, CHUNK)


def _shards(T: int, doc_lengths, cp: int, device):
    ids = torch.zeros(T, dtype=torch.long, device=device)
    batch = Batch(ids, ids, Packing.from_lengths(doc_lengths, device), ids.bool(), ids.float(), ids)
    return [shard_batch(batch, r, cp, CHUNK).packing for r in range(cp)]


def rel(a, b) -> float:
    return float((a.detach().float() - b.detach().float()).norm() / b.float().norm().clamp_min(1e-30))


def check(T: int, doc_lengths, cp: int, path: str, device, dtype, dims) -> dict:
    xs = inputs(T, *dims, device, dtype)
    w = torch.randn(T, dims[1], dims[3], device=device, dtype=torch.float32)
    ref = whole(xs, doc_lengths, path)
    g_ref = torch.autograd.grad((ref.float() * w).sum(), xs)
    got = delta_rule_on_one_device(xs, doc_lengths, cp, CHUNK, backend=path)
    g_got = torch.autograd.grad((got.float() * w).sum(), xs)
    return {"path": path, "cp": cp, "tokens": T, "docs": len(doc_lengths), "out_rel": rel(got, ref),
            "grad_rel": max(rel(a, b) for a, b in zip(g_got, g_ref))}


def _time(fn, device, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _rank_inputs(local: int, cp: int, device, dtype, dims):
    """Rank 0's shard of a cp·local-token document (its two segments' packing), random inputs for its local tokens
    (requiring grad), and the segments' order of the gathered maps."""
    T = local * cp
    packing = _shards(T, [T], cp, device)[0]
    G, H, K, V = dims
    gen = torch.Generator(device=device).manual_seed(cp)
    xl = [torch.randn(local, G, K, device=device, generator=gen).to(dtype),
          torch.randn(local, G, K, device=device, generator=gen).to(dtype),
          torch.randn(local, H, V, device=device, generator=gen).to(dtype),
          -F.softplus(torch.randn(local, H, device=device, generator=gen) + 2.0) * 0.2,
          torch.sigmoid(torch.randn(local, H, device=device, generator=gen)).to(dtype)]
    order = [2 * r + slot for r, slot in (segment_owner(j, cp) for j in range(2 * cp))]
    return packing, [x.requires_grad_() for x in xl], order


def one_rank_cost(local: int, cp: int, path: str, device, dtype, dims, reps: int) -> dict:
    """Rank 0's forward + backward on its `local` tokens of a cp·local micro-batch (one document: every segment
    continues the one before), the other ranks' maps stood in by copies of its own, against the plain delta rule."""
    packing, xl, order = _rank_inputs(local, cp, device, dtype, dims)
    plain_cu = torch.tensor([0, local], dtype=torch.int32, device=device)
    plain_pos = torch.arange(local, device=device)

    def combine():
        o_aug, m = local_segment_pass(*xl, packing, CHUNK, backend=path)
        states = fold_state_maps(m.repeat(cp, 1, 1, 1)[order])[[0, 2 * cp - 1]]
        with_incoming_states(o_aug, states).to(dtype).float().sum().backward()

    def plain():
        if path == "fla":
            o = chunk_gated_delta_rule_fla(*xl, plain_cu, CHUNK)
        else:
            o = chunk_gated_delta_rule_torch(*xl, plain_pos, CHUNK)
        o.float().sum().backward()

    print(f"  timing {path} cp={cp} …", flush=True)
    t_cp, t_plain = _time(combine, device, reps), _time(plain, device, reps)
    return {"path": path, "cp": cp, "local_tokens": local, "plain_ms": t_plain * 1e3, "cp_ms": t_cp * 1e3,
            "extra_ms": (t_cp - t_plain) * 1e3, "ratio": t_cp / t_plain}


def model_charge(local: int, cp: int, dims) -> tuple[float, float]:
    """The cost model's charge for this layer's combine compute, forward + backward (three forward-equivalents, as
    recipe.cost counts a pass without recompute), at the H200's delta-rule rate: (ms, in plain passes)."""
    from recipe.cost import cp_combine_seconds, delta_rule_flops_per_token_head, rates
    from recipe.hw import load_profile
    from recipe.models import LinearAttnShape

    G, H, K, V = dims
    la = LinearAttnShape(num_k_heads=G, num_v_heads=H, head_k_dim=K, head_v_dim=V, conv_kernel=4, chunk_size=CHUNK)
    rate = rates(load_profile("h200"))["delta_rule"]
    t = cp_combine_seconds(local, H, la, cp, rate)
    return 3 * t * 1e3, t / (local * H * delta_rule_flops_per_token_head(la) / rate)


def breakdown(local: int, cp: int, path: str, device, dtype, dims, reps: int) -> dict:
    """Where rank 0's combine time goes, forward + backward: the augmented pass alone (its outputs and maps
    summed into the loss), the fold of the 2·cp maps alone, and the completion alone, each timed on its own."""
    packing, xl, order = _rank_inputs(local, cp, device, dtype, dims)
    o_aug, m = local_segment_pass(*xl, packing, CHUNK, backend=path)
    o_aug, m = o_aug.detach().requires_grad_(), m.detach()
    maps = (m.repeat(cp, 1, 1, 1)[order] * 0.5).requires_grad_()  # contractive, as trained decays are
    states = fold_state_maps(maps.detach())[[0, 2 * cp - 1]].requires_grad_()

    def augmented():
        a, b = local_segment_pass(*xl, packing, CHUNK, backend=path)
        (a.float().sum() + b.sum()).backward()

    def fold():
        fold_state_maps(maps)[[0, 2 * cp - 1]].sum().backward()

    def completion():
        with_incoming_states(o_aug, states).to(dtype).float().sum().backward()

    return {"cp": cp, **{name: _time(fn, device, reps) * 1e3
                         for name, fn in (("augmented_ms", augmented), ("fold_ms", fold),
                                          ("completion_ms", completion))}}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--local", type=int, default=32768, help="tokens per rank")
    p.add_argument("--cps", default="2,4,8")
    p.add_argument("--paths", default=None, help="fla,torch (default: fla on CUDA when usable, else torch)")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--check-only", action="store_true")
    p.add_argument("--warm-only", action="store_true", help="run the timing shape once per path (autotuning), no table")
    p.add_argument("--time-only", action="store_true", help="skip the fp32 exactness check (its own autotuning)")
    p.add_argument("--breakdown", action="store_true",
                   help="also time the augmented pass, the fold and the completion each on its own")
    p.add_argument("--json", help="write the results here")
    a = p.parse_args(argv)
    device = torch.device(a.device)
    dims = (16, 32, 128, 128) if device.type == "cuda" else (2, 4, 16, 16)  # G, H, K, V (Qwen3.5-35B on GPU)
    cps = [int(c) for c in a.cps.split(",")]
    if a.paths:
        paths = a.paths.split(",")
    else:
        paths = ["fla"] if device.type == "cuda" and fla_status(dims[2])[0] else ["torch"]
    if "fla" in paths and not fla_status(dims[2])[0]:  # (also lifts fla's Hopper guard where our tiles allow)
        p.error(f"flash-linear-attention unusable here: {fla_status(dims[2])[1]}")
    timing_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if a.warm_only:
        for path in paths:
            t0 = time.perf_counter()
            one_rank_cost(a.local, cps[0], path, device, timing_dtype, dims, reps=1)
            print(f"warmed {path} at {a.local} local tokens: {time.perf_counter() - t0:.0f} s", flush=True)
        return 0
    results = {"checks": [], "costs": []}
    # exactness: a packed batch whose documents cross segment edges, and one starting exactly on an edge
    for path in ([] if a.time_only else paths):
        dtype = torch.float32
        for cp in cps:
            T = 2 * cp * CHUNK * (4 if device.type == "cuda" else 1)
            L = T // (2 * cp)
            docs = [L + 5, L - 5 + 3 * CHUNK // 2, T - (2 * L + 3 * CHUNK // 2)] if cp > 1 else [T]
            docs = [d for d in docs if d > 0]
            docs[-1] += T - sum(docs)
            r = check(T, docs, cp, path, device, dtype, dims)
            results["checks"].append(r)
            print(f"check {path:5s} cp={cp} T={T} docs={docs}: out rel {r['out_rel']:.2e}, grad rel "
                  f"{r['grad_rel']:.2e}", flush=True)
    if not a.check_only:
        print(f"\none rank, forward+backward, local {a.local} tokens, heads {dims[1]}×{dims[2]}×{dims[3]}")
        print("| path | cp | plain (ms) | with combine (ms) | extra (ms) | extra / plain | cost model (ms) | "
              "cost model / plain |")
        print("|---|---|---|---|---|---|---|---|")
        for path in paths:
            for cp in cps:
                r = one_rank_cost(a.local, cp, path, device, timing_dtype, dims, a.reps)
                r["model_ms"], r["model_passes"] = model_charge(a.local, cp, dims)
                results["costs"].append(r)
                print(f"| {path} | {cp} | {r['plain_ms']:.2f} | {r['cp_ms']:.2f} | {r['extra_ms']:.2f} | "
                      f"{r['extra_ms'] / r['plain_ms']:.2f} | {r['model_ms']:.2f} | {r['model_passes']:.2f} |",
                      flush=True)
        if a.breakdown:
            results["breakdown"] = []
            print("\n| cp | augmented pass (ms) | fold (ms) | completion (ms) |\n|---|---|---|---|")
            for cp in cps:
                r = breakdown(a.local, cp, paths[0], device, timing_dtype, dims, a.reps)
                results["breakdown"].append(r)
                print(f"| {cp} | {r['augmented_ms']:.2f} | {r['fold_ms']:.2f} | {r['completion_ms']:.2f} |",
                      flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
