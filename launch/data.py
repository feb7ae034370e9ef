"""Rollouts: the on-disk format, JSONL and Parquet readers, packing into micro-batches, and a synthetic generator.

A rollout is one sampled sequence (prompt + response). Fields (docs/training.md has examples):

| field            | type                 | required | meaning                                                          |
|------------------|----------------------|----------|------------------------------------------------------------------|
| input_ids        | list[int]            | yes      | prompt and response tokens, ≥ 2                                  |
| loss_mask        | list[0/1]            | yes      | 1 on tokens the loss trains (the response); loss_mask[0] = 0     |
| advantages       | float or list[float] | yes      | per sequence (broadcast) or per token                           |
| old_logprobs     | list[float]          | no       | trainer's log p(token) under the sampling policy                 |
| ref_logprobs     | list[float]          | no       | reference policy's log p(token), for the KL term                 |
| rollout_logprobs | list[float]          | no       | the rollout engine's own log p(token) (truncated IS correction)  |

Every per-token list is aligned with input_ids: entry t is about token t (log p(x_t | x_<t)); entry 0 is unused
because token 0 has no prediction. Packing shifts them onto the model's positions (position t predicts x_{t+1}).
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass, field
from pathlib import Path

import torch

from launch.model import Packing

TOKEN_FIELDS = ("old_logprobs", "ref_logprobs", "rollout_logprobs")
ALL_FIELDS = ("input_ids", "loss_mask", "advantages", *TOKEN_FIELDS)


class RolloutFormatError(ValueError):
    """A rollout file or record that does not follow the format; the message names the record and field."""


@dataclass
class Rollout:
    input_ids: list[int]
    loss_mask: list[int]
    advantages: list[float]
    old_logprobs: list[float] | None = None
    ref_logprobs: list[float] | None = None
    rollout_logprobs: list[float] | None = None

    def __len__(self) -> int:
        return len(self.input_ids)


def rollout_from_record(rec: dict, where: str, vocab_size: int | None = None) -> Rollout:
    """Validate one record (a JSON object or a Parquet row) into a Rollout. `where` prefixes every error."""
    if not isinstance(rec, dict):
        raise RolloutFormatError(f"{where}: expected an object with fields {', '.join(ALL_FIELDS[:3])}, "
                                 f"got {type(rec).__name__}")
    unknown = sorted(set(rec) - set(ALL_FIELDS) - {"id", "group", "reward"})
    if unknown:
        raise RolloutFormatError(f"{where}: unknown field(s) {unknown} (known: {', '.join(ALL_FIELDS)}; "
                                 f"ignored metadata: id, group, reward)")
    for name in ("input_ids", "loss_mask", "advantages"):
        if rec.get(name) is None:
            raise RolloutFormatError(f"{where}: missing required field {name!r}")
    ids = rec["input_ids"]
    if not isinstance(ids, (list, tuple)) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise RolloutFormatError(f"{where}: field 'input_ids' must be a list of integers")
    n = len(ids)
    if n < 2:
        raise RolloutFormatError(f"{where}: field 'input_ids' has {n} token(s); a rollout needs at least 2")
    if min(ids) < 0 or (vocab_size is not None and max(ids) >= vocab_size):
        bad = min(ids) if min(ids) < 0 else max(ids)
        raise RolloutFormatError(f"{where}: field 'input_ids' holds token {bad} outside [0, {vocab_size})")

    def token_list(name: str, values) -> list[float]:
        if not isinstance(values, (list, tuple)):
            raise RolloutFormatError(f"{where}: field {name!r} must be a list of {n} numbers")
        if len(values) != n:
            raise RolloutFormatError(f"{where}: field {name!r} has {len(values)} entries but input_ids has {n}")
        try:
            out = [float(v) for v in values]
        except (TypeError, ValueError):
            raise RolloutFormatError(f"{where}: field {name!r} must hold numbers") from None
        if not all(math.isfinite(v) for v in out[1:]):
            raise RolloutFormatError(f"{where}: field {name!r} holds a non-finite value")
        return out

    mask = token_list("loss_mask", rec["loss_mask"])
    if any(m not in (0.0, 1.0) for m in mask):
        raise RolloutFormatError(f"{where}: field 'loss_mask' must hold only 0 and 1")
    if mask[0]:
        raise RolloutFormatError(f"{where}: loss_mask[0] must be 0 (the first token has no prediction)")
    adv = rec["advantages"]
    if isinstance(adv, (int, float)) and not isinstance(adv, bool):
        if not math.isfinite(adv):
            raise RolloutFormatError(f"{where}: field 'advantages' is not finite")
        adv_list = [float(adv)] * n
    else:
        adv_list = token_list("advantages", adv)
    extra = {name: token_list(name, rec[name]) for name in TOKEN_FIELDS if rec.get(name) is not None}
    return Rollout(list(ids), [int(m) for m in mask], adv_list, **extra)


def read_jsonl(path: str | Path, vocab_size: int | None = None) -> list[Rollout]:
    path = Path(path)
    try:
        lines = path.read_text().splitlines()
    except OSError as e:
        raise RolloutFormatError(f"cannot read rollouts {path}: {e}") from None
    rollouts = []
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise RolloutFormatError(f"{path}:{i}: not valid JSON ({e.msg} at column {e.colno})") from None
        rollouts.append(rollout_from_record(rec, f"{path}:{i}", vocab_size))
    if not rollouts:
        raise RolloutFormatError(f"{path}: no rollouts")
    return rollouts


def read_parquet(path: str | Path, vocab_size: int | None = None) -> list[Rollout]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise RolloutFormatError("reading Parquet rollouts needs pyarrow (pip install pyarrow)") from None
    path = Path(path)
    try:
        table = pq.read_table(path)
    except Exception as e:  # pyarrow raises several types for unreadable files
        raise RolloutFormatError(f"cannot read Parquet rollouts {path}: {e}") from None
    missing = [c for c in ("input_ids", "loss_mask", "advantages") if c not in table.column_names]
    if missing:
        raise RolloutFormatError(f"{path}: missing column(s) {missing} (columns: {table.column_names})")
    rollouts = [rollout_from_record(rec, f"{path}: row {i}", vocab_size)
                for i, rec in enumerate(table.to_pylist())]
    if not rollouts:
        raise RolloutFormatError(f"{path}: no rollouts")
    return rollouts


def read_rollouts(path: str | Path, vocab_size: int | None = None) -> list[Rollout]:
    suffix = Path(path).suffix.lower()
    if suffix in (".jsonl", ".json"):
        return read_jsonl(path, vocab_size)
    if suffix in (".parquet", ".pq"):
        return read_parquet(path, vocab_size)
    raise RolloutFormatError(f"{path}: unknown rollout file type {suffix!r} (use .jsonl or .parquet)")


def write_jsonl(rollouts: list[Rollout], path: str | Path) -> None:
    with open(path, "w") as f:
        for r in rollouts:
            rec = {k: v for k, v in r.__dict__.items() if v is not None}
            f.write(json.dumps(rec) + "\n")


# ---- packing -------------------------------------------------------------------------------------------------
@dataclass
class Batch:
    """One packed micro-batch; per-token tensors are aligned with positions (entry t: prediction of token t+1)."""

    input_ids: torch.Tensor  # [T] int64
    targets: torch.Tensor  # [T] int64, −1 at each document's last position
    packing: Packing
    loss_mask: torch.Tensor  # [T] bool
    advantages: torch.Tensor  # [T] fp32
    seq_id: torch.Tensor  # [T] int64, index of the rollout within the micro-batch
    old_logprobs: torch.Tensor | None = None
    ref_logprobs: torch.Tensor | None = None
    rollout_logprobs: torch.Tensor | None = None
    extra: dict = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]

    @property
    def num_seqs(self) -> int:
        return len(self.packing.doc_lengths)


def make_batch(rollouts: list[Rollout], device: torch.device | str = "cpu") -> Batch:
    """Pack rollouts back to back into one sequence and shift the per-token fields onto positions."""
    if not rollouts:
        raise ValueError("make_batch needs at least one rollout")

    def shifted(values: list, fill) -> list:
        return list(values[1:]) + [fill]

    ids, tgt, mask, adv, seq = [], [], [], [], []
    tok = {name: [] for name in TOKEN_FIELDS}
    present = {name for name in TOKEN_FIELDS if all(getattr(r, name) is not None for r in rollouts)}
    partial = {name for name in TOKEN_FIELDS if any(getattr(r, name) is not None for r in rollouts)} - present
    if partial:
        raise ValueError(f"field(s) {sorted(partial)} present on some rollouts of a micro-batch but not all")
    for i, r in enumerate(rollouts):
        ids += r.input_ids
        tgt += shifted(r.input_ids, -1)
        mask += shifted(r.loss_mask, 0)
        adv += shifted(r.advantages, 0.0)
        seq += [i] * len(r)
        for name in present:
            tok[name] += shifted(getattr(r, name), 0.0)
    as_f = lambda xs: torch.tensor(xs, dtype=torch.float32, device=device)  # noqa: E731
    return Batch(
        input_ids=torch.tensor(ids, dtype=torch.int64, device=device),
        targets=torch.tensor(tgt, dtype=torch.int64, device=device),
        packing=Packing.from_lengths([len(r) for r in rollouts], device),
        loss_mask=torch.tensor(mask, dtype=torch.bool, device=device),
        advantages=as_f(adv), seq_id=torch.tensor(seq, dtype=torch.int64, device=device),
        **{name: as_f(tok[name]) for name in present},
    )


def pack_rollouts(rollouts: list[Rollout], max_tokens: int, num_ranks: int = 1) -> list[list[Rollout]]:
    """Greedy in-order packing into micro-batches of at most `max_tokens` tokens. With `num_ranks` data-parallel
    ranks the micro-batches are also cut at about 1/num_ranks of the step's tokens, so every rank gets a share
    (the step's loss and gradient do not depend on how its rollouts are grouped: launch/train.py weights each
    micro-batch by its share of the step)."""
    for i, r in enumerate(rollouts):
        if len(r) > max_tokens:
            raise ValueError(f"rollout {i} has {len(r)} tokens, more than micro_batch_tokens={max_tokens}")
    target = min(max_tokens, -(-sum(len(r) for r in rollouts) // num_ranks))
    groups: list[list[Rollout]] = []
    current, used = [], 0
    for r in rollouts:
        if current and (used >= target or used + len(r) > max_tokens):
            groups.append(current)
            current, used = [], 0
        current.append(r)
        used += len(r)
    if current:
        groups.append(current)
    return groups


# ---- synthetic rollouts --------------------------------------------------------------------------------------
def synthetic_rollouts(num_prompts: int, group_size: int, vocab_size: int, prompt_len: tuple[int, int] = (8, 32),
                       response_len: tuple[int, int] = (8, 64), seed: int = 0,
                       with_logprobs: bool = False) -> list[Rollout]:
    """GRPO-shaped random rollouts for benchmarks and demos: `group_size` responses per prompt, a random reward per
    response and advantages normalized within each group; optional log-prob fields near −log(vocab)."""
    rng = random.Random(seed)
    out = []
    for _ in range(num_prompts):
        prompt = [rng.randrange(vocab_size) for _ in range(rng.randint(*prompt_len))]
        rewards = [rng.random() for _ in range(group_size)]
        mean = sum(rewards) / group_size
        std = (sum((x - mean) ** 2 for x in rewards) / group_size) ** 0.5 + 1e-6
        for reward in rewards:
            resp = [rng.randrange(vocab_size) for _ in range(rng.randint(*response_len))]
            n = len(prompt) + len(resp)
            r = Rollout(prompt + resp, [0] * len(prompt) + [1] * len(resp), [(reward - mean) / std] * n)
            if with_logprobs:
                base = -math.log(vocab_size)
                r.old_logprobs = [base + rng.gauss(0, 0.05) for _ in range(n)]
                r.ref_logprobs = [base + rng.gauss(0, 0.05) for _ in range(n)]
                r.rollout_logprobs = [lp + rng.gauss(0, 0.05) for lp in r.old_logprobs]
            out.append(r)
    return out


def synthetic_long_batch(num_tokens: int, vocab_size: int, device, seed: int = 0, num_docs: int = 1) -> Batch:
    """One packed micro-batch of `num_tokens` random tokens in `num_docs` equal documents (benchmarks)."""
    gen = torch.Generator().manual_seed(seed)
    lengths = [num_tokens // num_docs] * num_docs
    lengths[-1] += num_tokens - sum(lengths)
    rollouts = []
    for n in lengths:
        ids = torch.randint(0, vocab_size, (n,), generator=gen).tolist()
        half = n // 2
        adv = float(torch.randn((), generator=gen))
        rollouts.append(Rollout(ids, [0] * half + [1] * (n - half), [adv] * n))
    return make_batch(rollouts, device)
