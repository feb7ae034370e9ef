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

from recipe.cli import app, solve_inputs
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
