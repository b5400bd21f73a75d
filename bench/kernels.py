"""Each kernel of the bf16 GPU forward at Flash sizes, decode batches 1, 8, 64 and contexts 4K, 64K:
time, achieved GB/s and TFLOP/s, and the fraction of the measured ceilings (device copy bandwidth,
cuBLAS bf16 matrix rate).

usage: python bench/kernels.py [--batches 1,8,64] [--contexts 4096,65536] [--reps 20] [--only moe,hc_pre]
    [--prefill 8192]
(--only: the kernels whose names start with one of these prefixes.) The MoE rows also run at a prefill step of
--prefill tokens, where the grouped GEMMs take the tensor cores (moe_wgmma.cu, and moe_mma.cu beside it; the released
formats' experts moe_wgmma_fp8.cu), and so do prefill attention and the indexer, their step ending at each context.
Bytes count each input read once and each output written once (METHOD.md). Weights and caches hold
random values tiled from one random block; expert weights a constant (12.9 GB of them).
Prints a table and writes bench/results/kernels.json.
"""
import argparse
import itertools
import statistics

import ml_dtypes
import numpy as np

from results import save
from dsv4rt.cuda import ops
from dsv4rt.cuda.build import WGMMA_ARCH
from dsv4rt.cuda.device import Event, Graph
from dsv4rt.cuda.driver import check, drv
from dsv4rt.cuda.runtime import Runtime
from dsv4rt.model import attention as attn_k, compress as comp_k, fp8 as fp8_k, gemm_fp8, hc as hc_k
from dsv4rt.model.gemm import Blas, grouped_linear, linear
from dsv4rt.model.moe import ExpertWeights, MoE, MoeDims, pointer_table, workspace_bytes
from dsv4rt.kv.entries import indexer_entry_bytes, packed_kv_bytes
from dsv4rt.model.paged import PagedCache
from dsv4rt.model.sample import sample

BF16, F32 = np.dtype(ml_dtypes.bfloat16), np.dtype(np.float32)
D, H, HD, RD, QL, G, OL, W = 4096, 64, 512, 64, 1024, 8, 1024, 128
NI, DI, TOPK, E, K_ACT, INTER, HC, V = 64, 128, 512, 256, 6, 2048, 4, 129280
RANDOM = 64 << 20


class Bench:
    def __init__(self, rt, reps: int, only: list[str]):
        self.rt, self.reps, self.rows, self.only = rt, reps, [], only
        self.dev, self.st = rt.device, rt.stream
        self.block = rt.arena.alloc(RANDOM)
        rng = np.random.default_rng(0)
        self.block.copy_from_host((rng.standard_normal(RANDOM // 2, np.float32) * 0.05).astype(BF16))

    def buf(self, nbytes: int, fill: bool = True):
        """Arena memory tiled with the random block (bf16 values ~ N(0, 0.05))."""
        b = self.rt.arena.alloc(nbytes)
        for at in range(0, nbytes if fill else 0, RANDOM):
            check(drv().cuMemcpyDtoDAsync(b.ptr + at, self.block.ptr, min(RANDOM, nbytes - at), self.st.handle))
        return b

    def host(self, array: np.ndarray):
        b = self.rt.arena.alloc(array.nbytes)
        b.copy_from_host(np.ascontiguousarray(array))
        return b

    def time(self, run) -> float:
        """Median seconds of one call, from a graph of `reps` calls replayed 5 times."""
        run(self.st)
        graph = Graph(self.st)
        with graph:
            for _ in range(self.reps):
                run(self.st)
        times = []
        for _ in range(5):
            a, b = Event(), Event()
            self.st.record(a)
            graph.replay()
            self.st.record(b)
            b.synchronize()
            times.append(a.elapsed_ms(b) / 1e3 / self.reps)
        graph.close()
        return statistics.median(times)

    def wants(self, name: str) -> bool:
        return not self.only or any(name.startswith(p) for p in self.only)

    def record(self, name, batch, ctx, run, nbytes, flops=0.0):
        if not self.wants(name):
            return
        try:
            t = self.time(run)
        except Exception as e:  # one kernel failing must not hide the others' numbers
            print(f"{name:28s} B={batch:<3d} ctx={ctx:<6d} failed: {e}")
            return
        self.rows.append(dict(kernel=name, batch=batch, context=ctx, us=t * 1e6, gbps=nbytes / t / 1e9,
                              tflops=flops / t / 1e12))


def matrix_rate(b: Bench, blas: Blas) -> float:
    """cuBLAS bf16 8192³ on random data, TFLOP/s (the matrix ceiling)."""
    m = 8192
    x, w, y = b.buf(m * m * 2), b.buf(m * m * 2), b.buf(m * m * 2, fill=False)
    mm = b.time(linear(blas, BF16, x.ptr, w.ptr, y.ptr, m, m, m))
    for z in (x, w, y):
        z.free()
    return 2 * m ** 3 / mm / 1e12


def paged(b: Bench, requests: int, entries: int, per_page: int, entry_bytes: int, held_from: int = 0):
    """A cache of `entries` entries per request, pages scattered in one random-filled pool; columns
    before `held_from` are not held (-1), as a sliding window's."""
    cols = -(-entries // per_page)
    page = per_page * entry_bytes
    pool = b.buf(requests * (cols - held_from) * page)
    order = np.random.default_rng(requests + entries).permutation(requests * (cols - held_from))
    table = np.full((requests, cols), -1, np.int64)
    table[:, held_from:] = (order * page).reshape(requests, cols - held_from)
    return PagedCache(pool.ptr, b.host(table.reshape(-1)).ptr,
                      b.host(np.arange(requests, dtype=np.int32) * cols).ptr, per_page, entry_bytes), pool


def per_batch(b: Bench, blas: Blas, B: int):
    T = BF16.itemsize
    x, y = b.buf(B * D * 2), b.buf(B * D * 2, fill=False)
    w = b.host(np.ones(D, np.float32))
    b.record("rmsnorm", B, 0, ops.rmsnorm(b.dev, BF16, y.ptr, x.ptr, w.ptr, B, D, 1e-6), 2 * B * D * T + D * 4)
    X = b.buf(B * HC * D * T)
    fn, base, scale = b.host(np.random.default_rng(1).standard_normal(((2 + HC) * HC, HC * D), np.float32) * 0.01), \
        b.host(np.zeros((2 + HC) * HC, np.float32)), b.host(np.ones(3, np.float32))
    post, comb = b.buf(B * HC * 4, fill=False), b.buf(B * HC * HC * 4, fill=False)
    ws = b.host(np.zeros(hc_k.pre_workspace_bytes(B, HC, D), np.uint8))
    hc_args = (y.ptr, post.ptr, comb.ptr, X.ptr, fn.ptr, base.ptr, scale.ptr, B, HC, D, 1e-6, 1e-6, 20)
    # fn stays in L2 across the graph's calls here; in a decode step it comes from HBM.
    b.record("hc_pre", B, 0, hc_k.pre(b.dev, BF16, *hc_args, workspace=ws.ptr), B * HC * D * T + fn.nbytes + B * D * T)
    b.record("hc_pre +norm", B, 0, hc_k.pre(b.dev, BF16, *hc_args, xn=x.ptr, norm=w.ptr, norm_eps=1e-6,
                                            workspace=ws.ptr), B * HC * D * T + fn.nbytes + 2 * B * D * T + D * 4)
    b.record("hc_post", B, 0, hc_k.post(b.dev, BF16, X.ptr, X.ptr, x.ptr, post.ptr, comb.ptr, B, HC, D),
             2 * B * HC * D * T + B * D * T)
    gemms = [("gemm wq_a 4096>1024", D, QL, BF16, 1), ("gemm wq_b 1024>32768", QL, H * HD, BF16, 1),
             ("gemm wkv 4096>512", D, HD, BF16, 1), ("gemm compressor 4096>1024 f32", D, 2 * HD, F32, 1),
             ("gemm compressor 4096>256 f32", D, 2 * DI, F32, 1),
             ("gemm indexer wq_b 1024>8192", QL, NI * DI, BF16, 1), ("gemm weights_proj 4096>64 f32", D, NI, F32, 1),
             ("gemm wo_b 8192>4096", G * OL, D, BF16, 1), ("gemm wo_a grouped 8x4096>1024", H * HD // G, OL, BF16, G),
             ("gemm head 4096>129280 f32", D, V, F32, 1)]
    cublas = Blas(b.rt.arena)
    for name, k, n, out, groups in filter(lambda g: b.wants(g[0]), gemms):
        for suffix, lib in (("", blas), (" cublas", cublas)):
            gemm_row(b, lib, name + suffix, B, k, n, out, groups)
    cublas.close()
    # Faithful fp8 linears: the activation quantiser, then the GEMM on e4m3 weight bytes (random bytes: the
    # time does not depend on the values) with e8m0 tile scales. B > 16 reads the weight once per 16 rows.
    fp8s = [("fp8 wq_a 4096>1024", D, QL), ("fp8 wq_b 1024>32768", QL, H * HD), ("fp8 wkv 4096>512", D, HD),
            ("fp8 wo_b 8192>4096", G * OL, D)]
    for name, k, n in filter(lambda g: b.wants(g[0]), fp8s):
        kb = -(-k // 128)
        xa, xq, xs = b.buf(B * k * T), b.buf(B * k, fill=False), b.buf(B * kb, fill=False)
        wq, ws, ya = b.buf(n * k), b.host(np.full((-(-n // 128), kb), 120, np.uint8)), b.buf(B * n * T, fill=False)
        b.record(f"{name} act_quant", B, 0, fp8_k.act_quant(b.dev, BF16, xq.ptr, xs.ptr, xa.ptr, B, k),
                 B * (k * T + k + kb))
        b.record(name, B, 0, fp8_k.skinny_gemm(b.dev, BF16, ya.ptr, xq.ptr, xs.ptr, wq.ptr, ws.ptr, B, n, k),
                 n * k + ws.nbytes + B * (k + kb + n * T), 2 * B * n * k)
        for z in (xa, xq, xs, ya, wq, ws):
            z.free()
    if b.wants("fp8 wo_a"):  # W8A16: the attention output unquantised, e4m3 weight bytes widened in registers
        k, n = H * HD // G, G * OL
        xa, wq, ya = b.buf(B * G * k * T), b.buf(n * k), b.buf(B * n * T, fill=False)
        ws = b.host(np.full((n // 128, -(-k // 128)), 120, np.uint8))
        b.record("fp8 wo_a grouped 8x4096>1024 w8a16", B, 0,
                 fp8_k.skinny_gemm(b.dev, BF16, ya.ptr, xa.ptr, 0, wq.ptr, ws.ptr, B, n, k, in_dtype=BF16, group_n=OL),
                 n * k + ws.nbytes + B * (G * k + n) * T, 2 * B * n * k)
        wa = b.buf(n * k * T, fill=False)   # the prefill form: expanded to bf16 for cuBLAS
        b.record("fp8 wo_a dequantize", B, 0, fp8_k.dequantize(b.dev, BF16, wa.ptr, wq.ptr, ws.ptr, n, k),
                 n * k * (1 + T) + ws.nbytes)
        for z in (xa, ya, wq, ws, wa):
            z.free()
    if b.wants("moe"):
        moe(b, blas, B)
    if b.wants("sample"):
        sample_rows(b, B)


# Prefill fp8 linears on the wgmma kernel (gemm_fp8), inputs already quantised (act_quant is a row per batch above):
# random bytes, whose values do not change the time. TFLOP/s are printed against H200's dense fp8 peak as well as
# the table's fraction of the measured bf16 rate.
FP8_DENSE_TFLOPS = 1580.0
BF16_DENSE_TFLOPS = 790.0
PREFILL_TOKENS = 8192
PREFILL_ROWS = (128, 1024, 4096)


def fp8_prefill(b: Bench):
    shapes = [("fp8 prefill wq_a 4096>1024", D, QL), ("fp8 prefill wq_b 1024>32768", QL, H * HD),
              ("fp8 prefill wo_b 8192>4096", G * OL, D), ("fp8 prefill shared w1 4096>2048", D, INTER)]
    shapes = [s for s in shapes if b.wants(s[0])]
    if shapes and b.dev.arch != WGMMA_ARCH:
        print(f"fp8 prefill rows skipped: the wgmma kernel needs {WGMMA_ARCH}, this is {b.dev.arch}")
        return
    for name, k, n in shapes:
        kb = k // 128
        wq, ws = b.buf(n * k), b.host(np.full((n // 128, kb), 120, np.uint8))
        for m in PREFILL_ROWS:
            xq, xs, y = b.buf(m * k), b.host(np.full((m, kb), 127, np.uint8)), b.buf(m * n * 2, fill=False)
            run = gemm_fp8.fp8_gemm(b.dev, xq.ptr, xs.ptr, wq.ptr, ws.ptr, y.ptr, m, n, k, BF16)
            before = len(b.rows)
            b.record(name, m, 0, run, m * k + n * k + xs.nbytes + ws.nbytes + 2 * m * n, 2 * m * n * k)
            if len(b.rows) > before:
                print(f"{name:34s} m={m:<5d} {b.rows[-1]['tflops']:7.1f} TFLOP/s = "
                      f"{b.rows[-1]['tflops'] / FP8_DENSE_TFLOPS:.3f} of dense fp8 ({FP8_DENSE_TFLOPS:.0f})")
            for z in (xq, xs, y):
                z.free()
        wq.free()
        ws.free()


def sample_rows(b: Bench, B: int):
    """Sampling at T 0.7 on chat-like logits: 20 plausible tokens well above a long N(0, 2.5) tail, so most of the
    vocabulary is in the pool and few tokens pass the cut; "flat": the random block (≈ N(0, 0.05)), the cut deep."""
    rng = np.random.default_rng(1)
    chat = rng.standard_normal((B, V), np.float32) * 2.5
    for r in range(B):
        chat[r, rng.choice(V, 20, replace=False)] += rng.uniform(8, 16, 20).astype(np.float32)
    logits, flat = b.host(chat), b.buf(B * V * 4)
    seed, step, out = b.host(np.arange(B, dtype=np.uint64)), b.host(np.zeros(B, np.uint64)), b.buf(B * 4, fill=False)
    for name, rows, top_k, top_p in (("sample top-p", logits, 0, 0.9), ("sample top-k", logits, 50, 1.0),
                                     ("sample top-p flat", flat, 0, 0.9)):
        temp, topk, topp = (b.host(np.full(B, v, t)) for v, t in ((0.7, np.float32), (top_k, np.int32),
                                                                  (top_p, np.float32)))
        b.record(name, B, 0, sample(b.dev, out.ptr, rows.ptr, B, V, temp.ptr, topk.ptr, topp.ptr, seed.ptr, step.ptr),
                 B * V * 4)
        for z in (temp, topk, topp):
            z.free()
    for z in (logits, flat, seed, step, out):
        z.free()


def gemm_row(b: Bench, blas: Blas, name: str, B: int, k: int, n: int, out, groups: int):
    """y [B, groups, n] = x [B, groups, k] · w[g]ᵀ as gemm.linear or grouped_linear run it (the skinny kernel for
    small B when `blas` has the device, else cuBLAS). Calls rotate over copies of the weight filling 256 MB, so
    that the larger ones come from HBM as in a decode step rather than from L2."""
    T, wbytes = BF16.itemsize, groups * n * k * BF16.itemsize
    copies = max(1, min(b.reps, (256 << 20) // wbytes))
    xa, wa, ya = b.buf(B * groups * k * T), b.buf(copies * wbytes), b.buf(B * groups * n * out.itemsize, fill=False)
    if groups == 1:
        runs = [linear(blas, BF16, xa.ptr, wa.ptr + c * wbytes, ya.ptr, B, n, k, out) for c in range(copies)]
    else:
        runs = [grouped_linear(blas, BF16, xa.ptr, wa.ptr + c * wbytes, ya.ptr, B, groups, n, k, out)
                for c in range(copies)]
    turn = itertools.cycle(runs)
    b.record(name, B, 0, lambda st: next(turn)(st), wbytes + B * groups * (k * T + n * out.itemsize),
             2 * B * groups * n * k)
    for z in (xa, wa, ya):
        z.free()


def moe(b: Bench, blas: Blas, B: int):
    T = BF16.itemsize
    rng = np.random.default_rng(B)
    xh = (rng.standard_normal((B, D)) * 0.5).astype(BF16)
    gate_h = (rng.standard_normal((E, D)) / np.sqrt(D)).astype(BF16)
    bias_h = (0.1 * rng.standard_normal(E)).astype(np.float32)
    s = np.sqrt(np.logaddexp(0, xh.astype(np.float32) @ gate_h.astype(np.float32).T)) + bias_h
    touched = len(np.unique(np.argpartition(-s, K_ACT - 1, axis=1)[:, :K_ACT]))
    per = INTER * D
    experts = b.rt.arena.alloc(E * 3 * per * T)
    check(drv().cuMemsetD16Async(experts.ptr, 0x3C00, E * 3 * per, b.st.handle))  # bf16 0.0078: not zeros
    tables = [pointer_table(b.rt.arena, [experts.ptr + (3 * e + m) * per * T for e in range(E)]) for m in range(3)]
    shared = b.buf(3 * per * T)
    dims = MoeDims(B, D, INTER, E, K_ACT, INTER)
    ws = b.rt.arena.alloc(workspace_bytes(dims, BF16))
    x, y = b.host(xh), b.buf(B * D * T, fill=False)
    def layer(path=None):
        return MoE(b.dev, blas, BF16, dims, x=x.ptr, y=y.ptr, gate=b.host(gate_h).ptr,
                   routed=ExpertWeights(*(t.ptr for t in tables)),
                   shared=ExpertWeights(shared.ptr, shared.ptr + per * T, shared.ptr + 2 * per * T), scaling=1.5,
                   limit=10.0, workspace=ws.ptr, bias=b.host(bias_h).ptr, path=path)
    run = layer()
    weights = (touched + 1) * 3 * per * T
    b.record(f"moe 256x2048 top-6 ({touched} experts)", B, 0, run, weights + gate_h.nbytes + 2 * B * D * T,
             2 * B * (K_ACT + 1) * 3 * per)
    # The grouped expert GEMMs alone, after a whole run of the layer has left its sort in the workspace; the skinny
    # kernel carries the shared expert, the others leave it to cuBLAS. wgmma is timed beside the mma.sync kernel.
    for r in [run] + ([layer("mma")] if run.path == "wgmma" else []):
        r(b.st)
        skinny = r.path == "skinny"
        name = f"moe grouped gemms ({r.path})"
        before = len(b.rows)
        b.record(name, B, 0, lambda st, r=r: [launch(st) for launch in r.grouped], weights,
                 2 * B * (K_ACT + skinny) * 3 * per)
        if not skinny and len(b.rows) > before:
            print(f"{name:34s} B={B:<5d} {b.rows[-1]['tflops']:7.1f} TFLOP/s = "
                  f"{b.rows[-1]['tflops'] / BF16_DENSE_TFLOPS:.3f} of dense bf16 ({BF16_DENSE_TFLOPS:.0f})")
    experts.free()


def moe_released(b: Bench, blas: Blas, B: int):
    """The MoE layer on the released formats (moe_fp4.Fp4MoE) at a prefill step of B tokens, and its routed expert
    GEMMs alone (moe_fp8_wgmma on sm_90a): packed e2m1 experts of constant codes and scales, an e4m3 shared expert."""
    from dsv4rt.model.moe_fp4 import Fp4Experts, Fp4MoE, Fp8Expert, workspace_bytes as fp4_workspace
    rng = np.random.default_rng(B + 1)
    xh = (rng.standard_normal((B, D)) * 0.5).astype(BF16)
    gate_h = (rng.standard_normal((E, D)) / np.sqrt(D)).astype(BF16)
    bias_h = (0.1 * rng.standard_normal(E)).astype(np.float32)
    packed, scales = INTER * D // 2, INTER * D // 32  # bytes of one matrix and of its scales
    experts, expert_scales = b.rt.arena.alloc(E * 3 * packed), b.rt.arena.alloc(E * 3 * scales)
    check(drv().cuMemsetD8Async(experts.ptr, 0x2A, E * 3 * packed, b.st.handle))  # codes 1.0 and -1.0
    check(drv().cuMemsetD8Async(expert_scales.ptr, 120, E * 3 * scales, b.st.handle))
    tables = [pointer_table(b.rt.arena, [base.ptr + (3 * e + m) * size for e in range(E)])
              for base, size in ((experts, packed), (expert_scales, scales)) for m in range(3)]
    shared = b.rt.arena.alloc(3 * INTER * D + 3 * (INTER // 128) * (D // 128))
    check(drv().cuMemsetD8Async(shared.ptr, 0x30, 3 * INTER * D, b.st.handle))  # e4m3 0.5
    check(drv().cuMemsetD8Async(shared.ptr + 3 * INTER * D, 120, 3 * (INTER // 128) * (D // 128), b.st.handle))
    s_at = [shared.ptr + m * INTER * D for m in range(3)] + \
        [shared.ptr + 3 * INTER * D + m * (INTER // 128) * (D // 128) for m in range(3)]
    dims = MoeDims(B, D, INTER, E, K_ACT, INTER)
    ws = b.rt.arena.alloc(fp4_workspace(dims, BF16))
    x, y = b.host(xh), b.buf(B * D * BF16.itemsize, fill=False)
    layer = Fp4MoE(b.dev, blas, BF16, dims, x=x.ptr, y=y.ptr, gate=b.host(gate_h).ptr,
                   routed=Fp4Experts(*(t.ptr for t in tables)), shared=Fp8Expert(*s_at), scaling=1.5, limit=10.0,
                   workspace=ws.ptr, bias=b.host(bias_h).ptr)
    routed_flops = 2 * B * K_ACT * 3 * INTER * D
    b.record(f"moe released top-6 ({layer.path})", B, 0, layer, E * 3 * (packed + scales), routed_flops +
             2 * B * 3 * INTER * D)
    grouped = [launch for launch in layer.launches if getattr(launch, "kernel", None) is not None
               and launch.kernel.name.startswith("moe_fp8_wgmma")]
    if grouped:
        layer(b.st)  # leaves the sort in the workspace
        name = "moe released grouped gemms (fp8)"
        before = len(b.rows)
        b.record(name, B, 0, lambda st: [launch(st) for launch in grouped], E * 3 * (packed + scales), routed_flops)
        if len(b.rows) > before:
            print(f"{name:34s} B={B:<5d} {b.rows[-1]['tflops']:7.1f} TFLOP/s = "
                  f"{b.rows[-1]['tflops'] / FP8_DENSE_TFLOPS:.3f} of dense fp8 ({FP8_DENSE_TFLOPS:.0f})")
    for z in (experts, expert_scales, shared, ws, x, y, *tables):
        z.free()


def per_context(b: Bench, B: int, C: int):
    T = BF16.itemsize
    rng = np.random.default_rng(C + B)
    pos, req = b.host(np.full(B, C, np.int32)), b.host(np.arange(B, dtype=np.int32))
    inv = b.host((160000.0 ** (-np.arange(0, RD, 2) / RD)).astype(np.float32))
    sink = b.host(rng.standard_normal(H).astype(np.float32))
    q, o = b.buf(B * H * HD * T), b.buf(B * H * HD * T, fill=False)
    window, _ = paged(b, B, C + 1, 64, HD * T, held_from=(C + 1 - W) // 64)
    n4, n128 = (C + 1) // 4, (C + 1) // 128
    c4a, _ = paged(b, B, n4, 64, HD * T)
    c128a, _ = paged(b, B, n128, 2, HD * T)
    sel = np.sort(np.stack([rng.choice(n4, TOPK, replace=False) for _ in range(B)]), axis=1).astype(np.int32)
    selected = b.host(sel)
    for mode, cache, chosen, ratio, keys in (("c4a", c4a, selected.ptr, 4, W + TOPK), ("c128a", c128a, None, 128, W + n128),
                                             ("sliding", None, None, 0, W)):
        splits = attn_k.attention_splits(B, H, keys, BF16, b.dev.sm_count)   # as GpuModel chooses
        ws = b.rt.arena.alloc(max(16, attn_k.attention_workspace_bytes(B, H, HD, splits)))
        run = attn_k.sparse_attention(b.dev, BF16, o.ptr, q.ptr, pos.ptr, req.ptr, sink.ptr, inv.ptr, window, cache,
                                      chosen, rows=B, heads=H, head_dim=HD, rope_dim=RD, window_size=W, ratio=ratio,
                                      top_k=TOPK if chosen else 0, splits=splits, workspace=ws.ptr)
        b.record(f"attention decode {mode}", B, C, run, B * keys * HD * T + 2 * B * H * HD * T,
                 4 * B * H * keys * HD)
        # The tensor-core kernel at its own splits (with attention_combine, then alone); at batch 1 also other
        # splits, to tune attention_mqa_splits.
        default = attn_k.attention_mqa_splits(B, H, keys, b.dev.sm_count)
        for z in sorted({default, *((1, 5, 10, 20, 40) if B == 1 and mode == "c4a" else ())}):
            ws = b.rt.arena.alloc(max(16, attn_k.attention_workspace_bytes(B, H, HD, z)))
            run = attn_k.sparse_attention_mqa(b.dev, BF16, o.ptr, q.ptr, pos.ptr, req.ptr, sink.ptr, inv.ptr, window,
                                              cache, chosen, rows=B, heads=H, head_dim=HD, rope_dim=RD, window_size=W,
                                              ratio=ratio, top_k=TOPK if chosen else 0, splits=z, workspace=ws.ptr)
            name = f"attention mqa decode {mode}" + ("" if z == default else f" splits={z}")
            b.record(name, B, C, run, B * keys * HD * T + 2 * B * H * HD * T, 4 * B * H * keys * HD)
            if z > 1 and z == default:
                b.record(name + " kernel", B, C, run.launches[0], B * keys * HD * T + B * H * HD * T,
                         4 * B * H * keys * HD)
            ws.free()
    keys_cache, _ = paged(b, B, n4, 64, DI * T)
    qi, wi = b.buf(B * NI * DI * T), b.host(rng.standard_normal((B, NI)).astype(np.float32))
    scores, out = b.buf(B * n4 * 4, fill=False), b.buf(B * TOPK * 4, fill=False)
    run = comp_k.indexer_select(b.dev, BF16, out.ptr, scores.ptr, qi.ptr, wi.ptr, keys_cache, pos.ptr, req.ptr, rows=B,
                                heads=NI, head_dim=DI, topk=TOPK, n_max=n4, ratio=4, inv_freq=inv.ptr, rope_dim=RD)
    b.record("indexer scores + top-512", B, C, run, B * n4 * DI * T + 2 * B * n4 * 4 + B * TOPK * 4,
             2 * B * n4 * NI * DI)
    score, select = run.launches   # each alone; the top-k reads the scores the runs above left
    b.record("indexer scores", B, C, score, B * n4 * DI * T + B * n4 * 4, 2 * B * n4 * NI * DI)
    b.record("indexer top-512", B, C, select, B * n4 * 4 + B * TOPK * 4)


def hc_prefill(b: Bench, T: int):
    """hc_pre with its norm over a prefill step of T tokens; the bytes it moves: the streams twice (projection, then
    the finish), u and the normed input."""
    E2 = BF16.itemsize
    X, u, xn = b.buf(T * HC * D * E2), b.buf(T * D * E2, fill=False), b.buf(T * D * E2, fill=False)
    fn = b.host(np.random.default_rng(1).standard_normal(((2 + HC) * HC, HC * D), np.float32) * 0.01)
    w, base, scale = b.host(np.ones(D, np.float32)), b.host(np.zeros((2 + HC) * HC, np.float32)), \
        b.host(np.ones(3, np.float32))
    post, comb = b.buf(T * HC * 4, fill=False), b.buf(T * HC * HC * 4, fill=False)
    ws = b.host(np.zeros(hc_k.pre_workspace_bytes(T, HC, D), np.uint8))
    run = hc_k.pre(b.dev, BF16, u.ptr, post.ptr, comb.ptr, X.ptr, fn.ptr, base.ptr, scale.ptr, T, HC, D, 1e-6, 1e-6,
                   20, xn=xn.ptr, norm=w.ptr, norm_eps=1e-6, workspace=ws.ptr)
    b.record("hc_pre prefill +norm", T, 0, run, 2 * T * HC * D * E2 + 2 * T * D * E2, 2 * T * HC * D * (2 + HC) * HC)


def fp8_entries(rng, n: int, hd: int, rd: int) -> np.ndarray:
    """n faithful-mode KV entries (kv_entry layout: e4m3 codes, bf16 rope dims, e8m0 scales, padding) of random
    values, none of them NaN."""
    nope, size = hd - rd, packed_kv_bytes(hd, rd)
    e = np.zeros((n, size), np.uint8)
    e[:, :nope] = rng.integers(0, 0x7F, (n, nope)) | rng.integers(0, 2, (n, nope)) << 7   # 0x7f, 0xff: NaN
    e[:, nope:nope + 2 * rd] = (rng.standard_normal((n, rd)) * 0.05).astype(BF16).view(np.uint8)
    e[:, nope + 2 * rd:nope + 2 * rd + -(-nope // 64)] = rng.integers(120, 128, (n, -(-nope // 64)))
    return e.reshape(-1)


def per_prefill(b: Bench, T: int, C: int):
    """A prefill step of T tokens of one request, positions C − T … C − 1: sparse attention (the tensor-core
    kernel; the step's own window keys from its rows, earlier ones from the cache) per layer kind, and the
    indexer. FLOPs count the keys each row attends to or scores."""
    E2 = BF16.itemsize
    rng = np.random.default_rng(C + T)
    p = np.arange(C - T, C, dtype=np.int32)
    pos, req = b.host(p), b.host(np.zeros(T, np.int32))
    inv = b.host((160000.0 ** (-np.arange(0, RD, 2) / RD)).astype(np.float32))
    sink = b.host(rng.standard_normal(H).astype(np.float32))
    q, o, rows = b.buf(T * H * HD * E2), b.buf(T * H * HD * E2, fill=False), b.buf(T * HD * E2)
    window, _ = paged(b, 1, C, 64, HD * E2, held_from=max(0, C - T - W + 1) // 64)
    n4, n128 = C // 4, C // 128
    c4a, _ = paged(b, 1, n4, 64, HD * E2)
    c128a, _ = paged(b, 1, max(1, n128), 2, HD * E2)
    visible4, visible128 = (p + 1) // 4, (p + 1) // 128
    sel = np.full((T, TOPK), -1, np.int32)
    for t, v in enumerate(visible4):
        sel[t, :min(v, TOPK)] = np.sort(rng.choice(v, min(v, TOPK), replace=False)) if v > TOPK else np.arange(v)
    window_keys = np.minimum(p + 1, W)
    for mode, cache, chosen, ratio, keys in (
            ("c4a", c4a, b.host(sel).ptr, 4, window_keys + np.minimum(visible4, TOPK)),
            ("c128a", c128a, None, 128, window_keys + visible128), ("sliding", None, None, 0, window_keys)):
        run = attn_k.sparse_attention_mqa(b.dev, BF16, o.ptr, q.ptr, pos.ptr, req.ptr, sink.ptr, inv.ptr, window, cache,
                                          chosen, rows=T, heads=H, head_dim=HD, rope_dim=RD, window_size=W,
                                          ratio=ratio, top_k=TOPK if chosen else 0, step_kv=rows.ptr)
        b.record(f"attention prefill {mode}", T, C, run, int(keys.sum()) * HD * E2 + 2 * T * H * HD * E2,
                 4 * H * HD * float(keys.sum()))
    # the faithful build's 584-byte entries (e4m3 nope dims, bf16 rope dims, scales), widened on their way in
    E8 = packed_kv_bytes(HD, RD)
    rows8 = b.buf(T * E8)
    window8, pool_w = paged(b, 1, C, 64, E8, held_from=max(0, C - T - W + 1) // 64)
    c4a8, pool_4 = paged(b, 1, n4, 64, E8)
    c128a8, pool_128 = paged(b, 1, max(1, n128), 2, E8)
    for buf in (rows8, pool_w, pool_4, pool_128):   # entries as the cache holds them: no NaN codes, scales near 1
        buf.copy_from_host(fp8_entries(rng, buf.nbytes // E8, HD, RD))
    for mode, cache, chosen, ratio, keys in (
            ("c4a", c4a8, b.host(sel).ptr, 4, window_keys + np.minimum(visible4, TOPK)),
            ("c128a", c128a8, None, 128, window_keys + visible128), ("sliding", None, None, 0, window_keys)):
        run = attn_k.sparse_attention_mqa(b.dev, BF16, o.ptr, q.ptr, pos.ptr, req.ptr, sink.ptr, inv.ptr, window8,
                                          cache, chosen, rows=T, heads=H, head_dim=HD, rope_dim=RD, window_size=W,
                                          ratio=ratio, top_k=TOPK if chosen else 0, fp8_kv=True, step_kv=rows8.ptr)
        b.record(f"attention prefill fp8 {mode}", T, C, run, int(keys.sum()) * E8 + 2 * T * H * HD * E2,
                 4 * H * HD * float(keys.sum()))
    keys_cache, _ = paged(b, 1, n4, 64, DI * E2)
    qi, wi = b.buf(T * NI * DI * E2), b.host(rng.standard_normal((T, NI)).astype(np.float32))
    scores, out = b.buf(T * n4 * 4, fill=False), b.buf(T * TOPK * 4, fill=False)
    run = comp_k.indexer_select(b.dev, BF16, out.ptr, scores.ptr, qi.ptr, wi.ptr, keys_cache, pos.ptr, req.ptr, rows=T,
                                heads=NI, head_dim=DI, topk=TOPK, n_max=n4, ratio=4, inv_freq=inv.ptr, rope_dim=RD)
    scored = float(visible4.sum())
    b.record("indexer prefill scores + top-512", T, C, run, scored * (DI * E2 + 8) + T * TOPK * 4, 2 * scored * NI * DI)
    score, select = run.launches
    b.record("indexer prefill scores", T, C, score, scored * (DI * E2 + 4), 2 * scored * NI * DI)
    b.record("indexer prefill top-512", T, C, select, scored * 4 + T * TOPK * 4)
    # faithful numerics: q rotated and rounded in place, then scores over 68-byte packed keys
    E4 = indexer_entry_bytes(BF16, DI, True)
    keys4, _ = paged(b, 1, n4, 64, E4)
    run = comp_k.indexer_select(b.dev, BF16, out.ptr, scores.ptr, qi.ptr, wi.ptr, keys4, pos.ptr, req.ptr, rows=T,
                                heads=NI, head_dim=DI, topk=TOPK, n_max=n4, ratio=4, rope_dim=RD, fp4_keys=True)
    rotate, score, _ = run.launches
    b.record("indexer prefill fp4 q", T, C, rotate, 2 * T * NI * DI * E2)
    b.record("indexer prefill fp4 scores", T, C, score, scored * (E4 + 4), 2 * scored * NI * DI)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--contexts", default="4096,65536")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--only", default="", help="comma-separated kernel-name prefixes (default: all)")
    ap.add_argument("--prefill", type=int, default=PREFILL_TOKENS, help="tokens of the prefill step's rows")
    # A driver memcpy inside a graph runs on the copy engines (2.8 TB/s measured): the copy ceiling is a
    # kernel's device-to-device copy, 4.3 TB/s on this H200 (KINDS.md), read plus write.
    ap.add_argument("--copy-gbps", type=float, default=4300.0)
    a = ap.parse_args()
    batches, contexts = [int(v) for v in a.batches.split(",")], [int(v) for v in a.contexts.split(",")]
    with Runtime(arena_bytes=40 << 30) as rt:
        b, blas = Bench(rt, a.reps, [p for p in a.only.split(",") if p]), Blas(rt.arena, rt.device)
        copy, mm = a.copy_gbps, matrix_rate(b, blas)
        fp8_prefill(b)
        if b.wants("moe"):
            moe(b, blas, a.prefill)
        if b.wants("moe released"):
            moe_released(b, blas, a.prefill)
        if b.wants("hc_pre prefill"):
            hc_prefill(b, a.prefill)
        for C in contexts if b.wants("attention prefill") or b.wants("indexer prefill") else []:
            per_prefill(b, a.prefill, max(C, a.prefill))
        for B in batches:
            per_batch(b, blas, B)
            for C in contexts if b.wants("attention") or b.wants("indexer") else []:
                per_context(b, B, C)
    print(f"ceilings: device copy {copy:.0f} GB/s (given), cuBLAS bf16 {mm:.0f} TFLOP/s (measured)")
    print(f"{'kernel':34s} {'B':>3s} {'ctx':>6s} {'us':>9s} {'GB/s':>7s} {'TFLOP/s':>8s} {'of ceiling':>10s}")
    for r in b.rows:
        r["fraction"] = max(r["gbps"] / copy, r["tflops"] / mm)
        print(f"{r['kernel']:34s} {r['batch']:3d} {r['context'] or '':>6} {r['us']:9.1f} {r['gbps']:7.0f} "
              f"{r['tflops']:8.2f} {r['fraction']:10.3f}")
    save("kernels", dict(copy_gbps=copy, bf16_tflops=mm, rows=b.rows), indent=1)


if __name__ == "__main__":
    main()
