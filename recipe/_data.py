"""Plain-data conversion of pydantic models without building pydantic's serializer (start-up time matters:
`recipe solve` should answer in well under a second)."""

from __future__ import annotations

from pydantic import BaseModel


def plain(obj, exclude: frozenset[str] = frozenset()):
    if isinstance(obj, BaseModel):
        return {(f.alias or k): plain(getattr(obj, k)) for k, f in type(obj).model_fields.items() if k not in exclude}
    if isinstance(obj, dict):
        return {k: plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [plain(v) for v in obj]
    return obj
