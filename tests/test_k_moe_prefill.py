"""The cuBLAS prefill MoE (dsv4rt/model/moe_prefill.py) against reference.moe.MoE, with test_k_moe.py's layers
and tolerances: Flash sizes (256 experts, top 6: most experts get no rows at few tokens) and odd sizes, hash and
routed layers, with and without the shared expert, one object run on new tokens."""
import numpy as np
import pytest

from conftest import rel_rows
from moe_cases import BF16, every_layer_kind, held, upload
from test_k_moe import Layer

pytestmark = pytest.mark.gpu
TOKENS = [1, 7, 64, 127, 300]


def build(rt, blas, layer: Layer, dtype, tokens: int, hashed: bool, x_buf, y_buf, ids_buf, with_shared=True):
    from dsv4rt.model.moe import MoeDims
    from dsv4rt.model.moe_prefill import ExpertAddresses, PrefillMoE, workspace_bytes
    bufs, routed, shared, _ = layer.on_device(rt, dtype)
    dims = MoeDims(tokens, layer.dim, layer.inter, layer.experts, layer.active, layer.inter if with_shared else 0)
    ws = rt.arena.alloc(workspace_bytes(dims, dtype))
    moe = PrefillMoE(rt.device, blas, dtype, dims, x=x_buf.ptr, y=y_buf.ptr, gate=bufs["gate"].ptr,
                     routed=ExpertAddresses.from_tables(routed, layer.experts),
                     shared=shared if with_shared else None, scaling=layer.scaling, limit=layer.limit,
                     workspace=ws.ptr, bias=None if hashed else bufs["bias"].ptr,
                     tid2eid=bufs["tid2eid"].ptr if hashed else None, ids=ids_buf.ptr if hashed else None)
    return moe, ws


def run_once(rt, moe, layer, dtype, hashed, with_shared, x, ids, dx, dy, dids):
    """Runs `moe` on x, compares with the reference; returns the experts' row counts."""
    tokens = len(x)
    dx.copy_from_host(x.astype(dtype))
    dy.copy_from_host(np.full((tokens, layer.dim), np.nan, dtype))
    dids.copy_from_host(ids)
    moe(rt.stream)
    rt.stream.synchronize()
    y = dy.copy_to_host(np.empty((tokens, layer.dim), dtype)).astype(np.float32)
    ref_moe = layer.reference(hashed, with_shared)
    err = rel_rows(y, ref_moe(x, ids)).max()
    assert err < (1e-5 if dtype == np.float32 else 1e-2), err
    counts = np.bincount(ref_moe.route(x, ids)[0].ravel(), minlength=layer.experts)
    assert np.array_equal(moe.offsets, np.concatenate([[0], np.cumsum(counts)]))
    return counts


def run_and_compare(rt, blas, layer, dtype, tokens, hashed, seed, with_shared=True):
    x, ids = layer.inputs(tokens, hashed, seed)
    dx, dy, dids = upload(rt, x.astype(dtype)), upload(rt, np.zeros((tokens, layer.dim), dtype)), upload(rt, ids)
    moe, ws = build(rt, blas, layer, dtype, tokens, hashed, dx, dy, dids, with_shared)
    counts = run_once(rt, moe, layer, dtype, hashed, with_shared, x, ids, dx, dy, dids)
    if tokens * layer.active < layer.experts:
        assert (counts == 0).any()
    for b in (dx, dy, dids, ws):
        b.free()
    return counts


@pytest.fixture(scope="module")
def odd():
    """Sizes that fill no vector run or GEMM tile evenly: k of 9 and 5 vectors, 40 and 72 columns."""
    yield from held(Layer(dim=72, inter=40, experts=12, active=3, limit=4.0))


@pytest.fixture(scope="module")
def flash():
    yield from held(Layer(dim=4096, inter=2048, experts=256, active=6, limit=10.0))


@every_layer_kind(TOKENS)
def test_flash(rt, blas, flash, dtype, hashed, tokens):
    counts = run_and_compare(rt, blas, flash, dtype, tokens, hashed, seed=3000 + tokens)
    if tokens == 300:
        assert counts.max() > 8


@every_layer_kind(TOKENS)
def test_odd_sizes(rt, blas, odd, dtype, hashed, tokens):
    counts = run_and_compare(rt, blas, odd, dtype, tokens, hashed, seed=4000 + tokens)
    if tokens == 1:
        assert (counts == 0).sum() == odd.experts - odd.active


@pytest.mark.parametrize("dtype", [np.float32, BF16])
@pytest.mark.parametrize("tokens", [7, 300])
def test_without_shared_expert(rt, blas, odd, dtype, tokens):
    run_and_compare(rt, blas, odd, dtype, tokens, False, seed=5000 + tokens, with_shared=False)


@pytest.mark.parametrize("hashed", [False, True], ids=["routed", "hash"])
def test_one_object_on_new_tokens(rt, blas, flash, hashed):
    """The row counts are read back on every call, not kept from the first."""
    tokens, dtype = 64, BF16
    dx, dy = upload(rt, np.zeros((tokens, flash.dim), dtype)), upload(rt, np.zeros((tokens, flash.dim), dtype))
    dids = upload(rt, np.zeros(tokens, np.int32))
    moe, ws = build(rt, blas, flash, dtype, tokens, hashed, dx, dy, dids)
    seen = [run_once(rt, moe, flash, dtype, hashed, True, *flash.inputs(tokens, hashed, seed), dx, dy, dids)
            for seed in (7, 8)]
    assert not np.array_equal(*seen)
    for b in (dx, dy, dids, ws):
        b.free()


def test_capture_is_refused(rt, blas, odd):
    """The host synchronisation has no place in a CUDA graph: capture fails loudly instead of baking in one
    step's row counts."""
    from dsv4rt.cuda.device import Graph, Stream
    from dsv4rt.cuda.driver import CudaError
    tokens, dtype = 7, BF16
    dx, dy = upload(rt, np.zeros((tokens, odd.dim), dtype)), upload(rt, np.zeros((tokens, odd.dim), dtype))
    dids = upload(rt, np.zeros(tokens, np.int32))
    moe, ws = build(rt, blas, odd, dtype, tokens, False, dx, dy, dids)
    stream = Stream()
    with pytest.raises(CudaError):
        with Graph(stream):
            moe(stream)
    stream.close()
    for b in (dx, dy, dids, ws):
        b.free()
