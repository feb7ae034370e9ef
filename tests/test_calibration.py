"""The committed calibration grid (hw_profiles/calibration/<hw>.json, written by bench/calibrate.py on the GPU) held
against today's cost model: every measured point reproduced within its tolerance, every point that ran out of memory
predicted not to fit, and the grid's recorded errors equal to what its points say. A cost-model change that loses
accuracy fails here; one that keeps it must re-predict the file (python bench/calibrate.py --refresh FILE)."""

from __future__ import annotations

import itertools
import json
import sys
from importlib import resources
from pathlib import Path

import pytest

from recipe import calibration
from recipe.calibration import point_errors, predict_point, summarize
from recipe.hw import builtin_names, load_profile

MEMORY_TOLERANCE = 0.05  # predicted peak allocated within ±5% of measured
TIME_TOLERANCE = 0.15  # predicted step within ±15% of measured

GRIDS = sorted(n for n in builtin_names() if calibration.load(n) is not None)


def _points(kind: str):
    out = []
    for hw in GRIDS:
        for p in calibration.load(hw).points:
            measured = "step_s" in p and "error" not in p
            if (kind == "measured") == measured and (kind != "oom" or p.get("error", "").startswith("OOM")):
                tag = (f"{hw}-{p['model']}-L{p['layers']}-{p['seq']}-{p['recompute']}-{p['lm_head']}"
                       f"{'-ep' if p['ep_path'] else ''}")
                out.append(pytest.param(hw, p, id=tag))
    return out


def test_h200_has_a_grid_with_held_out_points():
    cal = calibration.load("h200")
    assert cal is not None and cal.basis == "measured"
    env = cal.environment
    for key in ("torch", "triton", "driver", "gpu", "commit", "command"):
        assert env.get(key), key
    roles = {p["role"] for p in cal.points if "step_s" in p}
    assert roles == {"fit", "held_out"}
    fitted = ("qwen35-35b", "qwen3-30b-a3b")  # a model outside them (another width) is held out whole
    # and so is a held-out grid (partial recompute, its none and full twins too)
    assert all(p["role"] == ("held_out" if p["layers"] >= 8 or p["model"] not in fitted
                             or p.get("grid") in ("holdout", "partial") else "fit")
               for p in cal.points)
    assert sum(1 for p in cal.points if p.get("keep_layers")) >= 6
    # the two fitted models at three depths, a held-out model, both recompute modes, every head mode and the EP
    # path were asked for
    asked = {(p["model"], p["layers"], p["recompute"], p["lm_head"], p["ep_path"]) for p in cal.points}
    assert {a[0] for a in asked} == {*fitted, "qwen3-235b-a22b", "qwen3-next-80b", "mixtral-8x7b", "moonlight-16b",
                                     "glm45-air", "deepseek-v3", "olmoe-1b-7b", "qwen15-moe-a27b", "ernie45-21b-a3b",
                                     "gpt-oss-20b", "minimax-m2", "llama4-scout"}
    assert {a[1] for a in asked if a[0] in fitted} == {2, 4, 8}
    assert {a[2] for a in asked} == {"full", "none"} and {a[3] for a in asked} == {"fused", "lean", "naive"}
    assert any(a[4] for a in asked)
    assert calibration.load("mi300x") is None and calibration.basis("mi300x") == "assumed"


@pytest.mark.parametrize("hw,point", _points("measured"))
def test_cost_model_reproduces_each_measured_point(hw, point):
    today = predict_point(point, hw)
    mem = today["allocated_gb"] / point["peak_allocated_gb"] - 1
    t = today["step_s"] / point["step_s"] - 1
    assert abs(mem) <= MEMORY_TOLERANCE, f"peak memory {today['allocated_gb']:.2f} GB predicted against " \
                                         f"{point['peak_allocated_gb']:.2f} measured ({mem:+.1%})"
    assert abs(t) <= TIME_TOLERANCE, f"step {today['step_s']:.3f} s predicted against {point['step_s']:.3f} " \
                                     f"measured ({t:+.1%})"


@pytest.mark.parametrize("hw,point", _points("oom"))
def test_points_that_ran_out_of_memory_are_predicted_not_to_fit(hw, point):
    """What the solver asks of a layout: the whole prediction within the profile's usable memory (the allocator's
    slack is outside the allocated figure: the 2-layer 32K naive point, of 30 GiB blocks, runs out of memory with
    its allocated prediction, 149.8 GB, just under the card's 150.1)."""
    assert predict_point(point, hw)["total_gb"] > load_profile(hw).usable_gb


@pytest.mark.parametrize("hw", GRIDS)
def test_recorded_predictions_and_errors_are_todays(hw):
    """The file's predictions are today's cost model's (so memory_error, which the solver's margin reads, is the
    error today's model makes), and memory_error / time_error are the worst of its points' errors."""
    cal = calibration.load(hw)
    for p in cal.points:
        today = predict_point(p, hw)
        for k in ("allocated_gb", "total_gb", "step_s"):
            assert p["predicted"][k] == pytest.approx(today[k], rel=1e-9), \
                f"{k} of {p['model']} L{p['layers']} {p['seq']}: run python bench/calibrate.py --refresh"
    s = summarize(cal.points)
    assert cal.memory_error == pytest.approx(s["memory_error"]) and cal.time_error == pytest.approx(s["time_error"])
    errs = [point_errors(p) for p in cal.points]
    assert cal.memory_error == pytest.approx(max(abs(m) for m, _ in errs if m is not None))
    assert cal.time_error == pytest.approx(max(abs(t) for _, t in errs if t is not None))
    assert cal.memory_error <= MEMORY_TOLERANCE and cal.time_error <= TIME_TOLERANCE
    raw = json.loads(resources.files("hw_profiles").joinpath("calibration", f"{hw}.json").read_text())
    for role in ("fit", "held_out"):
        assert raw["errors"][role] == pytest.approx(s["errors"][role])
        assert raw["errors"][role]["points"] > 0


def test_point_errors_and_summary_hand_worked():
    pts = [{"role": "fit", "step_s": 2.0, "peak_allocated_gb": 100.0,
            "predicted": {"allocated_gb": 104.0, "step_s": 1.8}},
           {"role": "held_out", "step_s": 1.0, "peak_allocated_gb": 50.0,
            "predicted": {"allocated_gb": 49.0, "step_s": 1.12}},
           {"role": "held_out", "error": "OOM", "predicted": {"allocated_gb": 300.0, "step_s": 9.0}}]
    assert point_errors(pts[0]) == (pytest.approx(0.04), pytest.approx(-0.1))
    assert point_errors(pts[2]) == (None, None)
    s = summarize(pts)
    assert s["memory_error"] == pytest.approx(0.04) and s["time_error"] == pytest.approx(0.12)
    assert s["errors"]["fit"] == {"memory": pytest.approx(0.04), "time": pytest.approx(0.1), "points": 1}
    assert s["errors"]["held_out"] == {"memory": pytest.approx(0.02), "time": pytest.approx(0.12), "points": 1}


def test_measured_profiles_carry_their_efficiencies_and_sources():
    """h200 times its step from the per-operation efficiencies fit on its grid, each named in `sources`; the parts
    never measured take them from it (`efficiency_from`), each share of the dense peak scaled by their
    compute_efficiency over the H200's and the rest as they are, with the assumption in their sources."""
    h200 = load_profile("h200")
    assert h200.efficiency is not None and "calibration/h200.json" in h200.sources["efficiency"]
    assert h200.efficiency_from is None
    e = h200.efficiency
    for name in ("h100", "b200", "mi300x", "mi325x", "mi355x"):
        p = load_profile(name)
        assert p.efficiency_from == "h200" and p.sources["efficiency_from"]
        k = p.compute_efficiency / h200.compute_efficiency
        d = p.efficiency
        for n in ("expert_gemm", "dense_gemm", "delta_rule", "lm_head"):
            assert getattr(d, n) == pytest.approx(getattr(e, n) * k, rel=1e-12)
        assert d.attention == {w: pytest.approx(v * k, rel=1e-12) for w, v in e.attention.items()}
        for n in ("expert_rows", "expert_weights", "dense_rows", "optimizer", "ep_dispatch", "layer_latency_ms",
                  "ep_latency_ms", "ep_chunk_ms"):
            assert getattr(d, n) == getattr(e, n)
    assert load_profile("mi300x").efficiency.delta_rule == pytest.approx(0.046 * 0.32 / 0.385)
    assert load_profile("h100").efficiency == e  # the same chip, the same compute_efficiency
    assert load_profile("cpu").efficiency is None  # no reference: one compute_efficiency


def _nnls_by_brute_force(np, lhs, rhs):
    """The non-negative least-squares solution, found as the least-squares solution on every support of the terms
    whose coefficients are all positive, the one of least residual (the non-negative optimum is such a solution)."""
    best = None
    n = lhs.shape[1]
    for support in itertools.product((False, True), repeat=n):
        cols = [i for i, on in enumerate(support) if on]
        inv = np.zeros(n)
        if cols:
            inv[cols] = np.linalg.lstsq(lhs[:, cols], rhs, rcond=None)[0]
        if (inv[cols] > 0).all():
            res = float(np.sum((lhs @ inv - rhs) ** 2))
            best = min(best, (res, inv.tolist())) if best else (res, inv.tolist())
    return best[1]


def _expert_fit(np):
    """(inverse rates of recipe.cost.EXPERT_TERMS, the runs' work in them, their measured seconds) from the committed
    bench/bench_expert_rates.py runs."""
    from recipe.cost import EXPERT_TERMS, Layout, TrainOptions, compute_work
    from recipe.models import resolve_model

    raw = json.loads(resources.files("hw_profiles").joinpath("calibration", "h200_experts.json").read_text())
    rows = [r for r in raw["rows"] if r.get("role") != "held_out"]
    assert {r["model"] for r in rows} == {"qwen35-35b", "qwen3-30b-a3b", "qwen3-235b-a22b"}
    a = np.array([[compute_work(resolve_model(r["model"]).with_layers(r["layers"]), Layout(),
                                TrainOptions(micro_batch_tokens=r["tokens"]))[k] for k in EXPERT_TERMS]
                  for r in rows])
    y = np.array([r["measured_s"] for r in rows])
    return np.array(_nnls_by_brute_force(np, a / y[:, None], np.ones(len(y)))), a, y


def _dense_fit(np):
    """(inverse rates of FLOPs, row bytes and GEMM calls; the matmuls' work in them; their measured seconds) from
    the committed bench/bench_dense_rates.py runs."""
    raw = json.loads(resources.files("hw_profiles").joinpath("calibration", "h200_dense.json").read_text())
    a = np.array([[r["flops"], r["bytes"], 3.0] for r in raw["rows"]])
    y = np.array([r["measured_s"] for r in raw["rows"]])
    return np.array(_nnls_by_brute_force(np, a / y[:, None], np.ones(len(y)))), a, y, raw["rows"]


def test_h200_dense_gemm_rate_is_the_fit_of_the_dense_matmuls_alone():
    """efficiency.dense_gemm is the FLOP term of the non-negative least-squares fit of every model's dense matmuls
    timed alone (hw_profiles/calibration/h200_dense.json, bench/bench_dense_rates.py: eight models' projections,
    routers, shared experts and dense FFNs at 8K and 32K tokens) to their FLOPs, their rows' bytes and a fixed time
    per GEMM call; with those three terms every matmul at least 512 wide each way is within 25%, where its FLOP rate
    alone spans 0.41 to 0.82 of the peak."""
    np = pytest.importorskip("numpy")
    inv, a, y, rows = _dense_fit(np)
    assert (inv > 0).all()
    peak = load_profile("h200").peak_bf16_tflops * 1e12
    assert load_profile("h200").efficiency.dense_gemm == pytest.approx(1 / (inv[0] * peak), abs=6e-4)
    wide = [i for i, r in enumerate(rows) if min(r["in"], r["out"]) >= 512]
    err = (a @ inv)[wide] / y[wide] - 1
    assert np.abs(err).max() < 0.25
    alone = a[wide, 0] / y[wide] / peak
    assert alone.min() < 0.45 and alone.max() > 0.8


def test_h200_expert_efficiencies_are_the_fit_of_the_expert_runs():
    """efficiency.expert_gemm, expert_rows and expert_weights are the non-negative least-squares fit of the routed
    experts' grouped GEMMs timed alone (hw_profiles/calibration/h200_experts.json, bench/bench_expert_rates.py: three
    expert shapes, 8K to 128K tokens) to their work in the three terms, each run relative to its measurement; the
    fit reproduces every run within 10%, where any one FLOP rate is over 40% off on some."""
    np = pytest.importorskip("numpy")
    inv, a, y = _expert_fit(np)
    assert (inv > 0).all()
    hw = load_profile("h200")
    eff, peak, hbm = hw.efficiency, hw.peak_bf16_tflops * 1e12, hw.hbm_bw_tb_s * 1e12
    assert eff.expert_gemm == pytest.approx(1 / (inv[0] * peak), abs=6e-4)
    assert eff.expert_rows == pytest.approx(1 / (inv[1] * hbm), abs=6e-4)
    assert eff.expert_weights == pytest.approx(1 / (inv[2] * hbm), abs=6e-4)
    assert np.abs(a @ inv / y - 1).max() < 0.10
    # one FLOP rate cannot follow the shapes: the best single rate, midway between the slowest run's and the
    # fastest's, is over 40% off at both ends
    measured = a[:, 0] / y
    best = (measured.min() + measured.max()) / 2
    assert np.abs(measured / best - 1).max() > 0.4


def test_h200_expert_runs_of_a_shape_outside_the_fit():
    """Mixtral-8x7B's experts (8 of width 14,336, 2 a token: far wider and fewer than the fitted shapes; one cuBLAS
    GEMM an expert), timed alone and held out of the fit: the three terms predict them within 25%, and too fast at
    32K and 64K tokens, where the form expects a rate rising with an expert's rows and the GEMMs' stays flat
    (docs/BENCHMARKS.md, "Routed experts timed alone")."""
    from recipe.cost import EXPERT_TERMS, Layout, TrainOptions, compute_times, compute_work
    from recipe.models import resolve_model

    raw = json.loads(resources.files("hw_profiles").joinpath("calibration", "h200_experts.json").read_text())
    held = [r for r in raw["rows"] if r.get("role") == "held_out"]
    assert {r["model"] for r in held} == {"mixtral-8x7b"} and len(held) == 3
    hw = load_profile("h200")
    ratio = {}
    for r in held:
        m = resolve_model(r["model"]).with_layers(r["layers"])
        t = compute_times(compute_work(m, Layout(), TrainOptions(micro_batch_tokens=r["tokens"])), hw, m)
        ratio[r["tokens"]] = sum(t[k] for k in EXPERT_TERMS) / r["measured_s"]
    assert all(0.75 < v < 1.25 for v in ratio.values()), ratio
    assert ratio[32768] < 0.95 and ratio[65536] < 0.95, ratio


def test_h200_efficiencies_are_the_fit_of_its_grid():
    """The profile's other per-operation efficiencies are what `bench/calibrate.py --fit` computes from its committed
    grid: the delta rule at the rate its component ran at alone (its FLOPs in a step over the time it took in it,
    averaged over the component profiles), the routed experts at their fitted rates (above), the other operations
    the dense matmuls' GEMMs at their FLOP rate timed alone (below), the least-squares fit of the `fit` points' step
    times less the anchored operations' share (the step at world size 1 is Σ work / rate, linear in the inverse
    rates), non-negative, the dense matmuls' rows (with the norms and elementwise work around them) among them: found here by brute force over every
    support of the 8 terms, attention one per head width. A term the fit leaves at zero gets no time (the EP path's fixed cost: its copies' bytes
    explain the EP points); a rate above the bandwidth is charged at the bandwidth."""
    np = pytest.importorskip("numpy")
    from recipe.cost import ADAM_BYTES_MOVED, EXPERT_TERMS, Layout, TrainOptions, compute_work, local_param_count
    from recipe.models import resolve_model

    grid = calibration.load("h200")
    hw = load_profile("h200")
    eff, peak, hbm = hw.efficiency, hw.peak_bf16_tflops * 1e12, hw.hbm_bw_tb_s * 1e12
    part = "delta rule (kernel only)"
    found = []
    for c in grid.components:
        if part in c["parts"]:
            m = resolve_model(c["model"]).with_layers(c["layers"])
            work = compute_work(m, Layout(), TrainOptions(micro_batch_tokens=c["seq"]))
            found.append(work["delta_rule"] / c["parts"][part]["in_step_s"])
    assert found, f"no component profile times {part!r}"
    anchored = {"delta_rule": sum(found) / len(found), **dict(zip(EXPERT_TERMS, 1 / _expert_fit(np)[0])),
                "dense_gemm": 1 / _dense_fit(np)[0][0]}
    assert eff.delta_rule == pytest.approx(anchored["delta_rule"] / peak, abs=6e-4)

    # attention: one term per head width (Qwen3-30B-A3B's 128, Qwen3.5-35B-A3B's 256)
    terms = ("dense_rows", "attention@128", "attention@256", "lm_head", "ep_dispatch", "ep_passes", "layer_passes",
             "optimizer")
    rows, ys = [], []
    for r in grid.points:
        if "step_s" not in r or r["role"] != "fit":
            continue
        m = resolve_model(r["model"]).with_layers(r["layers"])
        o = TrainOptions(micro_batch_tokens=r["seq"], recompute=r["recompute"], lm_head=r["lm_head"])
        work = compute_work(m, Layout(), o, ep_path=r["ep_path"])
        work["optimizer"] = local_param_count(m, 1, Layout()) * ADAM_BYTES_MOVED
        work.update({f"attention@{d}": work["attention"] if m.head_dim == d else 0.0 for d in (128, 256)})
        rows.append([work[k] for k in terms])
        ys.append((r["step_s"], sum(work[op] / rate for op, rate in anchored.items())))
    a, y, known = np.array(rows), np.array([t for t, _ in ys]), np.array([k for _, k in ys])
    fitted = dict(zip(terms, _nnls_by_brute_force(np, a / y[:, None], 1 - known / y)))
    assert all(fitted[k] > 0 for k in ("dense_rows", "attention@128", "attention@256", "lm_head"))
    assert eff.lm_head == pytest.approx(1 / (fitted["lm_head"] * peak), abs=6e-4)
    assert set(eff.attention) == {64, 128, 256}
    for d in (128, 256):
        assert eff.attention[d] == pytest.approx(1 / (fitted[f"attention@{d}"] * peak), abs=6e-4), d
    assert eff.attention[128] > eff.attention[256]  # as the kernel alone runs (bench/bench_attention_rates.py)
    # width 64, which no fitted point has: 128's efficiency times the median, over the rows timed at 64 without
    # sinks (Granite 3.0-3B-A800M's and gpt-oss-120b's heads), of a row's kernel rate over 128's at its token count
    raw = json.loads(resources.files("hw_profiles").joinpath("calibration", "h200_attention.json").read_text())
    at128 = {r["tokens"]: r["flops"] / r["measured_s"] for r in raw["rows"] if r["head_dim"] == 128}
    ratios = sorted(r["flops"] / r["measured_s"] / at128[r["tokens"]] for r in raw["rows"]
                    if r["head_dim"] == 64 and not r["sinks"])
    assert len(ratios) == 10
    assert eff.attention[64] == pytest.approx(eff.attention[128] * (ratios[4] + ratios[5]) / 2, abs=6e-4)
    for k in ("dense_rows", "optimizer", "ep_dispatch"):  # charged at the bandwidth at most, as `--fit` caps it
        assert getattr(eff, k) == pytest.approx(min(1.0, 1 / (fitted[k] * hbm)) if fitted[k] else 1.0, abs=6e-4), k
    assert eff.layer_latency_ms == pytest.approx(fitted["layer_passes"] * 1e3, abs=6e-4)
    assert eff.ep_latency_ms == pytest.approx(fitted["ep_passes"] * 1e3, abs=6e-4)


def test_ep_chunk_cost_is_the_committed_runs_slope():
    """efficiency.ep_chunk_ms is the slope of the EP path's step over its chunk count in the committed runs (pooled
    least squares, each run its own intercept), per MoE layer and pass; the H100 carries the H200's figure."""
    raw = json.loads(resources.files("hw_profiles").joinpath("calibration", "h200_ep_chunks.json").read_text())
    num = den = 0.0
    for run in raw["runs"]:
        pts = [(int(p["variant"].split("=")[1]), p["step_s"]) for p in run["steps"] if p["variant"].startswith("EP")]
        mk = sum(k for k, _ in pts) / len(pts)
        mt = sum(t for _, t in pts) / len(pts)
        scale = run["moe_layers"] * run["passes"]
        num += sum((k - mk) * (t - mt) for k, t in pts) / scale
        den += sum((k - mk) ** 2 for k, _ in pts)
    slope_ms = num / den * 1e3
    for hw in ("h200", "h100"):
        assert load_profile(hw).efficiency.ep_chunk_ms == pytest.approx(slope_ms, abs=5e-3)
    assert 0.3 < slope_ms < 1.5  # a launch-bound loop's figure, not a unit slip


def test_ep_held_rows_is_what_the_h200_grid_measures():
    """EP_HELD_ROWS is what the EP points measure: each one's peak above its local twin in rows of h + 8 bf16 values
    a routed copy, averaged per model and over the models (the grid's EP points run one chunk); models whose EP
    points set their peak in the MoE backward agree to 5% at the same sequence length (expert widths 512 and 768 at
    32K tokens: the term carries no expert-width part, as both paths free their saved rows at their last use and
    recompute the SwiGLU in the backward)."""
    import recipe.cost as cost
    from recipe.models import resolve_model

    grid = calibration.load("h200")
    pts = [r for r in grid.points if r.get("peak_allocated_gb") and "error" not in r]
    local = [r for r in pts if r["lm_head"] != "naive" and not r["ep_path"]]
    # an EP point's twin is the local point of its own run (a held-out grid re-measures some, elsewhere)
    twins = {(r["model"], r["layers"], r["seq"]): r for r in local
             if r["recompute"] == "full" and r["lm_head"] == "fused" and not r.get("grid")}
    rows, at_32k = {}, {}
    for r in pts:
        q = twins.get((r["model"], r["layers"], r["seq"]))
        if r["ep_path"] and not r.get("grid") and q is not None and r["peak_allocated_gb"] > q["peak_allocated_gb"]:
            m = resolve_model(r["model"])
            row = r["seq"] * m.top_k * (m.hidden_size + 8) * 2 / 1e9
            rows.setdefault(r["model"], []).append((r["peak_allocated_gb"] - q["peak_allocated_gb"]) / row)
            if r["seq"] == 32768:
                at_32k.setdefault(r["model"], []).append(rows[r["model"]][-1])
    assert "qwen35-35b" in rows  # (the grid's Qwen3-30B-A3B EP point at 8K is set by the optimizer step, not the MoE)
    means = [sum(v) / len(v) for v in rows.values()]
    same_seq = [sum(v) / len(v) for v in at_32k.values()]
    assert len(same_seq) == 2 and max(same_seq) / min(same_seq) < 1.05, at_32k
    assert cost.EP_HELD_ROWS == pytest.approx(sum(means) / len(means), abs=0.006)


def test_ep_chunk_rows_is_what_the_committed_bench_runs_measure():
    """EP_CHUNK_ROWS is the EP path's peak at more than one chunk above its peak at one, in rows of h + 8 bf16 values
    a routed copy, averaged over the committed bench/bench_ep_path.py runs (hw_profiles/calibration/
    h200_ep_memory.json): by hand, (0.24 + 0.12 + 0.12) / 3 = 0.16. Positive: more chunks do not lower the peak, as
    the weight gradients copy every chunk's rows once."""
    import recipe.cost as cost
    from recipe.models import resolve_model

    data = json.loads((resources.files("hw_profiles") / "calibration" / "h200_ep_memory.json").read_text())
    m, extra = resolve_model("qwen35-35b"), []
    for run in data["runs"]:
        peaks = {r["variant"]: r["peak_allocated_gib"] * 2**30 for r in run["steps"]}
        assert peaks["EP path, k=1"] > peaks["local dispatch"]
        row = run["tokens"] * m.top_k * (m.hidden_size + 8) * 2
        extra += [(v - peaks["EP path, k=1"]) / row for k, v in peaks.items() if k.startswith("EP path, k=")
                  and k != "EP path, k=1"]
    assert [round(x, 2) for x in extra] == [0.24, 0.12, 0.12]
    assert cost.EP_CHUNK_ROWS == pytest.approx(sum(extra) / len(extra), abs=0.006) and cost.EP_CHUNK_ROWS > 0


def test_a_width_without_fitted_points_takes_the_kernel_ratio(tmp_path):
    """`calibrate.py --fit` gives a head width no fitted point has the nearest fitted width's efficiency times the
    median, over the rows timed at that width without sinks (several models' pooled), of a row's kernel rate over
    the nearest width's at its token count: one model's rows at 0.70, 0.80 and 0.90 of 128's and another's at 0.85
    (and a count only 64 has, a row with sinks and a windowed one, all ignored) make 0.447 · 0.825 = 0.369; a width
    with no common count, or no file, derives nothing."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    from calibrate import derived_widths

    rows = [{"head_dim": 128, "tokens": t, "flops": 1e12, "measured_s": 1e-3} for t in (8192, 32768, 131072)]
    rows += [{"model": "a", "head_dim": 64, "tokens": t, "flops": 1e12 * f, "measured_s": 1e-3, "sinks": False}
             for t, f in ((8192, 0.9), (32768, 0.7), (131072, 0.8), (65536, 0.1))]
    rows += [{"model": "b", "head_dim": 64, "tokens": 32768, "flops": 0.85e12, "measured_s": 1e-3}]
    rows += [{"model": "c", "head_dim": 64, "tokens": 8192, "flops": 0.1e12, "measured_s": 1e-3, "sinks": True},
             {"model": "c", "head_dim": 64, "tokens": 8192, "flops": 0.1e12, "measured_s": 1e-3, "window": 128}]
    rows += [{"head_dim": 96, "tokens": 4096, "flops": 1e12, "measured_s": 1e-3}]
    path = tmp_path / "h200_attention.json"
    path.write_text(json.dumps({"rows": rows}))
    assert derived_widths({128: 0.447, 256: 0.393}, path) == {64: pytest.approx(0.369, abs=1e-9)}
    assert derived_widths({128: 0.447}, tmp_path / "missing.json") == {}


def test_sink_merge_bytes_fit_by_hand(tmp_path):
    """`sink_merge_bytes` turns each pair of a full layer timed with and without its sinks into bytes at the H200
    profile's dense-row rate (0.439 · 4.8 TB/s) per value (64 heads · 64) and pass (4): pairs 2, 3 and 7 ms apart
    at 32K tokens give 2.107e9·[2, 3, 7]e-3 / (4 · 32,768 · 4096) = [7.85, 11.8, 27.5], median 12; a row without a
    partner and a windowed pair are left out."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    from calibrate import sink_merge_bytes

    rate = 0.439 * 4.8e12
    assert load_profile("h200").efficiency.dense_rows == 0.439 and load_profile("h200").hbm_bw_tb_s == 4.8
    base = {"heads": 64, "head_dim": 64, "tokens": 32768}
    rows = []
    for name, d in (("a", 2e-3), ("b", 3e-3), ("c", 7e-3)):
        rows += [{**base, "model": name, "sinks": False, "measured_s": 0.1},
                 {**base, "model": name, "sinks": True, "measured_s": 0.1 + d}]
    rows += [{**base, "model": "d", "sinks": True, "measured_s": 9.0},
             {**base, "model": "a", "window": 128, "sinks": False, "measured_s": 0.1},
             {**base, "model": "a", "window": 128, "sinks": True, "measured_s": 5.0}]
    path = tmp_path / "h200_attention.json"
    path.write_text(json.dumps({"rows": rows}))
    got = sink_merge_bytes(path)
    assert 3e-3 * rate / (4 * 32768 * 4096) == pytest.approx(11.77, abs=0.01)
    assert got == {"SINK_MERGE_BYTES": 12, "sink_fit_range": [7.8, 27.5], "sink_fit_pairs": 3}
    assert sink_merge_bytes(tmp_path / "missing.json") is None


def test_sink_merge_bytes_is_what_the_committed_bench_runs_measure():
    """SINK_MERGE_BYTES is the fit of gpt-oss-120b's full layers timed alone with and without their sinks at 8K to
    128K tokens (hw_profiles/calibration/h200_attention.json); gpt-oss's full layers carry it in their row bytes,
    its sliding layers (whose window fit holds the merge) and models without sinks do not."""
    import recipe.cost as cost
    from recipe.models import resolve_model

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    from calibrate import sink_merge_bytes

    got = sink_merge_bytes(Path(str(resources.files("hw_profiles") / "calibration" / "h200_attention.json")))
    assert got["SINK_MERGE_BYTES"] == cost.SINK_MERGE_BYTES and got["sink_fit_pairs"] == 5
    m = resolve_model("gpt-oss-20b")
    plain = m.model_copy(update={"arch": "moe"})
    assert m.has_sinks and not plain.has_sinks
    extra = cost.SINK_MERGE_BYTES * 64 * 64
    assert cost.dense_row_bytes(m, "full_attention", True) == cost.dense_row_bytes(plain, "full_attention", True) + extra
    assert cost.dense_row_bytes(m, "sliding_attention", True) == cost.dense_row_bytes(plain, "sliding_attention", True)


def test_window_costs_fit_by_hand(tmp_path):
    """`window_costs` puts each sliding-layer row in keys of the full-attention kernel: gpt-oss-120b at 32K (64
    heads, width 64) costs a key a query 4 · 32,768 · 2 · 64 · 128 FLOPs at the H200 profile's 0.381 · 989.4
    TFLOP/s = 5.697 µs. Rows of (2 · 256 + 100) and (2 · 640 + 100) of those (windows 128 and 512) give a key cost of
    2 and a row of 100 keys exactly; an 8K row (below WINDOW_FIT_MIN_TOKENS) and a full layer's row are left out."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    from calibrate import window_costs

    per_key = 4 * 32768 * 2 * 64 * 128 / (0.381 * 989.4e12)
    assert per_key == pytest.approx(5.697e-6, rel=1e-4)
    base = {"model": "gpt-oss-120b", "heads": 64, "head_dim": 64}
    rows = [{**base, "tokens": 32768, "window": w, "measured_s": (2 * k + 100) * per_key}
            for w, k in ((128, 256), (512, 640))]
    rows += [{**base, "tokens": 8192, "window": 128, "measured_s": 1.0}, {**base, "tokens": 32768, "measured_s": 1.0}]
    path = tmp_path / "h200_window.json"
    path.write_text(json.dumps({"rows": rows}))
    got = window_costs(path)
    assert (got["WINDOW_KEY_COST"], got["WINDOW_ROW_KEYS"], got["window_fit_rows"]) == (2.0, 100, 2)
    assert got["window_fit_error"] < 1e-9 and window_costs(tmp_path / "missing.json") is None


def test_window_constants_are_what_the_committed_bench_runs_measure():
    """WINDOW_KEY_COST and WINDOW_ROW_KEYS are the fit of gpt-oss-120b's sliding layers timed alone
    (hw_profiles/calibration/h200_window.json: windows 128 to 4096 at 32K tokens, 128 at 128K), within 12.2% of
    each row; the windowed kernel's key costs more than the full kernel's (it is the flash kernel, not cuDNN)."""
    import recipe.cost as cost

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    from calibrate import window_costs

    got = window_costs(Path(str(resources.files("hw_profiles") / "calibration" / "h200_window.json")))
    assert (got["WINDOW_KEY_COST"], got["WINDOW_ROW_KEYS"]) == (cost.WINDOW_KEY_COST, cost.WINDOW_ROW_KEYS)
    assert got["window_fit_rows"] == 6 and got["window_fit_error"] < 0.123 and cost.WINDOW_KEY_COST > 1


def test_merge_peaks_replaces_only_the_matching_measured_points(tmp_path):
    """`calibrate.py --merge-peaks` takes a memory-only run's peaks into a grid: the point of the same
    configuration (grid and kept layers included) takes them and the run's commit, its step time stays; a point
    the run did not measure, one the run failed, and one of another grid keep theirs; the predictions and errors are
    refreshed. A run that matches nothing is refused in one line and writes nothing."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    from calibrate import merge_peaks

    def pt(seq, peak, **kw):
        return {"model": "tiny-moe", "layers": 2, "seq": seq, "recompute": "full", "lm_head": "fused",
                "ep_path": False, "role": "fit", "predicted": {}, "step_s": 0.5, "peak_allocated_gb": peak,
                "peak_reserved_gb": peak + 1, **kw}

    grid = {"hw": "h200", "environment": {"commit": "aaa"}, "points": [
        pt(256, 10.0), pt(512, 11.0), pt(256, 12.0, grid="partial", keep_layers=1), pt(1024, 13.0)]}
    run = {"environment": {"commit": "bbb", "command": "calibrate.py --memory-only"}, "points": [
        {**pt(256, 9.0), "step_s": None}, pt(256, 8.0, keep_layers=1), {**pt(1024, 1.0), "error": "OOM: x"}]}
    for r in run["points"]:
        r.pop("step_s")
    g, r = tmp_path / "h200.json", tmp_path / "run.json"
    g.write_text(json.dumps(grid))
    r.write_text(json.dumps(run))
    merge_peaks(str(g), [str(r)])
    out = json.loads(g.read_text())
    first, second, partial, last = out["points"]
    assert (first["peak_allocated_gb"], first["peak_reserved_gb"], first["peak_commit"]) == (9.0, 10.0, "bbb")
    assert first["step_s"] == 0.5 and first["predicted"]["allocated_gb"] > 0
    assert [p["peak_allocated_gb"] for p in (second, partial, last)] == [11.0, 12.0, 13.0]
    assert not any("peak_commit" in p for p in (second, partial, last))
    assert out["environment"]["peaks"] == [{"command": "calibrate.py --memory-only", "commit": "bbb", "wall_s": None}]
    assert out["memory_error"] == summarize(out["points"])["memory_error"]
    before = g.read_text()
    r.write_text(json.dumps({"environment": {}, "points": [pt(4096, 1.0)]}))
    with pytest.raises(SystemExit, match="no point of .* matches"):
        merge_peaks(str(g), [str(r)])
    assert g.read_text() == before
