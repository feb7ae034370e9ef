"""DeepSeek sparse attention (launch/sparse_attention.py) on one GPU, one attention layer of a DSA model (GLM-5 by
default: 64 heads, q·k 256 and v 256 wide, a 512 + 64 latent, an indexer of 32 heads of 128 keeping 2,048 keys a
query) against the same layer's dense MLA (what the model runs without DSA: cuDNN over the expanded keys), on one
document of T tokens, bf16. Columns: the indexer's selection alone (forward only: it takes no gradient), then the
same with torch.topk selecting on the kernel's scores (the selection kernels' peer), the sparse attention alone
(absorbed; the Triton kernels forward and forward + backward, the torch blocks forward + backward), the whole DSA
layer (projections, indexer, sparse attention; forward + backward) and the dense layer (forward + backward), with
the ratio of the DSA layer to the dense one (lower is faster). Median ms of --reps after a warm-up; the peak memory
of each layer's forward + backward above its inputs. Before the table: the kernels' largest differences from the
torch blocks (output, dq, dlatent; relative to each tensor's largest value). Before each row: the selection kernels
against torch.topk on one block of scores (times, the same keys, the rows their sample missed), and with --variants
the selection configurations in VARIANT_SELECT_CONFIGS. After each row: the two attention kernels' own times
(forward, backward) at that length and their rate in model FLOPs (2·H·(2C + R) a selected key forward, three times
that forward + backward), then any configurations in FORWARD_CONFIGS and BACKWARD_CONFIGS beside the defaults.

    python bench/bench_sparse_attention.py --model glm-5.json --tokens 8192,32768,65536     # on the GPU
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=str(Path(__file__).parent / "configs" / "glm-5.json"))
    p.add_argument("--tokens", default="8192,32768,65536")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--check-heads", default="",
                   help="before the table, the kernels against the torch blocks at these head counts (e.g. "
                        "8,16,32,48,64,128: every configuration the kernels pick), on random selections")
    p.add_argument("--variants", action="store_true",
                   help="also time the kernels' other configurations (VARIANT_FORWARD_CONFIGS, "
                        "VARIANT_BACKWARD_CONFIGS, VARIANT_SELECT_CONFIGS)")
    args = p.parse_args()
    if args.variants:
        FORWARD_CONFIGS.extend(VARIANT_FORWARD_CONFIGS)
        BACKWARD_CONFIGS.extend(VARIANT_BACKWARD_CONFIGS)
        SELECT_CONFIGS.extend(VARIANT_SELECT_CONFIGS)

    import torch

    from bench_train_step import _time
    from launch.model import MLAttention, Packing, rope_cos_sin
    from launch.sparse_attention import index_topk, sparse_latent_attention
    from recipe.models import resolve_model

    dev = torch.device("cuda")
    m = resolve_model(args.model)
    if m.dsa is None:
        raise SystemExit(f"{args.model}: not a DeepSeek sparse attention model")
    torch.manual_seed(0)
    sparse_layer = MLAttention(m).to(dev, torch.bfloat16)
    dense_layer = MLAttention(m.model_copy(update={"dsa": None})).to(dev, torch.bfloat16)
    dense_layer.load_state_dict(sparse_layer.state_dict(), strict=False)
    a, d = m.mla, m.dsa
    print(f"{m.name}: {m.num_heads} heads, latent {a.kv_lora_rank} + {a.qk_rope_head_dim}, indexer {d.index_heads} x "
          f"{d.index_head_dim}, top {d.topk}; one document, bf16, median of {args.reps}")
    if args.check_heads:
        _check_heads([int(h) for h in args.check_heads.split(",")], a.kv_lora_rank, a.qk_rope_head_dim, dev)
    rows = []
    for T in (int(t) for t in args.tokens.split(",")):
        packing = Packing.from_lengths([T], device=dev)
        rope = rope_cos_sin(packing.positions, m, torch.bfloat16)
        x = (torch.randn(T, m.hidden_size, device=dev) * 0.5).to(torch.bfloat16).requires_grad_()
        dy = torch.randn(T, m.hidden_size, device=dev, dtype=torch.bfloat16)
        with torch.no_grad():
            ql = sparse_layer.q_a_layernorm(sparse_layer.q_a_proj(x))
            iq, iw, ik = sparse_layer.indexer(x, ql, rope)
        pos = torch.arange(T)
        starts = torch.zeros(T, dtype=torch.long)

        def indexer():
            return index_topk(iq, iw, ik, pos, starts, d.topk, sparse_layer.indexer.scale)

        def indexer_topk():  # the peer: torch.topk (the torch path's selection) on the same Triton scores
            from kernels import dsa_index
            from launch import sparse_attention

            def torch_select(score, query_index, doc_start, lo, k, out, backend=None):
                return dsa_index.select_keys(score, query_index, doc_start, lo, k, out, backend="torch")

            with _patched(sparse_attention, "select_keys", torch_select):
                return index_topk(iq, iw, ik, pos, starts, d.topk, sparse_layer.indexer.scale)

        idx = indexer()
        _compare_selection(iq, iw, ik, T, d.topk, sparse_layer.indexer.scale, dev, args.reps, _time)
        H, C = m.num_heads, a.kv_lora_rank + a.qk_rope_head_dim
        q_hat = (torch.randn(T, H, C, device=dev) * 0.3).to(torch.bfloat16).requires_grad_()
        latent = torch.randn(T, C, device=dev, dtype=torch.bfloat16).requires_grad_()
        do = torch.randn(T, H, a.kv_lora_rank, device=dev, dtype=torch.bfloat16)

        def attn_fwd():
            with torch.no_grad():
                sparse_latent_attention(q_hat, latent, idx, 0.06, a.kv_lora_rank)

        def attn_fwd_bwd(backend="auto"):
            sparse_latent_attention(q_hat, latent, idx, 0.06, a.kv_lora_rank, backend=backend).backward(do)

        def attn_torch():
            attn_fwd_bwd("torch")

        if not rows:  # the kernels against the torch blocks
            outs = []
            for backend in ("triton", "torch"):
                q_hat.grad = latent.grad = None
                o = sparse_latent_attention(q_hat, latent, idx, 0.06, a.kv_lora_rank, backend=backend)
                o.backward(do)
                outs.append((o.float(), q_hat.grad.float(), latent.grad.float()))
            errs = [((x - y).abs().max() / y.abs().max()).item() for x, y in zip(*outs)]
            print(f"Triton against the torch blocks at {T:,} tokens: output {errs[0]:.1e}, dq {errs[1]:.1e}, "
                  f"dlatent {errs[2]:.1e} (largest difference over the largest value)")
            print("| tokens | indexer fwd ms | indexer with torch.topk ms | sparse attn fwd ms | sparse attn fwd+bwd ms | torch blocks fwd+bwd ms | "
                  "DSA layer fwd+bwd ms | dense MLA layer fwd+bwd ms | DSA / dense | DSA peak GB | dense peak GB |")
            print("|---|---|---|---|---|---|---|---|---|---|---|")

        def layer(mod):
            def run():
                mod(x, rope, packing).backward(dy)
            return run

        from kernels import dsa_index_triton

        span_q, span_s = torch.arange(T, device=dev), torch.zeros(T, dtype=torch.long, device=dev)
        rows_ = min(T, 4096)
        for tile in INDEX_TILES:
            def scores(tile=tile):
                dsa_index_triton.index_scores(iq[-rows_:], iw[-rows_:], ik, span_q[-rows_:], span_s[-rows_:], 0,
                                              0.08, tile)
            scores()
            t_s = _time(scores, dev, args.reps)
            flops = 2 * d.index_heads * d.index_head_dim * rows_ * (T - rows_ / 2)
            print(f"  index scores, last {rows_:,} queries, tile {tile}: {t_s * 1e3:.1f} ms, {flops / t_s / 1e12:.0f} "
                  f"TF/s")
        row = [T]
        for fn in (indexer, indexer_topk, attn_fwd, attn_fwd_bwd, attn_torch):
            fn()
            row.append(_time(fn, dev, args.reps) * 1e3)
        peaks = []
        for mod in (sparse_layer, dense_layer):
            run = layer(mod)
            run()
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            row.append(_time(run, dev, args.reps) * 1e3)
            peaks.append((torch.cuda.max_memory_allocated() - base) / 1e9)
            x.grad = None
            mod.zero_grad(set_to_none=True)
        from kernels import sparse_mla_triton as smk

        idx32 = idx.int().contiguous()
        count = (idx32 >= 0).sum(1, dtype=torch.int32)
        kt = _kernel_times(smk, q_hat.detach(), latent.detach(), idx32, count, do, a.kv_lora_rank, dev, args.reps)
        row.append(row[6] / row[7])
        rows.append(row)
        print(f"| {T:,} | " + " | ".join(f"{v:.1f}" for v in row[1:8]) + f" | {row[8]:.2f} | "
              + " | ".join(f"{v:.2f}" for v in peaks) + " |", flush=True)
        flops = 2 * H * (2 * a.kv_lora_rank + a.qk_rope_head_dim) * count.double().sum().item()
        print(f"  kernels at {T:,}: forward {kt[0] * 1e3:.1f} ms, backward {kt[1] * 1e3:.1f} ms; "
              f"{3 * flops / sum(kt) / 1e12:.0f} TF/s in model FLOPs", flush=True)
        del q_hat, latent, do, idx, iq, iw, ik, x, dy
        torch.cuda.empty_cache()


@contextlib.contextmanager
def _patched(module, name, value):
    old = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, old)


def _compare_selection(iq, iw, ik, T, K, scale, dev, reps, _time):
    """The selection kernel against the torch path's topk on the scores of the last 2,048 queries (one of the
    indexer's blocks): times, equality, and how many rows the sample missed."""
    import torch

    from kernels import dsa_index, dsa_index_triton

    n = min(T, 2048)
    qi = torch.arange(T - n, T, device=dev)
    st = torch.zeros_like(qi)
    score = dsa_index.index_scores(iq[-n:], iw[-n:], ik, qi, st, 0, scale)
    k = min(K, T)
    out = torch.full((n, K), -1, dtype=torch.int32, device=dev)
    slow = dsa_index_triton.select(score, qi, st, 0, k, out)
    want = dsa_index.topk_select(score, k, 0)
    t_kernel = _time(lambda: dsa_index_triton.select(score, qi, st, 0, k, out), dev, reps)
    for cfg in SELECT_CONFIGS:
        other = torch.full_like(out, -1)
        dsa_index_triton.select(score, qi, st, 0, k, other, cfg)
        t = _time(lambda cfg=cfg: dsa_index_triton.select(score, qi, st, 0, k, other, cfg), dev, reps)
        print(f"  selection {cfg}: {t * 1e3:.2f} ms (the same keys: {torch.equal(other, out)})", flush=True)
    t_torch = _time(lambda: dsa_index.topk_select(score, k, 0), dev, reps)
    t_scores = _time(lambda: dsa_index.index_scores(iq[-n:], iw[-n:], ik, qi, st, 0, scale), dev, reps)
    print(f"  selection of the last {n:,} queries at {T:,} tokens: kernel {t_kernel * 1e3:.2f} ms, torch topk "
          f"{t_torch * 1e3:.2f} ms ({t_torch / t_kernel:.1f}x); the same keys: {torch.equal(out[:, :k], want)}; "
          f"rows the sample missed: {int(slow.sum())}; their scores {t_scores * 1e3:.2f} ms", flush=True)


def _check_heads(heads, C, R, dev, T=3000, K=256):
    """The kernels' output, dq and dlatent against the torch blocks' (bf16 inputs; relative to each tensor's largest
    value) at each head count, T queries each selecting min(K, t + 1) random causal keys."""
    import torch

    from launch.sparse_attention import _SparseLatentAttention, _SparseLatentAttentionTriton

    g = torch.Generator().manual_seed(0)
    idx = torch.full((T, K), -1, dtype=torch.int32)
    for t in range(T):
        idx[t, :min(K, t + 1)] = torch.randperm(t + 1, generator=g)[:K].int()
    idx = idx.to(dev)
    for H in heads:
        q = (torch.randn(T, H, C + R, generator=g) * 0.3).to(dev, torch.bfloat16).requires_grad_()
        latent = torch.randn(T, C + R, generator=g).to(dev, torch.bfloat16).requires_grad_()
        do = torch.randn(T, H, C, generator=g).to(dev, torch.bfloat16)
        outs = []
        for fn in (_SparseLatentAttentionTriton, _SparseLatentAttention):
            q.grad = latent.grad = None
            o = fn.apply(q, latent, idx, 0.06, C)
            o.backward(do)
            outs.append((o.float(), q.grad.float(), latent.grad.float()))
        errs = [((x - y).abs().max() / y.abs().max()).item() for x, y in zip(*outs)]
        print(f"{H} heads, Triton against the torch blocks: output {errs[0]:.1e}, dq {errs[1]:.1e}, dlatent "
              f"{errs[2]:.1e}", flush=True)


def _kernel_times(smk, q, latent, idx, count, do, v_dim, dev, reps):
    """The forward and backward kernels each alone, with their default configurations, then each configuration of
    FORWARD_CONFIGS and BACKWARD_CONFIGS (its time and its largest difference from the default's output)."""
    from bench_train_step import _time

    o, lse = smk.forward(q, latent, idx, count, 0.06, v_dim)
    dq, dl = smk.backward(q, latent, idx, count, o, lse, do, 0.06, v_dim)
    out = [_time(lambda: smk.forward(q, latent, idx, count, 0.06, v_dim), dev, reps),
           _time(lambda: smk.backward(q, latent, idx, count, o, lse, do, 0.06, v_dim), dev, reps)]
    err = lambda x, y: ((x.float() - y.float()).abs().max() / y.float().abs().max()).item()  # noqa: E731
    for kind, configs in (("forward", FORWARD_CONFIGS), ("backward", BACKWARD_CONFIGS)):
        for cfg in configs:
            if kind == "forward":
                run = lambda cfg=cfg: smk.forward(q, latent, idx, count, 0.06, v_dim, config=cfg)  # noqa: E731
            else:
                run = lambda cfg=cfg: smk.backward(q, latent, idx, count, o, lse, do, 0.06, v_dim,  # noqa: E731
                                                   config=cfg)
            try:
                got = run()
            except Exception as e:  # a configuration the GPU cannot hold (shared memory, registers)
                print(f"  {kind} {cfg}: {type(e).__name__}")
                continue
            want = (o,) if kind == "forward" else (dq, dl)
            errs = ", ".join(f"{err(x, y):.1e}" for x, y in zip(got, want))
            print(f"  {kind} {cfg}: {_time(run, dev, reps) * 1e3:.1f} ms (against the default: {errs})")
    return out


SELECT_CONFIGS = []  # selection kernel configurations to time beside the default (--variants)
VARIANT_SELECT_CONFIGS = [dict(BLOCK=b, num_warps=w) for b, w in ((512, 4), (1024, 8), (2048, 4), (2048, 8),
                                                                  (4096, 8), (8192, 16))]
INDEX_TILES = []  # (BM, BN, warps) of the index-score kernel to time, on the last 4,096 queries
# kernels/sparse_mla_triton.py configurations to time beside the defaults: the ones a head count that is not a
# multiple of 64 (forward) or at most 16 (backward) runs
FORWARD_CONFIGS: list[dict] = [dict(BH=16, BK=32, num_warps=4, num_stages=2, Q_PER_TILE=False)]
BACKWARD_CONFIGS: list[dict] = [dict(BH=16, BK=16, num_warps=4, num_stages=3)]
# with --variants: the others the defaults were chosen over (64 heads with tiles of 32 keys, fewer or more pipeline
# stages, q held across the loop; 32-head and 16-head forward programs of other shapes; backward with fewer stages,
# tiles of 16 keys, 16 heads of 32 keys, 16 warps)
VARIANT_FORWARD_CONFIGS = [dict(BH=64, BK=32, num_warps=8, num_stages=3, Q_PER_TILE=True),
                           dict(BH=64, BK=64, num_warps=8, num_stages=2, Q_PER_TILE=True),
                           dict(BH=64, BK=64, num_warps=8, num_stages=4, Q_PER_TILE=True),
                           dict(BH=64, BK=32, num_warps=8, num_stages=2, Q_PER_TILE=False),
                           dict(BH=32, BK=32, num_warps=8, num_stages=2, Q_PER_TILE=False),
                           dict(BH=16, BK=32, num_warps=4, num_stages=3, Q_PER_TILE=False),
                           dict(BH=16, BK=64, num_warps=4, num_stages=3, Q_PER_TILE=False)]
VARIANT_BACKWARD_CONFIGS = [dict(BH=32, BK=32, num_warps=8, num_stages=2),
                            dict(BH=32, BK=32, num_warps=8, num_stages=4),
                            dict(BH=32, BK=16, num_warps=8, num_stages=2),
                            dict(BH=16, BK=32, num_warps=8, num_stages=2),
                            dict(BH=32, BK=32, num_warps=16, num_stages=2),
                            dict(BH=16, BK=16, num_warps=4, num_stages=2)]

if __name__ == "__main__":
    main()
