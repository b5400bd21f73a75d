"""What the MoE tests (test_k_moe.py, test_k_moe_fp4.py) share: buffers, inputs without
near-ties in the routing, module-scoped layers, the run of one built MoE and its graph replay."""
from contextlib import contextmanager

import ml_dtypes
import numpy as np
import pytest

from conftest import rel_rows

BF16 = ml_dtypes.bfloat16
VOCAB = 1000


def upload(rt, host):
    host = np.ascontiguousarray(host)
    buf = rt.arena.alloc(max(host.nbytes, 16))
    buf.copy_from_host(host)
    return buf


def fetch(rt, buf, shape, dtype) -> np.ndarray:
    rt.stream.synchronize()
    return buf.copy_to_host(np.empty(shape, dtype))


def bf16_grid(a):
    return a.astype(BF16).astype(np.float32)


def untied_inputs(rng, gate, bias, active: int, tokens: int):
    """x on the bf16 grid without near-ties in the routed top-k (the GPU's fp32 logits differ from numpy's in the
    last bits); hash layers (bias None) take any x."""
    x = bf16_grid(rng.standard_normal((tokens, gate.shape[1]), dtype=np.float32))
    for _ in range(100):
        if bias is None:
            break
        logits = x.astype(np.float64) @ gate.T.astype(np.float64)
        score = np.sort(np.sqrt(np.logaddexp(0, logits)) + bias, axis=1)[:, ::-1]
        tie = score[:, active - 1] - score[:, active] < 1e-3
        if not tie.any():
            break
        x[tie] = bf16_grid(rng.standard_normal((int(tie.sum()), gate.shape[1]), dtype=np.float32))
    return x


def layer_inputs(layer, tokens: int, hashed: bool, seed: int):
    """x for `layer` (gate, bias, active) and token ids for hash layers."""
    rng = np.random.default_rng(seed)
    x = untied_inputs(rng, layer.gate, None if hashed else layer.bias, layer.active, tokens)
    return x, rng.integers(0, VOCAB, tokens).astype(np.int32)


def held(layer):
    """A module fixture's body: the layer, freed after the module's tests."""
    yield layer
    layer.free()


def every_layer_kind(tokens):
    """Parametrises a test over float32 and bf16 builds, routed and hash layers and `tokens`."""
    def mark(test):
        test = pytest.mark.parametrize("tokens", tokens)(test)
        test = pytest.mark.parametrize("hashed", [False, True], ids=["routed", "hash"])(test)
        return pytest.mark.parametrize("dtype", [np.float32, BF16])(test)
    return mark


@contextmanager
def ran(rt, blas, layer, build, dtype, tokens: int, hashed: bool, seed: int, **build_args):
    """(moe, x, ids, y as float32): build(rt, blas, layer, dtype, tokens, hashed, x_buf, y_buf, **build_args) ->
    (moe, workspace, ids_buf), run once on layer.inputs(tokens, hashed, seed); the buffers freed after."""
    x, ids = layer.inputs(tokens, hashed, seed)
    dx, dy = upload(rt, x.astype(dtype)), upload(rt, np.full((tokens, layer.dim), np.nan, dtype))
    moe, ws, dids = build(rt, blas, layer, dtype, tokens, hashed, dx, dy, **build_args)
    dids.copy_from_host(ids)
    moe(rt.stream)
    yield moe, x, ids, fetch(rt, dy, (tokens, layer.dim), dtype).astype(np.float32)
    for b in (dx, dy, ws, dids):
        b.free()


def check_graph_replay(rt, blas, layer, build):
    """A graph captured once and replayed on new tokens (8, bf16, routed) matches the reference each time."""
    from dsv4rt.cuda.device import Graph, Stream
    tokens, dtype = 8, BF16
    dx, dy = upload(rt, np.zeros((tokens, layer.dim), dtype)), upload(rt, np.zeros((tokens, layer.dim), dtype))
    moe, ws, ids = build(rt, blas, layer, dtype, tokens, False, dx, dy)
    stream = Stream()
    graph = Graph(stream)
    with graph:
        moe(stream)
    ref_moe = layer.reference(False)
    for seed in (5, 6):
        x, token_ids = layer.inputs(tokens, False, seed)
        dx.copy_from_host(x.astype(dtype), stream)  # a pageable copy may return before its DMA lands
        dy.copy_from_host(np.full((tokens, layer.dim), np.nan, dtype), stream)
        graph.replay()
        stream.synchronize()
        y = dy.copy_to_host(np.empty((tokens, layer.dim), dtype)).astype(np.float32)
        assert rel_rows(y, ref_moe(x, token_ids)).max() < 1e-2
    graph.close()
    stream.close()
    for b in (dx, dy, ws, ids):
        b.free()
