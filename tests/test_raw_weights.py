"""load_weights(raw=True): fp8/fp4 weights and their e8m0 block scales go to the device as released (wo_a
included); every other tensor as the default conversion gives it; float scales that are powers of two become
e8m0."""
import shutil

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save_file

from dsv4rt.loader import Checkpoint, CheckpointError, e8m0_to_float32, expected_shapes, scale_name
from dsv4rt.cuda.arena import ALIGN
from dsv4rt.loader.upload import layout
from dsv4rt.model.weights import E8M0, Converted, e8m0_bytes, load_weights
from dsv4rt.tiny import make_tiny

BF16 = ml_dtypes.bfloat16
FP8, FP4 = "layers.1.attn.wq_b.weight", "layers.2.ffn.experts.3.w2.weight"


@pytest.fixture(scope="module")
def official(tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp("raw") / "tiny", "tiny", 5, fmt="official", shard_gb=0.001)


@pytest.fixture(scope="module")
def ck(official):
    with Checkpoint.open(official) as c:
        c.validate()
        yield c


def quantized(ck) -> list[str]:
    """The weights a raw upload keeps as stored."""
    return [n for n in expected_shapes(ck.config) if ck.is_quantized(n)]


@pytest.mark.parametrize("dtype", [np.float32, BF16])
def test_raw_source_holds_the_stored_bytes(ck, dtype):
    raw, default = Converted(ck, dtype, keep_quantized=True), Converted(ck, dtype)
    q = quantized(ck)
    assert FP8 in q and FP4 in q
    assert raw.names() == list(expected_shapes(ck.config)) + sorted(scale_name(n) for n in q)
    for n in raw.names():
        got = raw.raw(n)
        if n in q or n.endswith(".scale"):
            stored = ck.raw(n)
            assert got.dtype == stored.dtype and got.shape == stored.shape, n
            assert np.shares_memory(got, stored), n  # a view of the mapped file, no copy on the host either
        else:
            want = default.raw(n)
            assert got.dtype == want.dtype and got.tobytes() == want.tobytes(), n
    assert raw.raw(FP8).dtype == ml_dtypes.float8_e4m3fn and raw.raw(FP8).shape == ck.logical_shape(FP8)
    assert raw.raw(FP4).dtype == np.int8 and raw.raw(FP4).shape == (ck.logical_shape(FP4)[0],
                                                                    ck.logical_shape(FP4)[1] // 2)
    assert raw.raw(scale_name(FP4)).dtype == E8M0


def test_wo_a_stays_fp8(ck):
    """wo_a, fp8 as released though its input is not act_quant-ed, goes up as stored: the W8A16 GEMM reads it."""
    wo_a = [n for n in expected_shapes(ck.config) if n.endswith(".attn.wo_a.weight")]
    assert len(wo_a) == ck.config.num_layers and set(wo_a) <= set(quantized(ck))
    raw = Converted(ck, BF16, keep_quantized=True)
    for n in wo_a:
        assert ck.quant_format(n) == "fp8" and raw.raw(n).dtype == ml_dtypes.float8_e4m3fn, n
        assert raw.raw(scale_name(n)).dtype == E8M0, n


def test_raw_layout_has_no_dequantised_copy(ck):
    """The device buffer holds the stored bytes of each quantised weight and its scales in place of the
    dequantised copy, nothing more."""
    raw, default = Converted(ck, BF16, keep_quantized=True), Converted(ck, BF16)
    aligned = lambda a: -(-a.nbytes // ALIGN) * ALIGN  # noqa: E731
    q = quantized(ck)
    _, raw_total = layout(raw, raw.names())
    _, default_total = layout(default, default.names())
    stored = sum(aligned(ck.raw(n)) + aligned(ck.raw(scale_name(n))) for n in q)
    assert raw_total == default_total - sum(aligned(default.raw(n)) for n in q) + stored < default_total


def test_default_source_is_unchanged(ck):
    src = Converted(ck, BF16)
    assert src.names() == list(expected_shapes(ck.config))
    assert src.raw(FP8).dtype == BF16 and src.raw(FP4).shape == ck.logical_shape(FP4)
    np.testing.assert_array_equal(src.raw(FP4).astype(np.float32), ck.float32(FP4).astype(BF16).astype(np.float32))


def test_float_scales_become_e8m0(ck, official, tmp_path):
    """The same checkpoint with its scales written as float32: the raw source gives the same e8m0 bytes."""
    tensors = {n: np.array(ck.raw(n)) for n in ck.names()}
    for n in ck.names():
        if n.endswith(".scale"):
            tensors[n] = e8m0_to_float32(tensors[n])
    folder = tmp_path / "float-scales"
    folder.mkdir()
    save_file(tensors, str(folder / "model.safetensors"))
    shutil.copyfile(official / "config.json", folder / "config.json")
    with Checkpoint.open(folder) as floats:
        floats.validate()
        assert floats.stored_dtype(scale_name(FP4)) == "F32"
        src, want = Converted(floats, BF16, keep_quantized=True), Converted(ck, BF16, keep_quantized=True)
        for n in want.names():
            if n.endswith(".scale"):
                got = src.raw(n)
                assert got.dtype == E8M0 and got.tobytes() == want.raw(n).view(np.uint8).tobytes(), n


def test_e8m0_bytes_of_every_exponent():
    byte = np.arange(255, dtype=np.uint8)
    floats = e8m0_to_float32(byte)
    assert np.array_equal(e8m0_bytes(floats, "s").view(np.uint8), byte)
    assert np.array_equal(e8m0_bytes(floats.astype(BF16), "s").view(np.uint8), byte)
    assert e8m0_bytes(byte, "s") is byte  # raw bytes pass as they are


@pytest.mark.parametrize("bad", [0.75, 0.0, -1.0, np.inf, np.nan])
def test_scales_without_e8m0_form_are_refused(bad):
    scale = np.array([[1.0, bad]], np.float32)
    with pytest.raises(CheckpointError, match="s.scale: block scales that are not powers of two"):
        e8m0_bytes(scale, "s.scale")


def test_load_weights_refuses_other_build_types():
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        load_weights(None, np.float16, None, None, raw=True)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [np.float32, BF16])
def test_device_bytes_equal_the_file_bytes(rt, ck, dtype):
    """Read back from the device: quantised weights and scales byte for byte as in the safetensors files, the rest
    as the default upload holds it."""
    w = load_weights(ck, dtype, rt.arena, rt.stream, raw=True)
    default = Converted(ck, dtype)
    q = set(quantized(ck))
    try:
        assert set(w.arrays) == set(expected_shapes(ck.config)) | {scale_name(n) for n in q}
        for n, arr in w.arrays.items():
            back = arr.to_host()
            want = ck.raw(n) if n in q or n.endswith(".scale") else default.raw(n)
            assert back.dtype == want.dtype and back.shape == want.shape, n
            assert back.tobytes() == want.tobytes(), n
            if n in q or n.endswith(".scale"):
                f, stored = ck._slot(n)  # the bytes in the file itself, through its header's offsets
                info = f.tensors[stored]
                with open(f.path, "rb") as fh:
                    fh.seek(f._data + info.begin)
                    assert back.tobytes() == fh.read(info.end - info.begin), n
    finally:
        w.buffer.free()
