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



def skip_without_wgmma(rt):
    from dsv4rt.cuda.build import WGMMA_ARCH
    if rt.device.arch != WGMMA_ARCH:
        pytest.skip(f"wgmma runs on {WGMMA_ARCH}")


def replays_the_eager_step(m, ids, start: int, rows: int) -> bool:
    """GpuModel m fed ids[:start], then a step of the next `rows` tokens run eagerly and again as a captured graph:
    whether the graph gives the eager logits bit for bit."""
    from dsv4rt.cuda.device import Graph
    from dsv4rt.model.forward import Entry
    m.forward(ids[:start])
    m.blocks.place(0, start + rows)
    m.tables.refresh(0, m.blocks, 0, m.rt.stream)
    entry = Entry(0, ids[start:start + rows], start)
    eager = m.run([entry], every_row=True)
    m.upload([entry])
    graph = Graph(m.rt.stream)
    with graph:
        m.launch(rows, rows, False)
    graph.replay(m.rt.stream)
    same = np.array_equal(m.outputs(rows, every_row=True), eager)
    graph.close()
    return same


def used_pages(engine) -> int:
    """KV pages the engine holds, over every size class."""
    a = engine.scheduler.blocks.allocator
    return sum(a.stats(c).used_pages for c in range(len(a.page_bytes)))


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
    b = Blas(rt.arena, rt.device)
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


def soak(engine, rng, n: int, shared: np.ndarray, arrivals: int, max_new: int, shared_share: float, vocab: int):
    """Drive the engine with n requests, up to arrivals-1 a step, random prompts (a share of them a prefix
    of `shared`) and output lengths, and an abort at random one step in ten, until all have ended.
    Returns the requests and the ids aborted; checks that every other request completed."""
    from dsv4rt.engine import Status
    from dsv4rt.reference.sampling import SamplingParams
    requests, aborted = [], set()
    while len(requests) < n or engine.has_unfinished():
        for _ in range(rng.integers(0, arrivals) if len(requests) < n else 0):
            params = SamplingParams(temperature=1.0, max_new_tokens=int(rng.integers(1, max_new)), seed=len(requests))
            length = int(rng.integers(1, len(shared) + 1))
            prompt = shared[:length] if rng.random() < shared_share else rng.integers(2, vocab, length)
            rid = engine.add_request(prompt.tolist(), params)
            requests.append(engine._live[rid])
        if requests and rng.random() < 0.1:
            victim = requests[rng.integers(len(requests))]
            if engine.abort(victim.id):
                aborted.add(victim.id)
        engine.step()
    for r in requests:
        if r.id in aborted:
            assert r.status is Status.ABORTED and r.finish_reason == "abort"
        else:
            assert r.status is Status.FINISHED and r.finish_reason in ("stop", "length")
            assert r.finish_reason == "stop" or len(r.generated) == r.params.max_new_tokens
    return requests, aborted

