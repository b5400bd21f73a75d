"""One source of truth for kernel facts: every constant the Python launchers copy from cuda_src/ (block sizes,
tile shapes, limits, entry layouts, instantiated variants) equals what the CUDA source says, read from it."""
import re

import ml_dtypes
import numpy as np
import pytest

from dsv4rt.cuda.build import instantiations, source_dir
from dsv4rt.kv import entries
from dsv4rt.model import attention, compress, fp8, gemm, gemm_fp8, hc, moe, moe_fp4, sample

_CONSTEXPR = re.compile(r"^constexpr (?:int|float|unsigned) ([^;]+);", re.MULTILINE)


def _source(file: str) -> str:
    return (source_dir() / file).read_text()


def _c_eval(expr: str, names: dict) -> int | float:
    """An integer expression of the CUDA source in Python: / between ints is C's truncating division."""
    expr = re.sub(r"\b(0x[0-9a-fA-F]+|[\d.]+(?:e[-+]?\d+)?)[fu]?\b", r"\1", expr).replace("/", "//")
    return eval(expr, {"__builtins__": {}}, names)  # noqa: S307 (our own source)


def constants(file: str, names: dict | None = None) -> dict[str, int | float]:
    """Every top-level `constexpr int|float|unsigned NAME = EXPR;` of `file` and the files it includes."""
    names = {} if names is None else names
    text = _source(file)
    for include in re.findall(r'^#include "([^"]+)"', text, re.MULTILINE):
        constants(include, names)
    for decl in _CONSTEXPR.findall(text):
        for part in decl.split(","):
            name, _, expr = part.partition("=")
            names[name.strip()] = _c_eval(expr.strip(), names)
    return names


def launch_bounds(file: str, kernel: str) -> tuple[int, ...]:
    """__launch_bounds__(threads[, min blocks]) of the kernel `kernel` in `file`."""
    m = re.search(r"__launch_bounds__\(([^()]*(?:\([^()]*\))?[^()]*)\)\s*\n?\s*" + kernel + r"\(", _source(file))
    assert m, f"no __launch_bounds__ for {kernel} in {file}"
    names = constants(file)
    return tuple(_c_eval(x, names) for x in m[1].split(","))


def template_args(file: str, kernel: str, position: int) -> set[str]:
    """The `position`-th template argument of every instantiation of `kernel` that `file` declares."""
    return {e[len(kernel) + 1:-1].split(",")[position] for e in instantiations(_source(file)) if e.startswith(kernel + "<")}


def _facts():
    att = constants("attention.cu")
    mqa = constants("attention_mqa.cu")
    wga = constants("attention_wgmma.cu")
    idx = constants("indexer.cu")
    hcs = constants("hc.cu")
    mo = constants("moe.cu")
    fp4 = constants("moe_fp4.cu")
    mma = constants("moe_mma.cu")
    yield "attention.MAX_HEAD_DIM", attention.MAX_HEAD_DIM, att["kMaxHeadDim"]
    yield "attention.BLOCK_HEADS", attention.BLOCK_HEADS, att["kBlockHeads"]
    yield "attention.ATTENTION_THREADS", attention.ATTENTION_THREADS, launch_bounds("attention.cu", "sparse_attention")[0]
    yield "attention.TILE_BYTES", attention.TILE_BYTES, int(re.search(r"kTileKeys = (\d+) /", _source("attention.cu"))[1])
    yield "attention.COMBINE_WARPS", attention.COMBINE_WARPS, att["kCombineWarps"]
    yield "attention.QKV_WARPS", attention.QKV_WARPS, constants("qkv.cu")["kQkvWarps"]
    yield "attention.MQA_HEADS", attention.MQA_HEADS, mqa["kMqaHeads"]
    yield "attention.MQA_KEYS", attention.MQA_KEYS, mqa["kMqaKeys"]
    yield "attention.MQA_THREADS", attention.MQA_THREADS, launch_bounds("attention_mqa.cu", "sparse_attention_mqa")[0]
    yield "attention.MQA_HEADS (wgmma)", attention.MQA_HEADS, wga["kWgaHeads"]
    yield "attention.MQA_THREADS (wgmma)", attention.MQA_THREADS, wga["kWgaThreads"]
    yield "attention.WGMMA_HEAD_DIM", attention.WGMMA_HEAD_DIM, wga["kWgaHd"]
    yield "attention.WGMMA_KEYS", attention.WGMMA_KEYS, wga["kWgaKeys"]
    yield "compress.POOL_THREADS", compress.POOL_THREADS, launch_bounds("compress.cu", "compress_pool")[0]
    yield "compress.INDEX_HEADS", compress.INDEX_HEADS, idx["kHeads"]
    yield "compress.KEY_TILE", compress.KEY_TILE, idx["kKeys"]
    yield "compress.SCORE_THREADS", compress.SCORE_THREADS, launch_bounds("indexer.cu", "indexer_scores")[0]
    yield "compress.MMA_DIM", compress.MMA_DIM, idx["kMmaDim"]
    yield "compress.MMA_STAGES", compress.MMA_STAGES, idx["kStages"]
    yield "compress.MMA_BLOCKS_PER_SM", compress.MMA_BLOCKS_PER_SM, launch_bounds("indexer.cu", "indexer_scores_mma")[1]
    yield "compress.MMA_FP4_STAGES", compress.MMA_FP4_STAGES, idx["kFp4Stages"]
    yield "compress.Q_THREADS", compress.Q_THREADS, launch_bounds("indexer_q.cu", "indexer_q_fp4")[0]
    yield "compress.Q_THREADS (128)", compress.Q_THREADS, launch_bounds("indexer_q.cu", "indexer_q_fp4_128")[0]
    yield "compress.CLUSTER", compress.CLUSTER, idx["kCluster"]
    yield "compress.SELECT_THREADS", compress.SELECT_THREADS, idx["kSelectThreads"]
    yield "fp8.BLOCK", fp8.BLOCK, constants("fp8.cuh")["kFp8Block"]
    yield "fp8.QUANT_WARPS", 32 * fp8.QUANT_WARPS, launch_bounds("fp8.cu", "act_quant")[0]
    yield "fp8.MAX_GEMM_WARPS", 32 * fp8.MAX_GEMM_WARPS, launch_bounds("fp8.cu", "fp8_skinny_gemm")[0]
    yield "fp8.BLOCKS_PER_WARP", fp8.BLOCKS_PER_WARP, int(re.search(r"\bU = (\d+);", _source("fp8.cu"))[1])
    yield "gemm.SKINNY_UNIT", gemm.SKINNY_UNIT, constants("skinny.cu")["kUnit"]
    yield "gemm_fp8.TILE_N", gemm_fp8.TILE_N, constants("gemm_fp8.cu")["kTileN"]
    yield "gemm_fp8.WARPGROUP_ROWS", gemm_fp8.WARPGROUP_ROWS, constants("gemm_fp8.cu")["kWgRows"]
    yield "hc.THREADS", hc.THREADS, hcs["kHcThreads"]
    yield "hc.TOK", hc.TOK, hcs["kHcTok"]
    yield "hc.DECODE_THREADS", hc.DECODE_THREADS, hcs["kPreThreads"]
    yield "hc.HCS", set(hc.HCS), {int(a) for a in template_args("hc.cu", "hc_pre", 1)}
    yield "hc.HCS (mma)", set(hc.HCS), {int(a) for a in template_args("hc_mma.cu", "hc_project_mma", 0)}
    pm = constants("hc_mma.cu")
    yield "hc.PROJECT_TOKENS", hc.PROJECT_TOKENS, pm["kPmTokens"]
    yield "hc.PROJECT_K", hc.PROJECT_K, pm["kPmK"]
    yield "hc.PROJECT_STAGES", hc.PROJECT_STAGES, pm["kPmStages"]
    yield "hc.PROJECT_THREADS", hc.PROJECT_THREADS, launch_bounds("hc_mma.cu", "hc_project_mma")[0]
    yield "hc.DECODE_THREADS (finish)", hc.DECODE_THREADS, launch_bounds("hc.cu", "hc_pre_finish")[0]
    yield "hc.DECODE_TOKENS", set(hc.DECODE_TOKENS), {int(a) for a in template_args("hc.cu", "hc_pre_decode", 2)}
    yield "moe.MAX_EXPERTS", moe.MAX_EXPERTS, mo["kMaxExperts"]
    yield "moe.MAX_ACTIVE", moe.MAX_ACTIVE, mo["kMaxActive"]
    yield "moe.TILE_N", moe.TILE_N, mo["kTileN"]
    yield "moe.GEMM_THREADS", moe.GEMM_THREADS, mo["kGemmThreads"]
    yield "moe.SKINNY_ROWS", moe.SKINNY_ROWS, mo["kSkinnyRows"]
    yield "moe.SKINNY_WARPS", moe.SKINNY_WARPS, mo["kSkinnyWarps"]
    yield "moe.SKINNY_W", moe.SKINNY_W, mo["kSkinnyW"]
    for name in ("ROWS", "COLS", "K", "STAGES", "WARPS"):
        yield f"moe.MMA_{name}", getattr(moe, f"MMA_{name}"), mma[f"kMma{name.title()}"]
    yield "moe.MMA_SHARED", moe.MMA_SHARED, mma["kMmaStages"] * mma["kMmaStageElems"] * 2
    yield "moe_gemm_mma threads", 32 * moe.MMA_WARPS, launch_bounds("moe_mma.cu", "moe_gemm_mma")[0]
    yield "moe_fp4.TILE_ROWS", moe_fp4.TILE_ROWS, fp4["kFp4Rows"]
    yield "moe_fp4.BLOCK", moe_fp4.BLOCK, fp4["kFp4Block"]
    yield "moe_fp4.MAX_WARPS", moe_fp4.MAX_WARPS, fp4["kFp4MaxWarps"]
    yield "moe_fp4.IN_FLIGHT", moe_fp4.IN_FLIGHT, fp4["kFp4InFlight"]
    f8 = constants("moe_wgmma_fp8.cu")
    for name, cuda in (("COLS", "Cols"), ("THREADS", "Threads"), ("STAGES", "Stages"), ("PRODUCERS", "Producers"),
                       ("SHARED", "Shared"), ("MULTIPLE", "K")):
        yield f"moe_fp4.FP8_{name}", getattr(moe_fp4, f"FP8_{name}"), f8[f"kF8{cuda}"]
    yield "moe.WGMMA_ROWS (fp8 experts)", moe.WGMMA_ROWS, f8["kF8Rows"]
    yield "moe_fp8_wgmma threads", moe_fp4.FP8_THREADS, launch_bounds("moe_wgmma_fp8.cu", "moe_fp8_wgmma")[0]
    yield "sample.THREADS", sample.THREADS, launch_bounds("sample.cu", "sample_tokens")[0]
    yield "sample.CLUSTERS", {c for _, c in sample.CLUSTERS} | {1}, {int(a) for a in template_args("sample.cu", "sample_tokens", 0)}
    yield "entries.KV_BLOCK", entries.KV_BLOCK, constants("kv_fp8.cuh")["kKvBlock"]
    yield "entries.FP4_BLOCK", entries.FP4_BLOCK, constants("indexer_fp4.cuh")["kFp4Block"]


FACTS = list(_facts())


@pytest.mark.parametrize("name, python, cuda", FACTS, ids=[f[0] for f in FACTS])
def test_python_copy_equals_the_cuda_source(name, python, cuda):
    assert python == cuda


def _device_function(file: str, name: str) -> tuple[list[str], list[tuple[str, str]], str]:
    """Parameters, `const int` locals and returned expression of a small `int name(int a, ...) { return EXPR; }`."""
    m = re.search(r"int " + name + r"\(([^)]*)\) \{(.*?)\n?\s*return ([^;]+);\s*\}", _source(file), re.DOTALL)
    assert m, f"{name} not found in {file}"
    params = [p.split()[-1] for p in m[1].split(",")]
    lets = re.findall(r"const int (\w+) = ([^;]+);", m[2])
    return params, lets, m[3]


def _call(file: str, name: str, consts: dict, *args: int) -> int:
    params, lets, expr = _device_function(file, name)
    names = dict(consts, **dict(zip(params, args)))
    for let, value in lets:
        names[let] = _c_eval(value, names)
    return _c_eval(expr, names)


@pytest.mark.parametrize("head_dim, rope_dim", [(512, 64), (64, 16), (32, 16), (128, 64), (576, 64), (520, 8)])
def test_main_cache_entry_layout_matches_kv_fp8_cuh(head_dim, rope_dim):
    consts = constants("kv_fp8.cuh")
    want = _call("kv_fp8.cuh", "kv_fp8_bytes", consts, head_dim, rope_dim)
    assert entries.kv_entry_bytes(ml_dtypes.bfloat16, head_dim, rope_dim, fp8_kv=True) == want
    assert entries.kv_entry_bytes(np.float32, head_dim, rope_dim, fp8_kv=True) == 4 * head_dim  # unpacked build


@pytest.mark.parametrize("dim", [16, 32, 64, 100, 128, 160])
def test_indexer_entry_layout_matches_indexer_fp4_cuh(dim):
    want = _call("indexer_fp4.cuh", "fp4_entry_bytes", constants("indexer_fp4.cuh"), dim)
    assert entries.indexer_entry_bytes(ml_dtypes.bfloat16, dim, fp4_keys=True) == want
    assert entries.indexer_entry_bytes(np.float32, dim, fp4_keys=True) == want
