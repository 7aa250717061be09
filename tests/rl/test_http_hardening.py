"""`v4 rl serve` against hostile or broken input: what the server opens, where a weight-update group listens,
and requests that are malformed, deeply nested, slow, short, too large or carry complex weights.

Each test drives a real RolloutHTTPServer (in a thread, on a free loopback port, in front of a real
EmbeddedEngine on the tiny model) with real HTTP requests and real files: a `..` in a checkpoint's weight_map,
symlinks out of the directory, a truncated shard, a client socket that stops sending.
"""
from __future__ import annotations

import ipaddress
import json
import math
import os
import shutil
import socket
import struct
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from dsv4.checkpoint import INDEX, CheckpointError, generate_checkpoint, read_header
from dsv4.config import ModelConfig
from dsv4.megatron.launch import free_port
from dsv4.rl.engine import EmbeddedEngine
from dsv4.rl.http import ENDPOINT_BODIES, HTTPEngine, RolloutHTTPServer, serialize_named_tensors

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Served:
    engine: EmbeddedEngine
    server: RolloutHTTPServer
    thread: threading.Thread

    @property
    def url(self) -> str:
        return self.server.url

    def post(self, path: str, body=None, data: bytes | None = None) -> tuple[int, dict | str]:
        data = json.dumps(body).encode() if data is None else data
        req = urllib.request.Request(self.url + path, data=data, method="POST",
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                status, raw = r.status, r.read()
        except urllib.error.HTTPError as e:
            status, raw = e.code, e.read()
        try:
            return status, json.loads(raw)
        except ValueError:
            return status, raw.decode()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def start():
    running: list[Served] = []

    def _start(**kw) -> Served:
        engine = kw.pop("engine", None) or EmbeddedEngine.from_preset("tiny", seed=0)
        server = RolloutHTTPServer(engine, "127.0.0.1", 0, None, log=lambda line: None, **kw)
        t = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        t.start()
        s = Served(engine, server, t)
        running.append(s)
        return s

    yield _start
    for s in running:
        if s.thread.is_alive():
            s.stop()


def _params(engine) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in engine.model.named_parameters()}


def _unchanged(engine, before) -> bool:
    return all(torch.equal(p, before[n]) for n, p in engine.model.named_parameters())


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    """A generated tiny checkpoint (seed 4: other weights than the served engine's)."""
    out = tmp_path_factory.mktemp("ckpt") / "tiny"
    generate_checkpoint(ModelConfig.preset("tiny", seed=4), out)
    return out


def _copy_dir(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _shard(d: Path) -> Path:
    [shard] = sorted(d.glob("*.safetensors"))
    return shard


# --- update_weights_from_disk opens nothing outside model_path -----------------------------------------------

def test_a_weight_map_pointing_outside_is_refused_and_quotes_no_bytes(start, ckpt, tmp_path):
    s = start()
    before = _params(s.engine)
    secret = tmp_path / "secret"
    secret.write_bytes(b"hunter2!" + b"x" * 100)       # its first 8 bytes as a header length: a huge number
    leaked = str(struct.unpack("<Q", b"hunter2!")[0])
    model = _copy_dir(ckpt, tmp_path / "model")
    rel = os.path.relpath(secret, model)                 # ../secret
    for target in (rel, str(secret), f"{_shard(model).name}/../../secret"):
        (model / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": {"embed.weight": target}}))
        status, body = s.post("/update_weights_from_disk", {"model_path": str(model)})
        assert status == 400 and not body["success"], body
        assert "outside the checkpoint directory" in body["message"] and leaked not in body["message"], body
    assert _unchanged(s.engine, before) and s.engine.weight_version == "default"
    # read directly, a file that is no safetensors file is named as such, its bytes not quoted
    with pytest.raises(CheckpointError) as e:
        read_header(secret)
    assert leaked not in str(e.value) and "not a safetensors file" in str(e.value)


def test_symlinks_out_of_model_path_are_refused_and_inside_ones_read(start, ckpt, tmp_path):
    s = start()
    before = _params(s.engine)
    outside = _copy_dir(ckpt, tmp_path / "elsewhere")    # a valid checkpoint: without the check it would load
    model = tmp_path / "model"
    model.mkdir()
    shutil.copy(ckpt / "config.json", model)
    shutil.copy(ckpt / INDEX, model)
    shard = _shard(outside).name
    (model / shard).symlink_to(outside / shard)          # the shard the index names: a symlink out
    status, body = s.post("/update_weights_from_disk", {"model_path": str(model), "weight_version": "stolen"})
    assert status == 400 and "outside the checkpoint directory" in body["message"], body
    assert _unchanged(s.engine, before) and s.engine.weight_version == "default"
    # the index itself a symlink out
    (model / shard).unlink()
    shutil.copy(outside / shard, model / shard)
    (model / INDEX).unlink()
    (model / INDEX).symlink_to(outside / INDEX)
    status, body = s.post("/update_weights_from_disk", {"model_path": str(model)})
    assert status == 400 and "outside the checkpoint directory" in body["message"], body
    assert _unchanged(s.engine, before)
    # no index: every *.safetensors is read, and a symlink among them must stay inside too
    (model / INDEX).unlink()
    (model / shard).unlink()
    (model / shard).symlink_to(outside / shard)
    status, body = s.post("/update_weights_from_disk", {"model_path": str(model)})
    assert status == 400 and "outside the checkpoint directory" in body["message"], body
    # a symlink that stays inside the directory is fine
    (model / shard).unlink()
    shutil.copy(outside / shard, model / "real.bin")
    (model / shard).symlink_to("real.bin")
    status, body = s.post("/update_weights_from_disk", {"model_path": str(model), "weight_version": "inside"})
    assert status == 200 and body["success"], body
    assert not _unchanged(s.engine, before) and s.engine.weight_version == "inside"


def test_a_corrupt_header_is_an_error_not_a_crash(start, ckpt, tmp_path):
    s = start()
    model = _copy_dir(ckpt, tmp_path / "model")
    shard = _shard(model)
    data = shard.read_bytes()
    n = struct.unpack("<Q", data[:8])[0]
    for header in ({"embed.weight": 1}, {"embed.weight": {"dtype": "BF16", "shape": [2], "data_offsets": [0, 999]}},
                   [[[[[[]]]]]], "x" * 5):
        raw = json.dumps(header).encode()
        shard.write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + n:])
        status, body = s.post("/update_weights_from_disk", {"model_path": str(model)})
        assert status == 400 and not body["success"] and str(shard) in body["message"], (header, body)
    nested = b"[" * 100_000 + b"]" * 100_000
    shard.write_bytes(struct.pack("<Q", len(nested)) + nested)
    status, body = s.post("/update_weights_from_disk", {"model_path": str(model)})
    assert status == 400 and "not valid JSON" in body["message"], body


def test_rl_serve_on_a_truncated_shard_says_so_without_a_traceback(ckpt, tmp_path):
    model = _copy_dir(ckpt, tmp_path / "model")
    shard = _shard(model)
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    r = subprocess.run([sys.executable, "-m", "launcher", "rl", "serve", "--checkpoint", str(model), "--port", "0"],
                       cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr and f"{shard}: truncated" in r.stderr and "fix:" in r.stderr, r.stderr


@pytest.mark.parametrize("config", ["{not json", "[1]", '{"quantization_config": [1]}'])
def test_rl_serve_on_a_broken_config_json_is_a_config_error(ckpt, tmp_path, config):
    from click.testing import CliRunner

    from launcher.commands.rl import rl
    from launcher.errors import ConfigError
    model = _copy_dir(ckpt, tmp_path / "model")
    (model / "config.json").write_text(config)
    r = CliRunner().invoke(rl, ["serve", "--checkpoint", str(model), "--port", "0"])
    assert isinstance(r.exception, ConfigError) and str(model / "config.json") in r.exception.message, r.exception


# --- where a weight-update group listens, and for how long -------------------------------------------------

def _listeners(port: int) -> list[ipaddress._BaseAddress]:
    """The addresses that listen on TCP `port` on this host (/proc/net/tcp, tcp6)."""
    out = []
    for name, v6 in (("/proc/net/tcp", False), ("/proc/net/tcp6", True)):
        try:
            lines = Path(name).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            local, state = line.split()[1], line.split()[3]
            addr, p = local.split(":")
            if state != "0A" or int(p, 16) != port:
                continue
            raw = bytes.fromhex(addr)
            raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))   # each 32-bit word is host-order
            out.append(ipaddress.ip_address(raw))
    return out


def test_a_loopback_server_refuses_a_rendezvous_off_loopback(start):
    s = start()
    other = next((a for a in _host_addresses() if not a.is_loopback), ipaddress.ip_address("192.0.2.1"))
    for address in ("0.0.0.0", "::", str(other)):
        port = free_port()
        status, body = s.post("/init_weights_update_group", {"master_address": address, "master_port": port,
                                                             "rank_offset": 0, "world_size": 1, "backend": "gloo"})
        assert status == 400 and body["error"]["field"] == "master_address", (address, body)
        assert "loopback" in body["error"]["message"]
        assert _listeners(port) == [], f"{address}: something listens on {port}"


def _host_addresses() -> list[ipaddress._BaseAddress]:
    try:
        infos = socket.getaddrinfo(socket.gethostname(), None)
    except OSError:
        return []
    return [ipaddress.ip_address(i[4][0].split("%")[0]) for i in infos]


def test_a_group_the_engine_hosts_on_loopback_listens_on_loopback_only(start):
    s = start()
    port = free_port()
    status, body = s.post("/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": port,
                                                         "rank_offset": 0, "world_size": 1, "group_name": "g",
                                                         "backend": "gloo"})
    assert status == 200 and body["success"], body
    try:
        found = _listeners(port)
        assert found and all(a.is_loopback for a in found), found   # torch's store alone listens on every interface
    finally:
        assert s.post("/destroy_weights_update_group", {"group_name": "g"})[1]["success"]


def test_a_group_waits_no_longer_than_the_servers_bound(start):
    s = start(group_timeout_s=1.0)
    port = free_port()                               # nobody hosts the rendezvous: the join can only time out
    client = HTTPEngine(s.url, timeout=60)           # well short of torch's default wait of 300 s
    ack = client.init_weights_update_group("127.0.0.1", port, 1, 2, group_name="g", backend="gloo")
    assert not ack["success"] and "could not join" in ack["message"], ack
    assert _listeners(port) == []


# --- requests --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("temperature", [1e-40, 1e-7])
def test_a_tiny_temperature_is_greedy_with_finite_logprobs(start, temperature):
    s = start()
    body = {"input_ids": [5, 17, 42], "return_logprob": True,
            "sampling_params": {"max_new_tokens": 4, "ignore_eos": True}}
    status, greedy = s.post("/generate", {**body, "sampling_params": {**body["sampling_params"], "temperature": 0}})
    assert status == 200
    status, tiny = s.post("/generate", {**body, "sampling_params": {**body["sampling_params"],
                                                                    "temperature": temperature}})
    assert status == 200
    lps = [e[0] for e in tiny["meta_info"]["output_token_logprobs"]]
    assert all(isinstance(v, float) and math.isfinite(v) and v <= 0 for v in lps), lps
    assert tiny["output_ids"] == greedy["output_ids"]
    assert lps == [e[0] for e in greedy["meta_info"]["output_token_logprobs"]]


def test_deeply_nested_json_is_a_400_on_every_endpoint(start):
    s = start()
    deep = b"[" * 100_000 + b"]" * 100_000
    for path in ENDPOINT_BODIES:
        for data in (deep, b'{"a": ' + deep + b"}", b'{"names": ' + deep + b"}", b'{"input_ids": ' + deep + b"}"):
            status, body = s.post(path, data=data)
            assert status == 400 and body["error"]["code"] == 400, (path, data[:20], body)
    status, body = s.post("/update_weights_from_disk", data=b'{"model_path": "/x", "manifest": {"a": ' + deep + b"}}")
    assert status == 400 and body["error"]["field"] == "body", body
    assert s.post("/generate", {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1}})[0] == 200


def _partial_request(server: RolloutHTTPServer, sent: bytes, length: int) -> socket.socket:
    c = socket.create_connection(server.server_address[:2], timeout=60)
    c.sendall(b"POST /generate HTTP/1.0\r\nContent-Type: application/json\r\n"
              + f"Content-Length: {length}\r\n\r\n".encode() + sent)
    return c


def _answer(c: socket.socket) -> tuple[int, dict]:
    data = b""
    while chunk := c.recv(65536):
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)


def test_a_client_that_stops_sending_does_not_hold_up_shutdown(start):
    s = start()
    c = _partial_request(s.server, b'{"input_ids": [1,', 1000)   # 17 of 1000 bytes, and the socket stays open
    try:
        deadline = time.monotonic() + 60
        while not s.server._reading and time.monotonic() < deadline:
            time.sleep(0.01)                   # accepted (a connection still in the backlog is reset on close)
        stopper = threading.Thread(target=s.stop)
        stopper.start()
        stopper.join(60)                       # without the fix: until the client gives up (never, here)
        assert not stopper.is_alive(), "shutdown waits for a client that sends nothing"
        status, body = _answer(c)
        assert status == 400 and "ended after 17 of 1000 bytes" in body["error"]["message"], body
    finally:
        c.close()


def test_a_stalled_body_times_out_and_a_short_one_is_named(start):
    s = start(read_timeout_s=0.5)
    c = _partial_request(s.server, b'{"input_ids"', 100)
    try:
        status, body = _answer(c)              # the client never sends more: the server's read timeout answers
    finally:
        c.close()
    assert status == 408 and "12 of 100 bytes" in body["error"]["message"], body
    c = _partial_request(s.server, b'{"input_ids": [1]}', 100)
    c.shutdown(socket.SHUT_WR)                  # the client says it is done, 82 bytes short
    try:
        status, body = _answer(c)
    finally:
        c.close()
    assert status == 400 and body["error"]["field"] == "body" and "18 of 100" in body["error"]["message"], body
    assert s.post("/generate", {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1}})[0] == 200


def test_the_body_limit_is_the_servers_setting(start):
    s = start(max_body_mb=1)
    c = _partial_request(s.server, b"", 2 << 20)   # the headers alone: the server answers before any body
    try:
        status, body = _answer(c)
    finally:
        c.close()
    message = body["error"]["message"]
    assert status == 413 and "limit of 1 MiB" in message and "--max-body-mb" in message, message
    with pytest.raises(ValueError, match="max_body_mb"):
        RolloutHTTPServer(s.engine, "127.0.0.1", 0, max_body_mb=0)


def test_complex_weights_are_refused_not_cast(start, ckpt, tmp_path):
    s = start()
    before = _params(s.engine)
    shape = before["norm.weight"].shape
    z = torch.full(shape, 1 + 2j, dtype=torch.complex64)
    status, body = s.post("/update_weights_from_tensor",
                          {"serialized_named_tensors": [serialize_named_tensors([("norm.weight", z)])]})
    assert status == 400 and not body["success"] and "complex64" in body["message"], body
    # from disk: a shard holding a complex tensor (safetensors' C64)
    model = _copy_dir(ckpt, tmp_path / "model")
    shard = _shard(model)
    tensors = load_file(shard)
    tensors["norm.weight"] = z
    save_file(tensors, shard)
    status, body = s.post("/update_weights_from_disk", {"model_path": str(model)})
    assert status == 400 and "complex64" in body["message"], body
    assert _unchanged(s.engine, before)
