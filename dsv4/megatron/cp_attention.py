"""DeepSeek-V4 attention on a context-parallel split of the sequence (see CPSplit in parallel.py).

Every query needs three kinds of keys, and each crosses the split differently:

* sliding window: the W-1 raw rows before a chunk live on the rank that holds the chunk before it. Each
  rank all-gathers the last rows of both its chunks (a few rows per rank, not the sequence), and every
  chunk is extended by the rows before it ("halo") and recomputes their per-token keys itself;
* compressed entries: entry i pools tokens [i*m, (i+1)*m) (and the previous block's first channel half
  when m == 4), so a block can straddle a chunk edge. The chunk holding a block's LAST token computes the
  entry, reading the block's earlier tokens from its halo. Entries are S/m rows in all: they are
  all-gathered, and every rank indexes the whole set with global entry ids, as one process does;
* the lightning indexer scores a query against every earlier compressed entry: its keys are gathered the
  same way and the top-k is taken over the gathered set, masked by each query's global position.

The gathers are autograd functions whose backward reduce-scatters, so a rank's rows get the gradients
every rank's loss sends them. Index lists stay lists of rows into one KV tensor per rank, so the same
sparse-attention entry point (torch or TileLang) runs unchanged on the gathered rows.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from dsv4 import model as ref
from dsv4.kernels import reference as kref
from dsv4.megatron.parallel import CPSplit, cp_all_gather


def halo_reach(window: int, ratio: int) -> int:
    """Raw rows a chunk needs from before its start: the window's W-1, and the tokens of the blocks it owns
    that start before it (m-1; 2m-1 with the overlapping ratio-4 windows, which read the previous block)."""
    need = window - 1
    if ratio:
        need = max(need, 2 * ratio - 1 if ratio == 4 else ratio - 1)
    return need


def extend_chunks(x: torch.Tensor, split: CPSplit, reach: int) -> list[tuple[torch.Tensor, int]]:
    """x [B, 2L, F] (this rank's two chunks) -> per chunk (rows [B, T+L, F], global position of row 0): the
    chunk preceded by its `reach` earlier rows (fewer at the sequence start). Only the last min(reach, L)
    rows of each chunk travel; when reach > L a chunk's halo comes from several earlier chunks."""
    B, _, Fd = x.shape
    L, cp = split.L, split.cp
    Tg = min(reach, L)
    chunks = [x[:, k * L:(k + 1) * L] for k in range(2)]
    if Tg == 0:
        return [(c, g) for c, g in zip(chunks, split.starts)]
    tails = torch.stack([c[:, L - Tg:] for c in chunks])                     # [2, B, Tg, F]
    every = cp_all_gather(tails)                                              # [cp, 2, B, Tg, F]
    flat = every.permute(2, 0, 1, 3, 4).reshape(B, cp * 2 * Tg, Fd)
    out = []
    for c, g in zip(chunks, split.starts):
        T = min(reach, g)
        if T == 0:
            out.append((c, g))
            continue
        pos = torch.arange(g - T, g, device=x.device)
        chunk = pos // L
        r, s = split.owner(chunk)
        rows = (r * 2 + s) * Tg + (pos - chunk * L - (L - Tg))
        out.append((torch.cat([flat.index_select(1, rows), c], dim=1), g - T))
    return out


def window_idxs(g: int, L: int, S: int, window: int, ext_start: int, row_offset: int, device) -> torch.Tensor:
    """[L, min(S, W)] int64 rows of a chunk's extended KV (placed at `row_offset`) for queries at global
    positions g..g+L-1: the reference's window_topk_idxs slots, moved to this chunk's rows."""
    t = torch.arange(g, g + L, device=device).unsqueeze(1)
    glob = (t - window + 1).clamp(min=0) + torch.arange(min(S, window), device=device)
    return torch.where(glob > t, -1, glob - ext_start + row_offset)


def entries_per_chunk(split: CPSplit, ratio: int) -> list[int]:
    """Compressed entries each chunk owns (those whose block ends inside it), by chunk id."""
    return [((c + 1) * split.L) // ratio - (c * split.L) // ratio for c in range(2 * split.cp)]


def chunk_entries(comp: ref.Compressor, ext: torch.Tensor, ext_start: int, g: int, L: int,
                  freqs: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The compressed entries owned by the chunk at g (blocks ending in [g, g+L)), [B, n, d], computed by
    the reference compress/finish on the blocks' tokens taken from the extended rows."""
    m = comp.ratio
    lo, hi = g // m, (g + L) // m
    if hi <= lo:
        return ext.new_zeros(ext.shape[0], 0, comp.head_dim, dtype=dtype)
    first = max(lo - 1, 0) if m == 4 else lo       # overlap: the block before the first one is read too
    xs = ext[:, first * m - ext_start:hi * m - ext_start]
    c = ref.compress(comp.project(xs, comp.wkv), comp.project(xs, comp.wgate), comp.ape, m, comp.head_dim)
    if first < lo:
        c = c[:, 1:]                               # its own previous half was the block-0 fill, not real
    return comp.finish(c, torch.arange(lo, hi, device=ext.device) * m, freqs, dtype)


def gather_entries(mine: list[torch.Tensor], split: CPSplit, ratio: int,
                   anchor: torch.Tensor | None = None) -> torch.Tensor:
    """This rank's two chunks' entries -> every entry of the sequence in global order, [B, S//ratio, d].
    `anchor` (a parameter of the compressor) makes the gathered rows part of the graph on every rank,
    also where a rank owns no entry: the backward reduce-scatter must run on all CP ranks or none."""
    counts = entries_per_chunk(split, ratio)
    nmax = max(counts)
    B, d = mine[0].shape[0], mine[0].shape[-1]
    send = torch.stack([F.pad(e, (0, 0, 0, nmax - e.shape[1])) for e in mine])   # [2, B, nmax, d]
    if anchor is not None and torch.is_grad_enabled() and anchor.requires_grad and not send.requires_grad:
        send = send + 0.0 * anchor.sum()
    every = cp_all_gather(send)                                                   # [cp, 2, B, nmax, d]
    flat = every.permute(2, 0, 1, 3, 4).reshape(B, split.cp * 2 * nmax, d)
    chunk = torch.repeat_interleave(torch.arange(2 * split.cp), torch.tensor(counts))
    j = torch.cat([torch.arange(n) for n in counts])
    r, s = split.owner(chunk)
    return flat.index_select(1, ((r * 2 + s) * nmax + j).to(flat.device))


def compressed_idxs(pos: torch.Tensor, ratio: int, n: int, offset: int) -> torch.Tensor:
    """[len(pos), n] dense compressed attention at global positions: entry i (row offset+i) once its block
    is complete (the reference's compress_topk_idxs with each query's own position)."""
    i = torch.arange(n, device=pos.device).unsqueeze(0)
    return torch.where(i < (pos.unsqueeze(1) + 1) // ratio, i + offset, -1)


def indexer_logits(q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, split: CPSplit, impl: str) -> torch.Tensor:
    """Indexer scores [B, 2L, N] of this rank's queries against all N gathered entries, -inf where entry c is
    not complete for the query's global position t (c >= (t+1)//4)."""
    if impl != "tilelang":
        pos = split.positions(q.device)
        ok = torch.arange(k.shape[1], device=q.device).unsqueeze(0) < (pos.unsqueeze(1) + 1) // 4
        return kref.indexer_scores(q, k, w).masked_fill(~ok, float("-inf"))
    # The kernel masks by the query's row within the call. For a chunk starting at g (a multiple of 4) the
    # entries from g/4 on are masked exactly as for a sequence starting at g; the earlier ones are visible
    # to every query of the chunk and are scored without a mask, one head at a time to keep memory at [L, g/4].
    from dsv4.kernels import indexer_logits as kernel_logits
    L = split.L
    parts = []
    for k_, g in enumerate(split.starts):
        qs, ws = q[:, k_ * L:(k_ + 1) * L], w[:, k_ * L:(k_ + 1) * L]
        if g % 4:
            pos = torch.arange(g, g + L, device=q.device)
            ok = torch.arange(k.shape[1], device=q.device).unsqueeze(0) < (pos.unsqueeze(1) + 1) // 4
            parts.append(_scores_by_head(qs, k, ws).masked_fill(~ok, float("-inf")))
            continue
        diag = kernel_logits(qs, k[:, g // 4:], ws, 4, impl="tilelang")
        parts.append(torch.cat([_scores_by_head(qs, k[:, :g // 4], ws), diag], dim=-1) if g else diag)
    return torch.cat(parts, dim=1)


def _scores_by_head(q: torch.Tensor, k: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """sum_h relu(q_h . k) * w_h, fp32 [B, S, N], without the [B, S, H, N] intermediate of the einsum."""
    kf = k.float().transpose(1, 2)
    out = q.new_zeros(q.shape[0], q.shape[1], k.shape[1], dtype=torch.float32)
    for h in range(q.shape[2]):
        out += (q[:, :, h].float() @ kf).relu() * w[:, :, h].float().unsqueeze(-1)
    return out
