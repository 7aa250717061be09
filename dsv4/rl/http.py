"""The rollout engine over HTTP, in SGLang 0.5.23's wire format: a server (`serve`, `v4 rl serve`) and a client
(`HTTPEngine`) for our server or a real SGLang server.

The server is a stdlib `ThreadingHTTPServer` in front of any `RolloutEngine` (normally `EmbeddedEngine`). The
routes, field names, status codes and bodies are SGLang's (`srt/entrypoints/http_server.py`,
`srt/managers/io_struct.py`); tests/rl/test_http_contract.py checks them against SGLang's own generated schema
and request classes. Where it departs from SGLang, and why:

* Unknown fields (and query parameters) are a 400 naming the field on every endpoint (SGLang ignores them
  outside /generate's sampling_params). A misspelt `weight_version` must not silently leave the version unset.
  Fields SGLang has
  that cannot change anything here are accepted and ignored (`abort_all_requests`: an update already waits for
  running generates; `torch_empty_cache`, `recapture_cuda_graph`, `token_step`); fields asking for something we
  cannot do are a 400 (`selector="draft"`: no draft model; `is_async`, `keep_pause`, `manifest`).
* A bad request answers `{"error": {"message", "field", "code"}}`: SGLang's `{"error": {"message"}}` (its
  /generate schema errors are a bare `{"error": "<text>"}`) plus the field, so a caller can tell which value
  to fix. The client reads all three forms.
* `POST /update_weights_from_tensor`: SGLang's `serialized_named_tensors` holds one base64 string per TP rank of
  `MultiprocessingSerializer` output, i.e. CUDA-IPC handles that only open on the same host. Our server takes a
  list with exactly one entry (TP = 1): base64 of `torch.save(list[(name, tensor)])`, read back with
  `torch.load(weights_only=True)` so a body cannot run code. `serialize_named_tensors` makes it.
* Auth: SGLang's `--api-key` is the same `Authorization: Bearer` header, but optional. Here a server bound to
  anything but loopback refuses to start without a token, and every endpoint except `GET /health` checks it.
* Bodies are decoded straight from their bytes into the endpoint's schema (`ENDPOINT_BODIES`, msgspec Structs in
  `dsv4.rl.api`), at most `max_body_mb`; a body shorter than its Content-Length is a 400, a client silent for
  `read_timeout_s` a 408, and `server_close()` ends the requests still being sent rather than wait for them.
* `/update_weights_from_disk` opens no file that resolves outside `model_path` (`dsv4.checkpoint.inside`).
* `/init_weights_update_group`: a server on loopback refuses a `master_address` off loopback (the group's store
  listens unauthenticated; see `dsv4.rl.sync`), and every group waits at most `group_timeout_s`.
* torch's out-of-memory error during /generate answers 503 and the server keeps serving; so does a generate
  while the weights are released (`api.EngineUnavailable`).
* `/pause_generation` and `/continue_generation` answer SGLang's `{"message", "status": "ok"}` plus `success`;
  `/release_memory_occupation` and `/resume_memory_occupation` answer the engine's ack where SGLang answers
  `null`. `/model_info` adds the engine's keys (num_hidden_layers, num_experts_per_tok, hash_layers, ...);
  `/server_info` reports our engine (`"frontend": "dsv4.rl.http"`), which is how the client tells our server
  from SGLang.
* HTTP/1.0, one request per connection: no idle keep-alive connection holds up a graceful shutdown.
* No streaming, no `text` (no tokenizer), n = 1: see `dsv4.rl.api.parse_generate`.
"""
from __future__ import annotations

import base64
import hmac
import io
import ipaddress
import json
import math
import os
import signal
import socket
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable

from dsv4.rl import api
from dsv4.rl.api import GenerateRequest, GenerateResult, RequestError

FRONTEND = "dsv4.rl.http"          # /server_info "frontend"; SGLang's Python server says "python"
DEFAULT_MAX_BODY_MB = 4096         # one weight bucket (1 GiB in miles) is ~1.33 GiB once base64'd
DEFAULT_READ_TIMEOUT_S = 60.0      # the longest silence while a client sends its request (or takes the answer)
DEFAULT_GROUP_TIMEOUT_S = 60.0     # the longest a weight-update group waits for its members, or for one broadcast


# --- request bodies ------------------------------------------------------------------------------------

# path -> the body's schema, a msgspec Struct named after SGLang's io_struct class for it (the contract test
# checks the names, fields and required fields against SGLang's). The engine call gets the fields that are not
# the struct's `ignored` ones as keyword arguments.
ENDPOINT_BODIES: dict[str, type[api._Body]] = {
    "/generate": api.GenerateReqInput,
    "/init_weights_update_group": api.InitWeightsUpdateGroupReqInput,
    "/destroy_weights_update_group": api.DestroyWeightsUpdateGroupReqInput,
    "/update_weights_from_distributed": api.UpdateWeightsFromDistributedReqInput,
    "/update_weights_from_tensor": api.UpdateWeightsFromTensorReqInput,
    "/update_weights_from_disk": api.UpdateWeightFromDiskReqInput,
    "/begin_weight_update": api.BeginWeightUpdateReqInput,
    "/end_weight_update": api.EndWeightUpdateReqInput,
    "/pause_generation": api.PauseGenerationReqInput,
    "/continue_generation": api.ContinueGenerationReqInput,
    "/get_weights_by_name": api.GetWeightsByNameReqInput,
    "/release_memory_occupation": api.ReleaseMemoryOccupationReqInput,
    "/resume_memory_occupation": api.ResumeMemoryOccupationReqInput,
}


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


# --- update_weights_from_tensor payload ---------------------------------------------------------------

def serialize_named_tensors(named_tensors) -> str:
    """list[(name, tensor)] -> our `serialized_named_tensors` entry: base64 of torch.save of a list of
    (name, CPU tensor) pairs. (SGLang's entries are CUDA-IPC handles; see the module docstring.)"""
    import torch

    pairs = [(str(n), t.detach().to("cpu").contiguous()) for n, t in named_tensors]
    buf = io.BytesIO()
    torch.save(pairs, buf)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def deserialize_named_tensors(entries: list[str]) -> list:
    """The inverse of `serialize_named_tensors` for a one-entry (TP = 1) `serialized_named_tensors` list."""
    import torch

    field = "serialized_named_tensors"
    if len(entries) != 1:
        raise RequestError(field, f"one entry per TP rank: this server has TP=1, got {len(entries)}")
    try:
        raw = base64.b64decode(entries[0], validate=True)
    except ValueError as e:
        raise RequestError(f"{field}[0]", f"not base64: {e}") from None
    try:
        # weights_only: the unpickler admits tensors and plain containers only, never code
        obj = torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - any unreadable payload is the caller's error
        raise RequestError(f"{field}[0]", "not a torch.save'd list of (name, tensor) pairs (base64 of "
                                          f"dsv4.rl.http.serialize_named_tensors; CUDA-IPC handles from SGLang's "
                                          f"MultiprocessingSerializer do not cross hosts): {type(e).__name__}: {e}"
                           ) from None
    if not isinstance(obj, (list, tuple)) or not all(
            isinstance(p, (list, tuple)) and len(p) == 2 and isinstance(p[0], str) and isinstance(p[1], torch.Tensor)
            for p in obj):
        raise RequestError(f"{field}[0]", "expected a list of (name, tensor) pairs")
    return [(n, t) for n, t in obj]


# --- the server ---------------------------------------------------------------------------------------

def is_loopback(host: str) -> bool:
    """True when every address `host` names is a loopback address ('' and 0.0.0.0 are not)."""
    if not host:
        return False
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None)
    except OSError:
        return False
    return bool(infos) and all(ipaddress.ip_address(i[4][0].split("%")[0]).is_loopback for i in infos)


class _Reply(Exception):
    """Raised inside a handler: answer `status` with `body` (JSON unless it is str)."""

    def __init__(self, status: int, body: Any, headers: dict | None = None):
        super().__init__(status)
        self.status, self.body, self.headers = status, body, headers or {}


def _error(status: int, message: str, field: str | None = None) -> _Reply:
    err = {"message": message, "code": status}
    if field is not None:
        err["field"] = field
    return _Reply(status, {"error": err})


def _json_default(o):
    # numpy scalars and arrays from the engine (logprobs, ids)
    if hasattr(o, "tolist"):
        return o.tolist()
    raise TypeError(f"{type(o).__name__} is not JSON serialisable")


def _finite(o):
    # JSON has no NaN/inf: SGLang's orjson writes null for them, so do we
    if isinstance(o, float):
        return o if math.isfinite(o) else None
    if isinstance(o, dict):
        return {k: _finite(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [_finite(v) for v in o]
    return o


def _dumps(body) -> bytes:
    try:
        return json.dumps(body, allow_nan=False, default=_json_default).encode()
    except ValueError:
        return json.dumps(_finite(json.loads(json.dumps(body, default=_json_default))), allow_nan=False).encode()


class RolloutHTTPServer(ThreadingHTTPServer):
    """One engine behind SGLang's routes. `serve_forever()` in any thread; `shutdown()` from another one, then
    `server_close()`, which waits for the requests in flight (not for a client still sending its request)."""

    daemon_threads = False          # server_close() waits for requests in flight (graceful shutdown)
    block_on_close = True
    allow_reuse_address = True

    def __init__(self, engine, host: str = "127.0.0.1", port: int = 30000, token: str | None = None,
                 max_body_mb: int = DEFAULT_MAX_BODY_MB, log: Callable[[str], None] | None = None, *,
                 read_timeout_s: float = DEFAULT_READ_TIMEOUT_S, group_timeout_s: float = DEFAULT_GROUP_TIMEOUT_S):
        if token is not None and not token.strip():
            raise ValueError("the token is empty")
        if not is_loopback(host) and not token:
            raise ValueError(f"refusing to serve on {host!r} without a token: anyone who reaches it could replace the "
                             f"weights. Bind to 127.0.0.1, or give a shared-secret token (v4 rl serve --token-file)")
        for name, v in (("max_body_mb", max_body_mb), ("read_timeout_s", read_timeout_s),
                        ("group_timeout_s", group_timeout_s)):
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
                raise ValueError(f"{name} must be a finite number > 0, got {v!r}")
        self.engine = engine
        self.token = token
        self.loopback = is_loopback(host)
        self.max_body = int(max_body_mb) << 20
        self.read_timeout_s = float(read_timeout_s)
        self.group_timeout_s = float(group_timeout_s)
        self.log = log if log is not None else (lambda line: print(line, file=sys.stderr, flush=True))
        self._reading: set[socket.socket] = set()      # connections still sending their request
        self._reading_lock = threading.Lock()
        self._closing = False
        self.address_family = socket.AF_INET6 if ":" in host else socket.AF_INET
        super().__init__((host, port), _Handler)

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{f'[{host}]' if ':' in host else host}:{port}"

    def _reading_started(self, conn: socket.socket) -> None:
        with self._reading_lock:
            if not self._closing:
                self._reading.add(conn)
                return
        _stop_reading(conn)

    def _reading_done(self, conn: socket.socket) -> None:
        with self._reading_lock:
            self._reading.discard(conn)

    def server_close(self) -> None:
        # A client that sent less than its Content-Length (or nothing yet) would hold its handler thread, and so
        # this join, until the read timeout: end its request instead. Requests already read run to their answer.
        with self._reading_lock:
            self._closing = True
            reading, self._reading = list(self._reading), set()
        for conn in reading:
            _stop_reading(conn)
        super().server_close()


def _stop_reading(conn: socket.socket) -> None:
    try:
        conn.shutdown(socket.SHUT_RD)            # a blocked recv returns EOF; the answer can still be written
    except OSError:
        pass


class _Handler(BaseHTTPRequestHandler):
    server: RolloutHTTPServer
    # HTTP/1.0: one request per connection, so no idle keep-alive thread holds up a graceful shutdown
    protocol_version = "HTTP/1.0"
    server_version = "dsv4-rl-http"

    def setup(self):
        self.timeout = self.server.read_timeout_s       # every recv and send on this connection (StreamRequestHandler)
        super().setup()
        self.server._reading_started(self.connection)

    def finish(self):
        self.server._reading_done(self.connection)
        try:
            super().finish()
        except OSError:
            pass                                         # the client is gone or too slow to take the answer

    def handle_one_request(self):
        try:
            super().handle_one_request()
        except TimeoutError:
            self.close_connection = True                 # the answer could not be sent in time; nothing to do

    def do_GET(self):
        self._dispatch()

    do_POST = do_PUT = do_DELETE = do_PATCH = do_GET

    def log_message(self, format, *args):  # noqa: A002 - BaseHTTPRequestHandler's signature
        pass                               # one line per request is written by _dispatch

    def _dispatch(self):
        t0 = time.monotonic()
        split = urllib.parse.urlsplit(self.path)
        path = split.path.rstrip("/") or "/"
        status = 500
        self._body_read = False
        try:
            try:
                reply = self._route(path, split.query)
            except _Reply as r:
                reply = r
            except Exception as e:  # noqa: BLE001 - a bug in one request must not stop the server
                reply = _error(500, f"internal error: {type(e).__name__}: {e}")
            status = reply.status
            self._drain()
            self.server._reading_done(self.connection)
            self._send(reply)
        except (BrokenPipeError, ConnectionResetError, TimeoutError):
            pass                                   # the client went away (or stopped reading); nothing to answer
        finally:
            ms = (time.monotonic() - t0) * 1000
            self.server.log(f"{self.client_address[0]} {self.command} {path} {status} {ms:.1f} ms")

    def _send(self, reply: _Reply):
        if isinstance(reply.body, str):
            data, ctype = reply.body.encode(), "text/plain; charset=utf-8"
        elif reply.body is _EMPTY:
            data, ctype = b"", None
        else:
            data, ctype = _dumps(reply.body), "application/json"
        self.send_response(reply.status)
        if ctype:
            self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(data)))
        for k, v in reply.headers.items():
            self.send_header(k, v)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    def _drain(self):
        # A reply sent before the body was read (401, 404, ...): closing a socket with unread data makes the kernel
        # reset the connection, and the client may then never see the answer. Small bodies are read and dropped.
        if self._body_read:
            return
        self._body_read = True
        try:
            n = int(self.headers.get("Content-Length") or 0)
        except ValueError:
            return
        if 0 < n <= 16 << 20:
            try:
                self.rfile.read(n)
            except (OSError, ValueError):
                pass

    def _authorised(self) -> bool:
        token = self.server.token
        if not token:
            return True
        scheme, _, got = self.headers.get("Authorization", "").strip().partition(" ")
        # constant time in the token's content (compare_digest); the scheme name is case-insensitive (RFC 9110)
        return scheme.lower() == "bearer" and hmac.compare_digest(got.strip().encode(), token.encode())

    def _read_body(self) -> bytearray:
        """The request body, exactly Content-Length bytes (b"" without one)."""
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            raise _error(411, "chunked bodies are not read: send Content-Length")
        try:
            n = int(self.headers.get("Content-Length") or 0)
            if n < 0:
                raise ValueError
        except ValueError:
            raise _error(400, "Content-Length is not an integer >= 0", "Content-Length") from None
        if n > self.server.max_body:
            self._body_read = True                       # not drained either: the answer goes out at once
            raise _error(413, f"body of {n >> 20} MiB is over the limit of {self.server.max_body >> 20} MiB; "
                              f"send weights in smaller buckets (or start the server with a larger --max-body-mb)")
        self._body_read = True
        buf = bytearray(n)
        view, got = memoryview(buf), 0
        try:
            while got < n:
                k = self.rfile.readinto1(view[got:])      # one recv at a time: a timeout keeps the count
                if not k:
                    break
                got += k
        except TimeoutError:
            raise _error(408, f"the body stalled after {got} of {n} bytes (Content-Length): nothing arrived for "
                              f"{self.server.read_timeout_s:g} s") from None
        finally:
            view.release()
        if got < n:
            raise _error(400, f"the body ended after {got} of {n} bytes (Content-Length)", "body")
        self.server._reading_done(self.connection)
        return buf

    def _decode(self, path: str, raw: bytearray):
        # an empty body is SGLang's "all defaults" (requests' json=None, curl -X POST)
        try:
            return api.decode(raw if raw.strip() else b"{}", ENDPOINT_BODIES[path])
        except RequestError as e:
            raise _error(400, str(e), e.field) from None

    def _route(self, path: str, query: str) -> _Reply:
        entry = ROUTES.get(path)
        if entry is None:
            raise _error(404, f"no such endpoint: {path}")
        methods, handler = entry
        if self.command not in methods:
            raise _Reply(405, {"error": {"message": f"{path} takes {' or '.join(methods)}, not {self.command}",
                                         "code": 405}}, {"Allow": ", ".join(methods)})
        if not (path == "/health" and self.command == "GET") and not self._authorised():
            raise _Reply(401, {"error": {"message": "missing or wrong token: send 'Authorization: Bearer <token>'",
                                         "code": 401}}, {"WWW-Authenticate": "Bearer"})
        params = urllib.parse.parse_qs(query, keep_blank_values=True)
        allowed_query = {"timeout"} if path == "/flush_cache" else set()
        for k in params:
            if k not in allowed_query:
                raise _error(400, f"unknown query parameter for {path}", f"query.{k}")
        raw = self._read_body()           # after the token check: no unauthenticated client makes us read a body
        return handler(self, {k: v[-1] for k, v in params.items()}, raw)

    # --- endpoints ---

    def _generate(self, query, raw) -> _Reply:
        body: api.GenerateReqInput = self._decode("/generate", raw)
        del raw
        reqs: list[GenerateRequest] = []
        try:
            reqs = body.requests()
            results = self.server.engine.generate(reqs)
        except RequestError as e:
            raise _error(400, str(e), e.field) from None
        except api.EngineUnavailable as e:
            raise _error(503, str(e)) from None
        except Exception as e:
            if _is_oom(e):
                _release_cached_memory()
                raise _error(503, f"out of memory generating {len(reqs)} sequence(s) "
                                  f"({sum(len(r.input_ids) + r.sampling_params.max_new_tokens for r in reqs)} "
                                  f"tokens at most): send fewer sequences per request or a smaller max_new_tokens. "
                                  f"The server is still serving. ({str(e).splitlines()[0] if str(e) else ''})"
                             ) from None
            raise
        wire = [r.to_wire() for r in results]
        return _Reply(200, wire if body.batched else wire[0])

    def _control(self, path: str, method: str, raw, extra: Callable[[dict, dict], dict] | None = None):
        body = self._decode(path, raw)
        del raw
        kw = body.engine_kwargs()
        engine = self.server.engine
        try:
            if path == "/update_weights_from_tensor":
                body.serialized_named_tensors = None     # the base64 text: gone before the tensors are made
                kw["named_tensors"] = deserialize_named_tensors(kw.pop("serialized_named_tensors"))
            elif path == "/init_weights_update_group":
                self._check_rendezvous(body)
                if _takes(engine.init_weights_update_group, "timeout_s"):
                    kw["timeout_s"] = self.server.group_timeout_s
            ack = getattr(engine, method)(**kw)
        except RequestError as e:
            raise _error(400, str(e), e.field) from None
        except api.EngineUnavailable as e:
            raise _error(503, str(e)) from None
        finally:
            kw.pop("named_tensors", None)
        # the engine's answer is an ack, or SGLang's {"message", "status"} for pause/continue: every body says success
        ack = dict(ack) if isinstance(ack, dict) else api.ack(True)
        ok = bool(ack.setdefault("success", True))
        if extra is not None:
            ack = extra(ack, kw)
        return _Reply(200 if ok else 400, ack)

    def _check_rendezvous(self, body: api.InitWeightsUpdateGroupReqInput) -> None:
        # The group's rank 0 listens on master_address (the engine is rank 0 when rank_offset is 0) and every
        # rank connects there; torch's store has no authentication. A server that only loopback clients can
        # reach must not open, or dial, a port on another interface for them.
        if self.server.loopback and not is_loopback(body.master_address):
            raise RequestError("master_address", f"{body.master_address!r} is not a loopback address, and this "
                                                 f"server only listens on loopback: rendezvous on 127.0.0.1, or "
                                                 f"serve on a reachable address with a token (v4 rl serve --host "
                                                 f"ADDR --token-file FILE)")

    def _get_weights(self, query, raw) -> _Reply:
        # SGLang answers the parameter's first values as a JSON list (the trainer reads weights back with it)
        body = self._decode("/get_weights_by_name", raw)
        try:
            return _Reply(200, self.server.engine.get_weights_by_name(**body.engine_kwargs()))
        except RequestError as e:
            raise _error(400, str(e), e.field) from None
        except KeyError:
            raise _error(400, f"no parameter named {body.name!r}", "name") from None

    def _flush_cache(self, query, raw) -> _Reply:
        # SGLang: 200 with text, or 400 with the reason; the timeout is a query parameter, the body is empty
        if "timeout" in query:
            try:
                if not float(query["timeout"]) >= 0:
                    raise ValueError
            except ValueError:
                raise _error(400, "expected a number >= 0", "query.timeout") from None
        if raw.strip() not in (b"", b"{}"):
            raise _error(400, "/flush_cache takes no body (the timeout is the query parameter ?timeout=)", "body")
        ack = self.server.engine.flush_cache()
        if ack.get("success", True):
            return _Reply(200, "Cache flushed.\nPlease check backend logs for more details. (When there are running "
                               "or waiting requests, the operation will not be performed.)\n")
        return _Reply(400, (ack.get("message") or "Flush cache failed.") + "\n")

    def _health(self, query, raw) -> _Reply:
        return _Reply(200 if self.server.engine.health() else 503, _EMPTY)

    def _health_generate(self, query, raw) -> _Reply:
        try:
            ok = self.server.engine.health_generate()
        except Exception:  # noqa: BLE001 - any failure to generate is "unhealthy", which is the answer
            ok = False
        return _Reply(200 if ok else 503, _EMPTY)

    def _model_info(self, query, raw) -> _Reply:
        info = dict(self.server.engine.model_info())
        for k in ("model_path", "served_model_name", "tokenizer_path"):
            if info.get(k) is None:
                info[k] = ""        # strings in SGLang's contract (GetModelInfoResponse): null is a violation
        return _Reply(200, info)

    def _server_info(self, query, raw) -> _Reply:
        e, info = self.server.engine, self.server.engine.model_info()
        host, port = self.server.server_address[:2]
        return _Reply(200, {
            "model_path": info.get("model_path", ""), "served_model_name": info.get("model_path", ""),
            "tokenizer_path": "", "max_context_length": int(getattr(e, "max_seq_len", 0) or 0),
            "version": _version(), "frontend": FRONTEND, "host": host, "port": port,
            "max_batch": getattr(e, "max_batch", None), "weight_version": info.get("weight_version"),
            "auth": bool(self.server.token), "internal_states": [],
        })


def _takes(fn, name: str) -> bool:
    import inspect
    try:
        return name in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


_EMPTY = object()      # a reply with no body (the health endpoints, as SGLang)


def _weights(path: str, method: str, extra=None):
    return lambda handler, query, raw: handler._control(path, method, raw, extra)


# SGLang's bodies for these endpoints, plus the ack's `success`
def _paused(ack, kw):
    return {**ack, "message": ack.get("message") or "Generation paused successfully.", "status": "ok"}


def _continued(ack, kw):
    return {**ack, "message": ack.get("message") or "Generation continued successfully.", "status": "ok"}


def _disk(ack, kw):
    return {"num_paused_requests": 0, **ack}

ROUTES: dict[str, tuple[tuple[str, ...], Callable]] = {
    "/generate": (("POST", "PUT"), _Handler._generate),
    "/init_weights_update_group": (("POST",), _weights("/init_weights_update_group",
                                                                "init_weights_update_group")),
    "/destroy_weights_update_group": (("POST",), _weights("/destroy_weights_update_group",
                                                                   "destroy_weights_update_group")),
    "/update_weights_from_distributed": (("POST",), _weights("/update_weights_from_distributed",
                                                                      "update_weights_from_distributed")),
    "/update_weights_from_tensor": (("POST",), _weights("/update_weights_from_tensor",
                                                                 "update_weights_from_tensor")),
    "/update_weights_from_disk": (("POST",), _weights("/update_weights_from_disk", "update_weights_from_disk",
                                                               _disk)),
    "/begin_weight_update": (("POST",), _weights("/begin_weight_update", "begin_weight_update")),
    "/end_weight_update": (("POST",), _weights("/end_weight_update", "end_weight_update")),
    "/pause_generation": (("POST",), _weights("/pause_generation", "pause_generation", _paused)),
    "/continue_generation": (("POST",), _weights("/continue_generation", "continue_generation",
                                                          _continued)),
    "/release_memory_occupation": (("GET", "POST"), _weights("/release_memory_occupation",
                                                                      "release_memory_occupation")),
    "/resume_memory_occupation": (("GET", "POST"), _weights("/resume_memory_occupation",
                                                                     "resume_memory_occupation")),
    "/flush_cache": (("GET", "POST"), _Handler._flush_cache),
    "/get_weights_by_name": (("GET", "POST"), _Handler._get_weights),
    "/health": (("GET",), _Handler._health),
    "/health_generate": (("GET",), _Handler._health_generate),
    "/model_info": (("GET",), _Handler._model_info),
    "/get_model_info": (("GET",), _Handler._model_info),       # deprecated in SGLang, kept as an alias
    "/server_info": (("GET",), _Handler._server_info),
}


def _is_oom(e: BaseException) -> bool:
    torch = sys.modules.get("torch")
    oom = getattr(torch, "OutOfMemoryError", None) if torch is not None else None
    return oom is not None and isinstance(e, oom)


def _release_cached_memory() -> None:
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        torch.cuda.empty_cache()


def _version() -> str:
    try:
        from importlib.metadata import version
        return f"v4-launcher {version('v4-launcher')}"
    except Exception:  # noqa: BLE001 - not installed as a distribution
        return "v4-launcher"


def serve(engine, host: str = "127.0.0.1", port: int = 30000, token: str | None = None, *,
          max_body_mb: int = DEFAULT_MAX_BODY_MB, read_timeout_s: float = DEFAULT_READ_TIMEOUT_S,
          group_timeout_s: float = DEFAULT_GROUP_TIMEOUT_S, on_ready: Callable[[str], None] | None = None) -> None:
    """Serve `engine` until SIGTERM or SIGINT, then finish the requests in flight and return.

    Loopback by default; any other address needs `token` (checked as `Authorization: Bearer <token>` on every
    endpoint except GET /health). Raises ValueError when asked to serve off loopback without one.
    `on_ready(url)` is called once the socket is bound (port 0 picks a free port)."""
    server = RolloutHTTPServer(engine, host, port, token, max_body_mb=max_body_mb, read_timeout_s=read_timeout_s,
                               group_timeout_s=group_timeout_s)
    if threading.current_thread() is not threading.main_thread():
        # signal handlers can only be set in the main thread: serve until the process ends (to stop a server
        # from code, run RolloutHTTPServer.serve_forever yourself and call shutdown())
        try:
            if on_ready is not None:
                on_ready(server.url)
            server.serve_forever(poll_interval=0.2)
        finally:
            server.server_close()
        return
    stopping = threading.Event()

    def stop(signum, frame):
        if stopping.is_set():
            # a second signal: stop waiting for requests in flight (their threads would hold up a normal exit)
            server.log(f"{signal.Signals(signum).name} again: exiting without waiting")
            os._exit(128 + signum)
        server.log(f"{signal.Signals(signum).name}: finishing requests in flight, then stopping")
        stopping.set()

    # The loop runs in a (non-daemon) thread and the main thread only waits for a signal, then stops it: no
    # daemon thread is left to be cut off at interpreter exit (torch's teardown aborts the process when one is).
    loop = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.2}, name="rl-http-serve")
    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        loop.start()
        if on_ready is not None:
            on_ready(server.url)
        while not stopping.wait(0.5) and loop.is_alive():
            pass
    finally:
        if loop.is_alive():
            server.shutdown()          # returns once serve_forever has
            loop.join()
        server.server_close()          # joins the handler threads: requests in flight finish
        for sig, h in previous.items():
            signal.signal(sig, h)
    server.log("stopped")


# --- the client ---------------------------------------------------------------------------------------

class EngineHTTPError(RuntimeError):
    """The server answered an error (or could not be reached: status None); carries its message."""

    def __init__(self, url: str, status: int | None, message: str, field: str | None = None):
        where = f"{url}: HTTP {status}" if status is not None else url
        super().__init__(f"{where}: {message}" + (f" (field: {field})" if field else ""))
        self.url, self.status, self.message, self.field = url, status, message, field


class RemoteRequestError(RequestError):
    """The server rejected a request and named the field (the same exception type EmbeddedEngine raises)."""

    def __init__(self, url: str, status: int, field_name: str, message: str):
        message = message.removeprefix(f"{field_name}: ")      # our server's message already names the field
        super().__init__(field_name, f"{message} [{url}: HTTP {status}]")
        self.url, self.status, self.message = url, status, message


def _error_message(body: bytes) -> tuple[str, str | None]:
    """(message, field) from any error body SGLang or we send."""
    text = body.decode("utf-8", "replace").strip()
    try:
        d = json.loads(text)
    except ValueError:
        return text or "(empty body)", None
    if isinstance(d, dict):
        err = d.get("error", d)
        if isinstance(err, str):                # SGLang's /generate contract errors: {"error": "<text>"}
            return err, None
        if isinstance(err, dict):
            msg = err.get("message") or err.get("detail") or json.dumps(err)
            return str(msg), err.get("field")
        if "detail" in d:
            return str(d["detail"]), None
    return text, None


class HTTPEngine:
    """`RolloutEngine` over HTTP: our `v4 rl serve` or a real SGLang server (same payloads).

    Weight and control calls return `api.ack(...)` like the in-process engine: a 400 carrying SGLang's
    `{"success": false, "message"}` comes back as that ack; every other error status raises `EngineHTTPError`
    (or `RemoteRequestError`, an `api.RequestError`, when the server names the bad field).

    `routed_experts_shape=(num_hidden_layers, num_experts_per_tok)` reshapes routed_experts; by default it is
    read from /model_info, which our server fills and SGLang's does not (pass it for SGLang)."""

    def __init__(self, base_url: str, token: str | None = None, timeout: float = 600.0,
                 routed_experts_shape: tuple[int, int] | None = None):
        self.base_url = base_url.rstrip("/")
        self.token = token
        self.timeout = timeout
        self._shape = tuple(routed_experts_shape) if routed_experts_shape else None
        self._ours: bool | None = None

    def __repr__(self):
        return f"HTTPEngine({self.base_url!r})"

    # --- transport ---

    def _call(self, method: str, path: str, payload: Any = None, *, query: dict | None = None,
              timeout: float | None = None, ok_statuses=(200,)) -> tuple[int, bytes]:
        url = self.base_url + path + (("?" + urllib.parse.urlencode(query)) if query else "")
        data = None if payload is None else json.dumps(payload, allow_nan=False).encode()
        req = urllib.request.Request(url, data=data, method=method)
        if data is not None:
            req.add_header("Content-Type", "application/json")
        if self.token:
            req.add_header("Authorization", f"Bearer {self.token}")
        try:
            with urllib.request.urlopen(req, timeout=self.timeout if timeout is None else timeout) as r:
                return r.status, r.read()
        except urllib.error.HTTPError as e:
            body = e.read()
            if e.code in ok_statuses:
                return e.code, body
            msg, field = _error_message(body)
            if e.code == 400 and field:
                raise RemoteRequestError(url, e.code, field, msg) from None
            raise EngineHTTPError(url, e.code, msg, field) from None
        except (urllib.error.URLError, OSError) as e:
            reason = getattr(e, "reason", e)
            raise EngineHTTPError(url, None, f"cannot reach the engine: {reason}") from None

    def _json(self, method, path, payload=None, **kw):
        status, body = self._call(method, path, payload, **kw)
        return status, (json.loads(body) if body.strip() else None)

    def _ack_call(self, path: str, payload: dict, method: str = "POST") -> dict:
        # a 400 whose body is SGLang's {"success": false, "message"} is an answer, not a transport error
        status, body = self._call(method, path, payload, ok_statuses=(200, 400))
        try:
            d = json.loads(body) if body.strip() else None
        except ValueError:
            d = None
        if status == 400 and not (isinstance(d, dict) and "success" in d):
            msg, field = _error_message(body)
            if field:
                raise RemoteRequestError(self.base_url + path, status, field, msg)
            raise EngineHTTPError(self.base_url + path, status, msg)
        if isinstance(d, dict) and "success" in d:
            return {**d, **api.ack(d["success"], str(d.get("message", "")))}
        # SGLang's pause/continue answer {"message", "status"}; release/resume answer null
        return api.ack(status == 200, str(d.get("message", "")) if isinstance(d, dict) else "")

    def is_ours(self) -> bool:
        """True for our server (`v4 rl serve`), False for SGLang."""
        if self._ours is None:
            try:
                _, info = self._json("GET", "/server_info")
                self._ours = isinstance(info, dict) and info.get("frontend") == FRONTEND
            except EngineHTTPError as e:
                if e.status is None:
                    raise
                self._ours = False
        return self._ours

    # --- generation ---

    def _shape_tail(self) -> tuple[int, int]:
        if self._shape is None:
            info = self.model_info()
            layers, topk = info.get("num_hidden_layers"), info.get("num_experts_per_tok")
            if not (_is_int(layers) and _is_int(topk)):
                raise EngineHTTPError(self.base_url + "/model_info", 200,
                                      "/model_info does not report num_hidden_layers and num_experts_per_tok (SGLang "
                                      "does not): pass HTTPEngine(..., routed_experts_shape=(layers, topk))")
            self._shape = (layers, topk)
        return self._shape

    def generate(self, reqs: list[GenerateRequest]) -> list[GenerateResult]:
        """One /generate per run of requests sharing return_logprob/return_routed_experts/routed_experts_start_len
        (SGLang takes those once per batch); results in request order."""
        reqs = list(reqs)
        if not reqs:
            return []
        if any(r.sampling_params.allowed_token_ids is not None for r in reqs) and not self.is_ours():
            raise RequestError("sampling_params.allowed_token_ids",
                               f"{self.base_url} is SGLang, which has no allowed_token_ids: use a task without a "
                               f"sampling restriction (or our server, v4 rl serve)")
        out: list[GenerateResult] = []
        i = 0
        while i < len(reqs):
            key = _batch_key(reqs[i])
            j = i + 1
            while j < len(reqs) and _batch_key(reqs[j]) == key:
                j += 1
            out.extend(self._generate_batch(reqs[i:j]))
            i = j
        return out

    def _generate_batch(self, reqs: list[GenerateRequest]) -> list[GenerateResult]:
        tail = self._shape_tail() if reqs[0].return_routed_experts else None     # before generating, not after
        payload = generate_payload(reqs)
        _, body = self._json("POST", "/generate", payload)
        items = body if isinstance(body, list) else [body]
        if len(items) != len(reqs):
            raise EngineHTTPError(self.base_url + "/generate", 200, f"{len(items)} results for {len(reqs)} requests")
        # An aborted request (pause_generation(mode="abort"), or one SGLang cannot serve) comes back as a result
        # with finish_reason {"type": "abort", "message"}, as from the in-process engine: the caller decides.
        return [GenerateResult.from_wire(d, shape_tail=tail) for d in items]

    # --- weights ---

    def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                                  group_name: str = "weight_update_group", backend: str = "nccl") -> dict:
        return self._ack_call("/init_weights_update_group", {
            "master_address": master_address, "master_port": master_port, "rank_offset": rank_offset,
            "world_size": world_size, "group_name": group_name, "backend": backend})

    def destroy_weights_update_group(self, group_name: str = "weight_update_group") -> dict:
        return self._ack_call("/destroy_weights_update_group", {"group_name": group_name})

    def update_weights_from_distributed(self, names: list[str], dtypes: list[str], shapes: list[list[int]],
                                        group_name: str = "weight_update_group", flush_cache: bool = True,
                                        weight_version: str | None = None, load_format: str | None = None) -> dict:
        return self._ack_call("/update_weights_from_distributed", _drop_none({
            "names": list(names), "dtypes": [str(d).removeprefix("torch.") for d in dtypes],
            "shapes": [list(map(int, s)) for s in shapes], "group_name": group_name, "flush_cache": flush_cache,
            "weight_version": weight_version, "load_format": load_format}))

    def update_weights_from_tensor(self, named_tensors, load_format: str | None = None, flush_cache: bool = True,
                                   weight_version: str | None = None) -> dict:
        if not self.is_ours():
            raise EngineHTTPError(self.base_url + "/update_weights_from_tensor", None,
                                  "SGLang's update_weights_from_tensor takes CUDA-IPC handles, which only open on the "
                                  "server's own host: use update_weights_from_distributed (a broadcast group) or "
                                  "update_weights_from_disk")
        return self._ack_call("/update_weights_from_tensor", _drop_none({
            "serialized_named_tensors": [serialize_named_tensors(named_tensors)], "load_format": load_format,
            "flush_cache": flush_cache, "weight_version": weight_version}))

    def update_weights_from_disk(self, model_path: str, load_format: str | None = None,
                                 weight_version: str | None = None, flush_cache: bool = True) -> dict:
        return self._ack_call("/update_weights_from_disk", _drop_none({
            "model_path": str(model_path), "load_format": load_format, "weight_version": weight_version,
            "flush_cache": flush_cache}))

    def begin_weight_update(self) -> dict:
        return self._ack_call("/begin_weight_update", {})

    def end_weight_update(self) -> dict:
        return self._ack_call("/end_weight_update", {})

    # --- control ---

    def pause_generation(self, mode: str = "retract") -> dict:
        return self._ack_call("/pause_generation", {"mode": mode})

    def continue_generation(self) -> dict:
        return self._ack_call("/continue_generation", {})

    def flush_cache(self) -> dict:
        status, body = self._call("POST", "/flush_cache", None, ok_statuses=(200, 400))
        return api.ack(status == 200, body.decode("utf-8", "replace").strip())

    def get_weights_by_name(self, name: str, truncate_size: int = 100) -> list:
        """The first `truncate_size` values of a parameter, flattened (SGLang's /get_weights_by_name)."""
        return self._json("POST", "/get_weights_by_name", {"name": name, "truncate_size": truncate_size})[1]

    def release_memory_occupation(self, tags: list[str] | None = None) -> dict:
        return self._ack_call("/release_memory_occupation", {} if tags is None else {"tags": list(tags)})

    def resume_memory_occupation(self, tags: list[str] | None = None) -> dict:
        return self._ack_call("/resume_memory_occupation", {} if tags is None else {"tags": list(tags)})

    # --- health and info ---

    def _probe(self, path: str, timeout: float | None = None) -> bool:
        try:
            self._call("GET", path, timeout=timeout)
            return True
        except EngineHTTPError as e:
            if e.status == 401:
                raise                       # a wrong token is not "unhealthy": say so
            return False

    def health(self) -> bool:
        return self._probe("/health")

    def health_generate(self) -> bool:
        return self._probe("/health_generate")

    def wait_healthy(self, deadline: float = 300.0, interval: float = 0.5) -> None:
        """Poll /health_generate (which generates a token) until it answers 200; `deadline` is seconds from now.
        Raises TimeoutError naming the last answer."""
        end = time.monotonic() + deadline
        last = "no answer yet"
        while True:
            try:
                self._call("GET", "/health_generate", timeout=max(1.0, min(self.timeout, end - time.monotonic())))
                return
            except EngineHTTPError as e:
                if e.status == 401:
                    raise
                last = str(e)
            if time.monotonic() + interval > end:
                raise TimeoutError(f"{self.base_url} not healthy after {deadline:.0f} s: {last}")
            time.sleep(interval)

    def model_info(self) -> dict:
        return self._json("GET", "/model_info")[1]

    def server_info(self) -> dict:
        return self._json("GET", "/server_info")[1]


def _batch_key(r: GenerateRequest):
    return (r.return_logprob, r.return_routed_experts, r.routed_experts_start_len if r.return_routed_experts else 0)


def _drop_none(d: dict) -> dict:
    # SGLang's defaults for optional fields are None: leaving them out says the same and keeps bodies minimal
    return {k: v for k, v in d.items() if v is not None}


def generate_payload(reqs: list[GenerateRequest]) -> dict:
    """SGLang's /generate body for requests sharing the per-batch flags: the single form for one request, the
    batched form (lists of input_ids, sampling_params and rid) for several."""
    if len(reqs) == 1:
        return reqs[0].to_wire()
    if len({_batch_key(r) for r in reqs}) != 1:
        raise ValueError("one /generate batch needs the same return_logprob/return_routed_experts/"
                         "routed_experts_start_len for every request")
    first = reqs[0].to_wire()
    payload = {"input_ids": [list(r.input_ids) for r in reqs],
               "sampling_params": [r.sampling_params.to_dict() for r in reqs]}
    payload.update({k: v for k, v in first.items() if k not in ("input_ids", "sampling_params", "rid")})
    if any(r.rid is not None for r in reqs):
        # SGLang's batched rid is a list of strings: give the unnamed ones a fresh name
        payload["rid"] = [r.rid if r.rid is not None else uuid.uuid4().hex for r in reqs]
    return payload
