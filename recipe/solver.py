"""The solver: TP, EP and CP each from its one binding constraint, PP a final tie-break, DP and expert-DP what
remains. Each `solve_*` returns a `Decision`: the value, the constraint that decided it, the numbers behind it and
the alternative it rejected with its figure. The rules are derived in docs/solver.md. `pins` ("what if") fix
any of pp, tp, cp, ep: a pinned dimension's only candidate is its pin and the others are solved around it.

Pure Python: never imports torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .cost import Estimate, Layout, TrainOptions, tokens_per_s_bound, with_default_chunks
from .margin import Margin, estimate_with_margin as estimate, margin_of
from .cost import BF16, BYTES_UNSHARDED, GB, gpus_per_node_used, layer_params, stage_layers
from .hw import HwProfile
from .models import ModelShape, param_counts

MAX_WORLD = 4096
PP_TIE_BREAK = 0.03  # a deeper pipeline (or wider TP, or larger CP for a cheaper EP) must be this much faster per token
# Without --gpus, the count taken is the smallest from the smallest that fits up to twice it whose GPU-hours a token
# are at most this many times the cheapest count's in that range
COUNT_GAIN = 1.5


class InfeasibleError(ValueError):
    """No layout fits; the message names the binding constraint and by how much. `miss`: (world, layout, estimate)
    of the nearest miss when memory decided it, else None."""

    miss: tuple | None = None


@dataclass
class Decision:
    value: int | str  # a degree or a count; "full" / "none" for recompute
    constraint: str
    reason: str
    numbers: dict = field(default_factory=dict)
    rejected: str = ""


@dataclass
class Solution:
    world: int
    layout: Layout
    opts: TrainOptions
    estimate: Estimate
    decisions: dict[str, Decision]
    pins: dict[str, int] = field(default_factory=dict)  # the degrees the user fixed (`--pp/--tp/--cp/--ep`)
    count: Decision | None = None  # why this GPU count, when the solver chose it (no --gpus)
    recompute: Decision | None = None  # why this recompute mode, when the solver chose it (--recompute auto)

    @property
    def margin(self) -> Margin:
        return margin_of(self.estimate)

    @property
    def degrees(self) -> dict[str, int]:
        return self.layout.degrees(self.world)



def _margin_gb(est: Estimate) -> float:
    mg = margin_of(est)
    return mg.total_gb if mg is not None else 0.0


def _over(est: Estimate, usable_gb: float) -> str:
    """'X GB + margin M > Y' with as many decimals as it takes for X + M and Y to differ (172.84 > 172.80 is not
    '172.8 > 172.8')."""
    peak, mg = est.total_gb, _margin_gb(est)
    for digits in (1, 2, 3):
        a, b = f"{peak + mg:.{digits}f}", f"{usable_gb:.{digits}f}"
        if a != b:
            return f"{peak:.{digits}f} GB + margin {mg:.{digits}f} > {b}"
    return f"{peak:.4f} GB + margin {mg:.4f} > {usable_gb:.4f}"


def _short_gb(est: Estimate, hw: HwProfile) -> float:
    """How far a layout is from fitting: peak + margin − usable (GB)."""
    return est.total_gb + _margin_gb(est) - hw.usable_gb


def _peak_of(est: Estimate, hw: HwProfile) -> str:
    """'peak 64.8 GB + margin 11.3 of 78.6 GB usable'."""
    return f"peak {est.total_gb:.1f} GB + margin {_margin_gb(est):.1f} of {hw.usable_gb:.1f} GB usable"

def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


# ---- candidate values (divisibility) -------------------------------------------------------------------------
def tp_candidates(m: ModelShape, hw: HwProfile, ranks: int) -> list[int]:
    """TP splits heads, KV heads, linear-attention heads and the vocab (an embedding tied to the LM head is not
    split: tp = 1); it stays inside a node. The divisors of `ranks` that break none of the tp rules a pin is held to
    (pin_violations: the sequence does not enter them)."""
    return [t for t in divisors(ranks) if not pin_violations(m, hw, 0, {"tp": t})]


def cp_violations(m: ModelShape, seq: int, cp: int) -> list[str]:
    """Why `cp` cannot split this sequence (empty if it can). CP cuts the sequence into 2·cp equal segments (causal
    load balancing: rank i takes segments i and 2cp−1−i); Gated DeltaNet passes its exact state from segment to
    segment, so each segment must also be a whole number of delta-rule chunks."""
    if cp == 1:
        return []
    out = []
    if seq % (2 * cp):
        out.append(f"sequence {seq} does not split into 2·cp={2 * cp} equal segments (causal load balancing)")
    elif m.linear_attn is not None and (seq // (2 * cp)) % m.linear_attn.chunk_size:
        out.append(f"segments of {seq // (2 * cp)} tokens are not whole {m.linear_attn.chunk_size}-token "
                   f"delta-rule chunks")
    return out


def cp_candidates(m: ModelShape, seq: int, ranks: int, tp: int) -> list[int]:
    return [c for c in divisors(ranks) if not cp_violations(m, seq, c)]


def ep_candidates(m: ModelShape, ranks: int) -> list[int]:
    return [e for e in divisors(ranks) if m.num_experts % e == 0]


def pp_candidates(m: ModelShape, world: int) -> list[int]:
    """Divisors of the world that split the layers into equal counts. Uneven stages run (the split balances them in
    time, recipe.cost.pipeline_split, and the memory is the largest stage's), and any pp up to the layer count can
    be pinned; the search keeps to even splits because every depth up to the layer count doubles the solver's time
    (a 60-layer model on 64 GPUs: 6 depths instead of 3) and moves no preset's layout."""
    return [p for p in divisors(world) if m.num_layers % p == 0]


# ---- pins: degrees the user fixes ("what if") ------------------------------------------------------------------
PIN_DIMS = ("pp", "tp", "cp", "ep")


def normalize_pins(pins: dict | None) -> dict[str, int]:
    """{dim: degree} in layout order (pp, tp, cp, ep); None, {} and None values mean unpinned. An unknown key or a
    degree that is not a positive integer is unusable input (ValueError)."""
    if not pins:
        return {}
    if not isinstance(pins, dict):
        raise ValueError(f"pins must be a mapping of {', '.join(PIN_DIMS)} to degrees, got {type(pins).__name__}")
    unknown = [str(k) for k in pins if k not in PIN_DIMS]
    if unknown:
        raise ValueError(f"unknown pin {unknown[0]!r}: the degrees that can be pinned are {', '.join(PIN_DIMS)}")
    out = {}
    for k in PIN_DIMS:
        v = pins.get(k)
        if v is None:
            continue
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise ValueError(f"--{k} must be a positive integer, got {v!r}")
        out[k] = v
    return out


def pin_str(pins: dict[str, int]) -> str:
    return " ".join(f"{k}={v}" for k, v in pins.items())


def pin_violations(m: ModelShape, hw: HwProfile, seq: int, pins: dict[str, int], world: int | None = None) -> list[str]:
    """Why these pins cannot work (empty if they can): the divisibility rule each pinned degree breaks for the model,
    the sequence and the node; with `world`, also for that GPU count (pp·tp·cp must divide it, ep must divide
    world/pp — at pp = 1 when pp is not pinned: an ep that does not divide the world divides no world/pp)."""
    out = []
    pp, tp, cp, ep = (pins.get(k) for k in PIN_DIMS)
    if pp is not None and pp > m.num_layers:
        out.append(f"pp={pp} must leave each pipeline stage at least one of the {m.num_layers} layers")
    if tp is not None:
        bad = [f"{n:,} {what}" for n, what in m.tp_splits() if n % tp]
        if bad:
            out.append(f"tp={tp} must divide the {', the '.join(bad)}")
        if tp > hw.gpus_per_node:
            out.append(f"tp={tp} must stay inside one node ({hw.gpus_per_node} GPUs per {hw.name} node)")
        if tp > 1 and m.tp_refusal:
            out.append(f"tp={tp}: {m.name} {m.tp_refusal} (tp=1)")
    if cp is not None:
        out += [f"cp={cp} must split the sequence: {why}" for why in cp_violations(m, seq, cp)]
    if ep is not None and m.num_experts % ep:
        out.append(f"ep={ep} must divide the {m.num_experts} experts")
    if out or world is None:
        return out
    named = {k: pins[k] for k in ("pp", "tp", "cp") if k in pins}
    prod = (pp or 1) * (tp or 1) * (cp or 1)
    if world % prod:
        if len(named) == 1:
            out.append(f"{pin_str(named)} must divide the {world} GPUs")
        else:
            out.append(f"pinned {'·'.join(named)} = {'·'.join(map(str, named.values()))} = {prod} must divide the "
                       f"{world} GPUs")
    elif ep is not None and (world // (pp or 1)) % ep:
        out.append(f"ep={ep} must divide world/pp = {world}/{pp or 1} = {world // (pp or 1)}")
    return out


def _pin_error(m: ModelShape, hw: HwProfile, seq: int, pins: dict[str, int], bad: list[str],
               world: int | None = None) -> str:
    where = f"{world}x {hw.name}" if world is not None else hw.name
    return f"pinned {pin_str(pins)} cannot work for {m.name} at {seq:,} tokens on {where}: {'; '.join(bad)}"


def _only(cands: list[int], pins: dict[str, int], key: str) -> list[int]:
    v = pins.get(key)
    return cands if v is None else [c for c in cands if c == v]


def _pp_cands(m: ModelShape, world: int, pins: dict[str, int]) -> list[int]:
    """pp candidates that leave room for the pinned tp·cp and ep; a pinned pp is its own candidate wherever it divides
    the world, also where it does not divide the layers (an uneven split)."""
    inner, ep, pinned = pins.get("tp", 1) * pins.get("cp", 1), pins.get("ep", 1), pins.get("pp")
    cands = pp_candidates(m, world) if pinned is None else [pinned] if world % pinned == 0 else []
    return [p for p in cands if (world // p) % inner == 0 and (world // p) % ep == 0]


def _tp_cands(m: ModelShape, hw: HwProfile, ranks: int, pins: dict[str, int]) -> list[int]:
    return [t for t in _only(tp_candidates(m, hw, ranks), pins, "tp") if (ranks // t) % pins.get("cp", 1) == 0]


def _cp_cands(m: ModelShape, seq: int, ranks: int, tp: int, pins: dict[str, int]) -> list[int]:
    return _only(cp_candidates(m, seq, ranks, tp), pins, "cp")


def _ep_cands(m: ModelShape, ranks: int, pins: dict[str, int]) -> list[int]:
    return _only(ep_candidates(m, ranks), pins, "ep")


# ---- one rule per dimension ----------------------------------------------------------------------------------
def layout_estimate(m: ModelShape, hw: HwProfile, world: int, layout: Layout, base: TrainOptions,
                    auto_chunks: bool) -> tuple[TrainOptions, Estimate]:
    """The options a layout is estimated with, and its estimate: its default EP chunk count (unless the user set
    one), and for DeepSeek sparse attention under full recompute the indexer's selections kept for the recomputed
    forward where the layout fits with them (they cost 4·topk bytes a token a layer and spare the indexer's second
    pass)."""
    o = with_default_chunks(m, hw, world, layout, base) if auto_chunks else base
    if m.dsa is not None and o.recompute == "full" and not o.keep_selections:
        kept = o.model_copy(update={"keep_selections": True})
        est = estimate(m, hw, world, layout, kept)
        if est.fits:
            return kept, est
    return o, estimate(m, hw, world, layout, o)


def _ep_numbers(m: ModelShape, ranks: int, ep: int) -> dict:
    _, layer_expert = layer_params(m)
    edp = ranks // ep
    return {"experts_per_rank": m.num_experts // ep, "expert_dp": edp,
            "unsharded_expert_layer_gb": round(layer_expert / ep * BYTES_UNSHARDED / GB, 3),
            "expert_fsdp_gb_per_layer": round(layer_expert / ep * (edp - 1) / edp * (2 * BF16 + 4) / GB, 3)}


def _ep_times(est: Estimate, ep: int) -> dict:
    """The step's exposed MoE communication, and at ep > 1 the time of the EP chunk loop's extra rounds."""
    n = {"exposed_moe_comm_s": round(est.time_s["ep_exposed"] + est.time_s["fsdp_exposed"], 4)}
    if ep > 1:
        n["chunk_loop_s"] = round(est.compute_s["ep_chunks"], 4)
    return n


def in_node(hw: HwProfile, world: int, group: int, stride: int = 1) -> bool:
    """Whether each group of `group` ranks `stride` apart lies inside one node of the job's layout (`world` GPUs as
    nodes of gpus_per_node_used): its span group·stride divides the node (recipe/cost.py, group_bw)."""
    return gpus_per_node_used(hw, world) % (group * stride) == 0


def _where(hw: HwProfile, world: int, ep: int) -> str:
    node = gpus_per_node_used(hw, world)
    if in_node(hw, world, ep):
        return "inside one node"
    return f"across {max(2, -(-ep // node))} nodes ({world} GPUs as nodes of {node})"


def default_ep(m: ModelShape, hw: HwProfile, ranks: int, pins: dict[str, int] | None = None,
               world: int | None = None) -> int:
    """The starting point: the largest ep inside one node (the fast all-to-all domain); a pinned ep is its own."""
    cands = _ep_cands(m, ranks, pins or {})
    return max([e for e in cands if in_node(hw, world or ranks, e)] or cands[:1])


def solve_ep(m: ModelShape, hw: HwProfile, world: int, pp: int, tp: int, cp: int, opts: TrainOptions,
             auto_chunks: bool, pins: dict[str, int] | None = None) -> tuple[Decision, Estimate]:
    """EP: the exposed communication of the MoE layers — expert-parameter traffic against token traffic.

    Routed experts are most of an MoE model's parameters. Every rank all-gathers its E/ep experts per layer over
    expert-DP (bf16, twice under recompute) and reduce-scatters their fp32 gradients — a volume that does not
    depend on the sequence, so at short local sequences it cannot hide under the layer's compute. EP divides it
    by ep, at the price of token all-to-alls (s·k·h per rank per pass) that the chunked overlap hides under the
    expert GEMMs, well over NVLink/xGMI, poorly across nodes. Given the local sequence (tp, cp fixed), the ep
    with the least exposed time per token wins among those that keep the plan within memory; ties (within 1%)
    go to the in-node, larger ep, whose unsharded expert layer is smaller."""
    ranks = world // pp
    scored = {}
    for e in _ep_cands(m, ranks, pins or {}):
        lay = Layout(pp=pp, tp=tp, cp=cp, ep=e)
        est = layout_estimate(m, hw, world, lay, opts, auto_chunks)[1]
        if est.fits:
            scored[e] = est
    if not scored:
        e = default_ep(m, hw, ranks, pins, world)
        lay = Layout(pp=pp, tp=tp, cp=cp, ep=e)
        est = layout_estimate(m, hw, world, lay, opts, auto_chunks)[1]
        return Decision(e, "expert memory and traffic", "no ep fits at this cp", _ep_numbers(m, ranks, e)), est
    best_t = min(x.step_time_s for x in scored.values())
    near = [e for e, x in scored.items() if x.step_time_s <= best_t * 1.01]
    inside = [e for e in near if in_node(hw, world, e)]
    ep = max(inside) if inside else min(near)
    est = scored[ep]
    n = _ep_numbers(m, ranks, ep)
    n.update(_ep_times(est, ep))
    others = sorted((e for e in scored if e != ep), key=lambda e: scored[e].step_time_s)
    rejected = ""
    if others:
        a = others[0]
        rejected = (f"ep={a}: {scored[a].step_time_s:.3f} s/step vs {est.step_time_s:.3f} "
                    f"(exposed all-to-all {scored[a].time_s['ep_exposed']:.3f} s, expert FSDP "
                    f"{scored[a].time_s['fsdp_exposed']:.3f} s)")
    where = _where(hw, world, ep)
    return Decision(
        value=ep, constraint="exposed MoE communication (expert FSDP vs all-to-all)",
        reason=(f"{n['experts_per_rank']} experts/rank, {where}; expert FSDP {n['expert_fsdp_gb_per_layer']:.2f} "
                f"GB/layer, unsharded expert layer {n['unsharded_expert_layer_gb']:.2f} GB"),
        numbers=n, rejected=rejected,
    ), est


def solve_cp(m: ModelShape, hw: HwProfile, world: int, pp: int, tp: int, ep: int, opts: TrainOptions,
             auto_chunks: bool, pins: dict[str, int] | None = None) -> tuple[Decision | None, Estimate | None, dict]:
    """CP: the smallest context-parallel degree at which the activations fit in what persistent state leaves.

    Persistent state under FSDP2 does not depend on cp (everything is sharded over all ranks of a stage), while the
    activations scale with the local sequence s/cp; so the first cp that fits is the answer, and cp=1 whenever the
    full sequence fits — no fixed window. Returns (decision, estimate, tried) — (None, None, tried) if none fits."""
    ranks = world // (pp * tp)
    tried = {}
    for c in _cp_cands(m, opts.micro_batch_tokens, ranks, tp, pins or {}):
        lay = Layout(pp=pp, tp=tp, cp=c, ep=ep)
        est = layout_estimate(m, hw, world, lay, opts, auto_chunks)[1]
        tried[c] = est
        if est.fits:
            smaller = max((k for k in tried if k < c), default=0)  # none when cp is pinned
            prev = tried.get(smaller)
            if c == 1:
                reason = f"the full {opts.micro_batch_tokens:,}-token sequence fits: {_peak_of(est, hw)}"
                rejected = ""
            else:
                reason = f"activations at s/cp={opts.micro_batch_tokens // c:,} tokens leave {_peak_of(est, hw)}"
                rejected = f"cp={smaller}: peak {_over(prev, hw.usable_gb)}" if prev is not None else ""
            d = Decision(value=c, constraint="activation memory", reason=reason,
                         numbers={"local_tokens": opts.micro_batch_tokens // c,
                                  "activations_gb": round(est.memory_gb["activations"], 2),
                                  "persistent_gb": round(sum(est.memory_gb[k] for k in
                                                             ("weights", "grads", "master", "optimizer")), 2),
                                  "headroom_gb": round(est.headroom_gb, 2),
                                  "margin_gb": round(_margin_gb(est), 2)},
                         rejected=rejected)
            return d, est, tried
    return None, None, tried


def _sequence_split(m, hw, world, pp, t, opts, auto_chunks, pins=None):
    """CP by memory at the in-node EP; EP by exposed communication at that local sequence; CP re-checked with the
    chosen EP (a smaller ep holds a larger unsharded expert layer). Pinned degrees are the only candidates of their
    dimension. Returns (cp decision, ep decision, estimate, None), or (None, None, None, miss) where miss is
    (layout, estimate) of the largest cp tried, the nearest miss at this tp (None if no cp divides)."""
    pins = pins or {}
    ranks = world // pp
    e0 = default_ep(m, hw, ranks, pins, world)
    cp_d, est, tried = solve_cp(m, hw, world, pp, t, e0, opts, auto_chunks, pins)
    e_tried = e0
    for e in _ep_cands(m, ranks, pins):
        if cp_d is not None:
            break
        if e != e0:
            # the in-node EP does not fit at any cp: a larger ep holds a smaller unsharded expert layer, a smaller one
            # fewer EP dispatch buffers (the EP path's backward copies) — try each
            cp_d, est, tried = solve_cp(m, hw, world, pp, t, e, opts, auto_chunks, pins)
            e_tried = e
    if cp_d is None:
        miss = None
        if tried:
            c = max(tried)
            miss = (Layout(pp=pp, tp=t, cp=c, ep=e_tried), tried[c])
        return None, None, None, miss
    ep_d, _ = solve_ep(m, hw, world, pp, t, cp_d.value, opts, auto_chunks, pins)
    cp_d, est, tried = solve_cp(m, hw, world, pp, t, ep_d.value, opts, auto_chunks, pins)
    assert cp_d is not None, "solve_ep only picks an ep that fits at the cp it was given"
    # a larger ep shrinks the unsharded expert layer: if that lets a smaller cp fit, it may be the faster split
    for e in _ep_cands(m, ranks, pins):
        if e <= ep_d.value or cp_d.value == 1:
            continue
        cp2, est2, _ = solve_cp(m, hw, world, pp, t, e, opts, auto_chunks, pins)
        if cp2 is not None and cp2.value < cp_d.value and (_per_token(est2, world, pp, t, cp2.value)
                                                           < _per_token(est, world, pp, t, cp_d.value)):
            cp_d = cp2  # EP again at the shorter local sequence: e fits there, so some ep does
            ep_d, est = solve_ep(m, hw, world, pp, t, cp_d.value, opts, auto_chunks, pins)
    # the converse: a smaller ep needs fewer all-to-alls but holds a larger unsharded expert layer; if the next CP
    # step makes room for it and that is at least PP_TIE_BREAK faster per token, take it
    nxt = [c for c in _cp_cands(m, opts.micro_batch_tokens, ranks // t, t, pins) if c > cp_d.value]
    if nxt and ep_d.value > 1:
        c2 = nxt[0]
        ep2, est2 = solve_ep(m, hw, world, pp, t, c2, opts, auto_chunks, pins)
        gain = 1 - _per_token(est2, world, pp, t, c2) / _per_token(est, world, pp, t, cp_d.value)
        if ep2.value < ep_d.value and est2.fits and gain >= PP_TIE_BREAK:
            cp_d = Decision(c2, "activation memory, for a smaller EP",
                            f"cp={cp_d.value} fits with ep={ep_d.value}; cp={c2} makes room for ep={ep2.value}'s "
                            f"unsharded expert layer and is {100 * gain:.0f}% faster per token (fewer all-to-alls)",
                            {"local_tokens": opts.micro_batch_tokens // c2,
                             "activations_gb": round(est2.memory_gb["activations"], 2),
                             "headroom_gb": round(est2.headroom_gb, 2)},
                            rejected=f"cp={cp_d.value} with ep={ep_d.value}: {est.step_time_s:.3f} s/step")
            ep_d, est = ep2, est2
    return cp_d, ep_d, est, None


def _per_token(est: Estimate, world: int, pp: int, tp: int, cp: int) -> float:
    """Seconds per token of the whole job: step time over tokens per step (∝ step·pp·tp·cp at a fixed world)."""
    return est.step_time_s * pp * tp * cp


def solve_tp(m: ModelShape, hw: HwProfile, world: int, pp: int, opts: TrainOptions, auto_chunks: bool,
             pins: dict[str, int] | None = None):
    """TP: 1 unless one layer does not fit at any CP, or a TP group inside the node splits a sequence more cheaply
    than the CP group it replaces (per-layer communication); then the smallest TP that fits, or the faster one
    if it is at least PP_TIE_BREAK faster per token. TP is the only dimension that shrinks one layer's width
    (heads, recompute working set, the vocab of the head)."""
    ranks = world // pp
    first_fail = None  # (layout, estimate) of the nearest miss at the first tp
    found = []
    for t in _tp_cands(m, hw, ranks, pins or {}):
        cp_d, ep_d, est, miss = _sequence_split(m, hw, world, pp, t, opts, auto_chunks, pins)
        if cp_d is not None:
            found.append((t, cp_d, ep_d, est))
        elif first_fail is None and miss is not None:
            first_fail = miss
    if not found:
        return None, None, None, first_fail
    base = found[0]
    fastest = min(found, key=lambda f: _per_token(f[3], world, pp, f[0], f[1].value))
    speed = lambda f: _per_token(f[3], world, pp, f[0], f[1].value)  # noqa: E731
    t, cp_d, ep_d, est = base
    if fastest is not base and speed(fastest) < speed(base) * (1 - PP_TIE_BREAK):
        t, cp_d, ep_d, est = fastest
        b_t, b_cp, b_ep = base[0], base[1].value, base[2].value
        if b_cp > cp_d.value:
            why = "TP's in-node exchange costs less than the CP exchange it replaces"
        elif b_ep != ep_d.value:
            why = f"TP's in-node exchange costs less than the expert-parallel exchange of ep={b_ep} it replaces"
        else:
            why = "TP's in-node exchange costs less than the time its split of the layers saves"
        with_ep = lambda e: f", ep={e}" if b_ep != ep_d.value else ""  # noqa: E731
        d = Decision(t, "per-layer communication",
                     f"tp={t} with cp={cp_d.value}{with_ep(ep_d.value)} is "
                     f"{100 * (1 - speed(fastest) / speed(base)):.0f}% faster per token than tp={b_t} with "
                     f"cp={b_cp}{with_ep(b_ep)}: {why}",
                     {"peak_gb": round(est.total_gb, 2)},
                     rejected=f"tp={b_t}, cp={b_cp}{with_ep(b_ep)}: {base[3].step_time_s:.3f} s/step")
    elif t == 1:
        d = Decision(1, "per-layer memory", "one layer fits one GPU at some cp: no tensor split needed",
                     {"peak_gb": round(est.total_gb, 2)})
    else:
        rejected = ""
        if first_fail is not None:
            fail_lay, fail_est = first_fail
            rejected = f"tp={fail_lay.tp}, cp={fail_lay.cp}: peak {_over(fail_est, hw.usable_gb)}"
        d = Decision(t, "per-layer memory", f"tp={t} is the smallest tensor split at which some cp fits",
                     {"peak_gb": round(est.total_gb, 2)}, rejected=rejected)
    return d, ep_d, cp_d, est


def solve(m: ModelShape, hw: HwProfile, world: int, opts: TrainOptions, auto_chunks: bool = True,
          suggest: bool = True, pins: dict[str, int] | None = None) -> Solution:
    """Solve every dimension for `world` GPUs. Raises InfeasibleError naming the constraint and the shortfall.

    `pins` ({"ep": 2}, keys among pp, tp, cp, ep) fixes those degrees: each pinned dimension has its pinned value as
    its only candidate, the others are solved by their own rules around it, and a pinned dimension's decision says
    "pinned by the user" with the pinned layout's figures and what the dimension's own rule would pick instead. A
    pin that breaks a divisibility rule, or a pinned layout that does not fit, raises InfeasibleError naming it."""
    pins = normalize_pins(pins)
    _check_world(m, world)
    if pins:
        bad = pin_violations(m, hw, opts.micro_batch_tokens, pins, world)
        if bad:
            raise InfeasibleError(_pin_error(m, hw, opts.micro_batch_tokens, pins, bad, world))
    results = []
    closest = None  # (shortfall_gb, layout, estimate) of the nearest miss
    for p in _pp_cands(m, world, pins):
        tp_d, ep_d, cp_d, est = solve_tp(m, hw, world, p, opts, auto_chunks, pins)
        if tp_d is None:
            if est is not None:
                lay, e = est
                short = _short_gb(e, hw)
                if closest is None or short < closest[0]:
                    closest = (short, lay, e)
            continue
        results.append((p, tp_d, ep_d, cp_d, est))
    if not results:
        err = InfeasibleError(_infeasible_message(m, hw, world, opts, closest, suggest, pins, auto_chunks))
        err.miss = (world, closest[1], closest[2]) if closest is not None else None
        raise err
    base = results[0]
    per_tok = lambda r: _per_token(r[4], world, r[0], r[1].value, r[3].value)  # noqa: E731
    best = min(results, key=per_tok)
    chosen = base
    if best is not base and per_tok(best) < per_tok(base) * (1 - PP_TIE_BREAK):
        chosen = best
    p, tp_d, ep_d, cp_d, est = chosen
    if p == 1:
        pp_d = Decision(1, "pipeline bubble", "no pipeline needed: FSDP2 shards persistent state over all ranks",
                        {"bubble": 0.0})
    elif chosen is base:
        pp_d = Decision(p, "persistent state per stage", f"pp={p} is the smallest pipeline depth that fits",
                        {"bubble": round((p - 1) / (opts.micro_batches + p - 1), 3)},
                        rejected="pp=1: no tp/cp fits")
    else:
        pp_d = Decision(p, "tie-break: throughput",
                        f"pp={p} is {100 * (1 - per_tok(best) / per_tok(base)):.0f}% faster per token than "
                        f"pp={base[0]} (FSDP traffic per stage shrinks by pp)",
                        {"bubble": round((p - 1) / (opts.micro_batches + p - 1), 3)},
                        rejected=f"pp={base[0]}: {base[4].step_time_s:.2f} s/step")
    layout = Layout(pp=p, tp=tp_d.value, cp=cp_d.value, ep=ep_d.value)
    o, est = layout_estimate(m, hw, world, layout, opts, auto_chunks)
    assert est.fits, f"solver chose a layout that does not fit: {layout}"
    decisions = {"tp": tp_d, "ep": ep_d, "cp": cp_d, "pp": pp_d}
    for k in pins:
        decisions[k] = _pinned_decision(k, m, hw, world, layout, opts, est, auto_chunks)
    return Solution(world=world, layout=layout, opts=o, estimate=est, decisions=decisions, pins=dict(pins))


def _rule_choice(dim: str, m: ModelShape, hw: HwProfile, world: int, lay: Layout, opts: TrainOptions,
                 auto_chunks: bool) -> tuple[int, Estimate] | None:
    """What `dim`'s own rule picks with the other three degrees as in `lay`: EP by exposed communication
    (`solve_ep`), CP, TP and PP the smallest candidate that fits (their memory rules, without the throughput
    tie-breaks). None if nothing fits (cannot happen when `lay` fits: its own value is a candidate)."""
    if dim == "ep":
        d, e = solve_ep(m, hw, world, lay.pp, lay.tp, lay.cp, opts, auto_chunks)
        return (d.value, e) if e.fits else None
    if dim == "cp":
        d, e, _ = solve_cp(m, hw, world, lay.pp, lay.tp, lay.ep, opts, auto_chunks)
        return (d.value, e) if d is not None else None
    if dim == "tp":
        ranks = world // lay.pp
        cands = [t for t in tp_candidates(m, hw, ranks) if (ranks // t) % lay.cp == 0]
        layouts = [Layout(pp=lay.pp, tp=t, cp=lay.cp, ep=lay.ep) for t in cands]
    else:
        cands = [p for p in pp_candidates(m, world) if (world // p) % (lay.tp * lay.cp) == 0
                 and (world // p) % lay.ep == 0]
        layouts = [Layout(pp=p, tp=lay.tp, cp=lay.cp, ep=lay.ep) for p in cands]
    for cand in layouts:
        e = layout_estimate(m, hw, world, cand, opts, auto_chunks)[1]
        if e.fits:
            return getattr(cand, dim), e
    return None


def _pinned_decision(dim: str, m: ModelShape, hw: HwProfile, world: int, lay: Layout, opts: TrainOptions,
                     est: Estimate, auto_chunks: bool) -> Decision:
    """A pinned dimension's decision: the pinned layout's peak and headroom, the dimension's own figures, and the
    value its own rule would pick with the rest as solved (the rejected alternative, when it differs)."""
    v = getattr(lay, dim)
    n = {"peak_gb": round(est.total_gb, 2), "headroom_gb": round(est.headroom_gb, 2),
         "margin_gb": round(_margin_gb(est), 2)}
    if dim == "ep":
        n.update(_ep_numbers(m, world // lay.pp, v))
        n.update(_ep_times(est, v))
        where = _where(hw, world, v)
        detail = (f"{n['experts_per_rank']} experts/rank, {where}, unsharded expert layer "
                  f"{n['unsharded_expert_layer_gb']:.2f} GB")
    elif dim == "cp":
        n.update(local_tokens=opts.micro_batch_tokens // v, activations_gb=round(est.memory_gb["activations"], 2))
        detail = f"s/cp={n['local_tokens']:,} tokens, activations {n['activations_gb']:.1f} GB"
    elif dim == "tp":
        n.update(heads_per_rank=m.num_heads // v, tp_comm_s=round(est.time_s["tp"], 4))
        detail = f"{n['heads_per_rank']} attention heads/rank, TP exchange {n['tp_comm_s']:.3f} s/step"
    else:
        # the largest stage's layers (an uneven split where pp does not divide them)
        n.update(layers_per_stage=stage_layers(m, v, opts, hw),
                 bubble=round((v - 1) / (opts.micro_batches + v - 1), 3))
        detail = (f"{'' if m.num_layers % v == 0 else 'up to '}{n['layers_per_stage']} layers/stage, bubble "
                  f"{100 * n['bubble']:.0f}% of the step")
    reason = f"{dim}={v} ({_peak_of(est, hw)}, {detail})"
    rejected = ""
    rule = _rule_choice(dim, m, hw, world, lay, opts, auto_chunks)
    if rule is not None and rule[0] == v:
        reason += f"; the {dim.upper()} rule picks the same here"
    elif rule is not None:
        rv, r_est = rule
        rejected = (f"{dim}={rv}, the {dim.upper()} rule's choice with the rest as here: "
                    f"{r_est.tokens_per_s_per_gpu:,.0f} tok/s/GPU against {est.tokens_per_s_per_gpu:,.0f}, peak "
                    f"{r_est.total_gb:.1f} GB")
    return Decision(v, "pinned by the user", reason, n, rejected)


def _check_world(m: ModelShape, world: int) -> None:
    if world < 1 or world > MAX_WORLD:
        raise InfeasibleError(f"--gpus must be between 1 and {MAX_WORLD}, got {world}")


def _gb(x: float) -> str:
    """GB with one decimal, or three where one would round a real shortfall to 0.0."""
    return f"{x:.1f}" if abs(x) >= 0.05 else f"{x:.3f}"


def _infeasible_message(m: ModelShape, hw: HwProfile, world: int, opts: TrainOptions, closest,
                        suggest: bool = True, pins: dict[str, int] | None = None, auto_chunks: bool = True) -> str:
    seq = opts.micro_batch_tokens
    if pins:
        return _pinned_infeasible_message(m, hw, world, opts, closest, suggest, pins, auto_chunks)
    if closest is None:
        return (f"{world} GPUs: no layout divides them for {m.name} at {seq:,} tokens (cp must split the sequence "
                f"into 2·cp equal segments{' of whole delta-rule chunks' if m.linear_attn else ''}, "
                f"ep must divide {m.num_experts} experts, pp the {m.num_layers} layers)")
    short, lay, e = closest
    p, c = lay.pp, lay.cp
    persistent = sum(e.memory_gb[k] for k in ("weights", "grads", "master", "optimizer"))
    excluded = [x for x in divisors(world) if x > 1 and x not in cp_candidates(m, seq, world, 1)]
    why = ""
    if excluded:
        rules = [f"split {seq:,} tokens into 2·cp equal segments"]
        if m.linear_attn is not None:
            rules.append(f"make each a whole number of {m.linear_attn.chunk_size}-token delta-rule chunks")
        why = (f"; {world} GPUs leave no larger cp: cp={'/'.join(map(str, excluded))} would not "
               f"{' and '.join(rules)}")
    if suggest:
        nxt = _next_fitting(m, hw, world, opts, auto_chunks=auto_chunks)
        why += f" — {nxt} GPUs fit" if nxt else " — add GPUs or shorten --seq"
    return (f"{m.name} at {seq:,} tokens does not fit on {world}x {hw.name}: best layout tried (pp={p}, cp={c}) "
            f"peaks at {e.total_gb:.1f} GB + margin {_margin_gb(e):.1f} GB against {hw.usable_gb:.1f} GB usable "
            f"({_gb(short)} GB over; persistent "
            f"state {persistent:.1f} GB, activations {e.memory_gb['activations']:.1f} GB){why}")


def _lay_str(lay: Layout) -> str:
    return f"pp={lay.pp} tp={lay.tp} cp={lay.cp} ep={lay.ep}"


def _miss_str(hw: HwProfile, lay: Layout, e: Estimate, what: str) -> str:
    """'the pinned layout (pp=1 tp=1 cp=1 ep=8) peaks at X GB against Y GB usable (Z GB over; ...)'."""
    persistent = sum(e.memory_gb[k] for k in ("weights", "grads", "master", "optimizer"))
    return (f"{what} ({_lay_str(lay)}) peaks at {e.total_gb:.1f} GB + margin {_margin_gb(e):.1f} GB against "
            f"{hw.usable_gb:.1f} GB usable ({_gb(_short_gb(e, hw))} GB over; persistent state {persistent:.1f} GB, "
            f"activations "
            f"{e.memory_gb['activations']:.1f} GB)")


def _pinned_infeasible_message(m, hw, world, opts, closest, suggest, pins, auto_chunks) -> str:
    seq = opts.micro_batch_tokens
    head = f"{m.name} at {seq:,} tokens with {pin_str(pins)} pinned does not fit on {world}x {hw.name}"
    if closest is None:  # every pin divides (checked first), so some layout was tried; kept for safety
        return f"{head}: no layout with these pins divides the {world} GPUs"
    _, lay, e = closest
    what = "the pinned layout" if len(pins) == len(PIN_DIMS) else "the closest layout with these pins"
    msg = f"{head}: {_miss_str(hw, lay, e, what)}"
    if suggest:
        nxt = _next_fitting(m, hw, world, opts, pins, auto_chunks)
        msg += f" — with these pins {nxt} GPUs fit" if nxt else " — add GPUs, shorten --seq or drop a pin"
        try:
            free = solve(m, hw, world, opts, auto_chunks, suggest=False)
            msg += f"; unpinned, {world} GPUs fit as {_lay_str(free.layout)}"
        except InfeasibleError:
            pass
    return msg


def _next_fitting(m: ModelShape, hw: HwProfile, world: int, opts: TrainOptions,
                  pins: dict[str, int] | None = None, auto_chunks: bool = True) -> int | None:
    """The smallest larger GPU count (up to twice as many) at which some layout (with these pins) fits."""
    for w in range(world + 1, 2 * world + 1):
        if pins and pin_violations(m, hw, opts.micro_batch_tokens, pins, w):
            continue
        try:
            solve(m, hw, w, opts, auto_chunks, suggest=False, pins=pins)
            return w
        except InfeasibleError:
            continue
    return None


def _count_reason(sol: Solution, hw: HwProfile) -> str:
    e = sol.estimate
    return (f"CP={sol.layout.cp} at {100 * e.headroom_gb / hw.usable_gb:.0f}% headroom (peak {e.total_gb:.1f} GB + "
            f"margin {_margin_gb(e):.1f} of {hw.usable_gb:.1f} GB usable), {e.tokens_per_s_per_gpu:,.0f} tok/s/GPU")


def _whole_node(m: ModelShape, hw: HwProfile, opts: TrainOptions, auto_chunks: bool, pins: dict[str, int],
                sol: Solution) -> Solution | None:
    """Below one node: the whole node's solution when it needs a smaller CP (or TP, or PP) than `sol` at a throughput
    per GPU within PP_TIE_BREAK of it or better — the same GPU-hours per token or fewer, and a simpler layout that
    leaves more memory free. None when `sol` already fills a node or the node is not simpler."""
    node = hw.gpus_per_node
    if sol.world >= node or (pins and pin_violations(m, hw, opts.micro_batch_tokens, pins, node)):
        return None
    try:
        full = solve(m, hw, node, opts, auto_chunks, suggest=False, pins=pins)
    except InfeasibleError:
        return None
    a, b = sol.layout, full.layout
    simpler = (b.cp, b.tp, b.pp) < (a.cp, a.tp, a.pp) and b.cp <= a.cp and b.tp <= a.tp and b.pp <= a.pp
    fast = full.estimate.tokens_per_s_per_gpu >= sol.estimate.tokens_per_s_per_gpu * (1 - PP_TIE_BREAK)
    return full if simpler and fast else None


def solve_recompute(m: ModelShape, hw: HwProfile, sol: Solution, auto_chunks: bool = True,
                    pins: dict[str, int] | None = None) -> Solution:
    """`--recompute auto`. `sol` is solved under full recompute (its count too, when the solver chose it). At its
    GPU count two ways out of recompute are weighed, each with every dimension solved again: no recompute (a layer
    then costs 3 passes, not 4, often at a larger CP that holds the saved activations), and partial recompute, the
    last layers of each stage keeping their activations (`solve_partial`). The faster is taken when it runs at least
    PP_TIE_BREAK more tokens/s per GPU than full recompute. The solution returned says why in its `recompute`
    decision."""
    rate = sol.estimate.tokens_per_s_per_gpu
    none, none_why = None, ""
    try:
        none = solve(m, hw, sol.world, sol.opts.model_copy(update={"recompute": "none"}), auto_chunks, suggest=False,
                     pins=pins)
    except InfeasibleError as e:
        none_why = f"without recompute no layout fits {sol.world} GPUs with the margin"
        if e.miss is not None:
            none_why += f": {_miss_str(hw, e.miss[1], e.miss[2], 'the closest')}"
    part = solve_partial(m, hw, sol, auto_chunks, pins)
    gain = lambda x: x.estimate.tokens_per_s_per_gpu / rate  # noqa: E731
    best = max((x for x in (none, part) if x is not None), key=gain, default=None)
    if best is None or gain(best) < 1 + PP_TIE_BREAK:
        if none is None:
            why = none_why + ("; and no layer can keep its activations" if part is None else
                              f"; keeping {_last(part.opts.keep_layers)} activations, the fastest that fits, "
                              f"runs {gain(part):.2f}x the tokens/s per GPU")
            sol.recompute = Decision("full", "activation memory", why)
        else:
            g = gain(none) if part is None else max(gain(none), gain(part))
            sol.recompute = Decision("full", "step time", f"without recompute the best layout on {sol.world} GPUs "
                                     f"({_lay_str(none.layout)}) runs {gain(none):.2f}x the tokens/s per GPU of this "
                                     f"one" + ("" if part is None else f", keeping {_last(part.opts.keep_layers)} "
                                               f"activations {gain(part):.2f}x"),
                                     {"gain": round(g, 4)})
        return sol
    full_str = f"full recompute: {_lay_str(sol.layout)} at {rate:,.0f} tok/s/GPU"
    if best is none:
        best.recompute = Decision("none", "step time", f"no recompute fits {sol.world} GPUs as "
                                  f"{_lay_str(none.layout)} at {gain(none):.2f}x the tokens/s per GPU of full "
                                  f"recompute", {"gain": round(gain(none), 4)}, rejected=full_str)
    else:
        k = part.opts.keep_layers
        other = (none_why if none is None else f"no recompute: {_lay_str(none.layout)} at "
                 f"{none.estimate.tokens_per_s_per_gpu:,.0f} tok/s/GPU")
        where = f"of the {m.num_layers} layers" if part.layout.pp == 1 else "of each pipeline stage's layers"
        which = f"the last {where} keeps its" if k == 1 else f"the last {k} {where} keep their"
        best.recompute = Decision(f"keep {k}", "step time",
                                  f"{which} activations ({_lay_str(part.layout)}): the fastest of the kept-layer "
                                  f"counts solved on {sol.world} GPUs, {gain(part):.2f}x the tokens/s per GPU of full "
                                  f"recompute", {"gain": round(gain(part), 4), "keep_layers": k},
                                  rejected=f"{full_str}; {other}")
    if sol.count is not None:  # the count was chosen under full recompute, and its figures are that layout's
        c = sol.count
        best.count = Decision(c.value, c.constraint, f"{c.reason}, under full recompute", dict(c.numbers),
                              rejected=c.rejected)
    return best


def _last(k: int) -> str:
    """"the last layer's" / "the last 12 layers'"."""
    return "the last layer's" if k == 1 else f"the last {k} layers'"


KEEP_FRACTIONS = tuple(i / 8 for i in range(1, 8))  # the kept-layer counts solve_partial starts from, of a stage


def solve_partial(m: ModelShape, hw: HwProfile, sol: Solution, auto_chunks: bool = True,
                  pins: dict[str, int] | None = None) -> Solution | None:
    """Partial recompute at sol's GPU count: the solution with the most tokens/s per GPU among every dimension solved
    again with k layers kept, for k = 1 and each KEEP_FRACTIONS of the stage's layers, and for the most each of those
    layouts holds (`solve_keep_layers`) solved again as well (where that takes another layout, the most that keeps
    it); None if no count fits. Each count's layout comes from
    the solver's own rules (the smallest CP that holds the kept activations, …), so a larger k may take a larger
    CP: the search weighs the recompute a kept layer saves against what the wider exchange costs."""
    n = stage_layers(m, sol.layout.pp, sol.opts, hw)
    solved: dict[int, Solution | None] = {}

    def at(k: int) -> Solution | None:
        if k not in solved:
            try:
                solved[k] = solve(m, hw, sol.world, sol.opts.model_copy(update={"keep_layers": k}), auto_chunks,
                                  suggest=False, pins=pins)
            except InfeasibleError:
                solved[k] = None
        return solved[k]

    for k in sorted({1, *(max(1, round(n * f)) for f in KEEP_FRACTIONS)}):
        s = at(k) if k < n else None
        if s is None:
            break  # a kept layer only adds memory: where k fits no layout, no larger count does
        most = solve_keep_layers(m, hw, s)
        if most is None or most.opts.keep_layers <= k:
            continue
        lo, hi = k, most.opts.keep_layers
        top = at(hi)
        if top is None or top.layout != s.layout:
            # solved again, the most this layout holds took another layout (the rules weigh that many kept layers
            # differently): the most solved on this layout, by bisection
            while hi - lo > 1:
                mid = (lo + hi) // 2
                x = at(mid)
                lo, hi = (mid, hi) if x is not None and x.layout == s.layout else (lo, mid)
    return max((s for s in solved.values() if s is not None), key=lambda s: s.estimate.tokens_per_s_per_gpu,
               default=None)


def solve_keep_layers(m: ModelShape, hw: HwProfile, sol: Solution) -> Solution | None:
    """Partial recompute on sol's layout and count: the most decoder layers at the end of each pipeline stage that
    keep their activations (`keep_layers`, 1 to one fewer than the largest stage's layers) with the layout still
    fitting with the margin, or None if not one fits. Each kept layer adds its saved activations to the peak, so the
    largest that fits is found by bisection."""
    stage = stage_layers(m, sol.layout.pp, sol.opts, hw)

    def at(k: int) -> Estimate:
        return estimate(m, hw, sol.world, sol.layout, sol.opts.model_copy(update={"keep_layers": k}))

    lo, hi = 0, stage - 1  # at(lo) fits (lo = 0: sol itself); find the largest k ≤ hi that does
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if at(mid).fits:
            lo = mid
        else:
            hi = mid - 1
    if lo == 0:
        return None
    opts = sol.opts.model_copy(update={"keep_layers": lo})
    return Solution(world=sol.world, layout=sol.layout, opts=opts, estimate=at(lo), decisions=sol.decisions,
                    pins=dict(sol.pins), count=sol.count)


def _count_by_cost(m: ModelShape, hw: HwProfile, opts: TrainOptions, auto_chunks: bool, pins: dict[str, int],
                   sol: Solution) -> tuple[Solution, Solution]:
    """(the count to take, the cheapest) over `world_candidates` from sol's count up to twice it: the cheapest runs
    the most tokens/s per GPU (the fewest GPU-hours a token); the count taken is the smallest whose tokens/s per GPU
    are at least 1/COUNT_GAIN of that. It is sol itself unless the memory that made sol fit forced a wide TP or CP
    (or a deep PP) that a few more GPUs lift."""
    sols = [sol]
    if COUNT_GAIN * sol.estimate.tokens_per_s_per_gpu >= tokens_per_s_bound(m, hw, opts):
        return sol, sol  # no count can run COUNT_GAIN times its tokens/s per GPU: nothing to solve
    for w in world_candidates(hw):
        if w <= sol.world or w > 2 * sol.world or (pins and pin_violations(m, hw, opts.micro_batch_tokens, pins, w)):
            continue
        try:
            sols.append(solve(m, hw, w, opts, auto_chunks, suggest=False, pins=pins))
        except InfeasibleError:
            continue
    cheapest = max(sols, key=lambda s: s.estimate.tokens_per_s_per_gpu)
    want = cheapest.estimate.tokens_per_s_per_gpu / COUNT_GAIN
    return next(s for s in sols if s.estimate.tokens_per_s_per_gpu >= want), cheapest


def cheaper_count(m: ModelShape, hw: HwProfile, sol: Solution, auto_chunks: bool = True,
                  pins: dict[str, int] | None = None) -> Solution | None:
    """For a GPU count the user fixed (`--gpus`): the count the default rule would take from it instead — the
    smallest of `world_candidates` up to twice as many GPUs whose GPU-hours a token are within COUNT_GAIN of the
    cheapest's there (`_count_by_cost`) — or None when that is sol's own count."""
    taken, _ = _count_by_cost(m, hw, sol.opts, auto_chunks, normalize_pins(pins), sol)
    return None if taken is sol else taken


def world_candidates(hw: HwProfile) -> list[int]:
    small = [w for w in (1, 2, 4) if w < hw.gpus_per_node]
    return small + [hw.gpus_per_node * n for n in range(1, MAX_WORLD // hw.gpus_per_node + 1)]


def solve_min_gpus(m: ModelShape, hw: HwProfile, opts: TrainOptions, auto_chunks: bool = True,
                   pins: dict[str, int] | None = None) -> Solution:
    """The smallest GPU count (1, 2, 4, then whole nodes) at which some layout fits with the memory margin — with
    `pins`, some layout with those degrees (counts the pins do not divide are skipped). Below one node, the whole
    node instead when it runs a smaller CP (or TP, PP) at no less throughput per GPU (`_whole_node`); then a larger
    count, up to twice as many GPUs, when the count found needs over COUNT_GAIN times the GPU-hours a token of
    the cheapest count in that range (`_count_by_cost`). The
    solution's `count` decision says why, naming the cheaper count it rejected and why."""
    pins = normalize_pins(pins)
    seq = opts.micro_batch_tokens
    if pins:
        bad = pin_violations(m, hw, seq, pins)
        if bad:
            raise InfeasibleError(_pin_error(m, hw, seq, pins, bad))
    persistent_b = sum(param_counts(m).values()) * 16  # weights, grads, master, Adam: sharded over all ranks
    nearest = None  # (shortfall, world, layout, estimate) over the counts tried, with pins
    rejected = ""  # the largest count below the answer, and why it does not do
    for w in world_candidates(hw):
        if pins and pin_violations(m, hw, seq, pins, w):
            continue
        # lower bounds that need no solve: persistent state is sharded over all w ranks; even at cp = w every
        # rank keeps its slice of each layer's checkpointed input
        floor_b = persistent_b / w + m.num_layers * seq / w * m.hidden_size * BF16
        if floor_b / GB + hw.overhead_gb > hw.usable_gb:
            rejected = (f"{w} GPUs: persistent state and checkpointed layer inputs alone take "
                        f"{floor_b / GB + hw.overhead_gb:.1f} GB of {hw.usable_gb:.1f} usable")
            continue
        try:
            sol = solve(m, hw, w, opts, auto_chunks, suggest=False, pins=pins)
        except InfeasibleError as e:
            if e.miss is not None:
                short = _short_gb(e.miss[2], hw)
                if nearest is None or short < nearest[0]:
                    nearest = (short, *e.miss)
                _, lay, est = e.miss
                rejected = (f"{w} GPUs: the closest layout ({_lay_str(lay)}) peaks at {_over(est, hw.usable_gb)} "
                            f"GB usable")
            else:
                rejected = f"{w} GPUs: no layout divides them"
            continue
        head = "the smallest GPU count that fits with the memory margin"
        if hw.gpus_per_node < w:
            head += f" (whole {hw.gpus_per_node}-GPU nodes past one node)"
        full = _whole_node(m, hw, opts, auto_chunks, pins, sol)
        if full is not None:
            rejected = (f"{w} GPUs fit only with {_count_reason(sol, hw)} against "
                        f"{full.estimate.tokens_per_s_per_gpu:,.0f} on one {full.world}-GPU node with "
                        f"CP={full.layout.cp}")
            sol, head = full, "one whole node: a simpler layout at no less throughput per GPU"
        taken, cheapest = _count_by_cost(m, hw, opts, auto_chunks, pins, sol)
        if taken is not sol:
            a, b = sol.estimate.tokens_per_s_per_gpu, cheapest.estimate.tokens_per_s_per_gpu
            rejected = (f"{sol.world} GPUs fit only with {_lay_str(sol.layout)} at {a:,.0f} tok/s/GPU: {b / a:.2f}x "
                        f"the GPU-hours a token of {cheapest.world} GPUs ({b:,.0f}), and a slower step (--gpus "
                        f"{sol.world} takes them)")
            found = "the whole node" if full is not None else "the smallest that fits"
            sol, head = taken, (f"the smallest count within {COUNT_GAIN:g}x the fewest GPU-hours a token of any from "
                                f"{sol.world} ({found}) to {2 * sol.world}")
        sol.count = Decision(sol.world, head, f"CP={sol.layout.cp}, "
                             f"{100 * sol.estimate.headroom_gb / hw.usable_gb:.0f}% headroom",
                             {"headroom_gb": round(sol.estimate.headroom_gb, 2),
                              "margin_gb": round(_margin_gb(sol.estimate), 2)}, rejected=rejected)
        return sol
    if pins:
        near = ""
        if nearest is not None:
            _, w, lay, e = nearest
            what = "the pinned layout" if len(pins) == len(PIN_DIMS) else "the closest layout with these pins"
            near = f"; nearest: on {w} GPUs {_miss_str(hw, lay, e, what)}"
        raise InfeasibleError(f"{m.name} at {seq:,} tokens with {pin_str(pins)} pinned fits on no count of "
                              f"{hw.name} up to {MAX_WORLD} GPUs{near} — drop a pin, shorten --seq or use "
                              f"--micro-batch-tokens")
    raise InfeasibleError(f"{m.name} at {seq:,} tokens fits on no count of {hw.name} up to "
                          f"{MAX_WORLD} GPUs (persistent state {persistent_b / GB:,.0f} GB in all; the checkpointed "
                          f"layer inputs alone are {m.num_layers * seq * m.hidden_size * BF16 / GB:,.0f}"
                          f" GB) — shorten --seq or use --micro-batch-tokens")
