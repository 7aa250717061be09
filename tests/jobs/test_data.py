"""dsv4.data: SFT rows (shapes, dtypes, mask alignment, determinism), the split and the batch iterator."""
import json
from pathlib import Path

import pytest
import torch

from dsv4.data import SFTDataset, batches, train_val_split
from dsv4.encoding import ChatEncoder

SMOKE = Path(__file__).resolve().parents[2] / "data" / "sft_smoke.jsonl"


@pytest.fixture(scope="module")
def packed(tokenizer):
    return SFTDataset(SMOKE, tokenizer, seq_len=128)


def test_rows_have_the_training_shapes_and_dtypes(packed):
    assert len(packed) > 10
    row = packed[0]
    assert row["tokens"].shape == (129,) and row["tokens"].dtype == torch.int64
    assert row["loss_mask"].shape == (128,) and row["loss_mask"].dtype == torch.float32
    assert torch.isfinite(packed.loss_mask).all()
    assert set(packed.loss_mask.unique().tolist()) <= {0.0, 1.0}
    assert (packed.loss_mask.sum(1) > 0).all()


def test_packing_keeps_every_token_and_aligns_mask_with_targets(packed, tokenizer):
    rows = [json.loads(line) for line in SMOKE.read_text().splitlines()]
    enc = [ChatEncoder.builtin().encode(r["messages"], tokenizer) for r in rows]
    ids = torch.tensor([i for e in enc for i in e.ids])
    target_mask = torch.tensor([m for e in enc for m in e.mask], dtype=torch.float32)[1:]
    assert packed.stats.rows == 200 and packed.stats.tokens == len(ids) and packed.stats.dropped_no_loss == 0
    # window i is stream[i*L : i*L + L + 1]; its mask weights targets stream[i*L+1 : i*L+L+1]
    stream = torch.cat([packed.tokens[0]] + [t[1:] for t in packed.tokens[1:]])
    assert torch.equal(stream[: len(ids)], ids)
    assert torch.equal(packed.loss_mask.reshape(-1)[: len(target_mask)], target_mask)
    assert packed.stats.trained_tokens == int(target_mask.sum())


def test_padding_gives_one_row_per_conversation(tokenizer, tmp_path):
    ds = SFTDataset(SMOKE, tokenizer, seq_len=48, pack=False)
    assert ds.stats.samples + ds.stats.dropped_no_loss == 200 and ds.stats.truncated > 0
    first = json.loads(SMOKE.read_text().splitlines()[0])
    e = ChatEncoder.builtin().encode(first["messages"], tokenizer)
    n = min(len(e.ids), 49)
    assert ds.tokens[0, :n].tolist() == e.ids[:n]
    assert (ds.tokens[0, n:] == ds.pad_id).all() and ds.loss_mask[0, n - 1:].sum() == 0
    assert ds.loss_mask[0, : n - 1].tolist() == [float(m) for m in e.mask[1:n]]
    # a conversation whose answer lies beyond seq_len is dropped, not trained on with zero loss
    (tmp_path / "long.jsonl").write_text(json.dumps({"messages": [
        {"role": "user", "content": "x" * 100}, {"role": "assistant", "content": "y"}]}) + "\n")
    with pytest.raises(ValueError, match="no training row"):
        SFTDataset(tmp_path / "long.jsonl", tokenizer, seq_len=48, pack=False)


def test_dataset_is_deterministic(packed, tokenizer):
    again = SFTDataset(SMOKE, tokenizer, seq_len=128)
    assert torch.equal(again.tokens, packed.tokens) and torch.equal(again.loss_mask, packed.loss_mask)


def test_bad_input_says_where(tokenizer, tmp_path):
    (tmp_path / "bad.jsonl").write_text('{"messages": []}\n{"text": 1}\n')
    with pytest.raises(ValueError, match="bad.jsonl:2: expected an object with a 'messages' list"):
        SFTDataset(tmp_path / "bad.jsonl", tokenizer, seq_len=16)


def test_split_is_seeded_disjoint_and_complete(packed):
    train, val = train_val_split(packed, 0.1, seed=3)
    assert len(val) == round(len(packed) * 0.1) and len(train) + len(val) == len(packed)
    assert not set(train.indices) & set(val.indices)
    assert train_val_split(packed, 0.1, seed=3)[1].indices == val.indices
    assert train_val_split(packed, 0.1, seed=4)[1].indices != val.indices
    assert len(train_val_split(packed, 0.0, seed=3)[1]) == 0


def test_batches_are_deterministic_rank_disjoint_and_resumable(packed):
    take = lambda it, n: [next(it) for _ in range(n)]  # noqa: E731
    a = take(batches(packed, 2, seed=7), 5)
    assert a[0]["tokens"].shape == (2, 129) and a[0]["loss_mask"].shape == (2, 128)
    b = take(batches(packed, 2, seed=7), 5)
    assert all(torch.equal(x["tokens"], y["tokens"]) for x, y in zip(a, b))
    assert not torch.equal(take(batches(packed, 2, seed=8), 1)[0]["tokens"], a[0]["tokens"])
    # two ranks split what one rank with twice the batch sees, without overlap
    r0, r1 = take(batches(packed, 2, seed=7, rank=0, world=2), 3), take(batches(packed, 2, seed=7, rank=1, world=2), 3)
    whole = take(batches(packed, 4, seed=7), 3)
    for x, y, w in zip(r0, r1, whole):
        assert torch.equal(torch.cat([x["tokens"], y["tokens"]]), w["tokens"])
    # resuming at step 3 continues the same sequence
    resumed = take(batches(packed, 2, seed=7, start=3), 2)
    assert all(torch.equal(x["tokens"], y["tokens"]) for x, y in zip(a[3:], resumed))
    # more steps than one epoch: cycles on with a fresh order
    many = take(batches(packed, 8, seed=7), len(packed) // 8 + 2)
    assert all(torch.isfinite(x["loss_mask"]).all() for x in many)
    with pytest.raises(ValueError, match="rank"):
        next(batches(packed, 2, seed=7, rank=2, world=2))
