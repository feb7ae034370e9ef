"""The plan loader under hypothesis: random text, random YAML/JSON documents and mutated valid plans (dropped and
added keys, wrong types, huge and negative numbers, unicode, deep nesting). `parse_plan` raises nothing but
PlanError, whose message is one line; `recipe check` exits 2 with one line for the file and no traceback."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from recipe.cli import app
from recipe.solving import solve_inputs
from recipe.plan import Inputs, Plan, PlanError, build_plan, dumps, load_plan, parse_plan

FUZZ = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
CLI_FUZZ = settings(max_examples=40, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


def _valid_plan_dict() -> dict:
    inputs = Inputs(model="tiny-moe", seq_len=4096, hw="cpu", gpus=2)
    m, hw, sol = solve_inputs(inputs)
    return yaml.safe_load(dumps(build_plan(inputs, m, hw, sol)))


VALID = _valid_plan_dict()


def _paths(d, prefix=()):
    for k, v in d.items():
        yield prefix + (k,)
        if isinstance(v, dict):
            yield from _paths(v, prefix + (k,))


def _at(d, path):
    for k in path:
        d = d[k]
    return d


PATHS = list(_paths(VALID))
DICT_PATHS = [()] + [p for p in PATHS if isinstance(_at(VALID, p), dict)]  # where an unknown key can be added

huge_ints = st.sampled_from([10**30, -10**30, 2**63, -(2**63) - 1, 2**40 + 1, 10**4000, 0, -1])
scalars = st.one_of(
    st.none(), st.booleans(), st.integers(), huge_ints,
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=30),
    st.sampled_from(["", "1", "8", "2k", "全", "🙂", "a\nb", "\x00", "\u202e", "yes", "null", "1e400", "nan"]),
)
values = st.recursive(scalars, lambda c: st.one_of(st.lists(c, max_size=4),
                                                   st.dictionaries(st.text(max_size=8), c, max_size=4)),
                      max_leaves=12)


def _deep(depth: int, kind: str):
    v: object = 1
    for _ in range(depth):
        v = [v] if kind == "list" else {"a": v}
    return v


@st.composite
def mutated_plans(draw) -> dict:
    data = copy.deepcopy(VALID)
    for _ in range(draw(st.integers(1, 3))):
        op = draw(st.sampled_from(["drop", "add", "replace", "replace", "deep"]))
        path = draw(st.sampled_from(PATHS))
        parent = data
        try:
            for k in path[:-1]:
                parent = parent[k]
        except (KeyError, TypeError):
            continue
        if not isinstance(parent, dict):
            continue
        if op == "drop":
            parent.pop(path[-1], None)
        elif op == "add":
            target = data
            try:
                for k in draw(st.sampled_from(DICT_PATHS)):
                    target = target[k]
            except (KeyError, TypeError):
                continue
            if isinstance(target, dict):
                target[draw(st.text(min_size=1, max_size=12))] = draw(values)
        elif op == "replace":
            parent[path[-1]] = draw(values)
        else:
            parent[path[-1]] = _deep(draw(st.sampled_from([50, 5000])), draw(st.sampled_from(["list", "dict"])))
    return data


def _render(data, fmt: str) -> str:
    try:
        if fmt == "json":
            return json.dumps(data)
        return yaml.safe_dump(data, allow_unicode=True)
    except (RecursionError, ValueError, TypeError, OverflowError):
        assume(False)  # the generator itself cannot render it (e.g. a 5000-deep list in PyYAML)
        raise AssertionError  # unreachable


def _parses_or_plan_error(text: str):
    try:
        return parse_plan(text, "fuzz.yaml")
    except PlanError as e:
        msg = str(e)
        assert msg.startswith("fuzz.yaml") or msg.startswith("fuzz.yaml:"), msg
        assert "\n" not in msg and "\r" not in msg and len(msg) < 600, msg
        return None


# ---- parse_plan ----------------------------------------------------------------------------------------------
@FUZZ
@given(st.text(max_size=300))
def test_random_text(text):
    _parses_or_plan_error(text)


@FUZZ
@given(values, st.sampled_from(["yaml", "json"]))
def test_random_documents(doc, fmt):
    assert _parses_or_plan_error(_render(doc, fmt)) is None


@FUZZ
@given(mutated_plans(), st.sampled_from(["yaml", "json"]))
def test_mutated_valid_plans(data, fmt):
    plan = _parses_or_plan_error(_render(data, fmt))
    assert plan is None or isinstance(plan, Plan)


@FUZZ
@given(st.text(max_size=200), st.integers(0, 200))
def test_spliced_yaml(garbage, at):
    """Random text spliced into a valid plan's YAML (broken indentation, stray quotes, tabs, tags, anchors)."""
    text = dumps(Plan.model_validate(VALID))
    at = min(at * len(text) // 200, len(text))
    _parses_or_plan_error(text[:at] + garbage + text[at:])


@FUZZ
@given(st.binary(max_size=300))
def test_random_bytes_through_load_plan(tmp_path_factory, raw):
    p = tmp_path_factory.getbasetemp() / "fuzz_bytes.yaml"
    p.write_bytes(raw)
    try:
        load_plan(p)
    except PlanError as e:
        assert "\n" not in str(e)


@pytest.mark.parametrize("text", [
    "[" * 100_000 + "]" * 100_000,
    '{"a":' * 100_000 + "1" + "}" * 100_000,
    "a: &a [*a]\n",  # a recursive alias
    "schema: 1\ninputs: &x {model: *x}\n",
    "{schema: 1, solver: {version: 0.1.0}}",  # a YAML flow mapping is not JSON
    "\ufeffschema: 1\n",
    "!!python/object/apply:os.system ['true']\n",
    "schema: 2\n",
    "schema: " + "9" * 5000 + "\n",  # beyond int()'s digit limit
    '{"schema": 1, "a\\nb": 1}',  # a key with a newline: the error stays on one line
], ids=["deep-yaml", "deep-json", "recursive-alias", "recursive-inputs", "flow-yaml", "bom", "python-tag",
        "schema-2", "5000-digits", "newline-key"])
def test_hostile_documents(text):
    assert _parses_or_plan_error(text) is None


def test_unknown_key_is_reported_first_and_schema_version_named():
    data = copy.deepcopy(VALID)
    data["layout"]["colour"] = "blue"
    data["prediction"]["step_time_s"] = "slow"
    with pytest.raises(PlanError, match=r"^p: field layout\.colour: unknown key \(and 1 more\)$"):
        parse_plan(json.dumps(data), "p")
    data = copy.deepcopy(VALID)
    data["schema"] = 2
    with pytest.raises(PlanError, match="unsupported plan schema 2: this recipe reads schema 1"):
        parse_plan(yaml.safe_dump(data), "p")
    data = copy.deepcopy(VALID)
    data["prediction"]["step_time_s"] = float("inf")
    with pytest.raises(PlanError, match="prediction.step_time_s: Input should be a finite number"):
        parse_plan(json.dumps(data), "p")


# ---- the CLI: exit 2, one line, no traceback -----------------------------------------------------------------
runner = CliRunner()


@CLI_FUZZ
@given(st.one_of(mutated_plans().map(lambda d: ("doc", d)), st.text(max_size=200).map(lambda t: ("text", t))),
       st.sampled_from(["yaml", "json"]))
def test_cli_exits_2_in_one_line(tmp_path_factory, case, fmt):
    kind, payload = case
    text = payload if kind == "text" else _render(payload, fmt)
    try:
        parse_plan(text, "x")
        assume(False)  # still a valid plan: not what this test is about
    except PlanError:
        pass
    p = Path(tmp_path_factory.getbasetemp()) / f"fuzz_cli.{fmt}"
    p.write_text(text, encoding="utf-8", errors="surrogatepass")
    r = runner.invoke(app, ["check", str(p)])
    assert r.exit_code == 2, r.output
    assert r.exception is None or isinstance(r.exception, SystemExit), repr(r.exception)
    assert "Traceback" not in r.output
    lines = [ln for ln in r.output.splitlines() if ln.startswith(f"{p}:")]
    assert len(lines) == 1 and "[invalid]" in lines[0], r.output


# ---- the hardware-profile and model-config loaders -----------------------------------------------------------
# Mutated valid inputs: a loader returns a record or raises ValueError with one line naming the file; a record it
# returns never breaks the solver (no ZeroDivisionError from `bw_gb_s: 0`, no 1-GB HBM from `hbm_gib: true`).
LOADER_FUZZ = settings(max_examples=1000, deadline=None,
                       suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
PROFILE = yaml.safe_load((Path(__file__).resolve().parents[1] / "hw_profiles" / "h200.yaml").read_text())
HF_CONFIG = {
    "model_type": "qwen3_5_moe_text", "hidden_size": 64, "num_hidden_layers": 4, "vocab_size": 512,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "rms_norm_eps": 1e-6,
    "max_position_embeddings": 65536, "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32, "norm_topk_prob": True, "linear_num_key_heads": 2,
    "linear_num_value_heads": 4, "linear_key_head_dim": 16, "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4,
    "attn_output_gate": True, "rope_parameters": {"rope_theta": 10000000, "partial_rotary_factor": 0.25},
    "full_attention_interval": 4, "mtp_num_hidden_layers": 1,
    "layer_types": ["linear_attention"] * 3 + ["full_attention"],
}
numbers = st.one_of(st.integers(-3, 100), st.floats(allow_nan=True, allow_infinity=True), st.booleans(), st.none(),
                    huge_ints, st.sampled_from(["8", "1e3", "", "inf", [1], {"a": 1}, 0, 0.0, -0.0, 1e-300, 2.5]))


@st.composite
def mutated(draw, base: dict) -> dict:
    data = copy.deepcopy(base)
    paths = list(_paths(data))
    for _ in range(draw(st.integers(1, 3))):
        path = draw(st.sampled_from(paths))
        parent = data
        try:
            for k in path[:-1]:
                parent = parent[k]
        except (KeyError, TypeError):
            continue
        if not isinstance(parent, dict):
            continue
        op = draw(st.sampled_from(["number", "number", "number", "value", "drop", "add"]))
        if op == "drop":
            parent.pop(path[-1], None)
        elif op == "add":
            parent[draw(st.text(min_size=1, max_size=10))] = draw(values)
        else:
            parent[path[-1]] = draw(numbers if op == "number" else values)
    return data


def _one_line_value_error(fn, origin: str):
    try:
        return fn()
    except ValueError as e:
        msg = str(e)
        assert "\n" not in msg and origin in msg, msg
        return None


@LOADER_FUZZ
@given(mutated(PROFILE))
def test_profile_loader_fuzz(tmp_path_factory, data):
    from recipe.cost import Layout, TrainOptions, estimate
    from recipe.hw import _parse
    from recipe.solver import InfeasibleError, solve

    text = _render(data, "yaml")
    prof = _one_line_value_error(lambda: _parse(text, "fuzz_hw.yaml"), "fuzz_hw.yaml")
    if prof is None:
        return
    for v in (prof.peak_bf16_tflops, prof.hbm_gib, prof.hbm_bw_tb_s, prof.intra_node.bw_gb_s,
              prof.inter_node_bw_gb_s, prof.usable_memory_fraction, prof.compute_efficiency):
        assert not isinstance(v, bool) and v > 0 and v == v and v != float("inf")
    from recipe.models import PRESETS

    m = PRESETS["tiny-moe"]
    world = min(prof.gpus_per_node, 8)
    estimate(m, prof, world, Layout(), TrainOptions(micro_batch_tokens=4096))
    try:
        solve(m, prof, world, TrainOptions(micro_batch_tokens=4096))
    except InfeasibleError:
        pass


@LOADER_FUZZ
@given(mutated(HF_CONFIG), st.booleans())
def test_model_config_loader_fuzz(tmp_path_factory, data, nest):
    from recipe.cost import TrainOptions
    from recipe.hw import load_profile
    from recipe.models import from_hf_config, param_counts
    from recipe.solver import InfeasibleError, solve

    if nest:  # a multimodal config: the text part under text_config
        data = {"model_type": "qwen3_5_moe", "text_config": data}
    p = Path(tmp_path_factory.getbasetemp()) / "fuzz_model" / "config.json"
    p.parent.mkdir(exist_ok=True)
    try:
        p.write_text(json.dumps(data))
    except (ValueError, TypeError, RecursionError):
        assume(False)
    m = _one_line_value_error(lambda: from_hf_config(p), str(p))
    if m is None:
        return
    assert all(isinstance(v, int) and not isinstance(v, bool) for v in (m.num_layers, m.hidden_size, m.num_experts))
    param_counts(m)
    if m.hidden_size * m.num_layers * m.num_experts * m.expert_ffn < 10**12:  # the solver on shapes it can hold
        try:
            solve(m, load_profile("h100"), 8, TrainOptions(micro_batch_tokens=4096))
        except InfeasibleError:
            pass


# ---- the CLI's argument parser: random argv ------------------------------------------------------------------
# Commands, options and values, right and wrong, in any order: exit 0, 1 or 2; a failure is exactly one `error:`
# line on stderr; never a traceback, never an internal error (exit 3). 10,000 cases: the parser and the option
# checks answer in well under a millisecond, and the values keep the solves that do run small.
ARGV_FUZZ = settings(max_examples=10_000, deadline=None, database=None,
                     suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
COMMANDS = ["solve", "solve", "solve", "sweep", "compare", "models", "hw", "check", "version", "solv", "", "--help"]
INTS = ["1", "2", "8", "0", "-1", "-3", "100000", "1000000000000", "x", "1e3", "1.5", "", " 2", "٣", "4096", "4097",
        "64", "3", "7", "16", "-0", "0x10", "+2"]
JUNK = ["", " ", "-", "--", "\x00", "\n", "é", "🙂", "\u202e", "=", "--model=tiny-moe", "-o-", "-gx", "%s", "{}",
        "'", '"', "\\", "{dir}/..", "{dir}/", "~", "$HOME", "*", "a" * 300]  # path-like junk stays in tmp_path:
# `check /` would walk (and `--fix` rewrite plans across) the whole file system
OPTION_VALUES = {
    "--model": ["tiny-moe"] * 6 + ["qwen35-35b", "nope", "", "{cfg}", "{dir}", "/dev/null", "{missing}/config.json"],
    "--seq": ["4k", "4k", "1k", "96", "0", "-1", "12x", "1.5k", "0.1k", "9" * 30, "9" * 400, "", " 8K ", "1m"] + JUNK,
    "--hw": ["cpu", "cpu", "h100", "mi300x", "h1OO", "", "cpu,h100", ",", "{prof}", "/dev/null", "{dir}",
             "{bad_prof}"],
    "--gpus": INTS, "-g": INTS, "--layers": INTS, "--micro-batches": INTS, "--ep-chunks": INTS, "--top": INTS,
    "--pp": INTS, "--tp": INTS, "--cp": INTS, "--ep": INTS,
    "--micro-batch-tokens": ["4k", "8k", "1k", "x", "0"],
    "--recompute": ["full", "none", "some", ""],
    "--lm-head": ["fused", "lean", "naive", "x"],
    "-o": ["-", "{tmp}/out.yaml", "{tmp}/out.json", "{tmp}/out.txt", "{dir}", "/dev/null", "{missing}/x.yaml", "",
           "{prof}", "{cfg}"],
    "--format": ["yaml", "json", "text", "github", "xml", ""],
    "-f": ["yaml", "json", "text"],
    "--plot": ["{dir}", "/dev/null", "{tmp}/x.txt", "{missing}/x.png"],
}
OPTIONS = sorted(OPTION_VALUES)
FLAGS = ["--explain", "--fix", "--bogus", "-x", "--"]
POSITIONAL = ["{plan}", "{bad_plan}", "{missing}", "/dev/null", "{dir}", "qwen35-35b", "h100", "tiny-moe", "nope", ""]


def random_argv(seed: int) -> list[str]:
    """One argv from a seed (hypothesis draws the seed: one draw per case keeps 10,000 cases fast, and a failure
    prints the seed that reproduces it)."""
    import random

    rnd = random.Random(seed)
    argv = [rnd.choice(COMMANDS)]
    for _ in range(rnd.randint(0, 8)):
        kind = rnd.choice(["opt"] * 6 + ["flag", "pos", "junk"])
        if kind == "opt":
            opt = rnd.choice(OPTIONS)
            argv.append(opt)
            if rnd.randrange(20):  # now and then an option without its value
                values = OPTION_VALUES[opt]
                argv.append(str(rnd.randint(-5, 5000)) if values is INTS and rnd.random() < 0.3 else rnd.choice(values))
        elif kind == "flag":
            argv.append(rnd.choice(FLAGS))
        elif kind == "pos":
            argv.append(rnd.choice(POSITIONAL))
        else:
            argv.append(rnd.choice(JUNK) if rnd.random() < 0.7 else "".join(
                chr(rnd.choice([rnd.randint(32, 126), rnd.randint(0, 0x2FFF)])) for _ in range(rnd.randint(1, 6))))
    if argv[0] in ("solve", "sweep", "compare") and rnd.randrange(4):  # mostly a complete command
        for opt, default in (("--model", "tiny-moe"), ("--seq", "4k"), ("--hw", "cpu"), ("--gpus", "2")):
            if opt not in argv and (opt != "--gpus" or argv[0] == "sweep" or rnd.random() < 0.5):
                argv += [opt, default]
    return argv


def test_random_argv_never_tracebacks(tmp_path, monkeypatch):
    import contextlib
    import io

    import typer.main

    from recipe.cli import app as recipe_app

    monkeypatch.chdir(tmp_path)  # whatever a random -o names lands here
    (tmp_path / "dir").mkdir()
    cfg = tmp_path / "m" / "config.json"
    cfg.parent.mkdir()
    cfg.write_text(json.dumps(HF_CONFIG))
    prof = tmp_path / "prof.yaml"
    prof.write_text(yaml.safe_dump(PROFILE))
    bad_prof = tmp_path / "bad_prof.yaml"
    bad_prof.write_text(yaml.safe_dump({**PROFILE, "intra_node": {**PROFILE["intra_node"], "bw_gb_s": 0}}))
    plan = tmp_path / "plan.yaml"
    plan.write_text((Path(__file__).resolve().parents[1] / "plans" / "tiny-cpu.yaml").read_text())
    bad_plan = tmp_path / "bad_plan.yaml"
    bad_plan.write_text(plan.read_text().replace("seq_len: 4096", "seq_len: true"))
    subst = {"{cfg}": str(cfg), "{dir}": str(tmp_path / "dir"), "{prof}": str(prof), "{bad_prof}": str(bad_prof),
             "{plan}": str(plan), "{bad_plan}": str(bad_plan), "{missing}": str(tmp_path / "missing"),
             "{tmp}": str(tmp_path)}
    inputs = {p: p.read_bytes() for p in (cfg, prof, bad_prof, plan, bad_plan)}
    cmd = typer.main.get_command(recipe_app)
    seen = {0: 0, 1: 0, 2: 0}

    @ARGV_FUZZ
    @given(st.integers(0, 2**64))
    def go(seed):
        argv = random_argv(seed)
        argv = [next((a.replace(k, v) for k, v in subst.items() if k in a), a) for a in argv]
        read = {Path(v) for k, v in zip(argv, argv[1:]) if k in ("--model", "--hw")} & set(inputs)
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = cmd.main(argv, prog_name="recipe", standalone_mode=False)
        for p, b in inputs.items():
            if p.read_bytes() != b:
                assert p not in read, (argv, f"{p} was an input and was written over")
                p.write_bytes(b)  # a legitimate -o onto a file this command did not read: put it back
        e = err.getvalue()
        assert code in (0, 1, 2), (argv, code, e)
        assert "Traceback" not in e and "Traceback" not in out.getvalue(), (argv, e)
        lines = [ln for ln in e.splitlines() if ln.strip()]
        if code and argv[0] != "check":  # check reports per-plan problems on stdout
            errors = [ln for ln in lines if ln.startswith("error: ")]
            assert len(errors) == 1 or (argv[0] in ("", "--help") and not errors), (argv, e)
        seen[code] += 1

    go()
    assert seen[0] > 500 and seen[1] and seen[2] > 500, seen  # commands that ran, answered no, and refused
