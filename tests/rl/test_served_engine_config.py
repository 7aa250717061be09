"""V4_ROLLOUT_ENGINE=server (the embedded engine as a `v4 rl serve` process the RL job starts and restarts,
dsv4/rl/restart.py) takes its weights by broadcast or disk: inproc is refused at config time, auto is broadcast."""
from __future__ import annotations

import pytest

from jobs.train_rl import sync_path
from launcher.config import Selection, resolve
from launcher.config.checks import InvalidConfig


def cpu(**sets):
    return resolve(Selection(cluster="local", hw="cpu", preset="rl_smoke",
                             sets=tuple(f"{k}={v}" for k, v in {"V4_ROLLOUT_ENGINE": "server", **sets}.items())))


def test_a_served_engine_refuses_the_inproc_sync():
    with pytest.raises(InvalidConfig) as e:
        cpu(PRESET_RL_SYNC="inproc")
    (msg,) = e.value.errors
    assert "V4_ROLLOUT_ENGINE=server" in msg and "use broadcast" in msg


@pytest.mark.parametrize("sync, want", [("auto", "broadcast"), ("disk", "disk")])
def test_a_served_engine_syncs_by_broadcast_or_disk(sync, want):
    assert sync_path(cpu(PRESET_RL_SYNC=sync).values) == want
