"""The training core on one process: library (`Trainer`) and CLI (`python -m launch.train plan.yaml`).

One step: for each packed micro-batch, forward (each decoder layer under full recompute), per-token log-probs
through the fused LM head, the policy loss, backward; then AdamW on fp32 masters with gradient clipping. A NaN/inf
loss or gradient stops the run with the step number (or, with on_nonfinite="skip", skips that update and reports it).

Aggregation across micro-batches is exact: a token-mean loss is weighted by each micro-batch's share of the step's
loss tokens, a sequence-mean loss by its share of sequences, so splitting a step into micro-batches does not change
the gradient. Under context parallelism (a model parallelized with cp > 1 carries `context_parallel`) each rank runs
its zigzag shard of every micro-batch of its share, with the aggregation weights and loss-token count of the whole
micro-batch, so its loss, gradient and metrics are its part of the micro-batch's and they add up over the cp ranks.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
from dataclasses import dataclass, field

import torch

from launch.data import Batch
from launch.model import Transformer, logits_divisor
from launch.optim import MasterAdamW, NonFiniteError
from launch.recompute import apply_recompute
from launch.rl import LossConfig, fused_nll_loss, fused_policy_loss, policy_loss, token_logprobs, token_weights

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


@dataclass
class TrainConfig:
    """Training hyper-parameters the plan does not carry (the plan holds layout, recompute, head, micro-batch)."""

    lr: float = 1e-6
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.01
    max_grad_norm: float | None = 1.0
    objective: str = "rl"  # rl: policy loss; sft: token-mean negative log-likelihood on loss_mask tokens
    temperature: float = 1.0  # sampling temperature the log-probs are computed at
    loss: LossConfig = field(default_factory=LossConfig)
    on_nonfinite: str = "raise"  # raise | skip

    def __post_init__(self):
        if self.objective not in ("rl", "sft"):
            raise ValueError(f"objective must be rl or sft, got {self.objective!r}")
        if self.on_nonfinite not in ("raise", "skip"):
            raise ValueError(f"on_nonfinite must be raise or skip, got {self.on_nonfinite!r}")
        if not self.lr > 0:
            raise ValueError(f"lr must be positive, got {self.lr}")


class Trainer:
    """`dp_rank`/`dp_size`: this rank's share of each step's micro-batches (launch/parallel.py: micro_batch_share);
    `metrics_group` the group its metrics are summed over (every rank holding a part of the step: dp×cp; default
    `dp_group`). The model arrives already parallelized; with cp > 1 it carries the ContextParallel that shards
    each micro-batch."""

    def __init__(self, model: Transformer, cfg: TrainConfig, *, recompute: str = "full", keep_layers: int = 0,
                 keep_selections: bool = False, lm_head: str = "fused", dp_rank: int = 0, dp_size: int = 1,
                 dp_group=None, metrics_group=None):
        if lm_head not in ("fused", "lean", "naive"):
            raise ValueError(f"lm_head must be fused, lean or naive, got {lm_head!r}")
        self.model = apply_recompute(model, recompute, keep_layers, keep_selections)
        self.cfg, self.lm_head = cfg, lm_head
        self.dp_rank, self.dp_size, self.dp_group = dp_rank, dp_size, dp_group
        self.metrics_group = metrics_group if metrics_group is not None else dp_group
        self.context_parallel = getattr(model, "context_parallel", None)
        # tensor parallel: the head's weight is this rank's vocabulary rows, its statistics combined over the group
        self.tensor_parallel = getattr(model, "tensor_parallel", None)
        if self.tensor_parallel is not None and lm_head == "naive":
            raise ValueError("lm_head naive does not run under tensor parallelism (tp > 1): use fused or lean")
        self.optimizer = MasterAdamW(self.model.named_parameters(), lr=cfg.lr, betas=cfg.betas, eps=cfg.eps,
                                     weight_decay=cfg.weight_decay, max_grad_norm=cfg.max_grad_norm)
        self.step_num = 0

    def loss_terms(self, batch: Batch, hidden_TD: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Loss of one micro-batch and its metrics: its own aggregation, or, where `batch.extra` carries
        `token_weight` and `num_loss_tokens` (a context-parallel shard: with_loss_weights), the whole
        micro-batch's. `hidden_TD`: the final-norm hidden states where they are already computed (a pipeline's last
        stage)."""
        if hidden_TD is None:
            hidden_TD = self.model(batch.input_ids, batch.packing)
        # the sampling temperature, times what the model divides its logits by (Granite's logits scaling)
        weight, mask = self.model.lm_head.weight, batch.loss_mask
        shape = getattr(self.model, "shape", None)
        temp = self.cfg.temperature * (logits_divisor(shape) if shape is not None else 1.0)
        cap = shape.final_logit_softcap if shape is not None else None  # Gemma 4's, before the temperature
        w_T, n_loss = batch.extra.get("token_weight"), batch.extra.get("num_loss_tokens")
        tp = self.tensor_parallel
        if tp is not None:
            weight = tp.head_weight(weight)
        tp_group = None if tp is None else tp.group
        if self.lm_head in ("fused", "lean"):  # the loss goes into the head: three logits-sized GEMMs
            impl = "lean" if self.lm_head == "lean" else None  # (lean: four, and only the gradients in memory)
            if self.cfg.objective == "sft":
                return fused_nll_loss(hidden_TD, weight, batch.targets, mask, temperature=temp, softcap=cap,
                                      impl=impl, weights_T=w_T, num_loss_tokens=n_loss, tp_group=tp_group)
            return fused_policy_loss(hidden_TD, weight, batch.targets, batch.advantages, mask, self.cfg.loss,
                                     temperature=temp, softcap=cap, old_logp_T=batch.old_logprobs,
                                     ref_logp_T=batch.ref_logprobs,
                                     rollout_logp_T=batch.rollout_logprobs, seq_id_T=batch.seq_id, impl=impl,
                                     weights_T=w_T, num_loss_tokens=n_loss, tp_group=tp_group)
        logp_T, entropy_T = token_logprobs(hidden_TD, weight, batch.targets, mode=self.lm_head, temperature=temp,
                                           softcap=cap, with_entropy=True)
        if self.cfg.objective == "sft":
            n = mask.sum().clamp(min=1) if n_loss is None else torch.as_tensor(n_loss).clamp(min=1)
            loss = -(logp_T * mask).sum() / n if w_T is None else -(logp_T * w_T).sum()
            return loss, {"loss": loss.detach(), "entropy": ((entropy_T * mask).sum() / n).detach(),
                          "num_tokens": mask.sum().float()}
        return policy_loss(logp_T, batch.advantages, mask, self.cfg.loss, old_logp_T=batch.old_logprobs,
                           ref_logp_T=batch.ref_logprobs, rollout_logp_T=batch.rollout_logprobs,
                           entropy_T=entropy_T, seq_id_T=batch.seq_id, weights_T=w_T, num_loss_tokens=n_loss)

    def with_loss_weights(self, batch: Batch) -> Batch:
        """The micro-batch with its aggregation weights [T] and loss-token count in `extra`, computed on the whole
        micro-batch (so a context-parallel shard of it keeps the whole micro-batch's normalization)."""
        how = "token_mean" if self.cfg.objective == "sft" else self.cfg.loss.aggregation
        w_T = token_weights(batch.loss_mask, batch.seq_id, how)
        return dataclasses.replace(batch, extra={**batch.extra, "token_weight": w_T,
                                                 "num_loss_tokens": batch.loss_mask.sum().float()})

    def _weights(self, batches: list[Batch]) -> list[float]:
        if self.cfg.objective == "rl" and self.cfg.loss.aggregation == "seq_mean":
            sizes = [b.num_seqs for b in batches]
        else:
            sizes = [int(b.loss_mask.sum()) for b in batches]
        total = sum(sizes)
        return [s / total if total else 1.0 / len(batches) for s in sizes]

    def forward_backward(self, batches: list[Batch]) -> dict[str, float]:
        """Accumulate gradients over this rank's share of the step's micro-batches (`batches`: the whole step, the
        same list on every rank); returns the step's weighted metrics, summed over `metrics_group` (no update).
        Each loss is weighted by its micro-batch's share of the whole step, so the gradients summed over ranks are
        the one-process gradient."""
        from launch.parallel import micro_batch_share

        pipeline = getattr(self.model, "pipeline", None)
        if pipeline is not None:  # pipeline parallel: the schedule runs the share (launch/pipeline.py)
            return pipeline.forward_backward(self, batches)
        weights = self._weights(batches)
        sums: dict[str, torch.Tensor] = {}
        cp = self.context_parallel
        for j in micro_batch_share(len(batches), self.dp_rank, self.dp_size):
            batch, weight = (batches[j], weights[j]) if j is not None else (batches[0], 0.0)  # padding: weight 0
            if cp is not None:  # this rank's zigzag shard, normalized as the whole micro-batch
                batch = cp.shard(self.with_loss_weights(batch))
            loss, metrics = self.loss_terms(batch)
            (loss * weight).backward()
            if j is None:
                continue
            for k, v in metrics.items():
                sums[k] = sums.get(k, 0.0) + (v if k == "num_tokens" else v * weight)
        keys = sorted(k for k in metrics)
        out = torch.stack([torch.as_tensor(sums.get(k, 0.0), dtype=torch.float32, device=loss.device).reshape(())
                           for k in keys])
        if self.metrics_group is not None or self.dp_size > 1:
            import torch.distributed as dist

            if dist.get_world_size(self.metrics_group) > 1:  # None: the default group
                dist.all_reduce(out, group=self.metrics_group)
        return dict(zip(keys, out.tolist()))  # device sync, once per step

    def step(self, batches: list[Batch] | Batch) -> dict[str, float]:
        """One optimizer step over the given micro-batches. Returns metrics incl. grad_norm, lr, step."""
        batches = [batches] if isinstance(batches, Batch) else batches
        self.step_num += 1
        self.optimizer.zero_grad()
        metrics = self.forward_backward(batches)
        try:
            if not math.isfinite(metrics["loss"]):
                raise NonFiniteError(f"step {self.step_num}: loss is {metrics['loss']}")
            metrics["grad_norm"] = self.optimizer.step()
        except NonFiniteError as e:
            self.optimizer.zero_grad()
            if self.cfg.on_nonfinite == "raise":
                raise
            metrics.update(skipped=1.0, error=str(e))
        metrics.update(step=self.step_num, lr=self.optimizer.lr)
        return metrics


# ---- CLI -----------------------------------------------------------------------------------------------------
def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m launch.train", description=__doc__.split("\n\n")[0])
    p.add_argument("plan", help="plan YAML (recipe solve … -o plan.yaml)")
    p.add_argument("--data", help="rollouts (.jsonl or .parquet); default: synthetic GRPO-shaped rollouts")
    p.add_argument("--steps", type=int, default=1, help="the run's total steps (a resumed run continues to it)")
    p.add_argument("--rollouts-per-step", type=int, default=0, help="0: every rollout in every step")
    p.add_argument("--out", help="run folder: DIR/metrics.jsonl, DIR/checkpoints/step_N (default: neither)")
    p.add_argument("--resume", action="store_true", help="continue from the last complete checkpoint in --out")
    p.add_argument("--checkpoint-every", type=int, default=0, help="steps between checkpoints (0: only the last)")
    p.add_argument("--keep-last", type=int, default=0,
                   help="keep only the newest N checkpoints, deleting older ones after each save (0: keep all)")
    p.add_argument("--no-checkpoint", action="store_true",
                   help="write no checkpoint: not every N steps, not after the last step, not on a stop signal")
    p.add_argument("--hf-checkpoint", help="Hugging Face safetensors directory to start from")
    p.add_argument("--export", help="write the trained weights as a Hugging Face checkpoint here")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cpu", "cuda"])
    p.add_argument("--dtype", choices=sorted(DTYPES), help="compute dtype (default: bf16 on GPU, fp32 on CPU)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--objective", choices=["rl", "sft"], default="rl")
    p.add_argument("--lr", type=float, default=TrainConfig.lr)
    p.add_argument("--weight-decay", type=float, default=TrainConfig.weight_decay)
    p.add_argument("--max-grad-norm", type=float, default=1.0, help="0: no clipping")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--clip-low", type=float, default=LossConfig.clip_low)
    p.add_argument("--clip-high", type=float, default=LossConfig.clip_high)
    p.add_argument("--kl-coef", type=float, default=0.0)
    p.add_argument("--kl-estimator", choices=["k1", "k3"], default="k3")
    p.add_argument("--entropy-coef", type=float, default=0.0)
    p.add_argument("--aggregation", choices=["token_mean", "seq_mean"], default="token_mean")
    p.add_argument("--tis-cap", type=float, default=2.0, help="truncated IS cap; 0 turns the correction off")
    p.add_argument("--on-nonfinite", choices=["raise", "skip"], default="raise")
    args = p.parse_args(argv)
    for name in ("steps", "rollouts_per_step", "checkpoint_every", "keep_last", "max_grad_norm", "weight_decay"):
        if getattr(args, name) < 0 or (name == "steps" and args.steps == 0):
            p.error(f"--{name.replace('_', '-')} must be {'positive' if name == 'steps' else 'non-negative'}, "
                    f"got {getattr(args, name)}")
    if args.no_checkpoint and (args.checkpoint_every or args.keep_last):
        p.error(f"--no-checkpoint and --{'checkpoint-every' if args.checkpoint_every else 'keep-last'} are "
                f"alternatives; give one")
    if args.resume and not args.out:
        p.error("--resume needs --out (the run folder holding the checkpoints)")
    return args


def main(argv: list[str] | None = None) -> int:
    """CLI entry: user errors (plan, layout, data, checkpoint, options) print one line and return 2."""
    from launch import job

    args = _parse(argv)
    try:
        loss_cfg = LossConfig(clip_low=args.clip_low, clip_high=args.clip_high, kl_coef=args.kl_coef,
                              kl_estimator=args.kl_estimator, entropy_coef=args.entropy_coef,
                              aggregation=args.aggregation, tis_cap=args.tis_cap or None)
        cfg = TrainConfig(lr=args.lr, weight_decay=args.weight_decay, max_grad_norm=args.max_grad_norm or None,
                          objective=args.objective, temperature=args.temperature, loss=loss_cfg,
                          on_nonfinite=args.on_nonfinite)
        return job.run(args, cfg, Trainer)
    except (ValueError, FileNotFoundError) as e:  # PlanError, LayoutError, RolloutFormatError, CheckpointError …
        print(f"error: {e}", file=sys.stderr)
        return 2


def _exit(code: int) -> None:
    """End the process without interpreter finalization. By now the run's files are closed and fsynced and its
    process groups destroyed; what finalization would add is tearing down the communication library's C++ threads
    against Python's object cleanup in no fixed order, which under gloo ends a rank, rarely, in SIGABRT
    ("terminate called without an active exception") after a run that succeeded."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    _exit(main())
