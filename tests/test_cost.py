"""The cost model against the seed's arithmetic and hand-worked cases; relations, not calibrated GB."""

from __future__ import annotations

import dataclasses
import itertools

import pytest

import recipe.sweep as sweep_mod
from recipe.cost import (BF16, BYTES_UNSHARDED, EP_CHUNK_COUNTS, FP32, GB, Layout, TrainOptions, default_ep_chunks,
                         ep_copy_bytes, ep_layer_times, ep_dispatch_bytes, ep_overlap_time, estimate, forward_flops_per_token, layer_params,
                         layer_saved, layer_working_set, lm_head_bytes, moe_moments, overlap_efficiency, routed_row_bytes,
                         stage_params)
from recipe.hw import all_profiles, load_profile
from recipe.models import PRESETS, active_matmul_params, param_counts, resolve_model, total_params
from recipe.plan import Inputs, build_plan, dumps, parse_plan
from recipe.solver import Decision, Solution

Q35 = PRESETS["qwen35-35b"]
H100 = load_profile("h100")
MI300X = load_profile("mi300x")


def opts(seq: int, **kw) -> TrainOptions:
    return TrainOptions(micro_batch_tokens=seq, **kw)


# ---- LM head: the seed's 16.27 / 32.55 GB -------------------------------------------------------------------
def test_unfused_logits_seed_arithmetic():
    """65,536 tokens × 124,160 vocab (248,320 on a TP=2 shard) × 2 bytes = 16.27 GB; with the gradient 32.55 GB."""
    assert Q35.vocab_size == 248_320 and Q35.vocab_size // 2 == 124_160
    per_copy = 65_536 * 124_160 * 2
    assert round(per_copy / GB, 2) == 16.27
    assert round(2 * per_copy / GB, 2) == 32.55  # what a plan reports as lm_head_unfused_gb
    # what the naive head as the trainer runs it holds at its peak, in its backward: the saved fp32 log-softmax, the
    # fp32 gradient coming back to it and the one it passes on (the grid's naive points ran out of memory at 32K
    # where the bf16 figure predicted they fit; measured 11.7 bytes a logit at 8K)
    assert lm_head_bytes(Q35, 65_536, tp=2, mode="naive") == 65_536 * 124_160 * (4 + 4 + 4)


def test_fused_head_is_a_tile_not_the_logits():
    fused = lm_head_bytes(Q35, 65_536, tp=2, mode="fused")
    # hand-worked: the 4096-token group's fp16 tile weights of the 124,160-row shard (1.02 GB, inside the 2 GiB
    # budget) + fp32 dW and fp16 W copies of the shard + fp32 dH
    v, h = 124_160, Q35.hidden_size
    assert fused == pytest.approx(4096 * v * 2 + v * h * 6 + 65_536 * h * 4)
    assert round(fused / GB, 2) == 3.08  # 1.02 + 1.53 + 0.54 GB
    # a vocabulary whose 4096-token group would pass the budget: the group shrinks to fit it (2 GiB / (2 B x V),
    # in multiples of 256: 1024 tokens at V = 1M)
    big = Q35.model_copy(update={"vocab_size": 1_048_576})
    assert lm_head_bytes(big, 65_536, 1, "fused") == pytest.approx(
        1024 * 1_048_576 * 2 + 1_048_576 * h * 6 + 65_536 * h * 4)
    assert fused < 0.15 * lm_head_bytes(Q35, 65_536, tp=2, mode="naive")
    # the fp32 dH term grows with s; the logits group does not
    assert lm_head_bytes(Q35, 131_072, 2, "fused") - fused == pytest.approx(65_536 * Q35.hidden_size * FP32)


def test_lean_head_holds_its_two_gradients():
    # hand-worked: dW of the 124,160-row shard and dH of 65,536 tokens in bf16, plus 4 MiB; its forward's tile
    # statistics (12 B x 65,536 x 485 tiles = 0.38 GB, capped at 256 MiB) are less
    v, h = 124_160, Q35.hidden_size
    lean = lm_head_bytes(Q35, 65_536, tp=2, mode="lean")
    assert lean == pytest.approx((v + 65_536) * h * 2 + 4 * 2**20)
    assert round(lean / GB, 2) == 0.78 and lean < 0.3 * lm_head_bytes(Q35, 65_536, tp=2, mode="fused")
    # a few tokens on a large shard: the forward's statistics bound it
    assert lm_head_bytes(Q35, 512, tp=1, mode="lean") == pytest.approx((248_320 + 512) * h * 2 + 4 * 2**20)
    with pytest.raises(ValueError, match="lm_head mode"):
        lm_head_bytes(Q35, 512, tp=1, mode="liger")
    # in the estimate: the head's component shrinks, its time grows by the measured 2.2x (6.6 passes against 3)
    m4 = Q35.with_layers(4)
    f = estimate(m4, load_profile("h200"), 1, Layout(), opts(16_384, recompute="none"))
    le = estimate(m4, load_profile("h200"), 1, Layout(), opts(16_384, recompute="none", lm_head="lean"))
    # without recompute the head's component is what it holds beyond the backward's peak: swapping heads moves it
    # by the difference of what they hold, down to zero
    assert le.lm_head_own_gb == pytest.approx(lm_head_bytes(m4, 16_384, 1, "lean") / GB)
    assert le.memory_gb["lm_head"] == pytest.approx(max(0.0, f.memory_gb["lm_head"]
                                                        - (f.lm_head_own_gb - le.lm_head_own_gb)))
    assert f.memory_gb["lm_head"] > 2.5 and le.memory_gb["lm_head"] == 0.0
    assert le.step_time_s > f.step_time_s
    with pytest.raises(ValueError, match="lm_head must be one of fused, lean, naive"):
        opts(512, lm_head="liger")


def test_fused_head_adds_only_what_exceeds_the_layer_working_set():
    # under full recompute the head runs when only the checkpoints are live: its component is what it needs
    # beyond a layer's working set (often nothing); without recompute every layer's activations are live with it
    m4 = Q35.with_layers(4)
    full = estimate(m4, load_profile("h200"), 1, Layout(), opts(32_768))
    assert full.memory_gb["lm_head"] == 0.0
    none = estimate(m4, load_profile("h200"), 1, Layout(), opts(32_768, recompute="none"))
    # without recompute the gradients arrive a layer at a time: the backward peaks at the last layer (every saved
    # set, the head's and that layer's gradients); the head runs before any layer gradient exists, with every saved
    # set live, and adds what that moment needs beyond the backward's peak
    # (the last layer's backward moment is its FFN's peak in place of its saved set; the layer's expert gradients
    # form after that peak)
    # (each layer also keeps its input, which its input norm saves: a checkpoint under recompute)
    mixer, ffn = layer_saved(m4, 32_768, 1, 1)
    ffn_in = ffn + 32_768 * m4.hidden_size * BF16
    c = param_counts(m4)
    grads, head_grad = none.memory_gb["grads"] * GB, c["head"] * BF16
    layer_grad = (grads - head_grad - c["embedding"] * BF16) / 4
    working = layer_working_set(m4, 32_768, 1, 1, expert_grad=layer_params(m4)[1] * BF16)
    acts = 4 * (mixer + ffn_in) + (working - mixer - ffn) - (grads - head_grad - layer_grad)
    assert none.memory_gb["activations"] == pytest.approx(acts / GB)
    head_moment = 4 * (mixer + ffn_in) + lm_head_bytes(m4, 32_768, 1, "fused") - (grads - head_grad)
    assert none.memory_gb["lm_head"] == pytest.approx((head_moment - acts) / GB)
    assert none.memory_gb["lm_head"] < lm_head_bytes(m4, 32_768, 1, "fused") / GB


def test_moe_moments_by_hand():
    # Qwen3-30B-A3B (h 2048, 128 experts, top-8, expert f 768, no shared expert) at 131,072 tokens. Per token, live
    # through the block's backward: the post-norm's input and row scale (2048·2 + 4), its output (2048·2), the
    # router's fp32 probabilities (128·4), the top-k weights in fp32 and bf16 and the indices (8·14) and 4 bytes:
    # 8,824. A routed row saves x, gate and up, y (bf16) and its order: (2·2048 + 2·768)·2 + 8 = 11,272 bytes; its
    # backward's larger moment is the SwiGLU's (4·768·2 = 6,144 > 2048·2). Once the weight gradients form, the
    # saved rows are freed (launch/moe.py frees them at their last use, recompute or not) and the input gradient's
    # rows are held twice: 2·2048·2 bytes a row.
    m, s = resolve_model("qwen3-30b-a3b"), 131_072
    assert routed_row_bytes(m) == (11_272, 6_144)
    saved, before, after = moe_moments(m, s)
    assert saved == s * (8_824 + 8 * 11_272)
    assert before == s * (8_824 + 8 * 11_272 + 8 * 6_144)
    assert after == s * (8_824 + 8 * 2 * 2048 * 2)


def test_plan_reports_unfused_head_at_tp2():
    """A plan at 128K tokens, CP=2 (65,536 local tokens), TP=2 records the seed's 32.55 GB."""
    world, layout, o = 32, Layout(tp=2, cp=2, ep=8), opts(131_072, ep_overlap_chunks=32)
    est = estimate(Q35, MI300X, world, layout, o)
    assert round(est.lm_head_unfused_gb, 2) == 32.55
    decisions = {k: Decision(getattr(layout, k), "test", "hand-built layout") for k in ("tp", "ep", "cp", "pp")}
    sol = Solution(world=world, layout=layout, opts=o, estimate=est, decisions=decisions)
    inputs = Inputs(model="qwen35-35b", seq_len=131_072, hw="mi300x", gpus=world)
    plan = build_plan(inputs, Q35, MI300X, sol)
    assert plan.prediction.lm_head_unfused_gb == 32.55
    assert parse_plan(dumps(plan)).prediction.lm_head_unfused_gb == 32.55
    assert plan.layout.dp == 8 and plan.layout.edp == 4


# ---- FLOPs: 6N / 8N, the quadratic term ---------------------------------------------------------------------
def test_forward_matmul_flops_are_2n():
    f = forward_flops_per_token(Q35, 131_072)
    assert f["matmul_layers"] + f["head"] == pytest.approx(2 * active_matmul_params(Q35), rel=1e-9)


def test_full_recompute_is_8n_vs_6n():
    est = estimate(Q35, H100, 32, Layout(cp=2, ep=8), opts(131_072))
    f = est.flops_per_token
    assert f["model"] == pytest.approx(3 * f["forward"])  # 6N: forward 2N + backward 4N
    # 8N for the decoder layers (the recompute runs their forward again); the fused head forms its gradients in
    # its one forward (three GEMMs) and is not recomputed: 6N there
    layers = f["forward"] - f["head"]
    assert f["hardware"] == pytest.approx(4 * layers + 3 * f["head"])
    assert (f["hardware"] - 3 * f["head"]) / (f["model"] - 3 * f["head"]) == pytest.approx(4 / 3)  # +33%
    # matmul part alone, N = active matmul params: 8N / 6N
    n = active_matmul_params(Q35)
    assert 4 * (f["matmul_layers"] + f["head"]) == pytest.approx(8 * n)
    no_rc = estimate(Q35, H100, 32, Layout(cp=2, ep=8), opts(131_072, recompute="none", lm_head="naive"))
    assert no_rc.flops_per_token["hardware"] == pytest.approx(no_rc.flops_per_token["model"])


def test_attention_quadratic_term_only_for_full_attention_layers():
    # qwen35-35b: 10 full-attention layers of 16 heads × (256 + 256), causal → seq/2 keys on average
    for seq in (8192, 131_072):
        f = forward_flops_per_token(Q35, seq)
        assert f["attention"] == pytest.approx(2 * 16 * (256 + 256) * 10 * seq / 2)
    # Gated DeltaNet is linear in the sequence: its per-token FLOPs do not depend on seq
    assert forward_flops_per_token(Q35, 8192)["linear_attention"] == forward_flops_per_token(Q35, 262_144)[
        "linear_attention"]
    # doubling seq doubles the per-token attention term and leaves the matmuls alone
    a, b = forward_flops_per_token(Q35, 65_536), forward_flops_per_token(Q35, 131_072)
    assert b["attention"] == pytest.approx(2 * a["attention"])
    assert b["matmul_layers"] == a["matmul_layers"]
    # gpt-oss: the sliding layers see at most their 128-token window, the full layers seq/2
    g = PRESETS["gpt-oss-120b"]
    fg = forward_flops_per_token(g, 131_072)
    assert fg["attention"] == pytest.approx(2 * 64 * (64 + 64) * (18 * 131_072 / 2 + 18 * 128))


# ---- MFU over the dense peak only -----------------------------------------------------------------------------
def test_mfu_is_over_the_dense_peak():
    """186 TFLOP/s on an H100 is 18.8% of the 989.4 dense peak (9.4% against the 2:4-sparse 1979 would be wrong)."""
    assert H100.peak_bf16_tflops == pytest.approx(989.4)
    assert round(100 * 186 / H100.peak_bf16_tflops, 1) == 18.8
    est = estimate(Q35, H100, 32, Layout(cp=2, ep=8), opts(131_072))
    assert est.mfu_hardware == pytest.approx(est.tflops_per_gpu / H100.peak_bf16_tflops)
    f = est.flops_per_token
    assert est.mfu_model == pytest.approx(est.mfu_hardware * f["model"] / f["hardware"])
    assert 0.75 < est.mfu_model / est.mfu_hardware < 0.8  # 3/4 for the layers, 1 for the head


@pytest.mark.parametrize("name, dense_max", [("h100", 1000), ("h200", 1000), ("b200", 2300), ("mi300x", 1310),
                                             ("mi325x", 1310), ("mi355x", 2600)])
def test_no_profile_uses_a_sparse_peak(name, dense_max):
    assert load_profile(name).peak_bf16_tflops < dense_max


def test_every_profile_cites_its_peak():
    for p in all_profiles():
        assert "peak_bf16_tflops" in p.sources and p.usable_gb < p.hbm_gb + 1e-9


# ---- chunked EP overlap --------------------------------------------------------------------------------------
def test_overlap_efficiency_seed_figures():
    assert [round(overlap_efficiency(k), 2) for k in (8, 16, 32)] == [0.89, 0.94, 0.97]
    assert overlap_efficiency(1) == 0.5


def test_ep_overlap_time_is_max_plus_one_ramp():
    # comm = gemm: perfect overlap would cost 1.0; k chunks add one ramp/drain of 1/k → efficiency k/(k+1)
    for k in (1, 2, 8, 16, 32):
        assert 1.0 / ep_overlap_time(1.0, 1.0, k) == pytest.approx(overlap_efficiency(k))
    assert ep_overlap_time(3.0, 1.0, 1) == 4.0  # k=1: serial
    assert ep_overlap_time(3.0, 1.0, 4) == 3.25  # comm-bound: the gemm hides, one chunk of it shows


def test_default_ep_chunks_worked_by_hand():
    """qwen35-35b on 8 H200s at ep = 8, 64K tokens a rank, full recompute. One all-to-all transfer moves
    s·k·h·2·(ep − 1)/ep = 65,536 · 8 · 2048 · 2 · 7/8 bytes at the in-node bus bandwidth, A = 5.22 ms; the expert
    GEMMs of one pass take G = 9.94 ms: 524,288 routed rows' 3.30 TFLOP at 0.838 of 989.4 TF/s (3.98 ms), their
    5.91 GB of rows (2h + 3f = 5632 bf16 values each) at 0.21 of 4.8 TB/s (5.86 ms) and the 32 local experts'
    0.20 GB of weights at 0.404 of it (0.10 ms). Per MoE layer the passes carry 2, 1 and 2 transfers, and each
    chunk beyond the first costs 0.63 ms a pass:
        cost(k) = 2·(2A − G) + (2G + A)/k + 3·0.63·(k − 1)     (2A > G in the two two-transfer passes)
        k = 1: 26.1   k = 2: 15.4   k = 4: 12.9   k = 8: 17.4   k = 16: 30.9 ms
    so 4 chunks, where 2048-token chunks would be 32."""
    h200 = load_profile("h200")
    lay, o = Layout(ep=8), opts(65_536)
    a, g, transfers = ep_layer_times(Q35, h200, 8, lay, o)
    s, k, h = 65_536, Q35.top_k, Q35.hidden_size
    assert a == pytest.approx(s * k * h * 2 * 7 / 8 / (h200.intra_node.bw_gb_s * 1e9))
    eff, rows = h200.efficiency, s * k
    g_hand = (rows * 6 * h * 512 / (989.4e12 * eff.expert_gemm) + rows * (2 * h + 3 * 512) * 2 / (4.8e12 * eff.expert_rows)
              + 32 * 3 * h * 512 * 2 / (4.8e12 * eff.expert_weights))
    assert g == pytest.approx(g_hand)
    assert (round(a * 1e3, 2), round(g * 1e3, 2), transfers) == (5.22, 9.94, [2, 1, 2])
    c = h200.efficiency.ep_chunk_ms * 1e-3
    cost = {n: 2 * (2 * a - g) + (2 * g + a) / n + 3 * c * (n - 1) for n in EP_CHUNK_COUNTS}
    assert [round(cost[n] * 1e3, 1) for n in (1, 2, 4, 8, 16)] == [26.1, 15.4, 12.9, 17.4, 30.9]
    assert default_ep_chunks(Q35, h200, 8, lay, o) == min(cost, key=cost.get) == 4


@pytest.mark.parametrize("hw", ["h100", "mi300x"])
def test_default_ep_chunks_minimizes_the_step(hw):
    """The chosen count gives the least step time of the estimate itself (which charges both the exposed
    all-to-all and the chunk loop), over every count with chunks of at least 2048 tokens, with every layer recomputed,
    none, or some kept (their MoE layers' 4 transfers over 2 passes against a recomputed one's 5 over 3); at ep = 1
    it is 1."""
    prof = load_profile(hw)
    for seq, lay, world, keep in ((8_192, Layout(ep=8), 8, 0), (65_536, Layout(ep=8), 8, 0),
                                  (262_144, Layout(cp=2, ep=8), 16, 0), (131_072, Layout(ep=32), 32, 0),
                                  (65_536, Layout(), 8, 0), (65_536, Layout(ep=8), 8, 30),
                                  (32_768, Layout(ep=8), 8, 39), (131_072, Layout(pp=2, ep=8), 16, 12)):
        o = opts(seq).model_copy(update={"keep_layers": keep})
        k = default_ep_chunks(Q35, prof, world, lay, o)
        steps = {n: estimate(Q35, prof, world, lay, o.model_copy(update={"ep_overlap_chunks": n})).step_time_s
                 for n in EP_CHUNK_COUNTS if n == 1 or seq / lay.cp / n >= 2048}
        assert steps[k] == min(steps.values()), (hw, seq, lay, k, steps)
        if lay.ep == 1:
            assert k == 1
    assert default_ep_chunks(Q35, prof, 8, Layout(ep=8), opts(2048)) == 1  # one chunk's worth of tokens


def test_free_chunks_take_the_most_2048_token_chunks(monkeypatch):
    """With the chunk loop free, more chunks always hide more: the count is the largest with 2048-token chunks
    (32 at most), as the overlap model alone would have it."""
    import dataclasses

    h200 = load_profile("h200")
    free = dataclasses.replace(h200, efficiency=dataclasses.replace(h200.efficiency, ep_chunk_ms=1e-6))
    assert [default_ep_chunks(Q35, free, 8, Layout(ep=8), opts(s)) for s in (16_384, 32_768, 65_536, 1 << 20)] \
        == [8, 16, 32, 32]


def test_chunked_overlap_lowers_exposed_ep_time():
    lay = Layout(cp=2, ep=8)
    t = [estimate(Q35, H100, 32, lay, opts(131_072, ep_overlap_chunks=k)).time_s["ep_exposed"] for k in (1, 8, 32)]
    assert t[0] > t[1] > t[2] >= 0


# ---- the grid: 3 values over 4 dimensions is 81 configs ------------------------------------------------------
def test_three_values_per_dimension_is_81(monkeypatch):
    monkeypatch.setattr(sweep_mod, "pp_candidates", lambda m, world: [1, 2, 4])
    monkeypatch.setattr(sweep_mod, "tp_candidates", lambda m, hw, ranks: [1, 2, 4])
    monkeypatch.setattr(sweep_mod, "ep_candidates", lambda m, ranks: [2, 4, 8])
    monkeypatch.setattr(sweep_mod, "cp_candidates", lambda m, seq, ranks, tp: [1, 2, 4])
    pts = sweep_mod.grid(Q35, H100, 64, opts(32_768))
    assert len(pts) == 3 ** 4 == 81 == len(list(itertools.product([1, 2, 4], repeat=4)))
    assert len({p.layout for p in pts}) == 81


# ---- memory by component and its sharding group --------------------------------------------------------------
PERSISTENT = ("weights", "grads", "master", "optimizer")


def test_persistent_state_16_bytes_per_param_over_the_world():
    """With pp=1 every parameter ends up on world/... ranks: dense over tp·dp·cp, experts over ep·edp."""
    world = 32
    est = estimate(Q35, H100, world, Layout(cp=2, ep=8), opts(131_072))
    per_param = {"weights": BF16, "grads": BF16, "master": FP32, "optimizer": 2 * FP32}
    for k, b in per_param.items():
        assert est.memory_gb[k] == pytest.approx(total_params(Q35) * b / world / GB)
    assert sum(per_param.values()) == 16


def test_sharding_groups_hand_worked_tiny():
    """tiny-moe on 8 ranks, tp=1, cp=2, ep=2 → dp=4, edp=4. Dense state and FSDP traffic go over dp·cp = 8
    ranks; routed experts are split by ep=2 first and their FSDP shards spread over edp=4."""
    m = PRESETS["tiny-moe"]
    c = param_counts(m)
    dense = total_params(m) - c["routed_experts"]
    experts = c["routed_experts"]
    world, lay = 8, Layout(cp=2, ep=2)
    assert (lay.dp(world), lay.edp(world)) == (4, 4)
    est = estimate(m, H100, world, lay, opts(4096))
    assert est.memory_gb["master"] == pytest.approx((dense / (1 * 4 * 2) + experts / (2 * 4)) * FP32 / GB)
    # FSDP2 per step: gather bf16 twice (forward, backward) and reduce-scatter fp32 over each group
    fsdp = dense * (8 - 1) / 8 * (2 * BF16 + FP32) + experts / 2 * (4 - 1) / 4 * (2 * BF16 + FP32)
    assert est.comm_bytes["fsdp"] == pytest.approx(fsdp)
    # the unsharded FSDP2 unit: one layer's dense part whole, its experts only the ep-local E/ep
    layer_dense, layer_expert = layer_params(m)
    assert layer_expert == pytest.approx(experts / m.num_layers)
    s = 4096 / 2
    # ep > 1: the EP path's backward copies (ep_dispatch_bytes) join the layer's working set, whose expert
    # gradients (the layer's E/ep experts, sharded over edp) form after its peak; the untied embedding's gradient
    # (over dp·cp) forms after every layer's. The checkpoints: the last layer's backward holds all four beside one
    # layer's gradients (L·c − (L − 1)·g), the first's one beside every layer's (c), counted against every gradient
    assert not m.tie_embeddings
    ends = c["embedding"] + c["head"]
    g = ((dense - ends) / 8 + experts / 8) * BF16 / m.num_layers  # one layer's local gradients
    ckpt = s * m.hidden_size * BF16
    assert m.num_layers * ckpt - (m.num_layers - 1) * g > ckpt
    expected_acts = (m.num_layers * ckpt - (m.num_layers - 1) * g
                     + layer_working_set(m, s, 1, 2, expert_grad=layer_expert / (2 * 4) * BF16)
                     + ep_dispatch_bytes(m, s) + (layer_dense + layer_expert / 2) * BYTES_UNSHARDED
                     - c["embedding"] / 8 * BF16)
    assert est.memory_gb["activations"] == pytest.approx(expected_acts / GB)


def test_experts_split_by_ep_not_by_dp_cp():
    """At pp=2 the largest stage of the plan's split holds its layers' experts, divided over ep·edp = world/pp
    whatever ep is."""
    from recipe.cost import pipeline_split, stage_layers

    world = 32
    largest = stage_layers(Q35, 2, opts(8192), H100)
    assert largest == max(pipeline_split(Q35, 2, opts(8192), H100)) > Q35.num_layers / 2  # the head's holds fewer
    for ep in (1, 4, 8, 16):
        est = estimate(Q35, H100, world, Layout(pp=2, ep=ep), opts(8192))
        dense, experts, ends = stage_params(Q35, 2, largest)
        local = (dense + ends) / (world // 2) + experts / (world // 2)
        assert est.memory_gb["weights"] == pytest.approx(local * BF16 / GB)
    assert experts == pytest.approx(param_counts(Q35)["routed_experts"] * largest / Q35.num_layers)


def test_pipeline_memory_is_the_largest_stages():
    """An uneven split (8 layers of Qwen3.5-35B at 32K on the H100: the head weighs like several layers, so the
    first stage holds more) is priced at its largest stage, not at L/pp = 4."""
    from recipe.cost import pipeline_split

    m, o = Q35.with_layers(8), opts(32768)
    split = pipeline_split(m, 2, o, H100)
    assert split[0] > split[1]
    est = estimate(m, H100, 2, Layout(pp=2), o)
    dense, experts, ends = stage_params(m, 2, max(split))
    assert est.memory_gb["weights"] == pytest.approx((dense + ends + experts) * BF16 / GB)
    assert stage_params(m, 2, max(split))[1] > stage_params(m, 2)[1]


def test_pipeline_step_is_the_slowest_stages():
    """Under PP every slot waits for the slowest stage: the step's compute per micro-batch is that stage's layers'
    work at their rates plus the head only where it lives — the same seconds stage_costs gives the split — and the
    step is (micro-batches + pp − 1) slots plus the optimizer. 8 layers of Qwen3.5-35B at 32K on the H200."""
    from recipe.cost import compute_times, compute_work, slowest_stage, stage_costs

    h200 = load_profile("h200")
    m, o = Q35.with_layers(8), opts(32768, micro_batches=3)
    stage, has_head = slowest_stage(m, 2, o, h200)
    costs, _, head = stage_costs(m, 32768, o, h200)
    per_stage = [sum(costs[:5]), sum(costs[5:]) + head]  # the split 5 + 3: the head weighs like ~2 layers
    assert list(stage) == [5, 6, 7] and has_head and per_stage[1] >= per_stage[0]
    t_mb = sum(compute_times(compute_work(m, Layout(pp=2), o, False, h200), h200, m).values())
    assert t_mb == pytest.approx(32768 * per_stage[1], rel=1e-9)
    est = estimate(m, h200, 2, Layout(pp=2), o)
    slot = t_mb + est.time_s["pp_p2p"] / 3
    assert est.step_time_s == pytest.approx(slot * (3 + 1) + est.time_s["optimizer"], rel=1e-9)
    # one stage: all of it, the head included
    assert sum(compute_times(compute_work(m, Layout(), o, False, h200), h200, m).values()) == pytest.approx(
        32768 * (sum(costs) + head), rel=1e-9)


def test_pipeline_exchanges_are_the_slowest_stages():
    """Under PP the CP bytes count the slowest stage's layers, not L/pp of each kind: 8 layers of Qwen3.5-35B at
    32K, pp = 2, cp = 2 on the H200 — the slowest stage holds layers 5–7 and the head: two Gated DeltaNet layers and
    one full attention layer. Per pass (3 under full recompute): the attention layer all-gathers s·(cp−1) tokens of K and V;
    each Gated DeltaNet layer (cp−1) segment-map pairs and conv halos."""
    from recipe.cost import communication_terms, slowest_stage

    h200 = load_profile("h200")
    m, o = Q35.with_layers(8), opts(32768)
    assert slowest_stage(m, 2, o, h200) == (range(5, 8), True)
    la, s = m.linear_attn, 32768 / 2
    kv = 2 * m.num_kv_heads * m.head_dim * BF16
    maps = 2 * la.num_v_heads * la.head_k_dim * (la.head_v_dim + la.head_k_dim) * FP32
    halo = (la.conv_kernel - 1) * (2 * la.num_k_heads * la.head_k_dim + la.num_v_heads * la.head_v_dim) * BF16
    comm, _ = communication_terms(m, h200, 4, Layout(pp=2, cp=2), o)
    assert comm["cp"] == pytest.approx(3 * (1 * s * kv + 2 * (maps + 2 * halo)), rel=1e-12)


def test_cp_combine_charge_matches_its_h200_measurement():
    """The combine's charge in plain delta-rule passes, at Qwen3.5-35B's head shape (d_k = d_v = 128, C = 64,
    32 value heads, 32,768 tokens a rank): what bench/bench_cp_gdn.py measured on one H200 with fla, 0.73 / 0.84
    / 0.93 plain passes at cp = 2 / 4 / 8 (docs/BENCHMARKS.md). By hand at cp = 2: the FLOPs are one plain pass
    (6·128² + 4·64·128 + 2·128² = 6·128² + 4·64·256) plus the fold's 3·2·128³ per head, taking 0.642 of the rate's
    time, plus 0.094 of a pass for log2(2) = 1."""
    from recipe.cost import cp_combine_seconds, delta_rule_flops_per_token_head

    la, s, rate = Q35.linear_attn, 32768, 1e12
    plain = s * 32 * delta_rule_flops_per_token_head(la) / rate
    fold = 3 * 32 * 2 * 128 ** 3 / rate
    assert cp_combine_seconds(s, 32, la, 2, rate) == pytest.approx((plain + fold) * 0.642 + 0.094 * plain, rel=1e-12)
    for cp, measured in ((2, 0.734), (4, 0.839), (8, 0.928)):
        assert cp_combine_seconds(s, 32, la, cp, rate) / plain == pytest.approx(measured, rel=0.01)


def test_cp_time_charges_the_combine_per_linear_layer_and_forward_equivalent():
    """t_cp = bytes / bw + per Gated DeltaNet layer (4 forward-equivalents under full recompute) × the combine, plus
    two collective latencies per pass: 8 layers of Qwen3.5-35B, cp = 2, one stage, 32K."""
    from recipe.cost import COLLECTIVE_LATENCY_S, communication_terms, cp_combine_seconds, group_bw, rates

    h200 = load_profile("h200")
    m, o = Q35.with_layers(8), opts(32768)
    comm, t = communication_terms(m, h200, 2, Layout(cp=2), o)
    n_lin = m.num_linear_attn_layers
    combine = cp_combine_seconds(16384, m.linear_attn.num_v_heads, m.linear_attn, 2, rates(h200)["delta_rule"])
    expect = comm["cp"] / group_bw(h200, 2, 1, 2) + n_lin * (4 * combine + 3 * 2 * COLLECTIVE_LATENCY_S)
    assert t["cp"] == pytest.approx(expect, rel=1e-12)


def test_unsharded_expert_layer_shrinks_with_ep():
    a = [estimate(Q35, MI300X, 32, Layout(ep=ep), opts(8192)).memory_gb["activations"] for ep in (1, 2, 8, 32)]
    assert a == sorted(a, reverse=True)
    _, layer_expert = layer_params(Q35)
    # ep = 2 halves the unsharded expert layer and adds the EP path's backward copies (none at ep = 1)
    assert (a[0] - a[1]) * GB == pytest.approx(layer_expert / 2 * BYTES_UNSHARDED - ep_dispatch_bytes(Q35, 8192))
    assert (a[1] - a[2]) * GB == pytest.approx(layer_expert * (1 / 2 - 1 / 8) * BYTES_UNSHARDED)


def test_activations_scale_about_inverse_cp_persistent_does_not():
    ests = {cp: estimate(Q35, MI300X, 32, Layout(cp=cp, ep=8), opts(131_072)) for cp in (1, 2, 4, 8)}
    for k in PERSISTENT:
        assert len({round(e.memory_gb[k], 9) for e in ests.values()}) == 1, k
    acts = [ests[c].memory_gb["activations"] for c in (1, 2, 4, 8)]
    for lo, hi in zip(acts, acts[1:]):
        assert 0.45 < hi / lo < 0.6
    # the checkpoint term exactly: one layer input per layer, s/cp·h·2 bytes
    ck = lambda c: Q35.num_layers * 131_072 / c * Q35.hidden_size * BF16  # noqa: E731
    assert ck(1) / GB == pytest.approx(21.47, abs=0.01)
    d12 = (acts[0] - acts[1]) * GB
    ws = layer_working_set(Q35, 131_072, 1, 1) - layer_working_set(Q35, 65_536, 1, 2)
    ep_copies = ep_dispatch_bytes(Q35, 131_072) - ep_dispatch_bytes(Q35, 65_536)  # ep = 8: the EP path's copies
    assert d12 == pytest.approx(ck(1) - ck(2) + ws + ep_copies)


def test_recompute_none_keeps_every_layer():
    lay, o = Layout(cp=2, ep=8), opts(32_768)
    full = estimate(Q35, MI300X, 32, lay, o).memory_gb["activations"]
    none = estimate(Q35, MI300X, 32, lay, o.model_copy(update={"recompute": "none"})).memory_gb["activations"]
    assert none > 5 * full


def test_total_is_the_sum_and_fits_against_usable():
    est = estimate(Q35, H100, 32, Layout(cp=2, ep=8), opts(131_072))
    parts = ("weights", "grads", "master", "optimizer", "activations", "lm_head", "overhead")
    assert est.memory_gb["total"] == pytest.approx(sum(est.memory_gb[k] for k in parts))
    assert est.memory_gb["usable"] == pytest.approx(H100.hbm_gib * 2**30 / 1e9 * H100.usable_memory_fraction)
    assert est.fits == (est.memory_gb["total"] <= est.memory_gb["usable"])


# ---- time -----------------------------------------------------------------------------------------------------
def test_pp_bubble_fraction():
    m, o = Q35, opts(8192, micro_batches=8)
    for p in (2, 4):
        est = estimate(m, H100, 32, Layout(pp=p, ep=8), o)
        t = est.time_s
        assert t["pp_bubble"] / (est.step_time_s - t["optimizer"]) == pytest.approx((p - 1) / (8 + p - 1))
    assert estimate(m, H100, 32, Layout(ep=8), o).time_s["pp_bubble"] == 0


def test_ep_all_to_all_bytes_hand_worked():
    """Per micro-batch per MoE layer: s·k·h·2 bytes a transfer, (ep−1)/ep of them leave the rank; the forward
    dispatches and combines, the backward sends and returns, and under full recompute the recomputed forward only
    dispatches (launch/expert_parallel.py): 5 transfers, 4 without recompute."""
    s, ep = 65_536, 8
    one = s * 8 * 2048 * BF16 * (ep - 1) / ep
    est = estimate(Q35, H100, 32, Layout(cp=2, ep=ep), opts(131_072))
    assert est.comm_bytes["ep_all_to_all"] == pytest.approx(40 * 5 * one)
    est = estimate(Q35, H100, 32, Layout(cp=2, ep=ep), opts(131_072, recompute="none"))
    assert est.comm_bytes["ep_all_to_all"] == pytest.approx(40 * 4 * one)


def test_ep_exposed_time_counts_each_pass_transfers():
    """Unchunked (k = 1) the overlap is serial, so the exposed time is the transfers' time: 5 a layer under full
    recompute, each a2a / bw(ep)."""
    from recipe.cost import group_bw

    s, ep = 65_536, 8
    a2a = s * 8 * 2048 * BF16 * (ep - 1) / ep
    est = estimate(Q35, H100, 32, Layout(cp=2, ep=ep), opts(131_072, ep_overlap_chunks=1))
    assert est.time_s["ep_exposed"] == pytest.approx(40 * 5 * a2a / group_bw(H100, ep, 1, 8), rel=1e-9)


def test_tokens_and_step_time_consistent():
    world, lay, o = 32, Layout(cp=2, ep=8), opts(131_072)
    est = estimate(Q35, H100, world, lay, o)
    # dp·cp ranks share one 131,072-token micro-batch per dp rank: tokens/s/GPU = seq·dp / step / world
    assert est.tokens_per_s_per_gpu == pytest.approx(131_072 * lay.dp(world) / est.step_time_s / world)
    assert est.step_time_s == pytest.approx(sum(est.time_s.values()))


# ---- step time from its parts ---------------------------------------------------------------------------------
def test_profile_without_efficiencies_keeps_one_compute_efficiency():
    """No efficiencies, measured or taken (a user's profile with compute_efficiency alone): every matmul at
    compute_efficiency, the optimizer at 0.9 of HBM, no per-layer or EP-copy time — the single-figure formula,
    hand-worked."""
    MI300X = dataclasses.replace(load_profile("mi300x"), efficiency=None, efficiency_from=None)
    o = opts(65_536)
    e = estimate(Q35, MI300X, 8, Layout(cp=2), o)
    f = forward_flops_per_token(Q35, 65_536)
    s, fwd = 65_536 / 2, sum(f.values())
    hw_flops = 4 * (fwd - f["head"]) + 3 * f["head"]
    assert e.time_s["compute"] == pytest.approx(s * hw_flops / (MI300X.peak_bf16_tflops * 1e12
                                                                * MI300X.compute_efficiency))
    assert e.compute_s["layer_passes"] == 0.0
    on_ep = estimate(Q35, MI300X, 8, Layout(cp=2), o, ep_path=True)  # the EP path: no copy or fixed cost either
    assert on_ep.compute_s["ep_passes"] == 0.0 and on_ep.compute_s["ep_dispatch"] == 0.0
    assert on_ep.time_s["compute"] == pytest.approx(e.time_s["compute"])
    local = total_params(Q35) / 8
    assert e.time_s["optimizer"] == pytest.approx(local * 40 / (MI300X.hbm_bw_tb_s * 1e12 * 0.9))


def test_measured_profile_times_each_operation_at_its_own_rate():
    h200 = load_profile("h200")
    eff, peak = h200.efficiency, h200.peak_bf16_tflops * 1e12
    m4, s = Q35.with_layers(4), 32_768
    e = estimate(m4, h200, 1, Layout(), opts(s))
    f = forward_flops_per_token(m4, s)
    assert sum(e.compute_s.values()) == pytest.approx(e.time_s["compute"])
    assert e.compute_s["lm_head"] == pytest.approx(s * 3 * f["head"] / (peak * eff.lm_head))
    # attention at the efficiency of Qwen3.5's 256-wide heads; Qwen3-30B-A3B's 128-wide ones run at theirs
    assert e.compute_s["attention"] == pytest.approx(s * 4 * f["attention"] / (peak * eff.attention[256]))
    q3 = PRESETS["qwen3-30b-a3b"].with_layers(2)
    e3 = estimate(q3, h200, 1, Layout(), opts(s))
    assert e3.compute_s["attention"] == pytest.approx(
        s * 4 * forward_flops_per_token(q3, s)["attention"] / (peak * eff.attention[128]))
    assert e.compute_s["delta_rule"] == pytest.approx(s * 4 * f["linear_attention"] / (peak * eff.delta_rule))
    routed = 2 * param_counts(m4)["routed_experts"] * m4.top_k / m4.num_experts
    assert e.compute_s["expert_gemm"] == pytest.approx(s * 4 * routed / (peak * eff.expert_gemm))
    # the experts' bytes: each routed row's 2h + 3f bf16 values, and the 256 experts' weights once a pass, 4 passes
    # a layer (recompute)
    hbm, h, ffn = h200.hbm_bw_tb_s * 1e12, m4.hidden_size, m4.expert_ffn
    assert e.compute_s["expert_rows"] == pytest.approx(4 * 4 * s * 8 * (2 * h + 3 * ffn) * 2 / (hbm * eff.expert_rows))
    assert e.compute_s["expert_weights"] == pytest.approx(4 * 4 * 256 * 3 * h * ffn * 2 / (hbm * eff.expert_weights))
    assert e.compute_s["dense_gemm"] == pytest.approx(s * 4 * (f["matmul_layers"] - routed) / (peak * eff.dense_gemm))
    assert e.compute_s["layer_passes"] == pytest.approx(4 * 4 * eff.layer_latency_ms / 1e3)  # 4 layers × 4 passes
    # without recompute each layer runs 3 forward-equivalents, the head still 3 passes
    n = estimate(m4, h200, 1, Layout(), opts(s, recompute="none"))
    assert n.compute_s["expert_gemm"] == pytest.approx(e.compute_s["expert_gemm"] * 3 / 4)
    assert n.compute_s["lm_head"] == pytest.approx(e.compute_s["lm_head"])
    # the EP code path adds its row copies (nine of s·k rows of h + 8 bf16 values a layer under recompute, read and
    # written once; eight without) and its fixed time per MoE layer and pass (three passes under recompute, two
    # without), and nothing else
    ep = estimate(m4, h200, 1, Layout(), opts(s), ep_path=True)
    rows = s * m4.top_k * (m4.hidden_size + 8) * 2 * 2
    copies = m4.num_moe_layers * 9 * rows / (h200.hbm_bw_tb_s * 1e12 * eff.ep_dispatch)
    fixed = 3 * m4.num_moe_layers * eff.ep_latency_ms / 1e3
    assert ep.step_time_s - e.step_time_s == pytest.approx(copies + fixed)
    # each chunk beyond the first adds its fixed time to each pass of each MoE layer
    ep8 = estimate(m4, h200, 1, Layout(), opts(s, ep_overlap_chunks=8), ep_path=True)
    assert ep8.compute_s["ep_chunks"] * 1e3 == pytest.approx(3 * m4.num_moe_layers * 7 * eff.ep_chunk_ms)
    assert ep8.step_time_s - ep.step_time_s == pytest.approx(ep8.compute_s["ep_chunks"])
    assert ep.compute_s["ep_chunks"] == e.compute_s["ep_chunks"] == 0
    ep_n = estimate(m4, h200, 1, Layout(), opts(s, recompute="none"), ep_path=True)
    assert ep_n.compute_s["ep_passes"] * 1e3 == pytest.approx(2 * m4.num_moe_layers * eff.ep_latency_ms)
    assert ep_n.compute_s["ep_dispatch"] == pytest.approx(copies * 8 / 9)


def test_optimizer_step_can_set_the_peak():
    """At 1K tokens on one GPU the step's fp32 gradient copy of Qwen3.5's largest tensor (a layer's stacked
    gate/up experts, 256 × 1024 × 2048, a group of its own, clipped in place) exceeds the activations and the head:
    the optimizer component carries the difference."""
    m4 = Q35.with_layers(4)
    e = estimate(m4, load_profile("h200"), 1, Layout(), opts(1024))
    largest = 256 * 1024 * 2048
    moments = total_params(m4) * 8 / GB
    extra = 4 * largest / GB - e.memory_gb["activations"] - e.memory_gb["lm_head"]
    assert extra > 0
    assert e.memory_gb["optimizer"] == pytest.approx(moments + extra)
    # at 64K the activations are larger than the copies: the moments alone
    e64 = estimate(m4, load_profile("h200"), 1, Layout(), opts(65_536))
    assert e64.memory_gb["optimizer"] == pytest.approx(moments)


def test_ep_copies_count_the_regroups_and_only_the_local_share_of_each_exchange():
    """By hand, Qwen3.5-35B-A3B at 32K tokens: 262,144 copies of 2,056 bf16 values, read and written once, are
    2.156 GB a row copy. Four regroups on the compute stream, plus five exchanges under recompute (four without),
    of which the 1/ep a rank sends itself is a local copy; the rest is the all-to-all, charged as communication."""
    row = 32_768 * 8 * (2048 + 8) * 2 * 2
    assert row / GB == pytest.approx(2.156, abs=1e-3)
    assert ep_copy_bytes(Q35, 32_768, recompute=True) == pytest.approx(9 * row)  # world 1: every exchange is local
    assert ep_copy_bytes(Q35, 32_768, recompute=False) == pytest.approx(8 * row)
    assert ep_copy_bytes(Q35, 32_768, recompute=True, ep=8) == pytest.approx((4 + 5 / 8) * row)
    assert ep_copy_bytes(PRESETS["deepseek-v3"].with_layers(3), 32_768, recompute=True) == 0.0  # its dense layers


def test_attention_efficiency_by_head_width_worked_by_hand():
    """One figure serves every width; by width, linear between the measured widths and the nearest outside them:
    {128: 0.448, 256: 0.393} gives 0.448 at 64 and 128, 0.4205 at 192 (MLA's 128 + 64 query-key width), 0.393 at
    256 and 512, and their mean, 0.4205, without a model."""
    from recipe.cost import attention_efficiency, attention_width

    by = {128: 0.448, 256: 0.393}
    assert attention_efficiency(0.446, 192) == 0.446
    assert [attention_efficiency(by, w) for w in (64, 128, 256, 512)] == [0.448, 0.448, 0.393, 0.393]
    assert attention_efficiency(by, 192) == pytest.approx(0.4205)
    assert attention_efficiency(by, None) == pytest.approx(0.4205)
    assert attention_width(PRESETS["deepseek-v3"]) == 192 and attention_width(PRESETS["qwen35-35b"]) == 256


# ---- partial recompute (keep_layers) -------------------------------------------------------------------------------
_KEEP_CASES = [  # (model, hw, world, layout, micro-batch tokens, micro-batches)
    ("qwen35-35b", "mi300x", 8, Layout(), 32_768, 1),
    ("qwen35-35b", "h100", 16, Layout(cp=2, ep=8), 131_072, 1),
    ("qwen3-30b-a3b", "h100", 16, Layout(pp=2, tp=2, ep=4), 32_768, 4),
    ("deepseek-v3", "mi355x", 64, Layout(pp=4, ep=16), 32_768, 8),
    ("gpt-oss-120b", "mi300x", 16, Layout(cp=2, ep=8), 65_536, 1),
]


@pytest.mark.parametrize("model, hw, world, lay, tokens, mb", _KEEP_CASES)
def test_keep_layers_spans_full_recompute_to_none(model, hw, world, lay, tokens, mb):
    """keep_layers = 0 is full recompute and keeping every layer of the model is no recompute, in every figure
    (memory by component, step time and its parts, hardware FLOPs, bytes exchanged; under PP the split balanced as
    no recompute's); below that each kept layer adds memory and takes time off, the split balanced under full
    recompute (hybrid attention, MLA with dense first layers, PP with 1F1B in flight, TP, CP, EP)."""
    m, hw = PRESETS[model], load_profile(hw)
    base = TrainOptions(micro_batch_tokens=tokens, micro_batches=mb)
    full = estimate(m, hw, world, lay, base)
    none = estimate(m, hw, world, lay, base.model_copy(update={"recompute": "none"}))
    ests = [estimate(m, hw, world, lay, base.model_copy(update={"keep_layers": k})) for k in range(m.num_layers + 1)]

    def figures(e):
        return (e.memory_gb, e.step_time_s, e.time_s, e.tflops_per_gpu, e.comm_bytes, e.compute_s)

    assert figures(ests[0]) == figures(full)
    got, want = figures(ests[-1]), figures(none)
    for a, b in zip(got, want):
        if isinstance(a, dict):
            assert a.keys() == b.keys() and all(a[k] == pytest.approx(b[k], rel=1e-12, abs=1e-12) for k in a), (a, b)
        else:
            assert a == pytest.approx(b, rel=1e-12)
    mem = [e.total_gb for e in ests[:-1]]  # the split balanced under full recompute for each of these
    step = [e.step_time_s for e in ests[:-1]]
    assert all(x <= y + 1e-9 for x, y in zip(mem, mem[1:])) and mem[-1] > mem[0]
    assert all(x >= y - 1e-12 for x, y in zip(step, step[1:])) and step[-1] < step[0]


def test_keep_layers_work_worked_by_hand():
    """qwen35-35b, 40 layers, full attention in every fourth (the rest Gated DeltaNet), one stage, the last 4 layers
    kept: 36 layers run a recomputed forward, 9 of the 10 attention layers and 27 of the 30 Gated DeltaNet ones. So a
    layer pass count of 3·40 + 36 = 156, attention's work 3.9 forwards of the model's (full recompute: 4), the delta
    rule's 3.9, the routed experts' 3.9 (every layer is MoE), and hardware FLOPs per token 3 forwards of the layers,
    their recomputed share and the head's 3 GEMMs."""
    from recipe.cost import compute_work, flop_terms

    m = PRESETS["qwen35-35b"]
    assert m.num_layers == 40 and m.layer_types[3::4] == ("full_attention",) * 10
    opts = TrainOptions(micro_batch_tokens=32_768)
    keep = opts.model_copy(update={"keep_layers": 4})
    full, part = compute_work(m, Layout(), opts), compute_work(m, Layout(), keep)
    assert full["layer_passes"] == 160 and part["layer_passes"] == 156
    for op in ("attention", "delta_rule", "expert_gemm", "expert_rows", "expert_weights"):
        assert part[op] == pytest.approx(full[op] * 3.9 / 4, rel=1e-12), op
    f, _, hw_full, _ = flop_terms(m, opts)
    _, _, hw_part, _ = flop_terms(m, keep)
    layers = sum(f.values()) - f["head"]
    # the four kept layers' forward FLOPs: three Gated DeltaNet layers and one attention layer
    from recipe.cost import layer_work, BYTE_TERMS

    per = [sum(x for op, x in w.items() if op not in BYTE_TERMS) for w in layer_work(m, 32_768)]
    assert hw_full - hw_part == pytest.approx(layers * sum(per[36:]) / sum(per), rel=1e-12)
    assert per[36] == per[37] == per[38] < per[39]  # the kept attention layer costs more than a Gated DeltaNet one


def test_keep_layers_memory_worked_by_hand():
    """Each layer kept beyond the one whose backward runs first adds what its forward saved (its mixer's and its
    FFN's tensors; its input was already held as a checkpoint) while that first backward sets the peak: at
    qwen35-35b × 4 layers, 32K tokens on one H200 (the calibration grid's partial-recompute points), keeping 3
    layers instead of 2 adds exactly layer_saved. Keeping 1 costs nothing over full recompute: the peak stays in a
    recomputed layer's backward (measured: 74.5 GB for both)."""
    m = PRESETS["qwen35-35b"].with_layers(4)
    h200 = load_profile("h200")
    opts = TrainOptions(micro_batch_tokens=32_768)
    act = [estimate(m, h200, 1, Layout(), opts.model_copy(update={"keep_layers": k})).memory_gb["activations"]
           for k in range(4)]
    mixer, ffn = layer_saved(m, 32_768, 1, 1)
    assert (act[3] - act[2]) * GB == pytest.approx(mixer + ffn, rel=1e-9)
    assert act[1] == pytest.approx(act[0], rel=1e-12) and act[2] > act[1]


def test_keep_layers_needs_recompute():
    with pytest.raises(ValueError, match="keep_layers = 2 needs recompute 'full'"):
        TrainOptions(micro_batch_tokens=4096, recompute="none", keep_layers=2)
    with pytest.raises(ValueError, match="keep_layers must be a non-negative integer"):
        TrainOptions(micro_batch_tokens=4096, keep_layers=-1)


def test_mla_working_set_is_what_its_forward_saves():
    """attention_working_set for MLA equals the bytes MLAttention's forward keeps for its backward (distinct
    storages the autograd graph saves, weights aside), with a stand-in for SDPA that keeps what the flash kernel
    keeps (q, k, v, the output and its fp32 log-sum-exp), in bf16 at a small width with and without the q LoRA, and
    with A.X K2's gated query (both q latents into q_gate_proj, the output gated); v padded to the q·k width (the
    kernels off NVIDIA) and at its own width (cuDNN's, `cudnn_takes`)."""
    import torch

    import launch.model as lm
    from recipe.cost import attention_working_set
    from recipe.models import MLAShape, ModelShape

    class Flash(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v):
            with torch.no_grad():
                out = lm.F.scaled_dot_product_attention(*(x.transpose(0, 1) for x in (q, k, v)), is_causal=True)
            out = out.transpose(0, 1).contiguous()
            ctx.save_for_backward(q, k, v, out, torch.empty(q.shape[1], q.shape[0]))  # lse [H, T] fp32
            return out

    for q_lora, vendor, gated in ((0, "amd", False), (96, "amd", False), (0, "nvidia", False), (96, "nvidia", False),
                                  (96, "nvidia", True), (96, "amd", True)):
        m = ModelShape(name="mla", arch="deepseek_v3", hidden_size=256, num_layers=1, vocab_size=64,
                       layer_types=("full_attention",), num_heads=8, num_kv_heads=8, head_dim=48, qk_norm=False,
                       mla=MLAShape(q_lora_rank=q_lora, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16,
                                    v_head_dim=32, query_gate=gated), num_experts=4, top_k=2, expert_ffn=32)
        attn = lm.MLAttention(m).to(torch.bfloat16)
        T = 512
        x = torch.randn(T, m.hidden_size, dtype=torch.bfloat16, requires_grad=True)
        rope = lm.rope_cos_sin(torch.arange(T), m, torch.bfloat16)
        weights = {p.untyped_storage().data_ptr() for p in attn.parameters()}
        rope_ptrs = {t.untyped_storage().data_ptr() for t in rope}
        saved = {}

        def pack(t):
            st = t.untyped_storage()
            if st.data_ptr() not in weights | rope_ptrs:
                saved[st.data_ptr()] = st.nbytes()
            return t

        orig = lm.causal_attention, lm.cudnn_takes
        lm.causal_attention = lambda q, k, v, packing, scale: Flash.apply(q, k, v)
        lm.cudnn_takes = lambda q, k, v: vendor == "nvidia"
        try:
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                attn(x, rope, lm.Packing.from_lengths([T]))
        finally:
            lm.causal_attention, lm.cudnn_takes = orig
        want = attention_working_set(m, T, 1, 1, vendor)
        # beyond the formula: the two norms' fp32 row scales (4 bytes a token each)
        got = sum(saved.values()) - T * 4 * (2 if q_lora else 1)
        assert abs(got / want - 1) < 0.01, (q_lora, vendor, gated, got, want)


def test_a_gated_norm_keeps_what_the_cost_model_charges():
    """A.X K2's gated norm (launch.model.GatedNorm) keeps, beyond a plain RMSNorm's input and row scale, the norm's
    output, the gate's fp32 sigmoid and its two rank-r activations: h·(2 + 4) + 2·r·2 bytes a token, what layer_saved
    charges each gated norm (the input norm on the mixer's side; on an MoE layer the FFN norm too)."""
    import torch

    import launch.model as lm
    from recipe.cost import layer_saved

    T, h, r = 256, 128, 8
    norm = lm.GatedNorm(h, r, 1e-6).to(torch.bfloat16)
    x = torch.randn(T, h, dtype=torch.bfloat16, requires_grad=True)
    weights = {p.untyped_storage().data_ptr() for p in norm.parameters()} | {x.untyped_storage().data_ptr()}
    saved = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in weights:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        norm(x)
    got = sum(saved.values()) - T * 4  # less the RMSNorm's row scale, which a plain norm keeps too
    assert got == T * (h * (2 + 4) + 2 * r * 2)
    m = PRESETS["tiny-moe"].model_copy(update={"hidden_size": h})
    plain, gated = (layer_saved(x, T, 1, 1) for x in (m, m.model_copy(update={"gated_norm_rank": r})))
    assert gated[0] - plain[0] == got and gated[1] - plain[1] == got


def test_heads_wider_than_the_flash_kernels_hold_kv_at_the_query_heads():
    """Gemma 4's full layers (16 query heads of 512 over 2 KV heads whose values are their keys), hand-worked at
    s = 1,024: no flash kernel takes heads wider than 256, so SDPA's memory-efficient kernel runs them with K/V
    repeated to the 16 query heads (launch/model.py sdpa_kv), s·16·(512 + 512)·2 beside q; the normed input
    s·2816·2; the q/k norms' inputs and row scales (the value norm's input is k's, its row scale its own); SDPA's
    output and lse and o_proj's input. 108,675,072 bytes, above the sliding layers' 56,295,424."""
    from recipe.cost import attention_working_set, kernel_kv_heads

    s = 1024
    qw, kw = s * 16 * 512 * 2, s * 2 * 512 * 2
    full = (s * 2816 * 2 + (qw + kw + s * 18 * 4 + s * 2 * 4) + (qw + s * 16 * 1024 * 2)
            + (s * 16 * 1024 * 2 + s * 16 * 4))
    assert full == 108_675_072
    assert attention_working_set(PRESETS["gemma4-26b-a4b"], s, 1, 1) == full
    assert kernel_kv_heads(16, 2, 512, 512) == 16 and kernel_kv_heads(16, 8, 256, 256) == 8


def test_window_kernel_keys_by_hand():
    """A windowed kernel scores whole 128-key tiles: a 128-query block with a 128-token window reaches back 127 keys
    before its first query, 255 keys over two tiles (256); a 130-token window needs three (384). Each scored key
    costs 1.73 of the full-attention kernel's and the row 670 more: 1.73 · 256 + 670 = 1,112.88 for gpt-oss's
    128. gpt-oss-120b at 32K (18 full layers at 16,384 keys a query, 18 sliding at 128): the kernels cost
    (16,384 + 1,112.88) / (16,384 + 128) of the model's attention FLOPs at the full kernel's rate; a sequence no
    longer than the window is plain causal (ratio 1)."""
    from recipe.cost import attention_keys, attention_kernel_ratio, window_kernel_keys, window_keys

    assert (window_keys(128), window_keys(100), window_keys(129), window_keys(130)) == (256, 256, 256, 384)
    assert window_kernel_keys(128) == pytest.approx(1112.88) and window_kernel_keys(130) == pytest.approx(1334.32)
    oss = PRESETS["gpt-oss-120b"]
    assert attention_keys(oss, 32768) == (16384, 128)
    assert attention_keys(oss, 32768, kernel=True) == pytest.approx((16384, 1112.88))
    assert attention_kernel_ratio(oss, 32768) == pytest.approx((16384 + 1112.88) / (16384 + 128))
    assert attention_kernel_ratio(oss, 128) == 1.0 and attention_kernel_ratio(PRESETS["qwen3-30b-a3b"], 32768) == 1.0


def _dsa_shape():
    """DeepSeek-V3's preset cut to 4 layers (one dense) with an indexer of 8 heads of 16 keeping 4 keys a query."""
    from recipe.models import SparseAttentionShape

    return PRESETS["deepseek-v3"].with_layers(4).model_copy(update={"name": "v3-dsa", "dsa": SparseAttentionShape(
        topk=4, index_heads=8, index_head_dim=16)})


def test_block_sparse_attention_is_charged_on_its_selected_blocks_and_its_indexer():
    """MiniMax-M3's block-sparse layers, hand-worked at blocks of 4 keys, 2 kept a query (its own, forced, and one
    more): up to 8 tokens a query sees every earlier key (mean (8 + 1)/2 = 4.5 over 8); past them one whole block
    and its own block's keys up to it, 4 + (t mod 4) + 1 = 5, 6, 7, 8 for t = 8 … 11, so over 12 tokens
    (36 + 26)/12. Attention's forward FLOPs a token are 2·H·(d_qk + d_v) times the keys summed over the full
    layers (one dense at seq/2, three sparse); the indexer's 2·N·I·seq/2 a sparse layer, forward only; a layer's
    saved set adds the selection, topk_blocks int32 indices a query and index head (their heads split over tp)."""
    from recipe.cost import attention_working_set, block_sparse_keys, forward_flops_per_token
    from recipe.models import BlockSparseShape, ModelShape

    m = ModelShape(name="bs", arch="moe", hidden_size=256, num_layers=4, vocab_size=64,
                   layer_types=("full_attention",) * 4, num_heads=4, num_kv_heads=2, head_dim=16, num_experts=4,
                   top_k=2, expert_ffn=32, block_sparse=BlockSparseShape(block=4, topk_blocks=2, local_blocks=1,
                                                                         index_heads=2, index_head_dim=8,
                                                                         layers=(1, 2, 3)))
    assert block_sparse_keys(m, 8) == 4.5 and block_sparse_keys(m, 12) == pytest.approx(62 / 12)
    brute = sum(min(t + 1, 4 + t % 4 + 1) if t >= 8 else t + 1 for t in range(1000)) / 1000
    assert block_sparse_keys(m, 1000) == pytest.approx(brute)
    f = forward_flops_per_token(m, 12)
    assert f["attention"] == pytest.approx(2 * 4 * 32 * (12 / 2 + 3 * 62 / 12))
    assert f["indexer"] == 2 * 2 * 8 * 3 * 12 / 2
    plain = m.model_copy(update={"block_sparse": None})
    assert forward_flops_per_token(plain, 12)["attention"] == 2 * 4 * 32 * 4 * 12 / 2
    for tp in (1, 2):
        assert attention_working_set(m, 12, tp, 1) - attention_working_set(plain, 12, tp, 1) == 12 * 2 / tp * 2 * 4
    assert m.with_layers(2).block_sparse.layers == (1,)


def test_deepseek_sparse_attention_is_charged_on_its_selected_keys_and_its_indexer():
    """Hand-worked: a query at t attends min(K, t + 1) keys, so over 8 tokens at K = 4 the mean is (1+2+3+4·5)/8 =
    3.25 and over 3 tokens 2; attention's forward FLOPs a token are 2·H·(2C + R)·k̄ a layer (absorbed: q̂·latent
    over C + R channels, p·latent over C); the indexer's 2·N·I·S/2, forward only: the model FLOPs count it once
    where they count everything else three times, and the hardware FLOPs once more for the recomputed forward.
    Under tp the attention's work halves and so does the indexer's (each rank selects for half the queries, the
    selections all-gathered); its weights count with the
    attention's parameters; its rate and the kernels' come from the measured constants. The attention's time is its
    forward passes at the forward kernel's rate and its backward (twice the forward's FLOPs) at the backward
    kernel's: 128 heads over tp = 16 leave 8 a rank, whose forward runs 16-head programs half empty at the narrow
    forward rate."""
    from recipe.cost import (INDEX_ROW_S, SPARSE_BACKWARD_EFFICIENCY, SPARSE_FORWARD_EFFICIENCY,
                             SPARSE_NARROW_FORWARD_EFFICIENCY, compute_work, flop_terms, forward_flops_per_token,
                             rates, sparse_keys)
    from recipe.models import indexer_params

    m = _dsa_shape()
    assert sparse_keys(m, 8) == 3.25 and sparse_keys(m, 3) == 2.0
    a = m.mla
    f = forward_flops_per_token(m, 8)
    assert f["attention"] == 2 * 128 * (2 * 512 + 64) * 4 * 3.25
    assert f["indexer"] == 2 * 8 * 16 * 4 * 8 / 2
    assert indexer_params(m) == a.q_lora_rank * 8 * 16 + 7168 * 16 + 2 * 16 + 7168 * 8
    assert param_counts(m)["attention"] - param_counts(PRESETS["deepseek-v3"].with_layers(4))["attention"] \
        == 4 * indexer_params(m)
    opts = TrainOptions(micro_batch_tokens=4096)
    f, model, hw_flops, _ = flop_terms(m, opts)
    fwd = sum(f.values())
    assert model == 3 * fwd - 2 * f["indexer"]
    assert hw_flops == 4 * (fwd - f["head"]) - 2 * f["indexer"] + 3 * f["head"]  # full recompute, fused head
    one, two = compute_work(m, Layout(), opts), compute_work(m, Layout(tp=2), opts)
    assert one["indexer"] == 4096 * f["indexer"] * 2  # forward and recomputed forward
    assert two["attention"] == pytest.approx(one["attention"] / 2) and two["indexer"] == one["indexer"] / 2
    # under tp each rank selects for its share of the queries and all-gathers the selections: 8 passes (4 layers,
    # forward and recomputed forward) of 4096 queries × 4 keys, int32, half from the other rank
    from recipe.cost import communication_terms

    gathered = [communication_terms(x, load_profile("h200"), 2, Layout(tp=2), opts)[0]["tp"]
                for x in (m, m.model_copy(update={"dsa": None}))]
    assert gathered[0] - gathered[1] == 8 * 4096 * 4 * 4 / 2
    hw = load_profile("h200")
    r = rates(hw, m)
    peak = hw.peak_bf16_tflops * 1e12
    assert r["attention"] == peak * SPARSE_BACKWARD_EFFICIENCY
    # per token, full recompute: two forwards at the forward rate and a backward (2 forwards' FLOPs) at its own
    seconds = 4096 * f["attention"] * (2 / (peak * SPARSE_FORWARD_EFFICIENCY) + 2 / (peak * SPARSE_BACKWARD_EFFICIENCY))
    assert one["attention"] / r["attention"] == pytest.approx(seconds)
    # 128 heads over tp = 16: 8 a rank, the time of 16 heads' work, the forward in 16-head programs
    narrow = 4096 / 16 * f["attention"] * 2 * (2 / (peak * SPARSE_NARROW_FORWARD_EFFICIENCY)
                                                + 2 / (peak * SPARSE_BACKWARD_EFFICIENCY))
    assert compute_work(m, Layout(tp=16), opts)["attention"] / r["attention"] == pytest.approx(narrow)
    assert one["index_rows"] == 4096 * 2 * 4 and two["index_rows"] == 2048 * 2 * 4  # a rank's query rows, 8 passes
    assert r["index_rows"] == INDEX_ROW_S and 0 < r["indexer"] < hw.peak_bf16_tflops * 1e12
    assert rates(hw, PRESETS["deepseek-v3"])["indexer"] == float("inf")
    # a layer reusing an earlier one's selection: one indexer pass fewer, the selection (int32, s × K) kept
    from recipe.cost import memory_terms

    shared = m.model_copy(update={"dsa": m.dsa.model_copy(update={"shared_layers": (3,)})})
    assert compute_work(shared, Layout(), opts)["index_rows"] == 4096 * 2 * 3
    acts = [memory_terms(x, hw, 1, Layout(), opts)[0]["activations"] for x in (m, shared)]
    assert acts[1] - acts[0] == pytest.approx(4096 * 4 * 4)
    # the pipeline split keeps a shared layer on its source's stage: where the balanced split would part layers 2
    # and 3 ([3, 1], [2, 1, 1]), the shared model's keeps them together
    from recipe.cost import pipeline_split

    assert (pipeline_split(m, 2, opts, hw), pipeline_split(m, 3, opts, hw)) == ([3, 1], [2, 1, 1])
    assert (pipeline_split(shared, 2, opts, hw), pipeline_split(shared, 3, opts, hw)) == ([2, 2], [1, 1, 2])


def test_kept_selections_spare_the_recomputed_indexer_and_cost_their_bytes():
    """train.keep_selections: the recomputed forward takes the forward's selection instead of running the indexer,
    so the indexer's work and passes are the forward's alone (half of full recompute's) and its FLOPs leave the
    recomputed forward's hardware FLOPs once; every recomputed indexing layer's selection (int32, topk a token) is
    kept for the step (with a shared layer, its source's selection is kept either way: not counted twice). Without
    DSA the option changes nothing, nor without recompute."""
    from recipe.cost import compute_work, estimate, flop_terms, memory_terms

    m, hw = _dsa_shape(), load_profile("h200")
    opts = TrainOptions(micro_batch_tokens=4096)
    keep = opts.model_copy(update={"keep_selections": True})
    a, b = compute_work(m, Layout(), opts), compute_work(m, Layout(), keep)
    assert b["indexer"] == a["indexer"] / 2 and b["index_rows"] == a["index_rows"] / 2 == 4096 * 4
    assert {k: v for k, v in a.items() if k not in ("indexer", "index_rows")} == \
        {k: v for k, v in b.items() if k not in ("indexer", "index_rows")}
    f, _, hw_a, _ = flop_terms(m, opts)
    assert flop_terms(m, keep)[2] == pytest.approx(hw_a - f["indexer"])
    acts = [memory_terms(m, hw, 1, Layout(), o)[0]["activations"] for o in (opts, keep)]
    assert acts[1] - acts[0] == pytest.approx(4 * 4096 * 4 * 4)  # 4 layers, 4096 tokens, 4 keys, int32
    shared = m.model_copy(update={"dsa": m.dsa.model_copy(update={"shared_layers": (3,)})})
    acts = [memory_terms(shared, hw, 1, Layout(), o)[0]["activations"] for o in (opts, keep)]
    assert acts[1] - acts[0] == pytest.approx((3 - 1) * 4096 * 4 * 4)  # 3 indexing layers, one kept already
    assert estimate(m, hw, 1, Layout(), keep).step_time_s < estimate(m, hw, 1, Layout(), opts).step_time_s
    v3 = PRESETS["deepseek-v3"].with_layers(4)
    assert compute_work(v3, Layout(), keep) == compute_work(v3, Layout(), opts)
    none = TrainOptions(micro_batch_tokens=4096, recompute="none")
    assert estimate(m, hw, 1, Layout(), none.model_copy(update={"keep_selections": True})) == \
        estimate(m, hw, 1, Layout(), none)  # nothing is recomputed: nothing to keep


def _v4_shape():
    """DeepSeek-V4-Flash cut to 4 layers (three heavily compressed, one sparse), with a 4-key window, 8 tokens an
    entry in the heavy layers and the indexer keeping 2 entries."""
    m = PRESETS["deepseek-v4-flash"].with_layers(4)
    return m.model_copy(update={"sliding_window": 4, "compressed": m.compressed.model_copy(
        update={"hca_rate": 8, "index_topk": 2})})


def test_deepseek_v4_is_charged_on_its_window_and_compressed_entries():
    """Hand-worked: a query at t sees min(w, t + 1) raw keys and the entries compressed `rate` to one whose tokens
    are all earlier, ⌊(t + 1)/rate⌋ of them (a sparse layer at most index_topk): over 16 tokens, a window of 4 is
    (1+2+3+4·13)/16 = 58/16, sparse entries at rate 4 capped at 2 are (0·3 + 1·4 + 2·9)/16 = 22/16, heavy ones at
    rate 8 (8·1 + 1·2)/16 = 10/16 (checked against a count by enumeration at other lengths too). Attention's forward
    FLOPs a token are 2·H·(2·512)·k̄ a layer (K = V, one head of 512), the indexer's 2·N·I a score on the sparse
    layer's entries; the per-layer split sums to the model's. Under CP a rank receives the earlier segments'
    compressed entries (a sparse layer's with its index keys) and the window's edge, not the raw K = V rows; a pipeline
    stage sends its 4 residual streams; tp splits the output groups (8), not the one K = V head."""
    from recipe.cost import (communication_terms, compressed_cp_row, compressed_entries, compressed_keys,
                             forward_flops_per_token, layer_work, residual_width)
    from recipe.solver import pin_violations

    def counted(rate, seq, cap=10**9):
        return sum(min(cap, (t + 1) // rate) for t in range(seq)) / seq

    assert compressed_entries(4, 16, 2) == 22 / 16 and compressed_entries(8, 16) == 10 / 16
    for rate, seq, cap in ((4, 7, 2), (4, 37, 3), (8, 100, 10**9), (128, 1000, 10**9), (4, 3, 2)):
        assert compressed_entries(rate, seq, cap) == pytest.approx(counted(rate, seq, cap)), (rate, seq, cap)
    m = _v4_shape()
    assert m.layer_types == ("heavily_compressed_attention",) * 3 + ("compressed_sparse_attention",)
    assert compressed_keys(m, 16, "compressed_sparse_attention") == (58 + 22) / 16
    assert compressed_keys(m, 16, "heavily_compressed_attention") == (58 + 10) / 16
    f = forward_flops_per_token(m, 16)
    assert f["attention"] == 2 * 64 * 2 * 512 * (3 * 68 + 80) / 16
    assert f["indexer"] == 2 * 64 * 128 * counted(4, 16)
    lw = layer_work(m, 16)
    assert sum(w["attention"] for w in lw) == pytest.approx(f["attention"])
    assert sum(w.get("indexer", 0.0) for w in lw) == pytest.approx(f["indexer"])
    assert compressed_cp_row(m, 1024) == ((512 + 128) / 4 + 3 * 512 / 8) / 4 + 4 * 512 / 1024
    hw, opts = load_profile("h200"), TrainOptions(micro_batch_tokens=4096)
    assert residual_width(m) == 4 * 4096 and residual_width(PRESETS["deepseek-v3"]) == 7168
    comm = communication_terms(m, hw, 2, Layout(pp=2), opts)[0]
    assert comm["pp"] == 2 * 4096 * 4 * 4096 * BF16
    assert pin_violations(m, hw, 4096, {"tp": 8}) == []
    assert "output projection groups" in pin_violations(m, hw, 4096, {"tp": 16})[0]


def test_deepseek_v4_saves_its_streams_compressors_and_selection():
    """A DeepSeek-V4 layer's saved set (compressed_attention_working_set): with a sparse layer in the model, the
    largest kind is the sparse one, which beside a heavy one adds its selection (s · topk int32), a second series of
    the compressor (s · 2 · 512 bf16) and its entries at rate 4 instead of 8 (s/4 − s/8 rows of 512); the residual
    streams count 4 · h a token where another model's count h; tp halves what is per head (q_b's output and q, the
    outputs: 4 · 64 · 512 values a token, and o_a's 8 · 1024) and not the K = V head or the compressors."""
    from recipe.cost import compressed_attention_working_set

    m = _v4_shape()
    heavy = m.model_copy(update={"layer_types": ("heavily_compressed_attention",) * 4})
    s = 1024
    assert compressed_attention_working_set(m, s, 1, 1) - compressed_attention_working_set(heavy, s, 1, 1) == \
        s * 2 * 4 + s * 2 * 512 * BF16 + (s / 4 - s / 8) * 512 * BF16
    one, two = (compressed_attention_working_set(m, s, tp, 1) for tp in (1, 2))
    assert one - two == s * (4 * 64 * 512 + 8 * 1024) / 2 * BF16 + s * 2 * 64 / 2 * FP32
    # CP gathers the K = V rows of the whole micro-batch: one more head_dim row per rank per token
    assert compressed_attention_working_set(m, s, 1, 2) - one == s * 512 * BF16


def test_a_norm_after_the_moe_makes_the_recomputed_forward_combine():
    """Where a norm after the MoE block keeps its output (AFMoE's sandwich norms, FlexOlmo's post norms), the
    recomputed forward returns the experts' rows as a forward does: three passes of two transfers each, where a
    pre-norm model's recomputed forward only dispatches (one); and the EP path moves one more exchange and one more
    regroup of s·k rows of h + 8 bf16 values."""
    from recipe.cost import ep_copy_bytes, ep_transfers

    pre = PRESETS["qwen3-30b-a3b"]
    sandwich = pre.model_copy(update={"norm_placement": "sandwich", "hf_model_type": "afmoe"})
    assert (pre.moe_output_saved, sandwich.moe_output_saved) == (False, True)
    assert ep_transfers(True, False) == [2, 1, 2] and ep_transfers(True, True) == [2, 2, 2]
    assert ep_transfers(False, True) == [2, 2]
    row = 4096 * 8 * (2048 + 8) * BF16 * 2
    assert ep_copy_bytes(sandwich, 4096, True, 4) - ep_copy_bytes(pre, 4096, True, 4) == pytest.approx(row * (1 + 1 / 4))
    assert ep_copy_bytes(sandwich, 4096, False, 4) == ep_copy_bytes(pre, 4096, False, 4)
    # and each norm after a sublayer keeps that sublayer's output (bf16) and its row scale (fp32), s/tp rows
    from recipe.cost import layer_saved

    (m0, f0), (m1, f1) = (layer_saved(x, 4096, 2, 1) for x in (pre, sandwich))
    assert m1 - m0 == f1 - f0 == 2048 * (2048 * BF16 + FP32)
    # Cohere's parallel block has its one norm before both sublayers: nothing after them, as "pre"
    parallel = pre.model_copy(update={"norm_placement": "parallel", "hf_model_type": "cohere2_moe"})
    assert not parallel.moe_output_saved and layer_saved(parallel, 4096, 2, 1) == (m0, f0)


def test_layers_with_their_own_heads_cost_their_own_attention():
    """Step-3.7's first four layers by hand, at 8,192 tokens: a full layer of 64 heads over 4,096 keys a query on
    average (causal), three sliding layers of 96 heads over 512, q·k and v 128 wide: attention's forward FLOPs a token
    are 2·(128 + 128)·(64·4,096 + 3·96·512); a sliding layer's matmuls are its own heads' (q and o 96 · 128 wide) with
    the gate per head, (h, 96); the working set takes the most heads any layer has."""
    from recipe.cost import attention_working_set, dense_matmuls, forward_flops_per_token

    m = PRESETS["step37-flash"].with_layers(4)
    assert m.layer_types == ("full_attention",) + ("sliding_attention",) * 3 and m.sliding_window == 512
    assert forward_flops_per_token(m, 8192)["attention"] == 2 * 256 * (64 * 4096 + 3 * 96 * 512)
    h = 4096
    assert dense_matmuls(m, "sliding_attention", moe=False)[:5] == [(h, 96 * 128), (h, 8 * 128), (h, 8 * 128),
                                                                    (96 * 128, h), (h, 96)]
    assert dense_matmuls(m, "full_attention", moe=False)[0] == (h, 64 * 128)
    narrow = m.model_copy(update={"sliding_heads": None})
    assert attention_working_set(m, 1024, 1, 1) > attention_working_set(narrow, 1024, 1, 1)


# ---- Kimi Delta Attention ------------------------------------------------------------------------------------
KIMI = PRESETS["kimi-linear-48b"]


def _small_kda():
    """Kimi-Linear cut to 4 layers (three KDA, then MLA) with KDA at 2 heads of 16 and chunks of 16."""
    from recipe.models import LinearAttnShape

    la = LinearAttnShape(kind="kda", num_k_heads=2, num_v_heads=2, head_k_dim=16, head_v_dim=16, chunk_size=16)
    return KIMI.with_layers(4).model_copy(update={"linear_attn": la})


def test_kda_rule_flops_by_hand():
    """The chunked rule a KDA head costs per token: Gated DeltaNet's 6·d_k·d_v + 4·C·(d_k + d_v) and the decay per
    key channel's 4·C·d_k + 7·d_k + d_k·d_v/C (docs/cost_model.md). At d_k = d_v = 16, C = 16: 1,536 + 2,048 = 3,584
    and 1,024 + 112 + 16 = 1,152, 4,736 a head; three layers of 2 heads. At the release's 128 × 128, C = 64:
    163,840 + 33,920 = 197,760, 1.21 of Gated DeltaNet's at the same widths."""
    from recipe.cost import delta_rule_flops_per_token_head, layer_work

    m = _small_kda()
    assert m.layer_types == ("linear_attention",) * 3 + ("full_attention",)
    assert delta_rule_flops_per_token_head(m.linear_attn) == 3584 + 1152 == 4736
    assert forward_flops_per_token(m, 8192)["linear_attention"] == 3 * 2 * 4736
    la = KIMI.linear_attn
    assert delta_rule_flops_per_token_head(la) == 197_760
    gdn = dataclasses.replace(la, kind="gated_delta")
    assert delta_rule_flops_per_token_head(gdn) == 163_840  # Gated DeltaNet's count does not move
    # a KDA layer's matmuls: its projections (the conv's weights at one multiply-add each, as Gated DeltaNet's)
    from recipe.models import kda_params

    work = layer_work(m, 8192)
    assert work[0]["delta_rule"] == 2 * 4736 and work[0]["attention"] == 0
    assert work[1]["dense_gemm"] == 2 * kda_params(m.linear_attn, 2304) + 2 * (2304 * 256 + 3 * 2304 * 1024)


def test_kda_matmuls_are_its_projections():
    """A KDA layer's dense matmuls (in, out): q, k, v (h → H·D), the decay gate's f_a (h → D) and f_b (D → H·D),
    b_proj (h → H), the output gate's g_a and g_b, o_proj (H·D → h); then the layer's FFN."""
    from recipe.cost import dense_matmuls

    h, hd, d = 2304, 32 * 128, 128
    assert dense_matmuls(KIMI, "linear_attention", moe=True)[:9] == [
        (h, hd), (h, hd), (h, hd), (h, d), (d, hd), (h, 32), (h, d), (d, hd), (hd, h)]
    assert dense_matmuls(KIMI, "linear_attention", moe=True)[9] == (h, 256)  # the router


def test_kda_working_set_holds_its_recomputed_forward():
    """A KDA layer keeps, a token, at least what its recomputed forward holds — q, k, v after the convs (bf16), the
    decay per channel [H, D] in fp32, β, the output gate — and by hand: q, k, v before and after the convs
    2·3·HD·2, the gates' latents 2·D·2, the output gate HD·2, the decay and its in-chunk sums 2·HD·4, β H·4, two
    [C × C] matrices a head 2·C·H·4, the rule's and the norm's outputs 2·HD·2, the block's input and output 2·h·2:
    132,736 bytes at the release's sizes (h = 2304, 32 heads of 128, C = 64). TP splits the heads, not the
    latents or the block's rows; CP adds Gated DeltaNet's augmented width."""
    from recipe.cost import kda_working_set, linear_attention_working_set

    h, hd, d, nh, c = 2304, 4096, 128, 32, 64
    by_hand = 2 * 3 * hd * BF16 + 2 * d * BF16 + hd * BF16 + 2 * hd * FP32 + nh * FP32 + 2 * c * nh * FP32 \
        + 2 * hd * BF16 + 2 * h * BF16
    assert by_hand == 132_736 == linear_attention_working_set(KIMI, 1, 1) == kda_working_set(KIMI, 1, 1)
    floor = 3 * hd * BF16 + hd * FP32 + nh * FP32 + hd * BF16
    assert kda_working_set(KIMI, 1, 1) >= floor
    split = 2 * 3 * hd / 2 * BF16 + 2 * d * BF16 + hd / 2 * BF16 + 2 * hd / 2 * FP32 + nh / 2 * FP32 \
        + 2 * c * nh / 2 * FP32 + 2 * hd / 2 * BF16 + 2 * h * BF16
    assert kda_working_set(KIMI, 1, 2) == split
    assert kda_working_set(KIMI, 1, 1, cp=2) - by_hand == 3 * nh * d * BF16
    # the layer's mixer side is the larger of its two kinds
    from recipe.cost import attention_working_set

    s = 16384
    assert layer_saved(KIMI, s, 1, 1)[0] == pytest.approx(
        max(attention_working_set(KIMI, s, 1, 1), kda_working_set(KIMI, s, 1, 1)) + s * FP32)


def test_kda_backward_holds_its_chunked_rules_gradient_buffers():
    """By hand, per token and head at K = V = 128, C = 64 (fla's chunk_kda backward at its last in-chunk pass):
    w, u and the gated q, k (bf16) 4·128·2; the chunk states and their gradients (bf16, [K × V] a chunk) 2·128·128/64
    ·2; the new values and the WY pass's dv 2·128·2; two fp32 dA [C] 2·64·4; two fp32 passes of dq, dk, dg 6·128·4;
    β's gradients 4 + 4·4: 6,164 bytes, the 6.47 GB measured at 32K tokens and 32 heads within 0.1%. TP splits the
    heads; under CP the values are V + K wide. The layer's moment is that plus the saved set where it passes the
    FFN's and attention's, as in Kimi-Linear's own layers at 32K."""
    from recipe.cost import dense_ffn_moments, kda_backward_bytes, kda_working_set

    per_head = 4 * 128 * 2 + 2 * 2 * 128 * 128 // 64 + 2 * 2 * 128 + 2 * 64 * 4 + 6 * 128 * 4 + 4 + 16
    assert per_head == 6164
    assert kda_backward_bytes(KIMI, 1, 1) == per_head * 32
    assert kda_backward_bytes(KIMI, 32768, 1) == pytest.approx(6.4676e9, rel=1e-3)
    assert kda_backward_bytes(KIMI, 1, 2) == per_head * 16
    wider = 128 * 2 + 2 * 2 * 128 * 128 // 64 + 2 * 2 * 128  # the V-wide terms again at V = 128 more: u, h, dh, v, dv
    assert kda_backward_bytes(KIMI, 1, 1, cp=2) == (per_head + wider) * 32
    s = 32768
    moment = kda_working_set(KIMI, s, 1, 1) + kda_backward_bytes(KIMI, s, 1, 1) + s * FP32
    assert layer_working_set(KIMI, s, 1, 1) == pytest.approx(moment)
    # it binds: the saved mixer with the FFN's backward peak, and MLA's backward, are both smaller
    four = KIMI.with_layers(4)
    assert four.num_linear_attn_layers == 3 and four.num_attention_layers == 1
    assert layer_working_set(four, s, 1, 1) == pytest.approx(moment)
    ffn_side = layer_saved(KIMI, s, 1, 1)[0] + max(dense_ffn_moments(KIMI, s, 1)[1], *moe_moments(KIMI, s)[1:])
    assert ffn_side < moment


def test_kda_rule_runs_at_its_measured_share_of_the_delta_rule_rate():
    """KDA's chunked rule is charged KDA_RULE_RATE of the profile's delta-rule rate (measured: chunk_kda against
    chunk_gated_delta_rule per FLOP); every other rate, and Gated DeltaNet's, are the profile's."""
    from recipe.cost import KDA_RULE_RATE, rates

    h200 = load_profile("h200")
    qwen = resolve_model("qwen35-35b")
    kimi, plain = rates(h200, KIMI), rates(h200, qwen)
    assert KDA_RULE_RATE == 0.62
    assert kimi["delta_rule"] == pytest.approx(plain["delta_rule"] * KDA_RULE_RATE)
    assert plain["delta_rule"] == pytest.approx(h200.peak_bf16_tflops * 1e12 * h200.efficiency.delta_rule)
    assert kimi["dense_gemm"] == plain["dense_gemm"] and kimi["lm_head"] == plain["lm_head"]


def test_kda_and_mla_both_charge_their_cp_work():
    """Under CP a Kimi-Linear stage pays MLA's latent expansion of the other ranks' tokens and KDA's segment
    combine, both (four layers: three KDA, one MLA; cp = 2, 32K, full recompute): t_cp = bytes / bw + (3 + 1)
    expansions at the dense GEMM rate + per KDA layer 4 combines and 3·2 collective latencies."""
    from recipe.cost import COLLECTIVE_LATENCY_S, communication_terms, cp_combine_seconds, group_bw, rates

    h200 = load_profile("h200")
    m, o = KIMI.with_layers(4), opts(32768)
    comm, t = communication_terms(m, h200, 2, Layout(cp=2), o)
    s, a, r = 16384, m.mla, rates(h200)
    expand = 2 * a.kv_lora_rank * 32 * (a.qk_nope_head_dim + a.v_head_dim) * s
    combine = cp_combine_seconds(s, 32, m.linear_attn, 2, r["delta_rule"])
    expect = (comm["cp"] / group_bw(h200, 2, 1, 2) + 4 * expand / r["dense_gemm"]
              + 3 * (4 * combine + 3 * 2 * COLLECTIVE_LATENCY_S))
    assert t["cp"] == pytest.approx(expect, rel=1e-12)
