"""cuda_src/gemm_fp8.cu, the prefill fp8 GEMM (wgmma and TMA, sm_90a): against the faithful linear layer (numpy on
the dequantised weight, reference.quant.act_quant on its input) at Flash and small shapes, both block heights, in a
replayed graph; and, without a GPU, that its SASS (and the fp8 expert kernel's) runs on the tensor cores' GMMA
instructions. Also linear_fp8's choice between it and fp8.skinny_gemm: Hopper's e4m3 wgmma keeps 13 mantissa bits
of its sums, so only bf16 outputs take it, and a float32 build's fp8 linear layers match the reference's fp32 sums
(the "mid" model's widths)."""
import functools
import importlib.util
import re
import shutil
import subprocess
from pathlib import Path
from types import SimpleNamespace

import ml_dtypes
import numpy as np
import pytest

from conftest import rel_rows
from dsv4rt.loader.formats import dequant_fp8, quant_fp8
from dsv4rt.reference import quant
from test_k_fp8 import act_quant_bytes, fetch

gpu = pytest.mark.gpu
BF16 = ml_dtypes.bfloat16
FLASH = [(1024, 4096), (32768, 1024), (4096, 8192), (2048, 4096)]  # [n, k]: wq_a, wq_b, wo_b, 4096 → 2048
SMALL = [(128, 128), (128, 256), (256, 128), (256, 256)]
SENTINEL = 12288.0  # in the rows past m of y, which the kernel must leave alone


@functools.cache
def fp8_weight(n: int, k: int):
    """quant_fp8 of a random weight whose magnitude spreads over four decades from one 128 x 128 tile to the next,
    so that a scale taken from the wrong tile shows: (e4m3 bytes, e8m0 bytes, the dequantised float32 weight)."""
    rng = np.random.default_rng(n * 31 + k)
    mag = np.repeat(np.repeat(10.0 ** rng.uniform(-3, 1, (n // 128, k // 128)), 128, 0), 128, 1) / np.sqrt(k)
    q, s = quant_fp8(rng.standard_normal((n, k), dtype=np.float32) * mag.astype(np.float32))
    return q.view(np.uint8), s.view(np.uint8), dequant_fp8(q, s)


def activations(m: int, k: int) -> np.ndarray:
    """Rows whose magnitude spreads over four decades from one 128-column block to the next."""
    rng = np.random.default_rng(m * 131 + k)
    mag = np.repeat(10.0 ** rng.uniform(-2, 2, (m, k // 128)), 128, axis=1)
    return (rng.standard_normal((m, k)) * mag).astype(np.float32)


# (warpgroups, halves): 64-row blocks of 128 columns, 128-row ones of 128 and of 256 columns
BLOCKS = [(1, 1), (2, 1), (2, 2)]


def run_gemm(rt, dev, out_dtype, xq, xs, wq, ws, m, n, k, block, group_n=None):
    """y from the GPU; the rows of its last block past m are checked to keep their sentinel."""
    from dsv4rt.model import gemm_fp8
    rows = -(-m // 128) * 128
    dy = dev(np.full((rows, n), SENTINEL, out_dtype))
    gemm_fp8.fp8_gemm(rt.device, dev(xq).ptr, dev(xs).ptr, dev(wq).ptr, dev(ws).ptr, dy.ptr, m, n, k, out_dtype,
                      warpgroups=block[0], group_n=group_n, halves=block[1])(rt.stream)
    y = fetch(rt, dy, (rows, n), out_dtype).astype(np.float32)
    assert (y[m:] == SENTINEL).all(), "rows past m written"
    return y[:m]


@gpu
@pytest.mark.parametrize("n, k", FLASH + SMALL)
@pytest.mark.parametrize("m", [1, 17, 128, 300, 1000])
def test_prefill_gemm_matches_the_faithful_linear(rt, dev, m, n, k):
    wq, ws, w = fp8_weight(n, k)
    x = activations(m, k)
    xq, xs, _ = act_quant_bytes(x)
    want = quant.act_quant(x) @ w.T
    errors = {(np.dtype(out).name, block): rel_rows(run_gemm(rt, dev, out, xq, xs, wq, ws, m, n, k, block),
                                                    want).max()
              for out in (np.float32, BF16) for block in BLOCKS}
    assert max(errors.values()) < 1e-2, errors


@gpu
@pytest.mark.parametrize("groups, n, k", [(8, 1024, 4096), (2, 128, 128), (3, 256, 384)])  # Flash wo_a, "mid", odd
@pytest.mark.parametrize("m", [17, 300])
def test_grouped_prefill_gemm_matches_the_fast_output_projection(rt, dev, m, groups, n, k):
    """group_n: x [m, groups·k] quantised per group row (the fast numerics' wo_a input), group j of y from group j
    of x and of the weight's rows."""
    wq, ws, w = fp8_weight(groups * n, k)
    xq, xs, rounded = act_quant_bytes(activations(m, groups * k).reshape(m * groups, k))
    rounded = rounded.reshape(m, groups, k)
    want = np.concatenate([rounded[:, j] @ w[j * n:(j + 1) * n].T for j in range(groups)], axis=1)
    blocks = [b for b in BLOCKS if b[1] == 1 or n % 256 == 0]  # 256-column blocks within a group
    errors = {(np.dtype(out).name, block): rel_rows(run_gemm(rt, dev, out, xq, xs, wq, ws, m, groups * n, k, block,
                                                             group_n=n), want).max()
              for out in (np.float32, BF16) for block in blocks}
    assert max(errors.values()) < 1e-2, errors


@gpu
@pytest.mark.parametrize("dtype", [np.float32, BF16])
def test_act_quant_then_prefill_gemm_in_a_replayed_graph(rt, dev, dtype):
    """The prefill pair as a CUDA graph holds it: quantise the activations, then the GEMM, replayed on new inputs."""
    from dsv4rt.cuda.device import Graph
    from dsv4rt.model import fp8, gemm_fp8
    m, n, k = 300, 2048, 4096
    wq, ws, w = fp8_weight(n, k)
    dx, dq = dev(np.zeros((m, k), dtype)), dev(np.zeros((m, k), np.uint8))
    ds, dy = dev(np.zeros((m, fp8.scale_columns(k)), np.uint8)), dev(np.full((m, n), np.nan, np.float32))
    launches = [fp8.act_quant(rt.device, dtype, dq.ptr, ds.ptr, dx.ptr, m, k),
                gemm_fp8.fp8_gemm(rt.device, dq.ptr, ds.ptr, dev(wq).ptr, dev(ws).ptr, dy.ptr, m, n, k, np.float32)]
    graph = Graph(rt.stream)
    with graph:
        for launch in launches:
            launch(rt.stream)
    for trial in range(2):
        x = activations(m + trial, k)[:m].astype(dtype).astype(np.float32)
        dx.copy_from_host(x.astype(dtype), rt.stream)  # a pageable copy may return before its DMA lands
        graph.replay()
        assert rel_rows(fetch(rt, dy, (m, n), np.float32), quant.act_quant(x) @ w.T).max() < 1e-2
    graph.close()


@gpu
@pytest.mark.parametrize("dtype", [np.float32, BF16], ids=["float32", "bf16"])
@pytest.mark.parametrize("n, k", SMALL)
@pytest.mark.parametrize("m", [17, 300])
def test_linear_fp8_at_the_mid_models_widths(rt, dev, m, n, k, dtype):
    """act_quant then the GEMM linear_fp8 picks, at tests/test_gpu_faithful.py's "mid" widths: float32 within fp32
    summation noise of the float64 sums (the wgmma kernel's 13-bit sums sit ~4e-4 off), bf16 within its rounding."""
    from dsv4rt.model import fp8
    from dsv4rt.model.linear_fp8 import linear_fp8
    wq, ws, w = fp8_weight(n, k)
    x = activations(m, k).astype(dtype)
    dq, ds = dev(np.zeros((m, k), np.uint8)), dev(np.zeros((m, fp8.scale_columns(k)), np.uint8))
    dy = dev(np.full((m, n), np.nan, dtype))
    linear_fp8(rt.device, dtype, dev(x).ptr, dev(wq).ptr, dev(ws).ptr, dy.ptr, m, n, k, xq=dq.ptr, xs=ds.ptr)(
        rt.stream)
    want = quant.act_quant(x.astype(np.float32)).astype(np.float64) @ w.T.astype(np.float64)
    err = rel_rows(fetch(rt, dy, (m, n), dtype).astype(np.float32), want).max()
    assert err < (1e-5 if dtype == np.float32 else 1e-2), err


def test_float32_outputs_take_the_cuda_core_gemm(monkeypatch):
    from dsv4rt.model import fp8, gemm_fp8, linear_fp8
    monkeypatch.setattr(gemm_fp8, "fp8_gemm", lambda *args, **kw: "wgmma")
    monkeypatch.setattr(fp8, "skinny_gemm", lambda *args, **kw: "skinny")

    def chosen(arch, dtype, m, n, k, group_n=None):
        return linear_fp8.fp8_gemm(SimpleNamespace(arch=arch), dtype, 0, 0, 0, 0, 0, m, n, k, group_n)
    assert chosen("sm_90a", BF16, 300, 256, 128) == "wgmma"
    assert chosen("sm_90a", BF16, 17, 128, 256) == "wgmma"
    assert chosen("sm_90a", np.float32, 300, 256, 128) == "skinny"
    assert chosen("sm_90a", BF16, 16, 256, 128) == "skinny"
    assert chosen("sm_90a", BF16, 300, 200, 128) == "skinny"
    assert chosen("sm_90", BF16, 300, 256, 128) == "skinny"
    assert chosen("sm_90a", BF16, 300, 256, 128, group_n=128) == "wgmma"    # "mid"'s grouped wo_a in fast numerics
    assert chosen("sm_90a", BF16, 300, 128, 128, group_n=64) == "skinny"    # groups off the 128 tiles


@pytest.mark.parametrize("n, k, group_n", [(200, 128, None), (128, 200, None), (128, 64, None), (0, 128, None),
                                           (256, 128, 64), (384, 128, 256)])
def test_prefill_gemm_refuses_shapes_off_128(n, k, group_n):
    from dsv4rt.model import gemm_fp8
    with pytest.raises(ValueError, match="multiples of 128"):
        gemm_fp8.fp8_gemm(None, 0, 0, 0, 0, 0, 1, n, k, np.float32, group_n=group_n)


def test_prefill_gemm_refuses_misaligned_operands():
    from dsv4rt.model import gemm_fp8
    with pytest.raises(ValueError, match="16-byte aligned"):
        gemm_fp8.fp8_gemm(None, 8, 0, 0, 0, 0, 1, 128, 128, np.float32)


def test_block_height_fills_the_multiprocessors_first():
    from dsv4rt.model.gemm_fp8 import halves_for, warpgroups_for
    assert warpgroups_for(128, 1024, 132) == 1     # 8 blocks of 128 rows: 16 of 64
    assert warpgroups_for(4096, 1024, 132) == 2    # 256 blocks of 128 rows
    assert warpgroups_for(1000, 32768, 132) == 2
    assert halves_for(8192, 4096, 4096, 2, 132) == 2    # 64 x 16 blocks of 256 columns
    assert halves_for(8192, 512, 512, 2, 132) == 1      # 64 x 2: too few, 64 x 4 of 128
    assert halves_for(8192, 384, 384, 2, 132) == 1      # 64 x 2 again (the last half past n)
    assert halves_for(8192, 8192, 1024, 2, 132) == 2    # groups of 1024: whole 256-column blocks
    assert halves_for(8192, 3 * 384, 384, 2, 132) == 1  # a 256-column block would straddle two groups
    assert halves_for(8192, 4096, 4096, 1, 132) == 1    # 64-row blocks take 128 columns


def nvdisasm() -> str | None:
    """nvdisasm on PATH or in an NVIDIA wheel (nvidia-cuda-nvdisasm: nvidia/cu13/bin, nvidia/cuda_nvdisasm/bin)."""
    if found := shutil.which("nvdisasm"):
        return found
    spec = importlib.util.find_spec("nvidia")
    roots = spec.submodule_search_locations if spec else []
    return next((str(p) for root in roots for p in sorted(Path(root).glob("*/bin/nvdisasm"))), None)


def kernel_sass(tmp_path, monkeypatch, name: str):
    """cuda_src/<name>.cu built as dsv4rt builds it for sm_90a, with ptxas's wgmma left asynchronous: the module
    and its SASS."""
    pytest.importorskip("cuda.bindings")
    from dsv4rt.cuda.build import compile_module, instantiations, source_dir
    monkeypatch.setenv("DSV4RT_CACHE_DIR", str(tmp_path / "kernels"))
    module = compile_module(name, "sm_90a", instantiations((source_dir() / f"{name}.cu").read_text()))
    assert "serialized" not in module.log, module.log
    cubin = tmp_path / f"{name}.cubin"
    cubin.write_bytes(module.cubin)
    return module, subprocess.run([nvdisasm(), "-c", str(cubin)], capture_output=True, text=True, check=True).stdout


@pytest.mark.skipif(nvdisasm() is None, reason="no nvdisasm on PATH or in the nvidia wheels")
def test_prefill_kernels_run_on_gmma(tmp_path, monkeypatch):
    """Every instantiation, built as dsv4rt builds it for sm_90a, multiplies with QGMMA (wgmma on e4m3), loads with
    TMA (UTMALDG), and ptxas kept its wgmma asynchronous."""
    module, sass = kernel_sass(tmp_path, monkeypatch, "gemm_fp8")
    bodies = dict(re.findall(r"//-+ \.text\.(\S+) -+\n(.*?)(?=//-+ \.text\.|\Z)", sass, re.S))
    assert sorted(bodies) == sorted(module.lowered.values())
    for symbol, body in bodies.items():
        assert len(re.findall(r"\bQGMMA\.64x128x32\.F32\.E4M3\.E4M3\b", body)) >= 4, symbol
        assert "UTMALDG.2D" in body, symbol
        if "Li2ELi2E" in symbol:  # 256-column blocks: the producer warpgroup's registers go to the consumers
            assert "USETMAXREG.DEALLOC" in body and "USETMAXREG.TRY_ALLOC" in body, symbol


@pytest.mark.skipif(nvdisasm() is None, reason="no nvdisasm on PATH or in the nvidia wheels")
def test_fp8_expert_kernels_run_on_qgmma(tmp_path, monkeypatch):
    """The fp8 expert kernel (moe_wgmma_fp8.cu, the same e4m3 wgmma), both instantiations as dsv4rt builds them:
    QGMMA kept asynchronous, registers moved from the producer warpgroups to the consumers, none in local memory."""
    module, sass = kernel_sass(tmp_path, monkeypatch, "moe_wgmma_fp8")
    bodies = dict(re.findall(r"//-+ \.text\.(\S+) -+\n(.*?)(?=//-+ \.text\.|\Z)", sass, re.S))
    assert sorted(bodies) == sorted(module.lowered.values())
    for symbol, body in bodies.items():
        assert len(re.findall(r"\bQGMMA\.64x128x32\.F32\.E4M3\.E4M3\b", body)) == 4, symbol
        assert "USETMAXREG.DEALLOC" in body and "USETMAXREG.TRY_ALLOC" in body, symbol
        assert not re.search(r"\b(LDL|STL)\b", body), symbol
