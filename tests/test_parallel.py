"""Layouts on real process groups (gloo, CPU): FSDP2, expert, context, tensor and pipeline parallelism equal
one process.

Two launches (world sizes 2 and 4), each running every case of its size in one process group (tests/dist_cases.py):
the loss of each of two steps, step 1's other metrics and every gradient of step 1 against the same steps on one
process, in fp32. Tolerances: losses and metrics 1e-6 relative; gradients 1e-5 of each tensor's largest entry (or of
three thousandths of the largest gradient anywhere, for the near-cancelling A_log / dt_bias sums); k chunks equal one
chunk bitwise. CP: cp=2 (world 2), cp=4 and cp=2 × ep=2 with dp=2 (world 4) on packed micro-batches whose documents
cross segment edges, with a padded tail; and the CP exchanges alone (attention, conv halo, delta-rule combine) against
the one-process functions in fp64, outputs and input gradients to 1e-12. PP: pp=2 with an uneven split (3 + 1
layers) on off-policy sequence-mean data and interleaved over 2 virtual stages a rank (world 2), pp=2 × dp=2 with
ep=2 inside each stage, pp=4 (two middle stages), pp=2 × cp=2, pp=2 × tp=2 with ep=2 and a dense model at pp=2 ×
tp=2 interleaved (world 4). TP:
tp=2 alone and with ep=2 over the tp ranks (world 2), tp=2 × dp=2 with ep=1 and ep=4 and cp=2 × tp=2 with ep=4
(world 4), on packed micro-batches padded to whole sequence-parallel rows with documents across the tp ranks' edge.

Plus the pieces by hand: the regroup index, the micro-batch share, the layout checks, the grouped GEMMs.
"""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

from launch.expert_parallel import chunk_orders, chunk_regroup_index, regroup_index  # noqa: E402
from launch.moe import grouped_linear, grouped_linear_dx, grouped_weight_grad, permute  # noqa: E402
from launch.parallel import LayoutError, check_layout, micro_batch_share  # noqa: E402
from recipe.plan import LayoutSpec  # noqa: E402

LOSS_TOL, GRAD_TOL = 1e-6, 1e-5


def _launch(world: int, cases: list, tmp_path: Path) -> dict:
    import dist_cases

    return {r["name"]: r for r in dist_cases.spawn(world, cases, tmp_path / f"world{world}.json")}


@pytest.fixture(scope="module")
def world2(tmp_path_factory):
    import dist_cases

    return _launch(2, dist_cases.CASES[2], tmp_path_factory.mktemp("world2"))


@pytest.fixture(scope="module")
def world4(tmp_path_factory):
    import dist_cases

    return _launch(4, dist_cases.CASES[4], tmp_path_factory.mktemp("world4"))


def _assert_equal_to_one_process(r: dict) -> None:
    assert max(r["loss_rel"]) <= LOSS_TOL, f"{r['name']}: losses {r['losses']} vs one process {r['ref_losses']}"
    assert max(r["metric_rel"].values()) <= LOSS_TOL, f"{r['name']}: metrics differ by {r['metric_rel']}"
    assert r["grad_rel"] <= GRAD_TOL, f"{r['name']}: gradient {r['worst_grad']} differs by {r['grad_rel']:.2e}"


@pytest.mark.dist
@pytest.mark.parametrize("name", ["dp2", "ep2_k1", "ep2_k2", "ep2_k4", "ep2_k2_no_recompute", "ep2_k2_keep1"])
def test_world2_layouts_equal_one_process(world2, name):
    _assert_equal_to_one_process(world2[name])


@pytest.mark.dist
@pytest.mark.parametrize("name", ["dp4_ep2_k1", "dp4_ep2_k2", "dp4_ep4_k1"])
def test_world4_layouts_equal_one_process(world4, name):
    _assert_equal_to_one_process(world4[name])


@pytest.mark.dist
def test_the_runs_memory_figures_are_the_largest_over_ranks(world2):
    """launch/job.py reports each peak memory as its largest over the ranks (rank r passes 1 + r and 10 − r)."""
    assert world2["max_over_ranks"]["max"] == {"peak_mem_gb": 2.0, "peak_device_gb": 10.0}


@pytest.mark.dist
@pytest.mark.parametrize("world, name", [(2, "dense_dp2"), (4, "dense_tp2_dp2")])
def test_dense_model_layouts_equal_one_process(world2, world4, world, name):
    """A dense model (Qwen3.5 dense: Gated DeltaNet and attention layers, a SwiGLU MLP in every layer, no expert
    unit for FSDP2) under dp=2 and tp=2 × dp=2 equals one process."""
    _assert_equal_to_one_process({2: world2, 4: world4}[world][name])


@pytest.mark.dist
@pytest.mark.parametrize("world, name", [(2, "cp2"), (4, "cp4"), (4, "cp2_ep2")])
def test_context_parallel_layouts_equal_one_process(world2, world4, world, name):
    """Every step's loss (reported once per micro-batch: the cp ranks' parts add up), every metric and every
    gradient; cp2_ep2 is off-policy (ratio, truncated IS, KL, entropy) with sequence-mean aggregation."""
    _assert_equal_to_one_process({2: world2, 4: world4}[world][name])


@pytest.mark.dist
def test_context_parallel_data_crosses_segment_edges_and_pads(world2, world4):
    """The CP micro-batches hold documents across segment edges and a padded tail (not a multiple of 2·cp·16)."""
    for r in (world2["cp2"], world4["cp4"], world4["cp2_ep2"]):
        assert r["cp_docs_cross_segments"] and min(r["cp_padding"]) > 0, r["name"]
    assert world2["cp2"]["cp_segment_len"] == [32] and world4["cp4"]["cp_segment_len"] == [16]


@pytest.mark.dist
@pytest.mark.parametrize("world, name", [(2, "pieces_cp2"), (4, "pieces_cp4")])
def test_context_parallel_exchanges_are_exact_in_fp64(world2, world4, world, name):
    """K/V all-gather attention (dense-mask path; per piece as prefix + square merged by their log-sum-exps, and
    as one lower-right causal call), gpt-oss's attention with sinks (full, merged and one call; sliding windows of
    5 and 40 tokens, the second reaching past a segment), the conv with its halo and the delta rule with its
    state combine, forward and backward across ranks, equal the one-process functions to fp64 rounding; documents
    start on a segment edge and inside segments. Without the combine the delta rule is off by > 0.1."""
    r = {2: world2, 4: world4}[world][name]
    for piece in ("attn_dense", "attn_pieces", "attn_lower_right", "sink_full", "sink_full_lower_right",
                  "sink_window5", "sink_window40", "conv", "delta"):
        assert r[piece] < 1e-12, f"{name}: {piece} differs by {r[piece]:.2e}"
    assert r["delta_without_combine"] > 0.1
    assert r["edges_with_a_document_start"] >= 1


@pytest.mark.dist
@pytest.mark.parametrize("world, name", [(2, "tp2"), (2, "tp2_ep2"), (4, "tp2_dp2"), (4, "tp2_dp2_ep4"),
                                         (4, "cp2_tp2_ep4")])
def test_tensor_parallel_layouts_equal_one_process(world2, world4, world, name):
    """tp=2 on the Qwen3.5-style tiny model (Gated DeltaNet and attention layers, MoE with a shared expert):
    alone, with ep=2 over the tp ranks (the sequence-parallel tokens reach the experts once), with dp=2 (FSDP2 over
    dp on the tp DTensors; micro-batches padded with weight-0 repeats) and with dp=2 × ep=4 without recompute,
    off-policy with sequence-mean aggregation; and cp=2 × tp=2 with ep=4 (the CP exchanges on each rank's heads,
    the sequence-parallel rows a split of its zigzag shard): every step's loss, the metrics, the clipping norm and
    every gradient equal one process."""
    _assert_equal_to_one_process({2: world2, 4: world4}[world][name])


@pytest.mark.dist
@pytest.mark.parametrize("world, name", [(2, "mla_cp2"), (2, "mla_tp2_ep2"), (4, "mla_cp2_tp2_ep4"),
                                         (4, "mla_pp2_dp2_ep2")])
def test_deepseek_v3_layouts_equal_one_process(world2, world4, world, name):
    """The DeepSeek-V3-style tiny model (dist_cases.tiny_mla: MLA with the q LoRA, YaRN, a dense first layer,
    sigmoid group-limited routing with a non-zero correction bias, a shared expert) under cp=2, tp=2 × ep=2 (MLA's
    per-head expansions split, its latents replicated), cp=2 × tp=2 × ep=4 and pp=2 × dp=2 × ep=2 equals one
    process; under tp every parameter but the routed experts is a tp DTensor."""
    r = {2: world2, 4: world4}[world][name]
    _assert_equal_to_one_process(r)
    if "tp2" in name:
        import dist_cases
        from launch.model import build_model

        dense = sum(1 for n, _ in build_model(dist_cases.tiny_mla()).named_parameters() if ".mlp.experts." not in n)
        assert r["tensor_parallel_params"] == dense


@pytest.mark.dist
@pytest.mark.parametrize("world, name", [(2, "dsa_cp2_keepsel"), (2, "dsa_tp2_ep2"), (2, "dsa_pp2_keepsel"),
                                         (4, "dsa_cp2_tp2_ep4")])
def test_deepseek_sparse_attention_layouts_equal_one_process(world2, world4, world, name):
    """DeepSeek sparse attention (dist_cases.tiny_dsa: tiny_mla's blocks with an indexer keeping 6 keys a query)
    under cp=2 (each rank's queries select among the whole micro-batch's gathered index keys and latents, the
    latents' gradients flowing back to their own ranks), tp=2 × ep=2 (the absorbed heads split, the indexer's
    weights replicated, each rank projecting index queries and selecting keys for half the queries, the selections
    all-gathered), pp=2 and cp=2 ×
    tp=2 × ep=4 equals one process; the indexer, frozen, has no gradient anywhere and every other parameter but the
    routed experts is a tp DTensor. Under cp=2 and pp=2 the recomputed layers keep
    their selections (train.keep_selections): the indexer runs once a layer and micro-batch, not twice, and the
    step is the same (the last layer, sharing the third's selection, reads it in its recomputed forward either way)."""
    r = {2: world2, 4: world4}[world][name]
    _assert_equal_to_one_process(r)
    assert r["indexer_passes"] == (1 if name.endswith("keepsel") else 2)
    if "tp2" in name:  # rank 0 selects for its ⌈T/2⌉ of each micro-batch's queries, the other rank for the rest,
        # and projects index queries for those only
        assert 0.5 <= r["selection_rows_share"] < 0.55
        assert r["index_query_share"] == pytest.approx(r["selection_rows_share"])
    else:
        assert r["selection_rows_share"] is None and r["index_query_share"] == 1.0
    if "tp2" in name:
        import dist_cases
        from launch.model import build_model

        dense = sum(1 for n, _ in build_model(dist_cases.tiny_dsa()).named_parameters() if ".mlp.experts." not in n)
        assert r["tensor_parallel_params"] == dense


@pytest.mark.dist
@pytest.mark.parametrize("name", ["oss_ep2", "oss_tp2_ep2", "oss_pp2", "oss_cp2"])
def test_gpt_oss_layouts_equal_one_process(world2, name):
    """The gpt-oss-style tiny model (dist_cases.tiny_oss: attention sinks, sliding and full layers, q/k/v/o biases,
    biased router and experts, the clamped GLU acting) under dp=2 × ep=2 with 2 chunks, tp=2 × ep=2 (sinks split
    with the heads, o_proj's bias added once over the tp ranks), pp=2 and cp=2 (sinks and windows over the
    gathered keys, documents across segment edges) equals one process; under tp every parameter but the routed
    experts is a tp DTensor."""
    r = world2[name]
    _assert_equal_to_one_process(r)
    if "tp2" in name:
        import dist_cases
        from launch.model import build_model

        dense = sum(1 for n, _ in build_model(dist_cases.tiny_oss()).named_parameters() if ".mlp.experts." not in n)
        assert r["tensor_parallel_params"] == dense


@pytest.mark.dist
def test_sliding_windows_without_sinks_under_context_parallelism_equal_one_process(world2):
    """The Mixtral-style tiny model with sliding windows and no sinks (dist_cases.tiny_swa: windows of 8 keys on
    three layers, a full one last) under cp=2 (each piece's window reaching back over the gathered keys, documents
    across segment edges) equals one process."""
    r = world2["swa_cp2"]
    _assert_equal_to_one_process(r)
    assert r["cp_docs_cross_segments"]


@pytest.mark.dist
@pytest.mark.parametrize("name, shape", [("olmoe_tp2_ep2", "tiny_olmoe"), ("qwen2moe_tp2", "tiny_qwen2_moe")])
def test_olmoe_and_qwen2_moe_under_tensor_parallelism_equal_one_process(world2, name, shape):
    """The OLMoE-style tiny model (dist_cases.tiny_olmoe: q/k norms over all heads, each tp rank holding half of
    them and the sums of squares added over the ranks; q/k/v/o biases) under tp=2 × ep=2, and the Qwen2-MoE-style
    one (q/k/v biases, the gated shared expert) under tp=2, equal one process; every parameter but the routed
    experts is a tp DTensor."""
    import dist_cases
    from launch.model import build_model

    r = world2[name]
    _assert_equal_to_one_process(r)
    dense = sum(1 for n, _ in build_model(getattr(dist_cases, shape)()).named_parameters() if ".mlp.experts." not in n)
    assert r["tensor_parallel_params"] == dense


@pytest.mark.dist
@pytest.mark.parametrize("world, name, shape", [
    (2, "minimax_tp2_ep2", "tiny_minimax"), (4, "mimo_cp2_tp2_ep2", "tiny_mimo"),
    (4, "afmoe_cp2_tp2_ep2", "tiny_afmoe"), (4, "cohere_cp2_dp2_ep2", "tiny_cohere"),
    (4, "step_cp2_tp2_ep2", "tiny_step"), (4, "kimi_cp2_tp2_ep2", "tiny_kimi"),
    (4, "mistral4_cp2_tp2_ep2", "tiny_mistral4"), (4, "axk1_tp2_dp2_ep2_k2", "tiny_axk1"),
    (4, "gemma4_cp2_dp2_ep2_k2", "tiny_gemma4"), (4, "axk2_cp2_tp2_ep2", "tiny_axk2")])
def test_per_family_layouts_equal_one_process(world2, world4, world, name, shape):
    """The families' own blocks under layouts that split them: MiniMax-M2 (q/k norms over all heads) at tp=2 ×
    ep=2; MiMo-V2-Flash (sliding layers with their own KV heads, sinks and RoPE base), AFMoE (sandwich norms, the
    output gate), Step-3.7 (per-kind heads, a gate per head, clamped SwiGLU) and Kimi-Linear (KDA's per-channel
    decays through the CP state combine, its heads split over tp; RoPE-free MLA) and Mistral 4 (the query scale on
    each rank's global positions, a softmax router) at cp=2 × tp=2 × ep=2; A.X K1 (a norm on the MoE output, its
    experts' output kept for the backward) at tp=2 × dp=2 × ep=2 in 2 chunks; Gemma 4 (per-kind head widths, keys
    as values, the dense MLP beside the experts, the scaled router, layer scalars, soft-capped logits; tied, so
    tp = 1) at cp=2 × dp=2 × ep=2 in 2 chunks; A.X K2 (the gated query split with its heads over tp, the gated
    norms) at cp=2 × tp=2 × ep=2; Cohere2-MoE
    (a parallel block, tied embeddings) at cp=2 × dp=2 × ep=2: each equals one process; under tp every parameter but
    the routed experts is a tp DTensor, and under cp documents cross the segment edges."""
    import dist_cases
    from launch.model import build_model

    r = {2: world2, 4: world4}[world][name]
    _assert_equal_to_one_process(r)
    if "tp2" in name:
        model = build_model(getattr(dist_cases, shape)())
        assert r["tensor_parallel_params"] == sum(1 for n, _ in model.named_parameters() if ".mlp.experts." not in n)
    if "cp2" in name:
        assert r["cp_docs_cross_segments"]


@pytest.mark.dist
@pytest.mark.parametrize("name", ["ernie_ep2", "ernie_cp2"])
def test_ernie_layouts_equal_one_process(world2, name):
    """The ERNIE-4.5-style tiny model (dist_cases.tiny_ernie: softmax scores steered by a correction bias, shared
    experts, a dense first layer, interleaved RoPE, tied embeddings) under dp=2 × ep=2 with 2 chunks and under cp=2
    (the rotated keys exchanged, documents across segment edges) equals one process."""
    _assert_equal_to_one_process(world2[name])


@pytest.mark.dist
@pytest.mark.parametrize("name", ["llama4_cp2", "llama4_tp2_ep2"])
def test_llama4_layouts_equal_one_process(world2, name):
    """The Llama-4-style tiny model (dist_cases.tiny_llama4: chunked attention in runs of 8 positions, a RoPE-free
    global layer with query temperature, q/k at unit RMS, top-2 sigmoid weights on the experts' input, MoE every
    second layer) under cp=2 (runs cut on the whole micro-batch's positions, documents across segment edges) and
    under tp=2 × ep=2 equals one process; under tp every parameter but the routed experts is a tp DTensor."""
    r = world2[name]
    _assert_equal_to_one_process(r)
    if "tp2" in name:
        import dist_cases
        from launch.model import build_model

        dense = sum(1 for n, _ in build_model(dist_cases.tiny_llama4()).named_parameters() if ".mlp.experts." not in n)
        assert r["tensor_parallel_params"] == dense
    else:
        assert r["cp_docs_cross_segments"]


@pytest.mark.dist
def test_granite_under_tensor_parallelism_equals_one_process(world2):
    """The Granite-MoE-style tiny model (dist_cases.tiny_granite: the embedding multiplier through the
    vocabulary-parallel embedding, attention's own scale, residual multipliers, the logits' divisor in the head's
    temperature, a shared expert) under tp=2 × ep=2 equals one process; every parameter but the routed experts is a tp
    DTensor."""
    import dist_cases
    from launch.model import build_model

    r = world2["granite_tp2_ep2"]
    _assert_equal_to_one_process(r)
    dense = sum(1 for n, _ in build_model(dist_cases.tiny_granite()).named_parameters() if ".mlp.experts." not in n)
    assert r["tensor_parallel_params"] == dense


@pytest.mark.dist
def test_tensor_parallel_splits_every_dense_parameter_and_the_data_crosses_edges(world2, world4):
    """Every parameter but the routed experts is a tp DTensor, some micro-batch is padded to whole
    sequence-parallel rows, and some document runs across the edge between two tp ranks' rows."""
    from launch.model import build_model
    from recipe.models import PRESETS

    dense = sum(1 for n, _ in build_model(PRESETS["tiny-moe"]).named_parameters() if ".mlp.experts." not in n)
    for r in (world2["tp2"], world2["tp2_ep2"], world4["tp2_dp2"], world4["tp2_dp2_ep4"], world4["cp2_tp2_ep4"]):
        assert r["tensor_parallel_params"] == dense, r["name"]
        assert r["tp_padded"] and r["tp_docs_cross_shard_edges"], r["name"]
    assert world4["tp2_dp2"]["num_micro_batches"][0] % 2 == 1  # dp=2 pads step 1


@pytest.mark.dist
@pytest.mark.parametrize("world, name", [(2, "pp2"), (2, "pp2_v2"), (4, "pp2_dp2_ep2"), (4, "pp4"),
                                         (4, "pp2_cp2"), (4, "pp2_dp2_ep2_keep1"), (4, "pp2_tp2_ep2"),
                                         (4, "dense_pp2_v2_tp2")])
def test_pipeline_layouts_equal_one_process(world2, world4, world, name):
    """pp=2 (1F1B, micro-batches padded to the plan's micro_batch_tokens), pp=2 with 2 virtual stages a rank
    (interleaved 1F1B), pp=2 × dp=2 with ep=2 inside each stage, pp=4, pp=2 × cp=2, pp=2 × dp=2 × ep=2 with
    the last layer of each stage kept (partial recompute), pp=2 × tp=2 with ep=2 over each stage's tp ranks on an
    uneven split, and a dense model at pp=2 × tp=2 interleaved: every step's loss and metrics (on the last stage,
    broadcast to every rank) and every gradient of every stage equal one process."""
    _assert_equal_to_one_process({2: world2, 4: world4}[world][name])


@pytest.mark.dist
def test_pipeline_with_tensor_parallel_splits_each_stage(world4):
    """Under pp × tp each rank's stages hold their dense parameters as tp DTensors (the embedding on the first
    stage, the head on the last) and exchange their sequence-parallel rows, some document across the tp ranks'
    edge."""
    import dist_cases
    from launch.model import build_model

    def dense_params(model, layers, first, last):
        return sum(1 for n, _ in model.named_parameters() if ".mlp.experts." not in n and (
            (n.startswith("layers.") and n.split(".")[1] in layers) or (first and n.startswith("embed_tokens."))
            or (last and n.split(".")[0] in ("norm", "lm_head"))))

    for name, variant in (("pp2_tp2_ep2", "cp_off"), ("dense_pp2_v2_tp2", "dense")):
        whole = build_model(dist_cases._shape(variant))
        r = world4[name]
        assert r["tp_docs_cross_shard_edges"], name
        # rank 0 holds the first stage(s): its count of tp parameters is theirs
        layers, first, last = r["pipeline"][0][1], r["pipeline"][0][2], r["pipeline"][0][3]
        assert r["tensor_parallel_params"] == dense_params(whole, layers, first, last), name


@pytest.mark.dist
def test_pipeline_stages_hold_their_layers_and_run_every_micro_batch(world2, world4):
    """Each rank holds its stage's layers only (the embedding with the first, the head with the last) and runs one
    forward per micro-batch of its data-parallel share: steps of 2 and 2 micro-batches at pp=2 (2 + 2, 1F1B); 3 and
    6 at dp=2 (2 + 3); at pp=4 fewer micro-batches than stages (2 + 2, GPipe: no weight-0 micro-batch added);
    interleaved, a multiple of pp = 2 a stage (2 stages × (2 + 2))."""
    r = world2["pp2"]
    assert r["num_micro_batches"] == [2, 2]
    assert r["pipeline"] == [[0, ["0", "1", "2"], True, False, 4], [1, ["3"], False, True, 4]]
    r = world2["pp2_v2"]  # interleaved: rank 0 holds stages 0 and 2, rank 1 stages 1 and 3
    assert r["pipeline"] == [[0, ["0", "2"], True, False, 8], [1, ["1", "3"], False, True, 8]]
    r = world4["pp2_dp2_ep2"]
    assert r["num_micro_batches"] == [3, 6]
    assert r["pipeline"] == [[0, ["0", "1"], True, False, 5], [1, ["2", "3"], False, True, 5]]
    r = world4["pp4"]  # two middle stages
    assert r["pipeline"] == [[0, ["0"], True, False, 4], [1, ["1"], False, False, 4], [2, ["2"], False, False, 4],
                             [3, ["3"], False, True, 4]]
    r = world4["pp2_cp2"]  # each cp rank's zigzag shard flows between the stages, documents across segment edges
    assert r["cp_segment_len"] == [32] and r["cp_docs_cross_segments"]
    # partial recompute, stages [3, 1], one layer kept a stage: stage 0 recomputes layers 0 and 1, stage 1 none
    assert [p[1] for p in world4["pp2_dp2_ep2_keep1"]["pipeline"]] == [["0", "1", "2"], ["3"]]
    assert world4["pp2_dp2_ep2_keep1"]["recomputed_layers"] == [0, 1]
    assert world4["pp2_dp2_ep2"]["recomputed_layers"] == [0, 1]  # the split [2, 2], every layer recomputed
    # what an export writes: every stage's tensors gathered whole (tp, ep and dp shards joined) under the model's names
    for r in (world2["pp2"], world2["pp2_v2"], world4["pp2_dp2_ep2"], world4["pp4"], world4["pp2_tp2_ep2"],
              world4["dense_pp2_v2_tp2"]):
        assert r["export_equal"] is True, r["name"]


@pytest.mark.dist
def test_chunked_dispatch_equals_one_chunk_bitwise(world2, world4):
    assert world2["ep2_k2"]["bitwise_equal_k1"] is True
    assert world2["ep2_k4"]["bitwise_equal_k1"] is True
    assert world4["dp4_ep2_k2"]["bitwise_equal_k1"] is True


@pytest.mark.dist
def test_the_data_exercises_padding_and_idle_experts(world2, world4):
    """Step 1 has 3 micro-batches (dp=2 and dp=4 pad with weight-0 repeats), and some rank receives no row for
    some expert in some chunk."""
    assert world2["dp2"]["num_micro_batches"][0] % 2 == 1
    assert world2["ep2_k4"]["zero_rows_for_an_expert"]
    assert world4["dp4_ep2_k2"]["zero_rows_for_an_expert"]


@pytest.mark.dist
def test_recomputed_forward_reissues_only_the_dispatch(world2):
    """Per layer, micro-batch and chunk under full recompute: D and C in the forward, D again in the recompute,
    D' and C' in the backward = 5 all-to-alls (6 if the recompute re-issued the combine)."""
    r = world2["ep2_k2"]
    assert r["all_to_alls_per_layer_chunk_micro_batch"] == 5
    assert world2["ep2_k2_no_recompute"]["all_to_alls_per_layer_chunk_micro_batch"] == 4  # one forward only
    # the last of the 4 layers kept (partial recompute): 5 in the three recomputed, 4 in it
    assert world2["ep2_k2_keep1"]["all_to_alls_per_layer_chunk_micro_batch"] == (3 * 5 + 4) / 4
    assert world2["ep2_k2_keep1"]["recomputed_layers"] == [0, 1, 2]


# ---- the pieces, by hand ---------------------------------------------------------------------------------------
def test_regroup_index_by_hand():
    # src-major R=2 × El=2: rows 0-1 (s0, e0), 2 (s0, e1), 3 (s1, e0), 4-5 (s1, e1) → expert-major
    assert regroup_index(torch.tensor([[2, 1], [1, 2]]), (1, 0), 6).tolist() == [0, 1, 3, 2, 4, 5]
    assert regroup_index(torch.tensor([[1, 1], [1, 1]]), (1, 0), 4).tolist() == [0, 2, 1, 3]
    assert regroup_index(torch.tensor([[0, 3], [0, 0]]), (1, 0), 3).tolist() == [0, 1, 2]  # idle expert and rank
    # chunk-major [C=2, El=1, R=2] → (expert, source, chunk): c0 s0 row 0, c0 s1 rows 1-2, c1 s0 row 3, c1 s1 row 4
    assert regroup_index(torch.tensor([[[1, 2]], [[1, 1]]]), (1, 2, 0), 5).tolist() == [0, 3, 1, 2, 4]
    # and back: where each chunk-major row lands in that order (the backward's `dest`, the inverse of the above),
    # from the counts in (expert, source, chunk) order [El=1, R=2, C=2]
    assert regroup_index(torch.tensor([[[1, 1], [2, 1]]]), (2, 0, 1), 5).tolist() == [0, 2, 3, 1, 4]


@pytest.mark.parametrize("T,C", [(7, 1), (7, 3), (13, 4), (16, 16), (64, 5), (3, 5), (0, 2)])
def test_one_sort_of_every_chunk_equals_a_sort_of_each(T, C):
    """The route sorts every chunk's slots in one stable sort by (chunk, expert) and regroups every chunk's received
    rows in one call; each chunk's part equals what a sort of that chunk alone and its own regroup give, idle experts
    and empty segments included."""
    g = torch.Generator().manual_seed(T * 31 + C)
    E, K, R = 6, 2, 3
    top_e = torch.randint(0, E - 1, (T, K), generator=g)  # expert E-1 idle
    orders, counts = chunk_orders(top_e, C, E)
    for c, (local, token) in enumerate(orders):
        t0, t1 = c * T // C, (c + 1) * T // C
        order, tok, n = permute(top_e[t0:t1], E)
        assert torch.equal(local, order) and torch.equal(token, tok + t0) and torch.equal(counts[c], n)
    recv = torch.randint(0, 3, (R, C, E // R), generator=g)
    recv[0, :, 1] = 0  # an expert that receives nothing from rank 0
    if C > 1:
        recv[:, 1] = 0  # a chunk that receives nothing at all
    sizes = recv.sum((0, 2)).tolist()
    whole = chunk_regroup_index(recv, sum(sizes))
    for c, part in enumerate(torch.split(whole, sizes)):
        assert torch.equal(part, regroup_index(recv[:, c], (1, 0), sizes[c]))


def test_micro_batch_share_by_hand():
    assert micro_batch_share(5, 0, 2) == [0, 2, 4]
    assert micro_batch_share(5, 1, 2) == [1, 3, None]  # padded: same count of forwards on every rank
    assert micro_batch_share(3, 3, 4) == [None]
    assert micro_batch_share(1, 0, 1) == [0]


def test_layout_checks_name_every_factor():
    layout = LayoutSpec(pp=1, tp=1, cp=1, ep=2, dp=4, etp=1, edp=2)
    check_layout(layout, 4)
    with pytest.raises(LayoutError, match=r"pp·tp·cp·dp = 1·1·1·4 = 4 processes but this run has WORLD_SIZE=2"):
        check_layout(layout, 2)
    check_layout(LayoutSpec(pp=1, tp=1, cp=2, ep=2, dp=2, etp=1, edp=2), 4)  # cp runs
    check_layout(LayoutSpec(pp=2, tp=1, cp=1, ep=2, dp=2, etp=1, edp=1), 4)  # pp runs, with dp and ep
    check_layout(LayoutSpec(pp=2, tp=2, cp=1, ep=1, dp=1, etp=1, edp=2), 4)  # and with tp
    with pytest.raises(LayoutError, match=r"the plan asks for etp=2"):
        check_layout(LayoutSpec(pp=1, tp=2, cp=1, ep=1, dp=2, etp=2, edp=2), 4)


def test_the_solver_never_emits_expert_tensor_parallelism():
    """etp > 1 is refused by check_layout (above); nothing asks for it: etp cannot be pinned, every committed plan
    has etp=1, and so has every solve of every preset at 8 and 64 GPUs (the solver's layouts carry no etp)."""
    from recipe.cost import TrainOptions
    from recipe.hw import load_profile
    from recipe.models import PRESETS
    from recipe.plan import load_plan
    from recipe.solver import InfeasibleError, normalize_pins, solve

    with pytest.raises(ValueError, match="unknown pin 'etp'"):
        normalize_pins({"etp": 2})
    plans = sorted((Path(__file__).parent.parent / "plans").glob("*.yaml"))
    assert plans and all(load_plan(p).layout.etp == 1 for p in plans)
    solved = 0
    for name in PRESETS:
        for world in (8, 64):
            try:
                solution = solve(PRESETS[name], load_profile("h200"), world, TrainOptions(micro_batch_tokens=32768))
            except InfeasibleError:
                continue
            assert solution.degrees["etp"] == 1, (name, world)
            solved += 1
    assert solved >= len(PRESETS)


def test_check_plan_shape_refuses_tp_that_does_not_split_heads():
    """One line naming the degree and what it does not divide (recipe check's rules), before any group."""
    from launch.parallel import check_plan_shape
    from recipe.models import PRESETS

    shape = PRESETS["tiny-moe"]  # 4 query heads, 2 KV heads, 2 linear-attention key heads, vocabulary 512

    def plan(tp):
        return types.SimpleNamespace(layout=LayoutSpec(pp=1, tp=tp, cp=1, ep=1, dp=1, etp=1, edp=tp),
                                     train=types.SimpleNamespace(micro_batch_tokens=4096, pp_stages=None))

    check_plan_shape(plan(2), shape)
    with pytest.raises(LayoutError, match=r"^tp=3: 4 attention heads of tiny-moe are not divisible by tp=3$"):
        check_plan_shape(plan(3), shape)
    with pytest.raises(LayoutError, match=r"^tp=4: 2 KV heads of tiny-moe are not divisible by tp=4$"):
        check_plan_shape(plan(4), shape)


def test_tensor_parallel_refuses_what_it_cannot_split():
    """A tied embedding and head, or an MLA output bias: one line each."""
    import dataclasses

    from launch.model import build_model
    from launch.tensor_parallel import check_model
    from recipe.models import PRESETS

    shape = PRESETS["tiny-moe"]
    check_model(build_model(shape), 2)
    with pytest.raises(ValueError, match="ties its embedding to the LM head"):
        check_model(build_model(dataclasses.replace(shape, tie_embeddings=True)), 2)
    check_model(build_model(dataclasses.replace(shape, attn_bias=True)), 2)  # Attention adds 1/tp of the bias
    import dist_cases

    with pytest.raises(ValueError, match="output projection has a bias"):  # MLA's is not split
        check_model(build_model(dataclasses.replace(dist_cases.tiny_mla(), attn_bias=True)), 2)


def test_parallelize_refuses_ep_without_a_process_group():
    from launch.model import build_model
    from launch.parallel import parallelize
    from recipe.models import PRESETS

    plan = types.SimpleNamespace(layout=LayoutSpec(pp=1, tp=1, cp=1, ep=1, dp=1, etp=1, edp=1),
                                 train=types.SimpleNamespace(recompute="full", ep_overlap_chunks=2))
    with pytest.raises(LayoutError, match="process group"):
        parallelize(build_model(PRESETS["tiny-moe"]), plan, None, ep_dispatch=True)


def test_a_world_of_one_builds_its_parameters_in_the_compute_dtype():
    """FSDP2 (which casts parameters for compute) is not applied at world size 1, so a rank alone must build
    `dtype` parameters itself, with meshes or without; building on the meta device and materializing, as the
    distributed branch does, would leave every GEMM in fp32. Both branches build the same weights."""
    from launch.job import build_parallel_model
    from recipe.models import PRESETS

    plan = types.SimpleNamespace(layout=LayoutSpec(pp=1, tp=1, cp=1, ep=1, dp=1, etp=1, edp=1),
                                 train=types.SimpleNamespace(recompute="full", ep_overlap_chunks=1))
    alone = types.SimpleNamespace(world=1)  # the meshes of a one-rank group, as far as parallelize looks
    shape = PRESETS["tiny-moe"]
    models = [build_parallel_model(shape, plan, meshes, torch.device("cpu"), torch.bfloat16, seed=3)
              for meshes in (None, alone)]
    for model in models:
        assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    a, b = (m.state_dict() for m in models)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_few_wide_experts_take_one_gemm_each():
    """The dispatch rule on CUDA bf16: Mixtral's 8 experts (59M and 117M elements a matrix) run one cuBLAS GEMM each,
    as they do under expert parallelism (1 a rank at ep = 8); Qwen3-30B-A3B's 128 narrow ones, 16 of them a rank at
    ep = 8, and 24 wide ones take the grouped kernel; CPU and fp32 always take the loop."""
    import types

    from launch.moe import _use_grouped_mm

    gpu = types.SimpleNamespace(is_cuda=True, dtype=torch.bfloat16)
    assert not _use_grouped_mm(gpu, (8, 2 * 14336, 4096)) and not _use_grouped_mm(gpu, (8, 4096, 14336))
    assert not _use_grouped_mm(gpu, (1, 2 * 14336, 4096))
    assert _use_grouped_mm(gpu, (128, 2 * 768, 2048)) and _use_grouped_mm(gpu, (16, 2 * 768, 2048))
    assert _use_grouped_mm(gpu, (24, 2 * 14336, 4096))
    assert not _use_grouped_mm(types.SimpleNamespace(is_cuda=True, dtype=torch.float32), (128, 1536, 2048))
    assert not _use_grouped_mm(torch.empty(1, dtype=torch.bfloat16), (128, 1536, 2048))


def test_grouped_gemms_by_expert_with_idle_experts():
    torch.manual_seed(0)
    counts = [3, 0, 5, 1]
    x, dy = torch.randn(9, 6), torch.randn(9, 4)
    w = torch.randn(4, 4, 6)
    offs = torch.tensor(counts).cumsum(0).to(torch.int32)
    y = grouped_linear(x, w, counts, offs)
    dx = grouped_linear_dx(dy, w, counts, offs)
    dw = grouped_weight_grad(dy, x, counts, offs)
    rows = torch.repeat_interleave(torch.arange(4), torch.tensor(counts))
    for i, e in enumerate(rows.tolist()):
        torch.testing.assert_close(y[i], w[e] @ x[i])
        torch.testing.assert_close(dx[i], dy[i] @ w[e])
    for e in range(4):
        sel = rows == e
        torch.testing.assert_close(dw[e], dy[sel].t() @ x[sel])
    assert dw[1].abs().max() == 0
    # under autograd (a caller outside the MoE's Function) the same values, and gradients that flow to x and w
    xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
    yg = grouped_linear(xg, wg, counts, offs)
    torch.testing.assert_close(yg, y, rtol=0, atol=1e-6)
    yg.backward(dy)
    torch.testing.assert_close(xg.grad, dx)
    torch.testing.assert_close(wg.grad, dw)
