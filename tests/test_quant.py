"""Faithful-mode quantisers against ml_dtypes, and the Hadamard rotation."""
import ml_dtypes
import numpy as np
import pytest

from dsv4rt.reference import quant


def _grid_values(dtype) -> np.ndarray:
    """Every finite value of an ml_dtypes float type, from its bit patterns."""
    bits = np.arange(256 if np.dtype(dtype).itemsize == 1 else 16, dtype=np.uint8)
    vals = bits.view(dtype) if np.dtype(dtype).itemsize == 1 else np.array([np.float32(b) for b in bits.view(dtype)])
    vals = vals.astype(np.float32)
    return np.unique(vals[np.isfinite(vals)])


@pytest.mark.parametrize("fn, dtype, top", [(quant.round_e4m3, ml_dtypes.float8_e4m3fn, 448.0),
                                            (quant.round_e2m1, ml_dtypes.float4_e2m1fn, 6.0)])
def test_rounding_equals_ml_dtypes_on_random_inputs(fn, dtype, top):
    rng = np.random.default_rng(0)
    x = np.concatenate([
        rng.uniform(-top, top, 100_000),
        rng.standard_normal(100_000) * rng.choice([1e-3, 1e-2, 0.1, 1, 10], 100_000),
        [0.0, -0.0, top, -top],
    ]).astype(np.float32)
    ours = fn(x)
    theirs = x.astype(dtype).astype(np.float32)
    assert np.array_equal(ours, theirs)
    assert np.array_equal(np.signbit(ours), np.signbit(theirs))


@pytest.mark.parametrize("fn, dtype", [(quant.round_e4m3, ml_dtypes.float8_e4m3fn),
                                       (quant.round_e2m1, ml_dtypes.float4_e2m1fn)])
def test_ties_round_to_even(fn, dtype):
    grid = _grid_values(dtype)
    grid = grid[grid >= 0]
    mids = ((grid[:-1].astype(np.float64) + grid[1:]) / 2).astype(np.float32)
    ours = fn(mids)
    assert np.array_equal(ours, mids.astype(dtype).astype(np.float32))
    assert np.array_equal(fn(grid), grid)


def test_scales_are_e8m0_powers_of_two():
    rng = np.random.default_rng(1)
    amax = np.concatenate([np.exp(rng.uniform(-40, 40, 10_000)), 448.0 * 2.0 ** np.arange(-20, 20)]).astype(np.float32)
    s = quant.pow2_scale(amax, 448.0)
    expected = 2.0 ** np.ceil(np.log2(amax.astype(np.float64) / 448.0))
    assert np.array_equal(s, expected.astype(np.float32))
    assert np.array_equal(s.astype(ml_dtypes.float8_e8m0fnu).astype(np.float32), s)
    assert np.all(amax / s <= 448.0)


def test_act_quant_blocks_and_short_tail():
    rng = np.random.default_rng(2)
    x = (rng.standard_normal((7, 300)) * rng.uniform(0.01, 100, (7, 1))).astype(np.float32)
    q = quant.act_quant(x, 128)
    for lo, hi in ((0, 128), (128, 256), (256, 300)):
        blk = x[:, lo:hi]
        s = 2.0 ** np.ceil(np.log2(np.maximum(np.abs(blk).max(axis=1, keepdims=True), 1e-4) / 448.0))
        ref = (blk / s).astype(ml_dtypes.float8_e4m3fn).astype(np.float32) * s
        assert np.array_equal(q[:, lo:hi], ref.astype(np.float32))


def test_fp4_quant_matches_ml_dtypes():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((5, 128)).astype(np.float32)
    q = quant.fp4_quant(x, 32)
    blk = x.reshape(5, 4, 32)
    s = 2.0 ** np.ceil(np.log2(np.maximum(np.abs(blk).max(axis=-1, keepdims=True), 6 * 2.0 ** -126) / 6.0))
    ref = ((blk / s).astype(ml_dtypes.float4_e2m1fn).astype(np.float32) * s).reshape(5, 128)
    assert np.array_equal(q, ref)


def test_kv_round_leaves_rope_dims_alone():
    rng = np.random.default_rng(4)
    kv = rng.standard_normal((3, 512)).astype(np.float32)
    r = quant.kv_round(kv, 64)
    assert np.array_equal(r[:, 448:], kv[:, 448:])
    assert np.array_equal(r[:, :448], quant.act_quant(kv[:, :448], 64))
    assert not np.array_equal(r[:, :448], kv[:, :448])


@pytest.mark.parametrize("n", [1, 2, 16, 128])
def test_hadamard_is_orthonormal(n):
    h = quant.hadamard(n)
    assert np.allclose(h @ h.T, np.eye(n), atol=1e-6)
    assert np.all(np.abs(np.abs(h) - n ** -0.5) < 1e-7)


def test_rotation_preserves_dot_products():
    rng = np.random.default_rng(5)
    a, b = rng.standard_normal((2, 10, 128)).astype(np.float32)
    ra, rb = quant.rotate(a), quant.rotate(b)
    assert np.allclose((ra * rb).sum(-1), (a * b).sum(-1), rtol=1e-4, atol=1e-4)
    assert quant.rotate(np.ones((1, 24), np.float32)).shape == (1, 24)  # padded to 32, truncated
