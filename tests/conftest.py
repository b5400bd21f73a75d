from pathlib import Path

import numpy as np
import pytest

FIXTURES = Path(__file__).parent / "fixtures"
TINY_A = FIXTURES / "tiny-a"
REAL_RATIOS = FIXTURES / "real-ratios"


def rel_rows(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """‖a−b‖/‖b‖ per row (last axis), after checking that inf/NaN sit in the same places."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert a.shape == b.shape
    assert np.array_equal(np.isfinite(a), np.isfinite(b))
    a, b = np.where(np.isfinite(a), a, 0), np.where(np.isfinite(b), b, 0)
    return np.linalg.norm(a - b, axis=-1) / np.linalg.norm(b, axis=-1)



def pytest_collection_modifyitems(config, items):
    """GPU tests run only where a device is visible."""
    from dsv4rt.cuda.driver import gpu_visible
    if any("gpu" in item.keywords for item in items) and not gpu_visible():
        skip = pytest.mark.skip(reason="no NVIDIA GPU visible")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)


@pytest.fixture(scope="module")
def rt():
    """A runtime per GPU test module: one 8 GiB arena, released when the module ends."""
    from dsv4rt.cuda.runtime import Runtime
    with Runtime(arena_bytes=8 << 30) as r:
        yield r


@pytest.fixture(scope="module")
def blas(rt):
    from dsv4rt.model.gemm import Blas
    b = Blas(rt.arena)
    yield b
    b.close()


@pytest.fixture
def dev(rt):
    """Copies host arrays to fresh device buffers, freed after the test."""
    bufs = []

    def put(host: np.ndarray):
        host = np.ascontiguousarray(host)
        buf = rt.arena.alloc(max(host.nbytes, 16))
        if host.nbytes:
            buf.copy_from_host(host)
        bufs.append(buf)
        return buf
    yield put
    for b in bufs:
        b.free()
