"""Run one function per rank: in this process for world size 1; otherwise as Ray actors, or as local
processes with the local executor (`V4_EXECUTOR=local`: one machine, no Ray).

For world > 1 under Ray the driver reserves a placement group of one bundle per rank (a GPU and a CPU on cuda,
a CPU on cpu), starts one actor per bundle, orders the actors by (node IP, GPU id) so that
neighbouring ranks share a node, and points every rank at rank 0's node for the rendezvous
(MASTER_ADDR = rank 0's node IP, MASTER_PORT = the port of the store rank 0's actor hosts).

The rendezvous store (torch's TCPStore) is served, before any rank runs, by the local executor's parent (on
loopback) or by rank 0's Ray actor (on every interface, as torch's own); every rank, rank 0 included, joins it as a
client (torch's protocol for an agent's store, TORCHELASTIC_USE_AGENT_STORE). Its port is bound as it is chosen: the
OS's pick of port 0, or the port given (V4_DIST_PORT). A port found free and let go for rank 0 to bind later could be
taken in between, by a concurrent job or by any outgoing connection, which draws its local port from the same
ephemeral range (a CI run lost a NaN-bisect rung to EADDRINUSE so). World size 1 needs no rendezvous at all: its
process group is built on an in-process store (dsv4/megatron/train.py init_distributed).

`fn(rank, world, master_addr, master_port, payload) -> int` must be a module-level function (Ray
pickles it by reference); its return value is the rank's exit code. The job's exit code is 16 when
any rank reports 16 (non-finite loss/gradient), else the largest code; an actor that raises makes it 1.

Every rank's function runs through `run_rank`, which first makes the rank's process the same under every path
(dsv4/procenv.py: the OMP_NUM_THREADS=1 Ray gives an actor removed, the node's cores shared among the GPU ranks on it,
TileLang, inductor and Triton pointed at the cluster's compile cache under V4_COMPILE_CACHE), and tears down the
process group the function left behind when it returns (NCCL otherwise warns at exit, and a driver that ran world 1
in-process would keep a group bound to that job's rendezvous port). An actor reserves one CPU: a reservation is what
Ray schedules by, not what the rank computes with (a one-node cluster of V4_RAY_NUM_CPUS=3 must still place 2 ranks).

Local processes are spawned, one a rank (GPU = rank on cuda), rendezvous on 127.0.0.1. When a rank ends
with an error while others still run, those get RANK_GRACE_S to end on their own (all ranks stop
together on a non-finite step) and are then terminated: a rank left waiting in a collective for one
that died would otherwise hang the job.
"""
from __future__ import annotations

import ipaddress
import os
import socket
import sys
import time
from typing import Callable

EXIT_NONFINITE = 16
RANK_GRACE_S = 30.0


def combine_exit_codes(codes: list[int]) -> int:
    if EXIT_NONFINITE in codes:
        return EXIT_NONFINITE
    return max(codes) if codes else 0


def free_port() -> int:
    """A port free now, for a caller that must name one before anything listens on it (an engine told where to
    join); it may be taken before then: where this process will listen itself, bind first (`host_store`)."""
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def host_store(world: int, port: int = 0, host: str = "127.0.0.1"):
    """A job's rendezvous store served from this process for ranks that reach it at `host` (port 0: the OS picks
    one; `listen_socket` says where it listens). `.port` is where ranks join. A port that is taken (a V4_DIST_PORT
    in use) raises RuntimeError."""
    try:
        sock = listen_socket(host, port, world)
    except OSError as e:
        raise RuntimeError(f"cannot serve the rendezvous store on port {port}: {e.strerror}") from None
    return served_store(sock, world)


def listen_socket(host: str, port: int = 0, world: int = 1):
    """A TCP socket listening now on port (0: the OS's pick, `.getsockname()[1]`) for peers that reach it at `host`:
    on loopback for a loopback `host`, so that nothing another host can reach is opened (a store has no
    authentication), else on every interface (IPv6 ones for an IPv6 `host`), as torch's own server."""
    local = loopback_address(host)
    ip = local if local is not None else "::" if ":" in host else "0.0.0.0"
    sock = socket.socket(socket.AF_INET6 if ":" in ip else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((ip, port))
        sock.listen(min(world, 1024) + 16)
    except OSError:
        sock.close()
        raise
    return sock


def loopback_address(host: str) -> str | None:
    """The loopback IP `host` names (127.0.0.1, ::1, localhost), or None for any other host."""
    try:
        infos = socket.getaddrinfo(host.strip("[]"), None, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        return None
    ips = [i[4][0].split("%")[0] for i in infos]
    if not ips or not all(ipaddress.ip_address(ip).is_loopback for ip in ips):
        return None
    return ips[0]


def served_store(sock, world: int, timeout_s: float = 1800.0):
    """torch's TCPStore server on the socket `listen_socket` bound (it would otherwise bind every interface itself),
    which it owns from here."""
    from datetime import timedelta

    import torch.distributed as dist
    ip, port = sock.getsockname()[:2]
    fd = sock.detach()
    try:
        return dist.TCPStore(ip, port, world, is_master=True, timeout=timedelta(seconds=timeout_s),
                             wait_for_workers=False, master_listen_fd=fd)
    except BaseException:
        os.close(fd)
        raise


def join_hosted_store() -> None:
    """Make this rank's init_process_group join the store the launcher hosts instead of serving one as rank 0."""
    os.environ["TORCHELASTIC_USE_AGENT_STORE"] = "True"


def launch(fn: Callable, world: int, payload, device: str, master_port: int = 0, log=None,
           local: bool = False) -> int:
    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    if world == 1:
        return run_rank(fn, 0, 1, "127.0.0.1", master_port, payload, device, 1)     # no rendezvous: no port
    if local:
        return _launch_local(fn, world, payload, device, master_port, log)
    return _launch_ray(fn, world, payload, device, master_port, log)


def run_rank(fn, rank, world, master_addr, master_port, payload, device: str = "cpu", ranks_here: int = 1) -> int:
    """`fn` for one rank (one of `ranks_here` on its node), then `destroy_process_group()` if it left one initialized.
    Only after a return (any exit code, all ranks stop together on a non-finite step): after an exception a peer may
    be gone, and tearing down a communicator that waits for it can hang; the launchers end such ranks themselves."""
    prepare_rank(rank, device, ranks_here)
    code = fn(rank, world, master_addr, master_port, payload)
    dist = sys.modules.get("torch.distributed")      # not imported: fn made no process group
    if dist is not None and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    return code


def prepare_rank(rank: int, device: str, ranks_here: int) -> None:
    """The rank's CPU threads and compile cache, the same under every executor (dsv4/procenv.py)."""
    from dsv4 import procenv
    procenv.undo_ray_thread_cap()
    procenv.rank_threads(device, ranks_here)
    try:
        procenv.activate_compile_cache(device)
    except procenv.CacheRefused as e:
        if rank == 0:
            print(f"warning: compile cache not used, kernels are compiled afresh: {e}", file=sys.stderr, flush=True)


def _launch_local(fn, world, payload, device, master_port, log) -> int:
    import multiprocessing as mp
    if device == "cuda":
        import torch
        if torch.cuda.device_count() < world:
            log(f"error: {world} ranks need {world} GPUs on this machine; torch sees {torch.cuda.device_count()}")
            return 1
    try:
        store = host_store(world, master_port)
    except RuntimeError as e:
        log(f"error: {e}; set V4_DIST_PORT to a free port, or to 0 to have one picked")
        return 1
    port = store.port
    ctx = mp.get_context("spawn")             # CUDA cannot be used in a forked child
    procs = [ctx.Process(target=_local_rank, args=(fn, rank, world, port, payload, device), name=f"rank{rank}")
             for rank in range(world)]
    for p in procs:
        p.start()
    log(f"{world} ranks as local processes (pids {' '.join(str(p.pid) for p in procs)}); rendezvous 127.0.0.1:{port}")
    failed_at = None
    while any(p.exitcode is None for p in procs):
        bad = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
        if bad and failed_at is None:
            failed_at = time.time()
            log(f"rank {bad[0][0]} ended with exit code {bad[0][1]}; the others get {RANK_GRACE_S:g} s to end")
        if failed_at is not None and time.time() - failed_at > RANK_GRACE_S:
            for r, p in enumerate(procs):
                if p.exitcode is None:
                    log(f"rank {r} still running: terminated")
                    p.terminate()
            for p in procs:
                p.join(10)
                if p.exitcode is None:
                    p.kill()
            break
        time.sleep(0.2)
    for p in procs:
        p.join()
    del store                                 # the ranks are gone: stop serving their rendezvous
    # a rank killed by a signal has a negative exit code: count it as a failure
    return combine_exit_codes([c if c >= 0 else 1 for c in (p.exitcode for p in procs)])


def _local_rank(fn, rank, world, port, payload, device="cpu") -> None:
    os.environ["LOCAL_RANK"] = str(rank)      # init_distributed's GPU for this rank
    join_hosted_store()
    sys.exit(run_rank(fn, rank, world, "127.0.0.1", port, payload, device, world))


def _launch_ray(fn, world, payload, device, master_port, log) -> int:
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    if not ray.is_initialized():
        # inside a Ray job RAY_ADDRESS points at the cluster; run alone, this starts a local one
        ray.init(address=os.environ.get("RAY_ADDRESS") or None, log_to_driver=True)
    gpu = device == "cuda"
    bundle = {"CPU": 1, "GPU": 1} if gpu else {"CPU": 1}
    total = ray.cluster_resources()
    # a pipeline step's driver is a Ray job that holds its own entrypoint CPU(s) while the ranks wait for theirs
    held = {"CPU": float(os.environ.get("V4_JOB_DRIVER_CPUS") or 0)}
    short = {k: (v * world, total.get(k, 0), held.get(k, 0)) for k, v in bundle.items()
             if total.get(k, 0) - held.get(k, 0) < v * world}
    if short:
        # more than the whole cluster has: no amount of waiting places it
        log(f"error: {world} ranks of {bundle} can never be placed: they need "
            + ", ".join(f"{n:g} {k}" for k, (n, _, _) in short.items()) + ", the whole Ray cluster has "
            + ", ".join(f"{have:g} {k}" + (f" ({h:g} held by this job's driver)" if h else "")
                        for k, (_, have, h) in short.items())
            + "; run fewer ranks, or give Ray more (more nodes, or V4_RAY_NUM_CPUS on a CPU cluster)")
        return 1
    pg = placement_group([dict(bundle) for _ in range(world)], strategy="PACK")
    t0 = time.time()
    if not _wait_ready(pg, timeout=600, log=log, what=f"{world} x {bundle}"):
        remove_placement_group(pg)
        log(f"error: Ray could not place {world} ranks of {bundle} within 600 s; cluster resources: "
            f"{ray.cluster_resources()}")
        return 1
    log(f"placement group of {world} x {bundle} ready in {time.time() - t0:.1f} s")
    actor_cls = ray.remote(num_cpus=1, num_gpus=1 if gpu else 0)(RankActor)
    actors = [actor_cls.options(scheduling_strategy=PlacementGroupSchedulingStrategy(
        placement_group=pg, placement_group_bundle_index=i)).remote() for i in range(world)]
    try:
        where = ray.get([a.where.remote() for a in actors])
        order = sorted(range(world), key=lambda i: (_ip_key(where[i][0]), where[i][1]))
        actors = [actors[i] for i in order]
        master_addr = where[order[0]][0]
        try:
            port = ray.get(actors[0].host_store.remote(world, master_port, master_addr))
        except Exception as e:                     # a RayTaskError wrapping the actor's RuntimeError
            log(f"error: rank 0's actor {getattr(e, 'cause', None) or e}; set V4_DIST_PORT to a free port, or to 0 "
                "to have one picked")
            return 1
        log(f"{world} ranks on {sorted({w[0] for w in where})}; rendezvous {master_addr}:{port}")
        ips = [where[i][0] for i in order]          # a rank's neighbours on its node share its cores
        refs = [a.run.remote(fn, rank, world, master_addr, port, payload, device, ips.count(ips[rank]))
                for rank, a in enumerate(actors)]
        codes = _gather(refs, log)
    finally:
        for a in actors:
            ray.kill(a)
        remove_placement_group(pg)
    return combine_exit_codes(codes)


def _wait_ready(pg, timeout: float, log=None, what: str = "", every: float = 30.0) -> bool:
    """Wait for the placement group, saying every `every` s what is free meanwhile (other jobs hold the rest)."""
    import ray
    ref, deadline = pg.ready(), time.time() + timeout
    while True:
        ready, _ = ray.wait([ref], timeout=max(0.0, min(every, deadline - time.time())))
        if ready:
            return True
        if time.time() >= deadline:
            return False
        if log:
            free = ray.available_resources()
            log(f"waiting for Ray to place {what}: free now {free.get('CPU', 0):g} CPU, {free.get('GPU', 0):g} GPU "
                f"({deadline - time.time():.0f} s left)")


def _gather(refs, log) -> list[int]:
    """Every rank's exit code; a rank that raised counts as 1 (and its traceback is logged)."""
    import ray
    codes = []
    for rank, ref in enumerate(refs):
        try:
            codes.append(int(ray.get(ref)))
        except Exception as e:                     # RayTaskError / RayActorError: show it and go on
            log(f"rank {rank} failed: {e}")
            codes.append(1)
    return codes


def _ip_key(ip: str):
    try:
        return tuple(int(x) for x in ip.split("."))
    except ValueError:
        return (ip,)


class RankActor:
    """One training process. Ray sets CUDA_VISIBLE_DEVICES to the bundle's GPU, so the rank uses cuda:0."""

    def where(self) -> tuple[str, int]:
        import ray
        gpus = ray.get_gpu_ids()
        return ray.util.get_node_ip_address(), int(gpus[0]) if gpus else 0

    def host_store(self, world: int, port: int, host: str) -> int:
        """Serve the job's rendezvous store from this actor (rank 0's) for as long as it lives: its port."""
        self._store = host_store(world, port, host)
        return self._store.port

    def run(self, fn, rank, world, master_addr, master_port, payload, device="cpu", ranks_here=1) -> int:
        os.environ["LOCAL_RANK"] = "0"
        join_hosted_store()
        return run_rank(fn, rank, world, master_addr, master_port, payload, device, ranks_here)
