"""Layout pinning ("what if"): `recipe solve --pp/--tp/--cp/--ep` fixes those degrees and solves the rest with the
usual rules; a pin that cannot work exits 1 naming the divisibility rule or the memory shortfall; the plan records
the pins in `inputs.pins`, `recipe check` re-solves with them and `--fix` keeps them."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from recipe.cli import app
from recipe.solving import solve_inputs
from recipe.cost import Layout, TrainOptions, estimate, with_default_chunks
from recipe.hw import load_profile
from recipe.models import PRESETS
from recipe.plan import Inputs, build_plan, dumps, load_plan, parse_plan
from recipe.solver import InfeasibleError, pin_violations, solve, solve_min_gpus

runner = CliRunner()
PLANS = Path(__file__).resolve().parents[1] / "plans"
TINY_PLAN = PLANS / "tiny-cpu.yaml"
TINY = ["--model", "tiny-moe", "--seq", "4k", "--hw", "cpu"]  # 4 layers, 4/2 heads, 8 experts, vocab 512
# 1K tokens on 2 CPU processes: the EP rule's own choice is ep=1, 3% ahead of ep=2 (beyond its 1% tie band, which
# goes to the larger ep), so pinning ep=2 differs from the rule (at 4K the two are within 1% and the rule takes 2)
TINY_EP = ["--model", "tiny-moe", "--seq", "1k", "--hw", "cpu"]


def run(*args: str):
    return runner.invoke(app, list(args))


def one_line_error(result, code: int, *needles: str) -> str:
    assert result.exit_code == code, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    err = result.stderr.strip()
    assert "Traceback" not in result.output and "Traceback" not in err
    assert len(err.splitlines()) == 1 and err.startswith("error: "), err
    for n in needles:
        assert n in err, err
    return err


def solved_json(*args: str) -> dict:
    r = run("solve", *args, "-f", "json", "-o", "-")
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)


# ---- pinning solves the rest ---------------------------------------------------------------------------------
def test_pin_ep_on_tiny_moe_solves_the_rest():
    """2 CPU processes: unpinned the EP rule takes ep=1 (8 experts/rank, no all-to-all); pinned ep=2 the experts
    split 8/2 = 4 per rank, edp = 2/(pp·ep) = 1, and TP, CP, PP keep their own rules (1, 1, 1; dp = 2)."""
    free = solved_json(*TINY_EP, "--gpus", "2")
    assert free["layout"]["ep"] == 1 and "pins" not in free["inputs"]
    d = solved_json(*TINY_EP, "--gpus", "2", "--ep", "2")
    assert d["layout"] == {"pp": 1, "tp": 1, "cp": 1, "ep": 2, "dp": 2, "etp": 1, "edp": 1}
    assert d["inputs"]["pins"] == {"ep": 2}
    ep = d["reasons"]["ep"]
    assert re.match(r"pinned by the user: ep=2 \(peak [\d.]+ GB \+ margin [\d.]+ of 12\.9 GB usable, 4 experts/rank, "
                    r"inside one node", ep), ep
    assert "rejected ep=1, the EP rule's choice" in ep  # what the rule would have taken, with its figures
    for k in ("tp", "cp", "pp"):  # the unpinned dimensions: their own rules, as without the pin
        assert d["reasons"][k] == free["reasons"][k]
    assert d["prediction"]["memory_gb"]["total"] <= d["prediction"]["memory_gb"]["usable"]


def test_an_uneven_pipeline_depth_can_be_pinned(tmp_path):
    """pp=3 over tiny-moe's 4 layers: the unpinned search keeps to depths that divide the layers, a pin may not; the
    plan's stages cover the layers unevenly ([2, 1, 1]: the head's stage the lightest), its reason names the largest
    stage, and `recipe check` finds the plan valid and fitting."""
    d = solved_json(*TINY_EP, "--gpus", "3", "--pp", "3")
    assert d["layout"]["pp"] == 3 and d["train"]["pp_stages"] == [2, 1, 1]
    assert "up to 2 layers/stage" in d["reasons"]["pp"]
    plan = tmp_path / "pp3.yaml"
    assert run("solve", *TINY_EP, "--gpus", "3", "--pp", "3", "-o", str(plan)).exit_code == 0
    r = run("check", str(plan))
    assert r.exit_code == 0 and "1 plan checked: 1 ok" in r.output, r.output


def test_pinned_decision_in_the_solver_api():
    m, hw = PRESETS["tiny-moe"], load_profile("cpu")
    o = TrainOptions(micro_batch_tokens=1024)
    s = solve(m, hw, 2, o, pins={"ep": 2})
    assert s.pins == {"ep": 2} and s.layout == Layout(pp=1, tp=1, cp=1, ep=2)
    d = s.decisions["ep"]
    assert d.value == 2 and d.constraint == "pinned by the user"
    assert d.numbers["experts_per_rank"] == 4 and d.numbers["expert_dp"] == 1
    assert d.numbers["peak_gb"] == round(s.estimate.total_gb, 2)
    assert d.numbers["headroom_gb"] == round(hw.usable_gb - s.estimate.total_gb, 2)
    assert {k: s.decisions[k].constraint for k in ("tp", "cp", "pp")} == {
        "tp": "per-layer memory", "cp": "activation memory", "pp": "pipeline bubble"}
    assert solve(m, hw, 2, o, pins=None).pins == {} and solve(m, hw, 2, o, pins={}).layout.ep == 1
    # a pin the rule agrees with says so, and rejects nothing
    same = solve(m, hw, 2, o, pins={"cp": 1}).decisions["cp"]
    assert "the CP rule picks the same here" in same.reason and same.rejected == ""


@pytest.mark.parametrize("model, hw, seq, world", [
    ("qwen35-35b", "h100", 262_144, 32), ("qwen35-35b", "mi300x", 131_072, 8), ("mixtral-8x7b", "h100", 32_768, 16),
    ("tiny-moe", "cpu", 4096, 8)])
def test_pinning_the_solvers_own_choice_changes_nothing(model, hw, seq, world):
    m, prof, o = PRESETS[model], load_profile(hw), TrainOptions(micro_batch_tokens=seq)
    free = solve(m, prof, world, o)
    for pins in ({"ep": free.layout.ep}, {"cp": free.layout.cp}, {"tp": free.layout.tp, "pp": free.layout.pp},
                 {k: getattr(free.layout, k) for k in ("pp", "tp", "cp", "ep")}):
        s = solve(m, prof, world, o, pins=pins)
        assert s.layout == free.layout, pins
        assert all(s.decisions[k].constraint == "pinned by the user" for k in pins)


def test_pins_without_gpus_take_the_smallest_count_the_pins_allow():
    """Counts tried: 1, 2, 4, then whole 8-process nodes. tp=2 and cp=2 need pp·tp·cp = 4 to divide the count: 4."""
    d = solved_json(*TINY, "--tp", "2", "--cp", "2")
    assert d["inputs"]["gpus"] is None and d["inputs"]["pins"] == {"tp": 2, "cp": 2}
    assert (d["layout"]["tp"], d["layout"]["cp"], d["layout"]["dp"]) == (2, 2, 1)
    assert d["launch"]["nnodes"] * d["launch"]["nproc_per_node"] == 4
    # ep=8 needs 8 | world/pp: the first count is one node of 8
    assert solved_json(*TINY, "--ep", "8")["layout"]["edp"] == 1
    s = solve_min_gpus(PRESETS["tiny-moe"], load_profile("cpu"), TrainOptions(micro_batch_tokens=4096),
                       pins={"ep": 8})
    assert s.world == 8 and s.layout.ep == 8


# ---- pins that cannot work: exit 1, one line, the rule named -------------------------------------------------
@pytest.mark.parametrize("args, needle", [
    (["--gpus", "2", "--ep", "3"], "ep=3 must divide the 8 experts"),
    (["--gpus", "2", "--ep", "4"], "ep=4 must divide world/pp = 2/1 = 2"),
    (["--gpus", "4", "--pp", "2", "--ep", "4"], "ep=4 must divide world/pp = 4/2 = 2"),
    (["--gpus", "4", "--tp", "4"], "tp=4 must divide the 2 KV heads, the 2 linear-attention key heads"),
    (["--gpus", "8", "--pp", "8"], "pp=8 must leave each pipeline stage at least one of the 4 layers"),
    (["--gpus", "2", "--cp", "3"], "sequence 4096 does not split into 2·cp=6 equal segments"),
    (["--gpus", "2", "--tp", "2", "--cp", "2"], "pinned tp·cp = 2·2 = 4 must divide the 2 GPUs"),
    (["--gpus", "6", "--cp", "4"], "cp=4 must divide the 6 GPUs"),
    (["--ep", "3"], "ep=3 must divide the 8 experts"),  # without --gpus too, before any count is tried
])
def test_pin_breaking_divisibility_exits_1_naming_the_rule(args, needle):
    err = one_line_error(run("solve", *TINY, *args), 1, needle)
    assert "cannot work for tiny-moe at 4,096 tokens" in err


def test_cp_pin_must_cut_whole_delta_rule_chunks():
    """96 tokens at cp=2: 4 segments of 24 tokens, not whole 16-token delta-rule chunks (tiny-moe's chunk_size)."""
    one_line_error(run("solve", "--model", "tiny-moe", "--seq", "96", "--hw", "cpu", "--gpus", "2", "--cp", "2"), 1,
                   "cp=2 must split the sequence", "segments of 24 tokens are not whole 16-token delta-rule chunks")


def test_tp_pin_must_stay_in_a_node():
    one_line_error(run("solve", "--model", "deepseek-v3", "--seq", "4k", "--hw", "h100", "--gpus", "16", "--tp", "16"),
                   1, "tp=16 must stay inside one node (8 GPUs per h100 node)")


def test_a_tied_embedding_takes_no_tensor_parallelism():
    """ERNIE-4.5 ties its embedding to the LM head, which the vocabulary-parallel head does not split: a tp pin is
    refused naming why, the solver never picks tp > 1 for it, and `recipe check` flags a committed tp > 1."""
    from recipe.check import divisibility
    from recipe.cost import Layout
    from recipe.solver import tp_candidates

    one_line_error(run("solve", "--model", "ernie45-21b-a3b", "--seq", "32k", "--hw", "h100", "--tp", "2"), 1,
                   "tp=2: ernie45-21b-a3b ties its embedding to the LM head")
    m, hw = PRESETS["ernie45-21b-a3b"], load_profile("h100")
    assert tp_candidates(m, hw, 8) == [1] and tp_candidates(PRESETS["qwen3-30b-a3b"], hw, 8) == [1, 2, 4]
    assert [d for d, _, _ in divisibility(m, Layout(tp=2), 32768)] == ["tp"]


@pytest.mark.parametrize("flag", ["--pp", "--tp", "--cp", "--ep"])
def test_non_positive_pin_is_unusable_input(flag):
    one_line_error(run("solve", *TINY, flag, "0"), 2, f"{flag} must be positive, got 0")
    one_line_error(run("solve", *TINY, flag, "-2"), 2, f"{flag} must be positive, got -2")


def test_bad_pins_in_the_api_are_value_errors():
    m, hw, o = PRESETS["tiny-moe"], load_profile("cpu"), TrainOptions(micro_batch_tokens=4096)
    for pins, msg in (({"dp": 2}, "unknown pin 'dp'"), ({"ep": 0}, "--ep must be a positive integer"),
                      ({"ep": True}, "--ep must be a positive integer")):
        with pytest.raises(ValueError, match=msg) as e:
            solve(m, hw, 2, o, pins=pins)
        assert not isinstance(e.value, InfeasibleError)  # unusable input (exit 2), not "no layout fits"
    assert pin_violations(m, hw, 4096, {"ep": 2, "cp": 2}, 2) == []


def test_pinned_layout_that_does_not_fit_names_the_shortfall():
    """docs/solver.md's worked example: qwen35-35b at 256K on 32 H100s needs a CP split; pinning cp=1 (with ep=8)
    names that layout's peak, its memory margin and the shortfall, peak + margin − 78.6 GB usable, as the cost model
    and recipe/margin.py give them."""
    from recipe.margin import estimate_with_margin

    seq = 262_144
    m, hw = PRESETS["qwen35-35b"], load_profile("h100")
    e = estimate_with_margin(m, hw, 32, Layout(ep=8),
                             with_default_chunks(m, hw, 32, Layout(ep=8), TrainOptions(micro_batch_tokens=seq)))
    over = e.total_gb + e.margin.total_gb - load_profile("h100").usable_gb
    r = run("solve", "--model", "qwen35-35b", "--seq", "256k", "--hw", "h100", "--gpus", "32",
            "--pp", "1", "--tp", "1", "--cp", "1", "--ep", "8")
    err = one_line_error(r, 1, "with pp=1 tp=1 cp=1 ep=8 pinned does not fit on 32x h100",
                         f"the pinned layout (pp=1 tp=1 cp=1 ep=8) peaks at {e.total_gb:.1f} GB + margin "
                         f"{e.margin.total_gb:.1f} GB against 78.6 GB usable ({over:.1f} GB over")
    assert re.search(r"unpinned, 32 GPUs fit as pp=1 tp=1 cp=[248] ep=", err), err


def test_tiny_pinned_layout_out_of_memory_on_cpu():
    """tiny-moe at 4M tokens, all on one rank's sequence (cp=1): the peak the message names is the cost model's
    estimate of that layout, and the shortfall is that peak minus the cpu profile's 12.9 GB usable (24 GiB · 0.5)."""
    r = run("solve", "--model", "tiny-moe", "--seq", "4m", "--hw", "cpu", "--gpus", "2",
            "--pp", "1", "--tp", "1", "--cp", "1", "--ep", "2")
    err = one_line_error(r, 1, "the pinned layout (pp=1 tp=1 cp=1 ep=2) peaks at", "against 12.9 GB usable")
    peak, margin, over = map(float, re.search(r"peaks at ([\d.]+) GB \+ margin ([\d.]+) GB against 12\.9 GB usable "
                                              r"\(([\d.]+) GB over", err).groups())
    seq = 4 << 20
    m, hw = PRESETS["tiny-moe"], load_profile("cpu")
    o = with_default_chunks(m, hw, 2, Layout(ep=2), TrainOptions(micro_batch_tokens=seq))
    est = estimate(m, hw, 2, Layout(ep=2), o)
    assert peak == round(est.total_gb, 1) and over == pytest.approx(peak + margin - load_profile("cpu").usable_gb,
                                                                  abs=0.16)
    # the 4 layers' checkpointed inputs alone are 4 · 4,194,304 · 64 · 2 bytes = 2.1 GB of it
    assert est.memory_gb["activations"] > 4 * seq * 64 * 2 / 1e9
    # without --gpus: no count fits cp=1, and the nearest miss is named
    one_line_error(run("solve", "--model", "tiny-moe", "--seq", "4m", "--hw", "cpu", "--cp", "1", "--pp", "1",
                       "--tp", "1"), 1, "with pp=1 tp=1 cp=1 pinned fits on no count of cpu", "GB over")


# ---- the plan, check and --fix -------------------------------------------------------------------------------
def _pinned_plan(tmp_path, name="pinned.yaml"):
    out = tmp_path / name
    r = run("solve", *TINY_EP, "--gpus", "2", "--ep", "2", "-o", str(out))
    assert r.exit_code == 0, r.output
    return out


def test_pins_round_trip_through_the_plan(tmp_path):
    p = _pinned_plan(tmp_path)
    plan = load_plan(p)
    assert plan.inputs.pins == {"ep": 2} and plan.layout.ep == 2
    assert "pins:\n    ep: 2\n" in p.read_text()
    assert plan.reasons.ep.startswith("pinned by the user: ep=2")
    assert parse_plan(dumps(plan, "json")).inputs.pins == {"ep": 2}
    m, hw, sol = solve_inputs(plan.inputs, p.parent)
    assert sol.layout.ep == 2 and sol.pins == {"ep": 2}
    assert dumps(build_plan(plan.inputs, m, hw, sol)) == p.read_text()  # what `recipe solve` wrote, to the byte


def test_plans_without_pins_are_unchanged():
    """Schema 1 stays compatible: no `pins` key in an unpinned plan, and committed plans load with pins None."""
    unpinned = PLANS / "mixtral-8x7b_h100_32k.yaml"
    plan = load_plan(unpinned)
    assert plan.inputs.pins is None and "pins" not in plan.to_dict()["inputs"]
    inputs = Inputs(model="mixtral-8x7b", seq_len=32768, hw="h100")
    m, hw, sol = solve_inputs(inputs)
    assert dumps(build_plan(inputs, m, hw, sol)) == unpinned.read_text()
    assert load_plan(TINY_PLAN).inputs.pins == {"ep": 2}  # the committed tiny plan pins ep (the EP path on CPU)
    for empty in (None, {}):
        data = yaml.safe_load(unpinned.read_text())
        data["inputs"]["pins"] = empty
        assert parse_plan(yaml.safe_dump(data)).inputs.pins in (None, {})


def check(*args: str):
    return runner.invoke(app, ["check", *args])


def test_check_re_solves_a_pinned_plan_with_its_pins(tmp_path):
    """Unpinned, these inputs solve to ep=1; pinned, the plan says ep=2 and check finds no drift."""
    p = _pinned_plan(tmp_path)
    r = check(str(p))
    assert r.exit_code == 0, r.output
    assert "1 plan checked: 1 ok" in r.output
    # the same plan without its pins is drift against today's unpinned solve
    data = yaml.safe_load(p.read_text())
    del data["inputs"]["pins"]
    q = tmp_path / "unpinned.yaml"
    q.write_text(yaml.safe_dump(data, sort_keys=False))
    r = check(str(q))
    assert r.exit_code == 1 and f"{q}: layout.ep: committed 2, solved 1 [drift]" in r.output


def test_hand_edit_against_a_pin_is_named_and_fix_keeps_the_pins(tmp_path):
    p = _pinned_plan(tmp_path)
    clean = p.read_text()
    data = yaml.safe_load(clean)
    data["layout"].update(ep=1, edp=2)
    data["prediction"]["step_time_s"] += 1.0
    p.write_text(yaml.safe_dump(data, sort_keys=False))
    r = check(str(p))
    assert r.exit_code == 1, r.output
    assert (f"{p}: layout.ep: committed 1, solved 2 [drift] — the plan pins ep=2 (inputs.pins) but its layout has "
            f"ep=1: a hand edit") in r.output
    r = check("--fix", str(p))
    assert r.exit_code == 0 and f"fixed {p}" in r.output, r.output
    assert p.read_text() == clean  # rewritten as `recipe solve --ep 2` wrote it: pins kept, layout pinned
    assert load_plan(p).inputs.pins == {"ep": 2}


def test_pinned_plan_without_gpus_checks_clean(tmp_path):
    out = tmp_path / "p.json"
    r = run("solve", *TINY, "--cp", "2", "--ep", "2", "-f", "json", "-o", str(out))
    assert r.exit_code == 0, r.output
    plan = load_plan(out)
    assert plan.inputs.gpus is None and plan.inputs.pins == {"cp": 2, "ep": 2} and plan.layout.world == 2
    assert check(str(out)).exit_code == 0


def test_a_pin_that_no_longer_works_is_reported_not_raised(tmp_path):
    p = _pinned_plan(tmp_path)
    data = yaml.safe_load(p.read_text())
    data["inputs"]["pins"] = {"ep": 3}
    p.write_text(yaml.safe_dump(data, sort_keys=False))
    r = check(str(p))
    assert r.exit_code == 1 and "Traceback" not in r.output
    assert "ep=3 must divide the 8 experts" in r.output
    data["inputs"]["pins"] = {"dp": 2}
    p.write_text(yaml.safe_dump(data, sort_keys=False))
    r = check(str(p))
    assert r.exit_code == 2 and "[invalid] field inputs.pins.dp" in r.output


# ---- views ---------------------------------------------------------------------------------------------------
def test_explain_and_summary_show_the_pins():
    r = run("solve", *TINY_EP, "--gpus", "2", "--ep", "2", "--explain")
    assert r.exit_code == 0, r.output
    assert "pinned ep=2)" in r.stdout.splitlines()[0]
    assert re.search(r"^EP\s+2\s+pinned by the user\s+ep=2 \(peak", r.stdout, re.M), r.stdout
    assert re.search(r"EP=2\s+peak_gb=[\d.]+, headroom_gb=[\d.]+", r.stdout), r.stdout
    assert "ep=1, the EP rule's choice" in r.stdout
    r = run("solve", *TINY_EP, "--gpus", "2", "--ep", "2")
    assert re.search(r"^EP=2\s+pinned by the user\s+ep=2 \(peak [\d.]+ GB \+ margin [\d.]+ of 12\.9 GB usable", r.stdout,
                     re.M), r.stdout


def test_random_pins_never_traceback():
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    deg = st.one_of(st.none(), st.integers(min_value=-2, max_value=70).map(str))

    @settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
    @given(model=st.sampled_from(["tiny-moe", "qwen35-35b", "mixtral-8x7b"]), hw=st.sampled_from(["cpu", "h100"]),
           seq=st.sampled_from(["96", "4k", "128k"]), gpus=st.one_of(st.none(), st.sampled_from(["1", "2", "6", "16"])),
           pp=deg, tp=deg, cp=deg, ep=deg)
    def go(model, hw, seq, gpus, pp, tp, cp, ep):
        args = ["solve", "--model", model, "--seq", seq, "--hw", hw]
        for flag, v in (("--gpus", gpus), ("--pp", pp), ("--tp", tp), ("--cp", cp), ("--ep", ep)):
            if v is not None:
                args += [flag, v]
        r = run(*args)
        assert r.exit_code in (0, 1, 2), (args, r.output)
        assert "Traceback" not in r.output and (r.exception is None or isinstance(r.exception, SystemExit)), args
        if r.exit_code:
            assert len(r.stderr.strip().splitlines()) == 1, (args, r.stderr)
        else:
            for flag, v in (("pp", pp), ("tp", tp), ("cp", cp), ("ep", ep)):
                if v is not None:
                    assert f"{flag.upper()}={v} " in r.stdout.splitlines()[1] + " ", (args, r.stdout)

    go()
