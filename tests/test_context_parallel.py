"""Context parallelism without a process group: the zigzag shards, the Gated DeltaNet state combine against the
token-by-token delta rule, and the plan rules that refuse a cp that does not cut the micro-batch into whole chunks.

The exchanges on real ranks (K/V all-gather, conv halo, combine across ranks) and whole layouts against one process
run in tests/test_parallel.py's world-2 and world-4 launches (tests/dist_cases.py).
"""

from __future__ import annotations

import types

import pytest
import torch
import yaml

from launch.context_parallel import padded_length, segment_owner, shard_batch, zigzag_index
from launch.data import Rollout, make_batch
from launch.gated_delta import (chunk_factors, fold_state_maps, recurrent_gated_delta_rule_ref, segment_pass,
                                with_incoming_states)
from launch.model import Packing


def test_zigzag_index_and_owner_by_hand():
    assert zigzag_index(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert zigzag_index(8, 2, 1).tolist() == [2, 3, 4, 5]
    assert zigzag_index(16, 4, 1).tolist() == [2, 3, 12, 13]
    assert [segment_owner(j, 2) for j in range(4)] == [(0, 0), (1, 0), (1, 1), (0, 1)]
    assert padded_length(29, 2, 4) == 32 and padded_length(32, 2, 4) == 32 and padded_length(33, 2, 4) == 48
    with pytest.raises(ValueError, match="2·cp=4 equal segments"):
        zigzag_index(10, 2, 0)


def _batch(lengths, seed=0):
    gen = torch.Generator().manual_seed(seed)
    rollouts = []
    for n in lengths:
        r = lambda: torch.randn(n, generator=gen).tolist()  # noqa: E731
        rollouts.append(Rollout(torch.randint(0, 50, (n,), generator=gen).tolist(), [0] + [1] * (n - 1), r(),
                                old_logprobs=r(), ref_logprobs=r(), rollout_logprobs=r()))
    return make_batch(rollouts)


@pytest.mark.parametrize("cp", [2, 3])
def test_shards_reassemble_the_padded_micro_batch(cp):
    """Every per-token field (and a [T] tensor in extra) of all ranks' shards, put back at their global indices, is
    the micro-batch followed by one padding document (input 0, target −1, mask 0, weight 0); the local document
    pieces tile each shard and carry global positions."""
    lengths = [9, 4, 17, 1, 6]  # 37 tokens
    batch = _batch(lengths)
    batch.extra["token_weight"] = torch.rand(37)
    batch.extra["num_loss_tokens"] = batch.loss_mask.sum().float()
    Tp = padded_length(37, cp, 4)
    pad = Tp - 37
    assert pad > 0
    fields = ("input_ids", "targets", "loss_mask", "advantages", "seq_id", "old_logprobs", "ref_logprobs",
              "rollout_logprobs")
    whole = {f: torch.zeros(Tp, dtype=getattr(batch, f).dtype) for f in fields}
    whole["token_weight"], whole["positions"] = torch.zeros(Tp), torch.zeros(Tp, dtype=torch.int64)
    seen = torch.zeros(Tp, dtype=torch.int64)
    for rank in range(cp):
        s = shard_batch(batch, rank, cp, chunk=4)
        shard = s.packing.cp
        assert (shard.rank, shard.size, shard.segment_len, shard.num_padding) == (rank, cp, Tp // (2 * cp), pad)
        assert s.num_tokens == 2 * shard.segment_len == sum(s.packing.doc_lengths)
        assert s.extra["num_loss_tokens"] is batch.extra["num_loss_tokens"]
        for f in fields:
            whole[f][shard.index] = getattr(s, f)
        whole["token_weight"][shard.index] = s.extra["token_weight"]
        whole["positions"][shard.index] = s.packing.positions
        seen[shard.index] += 1
        start = 0
        for local, n, a, doc_start in shard.pieces:  # pieces tile the shard, each inside one segment
            assert local == start and a == int(shard.index[local]) and int(shard.positions[a]) == a - doc_start
            assert local // shard.segment_len == (local + n - 1) // shard.segment_len
            start += n
        assert start == s.num_tokens
    assert seen.tolist() == [1] * Tp
    for f in fields:
        torch.testing.assert_close(whole[f][:37], getattr(batch, f), rtol=0, atol=0)
    torch.testing.assert_close(whole["token_weight"][:37], batch.extra["token_weight"], rtol=0, atol=0)
    assert whole["positions"].tolist() == batch.packing.positions.tolist() + list(range(pad))
    assert whole["input_ids"][37:].tolist() == [0] * pad and whole["targets"][37:].tolist() == [-1] * pad
    assert not whole["loss_mask"][37:].any() and not whole["token_weight"][37:].any()
    assert whole["seq_id"][37:].tolist() == [len(lengths)] * pad


def _delta_inputs(T, seed, requires_grad=True, per_channel=False):
    """q, k (one key head of 4), v (two value heads of 3), the log decay g (per value head, or per value head and
    key channel: KDA's), β; fp64."""
    gen = torch.Generator().manual_seed(seed)
    f64 = torch.float64
    q, k = torch.randn(T, 1, 4, generator=gen, dtype=f64), torch.randn(T, 1, 4, generator=gen, dtype=f64)
    v = torch.randn(T, 2, 3, generator=gen, dtype=f64)
    # slow decay: the incoming state matters
    g = -(0.01 + 0.09 * torch.rand(T, 2, *((4,) if per_channel else ()), generator=gen, dtype=f64))
    beta = torch.rand(T, 2, generator=gen, dtype=f64)
    return [x.requires_grad_(requires_grad) for x in (q, k, v, g, beta)]


def _combine_on_simulated_ranks(inputs, positions, cp, chunk, with_combine=True):
    """What ContextParallel.delta_rule computes on each of cp ranks, with the all-gather done by hand: each rank's
    augmented pass over its two zigzag segments, the maps of all 2·cp segments folded in sequence order, each rank's
    outputs completed with its segments' incoming states; returned in global token order."""
    T = positions.shape[0]
    maps, passes = [], []
    for r in range(cp):
        idx = zigzag_index(T, cp, r)
        o_aug, m = segment_pass(chunk_factors(*(x[idx] for x in inputs), positions[idx], chunk), 2)
        passes.append((idx, o_aug))
        maps.append(m)
    gathered = torch.cat(maps)  # rank-major, as all_gather delivers it
    states = fold_state_maps(gathered[[2 * r + s for r, s in (segment_owner(j, cp) for j in range(2 * cp))]])
    out = torch.empty(T, 2, 3, dtype=inputs[2].dtype)
    for r, (idx, o_aug) in enumerate(passes):
        mine = states[[r, 2 * cp - 1 - r]] if with_combine else torch.zeros_like(states[:2])
        out = out.index_put((idx,), with_incoming_states(o_aug, mine))
    return out


@pytest.mark.parametrize("per_channel", [False, True])
@pytest.mark.parametrize("cp, lengths", [
    (2, [8, 5, 14, 5]),  # segments of 8 (two 4-token chunks): a document starts on the edge at 8, one inside
    (4, [8, 5, 14, 2, 16, 11, 8]),  # segments of 8: starts on the edges at 8 and 56, inside at 13, 27, 29, 45
])
def test_state_combine_equals_the_token_by_token_delta_rule(cp, lengths, per_channel):
    """The segments' affine maps, folded, and each segment run from its folded incoming state: outputs and the
    gradients of q, k, v, g, β equal the one-process recurrence in fp64, with a decay per head (Gated DeltaNet) and
    per key channel (KDA: the maps carry it as a diagonal); without the combine (zero incoming states) the outputs
    are visibly off, so the check has teeth."""
    T, chunk = sum(lengths), 4
    assert T == 2 * cp * 8
    positions = Packing.from_lengths(lengths).positions
    edges = [j * 8 for j in range(1, 2 * cp)]
    assert any(int(positions[e]) == 0 for e in edges) and any(int(positions[e]) > 0 for e in edges)
    inputs = _delta_inputs(T, seed=cp, per_channel=per_channel)
    out = _combine_on_simulated_ranks(inputs, positions, cp, chunk)
    ref_inputs = [x.detach().clone().requires_grad_() for x in inputs]
    ref = recurrent_gated_delta_rule_ref(*ref_inputs, positions)
    assert (out - ref).abs().max() < 1e-12
    cot = torch.randn(ref.shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    (out * cot).sum().backward()
    (ref * cot).sum().backward()
    for name, a, b in zip("q k v g beta".split(), inputs, ref_inputs):
        assert (a.grad - b.grad).abs().max() < 1e-11, name
    with torch.no_grad():
        alone = _combine_on_simulated_ranks(inputs, positions, cp, chunk, with_combine=False)
    assert (alone - ref).abs().max() > 1e-2


def test_state_map_of_a_segment_with_a_document_start_forgets_its_input():
    """M is zero once a document starts inside the segment (the reset); B is then the new document's state, and
    only the tokens of the document carried in read the incoming state (non-zero Q_eff rows)."""
    positions = Packing.from_lengths([3, 13]).positions.clone()  # one 16-token segment, a document starting at 3
    positions[:3] += 5  # the first three tokens continue a document from the segment before
    inputs = _delta_inputs(16, seed=1, requires_grad=False)
    f = chunk_factors(*inputs, positions, 4)
    o_aug, maps = segment_pass(f, 1)
    assert maps[0, ..., 3:].abs().max() == 0  # M: [K, K] after the V = 3 columns of B
    assert o_aug[3:, :, 3:].abs().max() == 0 < o_aug[:3, :, 3:].abs().max()  # Q_eff: only the first document reads
    f_cont = chunk_factors(*inputs, Packing.from_lengths([16]).positions + 5, 4)  # continues a document
    assert segment_pass(f_cont, 1)[1][0, ..., 3:].abs().max() > 1e-3


def test_the_completion_is_the_product_block_by_block(monkeypatch):
    """with_incoming_states in blocks smaller than a segment: O_0 + Q_eff S_in exactly in fp64 (gradcheck); with bf16
    outputs and fp32 states it returns bf16 within bf16 rounding of the fp32 product, keeps for the backward only
    Q_eff in bf16 and the states — no fp32 copy of the outputs — and its gradients match fp64 to bf16 rounding."""
    import launch.gated_delta as gd

    monkeypatch.setattr(gd, "COMPLETION_BLOCK_TOKENS", 3)
    S, T, H, K, V = 2, 14, 3, 4, 5
    gen = torch.Generator().manual_seed(3)
    o = torch.randn(T, H, V + K, generator=gen, dtype=torch.float64, requires_grad=True)
    st = torch.randn(S, H, K, V, generator=gen, dtype=torch.float64, requires_grad=True)

    def product(o, st):
        seg = o.reshape(S, T // S, H, V + K)
        return (seg[..., :V] + torch.einsum("sthk,shkv->sthv", seg[..., V:], st)).reshape(T, H, V)

    assert torch.equal(with_incoming_states(o, st), product(o, st))
    assert torch.autograd.gradcheck(with_incoming_states, (o, st))
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda x: saved.append(x) or x, lambda x: x):
        y = with_incoming_states(o.detach().bfloat16().requires_grad_(), st.detach().float().requires_grad_())
    assert y.dtype == torch.bfloat16
    assert sorted((str(x.dtype), tuple(x.shape)) for x in saved) == [("torch.bfloat16", (S, T // S, H, K)),
                                                                     ("torch.float32", (S, H, K, V))]
    ref = product(o.detach().bfloat16().double(), st.detach().float().double())
    assert ((y.double() - ref).abs().max() / ref.abs().max()) < 4e-3
    # the bf16 path's gradients (bf16 GEMMs, dS_in summed in fp32) against fp64 autograd of the product
    o16, st32 = o.detach().bfloat16().requires_grad_(), st.detach().float().requires_grad_()
    o64, st64 = o16.detach().double().requires_grad_(), st32.detach().double().requires_grad_()
    dy = torch.randn(T, H, V, generator=gen, dtype=torch.float64)
    with_incoming_states(o16, st32).backward(dy.bfloat16())
    product(o64, st64).backward(dy.bfloat16().double())
    assert o16.grad.dtype == torch.bfloat16 and st32.grad.dtype == torch.float32
    for got, want in ((o16.grad, o64.grad), (st32.grad, st64.grad)):
        assert ((got.double() - want).abs().max() / want.abs().max()) < 8e-3


def test_a_sharded_micro_batch_needs_a_parallelized_model():
    from launch.model import build_model
    from recipe.models import PRESETS

    model = build_model(PRESETS["tiny-moe"])
    s = shard_batch(_batch([20, 12]), 0, 2, 16)
    with pytest.raises(ValueError, match="needs a model parallelized with cp > 1"):
        model(s.input_ids, s.packing)


@pytest.mark.parametrize("loss", ["token_mean", "seq_mean", "naive", "sft"])
def test_parts_of_a_micro_batch_with_its_weights_add_up_to_its_loss(loss):
    """What each cp rank computes — its tokens' loss and metrics with the whole micro-batch's weights and loss-token
    count — sums over the ranks to the micro-batch's loss, metrics and hidden-state gradient (fused and naive heads,
    both aggregations, the SFT objective), whichever tokens each part holds."""
    from launch.rl import LossConfig, fused_nll_loss, fused_policy_loss, policy_loss, token_logprobs, token_weights

    gen = torch.Generator().manual_seed(0)
    T, D, V = 40, 8, 32
    hidden, weight = torch.randn(T, D, generator=gen, dtype=torch.float64), torch.randn(V, D, generator=gen,
                                                                                      dtype=torch.float64)
    targets = torch.randint(0, V, (T,), generator=gen)
    mask = torch.rand(T, generator=gen) < 0.7
    seq = torch.repeat_interleave(torch.arange(4), torch.tensor([7, 13, 11, 9]))
    adv, old, ref, rollout = (torch.randn(T, generator=gen, dtype=torch.float64) * s - (5 if s < 1 else 0)
                              for s in (1.0, 0.1, 0.1, 0.1))
    cfg = LossConfig(kl_coef=0.1, entropy_coef=0.01, aggregation="seq_mean" if loss == "seq_mean" else "token_mean")
    w_all = token_weights(mask, seq, "token_mean" if loss == "sft" else cfg.aggregation)
    n_all = mask.sum().double()

    def run(idx, whole):
        h = hidden[idx].clone().requires_grad_()
        kw = {} if whole else {"weights_T": w_all[idx], "num_loss_tokens": n_all}
        if loss == "sft":
            out = fused_nll_loss(h, weight, targets[idx], mask[idx], **kw)
        elif loss == "naive":
            logp, ent = token_logprobs(h, weight, targets[idx], mode="naive", with_entropy=True)
            out = policy_loss(logp, adv[idx], mask[idx], cfg, old_logp_T=old[idx], ref_logp_T=ref[idx],
                              rollout_logp_T=rollout[idx], entropy_T=ent, seq_id_T=seq[idx], **kw)
        else:
            out = fused_policy_loss(h, weight, targets[idx], adv[idx], mask[idx], cfg, old_logp_T=old[idx],
                                    ref_logp_T=ref[idx], rollout_logp_T=rollout[idx], seq_id_T=seq[idx], **kw)
        out[0].backward()
        return out, h.grad

    (ref_loss, ref_metrics), ref_grad = run(torch.arange(T), True)
    perm = torch.randperm(T, generator=gen)
    total, metrics, grad = 0.0, {}, torch.zeros(T, D, dtype=torch.float64)
    for idx in (perm[:17], perm[17:]):  # two ranks' tokens, not contiguous
        (part, part_metrics), g = run(idx, False)
        total = total + part.detach()
        for k, v in part_metrics.items():
            metrics[k] = metrics.get(k, 0.0) + v
        grad[idx] = g
    tol = {"rtol": 1e-12, "atol": 1e-14} if ref_loss.dtype == torch.float64 else {"rtol": 1e-6, "atol": 1e-7}
    torch.testing.assert_close(total.double(), ref_loss.detach().double(), **tol)
    for k, v in ref_metrics.items():
        torch.testing.assert_close(torch.as_tensor(metrics[k], dtype=torch.float64), v.double(), rtol=1e-6,
                                   atol=1e-7, msg=k)
    torch.testing.assert_close(grad.double(), ref_grad.double(), **tol)


# ---- the plan's cp against the micro-batch: recipe check, recipe launch, launch.train ---------------------------
def _plan_with_cp(tmp_path, cp, name):
    """plans/tiny-cpu.yaml (tiny-moe, 4,096-token micro-batches, 16-token chunks) with its layout set to cp ranks."""
    data = yaml.safe_load(open("plans/tiny-cpu.yaml"))
    data["layout"].update(cp=cp, dp=1, ep=1, edp=cp)
    data["inputs"].update(gpus=cp, pins=None)
    data["launch"]["nproc_per_node"] = cp
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


@pytest.mark.parametrize("cp, why", [
    (3, "sequence 4096 does not split into 2·cp=6 equal segments"),
    (256, "segments of 8 tokens are not whole 16-token delta-rule chunks"),
])
def test_a_cp_that_does_not_cut_whole_chunks_is_refused_before_any_process(tmp_path, capsys, monkeypatch, cp, why):
    """`recipe check` (and `recipe launch`'s pre-flight, which runs it) reports it as a misfit; `python -m
    launch.train` refuses it in one line before any process group. The plan loader alone checks only the schema."""
    import torch.distributed as dist

    from launch.launcher import LaunchError, check_plan_file
    from launch.train import main
    from recipe.check import check_plan
    from recipe.plan import load_plan

    path = _plan_with_cp(tmp_path, cp, f"cp{cp}.yaml")
    assert load_plan(path).layout.cp == cp
    misfits = [p for p in check_plan(path).problems if p.kind == "misfit"]
    assert [(p.field, p.committed) for p in misfits] == [("layout.cp", cp)] and misfits[0].cause.startswith(why)
    with pytest.raises(LaunchError, match=why):
        check_plan_file(path)
    monkeypatch.setenv("WORLD_SIZE", str(cp))
    assert main([str(path), "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"error: cp={cp}: {misfits[0].cause}"
    assert not dist.is_initialized()


def test_a_cp_that_cuts_whole_chunks_passes_the_plan_rules(tmp_path):
    from launch.parallel import check_layout, check_plan_shape
    from recipe.plan import load_plan

    plan = load_plan(_plan_with_cp(tmp_path, 4, "cp4.yaml"))
    check_layout(plan.layout, 4)
    check_plan_shape(plan, plan.model_shape())


def test_parallelize_refuses_cp_without_a_process_group():
    from launch.model import build_model
    from launch.parallel import LayoutError, parallelize
    from recipe.models import PRESETS
    from recipe.plan import LayoutSpec

    plan = types.SimpleNamespace(layout=LayoutSpec(pp=1, tp=1, cp=2, ep=1, dp=1, etp=1, edp=2),
                                 train=types.SimpleNamespace(recompute="full", ep_overlap_chunks=1))
    with pytest.raises(LayoutError, match="context parallel needs a process group"):
        parallelize(build_model(PRESETS["tiny-moe"]), plan, None)



@pytest.mark.parametrize("cp", [2, 3])
def test_chunked_attention_by_piece_equals_the_whole_sequence(cp):
    """Llama 4's chunked attention under CP: each rank's queries, cut into pieces where a run of `chunk` positions
    of their document ends (`ContextShard.chunked`) and attended against the whole micro-batch's keys piece by piece
    (the kernel path GPUs take), and by the dense mask of the runs (the CPU path), equal the whole sequence's
    chunked attention (`Packing.chunked`) at the rank's tokens; runs cross segment edges and documents start
    mid-run of the segments."""
    from launch.context_parallel import _attention_by_piece
    from launch.model import causal_attention

    lengths, chunk = [9, 30, 4, 21], 8  # 64 tokens: segments of 16 (cp 2) or 11 (cp 3, padded to 66)
    batch = _batch(lengths)
    gen = torch.Generator().manual_seed(4)
    Tp = padded_length(64, cp, 1)
    q, k, v = (torch.randn(Tp, 4, 8, generator=gen) for _ in range(3))
    whole = Packing.from_lengths(lengths + ([Tp - 64] if Tp > 64 else []))
    want = causal_attention(q, k, v, whole.chunked(chunk), 0.3)
    assert not torch.allclose(want, causal_attention(q, k, v, whole, 0.3), atol=1e-3)  # the runs matter
    crossing = 0
    for rank in range(cp):
        shard = shard_batch(batch, rank, cp).packing.cp
        runs = shard.chunked(chunk)
        crossing += sum(1 for _, n, a, start in runs.pieces if a > start)  # a piece whose run began before it
        got = _attention_by_piece(q[shard.index], k, v, runs, 0.3)
        torch.testing.assert_close(got, want[shard.index], atol=1e-5, rtol=1e-5)
        qi = shard.index
        mask = (runs.doc[qi][:, None] == runs.doc[None, :]) & (torch.arange(Tp)[None, :] <= qi[:, None])
        dense = torch.nn.functional.scaled_dot_product_attention(
            q[qi].transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], attn_mask=mask,
            scale=0.3)[0].transpose(0, 1)
        torch.testing.assert_close(dense, want[qi], atol=1e-5, rtol=1e-5)
    assert crossing > 0


def test_values_narrower_than_the_heads_by_piece_equal_the_whole_sequence():
    """MiMo-V2-Flash's values (narrower than q·k) at their own width under CP: each rank's queries against the whole
    micro-batch's keys piece by piece, GQA inside the kernel, equal the whole sequence's attention at the rank's
    tokens, outputs at the values' width."""
    from launch.context_parallel import _attention_by_piece
    from launch.model import causal_attention

    lengths = [9, 30, 4, 21]
    batch = _batch(lengths)
    gen = torch.Generator().manual_seed(5)
    q, k, v = torch.randn(64, 4, 12, generator=gen), torch.randn(64, 2, 12, generator=gen), torch.randn(
        64, 2, 8, generator=gen)
    want = causal_attention(q, k, v, Packing.from_lengths(lengths), 0.3)
    assert want.shape == (64, 4, 8)
    for rank in range(2):
        shard = shard_batch(batch, rank, 2).packing.cp
        got = _attention_by_piece(q[shard.index], k, v, shard, 0.3)
        torch.testing.assert_close(got, want[shard.index], atol=1e-5, rtol=1e-5)
