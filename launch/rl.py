"""Per-token log-probs through the LM head, and the RL policy loss on them.

Shape legend: T tokens of one packed micro-batch. Every per-token tensor is aligned with the model's positions:
entry t belongs to the prediction made at position t, i.e. to the next token (launch/data.py shifts the rollout
fields that way). docs/training.md writes each loss out with a worked example.

Loss (per token t, with mask m_t, advantage A_t, ratio ρ_t = exp(logp_t − logp_old_t)):
    pg_t  = −min(ρ_t A_t, clip(ρ_t, 1 − ε_low, 1 + ε_high) A_t) · w_t     (w_t: truncated importance weight)
    kl_t  = k1: logp_t − logp_ref_t      k3: exp(logp_ref_t − logp_t) − (logp_ref_t − logp_t) − 1
    l_t   = pg_t + β_kl · kl_t − c_ent · H_t
aggregated by token-mean (Σ m l / Σ m over the micro-batch) or sequence-mean (mean over sequences of each
sequence's token mean).

Under context parallelism a rank holds part of a micro-batch: the trainer computes the weights w_t (token_weights)
and the loss-token count on the whole micro-batch and hands this rank's part of them in (`weights_T`,
`num_loss_tokens`), so each rank's loss and metrics are its share of the micro-batch's and they add up over ranks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

import kernels


def token_logprobs(hidden_TD: torch.Tensor, weight_VD: torch.Tensor, targets_T: torch.Tensor, *,
                   mode: Literal["fused", "lean", "naive"] = "fused", temperature: float = 1.0,
                   softcap: float | None = None, with_entropy: bool = False):
    """log p(target_t) [T] fp32 (and entropy [T]) under softmax(logits / temperature), the logits soft-capped to
    softcap · tanh(logits / softcap) first when softcap is set (Gemma's final_logit_softcapping; None or 0: not).
    `fused` and `lean` stream the vocabulary through kernels.linear_logprobs (no [T, V] logits; lean's memory saving
    needs the loss in the head, fused_policy_loss, so log-probs alone take the same path); `naive` materializes fp32
    logits. Negative targets give 0 and no gradient."""
    if mode in ("fused", "lean"):
        return kernels.linear_logprobs(hidden_TD, weight_VD, targets_T, temperature=temperature, softcap=softcap,
                                       with_entropy=with_entropy)
    if mode != "naive":
        raise ValueError(f"lm_head must be 'fused', 'lean' or 'naive', got {mode!r}")
    logits_TV = F.linear(hidden_TD, weight_VD).float()
    if softcap:
        logits_TV = softcap * torch.tanh(logits_TV / softcap)
    logits_TV = logits_TV / temperature
    logp_TV = torch.log_softmax(logits_TV, dim=-1)
    valid_T = targets_T >= 0
    logp_T = logp_TV.gather(1, targets_T.clamp(min=0)[:, None]).squeeze(1) * valid_T
    if with_entropy:
        return logp_T, -(logp_TV.exp() * logp_TV).sum(-1)
    return logp_T


@dataclass
class LossConfig:
    clip_low: float = 0.2  # ε_low: ratio floor 1 − ε_low
    clip_high: float = 0.28  # ε_high: ratio ceiling 1 + ε_high (DAPO-style clip-higher when > clip_low)
    kl_coef: float = 0.0  # β_kl; 0 turns the KL term off
    kl_estimator: Literal["k1", "k3"] = "k3"
    entropy_coef: float = 0.0  # c_ent: entropy bonus
    aggregation: Literal["token_mean", "seq_mean"] = "token_mean"
    tis_cap: float | None = 2.0  # truncated importance weight cap C (None: no correction)

    def __post_init__(self):
        if self.clip_low < 0 or self.clip_high < 0 or self.clip_low >= 1:
            raise ValueError(f"clip_low must be in [0, 1) and clip_high ≥ 0, got {self.clip_low}, {self.clip_high}")
        if self.kl_estimator not in ("k1", "k3"):
            raise ValueError(f"kl_estimator must be k1 or k3, got {self.kl_estimator!r}")
        if self.aggregation not in ("token_mean", "seq_mean"):
            raise ValueError(f"aggregation must be token_mean or seq_mean, got {self.aggregation!r}")
        if self.tis_cap is not None and self.tis_cap <= 0:
            raise ValueError(f"tis_cap must be positive or None, got {self.tis_cap}")


def kl_penalty(logp_T: torch.Tensor, ref_logp_T: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token estimate of KL(π ‖ π_ref) from samples of π: k1 = log π − log π_ref (unbiased, can be negative);
    k3 = r − log r − 1 with r = π_ref/π (unbiased, ≥ 0, lower variance)."""
    log_r = ref_logp_T - logp_T
    if estimator == "k1":
        return -log_r
    return torch.exp(log_r) - log_r - 1.0


def token_weights(mask_T: torch.Tensor, seq_id_T: torch.Tensor | None, how: str) -> torch.Tensor:
    """w_T with aggregate(x) = Σ_t w_t x_t, fixed by the masks alone (which is what lets the fused head take the
    loss token by token): token_mean w = m / Σ m; seq_mean w = m / (tokens of t's sequence · sequences with
    tokens). All-masked gives w = 0."""
    mask = mask_T.float()
    if how == "token_mean":
        return mask / mask.sum().clamp(min=1.0)
    if how != "seq_mean":
        raise ValueError(f"aggregation must be token_mean or seq_mean, got {how!r}")
    if seq_id_T is None:
        raise ValueError("seq_mean aggregation needs seq_id_T")
    num_seqs = int(seq_id_T.max()) + 1 if seq_id_T.numel() else 0
    counts = torch.zeros(num_seqs, dtype=mask.dtype, device=mask.device).index_add_(0, seq_id_T, mask)
    num_with_tokens = (counts > 0).sum().clamp(min=1)
    return mask / (counts[seq_id_T].clamp(min=1.0) * num_with_tokens)


def aggregate(x_T: torch.Tensor, mask_T: torch.Tensor, seq_id_T: torch.Tensor | None, how: str) -> torch.Tensor:
    return (token_weights(mask_T, seq_id_T, how).to(x_T.dtype) * torch.where(mask_T.bool(), x_T, 0.0)).sum()


def token_losses(logp_T: torch.Tensor, advantages_T: torch.Tensor, mask_T: torch.Tensor, cfg: LossConfig, *,
                 old_logp_T: torch.Tensor | None = None, ref_logp_T: torch.Tensor | None = None,
                 rollout_logp_T: torch.Tensor | None = None, entropy_T: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, dict[str, torch.Tensor | None]]:
    """Per-token loss l_t (the module docstring's formula) and its parts; the one place the formula lives (the
    unfused policy_loss and the fused head both call it). Masked-out tokens (prompts, padding) get neutral inputs
    (advantage 0, old/ref/rollout log-probs equal to the current ones) so whatever a rollout file holds there, NaN
    included, reaches neither the loss nor, through 0 · NaN in autograd, the gradients."""
    mask = mask_T.bool()
    cur = logp_T.detach()
    advantages_T = torch.where(mask, advantages_T, 0.0)
    old = cur if old_logp_T is None else torch.where(mask, old_logp_T, cur)
    ref_logp_T = None if ref_logp_T is None else torch.where(mask, ref_logp_T, cur)
    rollout_logp_T = None if rollout_logp_T is None else torch.where(mask, rollout_logp_T, old)
    log_ratio = logp_T - old
    ratio = torch.exp(log_ratio)
    surr1 = ratio * advantages_T
    surr2 = torch.clamp(ratio, 1.0 - cfg.clip_low, 1.0 + cfg.clip_high) * advantages_T
    pg_T = -torch.minimum(surr1, surr2)
    tis_w = None
    if rollout_logp_T is not None and cfg.tis_cap is not None:
        tis_w = torch.exp(old - rollout_logp_T).clamp(max=cfg.tis_cap).detach()
        pg_T = pg_T * tis_w
    loss_T = pg_T
    kl_T = None
    if ref_logp_T is not None and cfg.kl_coef:
        kl_T = kl_penalty(logp_T, ref_logp_T, cfg.kl_estimator)
        loss_T = loss_T + cfg.kl_coef * kl_T
    if cfg.entropy_coef:
        if entropy_T is None:
            raise ValueError("entropy_coef > 0 needs entropy_T (token_logprobs(..., with_entropy=True))")
        loss_T = loss_T - cfg.entropy_coef * entropy_T
    return loss_T, dict(pg=pg_T, kl=kl_T, tis_w=tis_w, surr1=surr1, surr2=surr2, log_ratio=log_ratio)


def policy_loss(logp_T: torch.Tensor, advantages_T: torch.Tensor, mask_T: torch.Tensor, cfg: LossConfig, *,
                old_logp_T: torch.Tensor | None = None, ref_logp_T: torch.Tensor | None = None,
                rollout_logp_T: torch.Tensor | None = None, entropy_T: torch.Tensor | None = None,
                seq_id_T: torch.Tensor | None = None, weights_T: torch.Tensor | None = None,
                num_loss_tokens: torch.Tensor | float | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO/GRPO clipped surrogate on per-token log-probs. Returns (loss, metrics as 0-d tensors, detached).

    old_logp: the trainer's log-probs under the policy that sampled (None: on-policy, the detached current ones).
    rollout_logp: the rollout engine's own log-probs; with cfg.tis_cap the per-token surrogate is weighted by
    min(exp(old_logp − rollout_logp), cap), detached (truncated importance sampling).
    weights_T / num_loss_tokens: the aggregation weights and the loss-token count of the whole micro-batch when
    these tokens are part of it (None: computed from these tokens' masks).
    """
    loss_T, parts = token_losses(logp_T, advantages_T, mask_T, cfg, old_logp_T=old_logp_T, ref_logp_T=ref_logp_T,
                                 rollout_logp_T=rollout_logp_T, entropy_T=entropy_T)
    if weights_T is None:
        loss = aggregate(loss_T, mask_T, seq_id_T, cfg.aggregation)
    else:
        loss = (weights_T.to(loss_T.dtype) * torch.where(mask_T.bool(), loss_T, 0.0)).sum()
    return loss, _metrics(loss, parts, mask_T, entropy_T, num_loss_tokens)


def _count(mask_T: torch.Tensor, num_loss_tokens) -> torch.Tensor:
    """The token-mean denominator: these tokens' loss-token count, or the whole micro-batch's when given."""
    n = mask_T.float().sum() if num_loss_tokens is None else torch.as_tensor(num_loss_tokens, dtype=torch.float32,
                                                                               device=mask_T.device)
    return n.clamp(min=1.0)


def _metrics(loss, parts, mask_T, entropy_T, num_loss_tokens=None) -> dict[str, torch.Tensor]:
    with torch.no_grad():
        mask = mask_T.bool()
        m = mask.float()
        n = _count(mask_T, num_loss_tokens)
        clipped = (parts["surr2"] < parts["surr1"]) & mask  # the clipped branch is taken (and carries no gradient)
        log_ratio = parts["log_ratio"]
        metrics = {
            "loss": loss.detach(),
            "pg_loss": (parts["pg"] * m).sum() / n,
            "clip_frac": clipped.float().sum() / n,
            "approx_kl": ((torch.exp(-log_ratio) + log_ratio - 1.0) * m).sum() / n,  # k3 of KL(old ‖ new)
            "num_tokens": m.sum(),
        }
        if entropy_T is not None:
            metrics["entropy"] = (entropy_T * m).sum() / n
        if parts["kl"] is not None:
            metrics["kl_ref"] = (parts["kl"] * m).sum() / n
        if parts["tis_w"] is not None:
            metrics["tis_weight"] = (parts["tis_w"] * m).sum() / n
    return {k: v.detach() for k, v in metrics.items()}


def fused_policy_loss(hidden_TD: torch.Tensor, weight_VD: torch.Tensor, targets_T: torch.Tensor,
                      advantages_T: torch.Tensor, mask_T: torch.Tensor, cfg: LossConfig, *, temperature: float = 1.0,
                      softcap: float | None = None, old_logp_T: torch.Tensor | None = None,
                      ref_logp_T: torch.Tensor | None = None, rollout_logp_T: torch.Tensor | None = None,
                      seq_id_T: torch.Tensor | None = None,
                      impl: str | None = None, weights_T: torch.Tensor | None = None,
                      num_loss_tokens: torch.Tensor | float | None = None, tp_group=None
                      ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """policy_loss(token_logprobs(...)) with the loss handed to the LM head (kernels.linear_policy_loss): the head
    knows each token's gradient as soon as its log-prob is known and runs three logits-sized GEMMs, not four.
    `impl` is the head's mode: "fused" (None) or "lean" (four GEMMs, holding nothing beside the two gradients but
    a few MiB). Same per-token formula
    (token_losses) and weights (token_weights, or `weights_T` as policy_loss's); metrics from the detached
    log-probs. `tp_group`: `weight_VD` is this rank's equal share of the vocabulary rows (vocabulary-parallel
    head; every rank of the group holds the same tokens and gets the same loss). `softcap`: as token_logprobs'."""
    w_T = token_weights(mask_T, seq_id_T, cfg.aggregation) if weights_T is None else weights_T
    mask_b = mask_T.bool()

    def sl(x, t0, t1):
        return None if x is None else x[t0:t1]

    def token_loss(logp, ent, t0, t1):
        loss_t, _ = token_losses(logp, advantages_T[t0:t1], mask_b[t0:t1], cfg, old_logp_T=sl(old_logp_T, t0, t1),
                                 ref_logp_T=sl(ref_logp_T, t0, t1), rollout_logp_T=sl(rollout_logp_T, t0, t1),
                                 entropy_T=ent)
        return torch.where(mask_b[t0:t1], loss_t, 0.0) * w_T[t0:t1]

    loss, logp_T, ent_T = kernels.linear_policy_loss(hidden_TD, weight_VD, targets_T, token_loss,
                                                     temperature=temperature, softcap=softcap, with_entropy=True,
                                                     mode=impl, tp_group=tp_group)
    _, parts = token_losses(logp_T, advantages_T, mask_T, cfg, old_logp_T=old_logp_T, ref_logp_T=ref_logp_T,
                            rollout_logp_T=rollout_logp_T, entropy_T=ent_T)
    return loss, _metrics(loss, parts, mask_T, ent_T, num_loss_tokens)


def fused_nll_loss(hidden_TD: torch.Tensor, weight_VD: torch.Tensor, targets_T: torch.Tensor, mask_T: torch.Tensor,
                   *, temperature: float = 1.0, softcap: float | None = None, impl: str | None = None,
                   weights_T: torch.Tensor | None = None, num_loss_tokens: torch.Tensor | float | None = None,
                   tp_group=None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """SFT objective through the fused head (impl, tp_group and softcap as fused_policy_loss's): token-mean negative
    log-likelihood over mask_T, plus metrics (weights_T / num_loss_tokens as policy_loss's)."""
    w_T = token_weights(mask_T, None, "token_mean") if weights_T is None else weights_T
    loss, _, ent_T = kernels.linear_policy_loss(hidden_TD, weight_VD, targets_T,
                                                lambda logp, ent, t0, t1: -logp * w_T[t0:t1],
                                                temperature=temperature, softcap=softcap, with_entropy=True,
                                                mode=impl, tp_group=tp_group)
    m = mask_T.float()
    n = _count(mask_T, num_loss_tokens)
    return loss, {"loss": loss.detach(), "entropy": ((ent_T * m).sum() / n).detach(), "num_tokens": m.sum()}
