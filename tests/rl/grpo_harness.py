"""Run the GRPO loop (dsv4/rl/loop.py) on a real megatron-core world-1 trainer in a subprocess (its process group
and megatron's parallel state are process-wide) and read back its metrics rows. The engine is the embedded one
in the trainer's process, or `v4 rl serve` servers at the given URLs (one client each, an EngineGroup for more)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

from dsv4.megatron.launch import free_port

ROOT = Path(__file__).resolve().parents[2]

TRAINER = """
import json, sys
from pathlib import Path
from dsv4.config import ModelConfig
from dsv4.megatron.parallel import Layout, init_parallel
from dsv4.megatron.train import Outputs, TrainConfig, init_distributed, quiet_libraries
from dsv4.rl.loop import RLConfig, run_grpo
from dsv4.rl.tasks import EchoTask

out, port, options = Path(sys.argv[1]), int(sys.argv[2]), json.loads(sys.argv[3])
urls = options.pop("urls", None)
quiet_libraries()
init_distributed(0, 1, "gloo", "cpu", "127.0.0.1", port)
tc = TrainConfig(model=ModelConfig.preset("tiny", seed=3), layout=Layout(), seq_len=4, micro_batch_size=32,
                 global_batch_size=64, num_steps=3, lr=1e-3, weight_decay=0.0, device="cpu", save_interval=100)
init_parallel(tc.layout, tc.seed)
task = EchoTask()
rl = RLConfig(prompts_per_step=8, group_size=8, max_new_tokens=1, scratch=out,
              allowed_token_ids=task.allowed_token_ids, **options)
if urls is None:
    from dsv4.model import Transformer
    from dsv4.rl.engine import EmbeddedEngine
    engine = EmbeddedEngine(Transformer(tc.model, init=False))
else:
    from dsv4.rl.group import EngineGroup
    from dsv4.rl.http import HTTPEngine
    engine = HTTPEngine(urls[0]) if len(urls) == 1 else EngineGroup([HTTPEngine(u) for u in urls])
rows = []
code = run_grpo(tc, rl, task, task.reward, engine, Outputs(checkpoints=out / "ckpt"), rows.append)
(out / "rows.json").write_text(json.dumps(rows))
sys.exit(code)
"""


def run_trainer(out: Path, **options) -> list[dict]:
    """Three GRPO steps; `options` are RLConfig fields, plus `urls` for served engines. -> the metrics rows."""
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(TRAINER), str(out), str(free_port()),
                        json.dumps(options)], cwd=ROOT, capture_output=True, text=True, timeout=600,
                       env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH")))), "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return json.loads((out / "rows.json").read_text())
