"""Records: frozen dataclasses for the shapes the solver works on (model shapes, hardware profiles, options).

`recipe solve` must answer in well under a second on a 2-core laptop, and importing pydantic alone costs about a
third of that. So the hot path works on plain frozen dataclasses, whose own `__post_init__` checks the cross-field
rules, and pydantic validates them — field types, constraints, unknown keys — only where untrusted data comes in
(a user's profile YAML or config.json, a committed plan), imported at that moment.
"""

from __future__ import annotations

from dataclasses import fields, is_dataclass, replace


class Record:
    """Mixin for frozen dataclasses, with the two pydantic-style helpers the codebase uses."""

    __pydantic_config__ = {"extra": "forbid"}  # read by pydantic when it validates this dataclass

    def model_copy(self, update: dict | None = None):
        return replace(self, **(update or {}))  # re-runs __post_init__: the copy is checked too

    def model_dump(self, exclude: set | frozenset | None = None, mode: str | None = None) -> dict:
        return {f.name: plain(getattr(self, f.name)) for f in fields(self) if not exclude or f.name not in exclude}


def plain(obj, exclude: frozenset[str] = frozenset()):
    """A record, pydantic model or container as plain data (lists for tuples), without pydantic's serializer."""
    if is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: plain(getattr(obj, f.name)) for f in fields(obj) if f.name not in exclude}
    model_fields = getattr(type(obj), "model_fields", None)
    if isinstance(model_fields, dict):  # a pydantic model
        return {(f.alias or k): plain(getattr(obj, k)) for k, f in model_fields.items() if k not in exclude}
    if isinstance(obj, dict):
        return {k: plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [plain(v) for v in obj]
    return obj


def validate(cls, data, origin: str):
    """Untrusted data → a record of `cls`, or ValueError naming the origin, the field and what is wrong. Types are
    strict: a boolean is not a number, a string is not a number, a fraction is not a count (pydantic alone would read
    `hbm_gb: true` as 1.0 and `"8"` as 8)."""
    from pydantic import ValidationError

    if not isinstance(data, dict):
        raise ValueError(f"{origin}: expected a mapping of fields, got {type(data).__name__}")
    bad = strict_problem(cls, data)
    if bad is not None:
        loc, msg = bad
        raise ValueError(f"{origin}: field {loc!r}: {msg}" if loc else f"{origin}: {msg}")
    try:
        return _adapter(cls).validate_python(data)
    except ValidationError as e:
        errs = e.errors()
        # a union (a number or a mapping) reports each branch: keep the one of the input's own kind
        err = next((x for x in errs if not (x.get("type") == "dict_type" or (
            x.get("type") in ("float_type", "int_type") and isinstance(x.get("input"), dict)))), errs[0])
        branch = lambda x: str(x) in ("float", "int") or str(x).startswith("dict[")  # noqa: E731 - a union's tag
        loc = ".".join(str(x) for x in err.get("loc", ()) if not branch(x))
        msg = "unknown field" if err.get("type") == "unexpected_keyword_argument" else err.get("msg", "invalid")
        msg = msg.removeprefix("Value error, ")
        raise ValueError(f"{origin}: field {loc!r}: {msg}" if loc else f"{origin}: {msg}") from None
    except (RecursionError, OverflowError, TypeError) as e:  # pathological input pydantic cannot digest
        raise ValueError(f"{origin}: unusable data ({type(e).__name__})") from None


_HINTS: dict[type, dict] = {}
_ADAPTERS: dict[type, object] = {}


def _adapter(cls):
    """One pydantic TypeAdapter per record class (building one costs milliseconds)."""
    if cls not in _ADAPTERS:
        from pydantic import TypeAdapter

        _ADAPTERS[cls] = TypeAdapter(cls)
    return _ADAPTERS[cls]


def _hints(cls) -> dict:
    if cls not in _HINTS:
        import sys
        import typing

        _HINTS[cls] = typing.get_type_hints(cls, vars(sys.modules[cls.__module__]))
    return _HINTS[cls]


def _shown(v) -> str:
    s = {True: "true", False: "false", None: "null"}[v] if v is None or isinstance(v, bool) else repr(v)
    return s if len(s) <= 40 else s[:39] + "…"


def strict_problem(cls, data: dict, prefix: str = "") -> tuple[str, str] | None:
    """(dotted field, what is wrong) for the first value of `data` whose type is not strictly the field's; None when
    every value is. Ranges and cross-field rules are left to the record's own checks."""
    hints = _hints(cls)
    for name, value in data.items():
        if name not in hints:
            continue  # an unknown key: pydantic names it
        bad = _type_problem(hints[name], value, f"{prefix}{name}")
        if bad is not None:
            return bad
    return None


def _type_problem(tp, value, loc: str) -> tuple[str, str] | None:
    import math
    import types
    import typing

    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        arms = [a for a in args if a is not type(None)]
        return _type_problem(arms[0], value, loc) if len(arms) == 1 else None
    if tp is bool:
        return None if isinstance(value, bool) else (loc, f"expected true or false, got {_shown(value)}")
    if tp in (int, float):
        whole = tp is int
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return loc, f"expected a {'whole number' if whole else 'number'}, got {_shown(value)}"
        if isinstance(value, float) and not math.isfinite(value):
            return loc, f"expected a finite {'whole number' if whole else 'number'}, got {_shown(value)}"
        if whole and isinstance(value, float) and not value.is_integer():
            return loc, f"expected a whole number, got {_shown(value)}"
        if abs(value) >= 2**62:
            return loc, f"{_shown(value)} is out of range"
        return None
    if origin is typing.Literal:
        if isinstance(value, bool) and not any(isinstance(a, bool) for a in args):
            return loc, f"expected one of {', '.join(map(str, args))}, got {_shown(value)}"
        return None
    if origin in (tuple, list) and isinstance(value, (list, tuple)):
        inner = args[0] if args else None
        for i, v in enumerate(value):
            bad = _type_problem(inner, v, f"{loc}.{i}") if inner is not None else None
            if bad is not None:
                return bad
        return None
    if origin is dict and isinstance(value, dict) and len(args) == 2:
        for k, v in value.items():
            bad = _type_problem(args[1], v, f"{loc}.{k}")
            if bad is not None:
                return bad
        return None
    if isinstance(tp, type) and is_dataclass(tp) and isinstance(value, dict):
        return strict_problem(tp, value, f"{loc}.")
    return None
