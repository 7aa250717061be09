"""Routing replay (R3): the trainer routes each token to the experts the rollout engine chose for it.

Between rollout and training the router can change its mind: the trainer's numerics differ (bf16 kernels,
another parallel layout), or the weights moved (a sync, the balancing bias). A token routed to other experts is
scored by another network, and its logprob no longer matches the rollout's. Replay forces the recorded experts
while the router's scores of those experts still weight them, so the router keeps its gradient.

The mask follows verl's `build_r3_replay_mask` and SGLang's capture: a row is replayed when the engine routed
that token, i.e. from `routed_experts_start_len` up to the second-to-last token of a sample (the last sampled
token is never fed). Padding, the last row and the prompt before the start offset route natively. Hash-routed
layers never replay: their experts are a table lookup of the token id (`Gate.forward` ignores replay there).
"""
from __future__ import annotations

import contextlib

import numpy as np
import torch

from dsv4.model import Transformer


def routes_tensor(samples: list[tuple[int, int, np.ndarray]], seq_len: int, n_layers: int, topk: int, device=None):
    """Per sample (total tokens, routed_experts_start_len, routes [total - 1 - start, L, k]) -> (routes
    [B, seq_len, L, k] long, mask [B, seq_len] bool) for a batch padded to seq_len."""
    B = len(samples)
    routes = torch.zeros(B, seq_len, n_layers, topk, dtype=torch.long)
    mask = torch.zeros(B, seq_len, dtype=torch.bool)
    for b, (total, start, r) in enumerate(samples):
        rows = total - 1 - start
        if r.shape[0] != rows:
            raise ValueError(f"sample {b}: {r.shape[0]} routed rows for {total} tokens from start {start}; "
                             f"expected {rows} (SGLang's [seqlen - 1 - start, layers, top-k])")
        routes[b, start:total - 1] = torch.from_numpy(np.asarray(r, dtype=np.int64))
        mask[b, start:total - 1] = True
    return routes.to(device), mask.to(device)


@contextlib.contextmanager
def replayed_routes(model: Transformer, routes: torch.Tensor, mask: torch.Tensor):
    """Within the block, every score-routed layer of `model` replays `routes` [B, S, L, k] where `mask` [B, S]."""
    k = routes.shape[-1]
    flat_mask = mask.reshape(-1)
    try:
        for i, layer in enumerate(model.layers):
            layer.ffn.gate.replay = (routes[:, :, i].reshape(-1, k), flat_mask)
        yield
    finally:
        for layer in model.layers:
            layer.ffn.gate.replay = None


def route_agreement(native: torch.Tensor, replayed: torch.Tensor, mask: torch.Tensor) -> float:
    """Share of masked rows (over all layers) whose native expert set equals the replayed one."""
    same = (native.sort(-1).values == replayed.sort(-1).values).all(-1)      # [B, S, L]
    m = mask.unsqueeze(-1).expand_as(same)
    return float(same[m].float().mean()) if m.any() else 1.0
