"""`recipe check`: does each committed plan still say what the solver says today, and does it still fit?

Plain functions returning data; the CLI (recipe/check_cli.py) renders it. For each plan:
  1. schema: valid, unknown keys rejected (`load_plan`);
  2. divisibility of the committed layout against today's model shape;
  3. fit: the committed layout re-estimated with today's cost model, peak ≤ the profile's usable memory;
  4. drift: the plan's inputs re-solved with today's profiles and solver — with the same pins (`inputs.pins`, the
     degrees `recipe solve --pp/--tp/--cp/--ep` fixed), so a pinned plan is compared with today's pinned solve, and
     `--fix` keeps its pins; layout, train, launch, prediction and the solver block (version, fingerprints) compared
     field by field. A changed profile, model shape or solver version is named as the cause of every drifted
     field; a layout degree that contradicts the plan's own pin is named as such.

Kinds: `invalid` (unusable input: exit 2), `drift` and `misfit` (exit 1). Pure Python: never imports torch.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from .plan import Plan, PlanError, build_plan, load_plan
from .solving import solve_inputs
from .text import layout_str, one_line

Kind = Literal["drift", "misfit", "invalid"]
SEVERITY = {"drift": 1, "misfit": 1, "invalid": 2}
PLAN_SUFFIXES = (".yaml", ".yml", ".json")
COMPARED = ("layout", "train", "launch", "prediction")  # blocks that must equal today's solve


@dataclass(frozen=True)
class Problem:
    file: str
    field: str  # dotted path in the plan ("layout.ep"), or "plan" / "path" for unusable input
    committed: object
    solved: object
    kind: Kind
    cause: str = ""


@dataclass
class PlanCheck:
    file: str
    plan: Plan | None = None
    fresh: Plan | None = None  # what the plan's inputs solve to today
    problems: list[Problem] = field(default_factory=list)
    peak_gb: float | None = None  # the committed layout, re-estimated with today's cost model
    usable_gb: float | None = None

    @property
    def severity(self) -> int:
        return max((SEVERITY[p.kind] for p in self.problems), default=0)

    @property
    def status(self) -> str:
        kinds = {p.kind for p in self.problems}
        for k in ("invalid", "misfit", "drift"):
            if k in kinds:
                return k
        return "ok"

    @property
    def fixable(self) -> bool:
        """A plan that loaded and re-solved, with drift or misfit: rewriting it with today's solve fixes it."""
        return self.plan is not None and self.fresh is not None and self.severity == 1


# ---- finding plans -------------------------------------------------------------------------------------------
def find_plans(paths: list[str | Path]) -> tuple[list[Path], list[Problem]]:
    """Files as given; folders → every *.yaml/*.yml/*.json inside, recursively, sorted (hidden paths skipped).
    A missing path, or a folder with no plan in it, is a problem of kind `invalid`."""
    files: list[Path] = []
    missing: list[Problem] = []
    for raw in paths:
        p = Path(raw)
        if p.is_dir():
            found = sorted(_plan_files(p))
            if not found:
                missing.append(Problem(str(p), "path", None, None, "invalid",
                                       f"no plan files (*.yaml, *.yml, *.json) under {p}"))
            files.extend(found)
        elif p.exists():
            files.append(p)
        else:
            missing.append(Problem(str(p), "path", None, None, "invalid", "no such file or folder"))
    seen: set[Path] = set()
    unique = [f for f in files if not (f.resolve() in seen or seen.add(f.resolve()))]
    return unique, missing


def _plan_files(folder: Path):
    """The plan files under a folder, not descending into hidden folders (.git, .venv: their files are never plans,
    and a virtual environment holds tens of thousands)."""
    for root, dirs, names in os.walk(folder):
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        for name in names:
            f = Path(root) / name
            if not name.startswith(".") and f.suffix in PLAN_SUFFIXES and f.is_file():
                yield f


# ---- one plan ------------------------------------------------------------------------------------------------
def check_plan(path: str | Path) -> PlanCheck:
    from .cost import Layout, estimate

    path = Path(path)
    res = PlanCheck(str(path))
    try:
        plan = load_plan(path)
    except PlanError as e:
        res.problems.append(Problem(res.file, "plan", None, None, "invalid", _strip_origin(str(e), res.file)))
        return res
    res.plan = plan
    base = path.parent
    try:
        m = plan.model_shape(base)
        hw = plan.hw_profile(base)
    except ValueError as e:
        res.problems.append(Problem(res.file, "inputs", None, None, "invalid", one_line(str(e))))
        return res
    lay = plan.layout

    # today's solve of the same inputs (done first: the divisibility lines show the solved value)
    try:
        fresh, solve_error = _resolve(plan, base)
    except ValueError as e:  # inputs no solve can use (e.g. a GPU count that fills no whole node)
        res.problems.append(Problem(res.file, "inputs", None, None, "invalid", one_line(str(e))))
        return res
    res.fresh = fresh
    solved_layout = fresh.layout if fresh is not None else None

    for name, committed, why in divisibility(m, lay, plan.train.micro_batch_tokens, plan.train.pp_stages):
        solved = getattr(solved_layout, name) if solved_layout is not None else None
        res.problems.append(Problem(res.file, f"layout.{name}", committed, solved, "misfit", why))

    try:
        est = estimate(m, hw, lay.world, Layout(pp=lay.pp, tp=lay.tp, cp=lay.cp, ep=lay.ep, etp=lay.etp),
                       plan.train_options())
        res.peak_gb, res.usable_gb = est.total_gb, hw.usable_gb
    except (ArithmeticError, ValueError) as e:
        res.problems.append(Problem(res.file, "layout", layout_str(lay), None, "misfit",
                                    f"today's cost model cannot estimate this layout ({type(e).__name__})"))
        est = None
    if est is not None and not est.fits:
        solved_peak = fresh.prediction.memory_gb.total if fresh is not None else None
        res.problems.append(Problem(
            res.file, "memory.peak_gb", round(est.total_gb, 1), solved_peak, "misfit",
            f"the committed layout ({layout_str(lay)}) peaks at {est.total_gb:.1f} GB with today's cost model, "
            f"{est.total_gb - hw.usable_gb:.1f} GB over the {hw.name} profile's {hw.usable_gb:.1f} GB usable"))

    if solve_error is not None:
        res.problems.append(Problem(res.file, "layout", layout_str(lay), "no layout fits", "drift",
                                    f"today's solver finds no layout for these inputs: {solve_error}"))
        return res
    res.problems.extend(drift(res.file, plan, fresh))
    return res


def _resolve(plan: Plan, base: Path) -> tuple[Plan | None, str | None]:
    from .solver import InfeasibleError

    try:
        m, hw, sol = solve_inputs(plan.inputs, base)
        return build_plan(plan.inputs, m, hw, sol), None
    except InfeasibleError as e:
        return None, one_line(str(e))


def divisibility(m, lay, seq: int, stages: list[int] | None = None) -> list[tuple[str, int, str]]:
    """(layout field, committed value, why) for each degree that does not divide what it splits; `stages` (the
    plan's train.pp_stages, layers per pipeline stage) must cover the model's layers."""
    out = []
    tp, cp = lay.tp, lay.cp
    out += [("tp", tp, f"{n} {what} of {m.name} are not divisible by tp={tp}") for n, what in m.tp_splits() if n % tp]
    if tp > 1 and m.tp_refusal:
        out.append(("tp", tp, f"{m.name} {m.tp_refusal} (tp=1)"))
    if m.num_experts % lay.ep:
        out.append(("ep", lay.ep, f"{m.num_experts} experts of {m.name} are not divisible by ep={lay.ep}"))
    if lay.pp > m.num_layers:
        out.append(("pp", lay.pp, f"{m.num_layers} layers of {m.name} cannot give each of pp={lay.pp} stages a "
                                  f"layer"))
    if stages is not None and sum(stages) != m.num_layers:
        out.append(("pp", lay.pp, f"train.pp_stages {list(stages)} holds {sum(stages)} layers but {m.name} has "
                                  f"{m.num_layers}"))
    from .solver import cp_violations

    out += [("cp", cp, why) for why in cp_violations(m, seq, cp)]
    return out


def drift(file: str, plan: Plan, fresh: Plan) -> list[Problem]:
    """One problem per field where the committed plan differs from today's solve of its inputs."""
    cause = drift_cause(plan, fresh)
    pins = plan.inputs.pins or {}
    old, new = plan.to_dict(), fresh.to_dict()
    out = []
    for key in ("version", "hw_fingerprint", "model_fingerprint"):
        a, b = old["solver"][key], new["solver"][key]
        if a != b:
            out.append(Problem(file, f"solver.{key}", a, b, "drift", _solver_cause(key, plan)))
    for block in COMPARED:
        a, b = _flatten(old[block], block), _flatten(new[block], block)
        for k in _ordered_keys(a, b):
            if a.get(k) != b.get(k):
                dim = k.removeprefix("layout.")
                why = cause
                if block == "layout" and dim in pins and a.get(k) != pins[dim]:
                    why = (f"the plan pins {dim}={pins[dim]} (inputs.pins) but its layout has {dim}={a.get(k)}: "
                           f"a hand edit")
                out.append(Problem(file, k, a.get(k), b.get(k), "drift", why))
    return out


def drift_cause(plan: Plan, fresh: Plan) -> str:
    """Why today's solve differs: the changed profile, model shape or solver version, else a hand edit."""
    causes = []
    if plan.solver.hw_fingerprint != fresh.solver.hw_fingerprint:
        causes.append(_solver_cause("hw_fingerprint", plan))
    if plan.solver.model_fingerprint != fresh.solver.model_fingerprint:
        causes.append(_solver_cause("model_fingerprint", plan))
    if plan.solver.version != fresh.solver.version:
        causes.append(_solver_cause("version", plan, fresh))
    if causes:
        return "; ".join(causes)
    return (f"profile, model shape and solver version {fresh.solver.version} unchanged: a hand edit, or a solver or "
            f"cost-model change without a version bump")


def _solver_cause(key: str, plan: Plan, fresh: Plan | None = None) -> str:
    if key == "hw_fingerprint":
        return f"the hardware profile {plan.inputs.hw!r} changed since the plan was solved"
    if key == "model_fingerprint":
        layers = f" at {plan.inputs.layers} layers" if plan.inputs.layers else ""
        return f"the model shape {plan.inputs.model!r}{layers} changed since the plan was solved"
    now = f" to {fresh.solver.version}" if fresh is not None else ""
    return f"the solver changed from version {plan.solver.version}{now}"


# ---- many plans, fixing --------------------------------------------------------------------------------------
def check_paths(paths: list[str | Path]) -> list[PlanCheck]:
    """Every plan under `paths`, in order; missing paths come back as checks with one `invalid` problem."""
    files, missing = find_plans(paths)
    out = [PlanCheck(p.file, problems=[p]) for p in missing]
    out.extend(check_plan(f) for f in files)
    return out


def exit_code(results: list[PlanCheck]) -> int:
    return max((r.severity for r in results), default=0)


def fix(result: PlanCheck) -> bool:
    """Rewrite a drifted or misfit plan with today's solve (atomically, same format). Never touches a plan that
    did not load or could not be re-solved. Returns whether it wrote."""
    from .plan import dumps, write_atomic

    if not result.fixable:
        return False
    path = Path(result.file)
    write_atomic(path, dumps(result.fresh, "json" if path.suffix.lower() == ".json" else "yaml"), flag="--fix")
    return True


# ---- helpers -------------------------------------------------------------------------------------------------
def _flatten(d: dict, prefix: str) -> dict[str, object]:
    out: dict[str, object] = {}
    for k, v in d.items():
        key = f"{prefix}.{k}"
        if isinstance(v, dict) and v:
            out.update(_flatten(v, key))
        else:
            out[key] = v
    return out


def _ordered_keys(a: dict, b: dict) -> list[str]:
    return list(a) + [k for k in b if k not in a]


def _strip_origin(msg: str, origin: str) -> str:
    if msg.startswith(origin + " is "):  # "plans/x is a FIFO (named pipe), not a plan file"
        return one_line("it" + msg[len(origin):])
    return one_line(msg[len(origin) + 2:] if msg.startswith(origin + ": ") else msg)


def format_value(v: object) -> str:
    if v is None:
        return "(absent)"
    if isinstance(v, str):
        return one_line(v, 120)
    return one_line(repr(v) if isinstance(v, float) else str(v), 120)


def problem_line(p: Problem) -> str:
    """`file: field: committed X, solved Y [kind] — cause`; unusable input: `file: [invalid] message`."""
    if p.kind == "invalid":
        where = f" {p.field}:" if p.field not in ("plan", "path") else ""
        return f"{one_line(p.file)}:{where} [invalid] {p.cause}"
    text = (f"{one_line(p.file)}: {p.field}: committed {format_value(p.committed)}, solved "
            f"{format_value(p.solved)} [{p.kind}]")
    return text + (f" — {p.cause}" if p.cause else "")


def line_of(text: str, dotted: str) -> int | None:
    """1-based line of a dotted field in a YAML or JSON plan (each key looked for after its parent's line)."""
    lines = text.splitlines()
    i = 0
    found = None
    for part in dotted.split("."):
        for j in range(i, len(lines)):
            s = lines[j].lstrip()
            if s.startswith((f"{part}:", f'"{part}":')):
                found, i = j + 1, j + 1
                break
        else:
            return found
    return found
