"""The CUDA runtime core on a real GPU: kernels, arena, streams, graphs, upload, interop."""
import ml_dtypes
import numpy as np
import pytest

from conftest import TINY_A, rel_rows
from dsv4rt.reference.ops import rmsnorm as rmsnorm_ref

pytestmark = pytest.mark.gpu
MiB = 1 << 20


def launch_rmsnorm(rt, dtype, out, x, w, rows, dim, stream=None):
    from dsv4rt.cuda import ops
    ops.rmsnorm(rt.device, dtype, out, x, w, rows, dim, 1e-6)(stream or rt.stream)


def device_copy(rt, host: np.ndarray):
    buf = rt.arena.alloc(host.nbytes)
    buf.copy_from_host(host)
    return buf


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16])
@pytest.mark.parametrize("rows, dim", [(37, 4096), (5, 1001), (1, 512)])
def test_rmsnorm_kernel_matches_reference(rt, dtype, rows, dim):
    rng = np.random.default_rng(rows * dim)
    x = (rng.standard_normal((rows, dim)) * 3).astype(dtype)
    w = (1 + 0.2 * rng.standard_normal(dim)).astype(np.float32)
    dx, dw = device_copy(rt, x), device_copy(rt, w)
    dy = device_copy(rt, np.full_like(x, np.nan))  # poison: every element must be written
    launch_rmsnorm(rt, dtype, dy.ptr, dx.ptr, dw.ptr, rows, dim)
    rt.stream.synchronize()
    y = dy.copy_to_host(np.empty_like(x)).astype(np.float32)
    ref = rmsnorm_ref(x.astype(np.float32), w, 1e-6)
    tol = 1e-6 if dtype == np.float32 else 8e-3  # one bf16 rounding of the output
    assert rel_rows(y, ref).max() < tol
    for b in (dx, dw, dy):
        b.free()


def test_arena_allocations_are_disjoint_and_reusable(rt):
    used = rt.arena.used
    bufs = [rt.arena.alloc(n) for n in (MiB, 3 * MiB + 5, 4096)]
    for i, b in enumerate(bufs):
        b.copy_from_host(np.full(b.nbytes, i + 1, np.uint8))
    for i, b in enumerate(bufs):
        assert np.all(b.copy_to_host(np.empty(b.nbytes, np.uint8)) == i + 1)
    first = bufs[0].ptr
    for b in bufs:
        b.free()
    assert rt.arena.used == used
    again = rt.arena.alloc(MiB)
    assert again.ptr == first
    again.free()


def test_adopted_memory_and_stream_stay_the_hosts():
    from dsv4rt.cuda.driver import check, drv
    from dsv4rt.cuda.runtime import Runtime
    d = drv()
    Runtime(arena_bytes=MiB).close()  # context current
    ptr = int(check(d.cuMemAlloc(8 * MiB)))
    stream = check(d.cuStreamCreate(0))
    with Runtime(arena_bytes=8 * MiB, ptr=ptr, stream=int(stream)) as r:
        assert r.arena.base == ptr and r.stream.ptr == int(stream)
        b = r.arena.alloc(MiB)
        b.copy_from_host(np.arange(MiB // 4, dtype=np.int32), r.stream)
        r.stream.synchronize()
    out = np.empty(MiB // 4, np.int32)
    check(d.cuMemcpyDtoH(out.ctypes.data, ptr, out.nbytes))  # still ours to read: not freed by the runtime
    assert np.array_equal(out, np.arange(MiB // 4))
    check(d.cuStreamSynchronize(stream))  # the stream handle is still valid
    check(d.cuStreamDestroy(stream))
    check(d.cuMemFree(ptr))


def test_graph_replay_equals_eager(rt):
    from dsv4rt.cuda.device import Graph
    rng = np.random.default_rng(7)
    x = rng.standard_normal((64, 4096)).astype(ml_dtypes.bfloat16)
    w = (1 + 0.2 * rng.standard_normal(4096)).astype(np.float32)
    dx, dw, da, db = device_copy(rt, x), device_copy(rt, w), device_copy(rt, x), device_copy(rt, x)

    def step():
        launch_rmsnorm(rt, ml_dtypes.bfloat16, da.ptr, dx.ptr, dw.ptr, 64, 4096)
        for _ in range(10):
            launch_rmsnorm(rt, ml_dtypes.bfloat16, db.ptr, da.ptr, dw.ptr, 64, 4096)
            launch_rmsnorm(rt, ml_dtypes.bfloat16, da.ptr, db.ptr, None, 64, 4096)

    step()
    rt.stream.synchronize()
    eager = da.copy_to_host(np.empty_like(x))
    da.copy_from_host(np.zeros_like(x))
    graph = Graph(rt.stream)
    with graph:
        step()
    assert np.all(da.copy_to_host(np.empty_like(x)).astype(np.float32) == 0)  # capture ran nothing
    for _ in range(3):
        graph.replay()
    rt.stream.synchronize()
    assert np.array_equal(da.copy_to_host(np.empty_like(x)).view(np.uint16), eager.view(np.uint16))
    graph.close()
    for b in (dx, dw, da, db):
        b.free()


@pytest.mark.parametrize("staging", [4096, 1 << 20, 64 << 20])
def test_upload_round_trips_bit_for_bit(rt, staging):
    from dsv4rt.loader import Checkpoint
    from dsv4rt.loader.upload import upload
    with Checkpoint.open(TINY_A) as ck:
        w = upload(ck, rt.arena, rt.stream, staging=staging)
        assert set(w.arrays) == set(ck.names()) and w.gbps > 0
        for name, arr in w.arrays.items():
            host = ck.raw(name)
            back = arr.to_host()
            assert back.dtype == host.dtype and back.shape == host.shape
            assert back.tobytes() == host.tobytes(), name
    w.buffer.free()


def test_cupy_sees_our_memory(rt):
    cp = pytest.importorskip("cupy")
    host = np.arange(24, dtype=np.float32).reshape(4, 6)
    buf = device_copy(rt, host)
    arr = buf.array((4, 6), np.float32)
    assert np.array_equal(cp.asnumpy(cp.asarray(arr)), host)
    assert np.array_equal(cp.asnumpy(cp.from_dlpack(arr)), host)
    bf = (host.astype(ml_dtypes.bfloat16))
    bbuf = device_copy(rt, bf)
    as_u16 = cp.asarray(bbuf.array((4, 6), ml_dtypes.bfloat16))
    assert as_u16.dtype == cp.uint16 and np.array_equal(cp.asnumpy(as_u16), bf.view(np.uint16))
    buf.free()
    bbuf.free()


def test_events_time_the_stream(rt):
    from dsv4rt.cuda.device import Event
    start, end = Event(), Event()
    x = device_copy(rt, np.ones((256, 4096), np.float32))
    rt.stream.record(start)
    for _ in range(20):
        launch_rmsnorm(rt, np.float32, x.ptr, x.ptr, None, 256, 4096)
    rt.stream.record(end)
    end.synchronize()
    assert 0 < start.elapsed_ms(end) < 1000
    x.free()
