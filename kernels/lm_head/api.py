"""The LM head's front: cross-entropy, per-token log-probs and a policy loss of softmax(hidden @ weight.T /
temperature), without [T x V] logits in memory. softcap c (Gemma's final_logit_softcapping; None or 0: none) caps the
logits before the temperature: softmax(c tanh(hidden @ weight.T / c) / temperature).

Two modes, what a user chooses between (the plan's `lm_head`, `recipe solve --lm-head`):
    "fused" (default): the fastest. With the loss handed to the head (linear_cross_entropy with reduction mean or
            sum, linear_policy_loss) three logits-sized GEMMs (kernels/lm_head/fused.py); without it (log-probs,
            per-token cross-entropy) an autograd function whose backward recomputes the logits: four
            (kernels/lm_head/token_stats.py).
    "lean": the least memory. The loss handed to the head, nothing beside the two gradients but [T] vectors and a
            few MiB (kernels/lm_head/lean.py): four GEMMs. Losses only.
backend None runs Triton on CUDA tensors and torch elsewhere (kernels/lm_head/backends.py). Shape legend: T tokens,
H hidden size, V vocab rows on this rank (V_global = V * tp when tp_group is given: equal shards).
"""

from __future__ import annotations

import torch

from kernels.lm_head.backends import backend_module
from kernels.lm_head.fused import LossInHead, TokenLoss, fused_run
from kernels.lm_head.lean import lean_run
from kernels.lm_head.numerics import Head, check_inputs, local_target, softcap_value
from kernels.lm_head.token_stats import TokenStats

MODES = ("fused", "lean")


def _mode(mode: str | None) -> str:
    if mode is None:
        return "fused"
    if mode not in MODES:
        raise ValueError(f"mode must be 'fused', 'lean' or None, got {mode!r}")
    return mode


def _head(hidden, weight, target, temperature, softcap, tp_group, backend) -> Head:
    hidden, weight = check_inputs(hidden, weight, target, temperature)
    return Head(hidden, weight, local_target(target, weight.shape[0], tp_group), 1.0 / float(temperature), tp_group,
                backend_module(hidden, backend), softcap_value(softcap))


def _token_stats(hidden, weight, target, temperature, softcap, with_entropy, tp_group, backend, chunk_tokens,
                 chunk_vocab):
    head = _head(hidden, weight, target, temperature, softcap, tp_group, backend)
    return TokenStats.apply(head.hidden, head.weight, head, bool(with_entropy), chunk_tokens, chunk_vocab)


def _loss_in_head(hidden, weight, target, token_loss: TokenLoss, *, mode: str, temperature, softcap, with_entropy,
                  tp_group, backend, chunk_tokens):
    """(loss, tz, lse, ent): loss = sum of token_loss over the token groups, differentiable in hidden and weight;
    tz, lse, ent [T] fp32 detached (ent zeros unless with_entropy)."""
    head = _head(hidden, weight, target, temperature, softcap, tp_group, backend)
    run_path = lean_run if mode == "lean" else fused_run

    def run(need_h: bool, need_w: bool):
        return run_path(head, token_loss, bool(with_entropy), chunk_tokens, need_h, need_w)

    return LossInHead.apply(head.hidden, head.weight, run)


def linear_cross_entropy(hidden, weight, target, *, ignore_index: int = -100, reduction: str = "mean",
                         z_loss: float = 0.0, temperature: float = 1.0, softcap: float | None = None, tp_group=None,
                         backend=None, mode=None, chunk_tokens=None, chunk_vocab=None):
    """Cross-entropy of softmax(hidden @ weight.T / temperature) against target, plus z_loss * lse^2; with softcap c
    the logits are c tanh(logits / c) before the temperature (None or 0: no cap).

    hidden [T, H], weight [V, H] (this rank's V / tp rows when tp_group is given), target [T] global vocab indices.
    reduction "mean" (over non-ignored tokens; 0 when all are ignored), "sum" or "none" ([T], 0 at ignored
    tokens). mode "fused" (None) or "lean" (mean or sum only: the loss goes into the head). chunk_tokens: tokens
    per group or chunk; chunk_vocab: vocab rows per chunk of reduction "none".
    """
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
    mode = _mode(mode)
    valid_T = target != ignore_index
    if reduction != "none":  # the loss handed to the head
        weight_T = valid_T.float()
        if reduction == "mean":
            weight_T = weight_T / valid_T.sum().clamp_min(1)

        def token_loss(tz, lse, ent, t0, t1):
            per = lse - tz
            if z_loss:
                per = per + z_loss * lse.square()
            return per * weight_T[t0:t1]

        loss, *_ = _loss_in_head(hidden, weight, target, token_loss, mode=mode, temperature=temperature,
                                 softcap=softcap, with_entropy=False, tp_group=tp_group, backend=backend,
                                 chunk_tokens=chunk_tokens)
        return loss
    if mode == "lean":
        raise ValueError("mode='lean' needs the loss in the head: reduction 'mean' or 'sum' (or linear_policy_loss)")
    tz_T, lse_T, _ = _token_stats(hidden, weight, target, temperature, softcap, False, tp_group, backend,
                                  chunk_tokens, chunk_vocab)
    loss_T = lse_T - tz_T
    if z_loss:
        loss_T = loss_T + z_loss * lse_T.square()
    return torch.where(valid_T, loss_T, torch.zeros_like(loss_T))


def linear_logprobs(hidden, weight, target, *, temperature: float = 1.0, softcap: float | None = None,
                    with_entropy: bool = False, tp_group=None, backend=None, chunk_tokens=None, chunk_vocab=None):
    """Per-token log p(target) under softmax(hidden @ weight.T / temperature) (logits soft-capped first with
    softcap), fp32 [T], differentiable (the fused mode's autograd path: four logits-sized GEMMs with a backward).

    Negative targets (padding) give 0 and no gradient. with_entropy=True also returns the per-token entropy
    [T] (differentiable): (logprobs, entropy).
    """
    tz_T, lse_T, ent_T = _token_stats(hidden, weight, target, temperature, softcap, with_entropy, tp_group, backend,
                                      chunk_tokens, chunk_vocab)
    valid_T = target >= 0
    logp_T = torch.where(valid_T, tz_T - lse_T, torch.zeros_like(lse_T))
    if with_entropy:
        return logp_T, ent_T
    return logp_T


def linear_policy_loss(hidden, weight, target, token_loss, *, temperature: float = 1.0,
                       softcap: float | None = None, with_entropy: bool = False, tp_group=None, backend=None,
                       chunk_tokens=None, mode=None):
    """A loss on per-token log-probs (and entropies) of softmax(hidden @ weight.T / temperature) (logits soft-capped
    first with softcap), computed inside the head: mode "fused" (None) three logits-sized GEMMs
    (kernels/lm_head/fused.py), "lean" four and nothing beside the two gradients but a few MiB
    (kernels/lm_head/lean.py).

    token_loss(logp, ent, t0, t1) -> [t1 - t0] per-token contributions for tokens [t0, t1), whose sum over all
    tokens is the loss: logp and ent are fp32 [t1 - t0] (ent None unless with_entropy), differentiable; any
    normalizer must be fixed beforehand (token-mean: divide by the mask's sum). It is called once per token group,
    in token order, under autograd. Negative targets (padding) give logp 0 and no gradient.
    Returns (loss, logp [T], entropy [T] or None); loss is differentiable in hidden and weight, logp and entropy
    are detached (for metrics).
    """
    mode = _mode(mode)
    valid_T = target >= 0

    def on_stats(tz, lse, ent, t0, t1):
        logp = torch.where(valid_T[t0:t1], tz - lse, torch.zeros_like(lse))
        return token_loss(logp, ent, t0, t1)

    loss, tz_T, lse_T, ent_T = _loss_in_head(hidden, weight, target, on_stats, mode=mode, temperature=temperature,
                                             softcap=softcap, with_entropy=with_entropy, tp_group=tp_group,
                                             backend=backend, chunk_tokens=chunk_tokens)
    logp_T = torch.where(valid_T, tz_T - lse_T, torch.zeros_like(lse_T))
    return loss, logp_T, (ent_T if with_entropy else None)
