"""AdamW with fp32 master weights over a bf16 (or fp32) model, global gradient-norm clipping, and a loud stop on a
non-finite gradient.

The model's parameters hold the compute copy (bf16 on GPU). The update itself is PyTorch's own AdamW over fp32
master copies (its fused kernel on GPU, one pass reading master, grad and both moments; foreach on CPU): each step
casts the gradients to fp32 a group at a time (bounded extra memory: at most `group_numel` fp32 gradients live),
steps, and writes the masters back into the compute copy. Where the model is already fp32 the master *is* the
parameter (no copy). Persistent bytes per parameter: 2 (bf16 weight) + 2 (bf16 grad) + 4 (master) + 8 (moments) = 16.
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
        self.masters = [torch.nn.Parameter(m, requires_grad=False) if not isinstance(m, torch.nn.Parameter) else m
                        for m in self.masters]
        self.decays = [p.dim() >= 2 for p in self.params]  # no decay on norms, dt_bias, A_log
        self.num_steps = 0
        self.groups = self._groups(group_numel)
        fused = all(m.is_cuda for m in self.masters)
        groups = [{"params": [m for m, d in zip(self.masters, self.decays) if d], "weight_decay": weight_decay},
                  {"params": [m for m, d in zip(self.masters, self.decays) if not d], "weight_decay": 0.0}]
        self.opt = torch.optim.AdamW([g for g in groups if g["params"]], lr=lr, betas=betas, eps=eps,
                                     fused=fused or None, foreach=None if fused else True)

    @property
    def exp_avg(self) -> list[torch.Tensor]:
        return [self.opt.state[m]["exp_avg"] if m in self.opt.state else torch.zeros_like(m) for m in self.masters]

    @property
    def exp_avg_sq(self) -> list[torch.Tensor]:
        return [self.opt.state[m]["exp_avg_sq"] if m in self.opt.state else torch.zeros_like(m) for m in self.masters]

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
        for idx in self.groups:
            idx = [i for i in idx if self.params[i].grad is not None]
            if not idx:
                continue
            for i in idx:  # fp32 gradients for this group only; the master shares storage with an fp32 param
                g = self.params[i].grad
                g = g.to(self.masters[i].dtype) if self.masters[i] is not self.params[i] else g
                self.masters[i].grad = g.mul(clip) if clip != 1.0 else g
            self.opt.step()  # params whose .grad is None (other groups) are skipped
            for i in idx:
                self.masters[i].grad = None
                if self.masters[i].data_ptr() != self.params[i].data_ptr():
                    self.params[i].data.copy_(self.masters[i])
        return total_f

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    def state_dict(self) -> dict:
        return {"num_steps": self.num_steps, "masters": dict(zip(self.names, self.masters)),
                "exp_avg": dict(zip(self.names, self.exp_avg)), "exp_avg_sq": dict(zip(self.names, self.exp_avg_sq))}
