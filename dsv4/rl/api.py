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
"""
from __future__ import annotations

import base64
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

# sampling_params keys: name -> (type, default). SGLang's keys we honour, plus allowed_token_ids.
SAMPLING_PARAMS: dict[str, tuple[type | tuple[type, ...], Any]] = {
    "max_new_tokens": (int, 128),
    "temperature": ((int, float), 1.0),
    "top_p": ((int, float), 1.0),
    "top_k": (int, -1),
    "min_p": ((int, float), 0.0),
    "stop_token_ids": (list, None),
    "ignore_eos": (bool, False),
    "sampling_seed": (int, None),
    "n": (int, 1),
    "skip_special_tokens": (bool, True),
    "no_stop_trim": (bool, False),
    "allowed_token_ids": (list, None),
}

# /generate request fields we accept (SGLang's names); anything else is a 400 naming the field.
GENERATE_FIELDS = {
    "input_ids", "rid", "sampling_params", "return_logprob", "logprob_start_len", "top_logprobs_num",
    "return_text_in_logprobs", "return_routed_experts", "routed_experts_start_len", "stream",
}


class RequestError(ValueError):
    """A bad request: `field` names the offending field (the HTTP server answers 400 with it)."""

    def __init__(self, field_name: str, message: str):
        super().__init__(f"{field_name}: {message}")
        self.field = field_name


class EngineUnavailable(RuntimeError):
    """The engine cannot serve right now (its memory is released); the HTTP server answers 503."""


def _check_type(name: str, value, typ) -> None:
    # bool is an int in Python; a JSON true for an int field is still a type error
    if isinstance(value, bool) and typ is not bool and bool not in (typ if isinstance(typ, tuple) else (typ,)):
        raise RequestError(name, f"expected {_type_name(typ)}, got a boolean")
    if not isinstance(value, typ):
        raise RequestError(name, f"expected {_type_name(typ)}, got {type(value).__name__} {value!r:.40}")


def _type_name(typ) -> str:
    names = [t.__name__ for t in (typ if isinstance(typ, tuple) else (typ,))]
    return " or ".join("number" if n == "float" else n for n in names)


@dataclass
class SamplingParams:
    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    sampling_seed: int | None = None
    allowed_token_ids: list[int] | None = None

    @classmethod
    def parse(cls, d: dict | None, where: str = "sampling_params") -> "SamplingParams":
        d = {} if d is None else d
        if not isinstance(d, dict):
            raise RequestError(where, f"expected an object, got {type(d).__name__}")
        out = {}
        for k, v in d.items():
            if k not in SAMPLING_PARAMS:
                raise RequestError(f"{where}.{k}", f"unknown sampling parameter; known: {', '.join(SAMPLING_PARAMS)}")
            typ, _ = SAMPLING_PARAMS[k]
            if v is None:
                continue
            _check_type(f"{where}.{k}", v, typ)
            if typ is list and not all(isinstance(t, int) and not isinstance(t, bool) for t in v):
                raise RequestError(f"{where}.{k}", "expected a list of token ids (integers)")
            out[k] = v
        if out.get("n", 1) != 1:
            raise RequestError(f"{where}.n", "only n=1 is served; send the prompt once per sample (same rid prefix)")
        for k in ("n", "skip_special_tokens", "no_stop_trim"):  # accepted for compatibility, no effect here
            out.pop(k, None)
        sp = cls(**out)
        if sp.max_new_tokens < 0:
            raise RequestError(f"{where}.max_new_tokens", f"must be >= 0, got {sp.max_new_tokens}")
        if not sp.temperature >= 0 or sp.temperature == float("inf"):   # written so that NaN is refused too
            raise RequestError(f"{where}.temperature", f"must be a finite number >= 0 (0 = greedy), got {sp.temperature}")
        if not 0 < sp.top_p <= 1:
            raise RequestError(f"{where}.top_p", f"must be in (0, 1], got {sp.top_p}")
        if sp.top_k == 0 or sp.top_k < -1:
            raise RequestError(f"{where}.top_k", f"must be -1 (off) or >= 1, got {sp.top_k}")
        if not 0 <= sp.min_p < 1:
            raise RequestError(f"{where}.min_p", f"must be in [0, 1), got {sp.min_p}")
        if sp.allowed_token_ids is not None and not sp.allowed_token_ids:
            raise RequestError(f"{where}.allowed_token_ids", "must name at least one token (or be left out)")
        return sp

    def to_dict(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if v is not None and v != SAMPLING_PARAMS[k][1]}


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


def parse_generate(payload: Any) -> list[GenerateRequest]:
    """A /generate body (single or batched, SGLang's forms) -> one GenerateRequest per sequence.
    Raises RequestError naming the field for anything we cannot serve exactly."""
    if not isinstance(payload, dict):
        raise RequestError("body", f"expected a JSON object, got {type(payload).__name__}")
    for k in payload:
        if k not in GENERATE_FIELDS:
            hint = " (send token ids: this engine has no tokenizer)" if k == "text" else ""
            raise RequestError(k, f"unknown or unsupported /generate field{hint}")
    if "input_ids" not in payload:
        raise RequestError("input_ids", "required")
    ids = payload["input_ids"]
    batched = isinstance(ids, list) and bool(ids) and isinstance(ids[0], list)
    seqs = ids if batched else [ids]
    for i, s in enumerate(seqs):
        where = f"input_ids[{i}]" if batched else "input_ids"
        if not isinstance(s, list) or not s:
            raise RequestError(where, "expected a non-empty list of token ids")
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in s):
            raise RequestError(where, "expected a list of integers")
    n = len(seqs)

    def per_seq(name, default):
        v = payload.get(name, default)
        if batched and isinstance(v, list) and name in ("sampling_params", "rid"):
            if len(v) != n:
                raise RequestError(name, f"a list of {len(v)} for {n} sequences")
            return v
        return [v] * n

    for name, typ in (("return_logprob", bool), ("return_routed_experts", bool), ("stream", bool),
                      ("return_text_in_logprobs", bool)):
        if name in payload and payload[name] is not None:
            _check_type(name, payload[name], typ)
    if payload.get("stream"):
        raise RequestError("stream", "streaming is not served; send stream=false")
    if payload.get("logprob_start_len", -1) not in (-1, None):
        raise RequestError("logprob_start_len", "only -1 (output tokens) is served")
    if payload.get("top_logprobs_num") not in (None, 0):
        raise RequestError("top_logprobs_num", "top logprobs are not served; use 0")
    start = payload.get("routed_experts_start_len", 0) or 0
    _check_type("routed_experts_start_len", start, int)
    rids = per_seq("rid", None)
    sps = per_seq("sampling_params", None)
    out = []
    for i in range(n):
        if rids[i] is not None and not isinstance(rids[i], str):
            raise RequestError("rid", f"expected a string, got {type(rids[i]).__name__}")
        if not 0 <= start <= len(seqs[i]):
            raise RequestError("routed_experts_start_len",
                               f"{start} is outside [0, prompt_tokens={len(seqs[i])}]")
        out.append(GenerateRequest(
            input_ids=list(seqs[i]),
            sampling_params=SamplingParams.parse(sps[i], "sampling_params" + (f"[{i}]" if batched and
                                                                              isinstance(payload.get("sampling_params"), list) else "")),
            return_logprob=bool(payload.get("return_logprob", False)),
            return_routed_experts=bool(payload.get("return_routed_experts", False)),
            routed_experts_start_len=start, rid=rids[i]))
    return out


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
