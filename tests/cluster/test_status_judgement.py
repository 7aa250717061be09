"""How `v4 cluster status` judges what the GCS reports, and what `up` then tells the user to do. Pure: the GCS view
is the dict the head's probe returns (the netns and local-cluster tests read it from a real Ray)."""
from launcher import cluster
from launcher.config import Selection, resolve


def _judged(cfg, *, cpu: float, dashboard_ok: bool, extra: bool = False) -> cluster.ClusterStatus:
    st = cluster.ClusterStatus(cluster="local", head=cfg.nodes[0], gcs="g", dashboard="d",
                               nodes=[cluster.NodeState(ip=cfg.nodes[0], role="head")])
    nodes = [{"ip": cfg.nodes[0], "state": "ALIVE", "hostname": "h", "resources": {"CPU": cpu}}]
    if extra:
        nodes.append({"ip": "10.9.9.9", "state": "ALIVE", "hostname": "stray", "resources": {"CPU": 1.0}})
    cluster._judge(cfg, st, {"gcs_ok": True, "dashboard_ok": dashboard_ok, "jobs": [], "nodes": nodes})
    return st


def test_each_fix_follows_from_what_is_wrong():
    cfg = resolve(Selection(cluster="local", hw="cpu", sets=("V4_RAY_NUM_CPUS=2",)))
    assert _judged(cfg, cpu=2.0, dashboard_ok=True).healthy
    wrong_cpus = _judged(cfg, cpu=1.0, dashboard_ok=True)
    assert wrong_cpus.problems == [f"{cfg.nodes[0]}: Ray sees 1 CPU(s), expected 2 (V4_RAY_NUM_CPUS)"]
    fix = cluster._settled_problems_fix(cfg, wrong_cpus)
    assert "other resources" in fix and "dashboard.log" not in fix and "V4_WORKER_IPS" not in fix
    no_dashboard = _judged(cfg, cpu=2.0, dashboard_ok=False)
    fix = cluster._settled_problems_fix(cfg, no_dashboard)
    assert "dashboard.log" in fix and "other resources" not in fix
    stray = _judged(cfg, cpu=2.0, dashboard_ok=True, extra=True)
    assert "stop the Ray on 10.9.9.9" in cluster._settled_problems_fix(cfg, stray)


def test_a_problem_worded_like_another_does_not_choose_its_fix():
    """The fix comes from the status's fields, not from the wording of its problem lines."""
    cfg = resolve(Selection(cluster="local", hw="cpu", sets=("V4_RAY_NUM_CPUS=2",)))
    st = _judged(cfg, cpu=2.0, dashboard_ok=True)
    st.problems.append(f"{cfg.nodes[0]}: raylet (pid 1, started by v4) is not running; Ray sees its dashboard die")
    fix = cluster._settled_problems_fix(cfg, st)
    assert "other resources" not in fix and "dashboard.log" not in fix
    assert "`v4 cluster down`, then `v4 cluster up`" in fix
