"""Fused kernels: the LM head (kernels/lm_head/: cross-entropy, per-token log-probs and a policy loss without
[tokens x vocab] logits), the Gated DeltaNet helpers (kernels/gdn_fused.py), the RMSNorm (kernels/rms_norm.py) and
RoPE (kernels/rope.py)."""

from kernels.lm_head import linear_cross_entropy, linear_logprobs, linear_policy_loss

__all__ = ["linear_cross_entropy", "linear_logprobs", "linear_policy_loss"]
