"""CPU/CI: every TileLang kernel still lowers to CUDA for sm_90a (catches TileLang API breakage without a GPU)."""
import importlib.util
import sys

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("tilelang") is None,
                                reason="tilelang is not installed (pip install 'tilelang>=0.1.11')")


def _lower(program, pass_configs=None) -> str:
    import tilelang
    import tvm
    target = tvm.target.Target({"kind": "cuda", "arch": "sm_90a"})
    with target, tvm.transform.PassContext(config=pass_configs or {}):
        return tilelang.lower(program, target=target).kernel_source


def test_dispatch_does_not_import_tilelang():
    import subprocess
    code = "import dsv4.kernels, sys; assert 'tilelang' not in sys.modules, 'imported tilelang'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_sparse_attn_fwd_lowers_warp_specialized_with_zero_fill_gather():
    from dsv4.kernels import tilelang_sparse_attn as sa
    src = _lower(sa.fwd_program(64, 512, 640, 512 ** -0.5), sa.FWD_PASS_CONFIGS)
    assert "wgmma" in src, "forward lost its wgmma GEMMs"
    # padded slots must be zero-filled by a predicated copy, never loaded from KV[-1]
    assert "cp_async_gs_conditional" in src, "KV gather is no longer a predicated (zero-fill) cp.async"
    assert "warpgroup_reg_alloc" in src and "warpgroup_reg_dealloc" in src
    assert "tma_load(Q_desc" in src, "forward no longer loads Q by TMA beside block 0's gather"


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


def test_indexer_lowers():
    from dsv4.kernels import tilelang_indexer as ix
    assert "wgmma" in _lower(ix.indexer_program(64, 128, 4))


@pytest.mark.parametrize("block,ue8m0,dtype", [(128, True, "bfloat16"), (64, False, "float32")])
def test_act_quant_lowers(block, ue8m0, dtype):
    from dsv4.kernels import tilelang_act_quant as aq
    src = _lower(aq.act_quant_program(512, block, ue8m0, dtype))
    assert "fp8_e4" in src
