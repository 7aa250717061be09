"""Values computed from weights, kept while no weight changes: within one training step's forward and backward.

Several forms of a weight are recomputed by every micro-batch that reads it although the weight only changes at
the optimizer step: the bf16 halves of an fp32 weight (dsv4/kernels/split_gemm.py), the straight-through value of
a QAT weight (dsv4/quant.py). Each such kind keeps a `Memo`; the trainer opens them all with `weights_fixed()`
around one step's schedule, and outside it a memo computes afresh (inference, evaluation, tests), so nothing is
held after the step and a caller that never opens it sees the old behaviour. A value is keyed by its weight's
storage (data pointer, shape, strides, dtype, device), which no weight changes inside the schedule.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Hashable

import torch


class Memo:
    """One kind of value: `get` computes it once per key while `weights_fixed()` is open, at every call otherwise."""
    every: list["Memo"] = []

    def __init__(self, name: str):
        self.name, self.store = name, None
        Memo.every.append(self)

    @property
    def open(self) -> bool:
        return self.store is not None

    def get(self, key: Hashable, make: Callable[[], object]):
        if self.store is None:
            return make()
        if key not in self.store:
            self.store[key] = make()
        return self.store[key]


def weight_key(w: torch.Tensor, *kind) -> tuple:
    return (*kind, w.data_ptr(), tuple(w.shape), tuple(w.stride()), w.dtype, w.device)


@contextmanager
def weights_fixed():
    """Open every memo (nested: the outer one's values stay): the caller promises no weight changes meanwhile."""
    outer = [m.store for m in Memo.every]
    for m in Memo.every:
        m.store = {} if m.store is None else m.store
    try:
        yield
    finally:
        for m, o in zip(Memo.every, outer):
            m.store = o
