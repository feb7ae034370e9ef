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
    """Untrusted data → a record of `cls`, or ValueError naming the origin, the field and what is wrong."""
    from pydantic import TypeAdapter, ValidationError

    if not isinstance(data, dict):
        raise ValueError(f"{origin}: expected a mapping of fields, got {type(data).__name__}")
    try:
        return TypeAdapter(cls).validate_python(data)
    except ValidationError as e:
        err = e.errors()[0]
        loc = ".".join(str(x) for x in err.get("loc", ()))
        msg = "unknown field" if err.get("type") == "unexpected_keyword_argument" else err.get("msg", "invalid")
        msg = msg.removeprefix("Value error, ")
        raise ValueError(f"{origin}: field {loc!r}: {msg}" if loc else f"{origin}: {msg}") from None
