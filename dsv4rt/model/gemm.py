"""Dense GEMMs on raw device pointers: y = x·Wᵀ with W [N, K] (PyTorch Linear layout).

Decode batches in bf16 (m ≤ M_SKINNY rows) with narrow weights go to cuda_src/skinny.cu, one launch that
streams the weight (no split-K reduce kernel after it); everything else to cuBLAS. cuBLAS is column-major:
a row-major [M, N] matrix is its column-major transpose, so y = x·Wᵀ is computed as yᵀ = W·xᵀ (W transposed
by cuBLAS, x and y as they are)."""
from __future__ import annotations

import ctypes
import functools

import ml_dtypes
import numpy as np

from ..cuda.build import declared
from ..cuda.device import Device, Launch
from ..cuda.ops import storage_name

# cuBLAS's advice for Hopper; smaller workspaces make it pick slower split-K kernels.
WORKSPACE_BYTES = 32 << 20
_DATA_TYPE = {np.dtype(np.float32): 0, np.dtype(ml_dtypes.bfloat16): 14}  # CUDA_R_32F, CUDA_R_16BF
_OP_N, _OP_T = 0, 1
_COMPUTE_32F, _COMPUTE_32F_PEDANTIC = 68, 69
_GEMM_DEFAULT = -1
BF16 = np.dtype(ml_dtypes.bfloat16)

# The skinny kernel (cuda_src/skinny.cu) takes bf16 GEMMs of up to M_SKINNY rows whose weights are narrow:
# at most SKINNY_MAX_TILES 16-row weight tiles times 8-row activation tiles. On an H200, weights streamed from
# HBM, it beats cuBLAS there (4096→1024: 5.8 µs against 7.0; 4096→512: 4.6 against 6.4; 8192→4096 at m ≤ 8:
# 19.5 against 20.5), while cuBLAS streams wider weights faster (1024→32768: 18.0 µs against 19.6; the
# indexer's 1024→8192, the grouped 8 × 4096→1024, the LM head) and larger batches too.
M_SKINNY = 16
SKINNY_MAX_TILES = 256
SKINNY_UNIT = 64         # kUnit: columns of k a warp takes at a time
SKINNY_WAVE_WARPS = 16   # resident warps a multiprocessor holds at the kernel's 108-124 registers


@functools.cache
def _cublas() -> ctypes.CDLL:
    """libcublas (the one CuPy's wheels bring), called directly: CuPy's wrappers set the handle's stream to
    CuPy's current stream on every call, which resets the workspace and refuses a capturing stream."""
    from cuda import pathfinder
    loaded = pathfinder.load_nvidia_dynamic_lib("cublas")
    lib = ctypes.CDLL(loaded.abs_path) if loaded.abs_path else ctypes.CDLL(None, handle=loaded._handle_uint)
    p, i, ll = ctypes.c_void_p, ctypes.c_int, ctypes.c_longlong
    signatures = dict(
        cublasCreate_v2=[p], cublasDestroy_v2=[p], cublasSetStream_v2=[p, p],
        cublasSetWorkspace_v2=[p, p, ctypes.c_size_t],
        cublasGemmEx=[p, i, i, i, i, i, p, p, i, i, p, i, i, p, p, i, i, i, i],
        cublasGemmStridedBatchedEx=[p, i, i, i, i, i, p, p, i, i, ll, p, i, i, ll, p, p, i, i, ll, i, i, i])
    for name, args in signatures.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, ctypes.c_int
    return lib


def _check(status: int, what: str):
    if status:
        raise RuntimeError(f"{what} failed: cublasStatus {status}")


def data_type(dtype) -> int:
    try:
        return _DATA_TYPE[np.dtype(dtype)]
    except KeyError:
        raise ValueError(f"no GEMM for {np.dtype(dtype)} (float32 or bfloat16)") from None


class Blas:
    """A cuBLAS handle with a workspace from the arena. cublasSetStream puts the handle back on cuBLAS's
    own workspace pool, which may allocate while a graph is being captured, so every change of stream
    sets ours again. GEMMs that may run at the same time on different streams need one Blas each."""

    def __init__(self, arena, device: Device | None = None, workspace_bytes: int = WORKSPACE_BYTES):
        """With a device, bf16 decode GEMMs take the skinny kernel; without one, every GEMM is cuBLAS's."""
        self.device = device
        handle = ctypes.c_void_p()
        _check(_cublas().cublasCreate_v2(ctypes.byref(handle)), "cublasCreate")
        self.handle = handle.value
        self.workspace = arena.alloc(workspace_bytes, "cuBLAS workspace")
        self.stream = None

    def use(self, stream):
        if stream.ptr != self.stream:
            lib = _cublas()
            _check(lib.cublasSetStream_v2(self.handle, stream.ptr), "cublasSetStream")
            _check(lib.cublasSetWorkspace_v2(self.handle, self.workspace.ptr, self.workspace.nbytes),
                   "cublasSetWorkspace")
            self.stream = stream.ptr

    def close(self):
        if self.handle:
            _check(_cublas().cublasDestroy_v2(self.handle), "cublasDestroy")
            self.workspace.free()
            self.handle = None


class Gemm:
    """y[g] = x[g]·w[g]ᵀ for g < groups, bound once, issued with `gemm(stream)` (capturable in a graph).

    x rows are `x_ld` elements apart, y rows `y_ld`; group g starts at x + g·x_step, w + g·w_step,
    y + g·y_step (elements). Inputs are `dtype`, y is `out_dtype` (default `dtype`), accumulation is
    fp32: pedantic for float32 (no TF32, so a float32 build matches numpy), tensor cores for bf16."""
    launch: Launch | None = None

    def __init__(self, blas: Blas, dtype, x: int, w: int, y: int, m: int, n: int, k: int, out_dtype=None, *,
                 x_ld: int | None = None, y_ld: int | None = None, groups: int = 1,
                 x_step: int = 0, w_step: int = 0, y_step: int = 0, alpha: float = 1.0):
        out_dtype = dtype if out_dtype is None else out_dtype
        in_type, out_type = data_type(dtype), data_type(out_dtype)
        if in_type != out_type and np.dtype(out_dtype) != np.float32:
            raise ValueError("a GEMM's output is its input type or float32")
        compute = _COMPUTE_32F_PEDANTIC if in_type == 0 else _COMPUTE_32F
        self.blas = blas
        x_ld, y_ld = x_ld or k, y_ld or n
        if blas.device is not None and takes_skinny(dtype, x, w, m, n, k, x_ld, groups, x_step, w_step):
            self.launch = skinny_gemm(blas.device, out_dtype, x, w, y, m, n, k, x_ld=x_ld, y_ld=y_ld, groups=groups,
                                      x_step=x_step, w_step=w_step, y_step=y_step, alpha=alpha)
            return
        self._alpha, self._zero = ctypes.c_float(alpha), ctypes.c_float(0.0)
        alpha, beta = ctypes.addressof(self._alpha), ctypes.addressof(self._zero)
        head = (blas.handle, _OP_T, _OP_N, n, m, k, alpha)
        if groups == 1:
            self._fn = _cublas().cublasGemmEx
            self._args = (*head, w, in_type, k, x, in_type, x_ld, beta, y, out_type, y_ld, compute, _GEMM_DEFAULT)
        else:
            self._fn = _cublas().cublasGemmStridedBatchedEx
            self._args = (*head, w, in_type, k, w_step, x, in_type, x_ld, x_step, beta, y, out_type, y_ld, y_step,
                          groups, compute, _GEMM_DEFAULT)

    def __call__(self, stream):
        if self.launch is not None:
            self.launch(stream)
            return
        self.blas.use(stream)
        _check(self._fn(*self._args), "cuBLAS GEMM")


def linear(blas: Blas, dtype, x: int, w: int, y: int, m: int, n: int, k: int, out_dtype=None,
           alpha: float = 1.0) -> Gemm:
    """y [m, n] = alpha · x [m, k] · wᵀ, w [n, k] row-major."""
    return Gemm(blas, dtype, x, w, y, m, n, k, out_dtype, alpha=alpha)


def grouped_linear(blas: Blas, dtype, x: int, w: int, y: int, m: int, groups: int, n: int, k: int,
                   out_dtype=None) -> Gemm:
    """The grouped output projection: y[:, g] = x[:, g] · w[g]ᵀ with x [m, groups, k], w [groups, n, k],
    y [m, groups, n]."""
    return Gemm(blas, dtype, x, w, y, m, n, k, out_dtype, x_ld=groups * k, y_ld=groups * n, groups=groups,
                x_step=k, w_step=n * k, y_step=n)


def skinny_tiles(m: int) -> int:
    """8-row activation tiles of a skinny block: one pass over the weight for up to 16 rows."""
    return 1 if m <= 8 else 2


def takes_skinny(dtype, x: int, w: int, m: int, n: int, k: int, x_ld: int, groups: int, x_step: int,
                 w_step: int) -> bool:
    """bf16, a decode batch, a narrow weight, and the kernel's 16-byte rows (k, x_ld, steps multiples of 8)."""
    return (np.dtype(dtype) == BF16 and 0 < m <= M_SKINNY and n > 0
            and groups * -(-n // 16) * skinny_tiles(m) <= SKINNY_MAX_TILES
            and x % 16 == 0 and w % 16 == 0 and all(v % 8 == 0 for v in (k, x_ld, x_step, w_step)))



def skinny_config(m: int, n: int, k: int, groups: int, sm_count: int) -> tuple[int, int, int, int]:
    """(tiles, per_block, parts, split): 8-row activation tiles of a block, its row groups (16 weight rows each),
    the warps of each, and the blocks of a cluster that split k with them. The parts·split warps of a row group
    grow while every warp keeps two 64-column units of k and all warps fit one wave of resident warps (at least
    4, which streamed 1024→32768 and the LM head best); parts stays 8 unless that makes clusters of 4 or more
    blocks outnumber the multiprocessors (measured over 4096→64 to 8192→4096: such clusters ran 1.4x slower)."""
    tiles = skinny_tiles(m)
    row_groups = groups * -(-n // 16) * -(-m // (8 * tiles))
    most = max(1, min(64, -(-k // SKINNY_UNIT) // 2))
    p = 1
    while 2 * p <= most and (p < 4 or row_groups * 2 * p <= SKINNY_WAVE_WARPS * sm_count):
        p *= 2
    parts = min(p, 8)
    if p // parts > 2 and row_groups * (p // parts) > sm_count:
        parts = min(p, 16)
    return tiles, max(1, 4 // parts), parts, p // parts


def skinny_gemm(device: Device, out_dtype, x: int, w: int, y: int, m: int, n: int, k: int, *, x_ld: int, y_ld: int,
                groups: int = 1, x_step: int = 0, w_step: int = 0, y_step: int = 0, alpha: float = 1.0,
                config: tuple[int, int, int, int] | None = None) -> Launch:
    """y[g] = alpha · x[g]·w[g]ᵀ (Gemm's layout) in one launch for bf16 x and w, y float32 or bfloat16, whatever
    the shape (Gemm routes by takes_skinny); `config` overrides skinny_config's."""
    tiles, per_block, parts, split = config or skinny_config(m, n, k, groups, device.sm_count)
    kernel = device.kernel("skinny", f"skinny_gemm<{storage_name(out_dtype)},{tiles},{split}>", declared("skinny"))
    P, I, L = ctypes.c_void_p, ctypes.c_int, ctypes.c_longlong
    args = [P(y), P(x), P(w), I(m), I(n), I(k), I(x_ld), I(y_ld), L(x_step), L(w_step), L(y_step),
            ctypes.c_float(alpha), I(groups), I(parts)]
    warps = per_block * parts
    grid = (-(-groups * -(-n // 16) // per_block), split, -(-m // (8 * tiles)))
    return kernel.bind(grid, 32 * warps, args, shared=warps * 8 * tiles * 16 * 4)
