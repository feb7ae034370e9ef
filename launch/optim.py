"""AdamW with fp32 master weights over a bf16 (or fp32) model, global gradient-norm clipping, and a loud stop on a
non-finite gradient.

The model's parameters hold the compute copy (bf16 on GPU). The optimizer holds an fp32 master copy and the two
moments; each step casts the gradients to fp32 a group at a time (bounded extra memory), updates the masters with
multi-tensor (`torch._foreach_*`) ops, and writes the masters back into the compute copy. Where the model is already
fp32 the master *is* the parameter (no copy). Persistent bytes per parameter: 2 (bf16 weight) + 2 (bf16 grad) +
4 (master) + 8 (moments) = 16.
"""

from __future__ import annotations

import math

import torch


class NonFiniteError(FloatingPointError):
    """A NaN or inf loss or gradient; the message names the step and, for gradients, the parameters."""


class MasterAdamW:
    def __init__(self, named_params, lr: float, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, max_grad_norm: float | None = 1.0,
                 master_dtype: torch.dtype = torch.float32, group_numel: int = 1 << 28):
        named = [(n, p) for n, p in named_params if p.requires_grad]
        if not named:
            raise ValueError("no trainable parameters")
        self.names = [n.replace("._checkpoint_wrapped_module", "") for n, _ in named]
        self.params = [p for _, p in named]
        self.lr, self.betas, self.eps = lr, betas, eps
        self.weight_decay, self.max_grad_norm = weight_decay, max_grad_norm
        self.masters = [p.data if p.dtype == master_dtype else p.detach().to(master_dtype).clone()
                        for p in self.params]
        self.exp_avg = [torch.zeros_like(m) for m in self.masters]
        self.exp_avg_sq = [torch.zeros_like(m) for m in self.masters]
        self.decays = [p.dim() >= 2 for p in self.params]  # no decay on norms, dt_bias, A_log
        self.num_steps = 0
        self.groups = self._groups(group_numel)

    def _groups(self, group_numel: int) -> list[list[int]]:
        groups, cur, used = [], [], 0
        for i, p in enumerate(self.params):
            if cur and used + p.numel() > group_numel:
                groups.append(cur)
                cur, used = [], 0
            cur.append(i)
            used += p.numel()
        return groups + [cur] if cur else groups

    @torch.no_grad()
    def grad_norm(self) -> torch.Tensor:
        norms = [torch.linalg.vector_norm(p.grad, dtype=torch.float32) for p in self.params if p.grad is not None]
        if not norms:
            raise RuntimeError("no gradients: call backward() before step()")
        return torch.linalg.vector_norm(torch.stack(norms))

    def nonfinite_params(self) -> list[str]:
        return [n for n, p in zip(self.names, self.params)
                if p.grad is not None and not bool(torch.isfinite(p.grad).all())]

    @torch.no_grad()
    def step(self, grad_norm: torch.Tensor | None = None) -> float:
        """One update; returns the pre-clip gradient norm. Raises NonFiniteError (and changes nothing) if the norm
        is not finite."""
        total = self.grad_norm() if grad_norm is None else grad_norm
        total_f = float(total)  # device sync: decides whether the step happens
        if not math.isfinite(total_f):
            bad = self.nonfinite_params()
            raise NonFiniteError(f"step {self.num_steps + 1}: gradient norm is {total_f}; non-finite gradients in "
                                 f"{bad[:5]}{'…' if len(bad) > 5 else ''}")
        clip = 1.0
        if self.max_grad_norm is not None and total_f > self.max_grad_norm:
            clip = self.max_grad_norm / (total_f + 1e-6)
        self.num_steps += 1
        b1, b2 = self.betas
        bc1, bc2 = 1 - b1 ** self.num_steps, 1 - b2 ** self.num_steps
        step_size = self.lr / bc1
        for idx in self.groups:
            idx = [i for i in idx if self.params[i].grad is not None]
            if not idx:
                continue
            masters = [self.masters[i] for i in idx]
            m = [self.exp_avg[i] for i in idx]
            v = [self.exp_avg_sq[i] for i in idx]
            grads = [self.params[i].grad.to(masters[0].dtype) for i in idx]
            if clip != 1.0:
                torch._foreach_mul_(grads, clip)
            torch._foreach_lerp_(m, grads, 1 - b1)  # m ← b1·m + (1 − b1)·g
            torch._foreach_mul_(v, b2)
            torch._foreach_addcmul_(v, grads, grads, 1 - b2)
            del grads
            denom = torch._foreach_sqrt(v)
            torch._foreach_div_(denom, math.sqrt(bc2))
            torch._foreach_add_(denom, self.eps)
            decay = [mt for i, mt in zip(idx, masters) if self.decays[i]]
            if self.weight_decay and decay:
                torch._foreach_mul_(decay, 1 - self.lr * self.weight_decay)
            torch._foreach_addcdiv_(masters, m, denom, -step_size)
            del denom
            for i in idx:
                if self.masters[i] is not self.params[i].data:
                    self.params[i].data.copy_(self.masters[i])
        return total_f

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    def state_dict(self) -> dict:
        return {"num_steps": self.num_steps, "masters": dict(zip(self.names, self.masters)),
                "exp_avg": dict(zip(self.names, self.exp_avg)), "exp_avg_sq": dict(zip(self.names, self.exp_avg_sq))}
