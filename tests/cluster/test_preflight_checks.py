"""The checks themselves, judged on node facts: real ones gathered on an H200 host
(tests/cluster/data/facts_h200.json, from node_scripts/node_facts.py) and variations of them."""
from __future__ import annotations

import copy
import json
from pathlib import Path

from launcher.config import Selection, resolve
from launcher.preflight import CHECKS
from launcher.preflight.registry import Context, RequiredInput

H200 = json.loads((Path(__file__).parent / "data" / "facts_h200.json").read_text())
A, B, C = "10.0.0.1", "10.0.0.2", "10.0.0.3"


def cfg_for(hw="h200", **sets):
    return resolve(Selection(cluster="h200_template", hw=hw, sets=tuple(f"{k}={v}" for k, v in sets.items())))


def facts(**changes):
    f = copy.deepcopy(H200)
    f["net"]["ifaces"]["eth0"]["ipv4"] = A
    f["token"] = "tok"
    for path, value in changes.items():
        d = f
        *keys, last = path.split("__")
        for k in keys:
            d = d[k]
        d[last] = value
    return f


def judge(name, cfg, per_node: dict, inputs=(), clock=None, **ctx_fields):
    ctx = Context(cfg=cfg, order=list(per_node), facts=per_node, token="tok", inputs=list(inputs), **ctx_fields)
    ctx.clock = clock or {n: (0.0, 0.01) for n in per_node}
    return {n: CHECKS[name].judge(n, ctx) for n in per_node}


def one(name, cfg, f, **kw):
    return judge(name, cfg, {A: f}, **kw)[A]


def test_real_h200_facts():
    cfg = cfg_for(V4_NUM_GPUS_PER_NODE=1, V4_EXPECT_IB=0)
    r = one("gpu", cfg, facts())
    assert (r.status, r.detail) == ("PASS", "1 x NVIDIA H200 (140 GiB)")
    assert one("driver", cfg, facts()).status == "PASS"
    assert one("gpu_memory", cfg, facts()).status == "PASS"
    assert one("nvlink", cfg, facts()).status == "SKIP"
    assert one("ulimit", cfg, facts()).status == "PASS"
    pk = one("packages", cfg, facts())          # that host really lacks them
    assert pk.status == "FAIL" and "ray, megatron-core, tilelang" in pk.detail


def test_gpu_count_and_model():
    assert one("gpu", cfg_for(), facts()).status == "FAIL"                 # 8 expected, 1 present
    r = one("gpu", cfg_for(hw="h20", V4_NUM_GPUS_PER_NODE=1), facts())     # "H20" is not an H200
    assert r.status == "FAIL" and "HW_GPU_NAME='H20'" in r.detail
    h20 = facts(gpu__gpus=[dict(H200["gpu"]["gpus"][0], name="NVIDIA H20", memory_total_mib=97871.0)])
    assert one("gpu", cfg_for(hw="h20", V4_NUM_GPUS_PER_NODE=1), h20).status == "PASS"
    assert one("gpu", cfg_for(hw="cpu"), facts()).status == "SKIP"


def test_foreign_gpu_memory():
    cfg = cfg_for(V4_NUM_GPUS_PER_NODE=1)
    uuid = H200["gpu"]["gpus"][0]["uuid"]
    busy = [dict(H200["gpu"]["gpus"][0], memory_used_mib=30720.0)]
    r = one("gpu_memory", cfg, facts(gpu__gpus=busy, gpu__apps=[
        {"pid": 4242, "used_mib": 30000.0, "gpu_uuid": uuid, "v4_session": None}]))
    assert r.status == "FAIL" and "4242" in r.detail
    ours = facts(gpu__gpus=busy, our_session="s1",
                 gpu__apps=[{"pid": 7, "used_mib": 30000.0, "gpu_uuid": uuid, "v4_session": "s1"}])
    assert one("gpu_memory", cfg, ours).status == "PASS"
    r = one("gpu_memory", cfg, facts(gpu__gpus=busy))                          # held, holder not visible
    assert r.status == "FAIL" and "not visible here" in r.detail


def test_driver_vs_torch_cuda():
    cfg = cfg_for(V4_NUM_GPUS_PER_NODE=1)
    assert one("driver", cfg, facts(packages__torch="2.11.0+cu130", gpu__cuda="12.8")).status == "FAIL"
    assert one("driver", cfg, facts(packages__torch="2.11.0+cu132", gpu__cuda="13.0")).status == "WARN"
    assert one("driver", cfg, facts(packages__torch="2.11.0+cu130", gpu__cuda="13.0")).status == "PASS"
    r = judge("driver", cfg, {A: facts(), B: facts(), C: facts(gpu__driver="570.1")})
    assert [r[n].status for n in (A, B, C)] == ["PASS", "PASS", "WARN"]


def test_nvlink_and_nvls():
    eight = [dict(H200["gpu"]["gpus"][0], index=i) for i in range(8)]
    on, off = cfg_for(HW_NCCL_NVLS_ENABLE=1), cfg_for(HW_NCCL_NVLS_ENABLE=0)
    assert one("nvlink", on, facts(gpu__gpus=eight)).status == "FAIL"
    assert one("nvlink", off, facts(gpu__gpus=eight)).status == "WARN"
    assert one("nvlink", on, facts(gpu__gpus=eight, gpu__nvlink_active=144)).status == "PASS"


def test_nccl_allreduce_bandwidth():
    two = cfg_for(V4_NUM_GPUS_PER_NODE=2)
    measured = {"gpus": 2, "bytes": 256 << 20, "seconds": 0.0016, "busbw_gbps": 168.0, "error": ""}
    assert one("nccl", cfg_for(V4_NUM_GPUS_PER_NODE=1), facts()).status == "SKIP"
    assert one("nccl", cfg_for(hw="cpu", V4_NUM_GPUS_PER_NODE=2), facts()).status == "SKIP"
    r = one("nccl", two, facts(nccl=measured))
    assert (r.status, r.detail) == ("PASS", "2 GPUs, 256 MiB bf16: bus bandwidth 168 GB/s")
    slow = one("nccl", two, facts(nccl=dict(measured, busbw_gbps=21.0)))     # H200 floor: 100 GB/s
    assert slow.status == "WARN" and "HW_NCCL_MIN_BUSBW_GBPS=100" in slow.detail and "topo" in slow.fix
    bad = one("nccl", two, facts(nccl=dict(measured, busbw_gbps=None,
                                           error="RuntimeError: rank 1: 3 of 9 sums are not 2")))
    assert bad.status == "FAIL" and "sums are not 2" in bad.detail
    assert one("nccl", two, facts(nccl=dict(measured, busbw_gbps=float("nan")))).status == "FAIL"   # not a PASS


def test_ib_and_memlock():
    cfg = cfg_for(V4_EXPECT_IB=1)
    assert one("ib", cfg, facts()).status == "FAIL"
    up = [{"device": "mlx5_0", "ports": {"1": {"state": "4: ACTIVE", "link_layer": "InfiniBand"}}}]
    assert one("ib", cfg, facts(ib=up)).detail == "active: mlx5_0/1"
    r = one("ulimit", cfg, facts(memlock=8 * 1024 * 1024))
    assert r.status == "FAIL" and "8192 KiB" in r.detail
    assert one("ulimit", cfg_for(V4_EXPECT_IB=0), facts(memlock=8 * 1024 * 1024)).status == "WARN"


def test_socket_interface():
    cfg = cfg_for()
    multi = facts(net__ifaces={"eth0": {"operstate": "up", "ipv4": "172.17.0.5"},
                               "ib0": {"operstate": "up", "ipv4": A}})
    r = judge("socket_ifname", cfg, {A: multi, B: facts()})[A]
    assert r.status == "WARN" and r.fix == "set V4_SOCKET_IFNAME=ib0"
    r = one("socket_ifname", cfg_for(V4_SOCKET_IFNAME="bond0"), facts())
    assert r.status == "FAIL" and "bond0 does not exist" in r.detail


def test_versions_majority_and_known_bad():
    cfg = cfg_for()
    r = judge("versions", cfg, {A: facts(), B: facts(), C: facts(packages__torch="2.10.0")})
    assert [r[n].status for n in (A, B, C)] == ["PASS", "PASS", "FAIL"]
    assert "torch 2.10.0 (others: 2.11.0)" in r[C].detail
    for v, want in (("0.1.9", "FAIL"), ("0.1.10.post1", "FAIL"), ("0.1.11", "PASS"), ("0.1.8", "PASS")):
        assert one("known_bad", cfg, facts(packages__tilelang=v)).status == want, v


def test_clock_disk_shared_inputs():
    cfg = cfg_for()
    r = judge("clock", cfg, {A: facts(), B: facts(), C: facts()},
              clock={A: (0.0, 0.01), B: (2.5, 0.01), C: (-40.0, 0.01)})
    assert [r[n].status for n in (A, B, C)] == ["PASS", "WARN", "FAIL"]
    full = facts(disk__work=dict(H200["disk"]["work"], free_gb=1.0))
    assert one("disk", cfg, full).status == "FAIL"
    assert one("shared_work", cfg, facts(token=None, token_error="FileNotFoundError")).status == "FAIL"
    need = [RequiredInput("/ckpt", "BF16 checkpoint", sentinel="model.safetensors.index.json")]
    assert one("inputs", cfg, facts(paths={}), inputs=need).status == "FAIL"
    half = {"/ckpt": {"exists": True, "is_dir": True}, "/ckpt/model.safetensors.index.json": {"exists": False}}
    r = one("inputs", cfg, facts(paths=half), inputs=need)
    assert r.status == "FAIL" and "incomplete" in r.detail
    done = {**half, "/ckpt/model.safetensors.index.json": {"exists": True, "is_dir": False}}
    assert one("inputs", cfg, facts(paths=done), inputs=need).status == "PASS"


def test_a_broken_check_fails_loudly():
    r = one("gpu", cfg_for(V4_NUM_GPUS_PER_NODE=1), facts(gpu={"nvidia_smi": True}))
    assert r.status == "FAIL" and "check raised KeyError" in r.detail


def h200_smoke(**sets):
    """The 4-layer smoke as it ran on the one H200 (8 routed experts): 34.5 GB a checkpoint by the estimate, saved
    every 3 steps as the preset did before hw/h200.env's HW_SMOKE_SAVE_INTERVAL kept one checkpoint at a time."""
    sets = dict(V4_NUM_GPUS_PER_NODE=1, V4_EXPECT_IB=0, PRESET_MODEL_OVERRIDES='"n_routed_experts=8"',
                **{"PRESET_SAVE_INTERVAL": 3, **sets})
    return resolve(Selection(preset="smoke", cluster="h200_template", hw="h200",
                             sets=tuple(f"{k}={v}" for k, v in sets.items())))


def test_disk_room_for_checkpoints():
    """What happened on the H200: the 4-layer smoke (2.8 B params, 32 GiB = 34.4 GB a checkpoint) saved at step 3,
    then the disk (68 GB free) filled during the step-6 save. Preflight now says so before training."""
    cfg = h200_smoke()
    assert 33 < cfg["CKPT_GB"] < 36 and cfg["CKPT_PEAK_COUNT"] == 2
    r = one("disk", cfg, facts())
    assert r.status == "FAIL" and "need ~69.0 GB (2 x 34.5 GB at once)" in r.detail and "PRESET_SAVE_INTERVAL=6" in r.fix, r
    r = one("disk", h200_smoke(PRESET_SAVE_INTERVAL=6), facts())
    assert r.status == "PASS" and "1 x 34.5" in r.detail, r


def test_disk_room_counts_a_resumed_runs_checkpoints():
    """`--resume` after the first save: that checkpoint (34.5 GB) is on disk and counts as room, since it
    either stays among the two at once or is deleted to make way. A run whose training is done needs none."""
    cfg = h200_smoke()
    f = facts(disk__work__free_gb=40.0)                         # 68 GB before the first save
    assert one("disk", cfg, f).status == "FAIL"
    r = one("disk", cfg, f, run_ckpt_gb=34.5)
    assert r.status == "PASS" and "34.5 GB of this run's already on disk" in r.detail, r
    assert one("disk", cfg, f, run_ckpt_gb=20.0).status == "FAIL"             # 40 + 20 < 69
    r = one("disk", cfg, facts(disk__work__free_gb=30.0), run_trained=True)
    assert r.status != "FAIL" and "training is done" in r.detail, r


def test_tree_gb_measures_what_a_run_holds(tmp_path):
    from launcher.preflight import _tree_gb
    assert _tree_gb(tmp_path / "missing") == 0
    (tmp_path / "iter_3").mkdir()
    (tmp_path / "iter_3" / "shard").write_bytes(b"x" * 3_000_000)
    (tmp_path / "latest").write_text("3")
    assert _tree_gb(tmp_path) == 3_000_001 / 1e9


def test_strict_verdict_is_the_one_printed():
    """--strict: a WARN fails the command (exit 3), so the table's last line and the JSON's `ok` say so too."""
    from launcher import preflight
    from launcher.preflight.registry import CheckResult
    rs = [CheckResult("ssh", A, "PASS", "ok"), CheckResult("clock", A, "WARN", "+2 s", "sync clocks")]
    assert preflight.render_table(rs).endswith("1 PASS, 1 WARN -- preflight passed")
    assert preflight.to_json(rs)["ok"] is True
    assert preflight.render_table(rs, strict=True).endswith("-- preflight FAILED (strict: a WARN fails)")
    assert preflight.to_json(rs, strict=True)["ok"] is False and preflight.failed(rs, strict=True)
    assert preflight.to_json(rs[:1], strict=True)["ok"] is True


def test_container_mode_facts_from_the_host():
    """Before `v4 cluster up` the container does not exist: facts come from the host, the image's software is judged
    later (SKIP, saying when), what the host shows (GPUs, disks, network) is judged now."""
    cfg = cfg_for(V4_NUM_GPUS_PER_NODE=1, V4_EXPECT_IB=0, V4_CONTAINER="v4c", V4_IMAGE="img:1")
    host = facts(packages__torch=None, memlock=64 * 1024)
    absent = {"state": "absent", "owner": "", "ours": False, "image": "", "error": ""}
    kw = {"containers": {A: absent}, "where": {A: "host"}}
    r = one("container", cfg, host, **kw)
    assert r.status == "PASS" and "`v4 cluster up` creates it from img:1" in r.detail
    for name in ("python", "versions", "packages", "known_bad"):
        r = one(name, cfg, host, **kw)
        assert r.status == "SKIP" and "does not exist yet" in r.detail and "v4 cluster up" in r.detail, (name, r)
    assert one("gpu", cfg, host, **kw).status == "PASS"
    assert one("ulimit", cfg, host, **kw).status == "PASS"          # the container gets --ulimit memlock=-1
    foreign = dict(absent, state="running", owner="other", image="x")
    r = one("container", cfg, host, containers={A: foreign})
    assert r.status == "FAIL" and "docker rm -f v4c" in r.fix
    stale = dict(absent, state="running", owner=cfg["V4_CLUSTER_NAME"], ours=True, image="img:0")
    assert one("container", cfg, host, containers={A: stale}).status == "WARN"
    current = dict(stale, image="img:1")
    assert one("container", cfg, facts(), containers={A: current}, where={A: "container"}).status == "PASS"
    nodocker = dict(absent, state="error", error="docker not found on the host 10.0.0.1: docker: command not found")
    r = one("container", cfg, host, containers={A: nodocker})
    assert r.status == "FAIL" and "install Docker" in r.fix
    assert one("container", cfg_for(V4_CONTAINER=""), facts()).status == "SKIP"     # no container: nothing to judge


def rl_cfg(**sets):
    """rl_smoke on the H200 template cluster (192.0.2.1-16) with SGLang rollout servers on two workers."""
    sets = {"V4_ROLLOUT_ENGINE": "sglang", "V4_ROLLOUT_NODES": '"192.0.2.2 192.0.2.3"', **sets}
    return resolve(Selection(preset="rl_smoke", cluster="h200_template", hw="h200",
                             sets=tuple(f"{k}={v}" for k, v in sets.items())))


def test_sglang_on_rollout_nodes():
    """Preflight `sglang`: the rollout nodes' python has SGLang at V4_SGLANG_VERSION; other nodes and other engines
    are SKIPped (every node gets a row)."""
    cfg = rl_cfg()
    head, r1, r2 = cfg.nodes[:3]
    r = judge("sglang", cfg, {head: facts(sglang=None), r1: facts(sglang=None), r2: facts(sglang="0.5.23")})
    assert (r[head].status, r[head].detail) == ("SKIP", "no rollout server on this node (V4_ROLLOUT_NODES)")
    assert r[r1].status == "FAIL" and r[r1].detail == "sglang is not installed for python3"
    assert r[r1].fix.startswith("pip install sglang==0.5.23 into python3 on 192.0.2.2")
    assert (r[r2].status, r[r2].detail) == ("PASS", "sglang 0.5.23 (pinned 0.5.23)")
    old = judge("sglang", cfg, {r1: facts(sglang="0.5.22")})[r1]
    assert old.status == "FAIL" and "sglang 0.5.22, but V4_SGLANG_VERSION=0.5.23 is pinned" in old.detail
    assert "pip install sglang==0.5.23" in old.fix
    assert judge("sglang", rl_cfg(V4_SGLANG_VERSION="0.5.22"), {r1: facts(sglang="0.5.22")})[r1].status == "PASS"
    # facts read on the host before `v4 cluster up` made the container: judged once it runs
    r = judge("sglang", cfg, {r1: facts(sglang=None)}, where={r1: "host"})[r1]
    assert r.status == "SKIP" and "v4 cluster up" in r.detail
    # not an SGLang run: nothing to judge anywhere
    embedded = resolve(Selection(preset="rl_smoke", cluster="h200_template", hw="h200"))
    assert one("sglang", embedded, facts(sglang=None)).detail == "V4_ROLLOUT_ENGINE=embedded: no SGLang server"
    sft = resolve(Selection(preset="smoke", cluster="h200_template", hw="h200", sets=("V4_ROLLOUT_ENGINE=sglang",)))
    assert one("sglang", sft, facts(sglang=None)).status == "SKIP"


def test_rollout_port_on_rollout_nodes():
    """Preflight `ports` judges V4_ROLLOUT_PORT on a rollout worker (gather asks for it there)."""
    from launcher.preflight.gather import node_ports
    cfg = rl_cfg()
    head, r1, w = cfg.nodes[0], cfg.nodes[1], cfg.nodes[5]
    assert node_ports(cfg, r1, head) == [30000] and node_ports(cfg, w, head) == []
    assert 30000 not in node_ports(cfg, head, head)
    held = {"30000": {"free": False, "error": "Address already in use", "ours": False,
                      "pids": [{"pid": 4242, "comm": "python3", "ours": False}]}}
    r = judge("ports", cfg, {head: facts(), r1: facts(ports=held), w: facts(ports={})})
    assert r[r1].status == "FAIL" and r[r1].detail == "V4_ROLLOUT_PORT=30000 is taken by python3 pid 4242"
    assert r[w].status == "SKIP" and r[head].status == "PASS"
    ours = {"30000": dict(held["30000"], ours=True, pids=[{"pid": 4242, "comm": "python3", "ours": True}])}
    r = judge("ports", cfg, {r1: facts(ports=ours)})[r1]
    assert r.status == "PASS" and "held by what v4 started: V4_ROLLOUT_PORT=30000" in r.detail
