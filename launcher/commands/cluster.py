"""`v4 cluster up | down | status | probe | token`: Ray on the configured nodes."""
from __future__ import annotations

import json
import sys
import time

import click

from launcher.cli_options import config_options, load_config
from launcher.errors import CLUSTER_FAILED
from launcher.table import table


@click.group("cluster")
def cluster():
    """Bring Ray up on the cluster's nodes, tear it down, show it, probe it."""


def render_status(st) -> str:
    alive = sum(n.gcs_state == "ALIVE" for n in st.nodes)
    lines = [f"cluster {st.cluster}: {'healthy' if st.healthy else 'NOT healthy'} ({alive}/{len(st.nodes)} nodes ALIVE)"
             f"  GCS {st.gcs}  dashboard {st.dashboard}{'' if st.dashboard_ok else ' (down)'}"
             + (f"  cluster id {st.cluster_id[:12]}" if st.cluster_id else "")]
    rows = [("NODE", "ROLE", "HOSTNAME", "RAY", "CPU", "GPU", "RAYLET", "V4 PROCS")]
    for n in st.nodes:
        raylet = n.proc("raylet")
        procs = f"{sum(p['alive'] for p in n.procs)}/{len(n.procs)} alive" if n.recorded else "-"
        rows.append((n.ip, n.role, n.hostname or "-", n.gcs_state if n.reachable else "UNREACHABLE",
                     f"{n.resources.get('CPU', 0):g}" if n.resources else "-",
                     f"{n.resources.get('GPU', 0):g}" if n.resources else "-",
                     (f"pid {raylet['pid']} {'up' if raylet['alive'] else 'DEAD'}") if raylet else "-", procs))
    for n in st.extra_nodes:
        rows.append((n["ip"], "EXTRA", n["hostname"], n["state"], f"{n['resources'].get('CPU', 0):g}",
                     f"{n['resources'].get('GPU', 0):g}", "-", "-"))
    lines.append(table(rows))
    if st.jobs is not None:
        by = {}
        for j in st.jobs:
            by[j["status"]] = by.get(j["status"], 0) + 1
        lines.append(f"jobs: {len(st.jobs)}" + (f" ({', '.join(f'{v} {k}' for k, v in sorted(by.items()))})" if by else ""))
        for j in sorted(st.jobs, key=lambda j: j.get("start_time") or 0)[-10:]:
            lines.append(f"  {j['submission_id'] or j['job_id']}  {j['status']}  {j['entrypoint'][:80]}")
    if st.problems:
        lines.append("problems:")
        lines += [f"  - {p}" for p in st.problems]
    if st.left_out:
        # launcher/recovery.py: a run went on without them; a later preflight that passes there takes them back
        lines.append("left out by runs:")
        lines += [f"  - {e['ip']}: {e['why'][:300]} (run {e['run']}, {e['by']}, "
                  f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(e['at']))})" for e in st.left_out]
    return "\n".join(lines)


@cluster.command("init")
@click.argument("name")
@click.option("--from", "template", required=True, metavar="TEMPLATE",
              help="a cluster file to start from: a name in envs/cluster/ (e.g. h200_template) or a path")
@click.option("--master", metavar="ADDR", help="the head node's address (V4_MASTER_IP)")
@click.option("--workers", metavar="'ADDR ...'", help="the worker nodes' addresses, space-separated (V4_WORKER_IPS; "
              "sets V4_NUM_NODES)")
@click.option("--gpus-per-node", type=int, help="V4_NUM_GPUS_PER_NODE")
@click.option("--work", metavar="DIR", help="the shared directory, the same path on every node (V4_WORK)")
@click.option("--local-dir", metavar="DIR", help="node-local scratch for Ray (V4_LOCAL_DIR)")
@click.option("--user", help="SSH login user (V4_SSH_USER)")
@click.option("--ssh-key", metavar="FILE", help="SSH private key (V4_SSH_KEY)")
@click.option("--known-hosts", metavar="FILE", help="the pinned host keys (V4_SSH_KNOWN_HOSTS)")
@click.option("--python", metavar="PATH", help="the interpreter on the nodes (V4_PYTHON)")
@click.option("--image", help="container image (V4_IMAGE)")
@click.option("--container", metavar="NAME", help="container name: run inside it (V4_CONTAINER)")
@click.option("--no-container", is_flag=True, help="run on the hosts (empties V4_CONTAINER and V4_IMAGE)")
@click.option("--set", "sets", multiple=True, metavar="KEY=VALUE", help="any other cluster key (repeatable)")
@click.option("--force", is_flag=True, help="overwrite an existing envs/cluster/NAME.env (never the --from template)")
def init(name, template, sets, force, no_container, **opts):
    """Write envs/cluster/NAME.env from TEMPLATE with your addresses and paths. Nothing is written while a
    template placeholder (a documentation-range address, a /your/ path) or any other validation error remains."""
    from launcher.clusterinit import OPTION_KEYS, init as do_init
    values = {OPTION_KEYS["--" + k.replace("_", "-")]: str(v) for k, v in opts.items() if v is not None}
    if no_container:
        if opts.get("container") or opts.get("image"):
            raise click.UsageError("--no-container goes without --container and --image")
        values.update(V4_CONTAINER="", V4_IMAGE="", V4_DOCKER_MOUNTS="")
    for s in sets:
        key, eq, val = s.partition("=")
        if not eq:
            raise click.UsageError(f"--set {s!r}: expected KEY=VALUE")
        values[key.strip()] = val
    path, _ = do_init(name, template, values, force=force)
    click.echo(f"wrote {path}")
    click.echo("next:", err=True)
    click.echo(f"  v4 config show --cluster {name} --explain     every value and where it came from", err=True)
    click.echo(f"  v4 bootstrap --cluster {name}                 validate, SSH, preflight, Ray, probe, smoke, step "
               "by step", err=True)


@cluster.command("up")
@config_options()
@click.option("--json", "as_json", is_flag=True, help="print the resulting status as JSON on stdout")
def up(selection, as_json):
    """Start Ray: head, then workers; wait until the GCS reports every node. No-op when healthy. A Ray on the
    cluster's ports that this checkout did not start (another user's, another clone's) is refused, exit 5: never
    joined, never sent the token."""
    from launcher import cluster as c
    cfg = load_config(selection)
    st = c.up(cfg)
    click.echo(json.dumps(st.to_json(), indent=2) if as_json else render_status(st))


@cluster.command("down")
@config_options()
@click.option("--force", is_flag=True,
              help="on nodes where v4 recorded no Ray, fall back to `ray stop --force` (stops EVERY Ray process there)")
@click.option("--json", "as_json", is_flag=True, help="per-node report as JSON on stdout")
def down(selection, force, as_json):
    """Stop the Ray processes v4 started (recorded per node); other Ray processes are left alone. Runs leave Ray up
    (the next starts at once); this stops it. With V4_ROLLOUT_ENGINE=sglang, the SGLang rollout servers v4 started on
    the rollout nodes are stopped first."""
    from launcher import cluster as c
    from launcher import rollout
    cfg = load_config(selection)
    # before Ray: in container mode Ray's `down` removes the container, and a server's orderly stop needs it running
    servers = rollout.rollout_down(cfg) if rollout.sglang_selected(cfg) else []
    reports = c.down(cfg, force=force)
    if as_json:
        click.echo(json.dumps({"schema": 1, "nodes": reports, **({"rollout": servers} if servers else {})}, indent=2))
    if not all(r["ok"] for r in reports + servers):
        sys.exit(CLUSTER_FAILED)


@cluster.command("status")
@config_options()
@click.option("--json", "as_json", is_flag=True, help="machine-readable output (schema 1)")
def status(selection, as_json):
    """Nodes (as Ray's GCS sees them), resources, v4's recorded processes, jobs. Exit 5 when unhealthy."""
    from launcher import cluster as c
    cfg = load_config(selection)
    st = c.status(cfg)
    click.echo(json.dumps(st.to_json(), indent=2) if as_json else render_status(st))
    if not st.healthy:
        sys.exit(CLUSTER_FAILED)


@cluster.command("token")
@config_options()
def token(selection):
    """Print the running cluster's Ray auth token, for clients outside v4 (`Authorization: Bearer <token>`).
    Exit 5 when the head has none."""
    from launcher import cluster as c
    cfg = load_config(selection)
    tok = c.read_auth_token(cfg)
    if not tok:
        click.echo(f"error: no Ray auth token on the head ({c.auth_token_path(cfg, cfg.nodes[0])}); "
                   "`v4 cluster up` writes one when it starts Ray", err=True)
        sys.exit(CLUSTER_FAILED)
    click.echo(tok)


@cluster.command("probe")
@config_options()
@click.option("--json", "as_json", is_flag=True, help="what each node reported, as JSON")
@click.option("--timeout", default=300.0, show_default=True, help="seconds before the job is stopped")
def probe(selection, as_json, timeout):
    """Submit the built-in probe job (one Ray task per node) and print what every node sees."""
    from launcher import jobs, registry
    cfg = load_config(selection)
    run = registry.create_run(cfg, prefix="probe", argv=sys.argv)
    click.echo(f"run {run.id}: {run.dir}", err=True)
    outcome, seen = jobs.probe(cfg, run, timeout_s=timeout)
    if as_json:
        click.echo(json.dumps({"run_id": run.id, "outcome": outcome.to_json(), "nodes": seen}, indent=2))
        return
    for s in sorted(seen, key=lambda s: s["ip"]):
        click.echo(f"{s['ip']:<16} {s['hostname']:<20} GPU(ray)={s['resources'].get('GPU', 0):g} "
                   f"nvidia-smi={s['gpus_visible']} ifname={s['socket_ifname'] or '-'} python={s['python']}")
    click.echo(f"probe: {len(seen)}/{len(cfg.nodes)} node(s) answered in {outcome.elapsed_s:.1f} s "
               f"(job {outcome.submission_id})", err=True)
