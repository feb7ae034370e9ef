"""Error bands and the memory margin (recipe/margin.py), the default GPU count, topology and units: hand-worked
margin terms, no plan past usable − margin over the model × profile matrix, the count rules and their rejection
message, 12 GPUs on 8-GPU nodes, HBM in GiB, the `assumed` warning, the plan's new fields read back."""

from __future__ import annotations

import functools
import json

import pytest
import yaml
from typer.testing import CliRunner

from recipe import calibration, margin
from recipe.cli import app
from recipe.cost import GB, Layout, TrainOptions, estimate, gpus_per_node_used, group_bw, with_default_chunks
from recipe.hw import load_profile
from recipe.margin import estimate_with_margin, memory_margin
from recipe.models import PRESETS
from recipe.plan import load_plan, parse_plan
from recipe.solver import InfeasibleError, solve, solve_min_gpus

runner = CliRunner()
Q35 = PRESETS["qwen35-35b"]
MODELS = [n for n in PRESETS if n != "tiny-moe"]
PROFILES = ["h100", "mi300x", "mi355x", "b200"]


@functools.lru_cache(maxsize=None)
def _hw(name):
    return load_profile(name)


def _opts(seq, m, hw, world, lay):
    """The options the solver estimates `lay` with: its default chunk count."""
    return with_default_chunks(m, _hw(hw), world, lay, TrainOptions(micro_batch_tokens=seq))


@pytest.fixture
def measured(monkeypatch):
    """Every profile measured, with a worst memory error of 5% and step-time error of 12% (not the committed grid's
    figures: these tests must not depend on them)."""
    cal = calibration.Calibration(hw="any", memory_error=0.05, time_error=0.12, points=(), environment={})
    monkeypatch.setattr(calibration, "load", lambda hw: cal)
    margin._bands.cache_clear()
    yield cal
    margin._bands.cache_clear()


@pytest.fixture
def assumed(monkeypatch):
    monkeypatch.setattr(calibration, "load", lambda hw: None)
    margin._bands.cache_clear()
    yield
    margin._bands.cache_clear()


# ---- the margin, by hand ---------------------------------------------------------------------------------------
def test_margin_terms_by_hand(measured):
    """qwen35-35b, 128K, 32 H100s, cp=2 ep=4 (dp=16, edp=8), full recompute:
    V = 248,320, h = 2048, k = 8, I = 512, 256 experts of 3·h·I = 3,145,728 parameters each, not tied.
      error      = peak · 0.05 / 0.95
      root unit  = (V·h [embedding] + V·h [head] + V·h [head gradient]) · 2 B = 3 · 508,559,360 · 2 = 3.0514 GB
      FSDP       = (dense layer + 256/4 experts · 3,145,728) · 6 B
      all-to-all = (4 − 1) · 2 · 4 channels · 4 MiB = 100,663,296 B
      imbalance  = 0.25 · s·k·((2h + 2I)·2 + 8 + max(h, 4I)·2) = 0.25 · 65,536 · 8 · (10,248 + 4,096)
                 = 1,880,096,768 B (one layer: recompute; a routed row's saved tensors and its backward moment)"""
    lay, seq = Layout(cp=2, ep=4), 131_072
    o = _opts(seq, Q35, "h100", 32, lay)
    est = estimate(Q35, _hw("h100"), 32, lay, o)
    mg = memory_margin(Q35, _hw("h100"), 32, lay, o, est)
    p = mg.parts_gb
    assert mg.bands.basis == {"memory": "measured", "step_time": "measured"}
    assert p["error"] == pytest.approx(est.total_gb * 0.05 / 0.95)
    assert p["root_unit"] == pytest.approx(3 * 248_320 * 2048 * 2 / 1e9)
    from recipe.cost import layer_params

    dense, _ = layer_params(Q35)
    assert p["fsdp_in_flight"] == pytest.approx((dense + 64 * 3 * 2048 * 512) * 6 / 1e9)
    assert p["all_to_all"] == pytest.approx(100_663_296 / 1e9)
    assert p["imbalance"] == pytest.approx(1_880_096_768 / 1e9)
    assert mg.total_gb == pytest.approx(sum(p.values()))
    assert mg.multi_gpu_gb == pytest.approx(mg.total_gb - p["error"])


def test_one_gpu_has_no_multi_gpu_allowance(measured):
    """On one GPU nothing is sharded or exchanged: the margin is the calibration's error term alone."""
    m = Q35.with_layers(4)
    o = _opts(65_536, m, "h200", 1, Layout())
    est = estimate(m, _hw("h200"), 1, Layout(), o)
    mg = memory_margin(m, _hw("h200"), 1, Layout(), o, est)
    assert mg.multi_gpu_gb == 0 and mg.total_gb == pytest.approx(est.total_gb * 0.05 / 0.95)


def test_assumed_profiles_hold_back_more(assumed):
    o = _opts(131_072, Q35, "mi300x", 8, Layout())
    est = estimate(Q35, _hw("mi300x"), 8, Layout(), o)
    mg = memory_margin(Q35, _hw("mi300x"), 8, Layout(), o, est)
    assert mg.bands.basis == {"memory": "assumed", "step_time": "assumed"}
    assert mg.bands.error == {"memory": margin.ASSUMED_MEMORY_ERROR, "step_time": margin.ASSUMED_TIME_ERROR}
    assert mg.parts_gb["error"] == pytest.approx(est.total_gb * 0.15 / 0.85)
    assert margin.ASSUMED_MEMORY_ERROR > 0.10  # wider than the ±10% a measured grid must meet


def test_no_recompute_counts_every_layers_imbalance(measured):
    lay, seq = Layout(cp=8, ep=8), 32_768
    o = _opts(seq, Q35, "h100", 64, lay).model_copy(update={"recompute": "none"})
    mg = memory_margin(Q35, _hw("h100"), 64, lay, o, estimate(Q35, _hw("h100"), 64, lay, o))
    assert mg.parts_gb["imbalance"] == pytest.approx(0.25 * 4096 * 8 * (10_248 + 4_096) * Q35.num_moe_layers / 1e9)


# ---- no plan past usable − margin --------------------------------------------------------------------------------
@pytest.mark.parametrize("model", MODELS)
def test_no_plan_exceeds_usable_minus_margin(model):
    """Over the model × profile matrix, at the default count and at fixed counts: peak + margin ≤ usable, the margin
    the plan carries is the one recomputed from its layout, and at least the calibration's error term."""
    m = PRESETS[model]
    for h in PROFILES:
        hw = _hw(h)
        for seq in (32_768, 131_072):
            sols = []
            for w in (None, 8, 32):
                try:
                    o = TrainOptions(micro_batch_tokens=seq)
                    sols.append(solve_min_gpus(m, hw, o) if w is None else solve(m, hw, w, o))
                except InfeasibleError:
                    pass
            for s in sols:
                e, mg = s.estimate, s.margin
                again = memory_margin(m, hw, s.world, s.layout, s.opts, e)
                assert mg.parts_gb == again.parts_gb
                assert e.total_gb + mg.total_gb <= hw.usable_gb, (model, h, seq, s.world, s.layout)
                err = mg.bands.error["memory"]
                assert mg.total_gb >= e.total_gb * err, (model, h, seq)


def test_a_layout_that_fits_only_without_the_margin_is_refused():
    """qwen35-35b on 32 H100s at cp=1 ep=4: the longest sequence (in 4K steps) whose peak still fits usable memory
    fits only without the margin; pinned there, the solve refuses it and names peak + margin, and unpinned it
    splits the activations instead (over cp or tp, whichever is faster), keeping at least the margin free."""
    hw, lay = _hw("h100"), Layout(cp=1, ep=4)
    seq = 16_384
    while estimate(Q35, hw, 32, lay, _opts(seq + 4096, Q35, "h100", 32, lay)).fits:
        seq += 4096
    raw = estimate(Q35, hw, 32, lay, _opts(seq, Q35, "h100", 32, lay))
    withm = estimate_with_margin(Q35, hw, 32, lay, _opts(seq, Q35, "h100", 32, lay))
    assert raw.fits and not withm.fits and 0 <= raw.headroom_gb < withm.margin.total_gb
    with pytest.raises(InfeasibleError, match=rf"peaks at {raw.total_gb:.1f} GB \+ margin "
                                              rf"{withm.margin.total_gb:.1f} GB against 78\.6 GB usable"):
        solve(Q35, hw, 32, TrainOptions(micro_batch_tokens=seq), pins={"pp": 1, "tp": 1, "cp": 1, "ep": 4})
    s = solve(Q35, hw, 32, TrainOptions(micro_batch_tokens=seq))
    assert s.layout.cp * s.layout.tp >= 2 and s.estimate.headroom_gb >= s.margin.total_gb


# ---- the default GPU count ---------------------------------------------------------------------------------------
def test_readme_main_command_defaults_to_one_node_with_10pct_headroom():
    """`recipe solve --model qwen35-35b --seq 128k --hw mi300x`: 4 GPUs need CP=4 (and either do not fit with the
    margin or run slower per GPU than one 8-GPU node at CP=1); the default is the node, with at least 10% of usable
    memory free, and its reason names the 4 GPUs it rejected."""
    r = runner.invoke(app, ["solve", "--model", "qwen35-35b", "--seq", "128k", "--hw", "mi300x", "-f", "json",
                            "-o", "-"])
    assert r.exit_code == 0, r.output
    plan = json.loads(r.stdout)
    pred, mem = plan["prediction"], plan["prediction"]["memory_gb"]
    assert plan["layout"]["cp"] == 1 and plan["launch"]["nnodes"] * plan["launch"]["nproc_per_node"] == 8
    assert pred["headroom_gb"] >= 0.10 * mem["usable"]
    assert pred["headroom_gb"] >= pred["margin_gb"]["total"]
    why = plan["reasons"]["gpus"].split("rejected ", 1)[1]
    assert why.startswith("4 GPUs"), why
    assert ("fit only with CP=4 at " in why and "on one 8-GPU node with CP=1" in why) or (
        "cp=4" in why and "+ margin" in why and "> 185.3 GB usable" in why), why


def test_default_count_is_whole_nodes_past_one_node_and_names_the_rejected_count():
    """qwen35-35b at 128K on H100s: one node does not fit with the margin, whole nodes do (16 today); the reason
    names the count one node below it, with the peak and margin of its closest layout."""
    s = solve_min_gpus(Q35, _hw("h100"), TrainOptions(micro_batch_tokens=131_072))
    assert s.world > 8 and s.world % _hw("h100").gpus_per_node == 0
    assert s.count.constraint.startswith("the smallest GPU count that fits with the memory margin")
    assert s.count.rejected.startswith(f"{s.world - 8} GPUs: the closest layout (pp=")
    assert "+ margin" in s.count.rejected and "> 78.6 GB usable" in s.count.rejected
    for model in ("qwen35-122b", "qwen3-235b-a22b", "deepseek-v3"):
        for h in ("h100", "mi300x"):
            try:
                w = solve_min_gpus(PRESETS[model], _hw(h), TrainOptions(micro_batch_tokens=131_072)).world
            except InfeasibleError:
                continue
            assert w in (1, 2, 4) or w % _hw(h).gpus_per_node == 0, (model, h, w)


def test_a_count_that_fits_only_by_a_wide_split_gives_way_to_a_cheaper_one():
    """gpt-oss-120b at 128K on H100s first fits on 32 GPUs, only with tp=2: 1.85x the GPU-hours a token of the cheapest
    count up to 64. The count taken is, by brute force over every whole-node count from 32 to 64, the smallest whose
    tokens/s per GPU reach 1/1.5 of the best there (40, at tp=1); the reason names 32 and how to take it."""
    hw, o = _hw("h100"), TrainOptions(micro_batch_tokens=131_072)
    m = PRESETS["gpt-oss-120b"]
    s = solve_min_gpus(m, hw, o)
    with pytest.raises(InfeasibleError):
        solve(m, hw, 24, o)
    first = solve(m, hw, 32, o)
    assert first.layout.tp == 2
    rates = {}
    for w in range(32, 65, 8):
        try:
            rates[w] = solve(m, hw, w, o).estimate.tokens_per_s_per_gpu
        except InfeasibleError:
            pass
    best = max(rates.values())
    assert best / rates[32] > 1.5
    assert s.world == min(w for w, r in rates.items() if r >= best / 1.5) == 40
    assert s.layout.tp == 1 and s.estimate.tokens_per_s_per_gpu == pytest.approx(rates[40])
    assert s.count.constraint.startswith("the smallest count within 1.5x the fewest GPU-hours a token of any from 32 ")
    assert s.count.rejected.startswith("32 GPUs fit only with pp=1 tp=2 ")
    assert f"{best / rates[32]:.2f}x the GPU-hours a token of" in s.count.rejected
    assert s.count.rejected.endswith("(--gpus 32 takes them)")


def test_the_smallest_count_stays_when_no_count_is_much_cheaper():
    """qwen35-35b at 128K on H100s: 16 GPUs fit, and no count up to 32 runs 1.5x their tokens/s per GPU."""
    hw, o = _hw("h100"), TrainOptions(micro_batch_tokens=131_072)
    s = solve_min_gpus(Q35, hw, o)
    rates = [solve(Q35, hw, w, o).estimate.tokens_per_s_per_gpu for w in (16, 24, 32)]
    assert s.world == 16 and max(rates) < 1.5 * rates[0]


def test_a_partial_node_stays_when_the_node_is_no_simpler():
    """tiny-moe at 4K fits one CPU rank at cp=1; a whole node would be no simpler (cp=1 too): 1 it is."""
    s = solve_min_gpus(PRESETS["tiny-moe"], _hw("cpu"), TrainOptions(micro_batch_tokens=4096))
    assert s.world == 1 and s.layout.cp == 1 and s.count.rejected == ""


def test_article_layout_keeps_the_margin():
    """32 H100s at 128K (the published run's scale): the plan keeps at least its margin free."""
    s = solve(Q35, _hw("h100"), 32, TrainOptions(micro_batch_tokens=131_072))
    assert s.estimate.headroom_gb >= s.margin.total_gb


# ---- topology --------------------------------------------------------------------------------------------------
def test_twelve_h100s_cost_a_four_rank_group_across_nodes():
    """12 GPUs run as 2 nodes × 6: a 4-rank group at ranks 4–7 spans both, so it gets the inter-node bandwidth; a
    3-rank or 6-rank group, or 2 ranks 3 apart, stay inside a node; on 16 GPUs (2 × 8) a 4-rank group is inside."""
    hw = _hw("h100")
    node = gpus_per_node_used(hw, 12)
    assert node == 6
    inter, intra = hw.inter_node_bw_gb_s * GB, hw.intra_node.bw_gb_s * GB
    assert group_bw(hw, 4, 1, node) == inter
    assert group_bw(hw, 2, 2, node) == inter  # span 4 in a node of 6: ranks 4 and 6 sit on different nodes
    assert group_bw(hw, 3, 1, node) == group_bw(hw, 6, 1, node) == group_bw(hw, 2, 3, node) == intra
    assert group_bw(hw, 4, 1, gpus_per_node_used(hw, 16)) == intra
    s = solve(Q35, hw, 12, TrainOptions(micro_batch_tokens=32_768), pins={"ep": 4})
    assert "across 2 nodes (12 GPUs as nodes of 6)" in s.decisions["ep"].reason
    # the all-to-all time at 12 GPUs is the inter-node one: same layout on 16 GPUs (inside a node) is faster at it
    o = TrainOptions(micro_batch_tokens=32_768, ep_overlap_chunks=8)
    e12 = estimate(Q35, hw, 12, Layout(cp=2, ep=4), o)
    e16 = estimate(Q35, hw, 16, Layout(cp=2, ep=4), o)
    assert e12.time_s["ep_exposed"] > e16.time_s["ep_exposed"]


# ---- units -----------------------------------------------------------------------------------------------------
def test_hbm_in_gib_usable_in_decimal_gb():
    """An H100 reports 81,559 MiB = 79.6 GiB: usable = 79.6 · 2**30 / 1e9 · 0.92 = 78.63 GB; the hw table says
    GiB for the capacity and GB for usable memory, as every memory figure elsewhere."""
    h = _hw("h100")
    assert h.hbm_gib == 79.6 and h.usable_gb == pytest.approx(78.632, abs=1e-3)
    r = runner.invoke(app, ["hw"])
    assert "HBM GiB" in r.stdout and "usable GB" in r.stdout and "HBM GB" not in r.stdout
    assert json.loads(runner.invoke(app, ["hw", "h100", "-f", "json"]).stdout)["hbm_gib"] == 79.6
    out = runner.invoke(app, ["solve", "--model", "qwen35-35b", "--seq", "128k", "--hw", "h100", "--explain"]).stdout
    assert "GiB" not in out  # one unit in the tables: decimal GB


# ---- the assumed warning ---------------------------------------------------------------------------------------
def test_solve_warns_once_when_a_figure_is_assumed(assumed):
    r = runner.invoke(app, ["solve", "--model", "qwen35-35b", "--seq", "128k", "--hw", "mi300x"])
    assert r.exit_code == 0
    warn = [ln for ln in r.stderr.splitlines() if ln.startswith("warning:")]
    assert warn == ["warning: mi300x has no calibration grid (hw_profiles/calibration/mi300x.json): its memory and "
                    "step time predictions are assumed, not measured (error band ±15% memory, ±25% step time; the "
                    "margin holds the memory band back)"]
    assert "margin" in r.stdout and "(assumed)" in r.stdout


def test_no_warning_on_a_measured_profile(measured):
    r = runner.invoke(app, ["solve", "--model", "qwen35-35b", "--seq", "128k", "--hw", "h100"])
    assert r.exit_code == 0 and "warning" not in r.stderr
    assert "memory error ±5% (measured)" in r.stdout


@pytest.mark.parametrize("model, says", [
    ("deepseek-v4-flash", "deepseek-v4-flash is planned, not trained by this core, so no step of it has been "
                          "measured"),
    ("gemma4-26b-a4b", "gemma4-26b-a4b's attention heads of 512 channels are wider than any measured step's (256)")])
def test_a_model_no_measured_step_backs_is_assumed_on_a_measured_profile(measured, tmp_path, model, says):
    """DeepSeek-V4 (planned, not trained) and Gemma 4 (trained, its full layers' heads 512 wide where the grids
    timed 256 at most) on a measured profile: no measured step backs them, so their bands, their margin's error
    term and the plan's basis are the assumed ones, said in one line; a model within the grid on the same profile
    keeps the measured bands; on a profile without a grid the profile's own warning stands."""
    g = PRESETS[model]
    hw = _hw("h200")
    assert margin.bands(hw, g) == margin.ASSUMED and margin.bands(hw, PRESETS["qwen35-35b"]).basis["memory"] == "measured"
    assert margin.unmeasured(g) and not margin.unmeasured(PRESETS["gpt-oss-120b"])
    o = TrainOptions(micro_batch_tokens=32768)
    est = margin.estimate_with_margin(g, hw, 8, Layout(), o)
    e = margin.ASSUMED_MEMORY_ERROR
    assert est.margin.parts_gb["error"] == pytest.approx(est.total_gb * e / (1 - e))
    r = runner.invoke(app, ["solve", "--model", model, "--seq", "32k", "--hw", "h200", "-o", str(tmp_path / "g.yaml")])
    assert r.exit_code == 0, r.output
    warn = [ln for ln in r.stderr.splitlines() if ln.startswith("warning:")]
    assert warn == [f"warning: {says}: its predictions on h200 are assumed (error band ±15% memory, ±25% step "
                    f"time; the margin holds the memory band back)"]
    assert yaml.safe_load((tmp_path / "g.yaml").read_text())["prediction"]["basis"] == {"memory": "assumed",
                                                                                        "step_time": "assumed"}
    r = runner.invoke(app, ["solve", "--model", "qwen35-35b", "--seq", "32k", "--hw", "h200"])
    assert r.exit_code == 0 and "warning" not in r.stderr


# ---- the plan --------------------------------------------------------------------------------------------------
def test_plan_round_trips_margin_basis_and_count(tmp_path):
    out = tmp_path / "p.yaml"
    r = runner.invoke(app, ["solve", "--model", "qwen35-35b", "--seq", "128k", "--hw", "mi300x", "-o", str(out)])
    assert r.exit_code == 0, r.output
    text = out.read_text()
    plan = load_plan(out)
    pred = plan.prediction
    assert pred.basis.memory == "assumed" and pred.error.memory == 0.15 and pred.error.step_time == 0.25
    parts = pred.margin_gb
    assert parts.total == pytest.approx(parts.error + parts.root_unit + parts.fsdp_in_flight + parts.all_to_all
                                        + parts.imbalance, abs=0.03)
    assert pred.headroom_gb == pytest.approx(pred.memory_gb.usable - pred.memory_gb.total, abs=0.01)
    assert "rejected 4 GPUs" in plan.reasons.gpus
    from recipe.plan import dumps

    assert dumps(plan) == text and parse_plan(dumps(plan, "json")).to_dict() == plan.to_dict()
    # a plan written before margins (no headroom, margin, basis, error, count) still loads
    old = yaml.safe_load(text)
    for k in ("headroom_gb", "margin_gb", "basis", "error"):
        del old["prediction"][k]
    del old["reasons"]["gpus"]
    back = parse_plan(yaml.safe_dump(old))
    assert back.prediction.margin_gb is None and "margin_gb" not in back.to_dict()["prediction"]
    # and a plan whose peak + margin passes usable is refused
    bad = yaml.safe_load(text)
    bad["prediction"]["margin_gb"]["total"] = bad["prediction"]["memory_gb"]["usable"]
    with pytest.raises(ValueError, match="exceeds the"):
        parse_plan(yaml.safe_dump(bad))


# ---- what the CLI says about the default and the margin ----------------------------------------------------------
def test_gpus_help_says_what_the_default_does():
    r = runner.invoke(app, ["solve", "--help"], env={"COLUMNS": "400"})
    text = " ".join(r.stdout.replace("│", " ").split())
    assert "default: the smallest count (1, 2, 4, then whole nodes) at which some layout's predicted peak plus the " \
           "memory margin fits usable memory" in text
    assert "below one node, the whole node when it needs less CP/TP/PP at 97% or more of the throughput per GPU" in text
    assert "up to twice that count, the smallest whose GPU-hours a token are within 1.5x the cheapest's" in text


def test_sweep_and_compare_count_fits_with_the_margin():
    """`recipe sweep`'s fits and `recipe compare`'s margin row are the solver's: peak + margin within usable."""
    data = json.loads(runner.invoke(app, ["sweep", "--model", "qwen35-35b", "--seq", "128k", "--hw", "h100",
                                          "--gpus", "32", "--top", "10000", "-f", "json"]).stdout)
    usable = data["usable_gb"]
    for p in data["points"]:
        assert p["fits"] == (p["peak_gb"] + p["margin_gb"] <= usable), p
    assert any(not p["fits"] and p["peak_gb"] <= usable for p in data["points"])  # refused for the margin alone
    cmp = json.loads(runner.invoke(app, ["compare", "--model", "qwen35-35b", "--seq", "128k", "--hw", "h100,mi300x",
                                         "-f", "json"]).stdout)
    for col in cmp["profiles"]:
        assert col["memory_gb"]["total"] + col["margin_gb"]["total"] <= col["usable_gb"]
        assert col["basis"] == {"memory": "assumed", "step_time": "assumed"} or col["hw"] == "h200"
