"""Dense GEMMs through cuBLAS on raw device pointers: y = x·Wᵀ with W [N, K] (PyTorch Linear layout).

cuBLAS is column-major: a row-major [M, N] matrix is its column-major transpose, so y = x·Wᵀ is
computed as yᵀ = W·xᵀ (W transposed by cuBLAS, x and y as they are)."""
from __future__ import annotations

import ctypes
import functools

import ml_dtypes
import numpy as np

# cuBLAS's advice for Hopper; smaller workspaces make it pick slower split-K kernels.
WORKSPACE_BYTES = 32 << 20
_DATA_TYPE = {np.dtype(np.float32): 0, np.dtype(ml_dtypes.bfloat16): 14}  # CUDA_R_32F, CUDA_R_16BF
_OP_N, _OP_T = 0, 1
_COMPUTE_32F, _COMPUTE_32F_PEDANTIC = 68, 69
_GEMM_DEFAULT = -1


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

    def __init__(self, arena, workspace_bytes: int = WORKSPACE_BYTES):
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

    def __init__(self, blas: Blas, dtype, x: int, w: int, y: int, m: int, n: int, k: int, out_dtype=None, *,
                 x_ld: int | None = None, y_ld: int | None = None, groups: int = 1,
                 x_step: int = 0, w_step: int = 0, y_step: int = 0, alpha: float = 1.0):
        out_dtype = dtype if out_dtype is None else out_dtype
        in_type, out_type = data_type(dtype), data_type(out_dtype)
        if in_type != out_type and np.dtype(out_dtype) != np.float32:
            raise ValueError("a GEMM's output is its input type or float32")
        compute = _COMPUTE_32F_PEDANTIC if in_type == 0 else _COMPUTE_32F
        self.blas = blas
        self._alpha, self._zero = ctypes.c_float(alpha), ctypes.c_float(0.0)
        alpha, beta = ctypes.addressof(self._alpha), ctypes.addressof(self._zero)
        x_ld, y_ld = x_ld or k, y_ld or n
        head = (blas.handle, _OP_T, _OP_N, n, m, k, alpha)
        if groups == 1:
            self._fn = _cublas().cublasGemmEx
            self._args = (*head, w, in_type, k, x, in_type, x_ld, beta, y, out_type, y_ld, compute, _GEMM_DEFAULT)
        else:
            self._fn = _cublas().cublasGemmStridedBatchedEx
            self._args = (*head, w, in_type, k, w_step, x, in_type, x_ld, x_step, beta, y, out_type, y_ld, y_step,
                          groups, compute, _GEMM_DEFAULT)

    def __call__(self, stream):
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
