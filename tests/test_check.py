"""`recipe check`: clean plans pass; hand edits, changed profiles, misfits and divisibility violations are named
with file, field, committed and solved values; unusable input exits 2 in one line; --fix; GitHub annotations."""

from __future__ import annotations

import json
import re
import shutil
from importlib import resources
from pathlib import Path
from types import SimpleNamespace

import yaml
from typer.testing import CliRunner

from recipe.check import check_paths, check_plan, divisibility, exit_code, find_plans, line_of
from recipe.cli import app
from recipe.solving import solve_inputs
from recipe.gen_plans import generate
from recipe.models import PRESETS
from recipe.plan import Inputs, build_plan, dumps, load_plan

runner = CliRunner()


def write_plan(path: Path, inputs: Inputs, fmt: str = "yaml") -> Path:
    m, hw, sol = solve_inputs(inputs, path.parent)
    path.write_text(dumps(build_plan(inputs, m, hw, sol), fmt))
    return path


def edit(path: Path, **blocks) -> None:
    """Overwrite fields of a YAML plan: edit(p, layout={"ep": 2, "edp": 1})."""
    data = yaml.safe_load(path.read_text())
    for block, fields in blocks.items():
        data[block].update(fields)
    path.write_text(yaml.safe_dump(data, sort_keys=False))


def tiny(tmp_path: Path, name: str = "tiny.yaml") -> Path:
    return write_plan(tmp_path / name, Inputs(model="tiny-moe", seq_len=1024, hw="cpu", gpus=2))


def q35_h100_128k(tmp_path: Path, name: str = "q35.yaml") -> Path:
    return write_plan(tmp_path / name, Inputs(model="qwen35-35b", seq_len=131072, hw="h100"))


def check(*args: str):
    return runner.invoke(app, ["check", *args])


def problem_lines(output: str, file: Path) -> list[str]:
    return [ln for ln in output.splitlines() if ln.startswith(f"{file}:")]


# ---- clean ---------------------------------------------------------------------------------------------------
def test_clean_plan_passes(tmp_path):
    p = tiny(tmp_path)
    r = check(str(p))
    assert r.exit_code == 0, r.output
    assert "1 plan checked: 1 ok" in r.output
    assert problem_lines(r.output, p) == []


def test_clean_json_plan_and_folder_recursion(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / ".hidden").mkdir()
    a = write_plan(tmp_path / "sub" / "b.json", Inputs(model="tiny-moe", seq_len=4096, hw="cpu", gpus=2), "json")
    b = tiny(tmp_path, "a.yml")
    (tmp_path / ".hidden" / "junk.yaml").write_text("not: a plan\n")
    (tmp_path / "notes.txt").write_text("ignored")
    files, missing = find_plans([tmp_path])
    assert files == [b, a] and missing == []  # sorted: a.yml before sub/b.json; hidden and .txt skipped
    r = check(str(tmp_path))
    assert r.exit_code == 0, r.output
    assert "2 plans checked: 2 ok" in r.output


def test_generated_plans_check_clean(tmp_path):
    written, skipped = generate(tmp_path)
    expected = {f"{m}_{hw}_{s}.yaml" for m in PRESETS if m != "tiny-moe" for hw in ("h100", "mi300x", "mi355x")
                for s in ("32k", "128k")} | {"tiny-cpu.yaml"}
    assert {p.name for p in written} | {n.split()[1].rstrip(":") for n in skipped} == expected
    tiny_plan = load_plan(tmp_path / "tiny-cpu.yaml")
    assert (tiny_plan.inputs.hw, tiny_plan.layout.world, tiny_plan.inputs.seq_len) == ("cpu", 2, 4096)
    assert (tiny_plan.layout.dp, tiny_plan.layout.ep, tiny_plan.inputs.pins) == (2, 2, {"ep": 2})
    results = check_paths([tmp_path])
    assert exit_code(results) == 0, [p for r in results for p in r.problems][:3]
    assert all(r.peak_gb <= r.usable_gb for r in results)


# ---- drift ---------------------------------------------------------------------------------------------------
def test_hand_edited_layout_is_drift_naming_field_and_values(tmp_path):
    p = tiny(tmp_path)
    edit(p, layout={"ep": 2, "edp": 1})
    r = check(str(p))
    assert r.exit_code == 1, r.output
    lines = problem_lines(r.output, p)
    assert any(re.search(r"layout\.ep: committed 2, solved 1 \[drift\]", ln) for ln in lines), r.output
    assert any("layout.edp: committed 1, solved 2" in ln for ln in lines)
    assert any("hand edit" in ln for ln in lines)
    assert "drift" in r.output.split("┃ peak")[-1]  # the table's status column


def test_changed_profile_is_named_as_the_cause(tmp_path):
    prof = tmp_path / "my_h100.yaml"
    shutil.copy(resources.files("hw_profiles") / "h100.yaml", prof)
    p = write_plan(tmp_path / "plan.yaml", Inputs(model="qwen35-35b", seq_len=131072, hw="my_h100.yaml"))
    assert check(str(p)).exit_code == 0  # the profile path resolves next to the plan, from any working directory
    data = yaml.safe_load(prof.read_text())
    data["hbm_gib"] = 96
    prof.write_text(yaml.safe_dump(data))
    r = check(str(p))
    assert r.exit_code == 1, r.output
    lines = problem_lines(r.output, p)
    assert any(ln.startswith(f"{p}: solver.hw_fingerprint: committed ") for ln in lines), r.output
    usable = [ln for ln in lines if "prediction.memory_gb.usable" in ln]
    assert usable and "the hardware profile 'my_h100.yaml' changed since the plan was solved" in usable[0]
    # usable GB = hbm_gib · 2**30 / 1e9 · 0.92: 79.6 GiB → 78.63, 96 GiB → 94.83
    assert "committed 78.63" in usable[0] and "solved 94.83" in usable[0]


def test_changed_model_shape_and_solver_version_are_named(tmp_path):
    p = tiny(tmp_path)
    edit(p, solver={"model_fingerprint": "0" * 16, "version": "0.0.1"}, layout={"ep": 2, "edp": 1})
    results = check_paths([p])
    probs = {q.field: q for q in results[0].problems}
    assert probs["solver.model_fingerprint"].committed == "0" * 16
    assert "solver.version" in probs
    cause = probs["layout.ep"].cause
    assert "the model shape 'tiny-moe' changed" in cause and "solver changed from version 0.0.1" in cause


def test_prediction_drift_is_reported_per_field(tmp_path):
    p = tiny(tmp_path)
    data = yaml.safe_load(p.read_text())
    data["prediction"]["step_time_s"] += 1.0
    p.write_text(yaml.safe_dump(data, sort_keys=False))
    (res,) = check_paths([p])
    assert [(q.field, q.kind) for q in res.problems] == [("prediction.step_time_s", "drift")]
    assert exit_code([res]) == 1


# ---- misfit and divisibility ---------------------------------------------------------------------------------
def test_misfit_when_committed_layout_does_not_fit(tmp_path):
    p = q35_h100_128k(tmp_path)
    lay = load_plan(p).layout
    assert lay.cp > 1
    edit(p, layout={"cp": 1, "dp": lay.dp * lay.cp})
    r = check(str(p))
    assert r.exit_code == 1, r.output
    (line,) = [ln for ln in problem_lines(r.output, p) if "[misfit]" in ln]
    assert "memory.peak_gb: committed" in line and "over the h100 profile's 78.6 GB usable" in line
    assert f"layout.cp: committed 1, solved {lay.cp} [drift]" in r.output
    (res,) = check_paths([p])
    assert res.status == "misfit" and res.peak_gb > res.usable_gb


def test_divisibility_violation_is_named(tmp_path):
    p = write_plan(tmp_path / "q122.yaml", Inputs(model="qwen35-122b", seq_len=131072, hw="h100", gpus=48))
    lay = load_plan(p).layout
    world = lay.world
    assert world % (3 * lay.pp * lay.etp) == 0
    edit(p, layout={"ep": 3, "edp": world // (3 * lay.pp * lay.etp)})
    r = check(str(p))
    assert r.exit_code == 1, r.output
    assert f"layout.ep: committed 3, solved {lay.ep} [misfit] — 256 experts of qwen35-122b are not divisible by " \
           f"ep=3" in r.output


def test_divisibility_rules_one_by_one():
    m = PRESETS["qwen35-35b"]  # 16/2 heads, 256 experts, 40 layers, vocab 248320, 16 linear-attention key heads

    def lay(**kw):
        return SimpleNamespace(**{"pp": 1, "tp": 1, "cp": 1, "ep": 1, **kw})

    assert divisibility(m, lay(), 131072) == []
    assert [f for f, _, _ in divisibility(m, lay(tp=4), 131072)] == ["tp"]  # KV heads: 2 % 4
    assert any("KV heads" in w for _, _, w in divisibility(m, lay(tp=4), 131072))
    assert any("attention heads" in w for _, _, w in divisibility(m, lay(tp=3), 131072))
    assert any("vocab" in w for _, _, w in divisibility(PRESETS["mixtral-8x7b"], lay(tp=3), 3 * 32768))
    assert [f for f, _, _ in divisibility(m, lay(ep=3), 131072)] == ["ep"]
    assert divisibility(m, lay(pp=3), 131072) == []  # 40 layers as 14 + 13 + 13, or as the split balances them
    assert [f for f, _, _ in divisibility(m, lay(pp=41), 131072)] == ["pp"]  # a stage with no layer
    assert any("sequence 131071 does not split into 2·cp=4" in w for _, _, w in divisibility(m, lay(cp=2), 131071))
    split = divisibility(m, lay(cp=2), 6)  # 6 tokens: divisible by cp=2, not into 2·cp=4 segments
    assert any("2·cp=4" in w for _, _, w in split)
    # Gated DeltaNet passes its exact state between segments: each must be whole 64-token chunks
    assert any("delta-rule chunks" in w for _, _, w in divisibility(m, lay(cp=2), 4 * 96))
    assert divisibility(m, lay(cp=2), 4 * 128) == []
    assert divisibility(m, lay(cp=32), 131072) == []  # no head limit on CP (16 key heads, cp=32 is fine)
    assert any("linear-attention key heads" in w for _, _, w in divisibility(m, lay(tp=32), 131072))


# ---- unusable input ------------------------------------------------------------------------------------------
def test_unknown_key_exits_2_in_one_line(tmp_path):
    p = tiny(tmp_path)
    p.write_text(p.read_text().replace("layout:\n", "layout:\n  colour: blue\n"))
    r = check(str(p))
    assert r.exit_code == 2, r.output
    assert problem_lines(r.output, p) == [f"{p}: [invalid] field layout.colour: unknown key"]
    assert "Traceback" not in r.output


def test_missing_path_exits_2_and_other_files_are_still_checked(tmp_path):
    good = tiny(tmp_path)
    drifted = tiny(tmp_path, "drifted.yaml")
    edit(drifted, layout={"ep": 2, "edp": 1})
    missing = tmp_path / "nope.yaml"
    r = check(str(missing), str(good), str(drifted))
    assert r.exit_code == 2, r.output  # the maximum severity
    assert problem_lines(r.output, missing) == [f"{missing}: [invalid] no such file or folder"]
    assert "3 plans checked: 1 ok, 1 drift, 1 invalid" in r.output


def test_empty_folder_is_unusable(tmp_path):
    r = check(str(tmp_path))
    assert r.exit_code == 2 and "no plan files" in r.output


def test_unknown_model_in_inputs_is_unusable(tmp_path):
    p = tiny(tmp_path)
    edit(p, inputs={"model": "tiny-moo"})
    r = check(str(p))
    assert r.exit_code == 2, r.output
    (line,) = problem_lines(r.output, p)
    assert "inputs: [invalid] unknown model 'tiny-moo'" in line and "tiny-moe" in line


# ---- --fix ---------------------------------------------------------------------------------------------------
def test_fix_rewrites_drifted_plans_and_never_touches_malformed_ones(tmp_path):
    drifted = q35_h100_128k(tmp_path, "a.yaml")
    clean_text = drifted.read_text()
    edit(drifted, layout={"cp": 1, "dp": 16})
    as_json = write_plan(tmp_path / "b.json", Inputs(model="tiny-moe", seq_len=1024, hw="cpu", gpus=2), "json")
    data = json.loads(as_json.read_text())
    data["layout"].update(ep=2, edp=1)
    as_json.write_text(json.dumps(data))
    bad = tmp_path / "c.yaml"
    bad.write_bytes(b"schema: 1\nlayout: {pp: 1, extra: [\n\xff")
    before = bad.read_bytes()
    r = check("--fix", str(tmp_path))
    assert r.exit_code == 2, r.output  # the malformed plan still fails
    assert f"fixed {drifted}" in r.output and f"fixed {as_json}" in r.output
    assert bad.read_bytes() == before
    assert drifted.read_text() == clean_text  # exactly what `recipe solve` writes
    assert json.loads(as_json.read_text())["layout"]["ep"] == 1
    assert not list(tmp_path.glob(".*.tmp"))
    r2 = check(str(drifted), str(as_json))
    assert r2.exit_code == 0, r2.output


def test_fix_on_clean_plans_writes_nothing(tmp_path):
    p = tiny(tmp_path)
    mtime = p.stat().st_mtime_ns
    r = check("--fix", str(p))
    assert r.exit_code == 0 and "fixed" not in r.output
    assert p.stat().st_mtime_ns == mtime


# ---- --format github -----------------------------------------------------------------------------------------
def test_github_annotations(tmp_path):
    p = tiny(tmp_path)
    edit(p, layout={"ep": 2, "edp": 1})
    bad = tmp_path / "z.yaml"
    bad.write_text("schema: 1\nbogus: 1\n")
    r = check("--format", "github", str(tmp_path))
    assert r.exit_code == 2, r.output
    ann = [ln for ln in r.output.splitlines() if ln.startswith("::")]
    ep_line = line_of(p.read_text(), "layout.ep")
    assert ep_line is not None and p.read_text().splitlines()[ep_line - 1].strip() == "ep: 2"
    assert (f"::error file={p},line={ep_line},title=recipe check%3A drift in layout.ep::layout.ep: committed 2, "
            f"solved 1 — ") in r.output
    assert any(a.startswith(f"::error file={bad},title=recipe check%3A invalid plan::") for a in ann)
    assert all(re.match(r"^::error file=[^,]+(,line=\d+)?,title=[^:]+::.+$", a) for a in ann), ann
    assert "┃" not in r.output  # no table in annotation mode
    assert r.output.splitlines()[-1] == "2 plans checked: 1 drift, 1 invalid"


def test_bad_format_option(tmp_path):
    r = check("--format", "xml", str(tiny(tmp_path)))
    assert r.exit_code == 2 and "--format must be" in r.output


def test_check_plan_returns_data(tmp_path):
    p = tiny(tmp_path)
    res = check_plan(p)
    assert res.status == "ok" and res.problems == [] and res.fresh is not None
    assert res.fresh.layout == res.plan.layout


def test_check_runs_without_the_cli():
    """recipe check's machinery and the CLI share the solve path (recipe/solving.py), not an import of each other."""
    import subprocess
    import sys

    code = ("import sys, recipe.check, recipe.gen_plans; "
            "assert 'recipe.cli' not in sys.modules, sorted(m for m in sys.modules if m.startswith('recipe'))")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_gen_plans_takes_no_option_for_a_folder(tmp_path, monkeypatch, capsys):
    """`python -m recipe.gen_plans --help` prints its usage and writes nothing (it once wrote 55 plans into a
    folder named --help); an unknown option exits 2."""
    from recipe.gen_plans import main

    monkeypatch.chdir(tmp_path)
    assert main(["--help"]) == 0 and main(["-x"]) == 2 and main([]) == 2
    assert list(tmp_path.iterdir()) == [] and "usage" in capsys.readouterr().err
