"""Loader: safetensors parsing, name layouts, sharding, validation against the config, fp8/fp4 formats."""
import json
import math
import mmap
import os
import shutil
import struct
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from safetensors.numpy import load as safetensors_load, load_file, save_file

from dsv4rt.config import ConfigError
from dsv4rt.loader import (Checkpoint, CheckpointError, SafetensorsFile, dequant_fp4, dequant_fp8, e8m0_to_float32,
                           expected_shapes, quant_fp4, quant_fp8, scale_name, to_hf, to_official)
from dsv4rt.loader.safetensors import DTYPES, parse_header

_FIXTURE = Path(__file__).parent / "fixtures" / "tiny-a"
TINY = _FIXTURE if (_FIXTURE / "model.safetensors").is_file() else Path("/work/shared/golden/tiny-a")
HF_WEIGHTS = load_file(TINY / "model.safetensors")
OFFICIAL = {to_official(k): v for k, v in HF_WEIGHTS.items()}


def st_bytes(header, data: bytes = b"") -> bytes:
    h = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<Q", len(h)) + h + data


def write(path: Path, blob: bytes) -> Path:
    path.write_bytes(blob)
    return path


def make_ckpt(d: Path, tensors: dict, config: dict | None = None) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    cfg = config or json.loads((TINY / "config.json").read_text())
    (d / "config.json").write_text(json.dumps(cfg))
    save_file(tensors, str(d / "model.safetensors"))
    return d


def one_line_error(fn, *match) -> str:
    with pytest.raises(CheckpointError) as e:
        fn()
    msg = str(e.value)
    assert "\n" not in msg
    for m in match:
        assert m in msg, msg
    return msg


# --- safetensors files --------------------------------------------------------------------------

DTYPE_CASES = {
    "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16, "F8_E4M3": ml_dtypes.float8_e4m3fn,
    "F8_E8M0": ml_dtypes.float8_e8m0fnu, "I8": np.int8, "U8": np.uint8, "I32": np.int32, "I64": np.int64,
    "BOOL": np.bool_,
}


@pytest.mark.parametrize("code", DTYPE_CASES)
def test_round_trip_every_dtype(tmp_path, code):
    rng = np.random.default_rng(0)
    dt = np.dtype(DTYPE_CASES[code])
    bits = rng.integers(0, 256, size=(3, 5, dt.itemsize), dtype=np.uint8)
    if code == "BOOL":
        bits &= 1
    if code == "F8_E8M0":
        bits[bits == 255] = 7  # 255 is NaN
    a = bits.view(dt).reshape(3, 5)
    tensors = {"a": a, "scalar": np.array(7, dt) if code != "BOOL" else np.array(True), "empty": np.zeros((0, 4), dt)}
    save_file(tensors, str(tmp_path / "x.safetensors"))
    with SafetensorsFile(tmp_path / "x.safetensors") as f:
        for name, want in tensors.items():
            got = f.array(name)
            assert f.tensors[name].dtype == code
            assert got.dtype == want.dtype and got.shape == want.shape
            assert got.tobytes() == want.tobytes()


def test_arrays_are_zero_copy_views_of_the_mapping(tmp_path):
    save_file({"w": np.arange(12, dtype=np.float32).reshape(3, 4)}, str(tmp_path / "x.safetensors"))
    f = SafetensorsFile(tmp_path / "x.safetensors")
    a = f.array("w")
    assert not a.flags.owndata and not a.flags.writeable
    base = a
    while isinstance(base, np.ndarray):
        base = base.base
    assert isinstance(base, memoryview) and isinstance(base.obj, mmap.mmap)
    start = np.frombuffer(base.obj, np.uint8).ctypes.data
    assert a.ctypes.data == start + 8 + struct.unpack("<Q", base.obj[:8])[0]
    assert np.shares_memory(a, f.array("w"))
    f.close()  # must not fail while views are alive; the mapping outlives them
    assert a[2, 3] == 11


@pytest.mark.parametrize("size", [0, 5])
def test_file_too_short(tmp_path, size):
    p = write(tmp_path / "short.safetensors", b"\x01" * size)
    one_line_error(lambda: SafetensorsFile(p), "short.safetensors", f"{size} bytes", "too short")


def test_header_length_beyond_file(tmp_path):
    p = write(tmp_path / "long.safetensors", struct.pack("<Q", 1000) + b"{}")
    one_line_error(lambda: SafetensorsFile(p), "long.safetensors", "header length 1000", "10-byte file")


@pytest.mark.parametrize("header", [b"{not json", b'{"a": \xff}'])
def test_header_not_json(tmp_path, header):
    p = write(tmp_path / "bad.safetensors", st_bytes(header))
    one_line_error(lambda: SafetensorsFile(p), "bad.safetensors", "not valid JSON")


def test_header_not_an_object(tmp_path):
    p = write(tmp_path / "list.safetensors", st_bytes([1, 2]))
    one_line_error(lambda: SafetensorsFile(p), "list.safetensors", "not a JSON object")


def test_entry_not_an_object(tmp_path):
    p = write(tmp_path / "e.safetensors", st_bytes({"w": [1]}))
    one_line_error(lambda: SafetensorsFile(p), "e.safetensors", "'w'", "not a JSON object")


@pytest.mark.parametrize("field", ["dtype", "shape", "data_offsets"])
def test_entry_missing_field(tmp_path, field):
    entry = {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}
    del entry[field]
    p = write(tmp_path / "m.safetensors", st_bytes({"w.weight": entry}, bytes(8)))
    one_line_error(lambda: SafetensorsFile(p), "m.safetensors", "'w.weight'", f"missing '{field}'")


def test_unknown_dtype(tmp_path):
    p = write(tmp_path / "d.safetensors", st_bytes({"w": {"dtype": "Q3", "shape": [2], "data_offsets": [0, 2]}}, bytes(2)))
    one_line_error(lambda: SafetensorsFile(p), "d.safetensors", "'w'", "unknown dtype 'Q3'")


@pytest.mark.parametrize("shape", [[-1, 2], [2.0], ["2"], [True], 4])
def test_bad_shape(tmp_path, shape):
    p = write(tmp_path / "s.safetensors", st_bytes({"w": {"dtype": "U8", "shape": shape, "data_offsets": [0, 2]}}, bytes(2)))
    one_line_error(lambda: SafetensorsFile(p), "s.safetensors", "'w'", "invalid shape")


@pytest.mark.parametrize("offsets", [[0, 9], [-1, 1], [0], [0, 1.5]])
def test_offsets_out_of_range_or_malformed(tmp_path, offsets):
    p = write(tmp_path / "o.safetensors", st_bytes({"w": {"dtype": "U8", "shape": [1], "data_offsets": offsets}}, bytes(8)))
    one_line_error(lambda: SafetensorsFile(p), "o.safetensors", "'w'", "data_offsets")


def test_offsets_end_before_begin(tmp_path):
    p = write(tmp_path / "o.safetensors", st_bytes({"w": {"dtype": "U8", "shape": [0], "data_offsets": [4, 2]}}, bytes(8)))
    one_line_error(lambda: SafetensorsFile(p), "o.safetensors", "'w'", "end comes before its begin")


def test_overlapping_tensors(tmp_path):
    header = {"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
              "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}
    p = write(tmp_path / "ov.safetensors", st_bytes(header, bytes(12)))
    one_line_error(lambda: SafetensorsFile(p), "ov.safetensors", "'a' and 'b' overlap")


def test_byte_size_differs_from_shape(tmp_path):
    p = write(tmp_path / "n.safetensors", st_bytes({"w": {"dtype": "BF16", "shape": [3, 2], "data_offsets": [0, 10]}}, bytes(10)))
    one_line_error(lambda: SafetensorsFile(p), "n.safetensors", "'w'", "holds 10 bytes", "needs 12")


def test_duplicate_name_in_header(tmp_path):
    e = '{"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}'
    p = write(tmp_path / "dup.safetensors", st_bytes(f'{{"w": {e}, "w": {e}}}'.encode(), bytes(1)))
    one_line_error(lambda: SafetensorsFile(p), "dup.safetensors", "'w' appears twice")


_json = st.recursive(st.none() | st.booleans() | st.integers(-3, 40) | st.floats() | st.text(max_size=4),
                     lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=3), c, max_size=3),
                     max_leaves=8)
_entry = st.fixed_dictionaries({}, optional={
    "dtype": st.sampled_from(["F32", "BF16", "U8", "I64", "F8_E4M3", "X"]) | _json,
    "shape": st.lists(st.integers(-1, 4), max_size=3) | _json,
    "data_offsets": st.lists(st.integers(-2, 40), min_size=2, max_size=2) | _json,
})


@settings(max_examples=400, deadline=None)
@given(st.dictionaries(st.text(max_size=3), _entry | _json, max_size=4), st.integers(0, 40))
def test_random_headers_only_raise_checkpoint_error(header, data_len):
    blob = st_bytes(header, bytes(data_len))
    try:
        tensors, start = parse_header(blob, "h")
    except CheckpointError as e:
        assert "\n" not in str(e)
        return
    for t in tensors.values():
        assert 0 <= t.begin <= t.end <= data_len
        np.frombuffer(blob, np.uint8, t.end - t.begin, start + t.begin)


@st.composite
def _valid_header(draw):
    header, pos = {}, 0
    for i in range(draw(st.integers(0, 4))):
        dtype = draw(st.sampled_from(sorted(DTYPES)))
        shape = draw(st.lists(st.integers(0, 3), max_size=3))
        size = math.prod(shape) * DTYPES[dtype].itemsize
        header[f"t{i}"] = {"dtype": dtype, "shape": shape, "data_offsets": [pos, pos + size]}
        pos += size
    return header, pos


@settings(max_examples=300, deadline=None)
@given(_valid_header(), st.data())
def test_valid_headers_parse_and_any_corrupted_field_is_caught(header_end, data):
    header, end = header_end
    tensors, _ = parse_header(st_bytes(header, bytes(end)), "h")
    assert {k: {"dtype": t.dtype, "shape": list(t.shape), "data_offsets": [t.begin, t.end]}
            for k, t in tensors.items()} == header
    if header:
        entry = header[data.draw(st.sampled_from(sorted(header)))]
        entry[data.draw(st.sampled_from(sorted(entry)))] = data.draw(_json)
        try:
            parse_header(st_bytes(header, bytes(end)), "h")
        except CheckpointError as e:
            assert "\n" not in str(e)


@settings(max_examples=100, deadline=None)
@given(_valid_header(), st.integers(1, 5), st.data())
def test_bytes_that_belong_to_no_tensor_are_refused_like_the_safetensors_library(header_end, extra, data):
    """The format lets no byte of the data section go unindexed: a gap before any tensor, or bytes after the
    last, are refused here as the safetensors library refuses them."""
    header, end = header_end
    names = sorted(header, key=lambda k: header[k]["data_offsets"])
    shift_from = data.draw(st.integers(0, len(names)))  # tensors from this one on move up by `extra` bytes
    for name in names[shift_from:]:
        header[name]["data_offsets"] = [o + extra for o in header[name]["data_offsets"]]
    blob = st_bytes(header, bytes(end + extra))
    msg = one_line_error(lambda: parse_header(blob, "h"), "belong to no tensor",
                         "before tensor" if shift_from < len(names) else f"the last {extra} bytes")
    with pytest.raises(Exception):  # the reference reader agrees
        safetensors_load(blob)
    assert msg.startswith("h: ")


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=64), st.integers(0, 80))
def test_random_bytes_only_raise_checkpoint_error(tail, n):
    for blob in (tail, struct.pack("<Q", n) + tail):
        try:
            parse_header(blob, "h")
        except CheckpointError:
            pass


# --- names ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("hf, official", [
    ("model.embed_tokens.weight", "embed.weight"),
    ("head.weight", "head.weight"),
    ("lm_head.weight", "head.weight"),
    ("model.norm.weight", "norm.weight"),
    ("model.hc_head.hc_fn", "hc_head_fn"),
    ("model.hc_head.hc_base", "hc_head_base"),
    ("model.hc_head.hc_scale", "hc_head_scale"),
    ("model.layers.3.attn.norm.weight", "layers.3.attn.kv_norm.weight"),
    ("model.layers.3.attn.compressor.norm.weight", "layers.3.attn.compressor.norm.weight"),
    ("model.layers.3.attn.indexer.compressor.norm.weight", "layers.3.attn.indexer.compressor.norm.weight"),
    ("model.layers.3.hc_attn_scale", "layers.3.hc_attn_scale"),
    ("model.layers.0.ffn.experts.7.w2.weight", "layers.0.ffn.experts.7.w2.weight"),
    ("model.layers.0.attn.wq_a.weight_scale_inv", "layers.0.attn.wq_a.scale"),
])
def test_name_mapping(hf, official):
    assert to_official(hf) == official
    assert to_official(official) == official
    if hf != "lm_head.weight" and not hf.endswith("_inv"):  # accepted, never written
        assert to_hf(official) == hf


def test_mtp_tensors_are_ignored():
    assert to_official("mtp.0.attn.wq_a.weight") is None
    assert to_official("model.mtp.0.attn.wq_a.weight") is None


def test_every_expected_name_round_trips_through_hf():
    for n in expected_shapes(Checkpoint.open(TINY).config):
        assert to_official(to_hf(n)) == n
    for stored in HF_WEIGHTS:
        assert to_hf(to_official(stored)) == stored


def test_expected_shapes_of_tiny_a():
    with Checkpoint.open(TINY) as ck:
        shapes = expected_shapes(ck.config)
    assert shapes == {k: v.shape for k, v in OFFICIAL.items()}
    assert shapes["layers.2.attn.compressor.wkv.weight"] == (64, 64)   # c4a: two overlapping windows
    assert shapes["layers.3.attn.compressor.wkv.weight"] == (32, 64)   # c128a
    assert "layers.3.attn.indexer.wq_b.weight" not in shapes
    assert "layers.1.attn.compressor.ape" not in shapes                # sliding only
    assert shapes["layers.0.ffn.gate.tid2eid"] == (512, 2) and "layers.2.ffn.gate.tid2eid" not in shapes


# --- checkpoint folders ---------------------------------------------------------------------------

def test_tiny_a_opens_and_validates():
    with Checkpoint.open(TINY) as ck:
        ck.validate()
        assert ck.names() == sorted(OFFICIAL)
        assert ck.stored_dtype("layers.0.ffn.gate.tid2eid") == "I64"
        assert not ck.is_quantized("layers.0.attn.wq_a.weight")
        np.testing.assert_array_equal(ck.float32("layers.0.attn.kv_norm.weight"),
                                      HF_WEIGHTS["model.layers.0.attn.norm.weight"])


def test_both_layouts_give_the_same_table(tmp_path):
    names = sorted(HF_WEIGHTS)
    mixed = {(to_official(k) if i % 2 else k): v for i, k in enumerate(names) for v in [HF_WEIGHTS[k]]}
    with Checkpoint.open(TINY) as hf, Checkpoint.open(make_ckpt(tmp_path / "off", OFFICIAL)) as off, \
            Checkpoint.open(make_ckpt(tmp_path / "mix", mixed)) as mix:
        assert hf.names() == off.names() == mix.names() == sorted(OFFICIAL)
        for n in hf.names():
            assert hf.raw(n).tobytes() == off.raw(n).tobytes() == mix.raw(n).tobytes()
            assert hf.logical_shape(n) == off.logical_shape(n) == mix.logical_shape(n)
        off.validate()
        mix.validate()


def write_sharded(d: Path, tensors: dict, n_shards: int, rename=lambda i: f"model-{i:05d}.safetensors") -> dict:
    d.mkdir(parents=True, exist_ok=True)
    shutil.copy(TINY / "config.json", d / "config.json")
    wmap = {}
    names = sorted(tensors)
    for i in range(n_shards):
        part = {k: tensors[k] for k in names[i::n_shards]}
        (d / rename(i)).parent.mkdir(parents=True, exist_ok=True)
        save_file(part, str(d / rename(i)))
        wmap |= {k: rename(i) for k in part}
    index = {"metadata": {}, "weight_map": wmap}
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    return index


def test_sharded_checkpoint_through_index(tmp_path):
    index = write_sharded(tmp_path, HF_WEIGHTS, 3, lambda i: f"sub/m-{i}.safetensors" if i == 2 else f"m-{i}.safetensors")
    index["weight_map"]["model.norm.weight"] = "./" + index["weight_map"]["model.norm.weight"]
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with Checkpoint.open(tmp_path) as ck, Checkpoint.open(TINY) as ref:
        ck.validate()
        assert ck.names() == ref.names()
        for n in ck.names():
            assert ck.raw(n).tobytes() == ref.raw(n).tobytes()


def test_index_naming_a_tensor_its_shard_lacks(tmp_path):
    index = write_sharded(tmp_path, HF_WEIGHTS, 2)
    wmap = index["weight_map"]
    other = {"model-00000.safetensors": "model-00001.safetensors", "model-00001.safetensors": "model-00000.safetensors"}
    wmap["model.layers.0.attn.wq_a.weight"] = other[wmap["model.layers.0.attn.wq_a.weight"]]
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    one_line_error(lambda: Checkpoint.open(tmp_path), "'model.layers.0.attn.wq_a.weight'", "does not hold it")


@pytest.mark.parametrize("how", ["dotdot", "absolute", "symlink"])
def test_shard_escaping_the_folder(tmp_path, how):
    outside = tmp_path / "x.safetensors"
    save_file({"w": np.zeros(2, np.float32)}, str(outside))
    d = tmp_path / "ck"
    index = write_sharded(d, HF_WEIGHTS, 1)
    shard = {"dotdot": "../x.safetensors", "absolute": str(outside), "symlink": "link.safetensors"}[how]
    if how == "symlink":
        os.symlink(outside, d / "link.safetensors")
    index["weight_map"]["w"] = shard
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    one_line_error(lambda: Checkpoint.open(d), "model.safetensors.index.json", repr(shard), "outside the checkpoint folder")


def test_missing_shard(tmp_path):
    write_sharded(tmp_path, HF_WEIGHTS, 2)
    (tmp_path / "model-00001.safetensors").unlink()
    one_line_error(lambda: Checkpoint.open(tmp_path), "'model-00001.safetensors'", "does not exist")


def test_index_not_json(tmp_path):
    write_sharded(tmp_path, HF_WEIGHTS, 2)
    (tmp_path / "model.safetensors.index.json").write_text("{oops")
    one_line_error(lambda: Checkpoint.open(tmp_path), "model.safetensors.index.json", "cannot read the index")


def test_index_without_weight_map(tmp_path):
    write_sharded(tmp_path, HF_WEIGHTS, 2)
    (tmp_path / "model.safetensors.index.json").write_text('{"weight_map": {"a": 3}}')
    one_line_error(lambda: Checkpoint.open(tmp_path), "model.safetensors.index.json", "'weight_map'")


def test_any_safetensors_files_without_index(tmp_path):
    names = sorted(OFFICIAL)
    tmp_path.joinpath("config.json").write_text((TINY / "config.json").read_text())
    save_file({k: OFFICIAL[k] for k in names[:100]}, str(tmp_path / "a.safetensors"))
    save_file({k: OFFICIAL[k] for k in names[100:]}, str(tmp_path / "b.safetensors"))
    with Checkpoint.open(tmp_path) as ck:
        ck.validate()
        assert ck.names() == names


def test_folder_without_weights(tmp_path):
    shutil.copy(TINY / "config.json", tmp_path / "config.json")
    one_line_error(lambda: Checkpoint.open(tmp_path), str(tmp_path), "no model.safetensors")


def test_folder_that_does_not_exist(tmp_path):
    one_line_error(lambda: Checkpoint.open(tmp_path / "nope"), "nope", "does not exist")
    one_line_error(lambda: Checkpoint.open(TINY / "config.json"), "config.json", "not a folder")


def test_config_not_json(tmp_path):
    make_ckpt(tmp_path, {"w": np.zeros(1, np.float32)})
    (tmp_path / "config.json").write_text("{nope")
    with pytest.raises(ConfigError, match="not valid JSON"):
        Checkpoint.open(tmp_path)


def test_missing_tensors_are_all_named(tmp_path):
    gone = ["head.weight", "layers.2.attn.indexer.compressor.ape", "layers.4.ffn.experts.7.w3.weight"]
    with Checkpoint.open(make_ckpt(tmp_path, {k: v for k, v in OFFICIAL.items() if k not in gone})) as ck:
        msg = one_line_error(ck.validate, f"checkpoint {tmp_path} is missing 3 tensors")
    assert msg.endswith(": " + ", ".join(gone))


def test_config_disagrees_with_weights(tmp_path):
    cfg = json.loads((TINY / "config.json").read_text()) | {"q_lora_rank": 32}
    with Checkpoint.open(make_ckpt(tmp_path, OFFICIAL, cfg)) as ck:
        one_line_error(ck.validate, "config disagrees with weights: layers.0.attn.wq_a.weight is [48, 64], "
                                    "config implies [32, 64]", "more")


def test_unexpected_tensor(tmp_path):
    extra = OFFICIAL | {"layers.6.attn.wq_a.weight": OFFICIAL["layers.0.attn.wq_a.weight"]}
    with Checkpoint.open(make_ckpt(tmp_path, extra)) as ck:
        one_line_error(ck.validate, "holds 1 tensor the config does not expect: layers.6.attn.wq_a.weight")


def test_mtp_tensors_are_skipped(tmp_path):
    cfg = json.loads((TINY / "config.json").read_text())
    assert cfg["num_nextn_predict_layers"] == 1
    w = OFFICIAL["norm.weight"]
    extra = OFFICIAL | {"mtp.0.norm.weight": w, "model.mtp.0.enorm.weight": w, "model.layers.5.attn_norm.weight": w}
    with Checkpoint.open(make_ckpt(tmp_path, extra)) as ck:
        ck.validate()
        assert ck.names() == sorted(OFFICIAL)


def test_two_names_for_one_tensor(tmp_path):
    dup = HF_WEIGHTS | {"norm.weight": HF_WEIGHTS["model.norm.weight"]}
    one_line_error(lambda: Checkpoint.open(make_ckpt(tmp_path, dup)), "'model.norm.weight'", "'norm.weight'", "are both")


def test_hash_table_must_be_integer_and_in_range(tmp_path):
    name = "layers.1.ffn.gate.tid2eid"
    with Checkpoint.open(make_ckpt(tmp_path / "f", OFFICIAL | {name: OFFICIAL[name].astype(np.float32)})) as ck:
        one_line_error(ck.validate, name, "must hold integers, found F32")
    with Checkpoint.open(make_ckpt(tmp_path / "r", OFFICIAL | {name: OFFICIAL[name] + 8})) as ck:
        one_line_error(ck.validate, name, "expert ids outside [0, 8)")


def test_unknown_tensor_name(tmp_path):
    with Checkpoint.open(TINY) as ck:
        one_line_error(lambda: ck.raw("layers.0.nothing"), "has no tensor 'layers.0.nothing'")


# --- fp8 / fp4 formats ----------------------------------------------------------------------------

def finite_e4m3(rng, shape):
    b = rng.integers(0, 256, size=shape, dtype=np.uint8)
    b[(b & 0x7F) == 0x7F] = 0x42  # 0x7f / 0xff are NaN
    return b.view(ml_dtypes.float8_e4m3fn)


def e8m0(rng, shape, lo=110, hi=140):
    return rng.integers(lo, hi, size=shape, dtype=np.uint8).view(ml_dtypes.float8_e8m0fnu)


def test_e8m0_decoding():
    b = np.array([0, 1, 126, 127, 128, 254, 255], np.uint8)
    want = np.array([2.0 ** -127, 2.0 ** -126, .5, 1, 2, 2.0 ** 127, np.nan], np.float32)
    np.testing.assert_array_equal(e8m0_to_float32(b), want)
    np.testing.assert_array_equal(e8m0_to_float32(b.view(ml_dtypes.float8_e8m0fnu)), want)
    np.testing.assert_array_equal(e8m0_to_float32(b.view(ml_dtypes.float8_e8m0fnu)),
                                  b.view(ml_dtypes.float8_e8m0fnu).astype(np.float32))


def test_fp8_dequant_matches_ml_dtypes():
    rng = np.random.default_rng(1)
    w, s = finite_e4m3(rng, (200, 300)), e8m0(rng, (2, 3))
    want = np.empty((200, 300), np.float32)
    for i in range(200):
        for j in range(300):
            want[i, j] = float(w[i, j]) * 2.0 ** (int(s.view(np.uint8)[i // 128, j // 128]) - 127)
    np.testing.assert_array_equal(dequant_fp8(w, s), want)
    np.testing.assert_array_equal(dequant_fp8(w, s.astype(np.float32)), want)  # float scales too


def test_fp8_scale_shape_is_checked():
    with pytest.raises(ValueError, match=r"needs a scale of \[2, 3\], got \[2, 2\]"):
        dequant_fp8(np.zeros((200, 300), ml_dtypes.float8_e4m3fn), np.zeros((2, 2), np.float32))


def test_fp4_dequant_matches_ml_dtypes():
    rng = np.random.default_rng(2)
    packed, s = rng.integers(-128, 128, size=(5, 48), dtype=np.int8), e8m0(rng, (5, 3))
    b = packed.view(np.uint8)
    codes = np.stack([b & 15, b >> 4], axis=-1).reshape(5, 96)  # even column from the low nibble
    values = codes.view(ml_dtypes.float4_e2m1fn).astype(np.float32)
    scale = np.repeat(s.astype(np.float32), 32, axis=1)
    np.testing.assert_array_equal(dequant_fp4(packed, s), values * scale)
    np.testing.assert_array_equal(dequant_fp4(b, s), values * scale)  # U8 storage


def test_fp4_nibble_order():
    one = np.array([127], np.uint8).view(ml_dtypes.float8_e8m0fnu).reshape(1, 1)
    packed = np.array([[0x21, 0xF8, 0x7C]], np.uint8).view(np.int8)
    np.testing.assert_array_equal(dequant_fp4(packed, one), [[0.5, 1.0, -0.0, -6.0, -2.0, 6.0]])


def test_fp8_encoder_round_trip_on_grid_is_exact():
    rng = np.random.default_rng(3)
    exps = rng.integers(-20, 20, size=(3, 2))
    grid = finite_e4m3(rng, (300, 200)).astype(np.float32)
    grid[::128, ::128] = 448.0  # each block's amax is 448 * its scale, so the encoder picks exactly that scale
    x = grid * np.ldexp(1.0, np.repeat(np.repeat(exps, 128, 0), 128, 1)[:300, :200]).astype(np.float32)
    q, s = quant_fp8(x)
    assert q.dtype == ml_dtypes.float8_e4m3fn and s.dtype == ml_dtypes.float8_e8m0fnu and s.shape == (3, 2)
    np.testing.assert_array_equal(s.view(np.uint8), exps + 127)
    np.testing.assert_array_equal(dequant_fp8(q, s), x)


def test_fp4_encoder_round_trip_on_grid_is_exact():
    rng = np.random.default_rng(4)
    exps = rng.integers(-20, 20, size=(4, 3))
    grid = rng.choice(np.array([0, .5, 1, 1.5, 2, 3, 4, 6, -.5, -1, -1.5, -2, -3, -4, -6], np.float32), (4, 70))
    grid[:, ::32] = -6.0
    x = grid * np.ldexp(1.0, np.repeat(exps, 32, 1)[:, :70]).astype(np.float32)
    q, s = quant_fp4(x)
    assert q.dtype == np.int8 and q.shape == (4, 35) and s.shape == (4, 3)
    np.testing.assert_array_equal(s.view(np.uint8), exps + 127)
    np.testing.assert_array_equal(dequant_fp4(q, s), x)


@settings(max_examples=50, deadline=None)
@given(st.integers(1, 300), st.integers(1, 150), st.integers(-30, 30), st.integers(0, 2 ** 32 - 1))
def test_encoders_are_fixed_points_after_one_pass(rows, half_cols, exp, seed):
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((rows, 2 * half_cols)) * 2.0 ** exp).astype(np.float32)
    x[rng.random(x.shape) < 0.1] = 0
    # half a step of the grid: relative for normals, absolute (in units of the block scale) for subnormals
    formats = ((quant_fp8, dequant_fp8, np.uint8(0x38), 2 ** -4, 2 ** -10), (quant_fp4, dequant_fp4, 0x22, 2 ** -2, 2 ** -2))
    for quant, dequant, one, rel, sub in formats:
        q, s = quant(x)
        y = dequant(q, s)
        np.testing.assert_array_equal(dequant(*quant(y)), y)
        scale = dequant(np.full_like(q.view(np.uint8), one).view(q.dtype), s)
        assert np.all(np.abs(y - x) <= rel * np.abs(x) + sub * scale)


def test_partial_and_zero_blocks_get_their_own_scale():
    x = np.zeros((130, 129), np.float32)
    x[:128, :128] = 448.0
    x[129, 128] = 0.75
    q, s = quant_fp8(x)
    np.testing.assert_array_equal(s.view(np.uint8), [[127, 1], [1, 127 - 9]])  # 0.75 / 2^-9 = 384 <= 448
    np.testing.assert_array_equal(dequant_fp8(q, s), x)


def quantize_official(tensors: dict) -> dict:
    out = {}
    for n, v in tensors.items():
        if ".experts." in n and "shared" not in n:
            out[n], out[scale_name(n)] = quant_fp4(v)
        elif n.endswith(".weight") and v.ndim == 2 and any(k in n for k in ("wq_", "attn.wkv.", "wo_b", "shared")):
            out[n], out[scale_name(n)] = quant_fp8(v)
        else:
            out[n] = v
    return out


def test_quantized_checkpoint(tmp_path):
    stored = quantize_official(OFFICIAL)
    with Checkpoint.open(make_ckpt(tmp_path, stored)) as ck:
        ck.validate()
        fp8, fp4 = "layers.2.attn.wq_b.weight", "layers.4.ffn.experts.3.w2.weight"
        assert ck.stored_dtype(fp8) == "F8_E4M3" and ck.quant_format(fp8) == "fp8"
        assert ck.stored_dtype(fp4) == "I8" and ck.quant_format(fp4) == "fp4"
        assert ck.stored_dtype(scale_name(fp4)) == "F8_E8M0"
        assert not ck.is_quantized("layers.2.attn.compressor.wkv.weight")
        assert ck.raw(fp4).shape == (64, 16) and ck.logical_shape(fp4) == (64, 32)
        np.testing.assert_array_equal(ck.float32(fp8), dequant_fp8(stored[fp8], stored[scale_name(fp8)]))
        np.testing.assert_array_equal(ck.float32(fp4), dequant_fp4(stored[fp4], stored[scale_name(fp4)]))
        x = OFFICIAL[fp8]
        assert np.abs(ck.float32(fp8) - x).max() <= np.abs(x).max() / 16


def test_quantized_weight_without_scale(tmp_path):
    name = "layers.2.attn.wq_b.weight"
    stored = quantize_official(OFFICIAL)
    del stored[scale_name(name)]
    with Checkpoint.open(make_ckpt(tmp_path, stored)) as ck:
        one_line_error(ck.validate, f"fp8 weight {name} has no scale tensor layers.2.attn.wq_b.scale")
        msg = one_line_error(lambda: ck.float32(name), "has no scale tensor")
        assert msg.count("checkpoint") == 1


def test_quantized_weight_with_wrong_scale_shape(tmp_path):
    name = "layers.4.ffn.experts.0.w1.weight"
    stored = quantize_official(OFFICIAL) | {"layers.4.ffn.experts.0.w1.scale": np.zeros((32, 1), np.float32)}
    with Checkpoint.open(make_ckpt(tmp_path, stored)) as ck:
        one_line_error(ck.validate, name, "needs a scale of [32, 2]", "found F32 [32, 1]")
        one_line_error(lambda: ck.float32(name), name, "needs a scale of [32, 2], got [32, 1]")


# --- files that are not what they claim -----------------------------------------------------------

def test_header_with_an_absurdly_long_integer(tmp_path):
    """Python's own parser would refuse it with advice about its digit limit, naming no file."""
    header = b'{"w": {"dtype": "U8", "shape": [' + b"9" * 5000 + b'], "data_offsets": [0, 1]}}'
    p = write(tmp_path / "big.safetensors", st_bytes(header, bytes(1)))
    msg = one_line_error(lambda: SafetensorsFile(p))
    assert msg == f"{p}: header is not valid JSON (an integer of 5000 digits)"


def test_index_with_an_absurdly_long_integer(tmp_path):
    d = make_ckpt(tmp_path / "m", OFFICIAL)
    (d / "model.safetensors").rename(d / "a.safetensors")
    (d / "model.safetensors.index.json").write_text('{"metadata": {"total_size": ' + "9" * 5000 + "}}")
    msg = one_line_error(lambda: Checkpoint.open(d))
    assert msg == f"{d / 'model.safetensors.index.json'}: cannot read the index (an integer of 5000 digits)"


@pytest.mark.parametrize("kind, layout", [("FIFO", "single"), ("FIFO", "sharded"), ("folder", "single"),
                                          ("folder", "sharded"), ("character device", "single")])
def test_special_file_named_like_a_shard(tmp_path, kind, layout):
    d = make_ckpt(tmp_path / "m", OFFICIAL)
    (d / "model.safetensors").unlink()
    name = "model.safetensors" if layout == "single" else "model-00001-of-00001.safetensors"
    if layout == "sharded":
        (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"embed.weight": name}}))
    if kind == "FIFO":
        os.mkfifo(d / name)  # reading it would wait for a writer forever
    elif kind == "folder":
        (d / name).mkdir()
    else:
        (d / name).symlink_to("/dev/zero")  # a shard of an index may not point outside the folder
    assert one_line_error(lambda: Checkpoint.open(d)) == f"{d / name}: is a {kind}, not a regular file"


def test_index_that_is_a_fifo(tmp_path):
    d = make_ckpt(tmp_path / "m", OFFICIAL)
    (d / "model.safetensors").rename(d / "a.safetensors")
    os.mkfifo(d / "model.safetensors.index.json")
    msg = one_line_error(lambda: Checkpoint.open(d))
    assert msg == f"{d / 'model.safetensors.index.json'}: is a FIFO, not a regular file"


def test_file_cut_short_under_the_mapping(tmp_path):
    p = tmp_path / "x.safetensors"
    save_file({"a": np.arange(1024, dtype=np.float32), "b": np.arange(1024, dtype=np.float32)}, str(p))
    size = p.stat().st_size
    with SafetensorsFile(p) as f:
        assert f.array("a")[5] == 5
        os.truncate(p, 100)  # reading b's pages now would end the process with SIGBUS
        msg = one_line_error(lambda: f.array("b"), str(p), "changed while open")
        assert msg == f"{p}: changed while open ({size} bytes when opened, now 100); reopen the checkpoint"


def test_file_rewritten_in_place_under_the_mapping(tmp_path):
    p = tmp_path / "x.safetensors"
    save_file({"a": np.zeros(16, np.float32)}, str(p))
    with SafetensorsFile(p) as f:
        blob = p.read_bytes()
        with open(p, "r+b") as w:  # the same size, other weights
            w.write(blob[:-4] + b"\x00\x00\x80\x3f")
        st = p.stat()
        os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))  # coarse clocks could keep the old time
        one_line_error(lambda: f.array("a"), str(p), "changed while open")


def test_checkpoint_reads_refuse_a_changed_shard(tmp_path):
    d = make_ckpt(tmp_path / "m", OFFICIAL)
    with Checkpoint.open(d) as ck:
        os.truncate(d / "model.safetensors", 4096)
        one_line_error(lambda: ck.float32("embed.weight"), "model.safetensors", "changed while open")
