"""DeepSeek-V4 checkpoints: official names and their HF-style aliases, a random checkpoint in the released
layout, and a streaming FP8/MXFP4 -> BF16 dequantizer.

Released layout (official names, e.g. `layers.0.attn.wq_a.weight` + `layers.0.attn.wq_a.scale`):
  * FP8 linears: e4m3 [N, K] + e8m0 (or fp32) scales [ceil(N/128), ceil(K/128)];
  * routed experts (MXFP4): int8 [N, K/2], two e2m1 codes per byte (low nibble = even column) + e8m0 [N, K/32];
  * attn_sink, hc_*, ape, gate.bias: fp32; gate.tid2eid: int32; everything else bf16.
`ModelConfig.storage_format(name)` says which is which; `ModelConfig.param_shapes()` gives logical shapes.

BF16 output of the dequantizer: quantized and bf16 tensors become bf16; fp32 and int32 tensors keep their dtype
(the sink, hyper-connection and ape parameters must stay fp32). Names are the official ones, which the Hub
release has and transformers' and SGLang's DeepSeek-V4 loaders read; HF-style aliases are read, not written.

Shards are written by our own streaming safetensors writer: the header is known in advance from the plan, tensor
bytes are appended one tensor at a time (memory stays bounded by the largest tensor), the file is fsynced under a
`.tmp` name and renamed, so a shard file that exists is complete (an error removes the `.tmp`). The dequantizer keeps its plan in
`.dequantize-plan.json` and resumes by skipping shards that exist and whose header and size match the plan.
"""
from __future__ import annotations

import hashlib
import json
import os
import queue
import re
import shutil
import struct
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Callable, Iterable

import msgspec
import torch

from dsv4 import quant
from dsv4.config import ModelConfig
from dsv4.fileio import atomic_write

INDEX = "model.safetensors.index.json"
PLAN = ".dequantize-plan.json"
SHARD_RE = re.compile(r"^model-\d{5}-of-\d{5}\.safetensors$")
DEFAULT_SHARD_BYTES = 4 << 30

Progress = Callable[[int, int, str], None]   # (bytes done, bytes total, current tensor name)


class CheckpointError(ValueError):
    """A checkpoint that does not match what is expected (missing/extra tensors, wrong shapes, bad files)."""


# ================================================================================================ names
# Tensor names. The Hub release names its tensors as the official code does (`embed.weight`,
# `layers.N.attn.wq_a.weight` + `.scale`, `layers.N.ffn.experts.E.w1.weight`, `mtp.K.*`), and the loaders of
# other projects read exactly those:
#  * transformers 5.x `DeepseekV4ForCausalLM.from_pretrained` renames and fuses them on load (the "deepseek_v4"
#    entry of transformers/conversion_mapping.py; `mtp.*` is in its `_keys_to_ignore_on_load_unexpected`);
#  * SGLang's `DeepseekV4ForCausalLM.load_weights` (python/sglang/srt/models/deepseek_v4.py) renames every
#    incoming name itself (`remap_weight_name_to_dpsk_hf_format`), and its FP8 `wo_a` pre-pass
#    (`_dequant_fp8_wo_a`) finds a scale only under its official name `.wo_a.scale`.
# So `--names hf` writes the official names, and `--names official` is the same output.
# The HF-style aliases (`model.layers.N.self_attn.wq_a.weight_scale_inv`, `mlp.experts.E.gate_proj`, MTP block k
# as `model.layers.{n_layers+k}`: the names SGLang renames the official ones into) are read, never written: a
# BF16 checkpoint under them still loads, as every reader here detects a checkpoint's naming with `detect_naming`.
OFFICIAL, ALIASES = "official", "aliases"
NAMES = ("hf", "official")          # `dequantize --names` values; both write the official names

_ALIAS_COMPONENT = {"attn": "self_attn", "ffn": "mlp", "attn_norm": "input_layernorm",
                    "ffn_norm": "post_attention_layernorm"}
_ALIAS_EXPERT_W = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}
_OFF_COMPONENT = {v: k for k, v in _ALIAS_COMPONENT.items()}
_OFF_EXPERT_W = {v: k for k, v in _ALIAS_EXPERT_W.items()}


def official_to_alias(name: str, n_layers: int) -> str:
    """Official name (weights and `.scale` tensors) -> its HF-style alias. MTP block k becomes
    model.layers.{n_layers+k}."""
    top = {"embed.weight": "model.embed_tokens.weight", "head.weight": "lm_head.weight", "norm.weight": "model.norm.weight"}
    if name in top:
        return top[name]
    if name.startswith("hc_head_"):
        return "model." + name
    parts = name.split(".")
    if parts[0] == "layers":
        prefix, rest = ["model", "layers", parts[1]], parts[2:]
    elif parts[0] == "mtp":
        prefix, rest = ["model", "layers", str(n_layers + int(parts[1]))], parts[2:]
        if rest == ["norm", "weight"]:
            return ".".join(prefix + ["shared_head", "norm", "weight"])
        if rest and rest[0] == "head":
            return ".".join(prefix + ["shared_head"] + rest)
    else:
        raise KeyError(f"official name {name!r} is not a DeepSeek-V4 parameter name")
    out = []
    for i, p in enumerate(rest):
        prev = rest[i - 1] if i else ""
        if i == 0 and p in _ALIAS_COMPONENT:
            p = _ALIAS_COMPONENT[p]
        elif p in _ALIAS_EXPERT_W:                   # only experts.{e}.w* and shared_experts.w* exist
            p = _ALIAS_EXPERT_W[p]
        elif prev == "gate" and p == "bias":
            p = "e_score_correction_bias"
        elif prev == "gate" and p == "tid2eid":
            out[-1] = "topk"
        elif p == "scale" and i == len(rest) - 1:
            p = "weight_scale_inv"
        out.append(p)
    return ".".join(prefix + out)


def alias_to_official(name: str, n_layers: int) -> str:
    """Inverse of official_to_alias."""
    top = {"model.embed_tokens.weight": "embed.weight", "lm_head.weight": "head.weight", "model.norm.weight": "norm.weight"}
    if name in top:
        return top[name]
    if name.startswith("model.hc_head_"):
        return name[len("model."):]
    parts = name.split(".")
    if parts[:2] != ["model", "layers"] or len(parts) < 4:
        raise KeyError(f"HF-style name {name!r} is not a DeepSeek-V4 parameter name")
    layer, rest = int(parts[2]), parts[3:]
    prefix = ["layers", str(layer)] if layer < n_layers else ["mtp", str(layer - n_layers)]
    if layer >= n_layers and rest[0] == "shared_head":
        return ".".join(prefix + rest[1:])
    out = []
    for i, p in enumerate(rest):
        if i == 0 and p in _OFF_COMPONENT:
            p = _OFF_COMPONENT[p]
        elif p in _OFF_EXPERT_W:
            p = _OFF_EXPERT_W[p]
        elif p == "e_score_correction_bias":
            p = "bias"
        elif p == "topk":
            p = "gate"
        elif p == "weight_scale_inv":
            p = "scale"
        out.append(p)
    return ".".join(prefix + out)


def _is_alias(name: str) -> bool:
    # every alias starts with `model.` but the head's; no official name does
    return name.startswith("model.") or name == "lm_head.weight"


def detect_naming(names: Iterable[str], where: str | Path = "checkpoint") -> str:
    """The naming of a checkpoint from its tensor names (its index keys): OFFICIAL or ALIASES. A checkpoint that
    mixes the two is an error (its readers map one naming or the other)."""
    alias = official = None
    for n in names:
        if _is_alias(n):
            alias = alias or n
        else:
            official = official or n
        if alias and official:
            raise CheckpointError(f"{where}: mixes official tensor names ({official}) with HF-style aliases "
                                  f"({alias}); write it again with `v4 ckpt dequantize`")
    return ALIASES if alias else OFFICIAL


def to_official(name: str, naming: str, n_layers: int) -> str:
    """A tensor name of a checkpoint in `naming` -> the official name."""
    return alias_to_official(name, n_layers) if naming == ALIASES else name


def from_official(name: str, naming: str, n_layers: int) -> str:
    """The official name -> the tensor's name in a checkpoint in `naming`."""
    return official_to_alias(name, n_layers) if naming == ALIASES else name


def name_map(cfg: ModelConfig) -> dict[str, str]:
    """Every tensor name of the released layout (weights and scales; the names `dequantize` writes) -> its
    HF-style alias (read too)."""
    return {n: official_to_alias(n, cfg.n_layers) for n, _, _ in checkpoint_entries(cfg)}


# ================================================================================================ layout
_ST_DTYPES = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32", torch.float64: "F64",
              torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
              torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
              torch.float8_e8m0fnu: "F8_E8M0"}
_TORCH_DTYPES = {v: k for k, v in _ST_DTYPES.items()}
_ITEMSIZE = {k: torch.empty(0, dtype=v).element_size() for k, v in _TORCH_DTYPES.items()}


def _scale_name(weight_name: str) -> str:
    return weight_name[: -len(".weight")] + ".scale"


def checkpoint_entries(cfg: ModelConfig) -> list[tuple[str, str, tuple[int, ...]]]:
    """Tensors of the released layout as (official name, safetensors dtype, shape), in parameter order,
    without allocating anything. A quantized weight is followed by its `.scale`."""
    out = []
    block = 128
    for name, shape in cfg.param_shapes().items():
        fmt = cfg.storage_format(name)
        if fmt == "fp8":
            out.append((name, "F8_E4M3", shape))
            sdt = "F8_E8M0" if cfg.scale_dtype == "fp8" else "F32"
            out.append((_scale_name(name), sdt, (-(-shape[0] // block), -(-shape[1] // block))))
        elif fmt == "fp4":
            out.append((name, "I8", (shape[0], shape[1] // 2)))
            out.append((_scale_name(name), "F8_E8M0", (shape[0], shape[1] // 32)))
        else:
            out.append((name, {"bf16": "BF16", "fp32": "F32", "int32": "I32"}[fmt], shape))
    return out


def _nbytes(dtype: str, shape: Iterable[int]) -> int:
    n = _ITEMSIZE[dtype]
    for s in shape:
        n *= s
    return n


def _shard_groups(items: list[tuple[str, int]], shard_bytes: int) -> list[list[str]]:
    """Split (group key, bytes) into consecutive shards of at most shard_bytes (a group larger than that
    gets a shard of its own)."""
    shards, cur, size = [], [], 0
    for key, n in items:
        if cur and size + n > shard_bytes:
            shards.append(cur)
            cur, size = [], 0
        cur.append(key)
        size += n
    if cur:
        shards.append(cur)
    return shards


def shard_file_name(i: int, n: int) -> str:
    return f"model-{i + 1:05d}-of-{n:05d}.safetensors"


# ================================================================================================ safetensors io
class _HeaderEntry(msgspec.Struct, forbid_unknown_fields=True):
    dtype: str
    shape: list[Annotated[int, msgspec.Meta(ge=0)]]
    data_offsets: tuple[Annotated[int, msgspec.Meta(ge=0)], Annotated[int, msgspec.Meta(ge=0)]]


def read_header(path: str | Path) -> tuple[dict, int]:
    """(tensor name -> {dtype, shape, data_offsets}, offset of the data section). The messages of its errors
    quote none of the file's bytes (a server reads files a caller names), only what they fail to be."""
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise CheckpointError(f"{path}: too short for a safetensors file")
        (n,) = struct.unpack("<Q", raw)
        if n > 100 << 20:
            raise CheckpointError(f"{path}: not a safetensors file (its first 8 bytes are no header length)")
        try:
            header = json.loads(f.read(n))
        except (ValueError, RecursionError):
            raise CheckpointError(f"{path}: its header is not valid JSON: truncated or corrupted; download it again") from None
        size = os.fstat(f.fileno()).st_size
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: its header is not a JSON object; not a safetensors file")
    header.pop("__metadata__", None)
    for name, v in header.items():
        try:
            e = msgspec.convert(v, _HeaderEntry)
        except msgspec.ValidationError as err:
            raise CheckpointError(f"{path}: header entry {name[:200]!r} is not a safetensors tensor entry ({err}); "
                                  f"corrupted, download it again") from None
        lo, hi = e.data_offsets
        if e.dtype in _ITEMSIZE and hi - lo != _nbytes(e.dtype, e.shape) or hi < lo:
            raise CheckpointError(f"{path}: header entry {name[:200]!r}: data_offsets span {hi - lo} bytes, its "
                                  f"dtype and shape need {_nbytes(e.dtype, e.shape) if e.dtype in _ITEMSIZE else '?'}; "
                                  f"corrupted, download it again")
    need = 8 + n + max((v["data_offsets"][1] for v in header.values()), default=0)
    if size < need:
        # found here, before anything is written, not as a reader error halfway through the conversion
        raise CheckpointError(f"{path}: truncated: {size} bytes where its header describes {need}; download it again")
    return header, 8 + n


class ShardWriter:
    """Streams tensors into one safetensors file whose header (names, dtypes, shapes) is fixed up front.
    As a context manager it writes `path`.tmp and renames it to `path` only when every tensor arrived,
    so a shard under its final name is always complete.

    The bytes go to the file from a thread of its own (at most two tensors queued), so whoever produces the
    tensors (the dequantizer) computes the next one while the disk takes this one: where writing is the slow
    part, a write blocks for as long as the disk needs, and inline it would stall the compute."""

    def __init__(self, path: str | Path, entries: list[tuple[str, str, tuple[int, ...]]]):
        self.final = Path(path)
        self.path, self.entries, self.next = self.final.with_name(self.final.name + ".tmp"), entries, 0
        header, offset = {"__metadata__": {"format": "pt"}}, 0
        for name, dtype, shape in entries:
            n = _nbytes(dtype, shape)
            header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + n]}
            offset += n
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)              # data section 8-byte aligned
        self.size = 8 + len(raw) + offset
        self.f = open(self.path, "wb")
        self.f.write(struct.pack("<Q", len(raw)) + raw)
        self._queue: queue.Queue = queue.Queue(maxsize=2)
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._drain, name=f"write {self.final.name}", daemon=True)
        self._thread.start()

    def _drain(self) -> None:
        while (item := self._queue.get()) is not None:
            t, release = item
            if self._error is None:             # after a failed write, keep taking tensors so no put() blocks
                try:
                    self.f.write(memoryview(t.reshape(-1).view(torch.uint8).numpy()))   # no extra copy
                except BaseException as e:      # noqa: BLE001 -- raised again in the caller's thread
                    self._error = e
            if release is not None:
                release(t)

    def _join(self) -> None:
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()
        if self._error is not None:
            raise self._error

    def write(self, name: str, t: torch.Tensor, release: Callable[[torch.Tensor], None] | None = None) -> None:
        """Queues t for the file; `release(t)` is called once its bytes are written (t's memory may be reused)."""
        want_name, dtype, shape = self.entries[self.next]
        if name != want_name or _ST_DTYPES.get(t.dtype) != dtype or tuple(t.shape) != tuple(shape):
            raise CheckpointError(f"{self.path.name}: expected {want_name} {dtype} {list(shape)}, got {name} "
                                  f"{_ST_DTYPES.get(t.dtype, t.dtype)} {list(t.shape)}")
        if self._error is not None:
            raise self._error
        self._queue.put((t.detach().contiguous(), release))
        self.next += 1

    def close(self) -> None:
        self._join()
        if self.next != len(self.entries):
            raise CheckpointError(f"{self.path.name}: {len(self.entries) - self.next} tensors not written")
        self.f.flush()
        os.fsync(self.f.fileno())
        self.f.close()

    def __enter__(self) -> "ShardWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            try:
                self._join()
            except BaseException:         # noqa: BLE001 -- the exception in flight is the one to report
                pass
            self.f.close()            # a rerun writes the shard again from its start: nothing partial stays
            self.path.unlink(missing_ok=True)
            return
        try:
            self.close()
        except BaseException:
            self.f.close()
            self.path.unlink(missing_ok=True)
            raise
        os.replace(self.path, self.final)


def _shard_is_complete(path: Path, entries: list) -> bool:
    """A finished shard: same tensors, dtypes and shapes as planned, and the file is as long as its header says."""
    if not path.is_file():
        return False
    try:
        header, data_start = read_header(path)
    except (CheckpointError, ValueError, OSError):
        return False
    if list(header) != [e[0] for e in entries]:
        return False
    end = 0
    for name, dtype, shape in entries:
        h = header[name]
        if h["dtype"] != dtype or tuple(h["shape"]) != tuple(shape):
            return False
        end = max(end, h["data_offsets"][1])
    return path.stat().st_size == data_start + end


def _write_index(directory: Path, weight_map: dict[str, str], total: int) -> None:
    atomic_write(directory / INDEX, json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map},
                                                     indent=1) + "\n")


def _check_destination(out: Path, force: bool, what: str) -> None:
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"{out} exists and is not a directory; choose another output path")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise FileExistsError(f"{out} is not empty; refusing to overwrite it with {what}. "
                              "Pass --force (force=True) to replace it, or choose an empty directory")


# ================================================================================================ generator
@dataclass
class GenerateSummary:
    out_dir: str
    n_tensors: int
    n_shards: int
    total_bytes: int
    files: list[str] = field(default_factory=list)


def _to_release(name: str, w: torch.Tensor, cfg: ModelConfig) -> list[tuple[str, torch.Tensor]]:
    fmt = cfg.storage_format(name)
    if fmt == "fp8":
        q, s = quant.weight_quant_fp8(w, 128, ue8m0=cfg.scale_fmt == "ue8m0")
        return [(name, q), (_scale_name(name), quant.to_e8m0(s) if cfg.scale_dtype == "fp8" else s)]
    if fmt == "fp4":
        packed, s = quant.mxfp4_quant(w)
        return [(name, packed), (_scale_name(name), s)]
    return [(name, w.to({"bf16": torch.bfloat16, "fp32": torch.float32, "int32": torch.int32}[fmt]))]


def generate_checkpoint(cfg: ModelConfig, out_dir: str | Path, seed: int | None = None, force: bool = False,
                        shard_bytes: int = DEFAULT_SHARD_BYTES, progress: Progress | None = None) -> GenerateSummary:
    """Write a random checkpoint in the released layout. Tensor values are `dsv4.model.init_param` (the
    values `Transformer(cfg)` starts from with the same seed) put through the release formats, generated one
    parameter at a time."""
    from dsv4.model import init_param
    from dsv4.tokenizer import Tokenizer

    cfg = cfg.with_overrides(seed=cfg.seed if seed is None else seed)
    out = Path(out_dir)
    _check_destination(out, force, "a generated checkpoint")
    if out.is_dir() and force:
        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)

    entries = checkpoint_entries(cfg)
    by_param: dict[str, list] = {}
    for e in entries:
        key = e[0][: -len(".scale")] + ".weight" if e[0].endswith(".scale") else e[0]
        by_param.setdefault(key, []).append(e)
    shapes = cfg.param_shapes()
    groups = _shard_groups([(k, sum(_nbytes(d, s) for _, d, s in v)) for k, v in by_param.items()], shard_bytes)
    total = sum(_nbytes(d, s) for _, d, s in entries)
    weight_map, done = {}, 0
    for i, params in enumerate(groups):
        fname = shard_file_name(i, len(groups))
        with ShardWriter(out / fname, [e for p in params for e in by_param[p]]) as writer:
            for p in params:
                for name, t in _to_release(p, init_param(p, shapes[p], cfg, cfg.seed), cfg):
                    writer.write(name, t)
                    weight_map[name] = fname
                    done += t.numel() * t.element_size()
                if progress:
                    progress(done, total, p)
    _write_index(out, weight_map, total)

    tok = Tokenizer()
    tok.save(out)
    hf = cfg.to_hf_config()
    hf.update(bos_token_id=tok.bos_id, eos_token_id=tok.eos_id, pad_token_id=tok.pad_id)
    atomic_write(out / "config.json", json.dumps(hf, indent=1) + "\n")
    encoder = Path(__file__).with_name("encoding.py")
    if encoder.is_file():  # the released checkpoints carry their chat encoder as encoding/encoding_dsv4.py
        (out / "encoding").mkdir(exist_ok=True)
        shutil.copyfile(encoder, out / "encoding" / "encoding_dsv4.py")
    files = sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file())
    return GenerateSummary(str(out), len(entries), len(groups), total, files)


# ================================================================================================ reading
@dataclass
class SourceTensor:
    file: Path
    dtype: str
    shape: tuple[int, ...]


class _Index(msgspec.Struct):
    weight_map: dict[str, str]


def inside(root: Path, rel: str | Path) -> Path:
    """`root / rel` resolved (symlinks followed); CheckpointError unless that is inside `root` (also resolved)."""
    base = Path(root).resolve()
    real = (base / rel).resolve()
    if real != base and base not in real.parents:
        raise CheckpointError(f"{Path(root) / rel} is outside the checkpoint directory {root} (a '..', an absolute "
                              f"path or a symlink out of it): only files inside the directory are read")
    return real


def _source_tensors(src: Path, confine: bool = False) -> dict[str, SourceTensor]:
    """Every tensor of a checkpoint directory's shards (its index's, or every *.safetensors). `confine`: refuse
    any file (index, shard) that resolves outside `src`; a directory of symlinks into a cache (the Hub's
    snapshots/) is read only without it."""
    def resolve(rel):
        return inside(src, rel) if confine else src / rel
    index = resolve(INDEX)
    if index.is_file():
        try:
            files = sorted(set(msgspec.json.decode(index.read_bytes(), type=_Index).weight_map.values()))
        except (msgspec.DecodeError, RecursionError) as e:      # ValidationError is a DecodeError
            raise CheckpointError(f"{src / INDEX}: not a safetensors index ({e}); expected "
                                  f'{{"weight_map": {{tensor: shard file}}}}') from None
    else:
        files = sorted(p.name for p in src.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{src}: no {INDEX} and no *.safetensors files; is this a checkpoint directory?")
    out: dict[str, SourceTensor] = {}
    for fname in files:
        path = resolve(fname)
        if not path.is_file():
            raise CheckpointError(f"{src / INDEX} lists {fname}, which does not exist; re-download that shard")
        header, _ = read_header(path)
        for name, h in header.items():
            if name in out:
                raise CheckpointError(f"tensor {name} is in both {out[name].file.name} and {fname}")
            out[name] = SourceTensor(path, h["dtype"], tuple(h["shape"]))
    return out


def _to_official_names(tensors: dict[str, SourceTensor], n_layers: int, where: Path) -> dict[str, SourceTensor]:
    naming = detect_naming(tensors, where)
    if naming == OFFICIAL:
        return tensors
    try:
        return {to_official(n, naming, n_layers): t for n, t in tensors.items()}
    except (KeyError, ValueError) as e:
        raise CheckpointError(f"{where}: {e.args[0] if isinstance(e, KeyError) else e}") from None


# Copies of the shared embedding/head inside an MTP block. The model shares `embed`/`head` (the official
# converter skips these), but a released file may carry them; they are passed through, not rejected.
_MTP_SHARED = re.compile(r"^mtp\.\d+\.(emb\.tok_emb|embed_tokens|head)\.weight$")


def _expected_source(name: str, shape: tuple[int, ...], fmt: str) -> list[tuple[str, tuple[int, ...]]]:
    """(tensor, shape) the source must hold for parameter `name` of logical `shape` stored as `fmt`."""
    if fmt == "fp8":
        return [(name, shape), (_scale_name(name), (-(-shape[0] // 128), -(-shape[1] // 128)))]
    if fmt == "fp4":
        return [(name, (shape[0], shape[1] // 2)), (_scale_name(name), (shape[0], shape[1] // 32))]
    return [(name, shape)]


def _source_format(cfg: ModelConfig, name: str, tensors: dict[str, SourceTensor]) -> str:
    """How the source stores `name`: from the dtype on disk (a checkpoint may already be partly bf16)."""
    t = tensors[name]
    if t.dtype in ("F8_E4M3",):
        return "fp8"
    if t.dtype in ("I8", "U8") and _scale_name(name) in tensors:
        return "fp4"
    return "plain"


def check_source(cfg: ModelConfig, tensors: dict[str, SourceTensor], where: Path
                 ) -> tuple[dict[str, str], dict[str, tuple[int, ...]]]:
    """Every config parameter present with the right shape, nothing unexpected.
    -> ({tensor group: source format}, {tensor group: logical shape}): the config's parameters, then any MTP
    copies of the shared embedding/head found in the files."""
    errors, formats = [], {}
    expected = dict(cfg.param_shapes())
    expected.update({n: (cfg.vocab_size, cfg.dim) for n in sorted(tensors) if _MTP_SHARED.match(n)})
    used = set()
    for name, shape in expected.items():
        if name not in tensors:
            errors.append(f"missing {name} {list(shape)}")
            continue
        fmt = _source_format(cfg, name, tensors)
        formats[name] = fmt
        for tname, tshape in _expected_source(name, shape, fmt):
            used.add(tname)
            if tname not in tensors:
                errors.append(f"missing {tname} (scale of {name})")
            elif tensors[tname].shape != tuple(tshape):
                errors.append(f"{tname}: shape {list(tensors[tname].shape)} in {tensors[tname].file.name}, "
                              f"config expects {list(tshape)}")
    extra = sorted(set(tensors) - used)
    errors += [f"unexpected tensor {n} {list(tensors[n].shape)} in {tensors[n].file.name}" for n in extra[:20]]
    if len(extra) > 20:
        errors.append(f"... and {len(extra) - 20} more unexpected tensors")
    if errors:
        raise CheckpointError(f"{where}: checkpoint does not match its config.json "
                              f"({cfg.n_layers} layers, {cfg.n_routed_experts} experts, dim {cfg.dim}); "
                              f"{len(errors)} problem(s):\n  " + "\n  ".join(errors[:60]) +
                              "\nFix: point at the right checkpoint, or correct config.json to describe these tensors")
    return formats, expected


class _Reader:
    """Lazily opened safetensors handles (memory-mapped; one tensor in memory at a time)."""

    def __init__(self):
        self.handles = {}

    def get(self, t: SourceTensor, name: str) -> torch.Tensor:
        from safetensors import SafetensorError, safe_open
        try:
            if t.file not in self.handles:
                self.handles[t.file] = safe_open(str(t.file), framework="pt")
            return self.handles[t.file].get_tensor(name)
        except (SafetensorError, OSError) as e:       # read_header passed it: changed since, or corrupted
            raise CheckpointError(f"{t.file}: cannot read {name}: {e}") from None


# ================================================================================================ dequantizer
@dataclass
class DequantSummary:
    src: str
    dst: str
    n_tensors: int
    n_shards: int
    shards_written: int
    shards_skipped: int
    bytes_in: int                  # the whole source's
    bytes_out: int                 # of the shards this call covers: all of them, or a `part`'s
    names: str
    complete: bool = True          # False after a `part`: the index is not written yet


def _plan_fingerprint(src_tensors: dict[str, SourceTensor]) -> str:
    h = hashlib.sha256()
    for name in sorted(src_tensors):
        t = src_tensors[name]
        h.update(f"{name}|{t.dtype}|{t.shape}|{t.file.name}|{t.file.stat().st_size}\n".encode())
    return h.hexdigest()


def dequantize_checkpoint(src: str | Path, dst: str | Path, force: bool = False, names: str = "hf",
                          shard_bytes: int = DEFAULT_SHARD_BYTES, progress: Progress | None = None,
                          workers: int = 1, part: tuple[int, int] | None = None) -> DequantSummary:
    """Released-layout checkpoint (FP8 + MXFP4, official names or HF-style aliases) -> BF16 safetensors shards +
    index in `dst` under the official names (`names` "hf" or "official", the same output: see the names section
    above), with config.json, tokenizer and encoder files copied. Resumes an interrupted run into the same
    `dst`; refuses a non-empty `dst` that is not such a run unless force. `workers` > 1 converts that many
    output shards at once in separate processes (shards are independent; progress then moves shard by shard).

    `part` = (i, n): only the output shards whose number is i modulo n, and nothing else (no index, no side files),
    so that n machines sharing `dst` convert a checkpoint together; a call without `part` after all of them finds
    their shards complete and finishes the conversion (it converts whatever a part left undone)."""
    if part is not None and not (part[1] >= 1 and 0 <= part[0] < part[1]):
        raise ValueError(f"part {part[0]}/{part[1]}: I/N with 0 <= I < N, e.g. 0/4 on the first of four machines")
    if part is not None and force:
        raise ValueError("force with a part: one part would delete the shards the others wrote; clear DST once "
                         "before the parts start")
    if names not in NAMES:
        raise ValueError(f"names={names!r}: use 'hf' or 'official' (the same output: the official names of the "
                         "Hub release, which transformers and SGLang load)")
    src, dst = Path(src), Path(dst)
    if not (src / "config.json").is_file():
        raise CheckpointError(f"{src}: no config.json; pass the checkpoint directory (it holds config.json and "
                              "the *.safetensors shards)")
    if src.resolve() == dst.resolve():
        raise CheckpointError(f"source and destination are both {src}; choose a separate output directory")
    try:
        hf_cfg = json.loads((src / "config.json").read_text())
    except ValueError as e:
        raise CheckpointError(f"{src / 'config.json'}: not valid JSON ({getattr(e, 'msg', e)} at line "
                              f"{getattr(e, 'lineno', '?')}, column {getattr(e, 'colno', '?')}); fix or download it "
                              "again") from None
    cfg = ModelConfig.from_hf_config(hf_cfg)
    raw = _source_tensors(src)
    tensors = _to_official_names(raw, cfg.n_layers, src)
    raw_name = dict(zip(tensors, raw))          # official -> the name in the source files
    formats, shapes = check_source(cfg, tensors, src)

    # ---- plan: one output tensor per parameter under its official name, shards by size
    def out_dtype(name):
        d = tensors[name].dtype
        return d if d in ("F32", "I32", "I64") else "BF16"

    items = [(p, _nbytes(out_dtype(p), shapes[p])) for p in shapes]
    groups = _shard_groups(items, shard_bytes)
    plan = {"fingerprint": _plan_fingerprint(raw), "names": OFFICIAL,
            "shards": [{"file": shard_file_name(i, len(groups)),
                        "tensors": [[p, out_dtype(p), list(shapes[p])] for p in g]}
                       for i, g in enumerate(groups)]}

    # ---- destination: fresh, resumable, or refused
    plan_path = dst / PLAN
    if dst.is_dir() and any(dst.iterdir()):
        resumable = plan_path.is_file() and not (dst / INDEX).is_file() and \
            json.loads(plan_path.read_text()) == plan
        if part is not None and not plan_path.is_file():     # another part may have started but not written the plan
            resumable = all(SHARD_RE.match(p.name) or p.name.endswith(".tmp") for p in dst.iterdir())
        if force:
            clear_conversion(dst)
        elif not resumable:
            why = "it already holds a finished conversion" if (dst / INDEX).is_file() else \
                "it holds an interrupted conversion of a different source or layout" if plan_path.is_file() else \
                "it is not empty"
            raise FileExistsError(f"{dst}: refusing to overwrite, {why}. Pass --force (force=True) to replace it, "
                                  "or choose another destination")
    dst.mkdir(parents=True, exist_ok=True)
    if not plan_path.is_file() or force:
        atomic_write(plan_path, json.dumps(plan) + "\n")

    # ---- convert shard by shard
    weight_map = {}
    bytes_in = sum(_nbytes(t.dtype, t.shape) for t in raw.values())
    bytes_out = sum(n for _, n in items)
    done = written = skipped = 0
    mine = [k for k in range(len(groups)) if part is None or k % part[1] == part[0]]
    goal = sum(_nbytes(d, s) for k in mine for _, d, s in plan["shards"][k]["tensors"])   # this call's share
    todo = []
    for k, (shard, params) in enumerate(zip(plan["shards"], groups)):
        entries = [(n, d, tuple(s)) for n, d, s in shard["tensors"]]
        for n, _, _ in entries:
            weight_map[n] = shard["file"]
        if part is not None and k % part[1] != part[0]:
            continue
        if _shard_is_complete(dst / shard["file"], entries):
            skipped += 1
            done += sum(_nbytes(d, s) for _, d, s in entries)
            if progress:
                progress(done, goal, f"(already complete) {shard['file']}")
            continue
        todo.append((dst / shard["file"], entries, params))
    job = _ShardJob(formats, tensors, raw_name)
    if workers > 1 and len(todo) > 1:
        import multiprocessing as mp
        from concurrent.futures import ProcessPoolExecutor, as_completed
        threads = max(1, torch.get_num_threads() // workers)     # the cores are shared out, not oversubscribed
        with ProcessPoolExecutor(min(workers, len(todo)), mp_context=mp.get_context("spawn"),
                                 initializer=torch.set_num_threads, initargs=(threads,)) as pool:
            futures = {pool.submit(job, *t): t[0] for t in todo}
            for f in as_completed(futures):
                done += f.result()
                written += 1
                if progress:
                    progress(done, goal, futures[f].name)
    else:
        reader = _Reader()
        for final, entries, params in todo:
            done += job(final, entries, params, reader,
                        (lambda n, b: progress(done + b, goal, n)) if progress else None)
            written += 1

    if part is not None:                   # the call without a part finishes the conversion
        return DequantSummary(str(src), str(dst), len(shapes), len(groups), written, skipped, bytes_in, goal, names,
                              complete=False)

    # ---- side files, then the index (its presence marks a finished conversion)
    out_cfg = dict(hf_cfg)
    out_cfg.pop("quantization_config", None)
    out_cfg.update(torch_dtype="bfloat16", expert_dtype="bfloat16")
    atomic_write(dst / "config.json", json.dumps(out_cfg, indent=1) + "\n")
    for p in src.iterdir():
        if p.is_file() and p.suffix in (".json", ".py", ".md", ".txt", ".jinja", ".model") \
                and p.name not in ("config.json", INDEX):
            shutil.copyfile(p, dst / p.name)
        elif p.is_dir() and p.name == "encoding":
            shutil.copytree(p, dst / p.name, dirs_exist_ok=True)
    _write_index(dst, weight_map, bytes_out)
    plan_path.unlink()
    return DequantSummary(str(src), str(dst), len(shapes), len(groups), written, skipped, bytes_in, bytes_out, names)


def clear_conversion(dst: str | Path) -> None:
    """Delete what a conversion into `dst` wrote (shards, partial shards, plan, index); other files stay."""
    for p in Path(dst).iterdir():
        if SHARD_RE.match(p.name) or p.name.endswith(".tmp") or p.name in (INDEX, PLAN):
            p.unlink()


def _dequantize_param(name: str, fmt: str, tensors: dict[str, SourceTensor], raw_name: dict[str, str],
                      reader: _Reader, out: torch.Tensor | None = None) -> torch.Tensor:
    """The parameter in bf16 if it is quantized (into `out` if given), else as stored."""
    w = reader.get(tensors[name], raw_name[name])
    if fmt == "fp8":
        s = reader.get(tensors[_scale_name(name)], raw_name[_scale_name(name)])
        return quant.weight_dequant_fp8(w, s, 128, torch.bfloat16, out=out)
    if fmt == "fp4":
        s = reader.get(tensors[_scale_name(name)], raw_name[_scale_name(name)])
        return quant.mxfp4_dequant(w, s, torch.bfloat16, out=out)
    return w


class _Buffers:
    """Output tensors to use again once the shard writer has their bytes in the file. A fresh allocation's first
    touch costs the kernel a page fault (and zeroing) every 4 KB, as much as the dequantizing itself (docs/dsv4.md).
    Routed experts and layers repeat shapes, so a few buffers a shape serve a whole shard; at most `keep` a shape
    and `max_bytes` in all are held, so a shard of many shapes does not hold a copy of each."""

    def __init__(self, keep: int = 2, max_bytes: int = 1 << 30):
        self.keep, self.max_bytes, self.held, self.free, self.lock = keep, max_bytes, 0, {}, threading.Lock()

    def get(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        with self.lock:
            stack = self.free.get((shape, dtype))
            if stack:
                t = stack.pop()
                self.held -= t.nbytes
                return t
        return torch.empty(shape, dtype=dtype)

    def put(self, t: torch.Tensor) -> None:
        with self.lock:
            stack = self.free.setdefault((tuple(t.shape), t.dtype), [])
            if len(stack) < self.keep and self.held + t.nbytes <= self.max_bytes:
                stack.append(t)
                self.held += t.nbytes


def default_workers() -> int:
    """Shards converted at once by default: half the cores (each worker also holds one tensor in memory), at most 4."""
    return max(1, min(4, (os.cpu_count() or 2) // 2))


@dataclass
class _ShardJob:
    """Converts one output shard (picklable: a worker process gets it whole and opens the sources itself)."""
    formats: dict
    tensors: dict
    raw_name: dict

    def __call__(self, final: Path, entries: list, params: list, reader: "_Reader | None" = None,
                 progress: Callable[[str, int], None] | None = None) -> int:
        reader, written, buffers = reader or _Reader(), 0, _Buffers()
        with ShardWriter(final, entries) as writer:
            for p, (n, dtype, shape) in zip(params, entries):
                quantized = self.formats[p] in ("fp8", "fp4")     # into a buffer of ours, so it can be reused
                out = buffers.get(shape, torch.bfloat16) if quantized and dtype == "BF16" else None
                t = _dequantize_param(p, self.formats[p], self.tensors, self.raw_name, reader, out)
                if tuple(t.shape) != shape:
                    raise CheckpointError(f"{p}: dequantized to {list(t.shape)}, config expects {list(shape)}")
                writer.write(n, t.to(_TORCH_DTYPES[dtype]), release=buffers.put if out is not None else None)
                written += _nbytes(dtype, shape)
                if progress:
                    progress(n, written)
        return written


# ================================================================================================ loading
def iter_state_dict(directory: str | Path, cfg: ModelConfig | None = None, confine: bool = False):
    """Yield (official name, tensor) for every parameter of a checkpoint directory, one at a time (BF16 or
    released layout; quantized weights come out as bf16). Shapes are checked against the config first.
    `confine`: open no file that resolves outside `directory` (see _source_tensors)."""
    directory = Path(directory)
    cfg = cfg or ModelConfig.from_hf_config(str(inside(directory, "config.json") if confine
                                                else directory / "config.json"))
    raw = _source_tensors(directory, confine)
    tensors = _to_official_names(raw, cfg.n_layers, directory)
    raw_name = dict(zip(tensors, raw))
    formats, _ = check_source(cfg, tensors, directory)
    reader = _Reader()
    for p in cfg.param_shapes():
        yield p, _dequantize_param(p, formats[p], tensors, raw_name, reader)


def load_state_dict(directory: str | Path, cfg: ModelConfig | None = None) -> dict[str, torch.Tensor]:
    """All of `iter_state_dict` in one dict."""
    return dict(iter_state_dict(directory, cfg))


def load_model_from_bf16(directory: str | Path, **overrides):
    """Transformer built from `directory`/config.json (plus ModelConfig overrides such as dtype="fp32") with
    the checkpoint's weights. Accepts official names or HF-style aliases; a released FP8/MXFP4 layout is
    dequantized too."""
    from dsv4.model import Transformer

    directory = Path(directory)
    cfg = ModelConfig.from_hf_config(str(directory / "config.json"), **overrides)
    model = Transformer(cfg, init=False)
    sd = load_state_dict(directory, cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(sd.pop(name).to(p.dtype))
    return model
