"""All-reduce over NCCL: is the sum right, and at what bus bandwidth -- across this node's GPUs (preflight `nccl`),
or across the GPUs of two nodes, the same script started on both (`nccl_pairs`, launcher/preflight/probes.py).

Unlike the other node scripts this one imports torch (the cluster's Python runs the jobs, so it has it).
One forked process a GPU (the parent never touches CUDA, so forking is safe); each all-reduces a bf16
buffer of ones once (the sum must be the world size), warms up, then times `iters` all-reduces.
Bus bandwidth as nccl-tests defines it for all-reduce: 2 (n - 1) / n x bytes / time, n the world size.
argv[1]: JSON {"gpus", "bytes", "iters", "timeout", "backend" (nccl | gloo: CPU, for tests), and for a pair of nodes
"nodes": 2, "node_rank" (0 on the node that hosts the rendezvous), "master_addr", "master_port"}.
Prints one JSON line: {"gpus", "world", "node_rank", "bytes", "seconds", "busbw_gbps", "error"}; `seconds` is the
slowest of this node's ranks (a pair's figure takes the slower node's).
"""
import json
import os
import socket
import sys
import time


def rank_main(rank, n, local, addr, port, nbytes, iters, backend, q):
    try:
        import torch
        import torch.distributed as dist
        os.environ.update(MASTER_ADDR=addr, MASTER_PORT=str(port))
        dev = torch.device("cuda", local) if backend == "nccl" else torch.device("cpu")
        if backend == "nccl":
            torch.cuda.set_device(dev)
        dist.init_process_group(backend, rank=rank, world_size=n)
        x = torch.ones(nbytes // 2, dtype=torch.bfloat16, device=dev)
        dist.all_reduce(x)
        wrong = int((x != n).sum())
        if wrong:
            raise RuntimeError(f"rank {rank}: {wrong} of {x.numel()} sums are not {n}")
        for _ in range(2):
            dist.all_reduce(x)
        sync = torch.cuda.synchronize if backend == "nccl" else (lambda: None)
        sync()
        t = time.perf_counter()
        for _ in range(iters):
            dist.all_reduce(x)
        sync()
        q.put((rank, (time.perf_counter() - t) / iters, ""))
        dist.destroy_process_group()
    except Exception as e:   # noqa: BLE001 - reported, not raised: the parent prints one JSON line
        q.put((rank, None, f"{type(e).__name__}: {e}"))


def main(args):
    import multiprocessing as mp
    gpus, nbytes, iters = int(args["gpus"]), int(args.get("bytes", 256 << 20)), int(args.get("iters", 10))
    backend, timeout = args.get("backend", "nccl"), float(args.get("timeout", 90))
    nodes, node_rank = int(args.get("nodes", 1)), int(args.get("node_rank", 0))
    n = gpus * nodes
    out = {"gpus": gpus, "world": n, "node_rank": node_rank, "bytes": nbytes, "seconds": None, "busbw_gbps": None,
           "error": ""}
    addr, port = args.get("master_addr", "127.0.0.1"), int(args.get("master_port", 0))
    if not port:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    procs = [ctx.Process(target=rank_main, args=(node_rank * gpus + r, n, r, addr, port, nbytes, iters, backend, q))
             for r in range(gpus)]
    for p in procs:
        p.start()
    times, errors, deadline = {}, [], time.time() + timeout
    while len(times) + len(errors) < gpus:
        try:
            rank, dt, err = q.get(timeout=max(0.1, deadline - time.time()))
        except Exception:   # noqa: BLE001 - queue.Empty: a rank hangs (or died without a word)
            errors.append(f"no result from {gpus - len(times) - len(errors)} rank(s) within {timeout:g} s")
            break
        if err:
            errors.append(err)
        else:
            times[rank] = dt
    for p in procs:
        p.join(5)
        if p.is_alive():
            p.kill()
    if errors:
        out["error"] = errors[0]
    else:
        dt = max(times.values())
        out["seconds"] = dt
        out["busbw_gbps"] = 2 * (n - 1) / n * nbytes / dt / 1e9
    print(json.dumps(out))


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
