"""Float64 references for the fused LM head: materialize the logits (small shapes only; tests and bench)."""

from __future__ import annotations

import torch


def token_stats_reference(hidden_TH, weight_VH, target_T, temperature: float = 1.0, softcap: float | None = None):
    """(x at target or 0, lse, entropy) per token, float64, from materialized logits [T, V_global]:
    x = logits / temperature, the logits first capped to softcap tanh(logits / softcap) when softcap is set."""
    z_TV = hidden_TH.double() @ weight_VH.double().T
    if softcap:
        z_TV = softcap * torch.tanh(z_TV / softcap)
    x_TV = z_TV / temperature
    lse_T = torch.logsumexp(x_TV, dim=1)
    logp_TV = x_TV - lse_T[:, None]
    ent_T = -(logp_TV.exp() * logp_TV).sum(1)
    V = weight_VH.shape[0]
    hit_T = (target_T >= 0) & (target_T < V)
    tz_T = torch.where(hit_T, x_TV.gather(1, target_T.clamp(0, V - 1)[:, None])[:, 0], 0.0)
    return tz_T, lse_T, ent_T


def linear_cross_entropy_reference(hidden_TH, weight_VH, target_T, *, ignore_index=-100, reduction="mean",
                                   z_loss=0.0, temperature=1.0, softcap=None):
    tz_T, lse_T, _ = token_stats_reference(hidden_TH, weight_VH, target_T, temperature, softcap)
    valid_T = target_T != ignore_index
    loss_T = torch.where(valid_T, lse_T - tz_T + z_loss * lse_T.square(), 0.0)
    if reduction == "none":
        return loss_T
    if reduction == "sum":
        return loss_T.sum()
    return loss_T.sum() / valid_T.sum().clamp_min(1)


def linear_logprobs_reference(hidden_TH, weight_VH, target_T, *, temperature=1.0, with_entropy=False, softcap=None):
    tz_T, lse_T, ent_T = token_stats_reference(hidden_TH, weight_VH, target_T, temperature, softcap)
    logp_T = torch.where(target_T >= 0, tz_T - lse_T, 0.0)
    return (logp_T, ent_T) if with_entropy else logp_T
