"""The `recipe` command line: plans written and read back, the views, and bad input as one line on stderr."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from importlib import resources

import pytest
from typer.testing import CliRunner

from recipe.cli import app
from recipe.plan import load_plan, parse_plan

runner = CliRunner()
SOLVE = ["solve", "--model", "qwen35-35b", "--seq", "128k", "--hw", "mi300x"]


def run(*args: str):
    return runner.invoke(app, list(args))


def assert_one_line_error(result, *needles: str):
    assert result.exit_code != 0, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    err = result.stderr.strip()
    assert "Traceback" not in result.output and "Traceback" not in err
    assert len(err.splitlines()) == 1, err
    for n in needles:
        assert n in err, err
    return err


# ---- solve -----------------------------------------------------------------------------------------------------
def test_solve_writes_a_yaml_plan_that_loads(tmp_path):
    out = tmp_path / "plan.yaml"
    r = run(*SOLVE, "--gpus", "32", "-o", str(out))
    assert r.exit_code == 0, r.output
    assert f"wrote {out}" in r.stdout.replace("\n", "")
    plan = load_plan(out)
    assert plan.inputs.model == "qwen35-35b" and plan.inputs.seq_len == 131_072 and plan.inputs.hw == "mi300x"
    lay = plan.layout
    assert lay.world == 32 == lay.pp * lay.ep * lay.etp * lay.edp
    assert plan.launch.nnodes * plan.launch.nproc_per_node == 32 and plan.launch.backend == "nccl"
    assert plan.train.recompute == "full" and plan.train.lm_head == "fused"
    mem = plan.prediction.memory_gb
    assert mem.total + plan.prediction.margin_gb.total <= mem.usable + 0.02
    assert plan.prediction.basis.memory == "assumed"  # mi300x has no calibration grid
    assert plan.reasons.gpus is None  # --gpus given: the count is the user's, not a decision
    assert {k for k, v in plan.reasons.model_dump().items() if v is not None} == {"tp", "ep", "cp", "pp"}
    assert out.read_text().startswith("# recipe plan: qwen35-35b at 128k tokens on 32x mi300x")


def test_solve_without_gpus_finds_the_smallest_count(tmp_path):
    out = tmp_path / "p.yaml"
    r = run(*SOLVE, "-o", str(out))
    assert r.exit_code == 0, r.output
    plan = load_plan(out)
    assert plan.inputs.gpus is None and plan.layout.world >= 1
    assert plan.prediction.memory_gb.total <= plan.prediction.memory_gb.usable


def test_solve_json_to_stdout():
    r = run(*SOLVE, "--gpus", "16", "--format", "json", "-o", "-")
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)
    assert data["schema"] == 1 and data["layout"]["pp"] * data["layout"]["tp"] * data["layout"]["cp"] * data[
        "layout"]["dp"] == 16
    assert parse_plan(r.stdout).inputs.gpus == 16


def test_solve_explain_shows_each_decision_and_the_bar():
    r = run("solve", "--model", "qwen35-35b", "--seq", "256k", "--hw", "h100", "--gpus", "32", "--explain")
    assert r.exit_code == 0, r.output
    out = r.stdout
    for dim in ("TP", "EP", "CP", "PP"):
        assert re.search(rf"^\s*{dim}=\d+", out, re.M), dim
    assert "memory per GPU" in out and "█" in out
    assert re.search(r"\| \d+\.\d / \d+\.\d GB", out)  # the bar ends at the usable limit
    for comp in ("weights", "grads", "master", "optimizer", "activations", "lm_head", "overhead"):
        assert comp in out
    assert "rejected alternative" in out and re.search(r"cp=\d+: peak [\d.]+ GB \+ margin [\d.]+ > 78\.6", out)
    assert "memory margin (held back beyond the peak)" in out
    assert "step time" in out and "LM head (fused): holds" in out


def test_recompute_auto_writes_the_choice_and_checks_clean(tmp_path):
    """--recompute auto: the plan keeps `auto` in its inputs and the mode chosen in train.recompute, with its reason;
    `recipe check` re-solves it to the same plan; the summary has the RC row."""
    out = tmp_path / "mx.yaml"
    r = run("solve", "--model", "qwen15-moe-a27b", "--seq", "64k", "--hw", "h200", "--recompute", "auto", "-o",
            str(out))
    assert r.exit_code == 0, r.output
    assert "(no recompute, " in r.stdout and "\nRC=none  step time: no recompute fits 8 GPUs as " in r.stdout
    plan = load_plan(out)
    assert plan.inputs.recompute == "auto" and plan.train.recompute == "none"
    assert plan.reasons.recompute.startswith("step time: no recompute fits 8 GPUs as pp=1 tp=1 cp=4 ")
    assert run("check", str(out)).exit_code == 0


def test_recompute_auto_keeps_layers_and_the_plan_runs_them(tmp_path):
    """--recompute auto choosing partial recompute: the plan's train block names the kept layers (train.keep_layers,
    with train.recompute full), the summary says so, `recipe check` re-solves it to the same plan, and a plan that
    keeps layers without recompute is refused in one line."""
    out = tmp_path / "q.yaml"
    r = run("solve", "--model", "qwen35-35b", "--seq", "64k", "--hw", "mi300x", "--recompute", "auto", "-o", str(out))
    assert r.exit_code == 0, r.output
    assert "(recompute, last 5 layers kept, " in r.stdout
    assert "\nRC=keep 5 step time: the last 5 of the 40 layers keep their activations" in r.stdout
    plan = load_plan(out)
    assert plan.inputs.recompute == "auto" and plan.train.recompute == "full" and plan.train.keep_layers == 5
    assert plan.train_options().keep_layers == 5 and plan.layout.cp == 1
    assert run("check", str(out)).exit_code == 0
    bad = tmp_path / "bad.yaml"
    bad.write_text(out.read_text().replace("  recompute: full\n  keep_layers: 5",
                                           "  recompute: none\n  keep_layers: 5"))
    r = run("check", str(bad))
    assert r.exit_code != 0 and "train.keep_layers = 5 needs train.recompute: full" in r.output
    # a plan solved without auto has no such field
    full = tmp_path / "full.yaml"
    assert run("solve", "--model", "qwen35-35b", "--seq", "64k", "--hw", "mi300x", "-o", str(full)).exit_code == 0
    assert "keep_layers" not in full.read_text()


def test_a_sparse_attention_plan_keeps_its_selections_where_they_fit(tmp_path):
    """GLM-5's first three layers at 64K on one H200 have room for DeepSeek sparse attention's kept selections: the
    plan says train.keep_selections (the header too), `recipe check` re-solves it the same, and a plan keeping them
    without recompute is refused in one line; GLM-5 at 128K on 128 H200s has no room and its plan has no such field
    (and there the indexer's compute they would save hides behind the exchanges that bound the step: `recipe
    compare` says so). `recipe compare` gives what they buy; a plan without recompute (what --recompute auto picks
    here) carries none."""
    from pathlib import Path

    glm5 = str(Path(__file__).resolve().parents[1] / "bench" / "configs" / "glm-5.json")
    out = tmp_path / "g.yaml"
    r = run("solve", "--model", glm5, "--layers", "3", "--seq", "64k", "--hw", "h200", "--gpus", "1", "-o", str(out))
    assert r.exit_code == 0, r.output
    assert "(full recompute, index selections kept, fused LM head" in r.stdout
    plan = load_plan(out)
    assert plan.train.keep_selections and plan.train_options().keep_selections
    assert run("check", str(out)).exit_code == 0
    bad = tmp_path / "bad.yaml"
    bad.write_text(out.read_text().replace("  recompute: full\n", "  recompute: none\n"))
    r = run("check", str(bad))
    assert r.exit_code != 0 and "train.keep_selections needs train.recompute: full" in r.output
    tight = tmp_path / "t.yaml"
    r = run("solve", "--model", glm5, "--seq", "128k", "--hw", "h200", "-o", str(tight))
    assert r.exit_code == 0, r.output
    assert "keep_selections" not in tight.read_text() and "index selections" not in r.stdout
    r = run("compare", "--model", "glm5", "--seq", "128k", "--hw", "h200")
    flat = re.sub(r"[\s│]+", " ", r.stdout)  # the table's cells wrapped or not
    assert re.search(r"keeping them would save 0% of the step \([\d.]+ s of compute, behind the exchanges that bound "
                     r"the step\)", flat), r.stdout
    # `recipe compare` says what they buy; with --recompute auto choosing no recompute, there is nothing to keep
    r = run("compare", "--model", glm5, "--layers", "3", "--seq", "64k", "--hw", "h200", "--gpus", "1")
    assert r.exit_code == 0
    assert re.search(r"kept index selections +│ kept: saves \d+% of the step for 1\.6 GB", r.stdout)
    auto = tmp_path / "a.yaml"
    r = run("solve", "--model", glm5, "--layers", "3", "--seq", "64k", "--hw", "h200", "--gpus", "1", "--recompute",
            "auto", "-o", str(auto))
    assert r.exit_code == 0 and load_plan(auto).train.recompute == "none" and "keep_selections" not in auto.read_text()
    assert run("check", str(auto)).exit_code == 0


def test_gpus_that_cost_far_more_a_token_get_a_note():
    """--gpus 32 for gpt-oss-120b at 128K on H100s fits only at tp=2: the count the default rule takes, 40 (tp=1),
    runs 1.5x or more the tokens/s per GPU, and one line on stderr says so; 16 H100s for qwen35-35b, within the rule,
    get none."""
    r = run("solve", "--model", "gpt-oss-120b", "--seq", "128k", "--hw", "h100", "--gpus", "32")
    assert r.exit_code == 0, r.output
    note = [line for line in r.stderr.splitlines() if line.startswith("note:")]
    assert len(note) == 1 and note[0].startswith("note: 40 GPUs run ") and "of these 32 (PP=1 TP=1 " in note[0]
    assert float(note[0].split(" run ")[1].split("x")[0]) >= 1.5
    r = run("solve", "--model", "qwen35-35b", "--seq", "128k", "--hw", "h100", "--gpus", "16")
    assert r.exit_code == 0 and "note:" not in r.stderr


def test_solve_options_change_the_plan(tmp_path):
    base = json.loads(run(*SOLVE, "--gpus", "8", "--seq", "32k", "-f", "json", "-o", "-").stdout)
    naive = json.loads(run(*SOLVE, "--gpus", "8", "--seq", "32k", "--lm-head", "naive", "-f", "json",
                           "-o", "-").stdout)
    assert naive["train"]["lm_head"] == "naive"
    assert naive["prediction"]["memory_gb"]["lm_head"] > base["prediction"]["memory_gb"]["lm_head"]
    lean = json.loads(run(*SOLVE, "--gpus", "8", "--seq", "32k", "--lm-head", "lean", "-f", "json", "-o", "-").stdout)
    assert lean["train"]["lm_head"] == "lean"  # four GEMMs where fused runs three: a longer step
    assert lean["prediction"]["step_time_s"] > base["prediction"]["step_time_s"]
    short = json.loads(run(*SOLVE, "--gpus", "8", "--layers", "4", "-f", "json", "-o", "-").stdout)
    assert short["inputs"]["layers"] == 4


# ---- -o: atomic replace, untouched on failure ------------------------------------------------------------------
def test_output_replaces_existing_file_atomically(tmp_path):
    out = tmp_path / "plan.yaml"
    out.write_text("old contents\n")
    inode = out.stat().st_ino
    r = run(*SOLVE, "--gpus", "32", "-o", str(out))
    assert r.exit_code == 0, r.output
    load_plan(out)
    assert out.stat().st_ino != inode  # a rename over the old file, not a rewrite in place
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plan.yaml"]  # no temporary left behind


def test_failed_solve_leaves_existing_output_byte_identical(tmp_path):
    out = tmp_path / "plan.yaml"
    run(*SOLVE, "--gpus", "32", "-o", str(out))
    before = out.read_bytes()
    r = run("solve", "--model", "deepseek-v3", "--seq", "1m", "--gpus", "8", "--hw", "h100", "-o", str(out))
    assert r.exit_code != 0
    assert out.read_bytes() == before
    r = run(*SOLVE, "--seq", "12x", "-o", str(out))
    assert r.exit_code != 0 and out.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plan.yaml"]


def test_output_onto_a_directory_is_an_error(tmp_path):
    assert_one_line_error(run(*SOLVE, "--gpus", "32", "-o", str(tmp_path)), "is a directory")


# ---- bad input: one line, non-zero, no traceback ----------------------------------------------------------------
@pytest.mark.parametrize("args, needles", [
    (["--model", "qwen35-35", "--seq", "128k", "--hw", "h100"], ["unknown model", "did you mean qwen35-35b"]),
    (["--model", "qwen35-35b", "--seq", "128k", "--hw", "h10"], ["unknown hardware profile", "did you mean h100"]),
    (["--model", "qwen35-35b", "--seq", "12x", "--hw", "h100"], ["malformed size '12x'"]),
    (["--model", "qwen35-35b", "--seq", "128k", "--hw", "h100", "--gpus", "5000"], ["--gpus must be between"]),
    (["--model", "qwen35-35b", "--seq", "64k", "--hw", "h100", "--gpus", "7"],
     ["7 GPUs leave no larger cp", "cp=7 would not split", "12 GPUs fit"]),
    (["--model", "deepseek-v3", "--seq", "1m", "--gpus", "8", "--hw", "h100"],
     ["does not fit on 8x h100", "GB over"]),
    (["--model", "qwen35-35b", "--seq", "128k", "--hw", "h100", "--recompute", "some"],
     ["--recompute must be 'full', 'none' or 'auto', got 'some'"]),
    (["--model", "qwen35-35b", "--seq", "128k", "--hw", "h100", "--micro-batch-tokens", "32k"],
     ["--micro-batch-tokens 32,768 < --seq 131,072"]),
    (["--model", "qwen35-35b", "--seq", "128k", "--hw", "h100", "--format", "toml"], ["--format"]),
    (["--model", "qwen35-35b", "--seq", "128k", "--hw", "h100", "--layers", "99"], ["--layers 99"]),
])
def test_bad_input_is_one_line(args, needles):
    assert_one_line_error(run("solve", *args), *needles)


def test_infeasible_exits_1_and_bad_input_exits_2():
    assert run("solve", "--model", "deepseek-v3", "--seq", "1m", "--gpus", "8", "--hw", "h100").exit_code == 1
    assert run("solve", "--model", "nope", "--seq", "1k", "--hw", "h100").exit_code == 2


def test_bad_model_config_and_profile_files(tmp_path):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"model_type": "qwen3_moe", "hidden_size": 64}))
    assert_one_line_error(run("solve", "--model", str(cfg), "--seq", "8k", "--hw", "h100"), "missing field")
    prof = tmp_path / "mine.yaml"
    prof.write_text("name: mine\nvendor: nvidia\n")
    assert_one_line_error(run("solve", "--model", "qwen35-35b", "--seq", "8k", "--hw", str(prof)), "mine.yaml")


# ---- the other commands ----------------------------------------------------------------------------------------
def test_hw_lists_profiles_and_shows_sources():
    r = run("hw")
    assert r.exit_code == 0
    for name in ("h100", "h200", "b200", "mi300x", "mi325x", "mi355x", "cpu"):
        assert name in r.stdout
    assert "989.4" in r.stdout and "1979 " not in r.stdout
    r = run("hw", "mi300x")
    assert r.exit_code == 0 and "peak_bf16_tflops:" in r.stdout and "datasheet" in r.stdout
    assert_one_line_error(run("hw", "mi30"), "did you mean")


def test_models_lists_totals_and_active():
    r = run("models")
    assert r.exit_code == 0
    row = next(line for line in r.stdout.splitlines() if "qwen35-35b" in line)
    counts = [float(x) for x in re.findall(r"(\d+\.\d+)B", row)]
    assert counts[0] == 34.661  # ≈34.66B text parameters
    assert counts[1] == 2.946  # ≈2.95B active: the input embedding (a lookup) is not counted
    assert "input embedding" in r.stdout
    r = run("models", "qwen35-35b")
    assert r.exit_code == 0 and "32,212,254,720" in r.stdout and "mtp" in r.stdout


def test_sweep_shows_the_solver_rank():
    r = run("sweep", "--model", "qwen35-35b", "--seq", "128k", "--hw", "mi300x", "--gpus", "32")
    assert r.exit_code == 0, r.output
    m = re.search(r"(\d+) grid points, (\d+) fit .* ranks #(\d+) \((\d+\.\d+)× the grid optimum", r.stdout.replace(
        "\n", " "))
    assert m, r.stdout
    n_points, n_fit, rank, ratio = int(m[1]), int(m[2]), int(m[3]), float(m[4])
    assert 1 <= rank <= n_fit <= n_points and ratio <= 1.05
    assert "◀ solver" in r.stdout or rank > 15


def test_compare_three_parts():
    r = run("compare", "--model", "qwen35-35b", "--seq", "128k", "--hw", "h100,mi300x,mi355x")
    assert r.exit_code == 0, r.output
    out = r.stdout
    for name in ("h100", "mi300x", "mi355x"):
        assert name in out
    for label in ("layout", "activations GB", "peak / usable GB", "tok/s/GPU", "MFU hw / model",
                  "what each technique buys", "full recompute", "fused LM head", "context parallel",
                  "FSDP2 sharding", "chunked EP overlap"):
        assert label in out, label
    assert_one_line_error(run("compare", "--model", "qwen35-35b", "--seq", "128k", "--hw", "h100,mi3000x"),
                          "unknown hardware profile")


def test_compare_plot(tmp_path):
    pytest.importorskip("matplotlib")
    png = tmp_path / "mem.png"
    r = run("compare", "--model", "qwen35-35b", "--seq", "128k", "--hw", "h100,mi300x", "--plot", str(png))
    assert r.exit_code == 0, r.output
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ---- a real process, from a directory that is not the repository ---------------------------------------------
def _recipe_argv() -> list[str]:
    exe = shutil.which("recipe", path=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    return [exe] if exe else [sys.executable, "-m", "recipe"]


def test_real_process_from_a_temp_cwd(tmp_path):
    """hw_profiles resolve from the installed package, not the working directory."""
    assert (resources.files("hw_profiles") / "mi300x.yaml").is_file()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    p = subprocess.run(_recipe_argv() + SOLVE + ["-o", "plan.yaml"], cwd=tmp_path, env=env, capture_output=True,
                       text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert load_plan(tmp_path / "plan.yaml").inputs.hw == "mi300x"
    bad = subprocess.run(_recipe_argv() + ["solve", "--model", "qwen35-35b", "--seq", "12x", "--hw", "mi300x"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2
    assert bad.stderr.strip().count("\n") == 0 and "Traceback" not in bad.stderr
    assert "torch" not in subprocess.run(
        [sys.executable, "-c", "import sys, recipe.cli, recipe.solver, recipe.sweep, recipe.plan; "
                               "print(' '.join(m for m in sys.modules if m.split('.')[0] in ('torch', 'triton')))"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60).stdout


def test_any_world_size_gets_a_launch_block(tmp_path):
    """12 GPUs on 8-GPU nodes: two nodes of six, a layout whose degrees multiply to 12."""
    from recipe.plan import load_plan

    out = tmp_path / "p.yaml"
    r = run("solve", "--model", "qwen35-35b", "--seq", "32k", "--hw", "h100", "--gpus", "12", "-o", str(out))
    assert r.exit_code == 0, r.output
    plan = load_plan(out)
    assert (plan.launch.nnodes, plan.launch.nproc_per_node) == (2, 6)
    assert plan.layout.world == 12


def test_solve_never_tracebacks_on_random_options():
    """Random sizes, GPU counts, depths and options: exit 0, 1 or 2, and on failure exactly one line, never a
    traceback."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    sizes = st.one_of(st.sampled_from(["4k", "128k", "1m", "0", "-8k", "1.5k", "12x", "", " 64K ", "9" * 30]),
                      st.text(max_size=8))
    counts = st.one_of(st.none(), st.integers(min_value=-3, max_value=5000).map(str), st.sampled_from(["x", "1e3"]))

    @settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
    @given(model=st.sampled_from(["tiny-moe", "qwen35-35b", "mixtral-8x7b", "nope", "/no/such/config.json"]),
           hw=st.sampled_from(["cpu", "h100", "mi355x", "h1OO"]), seq=sizes, gpus=counts, layers=counts,
           mbt=st.one_of(st.none(), sizes))
    def check(model, hw, seq, gpus, layers, mbt):
        args = ["solve", "--model", model, "--seq", seq, "--hw", hw]
        for flag, v in (("--gpus", gpus), ("--layers", layers), ("--micro-batch-tokens", mbt)):
            if v is not None:
                args += [flag, v]
        r = run(*args)
        assert r.exit_code in (0, 1, 2), (args, r.exit_code, r.output)
        assert "Traceback" not in r.output, (args, r.output)
        if r.exit_code == 1 or (r.exit_code == 2 and "error:" in r.output):
            assert len([ln for ln in r.output.splitlines() if ln.startswith("error:")]) == 1, (args, r.output)

    check()


def test_compare_ep_overlap_names_the_chunk_loop():
    """Where the plan runs EP, the overlap row gives its chunk count, the step it saves against one chunk and its chunk
    loop's time, as the cost model has them (qwen35-397b at 32K on 64 MI300X: ep = 8)."""
    import re

    from recipe.compare import technique_effects
    from recipe.cost import TrainOptions, estimate
    from recipe.hw import load_profile
    from recipe.models import PRESETS
    from recipe.solver import solve

    m, hw = PRESETS["qwen35-397b"], load_profile("mi300x")
    sol = solve(m, hw, 64, TrainOptions(micro_batch_tokens=32_768))
    assert sol.layout.ep > 1
    k = sol.opts.ep_overlap_chunks
    one = estimate(m, hw, 64, sol.layout, sol.opts.model_copy(update={"ep_overlap_chunks": 1}))
    got = re.fullmatch(r"k=(\d+): saves (-?[\d.]+)% of the step against k=1, its chunk loop's ([\d.]+) s included",
                       technique_effects(m, hw, sol)["ep_overlap"])
    assert got, technique_effects(m, hw, sol)["ep_overlap"]
    assert int(got[1]) == k > 1
    assert float(got[2]) == pytest.approx(100 * (1 - sol.estimate.step_time_s / one.step_time_s), abs=0.05)
    assert float(got[3]) == pytest.approx(sol.estimate.compute_s["ep_chunks"], abs=0.005)
    assert sol.estimate.compute_s["ep_chunks"] > 0


def test_compare_recompute_row_names_what_partial_recompute_would_buy():
    """Where full recompute is needed and the layout leaves room, the recompute row says how many last layers could
    keep their activations and the step time that saves, as solve_keep_layers finds them (qwen35-35b at 32K on 8
    MI300X: 12 layers); a solution that already keeps layers (--recompute auto) is compared without error."""
    import re

    from recipe.compare import technique_effects
    from recipe.cost import TrainOptions
    from recipe.hw import load_profile
    from recipe.models import PRESETS
    from recipe.solver import solve, solve_keep_layers, solve_recompute

    m, hw = PRESETS["qwen35-35b"], load_profile("mi300x")
    sol = solve(m, hw, 8, TrainOptions(micro_batch_tokens=32_768))
    part = solve_keep_layers(m, hw, sol)
    row = technique_effects(m, hw, sol)["recompute"]
    got = re.fullmatch(r"needed: without it \d+ GB > 185; the last (\d+) layers could keep their activations: "
                       r"(\d+)% less step time", row)
    assert got, row
    assert int(got[1]) == part.opts.keep_layers == 12
    assert int(got[2]) == round(100 * (1 - part.estimate.step_time_s / sol.estimate.step_time_s))
    auto = solve_recompute(m, hw, sol)
    assert auto.opts.keep_layers > 0 and technique_effects(m, hw, auto)["recompute"].startswith("needed: ")
