"""Issue 17: the CLI never destroys a file and never answers bad input with a traceback.

Each case asserts one line on stderr, the exit code (README.md's rule: 1 the answer is no, 2 unusable input), and
that no file was damaged: inputs keep their content and mode, a symlink's target is replaced atomically with its
mode kept, devices and directories are refused. Then the outputs people read: compare with a part that does not
fit, the --plot figure, tables at the terminal's width, the --explain legend, JSON for scripts, a closed pipe."""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import subprocess
import sys
import time
from importlib import resources
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from recipe.cli import app
from recipe.plan import load_plan, parse_plan

ROOT = Path(__file__).resolve().parents[1]
runner = CliRunner()
TINY = ["--model", "tiny-moe", "--seq", "4k", "--hw", "cpu", "--gpus", "1"]
SOLVE = ["solve", *TINY]


def run(*args: str, **kw):
    return runner.invoke(app, list(args), **kw)


def one_line(result, code: int, *needles: str) -> str:
    """Exactly one `error:` line on stderr, this exit code, no traceback."""
    assert result.exit_code == code, (result.exit_code, result.output)
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    err = result.stderr.strip()
    assert "Traceback" not in result.output
    assert len(err.splitlines()) == 1 and err.startswith("error: "), err
    for n in needles:
        assert n in err, err
    return err


def snapshot(*paths: Path) -> dict:
    """Content, mode, kind and inode of each path (not following a symlink at the path itself)."""
    out = {}
    for p in paths:
        st = os.lstat(p)
        data = p.read_bytes() if stat.S_ISREG(st.st_mode) else os.readlink(p) if stat.S_ISLNK(st.st_mode) else None
        out[p] = (stat.S_IFMT(st.st_mode), stat.S_IMODE(st.st_mode), st.st_ino, data)
    return out


def no_temporaries(folder: Path) -> None:
    assert not [p.name for p in folder.iterdir() if p.name.endswith(".tmp")]


# ---- files are sacred: -o ----------------------------------------------------------------------------------------
def test_o_dev_null_is_refused_and_the_device_stays(tmp_path):
    before = os.stat("/dev/null")
    one_line(run(*SOLVE, "-o", "/dev/null"), 2, "-o /dev/null is a character device, not a regular file")
    after = os.stat("/dev/null")
    assert stat.S_ISCHR(after.st_mode) and (after.st_ino, after.st_rdev) == (before.st_ino, before.st_rdev)
    link = tmp_path / "out.yaml"
    link.symlink_to("/dev/null")  # a symlink to a device: refused too, the link left as it was
    snap = snapshot(link)
    one_line(run(*SOLVE, "-o", str(link)), 2, "a symlink to /dev/null", "is a character device")
    assert snapshot(link) == snap and stat.S_ISCHR(os.stat("/dev/null").st_mode)


def test_o_fifo_and_directory_are_refused(tmp_path):
    fifo = tmp_path / "fifo.yaml"
    os.mkfifo(fifo)
    one_line(run(*SOLVE, "-o", str(fifo)), 2, "is a FIFO (named pipe), not a regular file")
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)
    d = tmp_path / "plans"
    d.mkdir()
    (d / "keep.txt").write_text("x")
    one_line(run(*SOLVE, "-o", str(d)), 2, f"-o {d} is a directory")
    assert [p.name for p in d.iterdir()] == ["keep.txt"]
    no_temporaries(tmp_path)


def test_o_symlink_replaces_its_target_atomically_keeping_the_mode(tmp_path):
    real = tmp_path / "store" / "plan.yaml"
    real.parent.mkdir()
    real.write_text("old\n")
    os.chmod(real, 0o640)
    inode = real.stat().st_ino
    link = tmp_path / "plan.yaml"
    link.symlink_to(Path("store") / "plan.yaml")
    r = run(*SOLVE, "-o", str(link))
    assert r.exit_code == 0, r.output
    assert link.is_symlink() and os.readlink(link) == str(Path("store") / "plan.yaml")  # still the same link
    assert load_plan(real).inputs.model == "tiny-moe"  # its target holds the plan
    assert stat.S_IMODE(real.stat().st_mode) == 0o640  # with the target's mode
    assert real.stat().st_ino != inode  # replaced by a rename, not rewritten in place
    no_temporaries(real.parent)
    no_temporaries(tmp_path)


def test_o_new_file_gets_the_umask_mode_and_an_existing_one_keeps_its_mode(tmp_path):
    old = os.umask(0o027)
    try:
        new = tmp_path / "new.yaml"
        assert run(*SOLVE, "-o", str(new)).exit_code == 0
        assert stat.S_IMODE(new.stat().st_mode) == 0o640
    finally:
        os.umask(old)
    ex = tmp_path / "existing.yaml"
    ex.write_text("x")
    os.chmod(ex, 0o604)
    assert run(*SOLVE, "-o", str(ex)).exit_code == 0
    assert stat.S_IMODE(ex.stat().st_mode) == 0o604 and load_plan(ex).layout.world == 1


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0, reason="root may write a read-only file")
def test_o_read_only_file_is_refused(tmp_path):
    ro = tmp_path / "ro.yaml"
    ro.write_text("keep\n")
    os.chmod(ro, 0o444)
    one_line(run(*SOLVE, "-o", str(ro)), 2, "is read-only")
    assert ro.read_text() == "keep\n"


def test_o_onto_an_input_is_refused(tmp_path):
    cfg_dir = tmp_path / "c"
    cfg_dir.mkdir()
    cfg = cfg_dir / "config.json"
    cfg.write_text(json.dumps(_tiny_hf_config()))
    prof = tmp_path / "my.yaml"
    shutil.copy(resources.files("hw_profiles") / "cpu.yaml", prof)
    os.chmod(prof, 0o600)
    alias = tmp_path / "alias.yaml"
    alias.symlink_to(prof)
    hard = tmp_path / "hard.yaml"
    os.link(prof, hard)
    snap = snapshot(cfg, prof, alias, hard)
    seq = ["--seq", "4k", "--gpus", "1"]
    one_line(run("solve", "--model", str(cfg), "--hw", "cpu", *seq, "-o", str(cfg)), 2,
             f"-o {cfg} is the --model input")
    one_line(run("solve", "--model", str(cfg_dir), "--hw", "cpu", *seq, "-o", str(cfg)), 2, "is the --model input")
    one_line(run("solve", "--model", "tiny-moe", "--hw", str(prof), *seq, "-o", str(prof)), 2,
             f"-o {prof} is the --hw input")
    for other in (alias, hard):  # the same file under another name
        one_line(run("solve", "--model", "tiny-moe", "--hw", str(prof), *seq, "-o", str(other)), 2, "--hw input")
    assert snapshot(cfg, prof, alias, hard) == snap
    assert run("solve", "--model", str(cfg), "--hw", str(prof), *seq, "-o", str(tmp_path / "p.yaml")).exit_code == 0


def _tiny_hf_config() -> dict:
    return {"model_type": "qwen3_moe", "hidden_size": 64, "num_hidden_layers": 2, "vocab_size": 512,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "num_experts": 8,
            "num_experts_per_tok": 2, "moe_intermediate_size": 32, "max_position_embeddings": 4096}


def test_missing_folder_is_named_as_written(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    err = one_line(run(*SOLVE, "-o", "nodir/x.yaml"), 2, "-o nodir/x.yaml: folder nodir does not exist")
    assert ".tmp" not in err
    (tmp_path / "afile").write_text("x")
    one_line(run(*SOLVE, "-o", "afile/x.yaml"), 2, "-o afile/x.yaml")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile"]


def test_bad_o_fails_before_the_solve(tmp_path, monkeypatch):
    """A refused -o costs no solve (deepseek-v3 at 1m on CPUs would take a second to find that nothing fits)."""
    import recipe.cli

    def no_solve(*a, **k):
        raise AssertionError("solved before checking -o")

    monkeypatch.setattr(recipe.cli, "solve_inputs", no_solve)
    one_line(run("solve", "--model", "deepseek-v3", "--seq", "1m", "--hw", "cpu", "-o", str(tmp_path)), 2,
             "is a directory")


# ---- formats -----------------------------------------------------------------------------------------------------
def test_format_follows_the_extension(tmp_path):
    for name, fmt in (("p.json", "json"), ("p.yml", "yaml"), ("p.YAML", "yaml"), ("p.plan", "yaml")):
        out = tmp_path / name
        r = run(*SOLVE, "-o", str(out))
        assert r.exit_code == 0, r.output
        text = out.read_text()
        if fmt == "json":
            assert json.loads(text)["schema"] == 1
        else:
            assert text.startswith("# recipe plan:")
        assert parse_plan(text).layout.world == 1
    assert run(*SOLVE, "--format", "json", "-o", str(tmp_path / "q.json")).exit_code == 0
    one_line(run(*SOLVE, "--format", "yaml", "-o", str(tmp_path / "r.json")), 2, "--format yaml contradicts -o")
    one_line(run(*SOLVE, "--format", "json", "-o", str(tmp_path / "r.yaml")), 2, "contradicts")
    assert not (tmp_path / "r.json").exists() and not (tmp_path / "r.yaml").exists()


def test_format_json_without_o_prints_the_plan():
    r = run(*SOLVE, "--format", "json")
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)  # only the plan: `recipe solve … --format json | jq .layout` works
    assert data["layout"]["pp"] == 1 and parse_plan(r.stdout).inputs.model == "tiny-moe"
    r = run(*SOLVE, "--format", "yaml")
    assert r.exit_code == 0 and yaml.safe_load(r.stdout)["schema"] == 1
    one_line(run(*SOLVE, "--format", "json", "--explain"), 2, "--explain")
    one_line(run(*SOLVE, "-o", "-", "--explain"), 2, "--explain")


def test_every_table_command_has_json(tmp_path):
    def js(*args):
        r = run(*args, "--format", "json")
        assert r.exit_code == 0, r.output
        return json.loads(r.stdout)

    sw = js("sweep", "--model", "tiny-moe", "--seq", "4k", "--hw", "cpu", "--gpus", "8", "--top", "3")
    assert len(sw["points"]) == 3 and 1 <= sw["solver_rank"] <= sw["grid_points"]
    assert set(sw["points"][0]) >= {"rank", "layout", "peak_gb", "fits", "step_time_s", "vs_best"}
    cmp_ = js("compare", "--model", "qwen35-35b", "--seq", "128k", "--hw", "h100,mi300x", "--gpus", "8")
    h100, mi300x = cmp_["profiles"]
    assert h100 == {"hw": "h100", "usable_gb": h100["usable_gb"], "fits": False,
                    "does_not_fit": "does not fit on 8 (needs 16)"}
    assert mi300x["fits"] and mi300x["gpus"] == 8 and "recompute" in mi300x["techniques"]
    assert {m["name"] for m in js("models")} >= {"qwen35-35b", "tiny-moe"}
    one = js("models", "qwen35-35b")
    assert one["params_by_group"]["routed_experts"] == 32_212_254_720
    assert {p["name"] for p in js("hw")} >= {"h100", "mi300x", "cpu"}
    assert js("hw", "mi300x")["sources"]["hbm_gib"]
    r = run("check", "--format", "json", str(ROOT / "plans" / "tiny-cpu.yaml"))
    assert r.exit_code == 0, r.output
    chk = json.loads(r.stdout)
    assert chk["counts"]["ok"] == 1 and chk["plans"][0]["status"] == "ok" and chk["exit_code"] == 0
    for args in (["hw"], ["models"], ["sweep", *TINY]):
        one_line(run(*args, "--format", "xml"), 2, "--format must be 'text' or 'json'")


# ---- compare --plot ----------------------------------------------------------------------------------------------
def test_plot_says_what_it_wrote_and_refuses_a_directory(tmp_path):
    pytest.importorskip("matplotlib")
    cmp_ = ["compare", "--model", "tiny-moe", "--seq", "4k", "--hw", "cpu", "--gpus", "1"]
    d = tmp_path / "figs"
    d.mkdir()
    one_line(run(*cmp_, "--plot", str(d)), 2, f"--plot {d} is a directory")
    assert list(d.iterdir()) == []
    r = run(*cmp_, "--plot", str(tmp_path / "mem"))
    assert r.exit_code == 0, r.output
    assert f"wrote {tmp_path / 'mem.png'}" in r.stdout
    assert (tmp_path / "mem.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and not (tmp_path / "mem").exists()
    r = run(*cmp_, "--plot", str(tmp_path / "mem.svg"))
    assert r.exit_code == 0 and (tmp_path / "mem.svg").read_text().lstrip().startswith("<?xml")
    one_line(run(*cmp_, "--plot", str(tmp_path / "mem.txt")), 2, ".png, .svg, .pdf")
    one_line(run(*cmp_, "--plot", "/dev/null"), 2, "character device")
    no_temporaries(tmp_path)


def test_plot_figure_reads():
    """Sequence axis labelled 8k…256k, the requested length marked, layout changes annotated, the legend off the
    data, the titles inside the figure."""
    pytest.importorskip("matplotlib")
    from recipe.compare import memory_figure
    from recipe.hw import load_profile
    from recipe.models import PRESETS

    fig = memory_figure(PRESETS["qwen35-35b"], [load_profile("mi300x"), load_profile("mi355x")], [8, 4],
                        seq_len=131072)
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    axes = fig.axes
    for ax in axes:
        assert [t.get_text() for t in ax.get_xticklabels()] == ["8k", "16k", "32k", "64k", "128k", "256k"]
        assert any(list(line.get_xdata()) == [131072, 131072] and line.get_linestyle() == ":" for line in ax.lines)
        notes = [t.get_text() for t in ax.texts]
        # where the solver's layout changes with length: cp=1 at the short ones, then another layout (on 8 MI300X a
        # larger cp by 256k; on 4 MI355X another ep)
        assert notes[0].startswith("cp=1 ") and len(notes) >= 2 and notes[-1] != notes[0], notes
        if ax is axes[0]:
            assert notes[-1] == "cp=2 ep=1", notes
        title = ax.title.get_window_extent(renderer)
        assert title.x0 >= 0 and title.x1 <= fig.bbox.x1 and title.y1 <= fig.bbox.y1
    legend = fig.legends[0].get_window_extent(renderer)
    assert not any(legend.overlaps(ax.get_window_extent(renderer)) for ax in axes)
    assert "requested 128k" in [t.get_text() for t in fig.legends[0].get_texts()]
    import matplotlib.pyplot as plt

    plt.close(fig)


# ---- validation: profiles, model configs, plans --------------------------------------------------------------------
@pytest.mark.parametrize("edit, needles", [
    (("intra_node", "bw_gb_s", 0), ["bw_gb_s must be a finite number of at least 1e-06, got 0"]),
    # a subnormal peak made every step time infinite and the EP rule's comparison of them fail
    (("peak_bf16_tflops", 5e-324), ["peak_bf16_tflops must be a finite number of at least 1e-06, got 5e-324"]),
    (("peak_bf16_tflops", float("inf")), ["field 'peak_bf16_tflops': expected a finite number, got inf"]),
    (("hbm_gib", True), ["field 'hbm_gib': expected a number, got true"]),
    (("hbm_gib", "80"), ["field 'hbm_gib': expected a number, got '80'"]),
    (("num_sms", 132.5), ["field 'num_sms': expected a whole number, got 132.5"]),
    (("warp_size", True), ["field 'warp_size'"]),
    (("overhead_gb", -1), ["overhead_gb must be a finite non-negative number"]),
    (("overhead_gb", float("nan")), ["field 'overhead_gb': expected a finite number"]),
    (("usable_memory_fraction", 1.5), ["usable_memory_fraction must be at most 1"]),
    (("inter_node_bw_gb_s", 0), ["inter_node_bw_gb_s must be a finite number of at least 1e-06"]),
    (("efficiency", "attention", 0), ["attention must be a finite number of at least 1e-06, got 0"]),
    (("efficiency", "ep_latency_ms", -0.5), ["efficiency.ep_latency_ms must be a finite number of milliseconds, "
                                             "at least 0, got -0.5"]),
    (("efficiency", "expert_rows", 1.5), ["efficiency.expert_rows must be at most 1, got 1.5"]),
    # attention: one figure or one per head width; a union's error names the branch of the input's kind
    (("efficiency", "attention", {128: 1.5}), ["efficiency.attention[128] must be a number in [1e-06, 1], got 1.5"]),
    (("efficiency", "attention", {}), ["efficiency.attention by head width needs positive whole widths"]),
    (("efficiency", "attention", "fast"), ["field 'efficiency.attention': Input should be a valid number"]),
    (("efficiency", "attention", {"wide": 0.4}), ["field 'efficiency.attention.wide.[key]': Input should be a valid "
                                                  "integer"]),
    # a field whose name starts like a union's tag ("int…") keeps its place in the path
    (("intra_node", "extra_thing", 1), ["field 'intra_node.extra_thing': unknown field"]),
    (("efficiency", "expert_weights", 0), ["expert_weights must be a finite number of at least 1e-06, got 0"]),
], ids=lambda x: str(x[0]) if isinstance(x, tuple) else None)
def test_bad_profile_figures_are_named(tmp_path, edit, needles):
    data = yaml.safe_load((resources.files("hw_profiles") / "h200.yaml").read_text())
    *where, key, value = edit
    target = data
    for k in where:
        target = target[k]
    target[key] = value
    prof = tmp_path / "bad.yaml"
    prof.write_text(yaml.safe_dump(data))
    snap = snapshot(prof)
    one_line(run("solve", "--model", "tiny-moe", "--seq", "4k", "--hw", str(prof), "--gpus", "1"), 2, "bad.yaml",
             *needles)
    assert snapshot(prof) == snap


@pytest.mark.parametrize("edit, needles", [
    ({"efficiency_from": "h900"}, ["efficiency_from: 'h900' is not a built-in profile (b200, cpu, h100, h200"]),
    ({"efficiency_from": "cpu"}, ["efficiency_from: cpu has no efficiencies measured on its own grid"]),
    ({"efficiency_from": "mi300x"}, ["efficiency_from: mi300x has no efficiencies measured on its own grid"]),
    ({"efficiency_from": 7}, ["efficiency_from: 7 is not a built-in profile"]),
    ({"efficiency_from": "h200", "efficiency": {"expert_gemm": 0.5}}, ["efficiency_from and efficiency are both "
                                                                        "given"]),
    ({"efficiency_from": "h200", "compute_efficiency": "fast"}, ["compute_efficiency must be a number in (0, 1], "
                                                                  "got 'fast'"]),
], ids=["unknown", "cpu", "derived", "number", "both", "bad-scale"])
def test_a_bad_efficiency_reference_is_named(tmp_path, edit, needles):
    """A profile that takes another's efficiencies names a built-in profile measured on its own grid, and gives no
    efficiencies of its own; anything else is one line naming the field, the file left as it was."""
    data = yaml.safe_load((resources.files("hw_profiles") / "mi300x.yaml").read_text())
    data.update(edit)
    prof = tmp_path / "bad.yaml"
    prof.write_text(yaml.safe_dump(data))
    snap = snapshot(prof)
    one_line(run("solve", "--model", "tiny-moe", "--seq", "4k", "--hw", str(prof), "--gpus", "1"), 2, "bad.yaml",
             *needles)
    assert snapshot(prof) == snap


def test_a_user_profile_takes_a_measured_profiles_efficiencies(tmp_path):
    """A user's copy of mi300x with its compute_efficiency raised times the step as the built-in profile does with
    every share of the dense peak scaled by the ratio of the two compute_efficiencies, and the rest unchanged."""
    from recipe.hw import load_profile

    data = yaml.safe_load((resources.files("hw_profiles") / "mi300x.yaml").read_text())
    data["compute_efficiency"] = 0.385
    prof = tmp_path / "tuned.yaml"
    prof.write_text(yaml.safe_dump(data))
    mine, h200 = load_profile(str(prof)), load_profile("h200")
    assert mine.efficiency == h200.efficiency  # the same compute_efficiency as the reference: its figures as they are
    assert load_profile("mi300x").efficiency.dense_gemm == pytest.approx(h200.efficiency.dense_gemm * 0.32 / 0.385)
    assert run("solve", "--model", "tiny-moe", "--seq", "4k", "--hw", str(prof), "--gpus", "1").exit_code == 0


def test_a_fixed_time_of_zero_is_a_valid_profile_figure(tmp_path):
    """A per-pass fixed time the calibration fit leaves at zero (no measurable cost) is a figure like any other: the
    profile loads and solves; its efficiencies, which divide, must stay at least 1e-6."""
    data = yaml.safe_load((resources.files("hw_profiles") / "h200.yaml").read_text())
    data["efficiency"].update(ep_latency_ms=0, layer_latency_ms=0.0, ep_chunk_ms=0)
    prof = tmp_path / "zero.yaml"
    prof.write_text(yaml.safe_dump(data))
    assert run("solve", "--model", "tiny-moe", "--seq", "4k", "--hw", str(prof), "--gpus", "1").exit_code == 0


def test_a_profile_without_the_expert_byte_terms_charges_the_experts_flops_alone(tmp_path):
    """A profile written before expert_rows and expert_weights existed loads: its routed experts cost their FLOPs at
    expert_gemm and nothing more."""
    from recipe.cost import Layout, TrainOptions, estimate
    from recipe.hw import load_profile
    from recipe.models import PRESETS

    data = yaml.safe_load((resources.files("hw_profiles") / "h200.yaml").read_text())
    del data["efficiency"]["expert_rows"], data["efficiency"]["expert_weights"]
    prof = tmp_path / "old.yaml"
    prof.write_text(yaml.safe_dump(data))
    e = estimate(PRESETS["qwen35-35b"].with_layers(2), load_profile(str(prof)), 1, Layout(),
                 TrainOptions(micro_batch_tokens=8192))
    assert e.compute_s["expert_rows"] == e.compute_s["expert_weights"] == 0 < e.compute_s["expert_gemm"]
    assert run("solve", "--model", "tiny-moe", "--seq", "4k", "--hw", str(prof), "--gpus", "1").exit_code == 0


@pytest.mark.parametrize("over, needle", [
    ({"num_hidden_layers": 48.7}, "field 'num_hidden_layers': expected a whole number, got 48.7"),
    ({"num_hidden_layers": True}, "field 'num_hidden_layers': expected a whole number, got true"),
    ({"num_hidden_layers": "2"}, "field 'num_hidden_layers': expected a whole number, got '2'"),
    ({"max_position_embeddings": None}, "field 'max_position_embeddings': expected a whole number, got null"),
    ({"text_config": "abc"}, "field 'text_config': expected an object, got 'abc'"),
    ({"rope_parameters": 3}, "field 'rope_parameters': expected an object, got 3"),
    ({"rms_norm_eps": True}, "field 'rms_norm_eps': expected a finite number, got true"),
    ({"norm_topk_prob": "yes"}, "field 'norm_topk_prob': expected true or false, got 'yes'"),
    ({"layer_types": "full_attention"}, "field 'layer_types': expected a list of layer type names"),
    ({"model_type": ["qwen3_moe"]}, "model_type ['qwen3_moe'] is not supported"),
])
def test_bad_model_config_fields_are_named(tmp_path, over, needle):
    cfg = tmp_path / "m" / "config.json"
    cfg.parent.mkdir()
    cfg.write_text(json.dumps({**_tiny_hf_config(), **over}))
    one_line(run("solve", "--model", str(cfg), "--seq", "4k", "--hw", "cpu", "--gpus", "1"), 2, needle)
    ok = _tiny_hf_config() | {"num_hidden_layers": 2.0}  # a whole number written as a float is still a count
    cfg.write_text(json.dumps(ok))
    assert run("models", str(cfg)).exit_code == 0


def _tiny_plan_text() -> str:
    return (ROOT / "plans" / "tiny-cpu.yaml").read_text()


@pytest.mark.parametrize("old, new, needle", [
    ("seq_len: 4096", "seq_len: true", "field inputs.seq_len: Input should be a valid integer, got true"),
    ("seq_len: 4096", "seq_len: 4096.5", "inputs.seq_len"),
    ("seq_len: 4096", "seq_len: '4096'", "inputs.seq_len"),
    ("gpus: 2", "gpus: 2.0", "inputs.gpus"),
    ("schema: 1", "schema: true", "unsupported plan schema true"),
    ("micro_batches: 1\n  optimizer", "micro_batches: false\n  optimizer", "train.micro_batches"),
])
def test_plan_types_are_strict_and_fix_never_touches_them(tmp_path, old, new, needle):
    text = _tiny_plan_text()
    assert old in text
    p = tmp_path / "p.yaml"
    p.write_text(text.replace(old, new, 1))
    snap = snapshot(p)
    for args in (["check", str(p)], ["check", "--fix", str(p)]):
        r = run(*args)
        assert r.exit_code == 2, r.output
        (line,) = [ln for ln in r.output.splitlines() if ln.startswith(f"{p}:")]
        assert "[invalid]" in line and needle in line, line
    assert snapshot(p) == snap


def test_huge_and_special_plan_files_are_refused_at_once(tmp_path):
    big = tmp_path / "big.yaml"
    big.write_text(_tiny_plan_text() + "# " + "x" * (16 << 20) + "\n")
    t = time.perf_counter()
    r = run("check", str(big), str(ROOT / "plans" / "tiny-cpu.yaml"))
    assert time.perf_counter() - t < 5
    assert r.exit_code == 2
    assert any("more than a plan file can be" in ln for ln in r.output.splitlines() if ln.startswith(str(big)))
    fifo = tmp_path / "fifo.yaml"
    os.mkfifo(fifo)
    r = run("check", str(fifo), "/dev/zero")  # would block, would stream forever: refused unread
    assert r.exit_code == 2 and "FIFO" in r.output and "character device" in r.output
    for flag, spec in (("--model", "/dev/zero"), ("--hw", "/dev/zero"), ("--model", str(fifo))):
        args = {"--model": "tiny-moe", "--hw": "cpu"} | {flag: spec}
        one_line(run("solve", "--model", args["--model"], "--hw", args["--hw"], "--seq", "4k"), 2, spec)


def test_fix_follows_a_symlinked_plan_and_keeps_its_mode(tmp_path):
    store = tmp_path / "store"
    store.mkdir()
    real = store / "tiny.yaml"
    data = yaml.safe_load(_tiny_plan_text())
    data["layout"].update(ep=1, edp=2)  # a hand edit against the plan's pin: drift, fixable
    real.write_text(yaml.safe_dump(data, sort_keys=False))
    os.chmod(real, 0o640)
    link = tmp_path / "plans" / "tiny.yaml"
    link.parent.mkdir()
    link.symlink_to(real)
    r = run("check", "--fix", str(link))
    assert r.exit_code == 0, r.output
    assert link.is_symlink() and os.readlink(link) == str(real)
    assert real.read_text() == _tiny_plan_text() and stat.S_IMODE(real.stat().st_mode) == 0o640
    no_temporaries(store)


# ---- bounds and exit codes ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("args, needle", [
    (["solve", *TINY, "--ep-chunks", "1000000000000"], "--ep-chunks must be between 1 and 4,096"),
    (["solve", *TINY, "--micro-batches", "10000000"], "--micro-batches must be between 1 and 1,000,000"),
    (["solve", *TINY, "--gpus", "100000"], "--gpus must be between 1 and 4,096, got 100,000"),
    (["solve", *TINY, "--layers", "1000000"], "--layers must be between 1 and 100,000"),
    (["solve", *TINY, "--ep", "5000"], "--ep must be between 1 and 4,096"),
    (["solve", *TINY, "--seq", "9" * 400], "is out of range"),
    (["sweep", *TINY, "--top", "-3"], "--top must be positive, got -3"),
    (["sweep", *TINY, "--top", "0"], "--top must be positive"),
    (["solve", *TINY, "--gpus", "1e3"], "'1e3' is not a valid int"),
    (["solve", *TINY, "--bogus"], "No such option: --bogus"),
    (["solve", "--model", "tiny-moe"], "Missing option"),
    (["solver"], "No such command 'solver'"),
    (["compare", "--model", "tiny-moe", "--seq", "4k", "--hw", ","], "--hw needs at least one profile"),
])
def test_out_of_range_and_malformed_options_exit_2(args, needle):
    one_line(run(*args), 2, needle)


EXIT_CASES = [  # (exit code, argv): README.md's rule, one code for one kind of answer, across commands
    (0, ["solve", *TINY]),
    (0, ["hw", "cpu"]),
    (0, ["check", str(ROOT / "plans" / "tiny-cpu.yaml")]),
    (1, ["solve", "--model", "deepseek-v3", "--seq", "1m", "--gpus", "8", "--hw", "h100"]),  # no layout fits
    (1, ["solve", "--model", "qwen35-35b", "--seq", "128k", "--hw", "h100", "--gpus", "7"]),  # none divides 7
    (1, ["compare", "--model", "deepseek-v3", "--seq", "1m", "--gpus", "8", "--hw", "h100,mi300x"]),
    (2, ["solve", "--model", "qwen35-35b", "--seq", "128k", "--hw", "h100", "--gpus", "100000"]),  # out of range
    (2, ["solve", "--model", "nope", "--seq", "4k", "--hw", "cpu"]),
    (2, ["solve", *TINY, "--gpus", "x"]),
    (2, ["check", "/no/such/plan.yaml"]),
    (2, ["hw", "nope"]),
]


@pytest.mark.parametrize("code, args", EXIT_CASES)
def test_one_rule_for_exit_codes(code, args):
    readme = " ".join((ROOT / "README.md").read_text().split())
    for rule in ("**0** done", "**1** the input is well-formed and the answer is no", "**2** unusable input",
                 "--gpus 100000", "**3** a bug", "**130** interrupted"):
        assert rule in readme, rule
    r = run(*args)
    assert r.exit_code == code, r.output
    assert "Traceback" not in r.output
    if code and args[0] != "check":  # check reports each plan's problems on stdout, one line each
        assert len(r.stderr.strip().splitlines()) == 1


def test_compare_shows_a_part_that_does_not_fit_in_its_column():
    r = run("compare", "--model", "qwen35-35b", "--seq", "128k", "--gpus", "8", "--hw", "h100,mi300x,mi355x")
    assert r.exit_code == 0, r.output
    gpus = next(ln for ln in r.stdout.splitlines() if "GPUs" in ln)
    assert "does not fit on 8 (needs 16)" in gpus and gpus.count(" 8 ") >= 2
    layout = next(ln for ln in r.stdout.splitlines() if "layout" in ln)
    assert layout.count("PP=1") == 2 and "—" in layout


def test_unexpected_errors_are_one_line_exit_3(monkeypatch):
    import recipe.summary

    monkeypatch.setattr(recipe.summary, "summary_text", lambda *a: 1 / 0)
    one_line(run(*SOLVE), 3, "internal error (ZeroDivisionError", "RECIPE_TRACEBACK=1")
    monkeypatch.setenv("RECIPE_TRACEBACK", "1")
    assert isinstance(run(*SOLVE).exception, ZeroDivisionError)


# ---- output people read ------------------------------------------------------------------------------------------
def test_tables_take_the_terminal_width(monkeypatch):
    monkeypatch.delenv("COLUMNS", raising=False)
    r = run("hw", env={"COLUMNS": "100"})  # a terminal of 100 columns (rich reads its width from COLUMNS too)
    assert r.exit_code == 0
    assert max(len(ln) for ln in r.stdout.splitlines()) <= 100
    r = run("hw")  # into a pipe, no width to adapt to: 160 columns, one row per line
    assert r.exit_code == 0 and 100 < max(len(ln) for ln in r.stdout.splitlines()) <= 160


def test_explain_reads_without_colour():
    from recipe.report import GLYPHS

    r = run("solve", "--model", "qwen35-35b", "--seq", "128k", "--hw", "mi300x", "--explain", env={"NO_COLOR": "1"})
    assert r.exit_code == 0, r.output
    out = r.stdout
    assert len(set(GLYPHS.values())) == len(GLYPHS)  # one glyph per component
    legend = next(ln for ln in out.splitlines() if "weights" in ln and "overhead" in ln)
    for k, g in GLYPHS.items():
        assert f"{g}{g} {k}" in legend
    bar = next(ln for ln in out.splitlines() if "| " in ln and "GB" in ln)
    assert set(bar.split("|")[0]) <= set(GLYPHS.values()) | {"·"}
    lm_row = next(ln for ln in out.splitlines() if ln.lstrip().startswith("= lm_head"))
    assert "0.00" in lm_row and "beyond a layer's working set" in lm_row  # the 0.00 says why
    assert "adds only what it needs beyond that: 0.00 GB" in out.replace("\n", " ")


def test_no_recompute_reads_as_english():
    r = run(*SOLVE, "--recompute", "none")
    assert r.exit_code == 0 and "(no recompute, fused LM head" in r.stdout and "none recompute" not in r.stdout
    r = run(*SOLVE, "--recompute", "none", "--explain")
    assert "(no recompute, fused LM head" in r.stdout and "none recompute" not in r.stdout


def test_shell_completion_is_on(monkeypatch):
    """--install-completion and --show-completion exist and give the bash script. Typer detects the user's shell
    from the process tree, which a test runner's tree need not show: the detection is pinned to bash here."""
    import typer.completion

    assert "--install-completion" in run("--help").stdout
    monkeypatch.setattr(typer.completion, "_get_shell_name", lambda: "bash")
    r = run("--show-completion", prog_name="recipe")
    assert r.exit_code == 0 and "_RECIPE_COMPLETE=complete_bash" in r.stdout, (r.output, r.exception)


def test_every_reference_resolves():
    """`recipe hw NAME` cites only files this repository has; docs/check.md pins nothing that does not exist."""
    for prof in resources.files("hw_profiles").iterdir():
        if prof.name.endswith(".yaml"):
            for ref in re.findall(r"[\w./-]+\.md\b", prof.read_text()):
                assert (ROOT / ref).is_file(), f"{prof.name} cites {ref}"
    for py in (ROOT / "recipe").glob("*.py"):
        for ref in re.findall(r"\b(?:docs/)?[A-Z][\w-]*\.md\b", py.read_text()):
            assert (ROOT / ref).is_file() or (ROOT / "docs" / ref).is_file(), f"{py.name} cites {ref}"
    tags = subprocess.run(["git", "tag"], cwd=ROOT, capture_output=True, text=True).stdout.split()
    check_md = (ROOT / "docs" / "check.md").read_text()
    assert "rev: <commit sha>" in check_md  # pre-commit pins recipe by commit
    for tag in re.findall(r"(?:rev: |/recipe@)(v\d[\w.]*)", check_md):
        assert tag in tags, f"docs/check.md pins {tag}, which is not a tag of this repository"


def test_make_test_prints_the_summary_line():
    """The Makefile's pytest flags, with pyproject's addopts: one -q, so the "N passed" line stays in CI logs."""
    line = next(ln for ln in (ROOT / "Makefile").read_text().splitlines() if "-m pytest" in ln)
    flags = line.split("-m pytest", 1)[1].split()[:-1]  # the flags before the test path
    p = subprocess.run([sys.executable, "-m", "pytest", *flags, "-p", "no:cacheprovider",
                        "tests/test_cli_safety.py::test_every_reference_resolves"], cwd=ROOT, capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    assert re.search(r"^1 passed in [\d.]+s", p.stdout, re.M), p.stdout


# ---- a closed pipe ---------------------------------------------------------------------------------------------
def _recipe_argv() -> list[str]:
    exe = shutil.which("recipe", path=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    return [exe] if exe else [sys.executable, "-m", "recipe"]


@pytest.mark.parametrize("args, code", [
    (["solve", *TINY, "-o", "x.yaml"], 0),
    (["hw"], 0),
    (["solve", "--model", "qwen35-35b", "--seq", "128k", "--hw", "mi300x", "--explain"], 0),
    (["check", str(ROOT / "plans")], 0),
    (["solve", "--model", "deepseek-v3", "--seq", "1m", "--gpus", "8", "--hw", "h100"], 1),
])
def test_a_reader_that_leaves_early_ends_quietly(tmp_path, args, code):
    """`recipe … | head -1`: no "Broken pipe" line, the command's own exit code, the plan file still written."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    p = subprocess.Popen(_recipe_argv() + args, cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE)
    p.stdout.close()  # the reader is gone before the first line
    err = p.stderr.read().decode()
    assert p.wait(timeout=120) == code, err
    assert "Broken pipe" not in err and "Traceback" not in err and "Exception ignored" not in err
    # the one line of an error; an `assumed`-figures warning (profiles without a calibration grid) may precede it
    lines = [line for line in err.strip().splitlines() if not line.startswith("warning: ")]
    assert len(lines) == (1 if code else 0), err
    if "-o" in args:
        assert load_plan(tmp_path / "x.yaml").inputs.model == "tiny-moe"
    shell = subprocess.run(["bash", "-c", 'set -o pipefail; "$@" | head -1 >/dev/null', "_", *_recipe_argv(), *args],
                           cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert shell.returncode == code and "Broken pipe" not in shell.stderr, shell.stderr


# ---- recipe launch's own file: --emit slurm --------------------------------------------------------------------
def test_emit_slurm_never_writes_through_an_existing_path(tmp_path):
    plan = str(ROOT / "plans" / "tiny-cpu.yaml")
    victim = tmp_path / "victim.txt"
    victim.write_text("keep\n")
    dangling, through, folder = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    for d in (dangling, through, folder):
        d.mkdir()
    (dangling / "launch.sbatch").symlink_to(tmp_path / "nowhere" / "x")
    (through / "launch.sbatch").symlink_to(victim)
    (folder / "launch.sbatch").mkdir()
    snap = snapshot(victim, dangling / "launch.sbatch", through / "launch.sbatch")
    for out in (dangling, through, folder):
        one_line(run("launch", plan, "--emit", "slurm", "--out", str(out)), 2, "launch.sbatch already exists",
                 "nothing is overwritten")
    one_line(run("launch", plan, "--emit", "slurm", "--out", str(victim)), 2, "the run needs a folder")
    assert snapshot(victim, dangling / "launch.sbatch", through / "launch.sbatch") == snap
    assert not (tmp_path / "nowhere").exists()
    r = run("launch", plan, "--emit", "slurm", "--out", str(tmp_path / "run"))
    assert r.exit_code == 0, r.output
    assert (tmp_path / "run" / "launch.sbatch").read_text().startswith("#!")
