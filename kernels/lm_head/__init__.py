"""The fused LM head: cross-entropy, per-token log-probs and a policy loss without [T x V] logits.

The front is kernels/lm_head/api.py; underneath, one module per path (fused.py, lean.py, token_stats.py), the
numerics they share (numerics.py), one module per backend (torch_backend.py, triton_backend.py, chosen in
backends.py), the Triton tile tables (tiles.py) and the float64 reference (reference.py). docs/kernels.md derives it.
"""

from kernels.lm_head.api import MODES, linear_cross_entropy, linear_logprobs, linear_policy_loss

__all__ = ["MODES", "linear_cross_entropy", "linear_logprobs", "linear_policy_loss"]
