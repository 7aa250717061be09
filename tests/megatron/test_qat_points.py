"""The QAT flags (fp8_gemm_inputs, mxfp4_experts) mean the same in the megatron stage as in the reference model:
the same Linear modules get the same quant-dequant points, and one process computes the reference's loss."""
from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_megatron_stage_quantises_where_the_reference_does():
    code = textwrap.dedent("""
        import socket, torch, torch.nn.functional as F
        from dsv4 import model as ref
        from dsv4.config import ModelConfig
        from dsv4.megatron.model import Objective, model_provider
        from dsv4.megatron.parallel import Layout, init_parallel
        from dsv4.megatron.train import init_distributed
        s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
        init_distributed(0, 1, "gloo", "cpu", "127.0.0.1", port)
        init_parallel(Layout(), 1)
        cfg = ModelConfig.preset("tiny", fp8_gemm_inputs=True, mxfp4_experts=True)
        stage = model_provider(cfg, Layout(), Objective())
        stage.init_weights(cfg.seed)
        R = ref.Transformer(cfg)
        theirs = {n: (m.qat_input, m.qat_weight) for n, m in R.named_modules() if isinstance(m, ref.Linear)}
        ours = {n: (m.qat_input, m.qat_weight) for n, m in stage.named_modules() if isinstance(m, ref.Linear)}
        assert ours and all(ours[n] == theirs[n] for n in ours), [n for n in ours if ours[n] != theirs[n]]
        assert ours["layers.1.attn.wq_a"] == ("fp8", "fp8") and ours["layers.1.ffn.experts.0.w1"] == ("fp8", "fp4")
        g = torch.Generator().manual_seed(0)
        tokens = torch.randint(0, cfg.vocab_size, (2, 33), generator=g)
        ids, labels, mask = tokens[:, :-1], tokens[:, 1:], torch.ones(2, 32)
        a = stage(ids, labels, mask)[0].item()
        b = (F.cross_entropy(R(ids).logits.flatten(0, 1), labels.flatten(), reduction="none")).sum().item()
        assert a == a and a == b, (a, b)
        plain = ModelConfig.preset("tiny")
        c = (F.cross_entropy(ref.Transformer(plain)(ids).logits.flatten(0, 1), labels.flatten(), reduction="none")).sum().item()
        assert c != a                       # the QAT points change the numbers: the check above can fail
        print("ok", a, c)
    """)
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0 and "ok" in r.stdout, r.stdout[-2000:] + r.stderr[-3000:]
