"""Mixture of experts for prefill steps with cuBLAS expert GEMMs, opt-in beside moe.MoE (twin:
dsv4rt/reference/moe.py). Gate GEMM → routing → counting sort as in moe.py; then the host reads the per-expert
row offsets back (one synchronisation per call: prefill steps only, never inside a CUDA graph), the routed rows
are gathered into expert order, and the experts' contiguous rows go through cuBLAS: g = x_e·w1ᵀ, u = x_e·w3ᵀ
(fp32), the clamped SwiGLU over all rows at once, out_e = h_e·w2ᵀ, one batched GEMM per matrix for all experts
of equal row count (a handful of calls: ctypes alone takes ~4 us of host time a call); shared expert and
weighted combine as in moe.py."""
from __future__ import annotations

import ctypes
from dataclasses import dataclass

import numpy as np

from ..cuda.arena import ALIGN
from ..cuda.device import Device, Stream
from ..cuda.driver import check, drv
from ..cuda.ops import storage_name
from .gemm import _COMPUTE_32F, _COMPUTE_32F_PEDANTIC, _GEMM_DEFAULT, _OP_N, _OP_T, Blas, _check, _cublas, \
    data_type
from .moe import ExpertWeights, MoeDims, check_layer, combine, kernel, route_and_sort, shared_expert, swiglu
from .moe import _layout as moe_layout


# The address arrays of the expert GEMMs, one entry per busy expert each: weights, then rows of the gathered
# inputs (later the outputs), g, u and the SwiGLU output.
ARRAYS = ("w1", "w3", "w2", "rows", "g", "u", "hidden")


def _layout(d: MoeDims, dtype) -> dict[str, int]:
    """moe.py's scratch arrays plus fp32 g and u [pairs, inter] and the GEMMs' address arrays [ARRAYS, busy
    experts]. The gathered rows live in expert_out: the w1/w3 GEMMs have read them before w2's write there."""
    at = moe_layout(d, dtype)
    f32 = -(-d.pairs * d.inter * 4 // ALIGN) * ALIGN
    pointers = len(ARRAYS) * min(d.experts, d.pairs) * 8
    return dict(at, g=at["total"], u=at["total"] + f32, pointers=at["total"] + 2 * f32,
                total=at["total"] + 2 * f32 + pointers)


def workspace_bytes(dims: MoeDims, dtype) -> int:
    return _layout(dims, dtype)["total"]


@dataclass(frozen=True)
class ExpertAddresses:
    """The routed experts' weight addresses on the host, uint64 [experts] each."""
    w1: np.ndarray
    w3: np.ndarray
    w2: np.ndarray

    @classmethod
    def from_tables(cls, tables: ExpertWeights, experts: int) -> "ExpertAddresses":
        """Read back from moe.pointer_table's device tables (synchronous: once, at load time)."""
        def read(table: int) -> np.ndarray:
            host = np.empty(experts, np.uint64)
            check(drv().cuMemcpyDtoH(host.ctypes.data, table, host.nbytes))
            return host
        return cls(read(tables.w1), read(tables.w3), read(tables.w2))


class BatchedGemm:
    """y_i [m, n] = x_i [m, k]·w_iᵀ for i < count (gemm.linear's product for each), one cublasGemmBatchedEx over
    device arrays of the addresses: all experts with m rows in one call."""

    def __init__(self, blas: Blas, dtype, n: int, k: int, out_dtype):
        in_type, out_type = data_type(dtype), data_type(out_dtype)
        self.blas, self.n, self.k = blas, n, k
        self._gemm = _cublas().cublasGemmBatchedEx
        p, i = ctypes.c_void_p, ctypes.c_int  # gemm._cublas declares the calls it makes; this one is ours
        self._gemm.argtypes, self._gemm.restype = [p, i, i, i, i, i, p, p, i, i, p, i, i, p, p, i, i, i, i, i], i
        self._alpha, self._zero = ctypes.c_float(1.0), ctypes.c_float(0.0)
        self._scalars = ctypes.addressof(self._alpha), ctypes.addressof(self._zero)
        self._types = in_type, out_type, _COMPUTE_32F_PEDANTIC if in_type == 0 else _COMPUTE_32F

    def __call__(self, stream: Stream, w: int, x: int, y: int, m: int, count: int):
        self.blas.use(stream)
        (alpha, beta), (t_in, t_out, compute), n, k = self._scalars, self._types, self.n, self.k
        _check(self._gemm(self.blas.handle, _OP_T, _OP_N, n, m, k, alpha, w, t_in, k, x, t_in, k, beta, y, t_out, n,
                          count, compute, _GEMM_DEFAULT), "cuBLAS batched GEMM")


class PrefillMoE:
    """moe.MoE's y [tokens, dim] = Σ_slot w·expert(x) + shared(x), with `routed` as host addresses and a workspace
    of this module's workspace_bytes(dims, dtype). Each call synchronises `stream` once."""

    def __init__(self, device: Device, blas: Blas, dtype, dims: MoeDims, *, x: int, y: int, gate: int,
                 routed: ExpertAddresses, shared: ExpertWeights | None, scaling: float, limit: float,
                 workspace: int, bias: int | None = None, tid2eid: int | None = None, ids: int | None = None):
        d = dims
        check_layer(d, shared, bias, tid2eid, ids, 8, "16-byte vectors")
        if not len(routed.w1) == len(routed.w3) == len(routed.w2) == d.experts:
            raise ValueError(f"routed addresses for {d.experts} experts")
        t, size = storage_name(dtype), np.dtype(dtype).itemsize
        at = {k: workspace + v for k, v in _layout(d, dtype).items()}
        self.dims, self.scratch, self.routed, self.size = d, at, routed, size
        P, I = ctypes.c_void_p, ctypes.c_int
        # moe_sort's row tiles (64) go unused here.
        self.front = route_and_sort(device, blas, dtype, d, at, x, gate, scaling, 64, bias=bias, tid2eid=tid2eid,
                                    ids=ids)
        # Issued after the synchronisation: the GPU gathers and runs the shared expert while the host issues
        # the routed GEMMs.
        self.middle = [kernel(device, f"moe_gather<{t}>").bind(d.pairs, 256, [
            P(at["expert_out"]), P(x), P(at["perm"]), I(d.active), I(d.dim)])]
        if shared is not None:
            self.middle += shared_expert(device, blas, dtype, d, at, x, shared, limit)
        self.up = BatchedGemm(blas, dtype, d.inter, d.dim, np.float32)
        self.down = BatchedGemm(blas, dtype, d.dim, d.inter, dtype)
        self.swiglu = swiglu(device, dtype, at["hidden"], at["g"], at["u"], d.pairs * d.inter, limit)
        self.combine = combine(device, dtype, d, at, y, shared is not None)
        self.offsets = np.zeros(d.experts + 1, np.int32)

    def __call__(self, stream: Stream):
        d, at, w, s = self.dims, self.scratch, self.routed, self.size
        if not d.tokens:
            return
        for launch in self.front:
            launch(stream)
        check(drv().cuMemcpyDtoHAsync(self.offsets.ctypes.data, at["offsets"], self.offsets.nbytes, stream.handle))
        stream.synchronize()
        counts = np.diff(self.offsets)
        busy = np.flatnonzero(counts)
        busy = busy[np.argsort(counts[busy], kind="stable")]  # grouped by row count
        row, n = self.offsets[busy].astype(np.uint64), len(busy)
        addresses = np.stack([w.w1[busy], w.w3[busy], w.w2[busy], at["expert_out"] + row * (d.dim * s),
                              at["g"] + row * (d.inter * 4), at["u"] + row * (d.inter * 4),
                              at["hidden"] + row * (d.inter * s)])
        # Before the launches below: a copy from pageable memory may wait for the stream's work.
        check(drv().cuMemcpyHtoDAsync(at["pointers"], addresses.ctypes.data, addresses.nbytes, stream.handle))
        for launch in self.middle:
            launch(stream)

        def array(name: str, i: int) -> int:
            """The device address of entry i (the i-th busy expert) of an address array."""
            return at["pointers"] + 8 * (n * ARRAYS.index(name) + i)

        sizes = counts[busy]
        first = np.flatnonzero(np.diff(sizes, prepend=0)).tolist()
        groups = [(i, end - i, int(sizes[i])) for i, end in zip(first, first[1:] + [n])]
        for i, count, m in groups:
            self.up(stream, array("w1", i), array("rows", i), array("g", i), m, count)
            self.up(stream, array("w3", i), array("rows", i), array("u", i), m, count)
        self.swiglu(stream)
        for i, count, m in groups:
            self.down(stream, array("w2", i), array("hidden", i), array("rows", i), m, count)
        self.combine(stream)
