"""The kernel NaN bisector end to end on the CPU: a synthetic "kernel" that goes NaN only when one pass-config
setting is on (and wrong only with a pair of others) must be traced to exactly that setting, through the real
worker subprocess, ddmin, the shape sweep and the written report."""
import json
import textwrap

import pytest

from dsv4.kernels import bisect as kb

SOURCE = textwrap.dedent('''
    import torch
    PASS_CONFIGS = {"tl.disable_tma_lower": True, "tl.disable_warp_specialized": True,
                    "tl.enable_aggressive_shared_memory_merge": True, "tl.enable_fast_math": False}
    def run(shape, pass_configs):
        g = torch.Generator().manual_seed(0)
        x = torch.randn(shape["S"], shape["D"], generator=g)
        y = x * 2
        if pass_configs.get("tl.enable_aggressive_shared_memory_merge") and shape["topk"] > 64:
            y[0, 0] = float("nan")                     # like the real bug: needs a loop of several blocks
        return {"y": y}
''')
REFERENCE = textwrap.dedent('''
    import torch
    def run(shape):
        g = torch.Generator().manual_seed(0)
        return {"y": torch.randn(shape["S"], shape["D"], generator=g) * 2}
''')


def test_ddmin_finds_one_minimal_subsets():
    assert kb.ddmin(list("abcdefgh"), lambda s: "c" in s) == ["c"]
    assert sorted(kb.ddmin(list("abcdefgh"), lambda s: {"b", "g"} <= set(s))) == ["b", "g"]


def test_parse_setting_and_shape():
    assert kb.parse_setting("TL_ENABLE_AGGRESSIVE_SHARED_MEMORY_MERGE=on") == ("tl.enable_aggressive_shared_memory_merge", True)
    assert kb.parse_setting("tl.ptxas_register_usage_level=10") == ("tl.ptxas_register_usage_level", 10)
    assert kb.Shape.parse("1,256,64,512,640").N == 641            # more KV rows than top-k slots
    with pytest.raises(ValueError, match="B,S,H,D,topk"):
        kb.Shape.parse("1,256,64")


def test_bisect_names_the_culprit_setting_and_smallest_shape(tmp_path):
    src, ref = tmp_path / "src.py", tmp_path / "ref.py"
    src.write_text(SOURCE)
    ref.write_text(REFERENCE)
    settings = dict(kb._load(str(src), "s").PASS_CONFIGS)
    report = kb.bisect("x", kb.Shape(1, 32, 64, 16, 128), settings, source=str(src), reference=str(ref),
                       timeout=120, log=lambda m: None)
    assert report.reproduced and report.baseline["verdict"] == "pass"
    assert report.culprit == {"tl.enable_aggressive_shared_memory_merge": True}
    assert "#2199" in report.culprit_note
    assert report.smallest_failing_shape == str(kb.Shape(1, 1, 64, 16, 128))      # topk 64 passes, S 1 fails
    jpath, mpath = kb.write_report(report, str(tmp_path / "out"))
    assert json.load(open(jpath))["culprit"] == report.culprit
    assert "Culprit" in open(mpath).read()


def test_bisect_says_when_the_kernel_does_not_build(tmp_path):
    """On an older TileLang a kernel may fail to compile at all (the shipped backward does on 0.1.9): that is
    reported as such, not as "no failure" or as a culprit."""
    src, ref = tmp_path / "src.py", tmp_path / "ref.py"
    broken = SOURCE.replace("def run(shape, pass_configs):\n",
                            "def run(shape, pass_configs):\n    raise RuntimeError('bad optional access')\n")
    assert broken != SOURCE
    src.write_text(broken)
    ref.write_text(REFERENCE)
    settings = dict(kb._load(str(src), "s").PASS_CONFIGS)
    report = kb.bisect("x", kb.Shape(1, 8, 64, 16, 128), settings, source=str(src), reference=str(ref),
                       timeout=120, log=lambda m: None)
    assert report.culprit is None and report.baseline["verdict"] == "error"
    assert "does not build" in report.culprit_note and "bad optional access" in report.culprit_note
