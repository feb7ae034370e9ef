"""Pipeline parallel, the pieces: the cost-balanced stage split (by hand), the plan field that records it, the padding
every micro-batch gets under pp (the loss and gradients do not move), and bad input refused in one line before any
process starts. The distributed runs (pp=2, pp=2 × dp=2 against one process) are in tests/test_parallel.py."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from recipe.cost import TrainOptions, pipeline_split, split_stages, stage_costs
from recipe.hw import load_profile
from recipe.models import PRESETS

ROOT = Path(__file__).resolve().parent.parent


# ---- the split, by hand ----------------------------------------------------------------------------------------
def test_split_balances_unequal_layer_costs_by_hand():
    """Three Gated DeltaNet layers (cost 1) then a full-attention layer (cost 3), twice; the head (2) on the last
    stage. Cut after 4 layers: 1+1+1+3 = 6 and 1+1+1+3+2 = 8; after 5: 7 and 7 — the best; after 6: 8 and 6."""
    costs = [1, 1, 1, 3, 1, 1, 1, 3]
    assert split_stages(costs, 2, last=2) == [5, 3]
    assert split_stages(costs, 2) == [4, 4]  # without the head: 6 and 6
    assert split_stages(costs, 1, last=2) == [8]
    # three stages: the largest stage costs at least 6 (layer 3 alone is 3, the head stage 3 + 2 = 5 at best):
    # [4, 3, 1] costs 6, 3 and 5; on a tie each stage starts as late as it can
    assert split_stages(costs, 3, last=2) == [4, 3, 1]
    # the embedding's cost joins the first stage: [1, 3] costs 2 + 1 = 3 and 3
    assert split_stages([1, 1, 1, 1], 2, first=2) == [1, 3]
    assert split_stages([1, 1, 1, 1], 4) == [1, 1, 1, 1]


def _split_by_trying_every_cut(costs, stages, first=0.0, last=0.0):
    """The reference: the same dynamic program trying every cut from the latest down (O(stages·layers²))."""
    n, inf = len(costs), float("inf")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    best = [[inf] * (n + 1) for _ in range(stages)]
    cut = [[0] * (n + 1) for _ in range(stages)]
    for j in range(1, n + 1):
        best[0][j] = first + prefix[j]
    for s in range(1, stages):
        for j in range(s + 1, n + 1):
            for i in range(j - 1, s - 1, -1):
                cost = max(best[s - 1][i], prefix[j] - prefix[i] + (last if s == stages - 1 and j == n else 0.0))
                if cost < best[s][j]:
                    best[s][j], cut[s][j] = cost, i
    sizes, j = [], n
    for s in range(stages - 1, 0, -1):
        sizes.append(j - cut[s][j])
        j = cut[s][j]
    return [j, *sizes[::-1]]


def test_split_by_binary_search_equals_trying_every_cut():
    """The cut search (a binary search where the two sides' costs cross) picks the same cuts as trying every one,
    ties included: small integer costs (many ties), real-valued ones, a first and a last stage's extra cost."""
    import random

    rng = random.Random(5)
    for trial in range(400):
        n = rng.randint(1, 24)
        costs = ([float(rng.randint(0, 3)) for _ in range(n)] if trial % 2 else
                 [rng.uniform(0.1, 5.0) for _ in range(n)])
        stages = rng.randint(1, n)
        first, last = rng.choice([0.0, 1.0, rng.uniform(0, 4)]), rng.choice([0.0, 2.0, rng.uniform(0, 6)])
        assert split_stages(costs, stages, first, last) == _split_by_trying_every_cut(costs, stages, first, last), \
            (costs, stages, first, last)


def test_split_refuses_more_stages_than_layers():
    with pytest.raises(ValueError, match="5 pipeline stages for 4 layers"):
        split_stages([1, 1, 1, 1], 5)


def test_stage_costs_tell_layer_kinds_apart():
    """Qwen3.5-35B at 32K: a full-attention layer costs more than a Gated DeltaNet layer (its quadratic term); the
    head is three logits-sized GEMMs, 3 · 2 · V · h per token; the embedding a lookup."""
    m = PRESETS["qwen35-35b"]
    opts = TrainOptions(micro_batch_tokens=32768)
    costs, first, last = stage_costs(m, 32768, opts)
    kinds = dict(zip(m.layer_types, costs))
    assert kinds["full_attention"] > 2 * kinds["linear_attention"]
    assert len(set(c for t, c in zip(m.layer_types, costs) if t == "linear_attention")) == 1
    assert first == 0.0 and last == 3 * 2 * m.vocab_size * m.hidden_size
    split = pipeline_split(m, 4, opts)
    assert sum(split) == m.num_layers and split == split_stages(costs, 4, first, last)
    assert split[-1] < split[0]  # the head's stage holds fewer layers


def test_on_a_profile_the_split_balances_time():
    """With a profile each layer costs its operations at their measured rates (the H200's delta rule runs at a
    fraction of attention's FLOP rate) plus the per-layer latency over the micro-batch, hand-worked here for one
    Gated DeltaNet layer; the time-balanced split's slowest stage is no slower, in seconds, than the FLOP-balanced
    one's — and for 8 layers of Qwen3.5-35B at 32K it is strictly faster."""
    from recipe.cost import layer_work, rates

    m = PRESETS["qwen35-35b"].with_layers(8)
    opts = TrainOptions(micro_batch_tokens=32768)
    hw = load_profile("h200")
    r = rates(hw)
    costs, first, last = stage_costs(m, 32768, opts, hw)
    w = layer_work(m, 32768)[0]
    assert m.layer_types[0] == "linear_attention"
    h, f = m.hidden_size, m.expert_ffn  # the experts' bytes a token: its 8 routed rows, the 256 experts' weights
    assert w["expert_rows"] == 8 * (2 * h + 3 * f) * 2 and w["expert_weights"] == 256 * 3 * h * f * 2 / 32768
    # the dense matmuls' rows a token: in_proj_qkv (16 key heads × 128 twice, 32 value heads × 128), in_proj_z,
    # in_proj_b and in_proj_a (one value a value head), out_proj; the router (256 experts); the shared expert's three
    # matrices (width 512) and its gate (one output)
    rows = ((h + 8192) + (h + 4096) + 2 * (h + 32) + (4096 + h)) + (h + 256) + 3 * (h + 512) + (h + 1)
    assert w["dense_rows"] == 2 * rows
    by_hand = 4 * (w["dense_gemm"] / r["dense_gemm"] + w["dense_rows"] / r["dense_rows"]
                   + w["expert_gemm"] / r["expert_gemm"] + w["expert_rows"] / r["expert_rows"]
                   + w["expert_weights"] / r["expert_weights"] + w["delta_rule"] / r["delta_rule"]) \
        + 4 * r["layer_passes"] / 32768
    assert costs[0] == pytest.approx(by_hand, rel=1e-12)
    assert last == pytest.approx(3 * 2 * m.vocab_size * m.hidden_size / r["lm_head"], rel=1e-12)

    def slowest(split):
        a = split[0]
        return max(sum(costs[:a]) + first, sum(costs[a:]) + last)

    in_time, in_flops = pipeline_split(m, 2, opts, hw), pipeline_split(m, 2, opts)
    assert in_time != in_flops and slowest(in_time) < slowest(in_flops)


# ---- the plan records it ---------------------------------------------------------------------------------------
def _solve(tmp_path: Path, *extra: str) -> dict:
    out = tmp_path / "plan.yaml"
    r = subprocess.run([sys.executable, "-m", "recipe", "solve", "--model", "qwen35-35b", "--layers", "8", "--seq",
                        "32k", "--hw", "h200", "--gpus", "4", *extra, "-o", str(out)], capture_output=True, text=True,
                       cwd=ROOT)
    assert r.returncode == 0, r.stderr
    return yaml.safe_load(out.read_text())


def test_plan_records_the_split_and_checks_clean(tmp_path):
    plan = _solve(tmp_path, "--pp", "2")
    m = PRESETS["qwen35-35b"].with_layers(8)
    opts = TrainOptions(micro_batch_tokens=plan["train"]["micro_batch_tokens"], recompute="full")
    assert plan["train"]["pp_stages"] == pipeline_split(m, 2, opts, load_profile("h200"))
    assert sum(plan["train"]["pp_stages"]) == 8
    r = subprocess.run([sys.executable, "-m", "recipe", "check", str(tmp_path / "plan.yaml")], capture_output=True,
                       text=True, cwd=ROOT)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "pp_stages" not in _solve(tmp_path, "--pp", "1")["train"]  # no pipeline, no field


def test_trainer_split_equals_the_plans(tmp_path):
    """The trainer's stages: the plan's pp_stages, or — for a plan without the field — the same pipeline_split of
    the plan's shape and micro-batch, so both equal what recipe solve recorded."""
    import types

    from launch.pipeline import stage_sizes
    from recipe.plan import load_plan

    _solve(tmp_path, "--pp", "4")
    plan = load_plan(tmp_path / "plan.yaml")
    shape = plan.model_shape()
    assert stage_sizes(plan, shape) == plan.train.pp_stages
    bare = types.SimpleNamespace(layout=plan.layout, hw_profile=plan.hw_profile, train=types.SimpleNamespace(
        micro_batch_tokens=plan.train.micro_batch_tokens, recompute=plan.train.recompute,
        lm_head=plan.train.lm_head))
    assert stage_sizes(bare, shape) == plan.train.pp_stages


# ---- padding moves nothing ---------------------------------------------------------------------------------------
def test_padding_to_the_micro_batch_size_keeps_loss_and_gradients():
    """A micro-batch padded to 64 tokens with a weight-0 document: the same loss, metrics and gradients as unpadded
    (one process, fp32), for the sequence-mean, off-policy loss."""
    from launch.data import make_batch, synthetic_rollouts
    from launch.model import build_model
    from launch.pipeline import pad_batch
    from launch.rl import LossConfig
    from launch.train import TrainConfig, Trainer

    shape = PRESETS["tiny-moe"]
    rollouts = synthetic_rollouts(2, 2, shape.vocab_size, prompt_len=(2, 8), response_len=(2, 10), seed=5,
                                  with_logprobs=True)
    batch = make_batch(rollouts)
    assert batch.num_tokens < 64
    cfg = TrainConfig(objective="rl", loss=LossConfig(kl_coef=0.1, aggregation="seq_mean", entropy_coef=0.01))
    results = []
    for pad in (False, True):
        trainer = Trainer(build_model(shape, seed=1), cfg, recompute="none")
        b = trainer.with_loss_weights(batch)
        b = pad_batch(b, 64) if pad else b
        assert b.num_tokens == (64 if pad else batch.num_tokens)
        loss, metrics = trainer.loss_terms(b)
        loss.backward()
        results.append((loss.detach(), metrics, {n: p.grad.clone() for n, p in trainer.model.named_parameters()}))
    (l0, m0, g0), (l1, m1, g1) = results
    # the loss is a near-cancelling sum (policy term, KL, entropy bonus) of O(1) terms: fp32 rounding of the terms,
    # not of the small result, sets the tolerance
    torch.testing.assert_close(l1, l0, rtol=1e-6, atol=1e-7)
    for k in m0:
        torch.testing.assert_close(m1[k], m0[k], rtol=1e-6, atol=1e-7)
    for n in g0:
        torch.testing.assert_close(g1[n], g0[n], rtol=1e-5, atol=1e-5 * float(g0[n].abs().max()) + 1e-12)
    padded = pad_batch(batch, 64)
    assert padded.packing.doc_lengths[-1] == 64 - batch.num_tokens and int(padded.packing.positions[-1]) == 63 - \
        batch.num_tokens
    assert not padded.loss_mask[batch.num_tokens:].any() and (padded.targets[batch.num_tokens:] == -1).all()


# ---- bad input: one line, before any process starts ------------------------------------------------------------
def _tiny_plan(tmp_path: Path, pp: int, stages: list[int] | None = None) -> Path:
    plan = yaml.safe_load((ROOT / "plans" / "tiny-cpu.yaml").read_text())
    plan["inputs"]["gpus"] = pp
    plan["inputs"].pop("pins", None)
    plan["layout"].update(pp=pp, tp=1, cp=1, ep=1, dp=1, etp=1, edp=1)
    plan["launch"].update(nnodes=1, nproc_per_node=pp)
    if stages is not None:
        plan["train"]["pp_stages"] = stages
    path = tmp_path / f"pp{pp}.yaml"
    path.write_text(yaml.safe_dump(plan, sort_keys=False))
    return path


def _train(plan: Path, world: int) -> subprocess.CompletedProcess:
    env = {**os.environ, "WORLD_SIZE": str(world), "RANK": "0", "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "launch.train", str(plan), "--steps", "1", "--device", "cpu"],
                          capture_output=True, text=True, cwd=ROOT, env=env, timeout=120)


@pytest.mark.parametrize("pp, stages, needle", [
    (8, None, "pp=8: 4 layers of tiny-moe cannot give each of pp=8 stages a layer"),  # more stages than layers
    (2, [2, 3], "pp=2: train.pp_stages [2, 3] holds 5 layers but tiny-moe has 4"),
    (2, [1, 1, 1], "train.pp_stages lists 3 stages, not a multiple of pp=2"),
])
def test_bad_pipeline_plans_exit_2_in_one_line(tmp_path, pp, stages, needle):
    r = _train(_tiny_plan(tmp_path, pp, stages), pp)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], r.stderr
    assert "Traceback" not in r.stderr


def test_tied_embeddings_are_refused_under_pp_before_any_group():
    import types

    from launch.parallel import LayoutError, check_plan_shape
    from recipe.plan import LayoutSpec

    shape = PRESETS["tiny-moe"].model_copy(update={"tie_embeddings": True})
    plan = types.SimpleNamespace(layout=LayoutSpec(pp=2, tp=1, cp=1, ep=1, dp=1, etp=1, edp=1),
                                 train=types.SimpleNamespace(micro_batch_tokens=64, pp_stages=None))
    with pytest.raises(LayoutError, match="pp=2: pipeline parallel puts the embedding and the LM head on different "
                                          "stages, and tiny-moe ties them"):
        check_plan_shape(plan, shape)
    check_plan_shape(plan, PRESETS["tiny-moe"])


def test_a_split_between_a_sparse_attention_layer_and_its_selection_source_is_refused_before_any_group():
    """GLM's shared sparse-attention layers reuse the selection of the last indexing layer before them, handed over
    inside the process: a pipeline split between the two is refused in one line; one that keeps them together runs."""
    import types

    import dist_cases
    from launch.parallel import LayoutError, check_plan_shape
    from recipe.plan import LayoutSpec

    shape = dist_cases.tiny_dsa()  # layer 3 reuses layer 2's selection

    def plan(stages):
        return types.SimpleNamespace(layout=LayoutSpec(pp=2, tp=1, cp=1, ep=1, dp=1, etp=1, edp=1),
                                     train=types.SimpleNamespace(micro_batch_tokens=64, pp_stages=stages))
    with pytest.raises(LayoutError, match=r"pp=2: the stages \[3, 1\] put layer 3 apart from layer 2, whose "
                                          r"sparse-attention selection it reuses"):
        check_plan_shape(plan([3, 1]), shape)
    check_plan_shape(plan([2, 2]), shape)


def test_recipe_check_names_a_split_that_misses_layers(tmp_path):
    r = subprocess.run([sys.executable, "-m", "recipe", "check", str(_tiny_plan(tmp_path, 2, [1, 2]))],
                       capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 1
    assert "train.pp_stages [1, 2] holds 3 layers but tiny-moe has 4" in r.stdout + r.stderr
