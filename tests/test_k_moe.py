"""MoE on the GPU against reference.moe.MoE: routing, the counting sort, grouped expert GEMMs (the skinny
decode kernel and the 64-row tiled one), the shared expert and the combine; tiny-a sizes, odd sizes and
Flash sizes (16 experts to keep memory small); hash and routed layers; graph replay."""
from dataclasses import dataclass

import numpy as np
import pytest

from conftest import rel_rows
from moe_cases import BF16, VOCAB, bf16_grid, check_graph_replay, every_layer_kind, held, layer_inputs, ran, upload
from dsv4rt.reference.moe import MoE as MoERef, Expert
from dsv4rt.reference.ops import Linear

pytestmark = pytest.mark.gpu


@dataclass
class Layer:
    """Random weights on the bf16 grid, so the float32 and bf16 builds read the same values."""
    dim: int
    inter: int
    experts: int
    active: int
    limit: float
    scaling: float = 1.5

    def __post_init__(self):
        rng = np.random.default_rng(self.dim + self.experts)
        d, i, e = self.dim, self.inter, self.experts
        self.gate = bf16_grid(rng.standard_normal((e, d), dtype=np.float32) * d ** -0.5)
        self.bias = (rng.standard_normal(e) * 0.3).astype(np.float32)
        # Expert matrices are windows at random offsets of two pools (w1/w3 and w2 scales): distinct
        # matrices at separate addresses, cheap to make and upload at Flash sizes.
        n = i * d
        self.pools = [bf16_grid(rng.standard_normal(4 * n, dtype=np.float32) * scale)
                      for scale in (4 * d ** -0.5, i ** -0.5)]
        window = lambda pool: (pool, 8 * int(rng.integers(0, 3 * n // 8)))  # noqa: E731 (16-byte aligned)
        self.windows = dict(w1=[window(0) for _ in range(e)], w3=[window(0) for _ in range(e)],
                            w2=[window(1) for _ in range(e)], s1=window(0), s3=window(0), s2=window(1))
        self.tid2eid = np.argsort(rng.random((VOCAB, e)), axis=1)[:, :self.active].astype(np.int32)
        self.device = {}

    def matrix(self, name, e=None):
        pool, at = self.windows[name] if e is None else self.windows[name][e]
        shape = (self.dim, self.inter) if name in ("w2", "s2") else (self.inter, self.dim)
        return self.pools[pool][at:at + self.dim * self.inter].reshape(shape)

    def reference(self, hashed: bool, shared: bool = True) -> MoERef:
        expert = lambda w1, w2, w3: Expert(Linear(w1), Linear(w2), Linear(w3), self.limit)  # noqa: E731
        m = self.matrix
        return MoERef(self.gate, None if hashed else self.bias, self.tid2eid if hashed else None,
                      [expert(m("w1", e), m("w2", e), m("w3", e)) for e in range(self.experts)],
                      expert(m("s1"), m("s2"), m("s3")) if shared else None, self.active, self.scaling)

    def on_device(self, rt, dtype):
        """Uploaded once per storage type."""
        from dsv4rt.model.moe import ExpertWeights, pointer_table
        if dtype not in self.device:
            pools = [upload(rt, p.astype(dtype)) for p in self.pools]
            address = lambda window: pools[window[0]].ptr + window[1] * np.dtype(dtype).itemsize  # noqa: E731
            tables = {n: pointer_table(rt.arena, [address(w) for w in self.windows[n]]) for n in ("w1", "w3", "w2")}
            routed = ExpertWeights(tables["w1"].ptr, tables["w3"].ptr, tables["w2"].ptr)
            shared = ExpertWeights(*(address(self.windows[n]) for n in ("s1", "s3", "s2")))
            bufs = dict(gate=upload(rt, self.gate.astype(dtype)), bias=upload(rt, self.bias),
                        tid2eid=upload(rt, self.tid2eid))
            buffers = list(bufs.values()) + list(tables.values()) + pools
            self.device[dtype] = (bufs, routed, shared, buffers)
        return self.device[dtype]

    def free(self):
        for _, _, _, buffers in self.device.values():
            for b in buffers:
                b.free()
        self.device.clear()

    inputs = layer_inputs


def build(rt, blas, layer: Layer, dtype, tokens: int, hashed: bool, x_buf, y_buf, with_shared=True, path=None):
    from dsv4rt.model.moe import MoE, MoeDims, workspace_bytes
    bufs, routed, shared, _ = layer.on_device(rt, dtype)
    dims = MoeDims(tokens, layer.dim, layer.inter, layer.experts, layer.active, layer.inter if with_shared else 0)
    ws = rt.arena.alloc(workspace_bytes(dims, dtype))
    ids = rt.arena.alloc(4 * tokens)
    moe = MoE(rt.device, blas, dtype, dims, x=x_buf.ptr, y=y_buf.ptr, gate=bufs["gate"].ptr, routed=routed,
              shared=shared if with_shared else None, scaling=layer.scaling, limit=layer.limit, workspace=ws.ptr,
              bias=None if hashed else bufs["bias"].ptr, tid2eid=bufs["tid2eid"].ptr if hashed else None,
              ids=ids.ptr if hashed else None, path=path)
    return moe, ws, ids


def run_and_compare(rt, blas, layer, dtype, tokens, hashed, seed, with_shared=True):
    with ran(rt, blas, layer, build, dtype, tokens, hashed, seed, with_shared=with_shared) as (moe, x, ids, y):
        ref_moe = layer.reference(hashed, with_shared)
        err = rel_rows(y, ref_moe(x, ids)).max()
        assert err < (1e-5 if dtype == np.float32 else 1e-2), err
        return check_sort(moe, ref_moe.route(x, ids)[0], tokens * layer.active)


def check_sort(moe, ref_idx, pairs):
    """The routing (as a set per token) and the counting sort's invariants, read back from the workspace."""
    from dsv4rt.cuda.driver import check, drv
    d = moe.dims

    def read(name, n, dtype=np.int32):
        out = np.empty(n, dtype)
        check(drv().cuMemcpyDtoH(out.ctypes.data, moe.scratch[name], out.nbytes))
        return out
    idx = read("idx", pairs)
    assert np.array_equal(np.sort(idx.reshape(d.tokens, -1), axis=1), np.sort(ref_idx, axis=1))
    counts = np.bincount(idx, minlength=d.experts)
    assert np.array_equal(read("offsets", d.experts + 1), np.concatenate([[0], np.cumsum(counts)]))
    tiles = -(-counts // moe.tile_rows)
    assert np.array_equal(read("tile_offsets", d.experts + 1), np.concatenate([[0], np.cumsum(tiles)]))
    assert tiles.sum() <= d.max_tiles(moe.tile_rows)
    perm, pos = read("perm", pairs), read("pos", pairs)
    assert np.array_equal(np.sort(perm), np.arange(pairs)) and np.array_equal(pos[perm], np.arange(pairs))
    assert np.all(np.diff(idx[perm]) >= 0)
    return counts


@pytest.fixture(scope="module")
def tiny():
    yield from held(Layer(dim=64, inter=32, experts=8, active=2, limit=3.0))


@pytest.fixture(scope="module")
def odd():
    """Sizes that fill no tile or vector run evenly: k of 9 and 5 vectors, 40 and 72 columns."""
    yield from held(Layer(dim=72, inter=40, experts=12, active=3, limit=4.0))


@pytest.fixture(scope="module")
def flash():
    yield from held(Layer(dim=4096, inter=2048, experts=16, active=6, limit=10.0))


@every_layer_kind([1, 5, 77])
def test_tiny(rt, blas, tiny, dtype, hashed, tokens):
    run_and_compare(rt, blas, tiny, dtype, tokens, hashed, seed=tokens)


@pytest.mark.parametrize("dtype", [np.float32, BF16])
@pytest.mark.parametrize("tokens", [5, 77])
def test_without_shared_expert(rt, blas, tiny, dtype, tokens):
    run_and_compare(rt, blas, tiny, dtype, tokens, False, seed=tokens, with_shared=False)


@pytest.mark.parametrize("dtype", [np.float32, BF16])
@pytest.mark.parametrize("hashed", [False, True], ids=["routed", "hash"])
@pytest.mark.parametrize("tokens, skinny", [(1, True), (3, True), (8, True), (64, True), (100, False)])
def test_odd_sizes(rt, blas, odd, dtype, hashed, tokens, skinny):
    """Tiles of 1 to 8 rows, experts without rows (1 and 3 tokens) and experts of several tiles (64 tokens)."""
    from dsv4rt.model.moe import MoeDims, grouped_path
    dims = MoeDims(tokens, odd.dim, odd.inter, odd.experts, odd.active, odd.inter)
    assert (grouped_path(rt.device.arch, dtype, dims) == "skinny") == skinny
    counts = run_and_compare(rt, blas, odd, dtype, tokens, hashed, seed=2000 + tokens)
    if tokens <= 3:
        assert (counts == 0).any()
    if tokens == 64:
        assert counts.max() > 8


@every_layer_kind([1, 8, 40, 300])
def test_flash(rt, blas, flash, dtype, hashed, tokens):
    run_and_compare(rt, blas, flash, dtype, tokens, hashed, seed=1000 + tokens)


@pytest.mark.parametrize("experts, active", [(384, 8), (256, 6), (7, 7)])
def test_route_matches_reference_exactly(rt, experts, active):
    from dsv4rt.model.moe import route
    rng = np.random.default_rng(experts)
    tokens = 123
    logits = (rng.standard_normal((tokens, experts)) * 2).astype(np.float32)
    bias = (rng.standard_normal(experts) * 0.3).astype(np.float32)
    dl, db = upload(rt, logits), upload(rt, bias)
    didx = upload(rt, np.full((tokens, active), -1, np.int32))
    dw = upload(rt, np.full((tokens, active), np.nan, np.float32))
    route(rt.device, dl.ptr, didx.ptr, dw.ptr, tokens, experts, active, 2.5, bias=db.ptr)(rt.stream)
    rt.stream.synchronize()
    idx = didx.copy_to_host(np.empty((tokens, active), np.int32))
    w = dw.copy_to_host(np.empty((tokens, active), np.float32))
    s = np.sqrt(np.logaddexp(0, logits))
    ref_idx = np.argsort(-(s + bias), axis=1, kind="stable")[:, :active]
    order = np.argsort(idx, axis=1)
    assert np.array_equal(np.take_along_axis(idx, order, 1), np.sort(ref_idx, axis=1))
    ref_w = np.take_along_axis(s, idx, 1)
    ref_w = ref_w / (ref_w.sum(axis=1, keepdims=True) + np.float32(1e-20)) * np.float32(2.5)
    assert np.abs(w - ref_w).max() < 2e-6 * np.abs(ref_w).max()
    for b in (dl, db, didx, dw):
        b.free()


def test_graph_replay_on_new_tokens(rt, blas, flash):
    check_graph_replay(rt, blas, flash, build)
