"""AdamW with fp32 master weights over a bf16 (or fp32) model, global gradient-norm clipping, and a loud stop on a
non-finite gradient.

The model's parameters hold the compute copy (bf16 on GPU). The update itself is PyTorch's own AdamW over fp32
master copies (its fused kernel on GPU, one pass reading master, grad and both moments, the clip taken inside as
its gradient scale; foreach on CPU, the clip a pass of its own): each step casts the gradients to fp32 a group at a
time (bounded extra memory: at most `group_numel` fp32 gradients live, or the one tensor larger than that; nothing
holds a group's casts past its update), steps, and writes the masters back into the compute copy. Where the model is already fp32 the master *is* the
parameter (no copy). Persistent bytes per parameter: 2 (bf16 weight) + 2 (bf16 grad) + 4 (master) + 8 (moments) = 16.

Under FSDP2 (launch/parallel.py) the parameters are fp32 DTensor shards and bf16 exists only while a layer is
gathered: the shard is its own master, its gradient arrives reduce-scattered in fp32, and the same 16 bytes per
parameter are spread over the ranks; the fused kernel takes the DTensor shards as they are. The gradient norm then sums each rank's local squares and all-reduces once
over the world (parameters on the dense mesh and on the expert mesh alike), so clipping sees the whole model.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _replicas(t: torch.Tensor) -> int:
    """How many ranks hold each element of t (a DTensor replicated along some mesh dimensions); 1 otherwise."""
    placements = getattr(t, "placements", ())
    return math.prod(t.device_mesh.size(i) for i, pl in enumerate(placements) if pl.is_replicate())


class NonFiniteError(FloatingPointError):
    """A NaN or inf loss or gradient; the message names the step and, for gradients, the parameters."""


class MasterAdamW:
    def __init__(self, named_params, lr: float, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, max_grad_norm: float | None = 1.0,
                 master_dtype: torch.dtype = torch.float32, group_numel: int = 1 << 28, fused: bool | None = None):
        named = [(n, p) for n, p in named_params if p.requires_grad]
        if not named:
            raise ValueError("no trainable parameters")
        self.names = [n.replace("._checkpoint_wrapped_module", "") for n, _ in named]
        self.params = [p for _, p in named]
        self.lr, self.betas, self.eps = lr, betas, eps
        self.weight_decay, self.max_grad_norm = weight_decay, max_grad_norm
        # an fp32 parameter is its own master (one process in fp32, or an FSDP2 shard)
        self.masters = [p if p.dtype == master_dtype else
                        torch.nn.Parameter(p.detach().to(master_dtype).clone(), requires_grad=False)
                        for p in self.params]
        # no decay on norms, dt_bias, A_log, biases (gpt-oss's per-expert ones are 2-D)
        self.decays = [p.dim() >= 2 and not n.endswith("bias") for n, p in zip(self.names, self.params)]
        self.distributed = any(hasattr(p, "device_mesh") for p in self.params)
        self.num_steps = 0
        self.groups = self._groups(group_numel)
        # one parameter group per (decay, mesh): foreach kernels take DTensors of one mesh at a time
        groups: dict[tuple, list] = {}
        for m, d in zip(self.masters, self.decays):
            groups.setdefault((d, id(getattr(m, "device_mesh", None))), []).append(m)
        # PyTorch's fused AdamW (one pass over master, gradient and moments; FSDP2's DTensor shards too) on GPU, its
        # foreach form elsewhere; the fused kernel also takes the clip, as a gradient scale (`grad_scale`)
        self.fused = all(m.is_cuda for m in self.masters) if fused is None else fused
        self.opt = torch.optim.AdamW([{"params": ps, "weight_decay": weight_decay if d else 0.0}
                                      for (d, _), ps in groups.items()], lr=lr, betas=betas, eps=eps,
                                     fused=self.fused or None, foreach=None if self.fused else True)
        # The moments exist from the start, as in a resumed run, so a fresh run lays out memory as a resumed one
        # does: made after the first backward they land in the blocks the activations freed (a 1-layer 32K run on
        # an H200 reserved 38.1 GB started fresh with lazy moments, 36.7 GB resumed).
        self._ensure_state()

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
        """The global L2 norm of all gradients (all ranks' shards together when the parameters are DTensors): one
        multi-tensor norm per (device, dtype, replica count) group of local gradients, not a kernel per tensor."""
        groups: dict[tuple, list[torch.Tensor]] = {}
        for p in self.params:
            if p.grad is not None:
                g = _local(p.grad)
                groups.setdefault((g.device, g.dtype, _replicas(p.grad)), []).append(g)
        if not groups:
            raise RuntimeError("no gradients: call backward() before step()")
        total = sum(torch.stack(torch._foreach_norm(gs, 2, dtype=torch.float32)).square().sum() / replicas
                    for (_, _, replicas), gs in groups.items())
        if self.distributed:
            dist.all_reduce(total)  # every rank holds a disjoint part of every sharded gradient
        return total.sqrt()

    def nonfinite_params(self) -> list[str]:
        """Parameters whose gradient holds a NaN/inf in this rank's shard."""
        return [n for n, p in zip(self.names, self.params)
                if p.grad is not None and not bool(torch.isfinite(_local(p.grad)).all())]

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
        # the clip: inside the fused kernel, which divides each gradient by grad_scale as it reads it; else a pass
        # scaling the gradients in place
        fold = self.fused and clip != 1.0
        self.opt.grad_scale = (torch.tensor(1.0 / clip, device=self.masters[0].device) if fold else None)
        own = [i for i, (m, p) in enumerate(zip(self.masters, self.params)) if m is p and p.grad is not None]
        if own:  # fp32 parameters are their own masters: one update over all of them
            if clip != 1.0 and not fold:
                torch._foreach_mul_([_local(self.params[i].grad) for i in own], clip)
            self.opt.step()
        held = {i: self.params[i].grad for i in own}
        for i in own:  # out of the way of the grouped updates below
            self.params[i].grad = None
        for idx in self.groups:
            idx = [i for i in idx if self.params[i].grad is not None]
            if not idx:
                continue
            for i in idx:  # fp32 gradients for this group only (bounded extra memory): a fresh cast, scaled in place
                self.masters[i].grad = self.params[i].grad.to(self.masters[i].dtype, copy=True)
                if clip != 1.0 and not fold:
                    self.masters[i].grad.mul_(clip)
            self.opt.step()  # masters whose .grad is None (other groups) are skipped
            for i in idx:
                self.masters[i].grad = None
                self.params[i].data.copy_(self.masters[i])
        for i, g in held.items():
            self.params[i].grad = g
        self.opt.grad_scale = None
        return total_f

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    # ---- checkpoints (torch.distributed.checkpoint's Stateful protocol) --------------------------------------
    def state_dict(self) -> dict:
        """Everything the update needs, keyed by parameter name only (no optimizer groups, no layout): the fp32
        masters, both moments and the step count. Sharded tensors stay DTensors, so a checkpoint written under one
        layout loads under another (DCP reshards by name and global shape); the bf16 compute copy is not saved (it
        is the masters, rounded)."""
        moments = [self.opt.state[m] for m in self.masters]
        return {"step": torch.tensor(self.num_steps, dtype=torch.int64),
                "master": dict(zip(self.names, self.masters)),
                "exp_avg": {n: st["exp_avg"] for n, st in zip(self.names, moments)},
                "exp_avg_sq": {n: st["exp_avg_sq"] for n, st in zip(self.names, moments)}}

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        """Take a state loaded in place by DCP (into the tensors `state_dict` returned): masters into the compute
        copy, the step count into every parameter's Adam step."""
        self.num_steps = int(state["step"])
        for m, p in zip(self.masters, self.params):
            self.opt.state[m]["step"].fill_(self.num_steps)
            if m is not p:
                p.data.copy_(m)

    def _ensure_state(self) -> None:
        """AdamW's per-parameter state as torch's AdamW creates it at its first step (zeros), made before any step:
        a checkpoint loads into it, and the moments take their memory before the activations do."""
        for group in self.opt.param_groups:
            on_device = bool(group.get("fused") or group.get("capturable"))
            for m in group["params"]:
                st = self.opt.state[m]
                if not st:
                    st["step"] = (torch.zeros((), dtype=torch.float32, device=_local(m).device) if on_device
                                  else torch.tensor(0.0, dtype=torch.float32))
                    st["exp_avg"] = torch.zeros_like(m, memory_format=torch.preserve_format)
                    st["exp_avg_sq"] = torch.zeros_like(m, memory_format=torch.preserve_format)
