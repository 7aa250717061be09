"""The rollout-engine interface, in SGLang's names (SGLang 0.5.23, `srt/managers/io_struct.py`).

The trainer talks to a rollout engine only through `RolloutEngine`: the embedded engine in-process
(`dsv4.rl.engine.EmbeddedEngine`), our HTTP server or real SGLang servers over HTTP (`dsv4.rl.http`). The
method names, argument names and result fields are SGLang's so that one client serves both, and a field
spelt differently from SGLang's wire format fails the contract tests (tests/rl/test_http_contract.py).

What is ours, not SGLang's:
* `sampling_params.allowed_token_ids`: sampling restricted to a set of tokens. The trainer scores the
  response under the same restriction (`restricted_logprobs`), so the mismatch metric stays honest. SGLang
  has no such field; against SGLang use tasks that need no restriction.
* `routed_experts` is an int32 array in process and base64 on the wire only (`GenerateResult.to_wire`).
* Hash-routed layers are captured too (SGLang leaves their rows zero); `model_info()["hash_layers"]` names them.

Request bodies are msgspec Structs named after SGLang's classes (whose io_struct classes are msgspec Structs
too), stricter than SGLang's: unknown fields are refused everywhere, and so is what we cannot serve exactly.
"""
from __future__ import annotations

import base64
import math
import re
import types
import typing
from dataclasses import dataclass, field
from typing import Annotated, Any, ClassVar, Literal, Optional, Protocol

import msgspec
import numpy as np
from msgspec import Meta, Struct

# SGLang's _SAMPLING_EPS (srt/sampling/sampling_params.py): a temperature below it is greedy decoding. Dividing
# logits by a smaller one overflows fp32 (1e-40 is subnormal), which samples token 0 with NaN logprobs.
SAMPLING_EPS = 1e-6

Int64 = Annotated[int, Meta(ge=-(1 << 63), le=(1 << 63) - 1)]
NonNegative = Annotated[int, Meta(ge=0, le=(1 << 63) - 1)]
Port = Annotated[int, Meta(ge=1, le=65535)]

# dtype names of /update_weights_from_distributed (dsv4.rl.sync.DTYPES has a torch dtype for each)
WEIGHT_DTYPES = ("bfloat16", "float32", "float16", "float8_e4m3fn", "float8_e8m0fnu", "int32", "int64", "uint8")
MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")          # SGLang's srt/constants.py


class RequestError(ValueError):
    """A bad request: `field` names the offending field (the HTTP server answers 400 with it)."""

    def __init__(self, field_name: str, message: str):
        super().__init__(f"{field_name}: {message}")
        self.field = field_name
        self.message = message


class EngineUnavailable(RuntimeError):
    """The engine cannot serve right now (its memory is released); the HTTP server answers 503."""


# --- request schemas ------------------------------------------------------------------------------------
# Every request body is a msgspec Struct named after SGLang's class for it (SGLang's io_struct classes are
# msgspec Structs too): msgspec checks the types while it decodes, straight from the body's bytes, so a value of
# the wrong type or a nesting deeper than the schema stops at its first byte. `__post_init__` adds what a type
# cannot say (a field we refuse, a relation between fields) as a RequestError; `decode` and `convert` turn
# either into a RequestError naming the field (`sampling_params[1].top_p`).

class _Body(Struct, kw_only=True, forbid_unknown_fields=True):
    # fields SGLang has that change nothing here: validated, then not passed to the engine (see dsv4.rl.http)
    ignored: ClassVar[frozenset[str]] = frozenset()

    def engine_kwargs(self) -> dict:
        return {f: getattr(self, f) for f in self.__struct_fields__ if f not in self.ignored}


def _refuse_unless(name: str, value, allowed: tuple, why: str) -> None:
    if value not in allowed:
        raise RequestError(name, f"{value!r} is not served here; use {' or '.join(map(repr, allowed))} ({why})")


def _default_nulls(s: Struct) -> None:
    # SGLang's schema takes null for any optional field: it means the default
    for f in msgspec.structs.fields(s):
        if getattr(s, f.name) is None and f.default is not None and f.default is not msgspec.NODEFAULT:
            setattr(s, f.name, f.default)


class SamplingParams(Struct, kw_only=True, forbid_unknown_fields=True):
    """SGLang's sampling_params keys we honour, plus allowed_token_ids; null means the default. A temperature
    below SAMPLING_EPS is greedy, as in SGLang."""
    max_new_tokens: Optional[NonNegative] = 128
    temperature: Optional[Annotated[float, Meta(ge=0)]] = 1.0
    top_p: Optional[Annotated[float, Meta(gt=0, le=1)]] = 1.0
    top_k: Optional[Int64] = -1
    min_p: Optional[Annotated[float, Meta(ge=0, lt=1)]] = 0.0
    stop_token_ids: Optional[list[Int64]] = None
    ignore_eos: Optional[bool] = False
    sampling_seed: Optional[Int64] = None
    allowed_token_ids: Optional[list[Int64]] = None
    # accepted for compatibility, no effect here (no tokenizer; n is checked)
    n: Optional[Int64] = 1
    skip_special_tokens: Optional[bool] = True
    no_stop_trim: Optional[bool] = False

    def __post_init__(self):
        _default_nulls(self)
        if not math.isfinite(self.temperature) or self.temperature < 0:   # NaN fails both comparisons
            raise RequestError("temperature", f"must be a finite number >= 0 (0 = greedy), got {self.temperature}")
        for name, ok, rule in (("top_p", 0 < self.top_p <= 1, "in (0, 1]"), ("min_p", 0 <= self.min_p < 1, "in [0, 1)"),
                               ("max_new_tokens", self.max_new_tokens >= 0, ">= 0"),
                               ("top_k", self.top_k == -1 or self.top_k >= 1, "-1 (off) or >= 1")):
            if not ok:
                raise RequestError(name, f"must be {rule}, got {getattr(self, name)}")
        if self.allowed_token_ids is not None and not self.allowed_token_ids:
            raise RequestError("allowed_token_ids", "must name at least one token (or be left out)")
        if self.n != 1:
            raise RequestError("n", "only n=1 is served; send the prompt once per sample (same rid prefix)")

    @classmethod
    def parse(cls, d: Any, where: str = "sampling_params") -> "SamplingParams":
        """A JSON-like dict (None: all defaults) -> SamplingParams; RequestError names `where.<key>`."""
        return convert({} if d is None else d, cls, where)

    def to_dict(self) -> dict:
        """The keys that differ from the defaults (what a client sends)."""
        return {f.name: getattr(self, f.name) for f in msgspec.structs.fields(self)
                if getattr(self, f.name) is not None and getattr(self, f.name) != f.default}


@dataclass
class GenerateRequest:
    input_ids: list[int]
    sampling_params: SamplingParams = field(default_factory=SamplingParams)
    return_logprob: bool = False
    return_routed_experts: bool = False
    routed_experts_start_len: int = 0
    rid: str | None = None

    def to_wire(self) -> dict:
        d = {"input_ids": self.input_ids, "sampling_params": self.sampling_params.to_dict(),
             "return_logprob": self.return_logprob}
        if self.return_routed_experts:
            d["return_routed_experts"] = True
            d["routed_experts_start_len"] = self.routed_experts_start_len
        if self.rid is not None:
            d["rid"] = self.rid
        return d


class GenerateReqInput(_Body):
    """A /generate body in SGLang's single or batched form (lists of input_ids, sampling_params and rid). Token
    ids only (no tokenizer), no streaming, n = 1, logprobs of the output tokens only."""
    input_ids: Optional[list[Int64 | list[Int64]]] = None
    text: Optional[str | list[str]] = None
    rid: Optional[str | list[str]] = None
    sampling_params: Optional[SamplingParams | list[SamplingParams]] = None
    return_logprob: Optional[bool] = False
    logprob_start_len: Optional[Int64] = None
    top_logprobs_num: Optional[Int64] = None
    return_text_in_logprobs: Optional[bool] = None
    return_routed_experts: Optional[bool] = False
    routed_experts_start_len: Optional[NonNegative] = 0
    stream: Optional[bool] = False

    def __post_init__(self):
        _default_nulls(self)
        if self.text is not None:
            raise RequestError("text", "send token ids (input_ids): this engine has no tokenizer")
        if self.input_ids is None:
            raise RequestError("input_ids", "required")
        if self.stream:
            raise RequestError("stream", "streaming is not served; send stream=false")
        if self.logprob_start_len not in (-1, None):
            raise RequestError("logprob_start_len", "only -1 (output tokens) is served")
        if self.top_logprobs_num not in (None, 0):
            raise RequestError("top_logprobs_num", "top logprobs are not served; use 0")
        seqs = self.sequences
        for i, s in enumerate(seqs):
            where = f"input_ids[{i}]" if self.batched else "input_ids"
            if not isinstance(s, list) or not s:
                raise RequestError(where, "expected a non-empty list of token ids")
            if not all(isinstance(t, int) for t in s):
                raise RequestError(where, "expected a list of integers")
            if not self.routed_experts_start_len <= len(s):
                raise RequestError("routed_experts_start_len",
                                   f"{self.routed_experts_start_len} is outside [0, prompt_tokens={len(s)}]")
        for name in ("sampling_params", "rid"):
            v = getattr(self, name)
            if isinstance(v, list) and (not self.batched or len(v) != len(seqs)):
                raise RequestError(name, f"a list of {len(v)} for {len(seqs) if self.batched else 'one'} "
                                         f"sequence(s): one entry per input_ids list")

    @property
    def batched(self) -> bool:
        ids = self.input_ids
        return bool(ids) and isinstance(ids[0], list)

    @property
    def sequences(self) -> list:
        return self.input_ids if self.batched else [self.input_ids]

    def requests(self) -> list[GenerateRequest]:
        n = len(self.sequences)

        def per_seq(v):
            return v if isinstance(v, list) else [v] * n
        sps = [sp if sp is not None else SamplingParams() for sp in per_seq(self.sampling_params)]
        return [GenerateRequest(input_ids=list(s), sampling_params=sp, return_logprob=bool(self.return_logprob),
                                return_routed_experts=bool(self.return_routed_experts),
                                routed_experts_start_len=self.routed_experts_start_len, rid=rid)
                for s, sp, rid in zip(self.sequences, sps, per_seq(self.rid))]


_SELECTOR = Literal["all", "target", "draft"]


def _no_draft(selector: str) -> None:
    _refuse_unless("selector", selector, ("all", "target"), "this engine has no draft model")


class InitWeightsUpdateGroupReqInput(_Body):
    master_address: str
    master_port: Port
    rank_offset: NonNegative
    world_size: Annotated[int, Meta(ge=1, le=1 << 20)]
    group_name: str = "weight_update_group"
    backend: Literal["nccl", "gloo"] = "nccl"


class DestroyWeightsUpdateGroupReqInput(_Body):
    group_name: str = "weight_update_group"


class UpdateWeightsFromDistributedReqInput(_Body):
    ignored: ClassVar[frozenset[str]] = frozenset({"abort_all_requests", "selector", "torch_empty_cache"})
    names: list[str]
    dtypes: list[Literal[WEIGHT_DTYPES]]
    shapes: list[list[NonNegative]]
    group_name: str = "weight_update_group"
    flush_cache: bool = True
    weight_version: Optional[str] = None
    load_format: Optional[str] = None
    abort_all_requests: bool = False          # an update already waits for the generation in flight
    selector: _SELECTOR = "all"
    torch_empty_cache: bool = False

    def __post_init__(self):
        _no_draft(self.selector)


class UpdateWeightsFromTensorReqInput(_Body):
    ignored: ClassVar[frozenset[str]] = frozenset({"abort_all_requests", "selector", "torch_empty_cache"})
    serialized_named_tensors: list[str]
    load_format: Optional[str] = None
    flush_cache: bool = True
    weight_version: Optional[str] = None
    abort_all_requests: bool = False
    selector: _SELECTOR = "all"
    torch_empty_cache: bool = False

    def __post_init__(self):
        _no_draft(self.selector)


class UpdateWeightFromDiskReqInput(_Body):
    ignored: ClassVar[frozenset[str]] = frozenset({"abort_all_requests", "torch_empty_cache", "recapture_cuda_graph",
                                                   "token_step", "is_async", "keep_pause", "manifest"})
    model_path: str
    load_format: Optional[str] = None
    weight_version: Optional[str] = None
    flush_cache: bool = True
    abort_all_requests: bool = False
    torch_empty_cache: bool = False
    recapture_cuda_graph: bool = False
    token_step: Int64 = 0
    is_async: bool = False
    keep_pause: bool = False
    manifest: Optional[dict] = None

    def __post_init__(self):
        _refuse_unless("is_async", self.is_async, (False,), "the update is synchronous")
        _refuse_unless("keep_pause", self.keep_pause, (False,), "pause with /pause_generation instead")
        _refuse_unless("manifest", self.manifest, (None,), "the checkpoint directory is read as a whole")


class BeginWeightUpdateReqInput(_Body):
    ignored: ClassVar[frozenset[str]] = frozenset({"selector"})
    selector: _SELECTOR = "all"

    def __post_init__(self):
        _no_draft(self.selector)


class EndWeightUpdateReqInput(_Body):
    pass


class PauseGenerationReqInput(_Body):
    # SGLang's default mode is "abort"; the RolloutEngine protocol's is "retract" (the client always sends it)
    mode: Literal["abort", "retract", "in_place"] = "abort"


class ContinueGenerationReqInput(_Body):
    ignored: ClassVar[frozenset[str]] = frozenset({"torch_empty_cache"})
    torch_empty_cache: bool = True


class GetWeightsByNameReqInput(_Body):
    name: str
    truncate_size: NonNegative = 100


class ReleaseMemoryOccupationReqInput(_Body):
    tags: Optional[list[Literal[MEMORY_TAGS]]] = None


class ResumeMemoryOccupationReqInput(_Body):
    tags: Optional[list[Literal[MEMORY_TAGS]]] = None


# --- decoding, and msgspec's errors as RequestError -------------------------------------------------------

_AT = re.compile(r"(?s)(.*?)(?: - at `\$(.*)`)?")
_FIELD_IN_MESSAGE = re.compile(r"Object (contains unknown|missing required) field `(.*)`")
_ENUM = re.compile(r"Invalid enum value (.*)")


def decode(raw: bytes | bytearray | memoryview, typ: type[Struct]) -> Struct:
    """A JSON body -> `typ`; RequestError naming the field for malformed JSON or a value against the schema."""
    try:
        return msgspec.json.decode(raw, type=typ)
    except msgspec.ValidationError as e:            # a DecodeError too: first
        raise _request_error(e, typ, "") from None
    except msgspec.DecodeError as e:
        raise RequestError("body", f"not JSON: {str(e).removeprefix('JSON is malformed: ')}") from None
    except RecursionError:
        raise RequestError("body", "nested too deeply for any field of this endpoint") from None


def convert(obj: Any, typ: type[Struct], where: str = "") -> Struct:
    """A JSON-like Python value -> `typ` (as `decode`); field names start with `where`."""
    try:
        return msgspec.convert(obj, typ)
    except msgspec.ValidationError as e:
        raise _request_error(e, typ, where) from None
    except RecursionError:
        raise RequestError(where or "body", "nested too deeply for any field") from None


def _request_error(e: msgspec.ValidationError, typ, where: str) -> RequestError:
    text, path = _AT.fullmatch(str(e)).groups()
    path = path or ""
    cause = e.__cause__
    if isinstance(cause, RequestError):              # a __post_init__'s: its field is relative to its struct
        text, path = cause.message, f"{path}.{cause.field}"
    elif m := _FIELD_IN_MESSAGE.fullmatch(text):
        path = f"{path}.{m.group(2)}"
        if m.group(1) == "missing required":
            text = "required"
        else:
            known = [t for t in _members(_at(typ, path.rsplit(".", 1)[0])) if _is_struct(t)]
            names = ", ".join(known[0].__struct_fields__) if known else None
            text = "unknown field" + ("" if names is None else f" (known: {names})" if names else " (it takes none)")
    elif m := _ENUM.fullmatch(text):
        choices = [a for t in _members(_at(typ, path)) if typing.get_origin(t) is Literal for a in typing.get_args(t)]
        text = f"{m.group(1)} is not one of {', '.join(map(repr, choices))}" if choices else text
    field_name = (where + path) if where else path.lstrip(".")
    return RequestError(field_name or "body", text)


def _members(t) -> list:
    """The alternatives of a type, Annotated and Optional unwrapped."""
    if typing.get_origin(t) is Annotated:
        return _members(typing.get_args(t)[0])
    if typing.get_origin(t) in (typing.Union, types.UnionType):
        return [m for a in typing.get_args(t) for m in _members(a)]
    return [t]


def _at(typ, path: str):
    """The type at a msgspec error path (`.a[0].b`) inside `typ`; None when it cannot be followed."""
    for name, index in re.findall(r"\.([^.\[]+)|\[(\d+)\]", path):
        nxt = None
        for t in _members(typ):
            if name and _is_struct(t):
                nxt = next((f.type for f in msgspec.structs.fields(t) if f.name == name), None)
            elif index and typing.get_origin(t) is list:
                nxt = typing.get_args(t)[0]
            if nxt is not None:
                break
        if nxt is None:
            return None
        typ = nxt
    return typ


def _is_struct(t) -> bool:
    return isinstance(t, type) and issubclass(t, Struct)


def parse_generate(payload: Any) -> list[GenerateRequest]:
    """A /generate body as a JSON-like value (single or batched, SGLang's forms) -> one GenerateRequest per
    sequence. Raises RequestError naming the field for anything we cannot serve exactly."""
    return convert(payload, GenerateReqInput).requests()


@dataclass
class GenerateResult:
    """SGLang's non-streaming /generate response for one sequence (no `text`: no tokenizer)."""
    output_ids: list[int]
    meta_info: dict

    @property
    def routed_experts(self) -> np.ndarray | None:
        return self.meta_info.get("routed_experts")

    @property
    def logprobs(self) -> list[float]:
        return [e[0] for e in self.meta_info.get("output_token_logprobs", [])]

    def to_wire(self) -> dict:
        meta = dict(self.meta_info)
        re = meta.get("routed_experts")
        if isinstance(re, np.ndarray):
            meta["routed_experts"] = base64.b64encode(np.ascontiguousarray(re, dtype=np.int32).tobytes()).decode()
        return {"output_ids": self.output_ids, "meta_info": meta}

    @classmethod
    def from_wire(cls, d: dict, shape_tail: tuple[int, int] | None = None) -> "GenerateResult":
        """`shape_tail` = (num_layers, topk) reshapes routed_experts to [rows, layers, topk] (SGLang sends it flat)."""
        meta = dict(d["meta_info"])
        re = meta.get("routed_experts")
        if isinstance(re, str):
            arr = np.frombuffer(base64.b64decode(re), dtype=np.int32)
            meta["routed_experts"] = arr.reshape(-1, *shape_tail) if shape_tail else arr
        return cls(output_ids=list(d["output_ids"]), meta_info=meta)


def ack(success: bool = True, message: str = "") -> dict:
    """The answer of every weight endpoint: {"success", "message"} (HTTP 200 on success, 400 otherwise)."""
    return {"success": bool(success), "message": message}


class RolloutEngine(Protocol):
    """SGLang's Engine/HTTP operations the trainer uses. Each weight call returns `ack(...)`."""

    def generate(self, reqs: list[GenerateRequest]) -> list[GenerateResult]: ...
    def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                                  group_name: str = "weight_update_group", backend: str = "nccl") -> dict: ...
    def destroy_weights_update_group(self, group_name: str = "weight_update_group") -> dict: ...
    def update_weights_from_distributed(self, names: list[str], dtypes: list[str], shapes: list[list[int]],
                                        group_name: str = "weight_update_group", flush_cache: bool = True,
                                        weight_version: str | None = None, load_format: str | None = None) -> dict: ...
    def update_weights_from_tensor(self, named_tensors, load_format: str | None = None, flush_cache: bool = True,
                                   weight_version: str | None = None) -> dict: ...
    def update_weights_from_disk(self, model_path: str, load_format: str | None = None,
                                 weight_version: str | None = None, flush_cache: bool = True) -> dict: ...
    def begin_weight_update(self) -> dict: ...
    def end_weight_update(self) -> dict: ...
    # SGLang's server defaults to "abort"; in process the default drains the batch in flight ("retract")
    def pause_generation(self, mode: str = "retract") -> dict: ...
    def continue_generation(self) -> dict: ...
    def flush_cache(self) -> dict: ...
    def release_memory_occupation(self, tags: list[str] | None = None) -> dict: ...
    def resume_memory_occupation(self, tags: list[str] | None = None) -> dict: ...
    def health(self) -> bool: ...
    def health_generate(self) -> bool: ...
    def model_info(self) -> dict: ...
