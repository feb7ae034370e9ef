"""Fused kernels. The LM head: cross-entropy and per-token log-probs without [tokens x vocab] logits."""

from kernels.lm_head import linear_cross_entropy, linear_logprobs

__all__ = ["linear_cross_entropy", "linear_logprobs"]
