"""Text forms every command shares: a layout on one line, any message as exactly one bounded line."""

from __future__ import annotations

LAYOUT_KEYS = ("pp", "tp", "cp", "ep", "dp", "edp")


def layout_str(layout) -> str:
    """'PP=1 TP=1 CP=2 EP=8 DP=4 EDP=1' from a degrees mapping or a layout object (attributes pp … edp)."""
    get = layout.__getitem__ if isinstance(layout, dict) else lambda k: getattr(layout, k)
    return " ".join(f"{k.upper()}={get(k)}" for k in LAYOUT_KEYS)


def one_line(text, limit: int = 300) -> str:
    """Control characters escaped and length bounded, so that a message always prints as exactly one line."""
    s = "".join(c if c.isprintable() else repr(c)[1:-1] for c in str(text))
    return s if len(s) <= limit else s[: limit - 1] + "…"


def recompute_words(opts) -> str:
    """'full recompute' / 'no recompute' (never 'none recompute') / 'recompute, last 12 layers kept', with ', index
    selections kept' where DeepSeek sparse attention's recomputed forward reuses the forward's selections."""
    if opts.recompute == "none":
        return "no recompute"
    k = opts.keep_layers
    words = "full recompute" if not k else f"recompute, last {'layer' if k == 1 else f'{k} layers'} kept"
    return words + (", index selections kept" if getattr(opts, "keep_selections", False) else "")
