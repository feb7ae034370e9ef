"""Rollout format: readers (JSONL, Parquet) with clear errors, packing and the shift onto positions."""

import json

import pytest
import torch

from launch.data import (RolloutFormatError, make_batch, pack_rollouts, read_rollouts, synthetic_rollouts,
                         write_jsonl)



GOOD = {"input_ids": [5, 6, 7, 8], "loss_mask": [0, 0, 1, 1], "advantages": 0.5,
        "old_logprobs": [0.0, -1.0, -2.0, -3.0]}


def _jsonl(tmp_path, *records, name="r.jsonl"):
    p = tmp_path / name
    p.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in records) + "\n")
    return p


def test_jsonl_roundtrip_and_shift(tmp_path):
    second = {"input_ids": [1, 2, 3], "loss_mask": [0, 1, 1], "advantages": [0, -1.0, -2.0],
              "old_logprobs": [0.0, -0.5, -0.25]}
    rollouts = read_rollouts(_jsonl(tmp_path, GOOD, second), vocab_size=10)
    b = make_batch(rollouts)
    # position t predicts token t+1 of its own document; each document's last position predicts nothing
    assert b.input_ids.tolist() == [5, 6, 7, 8, 1, 2, 3]
    assert b.targets.tolist() == [6, 7, 8, -1, 2, 3, -1]
    assert b.packing.positions.tolist() == [0, 1, 2, 3, 0, 1, 2]
    assert b.packing.cu_seqlens.tolist() == [0, 4, 7]
    assert b.loss_mask.tolist() == [False, True, True, False, True, True, False]
    assert b.advantages.tolist() == [0.5, 0.5, 0.5, 0.0, -1.0, -2.0, 0.0]
    assert b.old_logprobs.tolist() == [-1.0, -2.0, -3.0, 0.0, -0.5, -0.25, 0.0]
    assert b.seq_id.tolist() == [0, 0, 0, 0, 1, 1, 1]
    assert b.ref_logprobs is None
    write_jsonl(rollouts, tmp_path / "back.jsonl")
    assert read_rollouts(tmp_path / "back.jsonl")[1].advantages == [0.0, -1.0, -2.0]


@pytest.mark.parametrize("record,message", [
    ({"loss_mask": [0, 1], "advantages": 1.0}, "missing required field 'input_ids'"),
    ({**GOOD, "loss_mask": [0, 1, 1]}, "field 'loss_mask' has 3 entries but input_ids has 4"),
    ({**GOOD, "loss_mask": [1, 0, 1, 1]}, r"loss_mask\[0\] must be 0"),
    ({**GOOD, "loss_mask": [0, 2, 1, 1]}, "only 0 and 1"),
    ({**GOOD, "input_ids": [5, 6, 7, 99]}, "token 99 outside"),
    ({**GOOD, "input_ids": [5]}, "at least 2"),
    ({**GOOD, "advantage": 1.0}, r"unknown field\(s\) \['advantage'\]"),
    ({**GOOD, "ref_logprobs": [0.0, "x", 0.0, 0.0]}, "field 'ref_logprobs' must hold numbers"),
    ({**GOOD, "advantages": float("nan")}, "not finite"),
    ([1, 2, 3], "expected an object"),
])
def test_jsonl_errors_name_line_and_field(tmp_path, record, message):
    path = _jsonl(tmp_path, GOOD, record)
    with pytest.raises(RolloutFormatError, match=message) as e:
        read_rollouts(path, vocab_size=10)
    assert f"{path}:2" in str(e.value)


def test_jsonl_bad_json_and_unknown_suffix(tmp_path):
    with pytest.raises(RolloutFormatError, match=r"r.jsonl:1: not valid JSON"):
        read_rollouts(_jsonl(tmp_path, "{'input_ids': [1]}"))
    with pytest.raises(RolloutFormatError, match="unknown rollout file type '.csv'"):
        read_rollouts(tmp_path / "x.csv")
    with pytest.raises(RolloutFormatError, match="cannot read rollouts"):
        read_rollouts(tmp_path / "missing.jsonl")


def test_parquet_reader(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    table = pa.table({"input_ids": [[5, 6, 7], [1, 2]], "loss_mask": [[0, 1, 1], [0, 1]],
                      "advantages": [1.5, -0.5]})
    pq.write_table(table, tmp_path / "r.parquet")
    rollouts = read_rollouts(tmp_path / "r.parquet")
    assert [r.advantages for r in rollouts] == [[1.5] * 3, [-0.5] * 2]
    pq.write_table(pa.table({"input_ids": [[5, 6]], "advantages": [1.0]}), tmp_path / "bad.parquet")
    with pytest.raises(RolloutFormatError, match=r"missing column\(s\) \['loss_mask'\]"):
        read_rollouts(tmp_path / "bad.parquet")
    pq.write_table(pa.table({"input_ids": [[5, 6]], "loss_mask": [[0, 1, 1]], "advantages": [1.0]}),
                   tmp_path / "bad2.parquet")
    with pytest.raises(RolloutFormatError, match="row 0: field 'loss_mask' has 3 entries"):
        read_rollouts(tmp_path / "bad2.parquet")


def test_packing_and_synthetic():
    rollouts = synthetic_rollouts(3, 4, vocab_size=50, seed=1, with_logprobs=True)
    assert len(rollouts) == 12
    # advantages are normalized within each group of 4
    for i in range(0, 12, 4):
        group = [r.advantages[0] for r in rollouts[i:i + 4]]
        assert abs(sum(group)) < 1e-5
    groups = pack_rollouts(rollouts, max_tokens=120)
    assert [r for g in groups for r in g] == rollouts
    assert all(sum(len(r) for r in g) <= 120 for g in groups)
    with pytest.raises(ValueError, match="more than micro_batch_tokens=10"):
        pack_rollouts(rollouts, max_tokens=10)
    b = make_batch(groups[0])
    assert b.rollout_logprobs is not None and b.num_tokens == sum(len(r) for r in groups[0])
    rollouts[1].ref_logprobs = None
    with pytest.raises(ValueError, match="present on some rollouts"):
        make_batch(rollouts[:2])
    assert torch.equal(make_batch(rollouts[2:3]).input_ids, torch.tensor(rollouts[2].input_ids))
