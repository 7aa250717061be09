"""The HTTP rollout engine (dsv4/rl/http.py, `v4 rl serve`) against SGLang 0.5.23's own contract.

SGLang's contract comes from its PyPI wheel (downloaded once into ~/.cache/v4-tests/): the generated JSON schema
`sglang/api/v1/api_types.py`, loaded with nothing but msgspec, and the request classes of
`sglang/srt/managers/io_struct.py` and routes of `sglang/srt/entrypoints/http_server.py`, read with `ast`.
/generate bodies are checked with the schema's generated codecs (`X.from_json_value`), which are what SGLang's
server itself runs on every /generate body (`srt/entrypoints/api_contract.py`) and the only reader of its
positional `[logprob, token_id, text]` entries. Our real server runs in a thread in front of a real
EmbeddedEngine on the tiny model; it is driven with HTTPEngine and raw urllib.
"""
from __future__ import annotations

import ast
import base64
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import types
import urllib.error
import urllib.parse
import urllib.request
import zipfile
from dataclasses import dataclass
from pathlib import Path

import msgspec
import numpy as np
import pytest
import torch

from dsv4.rl import sync
from dsv4.megatron.launch import free_port
from dsv4.rl.api import GenerateRequest, RequestError, SamplingParams
from dsv4.rl.engine import EmbeddedEngine
from dsv4.rl.http import (ENDPOINT_BODIES, FRONTEND, ROUTES, EngineHTTPError, HTTPEngine, RemoteRequestError,
                          RolloutHTTPServer, serialize_named_tensors, serve)

SGLANG = "0.5.23"
CACHE = Path.home() / ".cache" / "v4-tests" / f"sglang-{SGLANG}"
ROOT = Path(__file__).resolve().parents[2]
# pip's words for "the index could not be reached" (as opposed to a real failure, which must fail the test)
NO_NETWORK = ("NewConnectionError", "Failed to establish a new connection", "Temporary failure in name resolution",
              "Name or service not known", "Network is unreachable", "ConnectTimeoutError", "ProxyError",
              "Max retries exceeded", "No route to host", "Connection refused", "nodename nor servname")


# --- SGLang's contract, from the wheel ------------------------------------------------------------------

class _Offline(Exception):
    pass


def _sglang_wheel() -> Path:
    """The cached wheel, downloaded on first use; _Offline when the index cannot be reached."""
    wheels = sorted(CACHE.glob(f"sglang-{SGLANG}-*.whl"))
    if not wheels:
        CACHE.mkdir(parents=True, exist_ok=True)
        r = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
                            f"sglang=={SGLANG}", "-d", str(CACHE)], capture_output=True, text=True, timeout=900)
        out = r.stdout + r.stderr
        wheels = sorted(CACHE.glob(f"sglang-{SGLANG}-*.whl"))
        if not wheels:
            reachable, index = _index_reachable()
            if not reachable or any(s in out for s in NO_NETWORK):
                raise _Offline(f"cannot download sglang=={SGLANG}: the package index {index} cannot be reached "
                            f"(no network): {out.strip().splitlines()[-1] if out.strip() else ''}")
            pytest.fail(f"pip download sglang=={SGLANG} failed although {index} answers:\n{out[-3000:]}")
    return wheels[-1]


def _index_reachable() -> tuple[bool, str]:
    """Whether pip's index accepts a TCP connection (pip itself does not always say why a download failed)."""
    index = os.environ.get("PIP_INDEX_URL")
    if not index:
        r = subprocess.run([sys.executable, "-m", "pip", "config", "get", "global.index-url"], capture_output=True,
                           text=True)
        index = r.stdout.strip() if r.returncode == 0 and r.stdout.strip() else "https://pypi.org/simple"
    u = urllib.parse.urlsplit(index)
    if u.scheme not in ("http", "https") or not u.hostname:
        return True, index
    try:
        socket.create_connection((u.hostname, u.port or (443 if u.scheme == "https" else 80)), timeout=10).close()
        return True, index
    except OSError:
        return False, index


@dataclass
class Sglang:
    schema: types.ModuleType                       # sglang/api/v1/api_types.py
    classes: dict[str, dict[str, bool]]            # io_struct class -> {field: required}
    routes: dict[str, tuple[set[str], str | None]]  # http_server path -> (methods, request class)
    extract_routed_experts: object                 # srt/state_capturer/routed_experts.py's decoder


def _source(wheel: Path, member: str) -> str:
    with zipfile.ZipFile(wheel) as z:
        return z.read(member).decode()


def _load_schema(src: str) -> types.ModuleType:
    # "loads standalone with only msgspec": check that before executing it
    imported = set()
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, ast.Import):
            imported |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            imported.add((node.module or "").split(".")[0])
    assert imported <= {"__future__", "typing", "msgspec"}, f"api_types.py now imports {imported}"
    mod = types.ModuleType("sglang_api_v1_api_types")
    mod.__file__ = "sglang/api/v1/api_types.py"
    sys.modules[mod.__name__] = mod            # msgspec resolves the postponed annotations through it
    exec(compile(src, f"<sglang-{SGLANG}>/sglang/api/v1/api_types.py", "exec"), mod.__dict__)
    return mod


def _io_struct_classes(src: str) -> dict[str, dict[str, bool]]:
    """Every class's annotated fields (own and inherited from classes in the same file) -> required?"""
    tree = ast.parse(src)
    own, bases = {}, {}
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            own[node.name] = {s.target.id: s.value is None for s in node.body
                              if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)
                              and not (isinstance(s.annotation, ast.Name) and s.annotation.id == "ClassVar")}
            bases[node.name] = [b.id for b in node.bases if isinstance(b, ast.Name)]

    def fields(name):
        out = {}
        for b in bases.get(name, []):
            out.update(fields(b))
        out.update(own.get(name, {}))
        return out
    return {name: fields(name) for name in own}


def _http_routes(src: str) -> dict[str, tuple[set[str], str | None]]:
    """SGLang's route table: path -> (methods, the class of the `obj` body parameter)."""
    routes = {}
    for node in ast.walk(ast.parse(src)):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        body_cls = None
        for a in node.args.args:
            if a.arg == "obj" and a.annotation is not None:
                ann = a.annotation
                if isinstance(ann, ast.Subscript):                     # Annotated[X, Body()]
                    ann = ann.slice.elts[0] if isinstance(ann.slice, ast.Tuple) else ann.slice
                body_cls = ann.id if isinstance(ann, ast.Name) else None
        for d in node.decorator_list:
            if not (isinstance(d, ast.Call) and isinstance(d.func, ast.Attribute) and d.args
                    and isinstance(d.args[0], ast.Constant) and isinstance(d.args[0].value, str)):
                continue
            kind = d.func.attr
            if kind in ("get", "post", "put"):
                methods = {kind.upper()}
            elif kind == "api_route":
                m = next((k.value for k in d.keywords if k.arg == "methods"), None)
                methods = {e.value for e in m.elts} if isinstance(m, ast.List) else {"GET"}
            else:
                continue
            routes[d.args[0].value] = (methods, body_cls)
    return routes


def _routed_experts_decoder(src: str):
    # SGLang's own decoder, cut out of a module that needs CUDA-era imports; pybase64 is base64-compatible
    fn = next(n for n in ast.parse(src).body
              if isinstance(n, ast.FunctionDef) and n.name == "extract_routed_experts_from_meta_info")
    ns = {"np": np, "pybase64": base64}
    exec(compile(ast.Module([fn], type_ignores=[]), "<sglang routed_experts.py>", "exec"), ns)
    return ns[fn.name]


@pytest.fixture(scope="session")
def sgl_or_reason() -> Sglang | str:
    """SGLang's contract, or why it is not at hand (then the contract tests skip; the others still run)."""
    try:
        import msgspec  # noqa: F401 - api_types.py needs it
    except ImportError:
        return "msgspec reads SGLang's schema: pip install -e ."
    try:
        wheel = _sglang_wheel()
    except _Offline as e:
        return str(e)
    return Sglang(
        schema=_load_schema(_source(wheel, "sglang/api/v1/api_types.py")),
        classes=_io_struct_classes(_source(wheel, "sglang/srt/managers/io_struct.py")),
        routes=_http_routes(_source(wheel, "sglang/srt/entrypoints/http_server.py")),
        extract_routed_experts=_routed_experts_decoder(_source(wheel, "sglang/srt/state_capturer/routed_experts.py")))


@pytest.fixture(scope="session")
def sgl(sgl_or_reason) -> Sglang:
    if isinstance(sgl_or_reason, str):
        pytest.skip(sgl_or_reason)
    return sgl_or_reason


# --- our server, a recording client ------------------------------------------------------------------------

@dataclass
class Call:
    method: str
    path: str
    payload: object
    status: int | None
    body: bytes | None


class RecordingClient(HTTPEngine):
    """HTTPEngine that keeps every request it sends and every answer it gets, for the contract checks."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.calls: list[Call] = []

    def _call(self, method, path, payload=None, **kw):
        try:
            status, body = super()._call(method, path, payload, **kw)
        except (EngineHTTPError, RemoteRequestError) as e:
            self.calls.append(Call(method, path, payload, e.status, None))
            raise
        self.calls.append(Call(method, path, payload, status, body))
        return status, body

    def sent(self, path):
        return [c for c in self.calls if c.path == path]


@dataclass
class Served:
    engine: EmbeddedEngine
    server: RolloutHTTPServer
    client: RecordingClient
    log: list[str]

    @property
    def url(self):
        return self.server.url


@pytest.fixture
def start(sgl_or_reason):
    """start(engine=None, host=..., token=...) -> Served; every /generate sent through its client is checked
    against SGLang's schema at teardown (when the schema is at hand)."""
    running: list[Served] = []

    def _start(engine=None, host="127.0.0.1", token=None):
        engine = engine or EmbeddedEngine.from_preset("tiny", seed=0)
        log: list[str] = []
        server = RolloutHTTPServer(engine, host, 0, token, log=log.append)
        threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        url = server.url if host not in ("0.0.0.0", "") else f"http://127.0.0.1:{server.server_address[1]}"
        s = Served(engine, server, RecordingClient(url, token=token, timeout=120), log)
        running.append(s)
        return s

    yield _start
    for s in running:
        s.server.shutdown()
        s.server.server_close()
    if isinstance(sgl_or_reason, str):
        return
    for s in running:
        for c in s.client.sent("/generate"):
            check_generate_request(sgl_or_reason, c.payload)
            if c.status == 200:
                check_generate_response(sgl_or_reason, c.payload, json.loads(c.body))


def check_generate_request(sgl: Sglang, payload: dict) -> None:
    sgl.schema.GenerateRequest.from_json_value(payload)           # raises JsonContractError on a violation
    # the schema ignores unknown keys (return_routed_experts is one): GenerateReqInput has them all
    assert set(payload) <= set(sgl.classes["GenerateReqInput"]), set(payload) - set(sgl.classes["GenerateReqInput"])


def check_generate_response(sgl: Sglang, payload: dict, body) -> None:
    batched = isinstance(payload["input_ids"][0], list)
    assert isinstance(body, list) == batched, "a batched input_ids answers a JSON list, a single one an object"
    items = body if batched else [body]
    for i, item in enumerate(items):
        r = sgl.schema.GenerateResponse.from_json_value(item)
        meta = item["meta_info"]
        assert r.meta_info.weight_version and r.meta_info.completion_tokens == len(item["output_ids"])
        if payload.get("return_logprob"):
            assert all(len(e) == 3 for e in meta["output_token_logprobs"])
            assert [e.token_id for e in r.meta_info.output_token_logprobs] == item["output_ids"]
        if payload.get("return_routed_experts"):
            flat = sgl.extract_routed_experts(item)
            prompt = payload["input_ids"][i] if batched else payload["input_ids"]
            rows = len(prompt) + len(item["output_ids"]) - 1 - payload.get("routed_experts_start_len", 0)
            assert flat.dtype == np.int32 and flat.size % rows == 0 and flat.size // rows > 0


def _raw(url, method="GET", body=None, token=None, data=None):
    """(status, headers, body bytes) of one raw HTTP request."""
    if body is not None:
        data = json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method)
    if data is not None:
        req.add_header("Content-Type", "application/json")
    if token is not None:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, r.headers, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.headers, e.read()


def _field_error(sgl, status, body, field):
    assert status == 400, body
    err = json.loads(body)["error"]
    sgl.schema.ErrorBody.from_json_value(err)
    assert err["field"] == field, err
    return err["message"]


def _req(prompt, n=4, logprob=True, routes=False, start=0, **sp):
    return GenerateRequest(list(prompt), SamplingParams(max_new_tokens=n, **sp), return_logprob=logprob,
                           return_routed_experts=routes, routed_experts_start_len=start)


# --- /generate against the schema ------------------------------------------------------------------------

def test_schema_loads_from_the_wheel_with_only_msgspec(sgl):
    assert {"GenerateRequest", "GenerateResponse", "GenerateMetaInfo", "LogprobEntry"} <= set(vars(sgl.schema))
    assert {"InitWeightsUpdateGroupReqInput", "UpdateWeightsFromTensorReqInput", "GenerateReqInput"} <= set(sgl.classes)
    assert sgl.routes["/generate"] == ({"POST", "PUT"}, "GenerateReqInput")


def test_generate_with_logprobs_and_routed_experts_meets_the_schema(start, sgl):
    s = start()
    info = s.client.model_info()
    L, k = info["num_hidden_layers"], info["num_experts_per_tok"]
    prompt = [5, 17, 42, 99, 7]
    [res] = s.client.generate([_req(prompt, n=5, routes=True, start=1, temperature=0)])
    [call] = s.client.sent("/generate")
    assert isinstance(call.payload["input_ids"][0], int)          # one request: SGLang's single form
    wire = json.loads(call.body)
    # 3-element entries, ids matching the output, a finite logprob each
    assert [e[1] for e in wire["meta_info"]["output_token_logprobs"]] == res.output_ids
    assert all(len(e) == 3 and e[2] is None and e[0] <= 0 for e in wire["meta_info"]["output_token_logprobs"])
    # routed_experts: base64 int32 [S-1-start, L, k], decoded by SGLang's own reader as by ours
    rows = len(prompt) + len(res.output_ids) - 1 - 1
    assert res.routed_experts.shape == (rows, L, k)
    assert np.array_equal(sgl.extract_routed_experts(wire), res.routed_experts.reshape(-1))
    assert ((0 <= res.routed_experts) & (res.routed_experts < info["n_routed_experts"])).all()
    assert res.meta_info["weight_version"] == info["weight_version"] == "default"
    sgl.schema.GetModelInfoResponse.from_json_value(info)


def test_batched_input_ids_answer_a_list_and_single_an_object(start, sgl):
    s = start()
    single = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 3, "temperature": 0},
              "return_logprob": True}
    batched = {"input_ids": [[1, 2, 3], [4, 5]], "sampling_params": [{"max_new_tokens": 2}, {"max_new_tokens": 3}],
               "rid": ["a", "b"], "return_logprob": True, "return_routed_experts": True}
    for payload in (single, batched):
        check_generate_request(sgl, payload)
        for method in ("POST", "PUT"):
            status, headers, body = _raw(s.url + "/generate", method, payload)
            assert status == 200 and headers["Content-Type"] == "application/json"
            check_generate_response(sgl, payload, json.loads(body))
    out = json.loads(_raw(s.url + "/generate", "POST", batched)[2])
    assert [o["meta_info"]["id"] for o in out] == ["a", "b"]
    assert [len(o["output_ids"]) for o in out] == [2, 3]
    # HTTPEngine sends several requests as one batched body (one per run of equal per-batch flags)
    res = s.client.generate([_req([1, 2, 3], 2), _req([4, 5], 3), _req([6], 2, routes=True)])
    assert [len(r.output_ids) for r in res] == [2, 3, 2] and res[2].routed_experts is not None
    assert [type(c.payload["input_ids"][0]) for c in s.client.sent("/generate")] == [list, int]


def test_the_schema_rejects_a_two_element_logprob_entry(start, sgl):
    """The check can fail: a mock with miles' 2-element entries would not pass it."""
    s = start()
    s.client.generate([_req([3, 4, 5], 2)])
    good = json.loads(s.client.sent("/generate")[0].body)
    sgl.schema.GenerateResponse.from_json_value(good)
    bad = json.loads(json.dumps(good))
    bad["meta_info"]["output_token_logprobs"] = [e[:2] for e in bad["meta_info"]["output_token_logprobs"]]
    with pytest.raises(sgl.schema.JsonContractError, match="3-element"):
        sgl.schema.GenerateResponse.from_json_value(bad)


def test_allowed_token_ids_is_our_extension_outside_sglangs_schema(start, sgl):
    s = start()
    digits = list(range(48, 58))
    [r] = s.client.generate([_req([1, 2], 6, allowed_token_ids=digits)])
    assert set(r.output_ids) <= set(digits)
    payload = s.client.sent("/generate")[0].payload
    with pytest.raises(sgl.schema.JsonContractError, match="allowed_token_ids"):
        sgl.schema.GenerateRequest.from_json_value(payload)
    s.client.calls.clear()               # checked above: SGLang would refuse it, on purpose
    # against an SGLang server the client refuses before sending
    s.client._ours = False
    with pytest.raises(RequestError, match="SGLang") as e:
        s.client.generate([_req([1, 2], 2, allowed_token_ids=digits)])
    assert e.value.field == "sampling_params.allowed_token_ids" and not s.client.calls


# --- weight and control endpoints against io_struct -------------------------------------------------------

def test_our_routes_and_accepted_fields_are_sglangs(sgl):
    for path, (methods, _) in ROUTES.items():
        assert path in sgl.routes, f"{path} is not an SGLang route"
        assert set(methods) == sgl.routes[path][0], (path, methods, sgl.routes[path][0])
    for path, body in ENDPOINT_BODIES.items():
        cls = body.__name__
        assert sgl.routes[path][1] == cls, f"SGLang reads {path} into {sgl.routes[path][1]}, not {cls}"
        fields = sgl.classes[cls]
        spec = {f.name: f.required for f in msgspec.structs.fields(body)}
        assert set(spec) <= set(fields), f"{path}: {set(spec) - set(fields)} are not fields of {cls}"
        required = {f for f, req in fields.items() if req}
        ours = {f for f, req in spec.items() if req}
        assert ours == required, (path, ours, required)
        assert body.ignored <= set(spec)
    # sampling_params: SGLang's keys, and our allowed_token_ids
    ours = set(SamplingParams.__struct_fields__) - {"allowed_token_ids"}
    theirs = set(sgl.schema.SamplingParams.__struct_fields__)
    assert ours <= theirs, ours - theirs


def test_every_payload_the_client_sends_is_an_sglang_request(start, sgl, tmp_path):
    s = start()
    c = s.client
    name, p = "head.weight", dict(s.engine.model.named_parameters())["head.weight"]
    port = free_port()
    answers = {
        # a one-rank group: the engine is rank 0 and hosts the store, so it forms at once
        "init": c.init_weights_update_group("127.0.0.1", port, 0, 1, group_name="g", backend="gloo"),
        "dist": c.update_weights_from_distributed([], [], [], group_name="g", weight_version="d1"),
        "destroy": c.destroy_weights_update_group("g"),
        "begin": c.begin_weight_update(),
        "tensor": c.update_weights_from_tensor([(name, p.detach().clone())], weight_version="t1"),
        "end": c.end_weight_update(),
        "disk": c.update_weights_from_disk(str(tmp_path / "absent"), weight_version="x"),
        "pause": c.pause_generation("retract"),
        "continue": c.continue_generation(),
        "flush": c.flush_cache(),
        "release": c.release_memory_occupation(["kv_cache"]),
        "resume": c.resume_memory_occupation(),
    }
    # SGLang answers the parameter's values themselves (a JSON list), not an ack
    values = c.get_weights_by_name(name, truncate_size=5)
    assert values == p.detach().flatten()[:5].tolist()
    assert all(a["success"] for k, a in answers.items() if k != "disk"), answers
    assert not answers["disk"]["success"] and "config.json" in answers["disk"]["message"]
    seen = set()
    for call in c.calls:
        if call.path not in ENDPOINT_BODIES or call.path == "/generate":
            continue
        cls = sgl.routes[call.path][1]
        fields = sgl.classes[cls]
        sent = set(call.payload or {})
        assert sent <= set(fields), f"{call.path}: {sent - set(fields)} are not fields of SGLang's {cls}"
        missing = {f for f, req in fields.items() if req} - sent
        assert not missing, f"{call.path}: required {missing} not sent"
        seen.add(call.path)
        body = json.loads(call.body)
        if call.path == "/get_weights_by_name":
            assert isinstance(body, list) and len(body) == call.payload["truncate_size"]
            continue
        out_cls = cls.replace("ReqInput", "ReqOutput")
        # the answer carries SGLang's output fields (success/message; num_paused_requests for disk)
        assert {f for f in sgl.classes.get(out_cls, {}) if f not in ("rid", "http_worker_ipc")} <= set(body), \
            (call.path, body)
    assert seen == set(ENDPOINT_BODIES) - {"/generate"}
    assert json.loads(c.sent("/pause_generation")[0].body)["status"] == "ok"
    [flush] = c.sent("/flush_cache")
    assert flush.payload is None and flush.body.startswith(b"Cache flushed")    # SGLang: text, body-less
    assert s.engine.weight_version == "t1"


def test_broadcast_weight_update_over_http(start):
    """The trainer (rank 0, gloo) broadcasts a bucket while /update_weights_from_distributed receives it."""
    s = start()
    params = dict(s.engine.model.named_parameters())
    new = {n: torch.randn_like(params[n]) for n in ("head.weight", "norm.weight")}
    port = free_port()
    trainer = {}
    t = threading.Thread(target=lambda: trainer.update(g=sync.weight_group("127.0.0.1", port, 0, 2, "gloo", "w")))
    t.start()
    assert s.client.init_weights_update_group("127.0.0.1", port, 1, 2, group_name="w", backend="gloo")["success"]
    t.join(30)
    ans = {}
    t = threading.Thread(target=lambda: ans.update(a=s.client.update_weights_from_distributed(
        list(new), [sync.dtype_name(v.dtype) for v in new.values()], [list(v.shape) for v in new.values()],
        group_name="w", weight_version="b1")))
    t.start()
    for v in new.values():
        sync.broadcast(trainer["g"], v)
    t.join(60)
    assert ans["a"]["success"], ans
    assert all(torch.equal(params[n], v) for n, v in new.items())
    assert s.client.model_info()["weight_version"] == "b1"
    assert s.client.destroy_weights_update_group("w")["success"]


def test_update_weights_from_tensor_round_trip_and_refusals(start, tmp_path):
    s = start()
    p = dict(s.engine.model.named_parameters())["norm.weight"]
    t = torch.rand_like(p)
    assert s.client.update_weights_from_tensor([("norm.weight", t)], weight_version="r1")["success"]
    assert torch.equal(p, t) and s.client.model_info()["weight_version"] == "r1"
    # a name the model lacks: SGLang's failure answer, the weights untouched
    a = s.client.update_weights_from_tensor([("no.such.weight", t)])
    assert not a["success"] and "no.such.weight" in a["message"] and torch.equal(p, t)
    # a pickle that would run code is refused (torch.load weights_only), and nothing runs
    marker = tmp_path / "ran"

    class Evil:
        def __reduce__(self):
            return (Path.touch, (marker,))
    import io
    buf = io.BytesIO()
    torch.save([("norm.weight", Evil())], buf)
    status, _, body = _raw(s.url + "/update_weights_from_tensor", "POST",
                           {"serialized_named_tensors": [base64.b64encode(buf.getvalue()).decode()]})
    assert status == 400 and json.loads(body)["error"]["field"] == "serialized_named_tensors[0]"
    assert not marker.exists()
    status, _, body = _raw(s.url + "/update_weights_from_tensor", "POST",
                           {"serialized_named_tensors": [serialize_named_tensors([("norm.weight", t)])] * 2})
    assert status == 400 and "TP=1" in json.loads(body)["error"]["message"]
    # against SGLang (CUDA-IPC handles) the client says what to use instead
    s.client._ours = False
    with pytest.raises(EngineHTTPError, match="update_weights_from_distributed"):
        s.client.update_weights_from_tensor([("norm.weight", t)])


# --- bad requests -------------------------------------------------------------------------------------

def test_unknown_fields_are_400_naming_the_field_on_every_endpoint(start, sgl):
    s = start()
    base = {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1}}
    st, _, body = _raw(s.url + "/generate", "POST", {**base, "retrun_logprob": True})
    _field_error(sgl, st, body, "retrun_logprob")
    st, _, body = _raw(s.url + "/generate", "POST", {**base, "sampling_params": {"max_new_token": 3}})
    _field_error(sgl, st, body, "sampling_params.max_new_token")
    for path in ENDPOINT_BODIES:
        st, _, body = _raw(s.url + path, "POST", {"weight_verison": "v1"})
        _field_error(sgl, st, body, "weight_verison")
    st, _, body = _raw(s.url + "/update_weights_from_disk", "POST", {"model_path": "/x", "weight_verison": "v1"})
    _field_error(sgl, st, body, "weight_verison")
    st, _, body = _raw(s.url + "/flush_cache?tiemout=3", "POST")
    _field_error(sgl, st, body, "query.tiemout")
    # and through the client: the same exception type the in-process engine raises
    with pytest.raises(RequestError) as e:
        s.client._json("POST", "/generate", {**base, "bogus": 1})
    assert e.value.field == "bogus"
    s.client.calls.clear()               # not an SGLang request, on purpose


def test_bad_types_and_missing_fields_are_400(start, sgl):
    s = start()
    cases = [
        ("/generate", {"input_ids": "hello"}, "input_ids"),
        ("/generate", {"input_ids": [1, True]}, "input_ids[1]"),
        ("/generate", {"input_ids": [[1], []]}, "input_ids[1]"),
        ("/generate", {"text": "hello"}, "text"),
        ("/generate", {"input_ids": [1], "sampling_params": {"top_p": 0}}, "sampling_params.top_p"),
        ("/generate", {"input_ids": [[1], [2]], "sampling_params": [{}, {"n": 2}]}, "sampling_params[1].n"),
        ("/generate", {"input_ids": [1], "return_logprob": "yes"}, "return_logprob"),
        ("/generate", {"input_ids": [1], "sampling_params": {"temperature": "hot"}}, "sampling_params.temperature"),
        ("/generate", {"input_ids": [1], "sampling_params": {"max_new_tokens": 1.5}}, "sampling_params.max_new_tokens"),
        ("/generate", {"sampling_params": {}}, "input_ids"),
        ("/generate", [1, 2], "body"),
        ("/init_weights_update_group", {"master_address": "h", "master_port": "80", "rank_offset": 1,
                                        "world_size": 2}, "master_port"),
        ("/init_weights_update_group", {"master_port": 80, "rank_offset": 1, "world_size": 2}, "master_address"),
        ("/update_weights_from_distributed", {"names": ["a"], "dtypes": ["bfloat16"], "shapes": [[1, "2"]]},
         "shapes[0][1]"),
        ("/update_weights_from_disk", {"model_path": 7}, "model_path"),
        ("/update_weights_from_disk", {"model_path": "/x", "is_async": True}, "is_async"),
        ("/update_weights_from_tensor", {"serialized_named_tensors": ["%%%"]}, "serialized_named_tensors[0]"),
        ("/begin_weight_update", {"selector": "draft"}, "selector"),
        ("/pause_generation", {"mode": "later"}, "mode"),
        ("/update_weights_from_distributed", {"names": ["a"], "dtypes": ["complex64"], "shapes": [[1]]}, "dtypes[0]"),
        ("/release_memory_occupation", {"tags": "weights"}, "tags"),
    ]
    for path, payload, field in cases:
        st, _, body = _raw(s.url + path, "POST", payload)
        _field_error(sgl, st, body, field)
    st, _, body = _raw(s.url + "/generate", "POST", data=b"{not json")
    _field_error(sgl, st, body, "body")
    assert _raw(s.url + "/no_such_endpoint")[0] == 404
    st, headers, _ = _raw(s.url + "/generate")
    assert st == 405 and "POST" in headers["Allow"]
    # the server still serves after all that
    assert s.client.generate([_req([1, 2], 1)])[0].output_ids


def test_a_prompt_past_the_context_limit_is_400(start):
    s = start()
    limit = s.client.model_info()["max_context_length"]
    with pytest.raises(RequestError) as e:
        s.client.generate([_req(range(limit + 5), 1)])
    assert e.value.field == "input_ids" and e.value.status == 400 and str(limit) in str(e.value)
    with pytest.raises(RequestError) as e:
        s.client.generate([_req([1, 2, 3], limit)])
    assert e.value.field == "sampling_params.max_new_tokens"


def test_out_of_memory_is_503_and_the_server_keeps_serving(start, monkeypatch):
    s = start()

    def oom(reqs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")
    monkeypatch.setattr(s.engine, "generate", oom)
    with pytest.raises(EngineHTTPError) as e:
        s.client.generate([_req([1, 2], 2)])
    assert e.value.status == 503 and "out of memory" in e.value.message and "still serving" in e.value.message
    s.client.calls.clear()
    monkeypatch.undo()
    assert len(s.client.generate([_req([1, 2], 2)])[0].output_ids) == 2


# --- auth ---------------------------------------------------------------------------------------------

def test_off_loopback_needs_a_token(start, sgl_or_reason):
    engine = EmbeddedEngine.from_preset("tiny", seed=0)
    for host in ("0.0.0.0", ""):
        with pytest.raises(ValueError, match="token"):
            RolloutHTTPServer(engine, host, 0)
        with pytest.raises(ValueError, match="token"):
            serve(engine, host, 0)
    # with one: every endpoint but GET /health wants it
    s = start(engine, host="0.0.0.0", token="s3cret-token")
    assert s.client.generate([_req([1, 2], 1)])[0].output_ids
    assert _raw(s.client.base_url + "/health")[0] == 200
    for token in (None, "wrong", "s3cret-tokenX", ""):
        for method, path, body in (("POST", "/generate", {"input_ids": [1]}), ("GET", "/health_generate", None),
                                   ("GET", "/model_info", None), ("POST", "/begin_weight_update", {})):
            st, headers, data = _raw(s.client.base_url + path, method, body, token=token)
            assert st == 401 and headers["WWW-Authenticate"] == "Bearer", (path, token, st)
            assert json.loads(data)["error"]["code"] == 401
    assert s.engine.weight_version == "default"            # the refused begin_weight_update did nothing
    with pytest.raises(EngineHTTPError) as e:
        HTTPEngine(s.client.base_url, token="wrong").health_generate()
    assert e.value.status == 401


def test_the_cli_refuses_off_loopback_without_a_token_and_open_token_files(tmp_path):
    from click.testing import CliRunner

    from launcher.commands.rl import rl
    from launcher.errors import ConfigError
    r = CliRunner().invoke(rl, ["serve", "--host", "0.0.0.0"])
    assert isinstance(r.exception, ConfigError) and "token" in r.exception.message
    tok = tmp_path / "token"
    tok.write_text("abc\n")
    tok.chmod(0o644)
    r = CliRunner().invoke(rl, ["serve", "--host", "0.0.0.0", "--token-file", str(tok)])
    assert isinstance(r.exception, ConfigError) and r.exception.fix == f"chmod 600 {tok}"
    tok.chmod(0o600)
    tok.write_text("\n")
    r = CliRunner().invoke(rl, ["serve", "--token-file", str(tok)])
    assert isinstance(r.exception, ConfigError) and "empty" in r.exception.message


# --- weight versions and the update bracket -----------------------------------------------------------

def test_generate_during_a_weight_update_waits_for_the_whole_update(start, sgl_or_reason):
    s = start()
    greedy = [_req([7, 8, 9, 10], 5, temperature=0, routes=True)]
    before = s.client.generate(greedy)[0]
    assert before.meta_info["weight_version"] == "default" == s.client.model_info()["weight_version"]
    params = dict(s.engine.model.named_parameters())
    torch.manual_seed(1)
    new = {n: torch.randn_like(params[n]) * params[n].std() + params[n].mean() for n in ("embed.weight", "head.weight")}

    assert s.client.begin_weight_update()["success"]
    got = {}
    waiting = threading.Thread(target=lambda: got.update(r=s.client.generate(greedy)[0]))
    waiting.start()
    # two buckets, the version set with the last one: a generate must see neither half
    assert s.client.update_weights_from_tensor([("embed.weight", new["embed.weight"])])["success"]
    time.sleep(0.3)
    assert waiting.is_alive(), "a generate ran between two buckets of one update"
    assert s.client.update_weights_from_tensor([("head.weight", new["head.weight"])], weight_version="step-1")["success"]
    time.sleep(0.3)
    assert waiting.is_alive(), "a generate ran before end_weight_update"
    assert s.client.end_weight_update()["success"]
    waiting.join(60)
    assert not waiting.is_alive()
    during = got["r"]
    after = s.client.generate(greedy)[0]
    assert during.meta_info["weight_version"] == after.meta_info["weight_version"] == "step-1"
    assert s.client.model_info()["weight_version"] == "step-1"
    if not isinstance(sgl_or_reason, str):
        sgl_or_reason.schema.GetModelInfoResponse.from_json_value(s.client.model_info())
    # the waiting request ran on the complete new weights: identical to one sent afterwards, unlike the old
    assert during.output_ids == after.output_ids and during.logprobs == after.logprobs
    assert np.array_equal(during.routed_experts, after.routed_experts)
    assert during.logprobs != before.logprobs


def test_generate_waits_while_paused(start):
    s = start()
    assert s.client.pause_generation("retract")["success"]
    got = {}
    t = threading.Thread(target=lambda: got.update(r=s.client.generate([_req([1, 2], 2)])[0]))
    t.start()
    time.sleep(0.3)
    assert t.is_alive()
    assert s.client.continue_generation()["success"]
    t.join(60)
    assert len(got["r"].output_ids) == 2


# --- health, info, the command ----------------------------------------------------------------------------

def test_health_info_and_wait_healthy(start, sgl):
    s = start()
    assert s.client.health() and s.client.health_generate()
    s.client.wait_healthy(10)
    info = s.client.server_info()
    sgl.schema.GetServerInfoResponse.from_json_value(info)
    assert info["frontend"] == FRONTEND and info["port"] == s.server.server_address[1] and s.client.is_ours()
    assert json.loads(_raw(s.url + "/get_model_info")[2]) == s.client.model_info()
    # one log line per request: client, method, path, status, milliseconds
    assert any(re.fullmatch(r"127\.0\.0\.1 GET /server_info 200 \d+\.\d ms", line) for line in s.log), s.log
    dead = HTTPEngine(f"http://127.0.0.1:{free_port()}", timeout=1)
    assert not dead.health()
    with pytest.raises(TimeoutError, match="not healthy"):
        dead.wait_healthy(0.5, interval=0.1)


def test_v4_rl_serve_prints_a_curl_example_and_stops_on_sigterm(tmp_path):
    tok = tmp_path / "token"
    tok.write_text("tok-123\n")
    tok.chmod(0o600)
    p = subprocess.Popen([sys.executable, "-m", "launcher", "rl", "serve", "--port", "0", "--token-file", str(tok),
                          "--max-batch", "4", "--max-body-mb", "128", "--read-timeout", "30", "--group-timeout", "5"],
                         cwd=ROOT, stderr=subprocess.PIPE, text=True,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        lines = []
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not any("curl" in x for x in lines):
            line = p.stderr.readline()
            if not line:
                break
            lines.append(line)
        text = "".join(lines)
        url = re.search(r"at (http://127\.0\.0\.1:\d+)", text).group(1)
        curl = re.search(r"try: (curl .*)", text).group(1)
        assert "Authorization: Bearer $(cat" in curl and "tok-123" not in text
        r = subprocess.run(["bash", "-c", curl], capture_output=True, text=True, timeout=60)
        assert json.loads(r.stdout)["meta_info"]["completion_tokens"] == 8, r
        client = HTTPEngine(url, token="tok-123")
        assert client.server_info()["max_batch"] == 4
        # --max-body-mb: a body over it is refused from its headers; one under it is read, and its memory given back
        host, port = urllib.parse.urlsplit(url).netloc.split(":")
        with socket.create_connection((host, int(port)), timeout=60) as c:
            c.sendall(b"POST /update_weights_from_tensor HTTP/1.0\r\nAuthorization: Bearer tok-123\r\n"
                      + f"Content-Length: {129 << 20}\r\n\r\n".encode())
            answer = c.makefile("rb").read()
        assert answer.startswith(b"HTTP/1.0 413") and b"limit of 128 MiB" in answer, answer[:300]
        rss = _rss_mb(p.pid)
        big = client.update_weights_from_tensor([("no.such.weight", torch.zeros(8 << 20))])   # 43 MiB of base64
        assert not big["success"] and "no.such.weight" in big["message"]
        assert _rss_mb(p.pid) - rss < 40, (rss, _rss_mb(p.pid))
        p.send_signal(signal.SIGTERM)
        rc = p.wait(30)
        rest = p.stderr.read()
        assert rc == 0, rest
        assert "POST /generate 200" in rest and "stopped" in rest
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for {pid}")


def test_the_command_module_does_not_import_torch():
    code = "import sys, launcher.commands.rl; print('torch' in sys.modules, 'dsv4' in sys.modules)"
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert r.stdout.split() == ["False", "False"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_real_cuda_out_of_memory_is_503_and_the_server_recovers(start):
    s = start(EmbeddedEngine.from_preset("tiny", seed=0, device="cuda"))
    assert len(s.client.generate([_req([1, 2, 3], 2)])[0].output_ids) == 2
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    # the caching allocator may hold the weights and 1 MiB more: a 64 x 250-token batch needs far more
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction((torch.cuda.memory_allocated() + (1 << 20)) / total)
    try:
        with pytest.raises(EngineHTTPError) as e:
            s.client.generate([_req(range(200), 50) for _ in range(64)])
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
    assert e.value.status == 503 and "out of memory" in e.value.message, e.value
    s.client.calls.clear()
    assert len(s.client.generate([_req([1, 2, 3], 2)])[0].output_ids) == 2
