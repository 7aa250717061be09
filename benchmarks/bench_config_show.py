"""Wall time of `v4 config show` next to `python -c pass`, measured in the same run.

    .venv/bin/python benchmarks/bench_config_show.py [--repeat 10]

Prints the median of each and their ratio, plus which heavy modules the command imported (none is
the goal: the config commands must not pay for torch or ray).
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CASES = {
    "python -c pass": [sys.executable, "-c", "pass"],
    "v4 config show --preset smoke": [sys.executable, "-m", "launcher", "config", "show", "--preset", "smoke"],
    "v4 config show --explain (h20_8node, dryrun)": [sys.executable, "-m", "launcher", "config", "show", "--explain",
                                                      "--cluster", "h20_8node", "--preset", "dryrun"],
    "v4 run --dry-run (h20_8node, smoke, h200)": [sys.executable, "-m", "launcher", "run", "--preset", "smoke",
                                                   "--hw", "h200", "--cluster", "h20_8node", "--dry-run"],
}


def median_wall(cmd: list[str], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=10)
    args = ap.parse_args()
    base = median_wall(CASES["python -c pass"], args.repeat)
    print(f"{'command':<48} {'median s':>9} {'x python -c pass':>17}")
    for name, cmd in CASES.items():
        t = base if name == "python -c pass" else median_wall(cmd, args.repeat)
        print(f"{name:<48} {t:9.3f} {t / base:17.1f}")
    probe = ("import sys\nfrom launcher.cli import main\ntry:\n    main(['config','show','--preset','smoke'])\n"
             "except SystemExit:\n    pass\nprint(sorted(m for m in ('torch','ray','paramiko','jinja2') if m in sys.modules), file=sys.stderr)")
    r = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True)
    print(f"heavy modules imported by `v4 config show`: {r.stderr.strip().splitlines()[-1]}")


if __name__ == "__main__":
    main()
