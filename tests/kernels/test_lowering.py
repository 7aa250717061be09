"""CPU/CI: every TileLang kernel still lowers to CUDA for sm_90a (catches TileLang API breakage without a GPU)."""
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("tilelang") is None,
                                reason="tilelang is not installed (pip install 'tilelang>=0.1.11')")
ROOT = Path(__file__).resolve().parents[2]


def _lower(program, pass_configs=None) -> str:
    import tilelang
    import tvm
    target = tvm.target.Target({"kind": "cuda", "arch": "sm_90a"})
    with target, tvm.transform.PassContext(config=pass_configs or {}):
        return tilelang.lower(program, target=target).kernel_source


def test_dispatch_does_not_import_tilelang():
    code = "import dsv4.kernels, sys; assert 'tilelang' not in sys.modules, 'imported tilelang'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_sparse_attn_fwd_lowers_warp_specialized_with_zero_fill_gather():
    from dsv4.kernels import tilelang_sparse_attn as sa
    src = _lower(sa.fwd_program(64, 512, 640, 512 ** -0.5), sa.FWD_PASS_CONFIGS)
    assert "wgmma" in src, "forward lost its wgmma GEMMs"
    # padded slots must be zero-filled by a predicated copy (src-size 0), never loaded from KV[-1]; a bounds check
    # around the copy (TileLang's safe-memory pass) would skip the padded rows' zero-fill
    gather = src[src.index("if (256 <= ((int)threadIdx.x))"):]
    calls = re.findall(r"^(\s*)(if \(.*\) \{\n\s*)?v4_cp_async16\(", gather, flags=re.M)
    assert calls and not any(guard for _, guard in calls), "the KV gather's copies are guarded by a bounds check"
    assert "mbarrier_cp_async_arrive_noinc" in src, "the producer waits for its own copies again"
    assert "warpgroup_reg_alloc" in src and "warpgroup_reg_dealloc" in src
    # Q by TMA; Q and O pass through once: evict-first, so they do not push the gathered KV rows out of L2
    assert re.search(r"tma_load<[^>]*EVICT_FIRST>\(Q_desc", src), "Q is no longer loaded by TMA, evict-first"
    assert re.search(r"tma_store<[^>]*EVICT_FIRST>\(O_desc", src), "O is no longer stored evict-first"


@pytest.mark.parametrize("heads,dim,topk", [(128, 512, 1024), (64, 128, 128)])
def test_sparse_attn_fwd_lowers_other_shapes(heads, dim, topk):
    from dsv4.kernels import tilelang_sparse_attn as sa
    assert "wgmma" in _lower(sa.fwd_program(heads, dim, topk, dim ** -0.5), sa.FWD_PASS_CONFIGS)


def test_sparse_attn_bwd_lowers_without_aggressive_merge():
    from dsv4.kernels import tilelang_sparse_attn as sa
    assert sa.BWD_PASS_CONFIGS["tl.enable_aggressive_shared_memory_merge"] is False
    src = _lower(sa.bwd_program(64, 512, 640, 512 ** -0.5), sa.BWD_PASS_CONFIGS)
    assert "AtomicAdd" in src and "wgmma" in src
    # KV rows by TMA: padding (-1) must stay an out-of-bounds box that TMA zero-fills, never a clamped row
    assert "tma_load" in src and "expect_transaction" in src, "backward no longer gathers KV rows by TMA"
    assert "tma_store" in src, "backward no longer writes dQ with a TMA store"
    assert "tma_load(Q_desc" in src and "tma_load(dO_desc" in src, "backward no longer loads Q and dO by TMA"
    assert "tma_load(O_desc" not in src, "backward stages O in shared memory again (block 0's fetch would wait for Delta)"
    assert "AtomicAdd((&(dSink" in src, "backward no longer accumulates dsink in the kernel"
    # dkv leaves the accumulators 16 bytes a lane (two lanes swap a pair first), not as two 8-byte atomics
    assert "v4_dkv_red4<" in src and "red.global.add.v4.f32" in src and "AtomicAddx2" not in src
    # warp-specialized: the steps synchronize through mbarriers only, so warpgroup 0 can score block i+1 while
    # warpgroup 1 still adds block i's dkv; a CTA-wide barrier in the loop would serialize them again
    loop = src[src.index("kv_full[0].wait("):src.rindex("v4_dkv_red4<")]
    assert "__syncthreads()" not in loop, "a CTA-wide barrier is back in the backward's step loop"
    assert "pds_full1[0].wait(" in loop, "P and dS are no longer double-buffered between the warpgroups"


def _ptxas_report(source: str, tmp_path) -> str:
    """Compile lowered CUDA for sm_90a with TileLang's own nvcc and flags; return ptxas's resource report."""
    import re
    import shutil
    from tilelang.contrib import nvcc
    try:
        compiler = nvcc.get_nvcc_compiler()
    except RuntimeError as e:                       # TileLang found no CUDA installation
        pytest.skip(f"no CUDA toolkit to compile the kernels with: {e}")
    if not shutil.which(compiler):
        pytest.skip(f"no nvcc ({compiler}) to compile the kernels with")
    cu = tmp_path / "kernel.cu"
    cu.write_text(source)
    cmd = [compiler, "--cubin", "-O3", "-arch=sm_90a", *nvcc.default_compile_options(), "-Xptxas=-v", str(cu),
           "-o", str(tmp_path / "kernel.cubin")]
    done = subprocess.run(cmd, capture_output=True, text=True)
    assert done.returncode == 0, f"nvcc failed on the lowered kernel:\n{done.stderr[-3000:]}"
    assert re.search(r"Used \d+ registers", done.stderr), done.stderr[-2000:]
    return done.stderr


def test_sparse_attn_kernels_compile_and_the_forward_does_not_spill(tmp_path):
    """Lowering stops at CUDA source, so the CUDA the kernels prepend (CP_ASYNC16, FAST_EX2, ROW_REDUCE, DKV_RED4) is
    only ever compiled here and on the GPU host. The forward's warpgroups run at the register counts setmaxnreg gives
    them: a spill is local-memory traffic in the loop (a tree reduction written with a loop nvcc did not unroll put its
    16 values in local memory: 24 bytes of spills, and the softmax went through the stack)."""
    import re
    from dsv4.kernels import tilelang_sparse_attn as sa
    fwd = _ptxas_report(_lower(sa.fwd_program(64, 512, 640, 512 ** -0.5), sa.FWD_PASS_CONFIGS), tmp_path)
    spills = [int(n) for n in re.findall(r"(\d+) bytes spill stores", fwd)]
    report = "\n".join(line for line in fwd.splitlines() if "ptxas" in line or "spill" in line)
    assert spills and max(spills) == 0, f"the forward spills registers:\n{report}"
    _ptxas_report(_lower(sa.bwd_program(64, 512, 640, 512 ** -0.5), sa.BWD_PASS_CONFIGS), tmp_path)


def test_indexer_lowers():
    from dsv4.kernels import tilelang_indexer as ix
    assert "wgmma" in _lower(ix.indexer_program(64, 128, 4))


@pytest.mark.parametrize("block,ue8m0,dtype", [(128, True, "bfloat16"), (64, False, "float32")])
def test_act_quant_lowers(block, ue8m0, dtype):
    from dsv4.kernels import tilelang_act_quant as aq
    src = _lower(aq.act_quant_program(512, block, ue8m0, dtype))
    assert "fp8_e4" in src


def test_a_compile_prints_nothing_on_stdout(tmp_path):
    """TileLang logs each compile to stdout (tqdm.write); through tilelang_compile the lines go to stderr, so a
    command's --json output stays parseable. A fresh cache makes TileLang compile (and log) for real."""
    code = ("from dsv4.kernels import tilelang_compile\n"
            "from dsv4.kernels.tilelang_act_quant import act_quant_program\n"
            "tilelang_compile(act_quant_program(128, 128, False, 'bfloat16'), [1, 2])\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, "TILELANG_CACHE_DIR": str(tmp_path)}, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "compile kernel" in done.stderr, done.stderr[-2000:]
    assert done.stdout == "", done.stdout[-2000:]
