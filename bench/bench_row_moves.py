"""Row moves of the expert-parallel backward: every chunk's rows into the weight gradients' order (expert, source
rank, chunk), as one cat and gather at the end or as one scatter a chunk, on bf16 rows and on the same bytes viewed as
int64 words (4 bf16 values a word: a quarter of the elements for the indexing kernels to address).

    python bench/bench_row_moves.py --rows 524288 --chunks 8 --cols 2048
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from bench_gdn_fused import _time as cuda_median_ms  # noqa: E402

from launch.expert_parallel import regroup_index  # noqa: E402


def words(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int64)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=524_288)
    p.add_argument("--chunks", type=int, default=8)
    p.add_argument("--cols", type=int, default=2048)
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--reps", type=int, default=10)
    args = p.parse_args()
    dev = torch.device("cuda")
    torch.manual_seed(0)
    C, El, M, D = args.chunks, args.experts, args.rows, args.cols
    recv = torch.randint(0, 2 * M // (C * El), (1, C, El), device=dev)  # [R = 1, C, El]
    M = int(recv.sum())
    perm = regroup_index(recv.permute(1, 2, 0), (1, 2, 0), M)
    dest = regroup_index(recv.permute(2, 0, 1), (2, 0, 1), M)
    sizes = recv[0].sum(1).tolist()
    starts = [sum(sizes[:c]) for c in range(C)]
    parts = [torch.randn(n, D, device=dev, dtype=torch.bfloat16) for n in sizes]
    ref = torch.cat(parts)[perm]

    def cat_gather(view):
        return view(torch.cat(parts))[perm]

    def scatter(view):
        whole = torch.empty(M, D, device=dev, dtype=torch.bfloat16)
        for c, part in enumerate(parts):
            view(whole).index_copy_(0, dest[starts[c]:starts[c] + sizes[c]], view(part))
        return whole

    def index_select(view):
        cat = view(torch.cat(parts))
        out = torch.empty_like(cat)
        return torch.index_select(cat, 0, perm, out=out)

    same = lambda t: t  # noqa: E731
    rows = [("cat + gather (bf16)", lambda: cat_gather(same)), ("cat + gather (int64 words)", lambda: cat_gather(words)),
            ("cat + index_select (bf16)", lambda: index_select(same)),
            ("cat + index_select (int64 words)", lambda: index_select(words)),
            ("index_copy_ a chunk (bf16)", lambda: scatter(same)),
            ("index_copy_ a chunk (int64 words)", lambda: scatter(words))]
    moved = M * D * 2
    print(f"{M:,} rows of {D} bf16 in {C} chunks ({moved / 1e9:.2f} GB a copy)")
    print(f"{'method':<36} {'ms':>8} {'GB/s a copy':>12}")
    for name, fn in rows:
        out = fn()
        got = out if out.dtype == torch.bfloat16 else out.view(torch.bfloat16)
        assert torch.equal(got.view(M, D), ref), name
        ms = cuda_median_ms(fn, args.reps, warmup=1)
        print(f"{name:<36} {ms:8.3f} {moved / ms / 1e6:12.0f}")


if __name__ == "__main__":
    main()
