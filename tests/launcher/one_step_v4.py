"""`v4 ARGS...` (the real CLI, pipeline and registry) with every plan cut down to one job step whose command is
$V4_TEST_ENTRY: what the interrupt-and-resume tests run as the launcher process they signal.

The step keeps its name, submission id and environment; on Ray it gets no working_dir (nothing of the checkout is
uploaded: the command is the test's own). Preflight, cluster up and gates are left out: the test brought up what
the step needs."""
from __future__ import annotations

import os
import sys

from launcher import plan as planning
from launcher.cli import main

_build = planning.build


def one_step(cfg, run_id=None):
    plan = _build(cfg, run_id=run_id)
    plan.steps = [s for s in plan.steps if s.kind == "job"][:1]
    job = plan.steps[0].job
    job.entrypoint = os.environ["V4_TEST_ENTRY"]
    if cfg["V4_EXECUTOR"] == "ray":
        job.runtime_env = {"env_vars": job.runtime_env["env_vars"]}
    return plan


planning.build = one_step

if __name__ == "__main__":
    main(sys.argv[1:])
