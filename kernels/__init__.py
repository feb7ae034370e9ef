"""Fused kernels. The LM head: cross-entropy, per-token log-probs and a fused policy loss without [tokens x vocab]
logits."""

from kernels.lm_head import linear_cross_entropy, linear_logprobs, linear_policy_loss

__all__ = ["linear_cross_entropy", "linear_logprobs", "linear_policy_loss"]
