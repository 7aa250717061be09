"""Model FLOPs per token of DeepSeek-V4, from the config alone: what MFU divides by.

A multiply-add is 2 FLOPs. Every weight matrix a token passes through costs 2 x its size: the attention's
low-rank projections (wq_a, wq_b, wkv, wo_a, wo_b), the compressors and the indexer's projections, the router, the
shared expert, the activated share of the routed experts (k of E), the hyper-connection mixes and the LM head; the
embedding is a lookup and costs nothing. The sparse attention costs 4 x heads x head_dim per slot a query visits
(scores and values), averaged over the positions of a causal sequence: the window (up to `window_size`), plus on a
ratio-4 layer the indexer's top-k of the compressed entries so far, plus on a heavily compressed layer all of them;
the indexer scores every compressed entry so far (2 x index heads x index dim each). Norms, rotations, the Sinkhorn
iterations and the softmax are left out (elementwise, a few per cent at most). MTP blocks count when they are
trained. Training is 3 x the forward (the backward is twice it); activation recompute adds a forward that the
hardware runs but the model does not need, so it is counted apart, as hardware FLOPs.
"""
from __future__ import annotations

from collections import defaultdict

from dsv4.config import ModelConfig

PARTS = ("attention projections", "sparse attention", "compressors", "indexer", "router", "routed experts",
         "shared expert", "hyper-connections", "lm head", "mtp projections")


def _part(name: str) -> str:
    if ".shared_experts." in name:
        return "shared expert"
    if ".experts." in name:
        return "routed experts"
    if name == "head.weight":
        return "lm head"
    if ".hc_" in name or name.startswith("hc_"):
        return "hyper-connections"
    if ".indexer." in name:
        return "indexer"
    if ".compressor." in name:
        return "compressors"
    if ".gate." in name:
        return "router"
    if name.endswith(("e_proj.weight", "h_proj.weight")):
        return "mtp projections"
    return "attention projections"


def attended(cfg: ModelConfig, layer_id: int, seq_len: int) -> tuple[float, float]:
    """(slots a query attends, compressed entries the indexer scores), each averaged over positions 0..S-1.
    Sums over t in closed form (a planner asks for sequences of 10^5..10^6 tokens): query t sees min(window, t+1)
    raw rows and n(t) = (t+1)//ratio complete compressed blocks, of which a ratio-4 layer attends min(top-k, n)."""
    r, S = cfg.layer_ratio(layer_id), seq_len
    slots = _sum_min(S, cfg.window_size)
    keys = 0
    if r:
        blocks = _sum_floor(S, r)
        slots += _sum_floor_capped(S, r, cfg.index_topk) if r == 4 else blocks
        keys = blocks if r == 4 else 0
    return slots / S, keys / S


def _sum_min(S: int, w: int) -> int:
    """sum of min(w, u) for u = 1..S"""
    return S * (S + 1) // 2 if S <= w else w * (w + 1) // 2 + (S - w) * w


def _sum_floor(S: int, r: int) -> int:
    """sum of u // r for u = 1..S"""
    n = S // r
    return r * n * (n - 1) // 2 + n * (S - n * r + 1)


def _sum_floor_capped(S: int, r: int, k: int) -> int:
    """sum of min(k, u // r) for u = 1..S: u // r reaches k at u = k*r"""
    if S < k * r:
        return _sum_floor(S, r)
    return _sum_floor(k * r - 1, r) + (S - k * r + 1) * k


def block_flops_per_token(cfg: ModelConfig, seq_len: int, mtp: bool = False) -> dict[str, dict[str, float]]:
    """Forward FLOPs per token by block and part: "layers.{i}" and "mtp.{k}" (their weights and attention), and
    "top" for what sits outside the blocks (the LM head, the final hyper-connection head; with MTP its blocks'
    logits through the shared head). Their sum is forward_flops_per_token; a pipeline planner adds up a stage's."""
    blocks: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    share = cfg.n_activated_experts / cfg.n_routed_experts
    for name, shape in cfg.param_shapes().items():
        if len(shape) != 2 or name == "embed.weight" or name.endswith(("tid2eid", ".ape")):
            continue
        if name.startswith("mtp.") and not mtp:
            continue
        part = _part(name)
        key = ".".join(name.split(".")[:2]) if name.startswith(("layers.", "mtp.")) else "top"
        blocks[key][part] += 2.0 * shape[0] * shape[1] * (share if part == "routed experts" else 1.0)
    layers = cfg.n_layers + (cfg.n_mtp_layers if mtp else 0)
    for layer_id in range(layers):
        slots, keys = attended(cfg, layer_id, seq_len)
        key = f"layers.{layer_id}" if layer_id < cfg.n_layers else f"mtp.{layer_id - cfg.n_layers}"
        blocks[key]["sparse attention"] += 4.0 * cfg.n_heads * cfg.head_dim * slots
        blocks[key]["indexer"] += 2.0 * cfg.index_n_heads * cfg.index_head_dim * keys
    if mtp:                                            # each MTP block has its own logits through the shared head
        blocks["top"]["lm head"] += 2.0 * cfg.dim * cfg.vocab_size * cfg.n_mtp_layers
    return {k: {p: v[p] for p in PARTS if v.get(p)} for k, v in blocks.items()}


def forward_flops_per_token(cfg: ModelConfig, seq_len: int, mtp: bool = False) -> dict[str, float]:
    """Forward FLOPs per token by part (PARTS)."""
    parts: dict[str, float] = defaultdict(float)
    for block in block_flops_per_token(cfg, seq_len, mtp).values():
        for p, v in block.items():
            parts[p] += v
    return {p: parts[p] for p in PARTS if parts.get(p)}


def train_flops_per_token(cfg: ModelConfig, seq_len: int, mtp: bool = False, recompute: bool = False) -> tuple[float, float]:
    """(model FLOPs, hardware FLOPs) per trained token: 3 x the forward, plus one more forward with recompute."""
    fwd = sum(forward_flops_per_token(cfg, seq_len, mtp).values())
    return 3.0 * fwd, (4.0 if recompute else 3.0) * fwd
