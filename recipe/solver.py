"""The solver: TP, EP and CP each from its one binding constraint, PP a final tie-break, DP and expert-DP what
remains. Each `solve_*` returns a `Decision`: the value, the constraint that decided it, the numbers behind it and
the alternative it rejected with its figure. The rules are derived in docs/solver.md.

Pure Python: never imports torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .cost import Estimate, Layout, TrainOptions, default_ep_chunks, estimate
from .cost import BF16, BYTES_UNSHARDED, GB, layer_params
from .hw import HwProfile
from .models import ModelShape, param_counts

MAX_WORLD = 4096
PP_TIE_BREAK = 0.03  # a deeper pipeline (or wider TP, or larger CP for a cheaper EP) must be this much faster per token


class InfeasibleError(ValueError):
    """No layout fits; the message names the binding constraint and by how much."""


@dataclass
class Decision:
    value: int
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

    @property
    def degrees(self) -> dict[str, int]:
        return self.layout.degrees(self.world)



def _over(peak_gb: float, usable_gb: float) -> str:
    """'X GB > Y' with as many decimals as it takes for X and Y to differ (172.84 > 172.80 is not '172.8 > 172.8')."""
    for digits in (1, 2, 3):
        a, b = f"{peak_gb:.{digits}f}", f"{usable_gb:.{digits}f}"
        if a != b:
            return f"{a} GB > {b}"
    return f"{peak_gb:.4f} GB > {usable_gb:.4f}"

def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


# ---- candidate values (divisibility) -------------------------------------------------------------------------
def tp_candidates(m: ModelShape, hw: HwProfile, ranks: int) -> list[int]:
    """TP splits heads, KV heads, linear-attention heads and the vocab; it stays inside a node."""
    out = []
    for t in divisors(ranks):
        if t > hw.gpus_per_node or m.num_heads % t or m.num_kv_heads % t or m.vocab_size % t:
            continue
        if m.linear_attn is not None and m.linear_attn.num_k_heads % t:
            continue
        out.append(t)
    return out


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
    return [p for p in divisors(world) if m.num_layers % p == 0]


# ---- one rule per dimension ----------------------------------------------------------------------------------
def _opts_for(base: TrainOptions, seq_local: float, ep: int, auto_chunks: bool) -> TrainOptions:
    if not auto_chunks:
        return base
    return base.model_copy(update={"ep_overlap_chunks": default_ep_chunks(seq_local, ep)})


def _ep_numbers(m: ModelShape, ranks: int, ep: int) -> dict:
    _, layer_expert = layer_params(m)
    edp = ranks // ep
    return {"experts_per_rank": m.num_experts // ep, "expert_dp": edp,
            "unsharded_expert_layer_gb": round(layer_expert / ep * BYTES_UNSHARDED / GB, 3),
            "expert_fsdp_gb_per_layer": round(layer_expert / ep * (edp - 1) / edp * (2 * BF16 + 4) / GB, 3)}


def default_ep(m: ModelShape, hw: HwProfile, ranks: int) -> int:
    """The starting point: the largest ep inside one node (the fast all-to-all domain)."""
    cands = ep_candidates(m, ranks)
    return max([e for e in cands if e <= hw.gpus_per_node] or cands[:1])


def solve_ep(m: ModelShape, hw: HwProfile, world: int, pp: int, tp: int, cp: int, opts: TrainOptions,
             auto_chunks: bool) -> tuple[Decision, Estimate]:
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
    for e in ep_candidates(m, ranks):
        o = _opts_for(opts, opts.micro_batch_tokens / cp, e, auto_chunks)
        est = estimate(m, hw, world, Layout(pp=pp, tp=tp, cp=cp, ep=e), o)
        if est.fits:
            scored[e] = est
    if not scored:
        e = default_ep(m, hw, ranks)
        o = _opts_for(opts, opts.micro_batch_tokens / cp, e, auto_chunks)
        est = estimate(m, hw, world, Layout(pp=pp, tp=tp, cp=cp, ep=e), o)
        return Decision(e, "expert memory and traffic", "no ep fits at this cp", _ep_numbers(m, ranks, e)), est
    best_t = min(x.step_time_s for x in scored.values())
    near = [e for e, x in scored.items() if x.step_time_s <= best_t * 1.01]
    in_node = [e for e in near if e <= hw.gpus_per_node]
    ep = max(in_node) if in_node else min(near)
    est = scored[ep]
    n = _ep_numbers(m, ranks, ep)
    n["exposed_moe_comm_s"] = round(est.time_s["ep_exposed"] + est.time_s["fsdp_exposed"], 4)
    others = sorted((e for e in scored if e != ep), key=lambda e: scored[e].step_time_s)
    rejected = ""
    if others:
        a = others[0]
        rejected = (f"ep={a}: {scored[a].step_time_s:.3f} s/step vs {est.step_time_s:.3f} "
                    f"(exposed all-to-all {scored[a].time_s['ep_exposed']:.3f} s, expert FSDP "
                    f"{scored[a].time_s['fsdp_exposed']:.3f} s)")
    where = "inside one node" if ep <= hw.gpus_per_node else f"across {ep // hw.gpus_per_node} nodes"
    return Decision(
        value=ep, constraint="exposed MoE communication (expert FSDP vs all-to-all)",
        reason=(f"{n['experts_per_rank']} experts/rank, {where}; expert FSDP {n['expert_fsdp_gb_per_layer']:.2f} "
                f"GB/layer, unsharded expert layer {n['unsharded_expert_layer_gb']:.2f} GB"),
        numbers=n, rejected=rejected,
    ), est


def solve_cp(m: ModelShape, hw: HwProfile, world: int, pp: int, tp: int, ep: int, opts: TrainOptions,
             auto_chunks: bool) -> tuple[Decision | None, Estimate | None, dict]:
    """CP: the smallest context-parallel degree at which the activations fit in what persistent state leaves.

    Persistent state under FSDP2 does not depend on cp (everything is sharded over all ranks of a stage), while the
    activations scale with the local sequence s/cp; so the first cp that fits is the answer, and cp=1 whenever the
    full sequence fits — no fixed window. Returns (decision, estimate, tried) — (None, None, tried) if none fits."""
    ranks = world // (pp * tp)
    tried = {}
    for c in cp_candidates(m, opts.micro_batch_tokens, ranks, tp):
        lay = Layout(pp=pp, tp=tp, cp=c, ep=ep)
        o = _opts_for(opts, opts.micro_batch_tokens / c, ep, auto_chunks)
        est = estimate(m, hw, world, lay, o)
        tried[c] = est
        if est.fits:
            prev = tried.get(max((k for k in tried if k < c), default=0))
            if c == 1:
                reason = (f"the full {opts.micro_batch_tokens:,}-token sequence fits: peak {est.total_gb:.1f} GB "
                          f"of {hw.usable_gb:.1f} GB usable")
                rejected = ""
            else:
                reason = (f"activations at s/cp={opts.micro_batch_tokens // c:,} tokens leave peak "
                          f"{est.total_gb:.1f} GB of {hw.usable_gb:.1f} GB usable")
                rejected = f"cp={max(k for k in tried if k < c)}: peak {_over(prev.total_gb, hw.usable_gb)}"
            d = Decision(value=c, constraint="activation memory", reason=reason,
                         numbers={"local_tokens": opts.micro_batch_tokens // c,
                                  "activations_gb": round(est.memory_gb["activations"], 2),
                                  "persistent_gb": round(sum(est.memory_gb[k] for k in
                                                             ("weights", "grads", "master", "optimizer")), 2),
                                  "headroom_gb": round(est.headroom_gb, 2)},
                         rejected=rejected)
            return d, est, tried
    return None, None, tried


def _sequence_split(m, hw, world, pp, t, opts, auto_chunks):
    """CP by memory at the in-node EP; EP by exposed communication at that local sequence; CP re-checked with the
    chosen EP (a smaller ep holds a larger unsharded expert layer)."""
    ranks = world // pp
    cp_d, est, tried = solve_cp(m, hw, world, pp, t, default_ep(m, hw, ranks), opts, auto_chunks)
    for e in ep_candidates(m, ranks):
        if cp_d is not None:
            break
        if e > default_ep(m, hw, ranks):
            # the in-node EP leaves too large an unsharded expert layer: spread the experts over more ranks
            cp_d, est, tried = solve_cp(m, hw, world, pp, t, e, opts, auto_chunks)
    if cp_d is None:
        return None, None, None, tried
    ep_d, _ = solve_ep(m, hw, world, pp, t, cp_d.value, opts, auto_chunks)
    cp_d, est, tried = solve_cp(m, hw, world, pp, t, ep_d.value, opts, auto_chunks)
    assert cp_d is not None, "solve_ep only picks an ep that fits at the cp it was given"
    # a larger ep shrinks the unsharded expert layer: if that lets a smaller cp fit, it may be the faster split
    for e in ep_candidates(m, ranks):
        if e <= ep_d.value or cp_d.value == 1:
            continue
        cp2, est2, _ = solve_cp(m, hw, world, pp, t, e, opts, auto_chunks)
        if cp2 is not None and cp2.value < cp_d.value and (_per_token(est2, world, pp, t, cp2.value)
                                                           < _per_token(est, world, pp, t, cp_d.value)):
            cp_d = cp2  # EP again at the shorter local sequence: e fits there, so some ep does
            ep_d, est = solve_ep(m, hw, world, pp, t, cp_d.value, opts, auto_chunks)
    # the converse: a smaller ep needs fewer all-to-alls but holds a larger unsharded expert layer; if the next CP
    # step makes room for it and that is at least PP_TIE_BREAK faster per token, take it
    nxt = [c for c in cp_candidates(m, opts.micro_batch_tokens, ranks // t, t) if c > cp_d.value]
    if nxt and ep_d.value > 1:
        c2 = nxt[0]
        ep2, est2 = solve_ep(m, hw, world, pp, t, c2, opts, auto_chunks)
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
    return cp_d, ep_d, est, tried


def _per_token(est: Estimate, world: int, pp: int, tp: int, cp: int) -> float:
    """Seconds per token of the whole job: step time over tokens per step (∝ step·pp·tp·cp at a fixed world)."""
    return est.step_time_s * pp * tp * cp


def solve_tp(m: ModelShape, hw: HwProfile, world: int, pp: int, opts: TrainOptions, auto_chunks: bool):
    """TP: 1 unless one layer does not fit at any CP, or a TP group inside the node splits a sequence more cheaply
    than the CP group it replaces (per-layer communication); then the smallest TP that fits, or the faster one
    if it is at least PP_TIE_BREAK faster per token. TP is the only dimension that shrinks one layer's width
    (heads, recompute working set, the vocab of the head)."""
    ranks = world // pp
    first_fail = None
    found = []
    for t in tp_candidates(m, hw, ranks):
        cp_d, ep_d, est, tried = _sequence_split(m, hw, world, pp, t, opts, auto_chunks)
        if cp_d is not None:
            found.append((t, cp_d, ep_d, est))
        elif first_fail is None and tried:
            c = max(tried)
            first_fail = (c, tried[c])
    if not found:
        return None, None, None, first_fail
    base = found[0]
    fastest = min(found, key=lambda f: _per_token(f[3], world, pp, f[0], f[1].value))
    speed = lambda f: _per_token(f[3], world, pp, f[0], f[1].value)  # noqa: E731
    t, cp_d, ep_d, est = base
    if fastest is not base and speed(fastest) < speed(base) * (1 - PP_TIE_BREAK):
        t, cp_d, ep_d, est = fastest
        d = Decision(t, "per-layer communication",
                     f"tp={t} with cp={cp_d.value} is {100 * (1 - speed(fastest) / speed(base)):.0f}% faster per "
                     f"token than tp={base[0]} with cp={base[1].value}: TP's in-node exchange costs less than the "
                     f"CP exchange it replaces",
                     {"peak_gb": round(est.total_gb, 2)},
                     rejected=f"tp={base[0]}, cp={base[1].value}: {base[3].step_time_s:.3f} s/step")
    elif t == 1:
        d = Decision(1, "per-layer memory", "one layer fits one GPU at some cp: no tensor split needed",
                     {"peak_gb": round(est.total_gb, 2)})
    else:
        fail_cp, fail_est = first_fail
        d = Decision(t, "per-layer memory", f"tp={t} is the smallest tensor split at which some cp fits",
                     {"peak_gb": round(est.total_gb, 2)},
                     rejected=f"tp=1, cp={fail_cp}: peak {_over(fail_est.total_gb, hw.usable_gb)}")
    return d, ep_d, cp_d, est


def solve(m: ModelShape, hw: HwProfile, world: int, opts: TrainOptions, auto_chunks: bool = True,
          suggest: bool = True) -> Solution:
    """Solve every dimension for `world` GPUs. Raises InfeasibleError naming the constraint and the shortfall."""
    _check_world(m, world)
    results = []
    closest = None  # (shortfall_gb, pp, cp, estimate) of the nearest miss
    for p in pp_candidates(m, world):
        tp_d, ep_d, cp_d, est = solve_tp(m, hw, world, p, opts, auto_chunks)
        if tp_d is None:
            if est is not None:
                c, e = est
                short = e.total_gb - hw.usable_gb
                if closest is None or short < closest[0]:
                    closest = (short, p, c, e)
            continue
        results.append((p, tp_d, ep_d, cp_d, est))
    if not results:
        raise InfeasibleError(_infeasible_message(m, hw, world, opts, closest, suggest))
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
    o = _opts_for(opts, opts.micro_batch_tokens / cp_d.value, ep_d.value, auto_chunks)
    est = estimate(m, hw, world, layout, o)
    assert est.fits, f"solver chose a layout that does not fit: {layout}"
    return Solution(world=world, layout=layout, opts=o, estimate=est,
                    decisions={"tp": tp_d, "ep": ep_d, "cp": cp_d, "pp": pp_d})


def _check_world(m: ModelShape, world: int) -> None:
    if world < 1 or world > MAX_WORLD:
        raise InfeasibleError(f"--gpus must be between 1 and {MAX_WORLD}, got {world}")


def _infeasible_message(m: ModelShape, hw: HwProfile, world: int, opts: TrainOptions, closest,
                        suggest: bool = True) -> str:
    seq = opts.micro_batch_tokens
    if closest is None:
        return (f"{world} GPUs: no layout divides them for {m.name} at {seq:,} tokens (cp must split the sequence "
                f"into 2·cp equal segments{' of whole delta-rule chunks' if m.linear_attn else ''}, "
                f"ep must divide {m.num_experts} experts, pp the {m.num_layers} layers)")
    short, p, c, e = closest
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
        nxt = _next_fitting(m, hw, world, opts)
        why += f" — {nxt} GPUs fit" if nxt else " — add GPUs or shorten --seq"
    return (f"{m.name} at {seq:,} tokens does not fit on {world}x {hw.name}: best layout tried (pp={p}, cp={c}) "
            f"peaks at {e.total_gb:.1f} GB against {hw.usable_gb:.1f} GB usable ({short:.1f} GB over; persistent "
            f"state {persistent:.1f} GB, activations {e.memory_gb['activations']:.1f} GB){why}")


def _next_fitting(m: ModelShape, hw: HwProfile, world: int, opts: TrainOptions) -> int | None:
    """The smallest larger GPU count (up to twice as many) at which some layout fits."""
    for w in range(world + 1, 2 * world + 1):
        try:
            solve(m, hw, w, opts, suggest=False)
            return w
        except InfeasibleError:
            continue
    return None


def world_candidates(hw: HwProfile) -> list[int]:
    small = [w for w in (1, 2, 4) if w < hw.gpus_per_node]
    return small + [hw.gpus_per_node * n for n in range(1, MAX_WORLD // hw.gpus_per_node + 1)]


def solve_min_gpus(m: ModelShape, hw: HwProfile, opts: TrainOptions, auto_chunks: bool = True) -> Solution:
    """The smallest GPU count (1, 2, 4, then whole nodes) at which some layout fits."""
    persistent_b = sum(param_counts(m).values()) * 16  # weights, grads, master, Adam: sharded over all ranks
    for w in world_candidates(hw):
        # lower bounds that need no solve: persistent state is sharded over all w ranks; even at cp = w every
        # rank keeps its slice of each layer's checkpointed input
        floor_b = persistent_b / w + m.num_layers * opts.micro_batch_tokens / w * m.hidden_size * BF16
        if floor_b / GB + hw.overhead_gb > hw.usable_gb:
            continue
        try:
            return solve(m, hw, w, opts, auto_chunks, suggest=False)
        except InfeasibleError:
            continue
    raise InfeasibleError(f"{m.name} at {opts.micro_batch_tokens:,} tokens fits on no count of {hw.name} up to "
                          f"{MAX_WORLD} GPUs (persistent state {persistent_b / GB:,.0f} GB in all; the checkpointed "
                          f"layer inputs alone are {m.num_layers * opts.micro_batch_tokens * m.hidden_size * BF16 / GB:,.0f}"
                          f" GB) — shorten --seq or use --micro-batch-tokens")
