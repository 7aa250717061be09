"""Normalized chat jsonl -> fixed-length SFT rows, and a deterministic batch iterator.

A row of the input file is {"messages": [...OpenAI-style...], "tools": [...]?} (what
jobs/prepare_data writes). Each conversation is encoded with the DeepSeek-V4 chat format
(dsv4.encoding) into token ids and a per-token mask (1 on assistant tokens). A training row is

    tokens    int64   [seq_len + 1]   inputs are tokens[:-1], targets tokens[1:]
    loss_mask float32 [seq_len]       loss_mask[t] weights the prediction of tokens[t + 1]

Packing (default) concatenates the conversations in file order and cuts the stream into
windows of seq_len + 1 tokens that overlap by one (window i starts at i * seq_len); no token is
wasted and documents may attend across their boundary (accepted for SFT on short chats; the
next document's BOS has mask 0, so no loss crosses it). Padding gives each conversation its own
row, truncated to seq_len + 1 and padded with EOS at mask 0. Windows or rows left with no
trained token are dropped, so every batch has a nonzero loss denominator.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

import numpy as np

from dsv4.encoding import EOS, ChatEncoder

if TYPE_CHECKING:
    import torch
# torch is imported where a tensor is made: jobs.verify_template reads rows with read_jsonl and needs none (3.6 s)


def read_jsonl(path: str | Path) -> list[dict]:
    rows = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n}: not valid JSON ({e.msg}); run jobs.prepare_data on the source") from None
            if not isinstance(row, dict) or not isinstance(row.get("messages"), list):
                raise ValueError(f"{path}:{n}: expected an object with a 'messages' list; run jobs.prepare_data on the source")
            rows.append(row)
    return rows


@dataclass
class DataStats:
    rows: int = 0  # conversations read
    samples: int = 0  # training rows produced
    tokens: int = 0  # tokens of all conversations
    trained_tokens: int = 0  # tokens with loss in the produced rows
    dropped_no_loss: int = 0  # windows/rows dropped for having no trained token
    truncated: int = 0  # conversations cut at seq_len + 1 (padding mode)


class SFTDataset:
    """A map-style dataset (its length and rows by index, as torch's Subset and DataLoader take)."""

    def __init__(self, path: str | Path, tokenizer, seq_len: int, *, encoder: ChatEncoder | None = None,
                 thinking_mode: str = "chat", drop_thinking: bool = False, pack: bool = True):
        if seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len}")
        self.seq_len, self.stats = seq_len, DataStats()
        encoder = encoder or ChatEncoder.builtin()
        eos = tokenizer.encode(EOS)
        if len(eos) != 1:
            raise ValueError(f"tokenizer encodes {EOS!r} as {eos}, expected one special token id")
        self.pad_id = eos[0]
        docs = []
        for row in read_jsonl(path):
            enc = encoder.encode(row["messages"], tokenizer, row.get("tools"), thinking_mode, drop_thinking)
            docs.append((np.asarray(enc.ids, np.int64), np.asarray(enc.mask, np.float32)))
        self.stats.rows = len(docs)
        self.stats.tokens = sum(len(ids) for ids, _ in docs)
        tokens, masks = self._pack(docs) if pack else self._pad(docs)
        import torch
        keep = masks.sum(1) > 0
        self.stats.dropped_no_loss = int((~keep).sum())
        self.tokens, self.loss_mask = torch.from_numpy(tokens[keep]), torch.from_numpy(masks[keep])
        self.stats.samples, self.stats.trained_tokens = len(self.tokens), int(self.loss_mask.sum())
        if not len(self.tokens):
            raise ValueError(f"{path}: no training row has a trained (assistant) token; check the data and the chat encoder")

    def _pack(self, docs):
        ids = np.concatenate([d[0] for d in docs]) if docs else np.zeros(0, np.int64)
        target_mask = np.concatenate([d[1] for d in docs])[1:] if docs else np.zeros(0, np.float32)
        n = max(0, -(-(len(ids) - 1) // self.seq_len))  # ceil((len - 1) / seq_len) windows
        total = n * self.seq_len + 1
        ids = np.concatenate([ids, np.full(max(0, total - len(ids)), self.pad_id, np.int64)])
        target_mask = np.concatenate([target_mask, np.zeros(n * self.seq_len - len(target_mask), np.float32)])
        starts = np.arange(n)[:, None] * self.seq_len
        return ids[starts + np.arange(self.seq_len + 1)], target_mask.reshape(n, self.seq_len)

    def _pad(self, docs):
        tokens = np.full((len(docs), self.seq_len + 1), self.pad_id, np.int64)
        masks = np.zeros((len(docs), self.seq_len), np.float32)
        for i, (ids, mask) in enumerate(docs):
            self.stats.truncated += len(ids) > self.seq_len + 1
            ids, mask = ids[: self.seq_len + 1], mask[1 : self.seq_len + 1]
            tokens[i, : len(ids)], masks[i, : len(mask)] = ids, mask
        return tokens, masks

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"tokens": self.tokens[i], "loss_mask": self.loss_mask[i]}


def train_val_split(dataset, val_fraction: float, seed: int) -> tuple[torch.utils.data.Subset, torch.utils.data.Subset]:
    """A seeded random split; the validation part gets round(n * val_fraction) rows, at least one
    when val_fraction > 0 and at most n - 1, so neither side is empty by accident."""
    import torch
    n = len(dataset)
    n_val = 0 if val_fraction <= 0 else min(max(1, round(n * val_fraction)), n - 1)
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()
    return torch.utils.data.Subset(dataset, sorted(perm[n_val:])), torch.utils.data.Subset(dataset, sorted(perm[:n_val]))


def batches(dataset, batch_size: int, seed: int, rank: int = 0, world: int = 1,
            start: int = 0) -> Iterator[dict[str, torch.Tensor]]:
    """Endless batches of `batch_size` rows for `rank` of `world` data-parallel ranks.

    Epoch e visits the rows in the order of a permutation seeded by (seed, e); each step takes
    the next batch_size * world indices of that stream and rank r keeps its own slice, so ranks
    never share a row within a step and every rank computes the same schedule alone. `start`
    skips that many steps, for resuming at the same place after a restart.
    """
    import torch
    n = len(dataset)
    if n == 0 or batch_size < 1 or not 0 <= rank < world:
        raise ValueError(f"batches: need a non-empty dataset, batch_size >= 1 and 0 <= rank < world "
                         f"(got {n} rows, batch_size={batch_size}, rank={rank}, world={world})")

    def stream():
        epoch = 0
        while True:
            yield from torch.randperm(n, generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch)).tolist()
            epoch += 1

    indices, step = stream(), 0
    while True:
        chunk = [next(indices) for _ in range(batch_size * world)]
        if step >= start:
            rows = [dataset[i] for i in chunk[rank * batch_size : (rank + 1) * batch_size]]
            yield {k: torch.stack([r[k] for r in rows]) for k in rows[0]}
        step += 1
