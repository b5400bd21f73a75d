"""The 584-byte KV entry and the 68-byte indexer key, byte for byte."""
import ml_dtypes
import numpy as np
import pytest

from dsv4rt.reference import layouts, quant


def random_rows(rng, n, d):
    scale = np.exp(rng.uniform(-8, 6, (n, 1))).astype(np.float32)
    x = (rng.standard_normal((n, d)) * scale).astype(np.float32)
    x[0] = 0  # an all-zero row takes the floor scale
    return x


def test_entry_sizes():
    assert layouts.kv_entry_bytes(512, 64) == 584
    assert layouts.indexer_entry_bytes(128) == 68


def test_kv_entry_bytes_and_round_trip():
    rng = np.random.default_rng(0)
    kv = random_rows(rng, 50, 512)
    e = layouts.encode_kv(kv, 64)
    assert e.shape == (50, 584) and e.dtype == np.uint8
    s = 2.0 ** np.ceil(np.log2(np.maximum(np.abs(kv[:, :448]).reshape(50, 7, 64).max(-1), 1e-4) / 448))
    assert np.array_equal(e[:, 576:583], (np.log2(s) + 127).astype(np.uint8))
    fp8 = (kv[:, :448] / np.repeat(s, 64, axis=1)).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    assert np.array_equal(e[:, :448], fp8)
    assert np.array_equal(e[:, 448:576], kv[:, 448:].astype(ml_dtypes.bfloat16).view(np.uint8).reshape(50, 128))
    assert np.all(e[:, 583] == 0)
    back = layouts.decode_kv(e, 512, 64)
    assert np.array_equal(back[:, :448], quant.kv_round(kv, 64)[:, :448])
    assert np.array_equal(back[:, 448:], kv[:, 448:].astype(ml_dtypes.bfloat16).astype(np.float32))


@pytest.mark.parametrize("hd, rd", [(32, 16), (96, 32)])
def test_kv_entry_odd_sizes(hd, rd):
    kv = random_rows(np.random.default_rng(hd), 9, hd)
    e = layouts.encode_kv(kv, rd)
    assert e.shape[1] == layouts.kv_entry_bytes(hd, rd) and e.shape[1] % 8 == 0
    assert np.array_equal(layouts.decode_kv(e, hd, rd)[:, :hd - rd], quant.kv_round(kv, rd)[:, :hd - rd])


@pytest.mark.parametrize("dim", [128, 16])
def test_indexer_key_round_trip_equals_the_reference_rounding(dim):
    k = random_rows(np.random.default_rng(dim), 40, dim)
    e = layouts.encode_indexer_key(k)
    assert e.shape == (40, layouts.indexer_entry_bytes(dim))
    assert np.array_equal(layouts.decode_indexer_key(e, dim), quant.indexer_round(k))


def test_indexer_nibble_order_and_scales():
    entry = np.zeros((1, 68), np.uint8)
    entry[0, 0] = 0x21           # value 0: code 1 (0.5), value 1: code 2 (1.0)
    entry[0, 1] = 0xF9           # value 2: code 9 (-0.5), value 3: code 15 (-6)
    entry[0, 64:68] = [127, 128, 126, 130]
    v = layouts.decode_indexer_key(entry, 128)[0]
    assert v[:4].tolist() == [0.5, 1.0, -0.5, -6.0]
    assert v[32] == 0 and np.signbit(v[4]) == 0
    entry[0, 16] = 0x07          # value 32 (second block, scale 2): code 7 (6) -> 12
    assert layouts.decode_indexer_key(entry, 128)[0, 32] == 12.0
