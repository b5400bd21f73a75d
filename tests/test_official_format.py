"""`make-tiny --format official`: fp8/fp4 weights with e8m0 block scales, sharded with an index, as released."""
import json
import re

import ml_dtypes
import numpy as np
import pytest

from conftest import FIXTURES, rel_rows
from test_cli import dsv4rt

from dsv4rt.loader import Checkpoint, e8m0_to_float32, fp4_scale_shape, fp8_scale_shape, scale_name
from dsv4rt.reference import load_model
from dsv4rt.tiny import make_tiny

SEED = 3
FP8 = ["layers.0.attn.wq_a.weight", "layers.1.attn.wq_b.weight", "layers.2.attn.wkv.weight",
       "layers.0.attn.wo_a.weight", "layers.0.attn.wo_b.weight", "layers.2.attn.indexer.wq_b.weight",
       "layers.1.ffn.shared_experts.w2.weight"]
FP4 = ["layers.0.ffn.experts.0.w1.weight", "layers.1.ffn.experts.3.w2.weight", "layers.2.ffn.experts.2.w3.weight"]
BF16 = ["embed.weight", "head.weight", "norm.weight", "layers.2.attn.q_norm.weight",
        "layers.0.attn.compressor.wkv.weight", "layers.2.attn.indexer.compressor.wgate.weight",
        "layers.2.attn.indexer.weights_proj.weight", "layers.1.ffn.gate.weight", "layers.1.attn_norm.weight"]
FP32 = ["layers.0.attn.compressor.ape", "layers.1.attn.attn_sink", "layers.2.ffn.gate.bias", "layers.0.hc_attn_fn",
        "layers.2.hc_ffn_base", "hc_head_scale"]
# every weight the released checkpoints store in fp8; the routed experts are all fp4
FP8_PATTERN = re.compile(r"\.attn\.(wq_a|wq_b|wkv|wo_a|wo_b|indexer\.wq_b)\.weight$|\.shared_experts\.w[123]\.weight$")
# round to nearest on e4m3 (3 mantissa bits) moves a normal value by at most 2^-4 of itself, so no row moves more
E4M3_BOUND = 2.0 ** -4
# e2m1 (1 mantissa bit) moves a normal value by up to 1/5 of itself (1.25 -> 1 or 1.5) and flushes values under
# a quarter of the scale to 0, which hold a small share of a row's norm: measured 12% per row (median), 17% worst
E2M1_BOUND = 0.25


@pytest.fixture(scope="module")
def official(tmp_path_factory):
    out = tmp_path_factory.mktemp("official") / "tiny"
    r = dsv4rt("make-tiny", out, "--preset", "tiny", "--seed", SEED, "--format", "official", "--shard-gb", 0.001)
    assert r.returncode == 0, r.stderr
    return out


@pytest.fixture(scope="module")
def bf16(tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp("bf16") / "tiny", "tiny", SEED)


@pytest.fixture(scope="module")
def faithful(official):
    return load_model(official, "faithful")


@pytest.fixture(scope="module")
def ids():
    return np.random.default_rng(0).integers(0, 129280, 32)


@pytest.fixture(scope="module")
def faithful_logits(faithful, ids):
    return faithful.logits_chunked(ids, None)


def test_stored_dtypes_are_the_released_ones(official):
    with Checkpoint.open(official) as ck:
        for n in FP8:
            assert (ck.stored_dtype(n), ck.stored_dtype(scale_name(n))) == ("F8_E4M3", "F8_E8M0"), n
            assert ck.raw(scale_name(n)).shape == fp8_scale_shape(ck.logical_shape(n))
        for n in FP4:
            assert (ck.stored_dtype(n), ck.stored_dtype(scale_name(n))) == ("I8", "F8_E8M0"), n
            out, cols = ck.logical_shape(n)
            assert ck.raw(n).shape == (out, cols // 2)
            assert ck.raw(scale_name(n)).shape == fp4_scale_shape((out, cols))
        assert all(ck.stored_dtype(n) == "BF16" for n in BF16)
        assert all(ck.stored_dtype(n) == "F32" for n in FP32)
        assert ck.stored_dtype("layers.0.ffn.gate.tid2eid") == "I32"
        weights = [n for n in ck.names() if n.endswith(".weight")]
        assert {n for n in weights if ck.quant_format(n) == "fp8"} == {n for n in weights if FP8_PATTERN.search(n)}
        assert {n for n in weights if ck.quant_format(n) == "fp4"} == {n for n in weights if ".ffn.experts." in n}
    cfg = json.loads((official / "config.json").read_text())
    flash = json.loads((FIXTURES / "configs" / "deepseek-v4-flash.json").read_text())
    assert cfg["quantization_config"] == flash["quantization_config"]
    assert cfg["expert_dtype"] == "fp4"


def test_wo_a_is_fp8_with_block_scales(official, bf16):
    """wo_a [G·o_lora, (H/G)·hd] as released: e4m3 with one e8m0 scale per 128 x 128 tile; the tiny model's rows
    are a single partial tile, scaled by its own largest element."""
    with Checkpoint.open(official) as q, Checkpoint.open(bf16) as b:
        for i in range(q.config.num_layers):
            n = f"layers.{i}.attn.wo_a.weight"
            w, scale = q.raw(n), q.raw(scale_name(n))
            assert w.dtype == ml_dtypes.float8_e4m3fn and w.shape == b.logical_shape(n) == (32, 64), n
            assert scale.shape == (1, 1) and q.stored_dtype(scale_name(n)) == "F8_E8M0", n
            amax = np.abs(b.float32(n)).max()
            assert amax / 448 <= e8m0_to_float32(scale)[0, 0] < amax / 224, n
            assert rel_rows(q.float32(n), b.float32(n)).max() < E4M3_BOUND, n


def test_shards_and_index(official):
    index = json.loads((official / "model.safetensors.index.json").read_text())
    wmap = index["weight_map"]
    shards = sorted(p.name for p in official.glob("*.safetensors"))
    assert len(shards) >= 3
    assert shards == [f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)]
    assert set(wmap.values()) == set(shards)
    with Checkpoint.open(official) as ck:
        ck.validate()
        assert set(wmap) == set(ck.names())
        assert index["metadata"]["total_size"] == sum(ck.raw(n).nbytes for n in ck.names())
        assert all(wmap[scale_name(n)] == wmap[n] for n in ck.names() if ck.is_quantized(n))


def test_dequantised_weights_are_the_bf16_draws_within_quantisation_error(official, bf16):
    worst = {"fp8": 0.0, "fp4": 0.0}
    with Checkpoint.open(official) as q, Checkpoint.open(bf16) as b:
        for n in q.names():
            fmt = q.quant_format(n)
            if fmt:
                worst[fmt] = max(worst[fmt], rel_rows(q.float32(n), b.float32(n)).max())
            elif not n.endswith(".scale"):
                np.testing.assert_array_equal(q.raw(n), b.raw(n))
    assert 0 < worst["fp8"] < E4M3_BOUND and 0 < worst["fp4"] < E2M1_BOUND, worst


def test_inspect_lists_quantised_dtypes(official):
    r = dsv4rt("inspect", official)
    assert r.returncode == 0, r.stderr
    assert re.search(r"^layers\.2\.attn\.wq_a\.weight +F8_E4M3 +\[32, 32\]$", r.stdout, re.M)
    assert re.search(r"^layers\.2\.attn\.wq_a\.scale +F8_E8M0 +\[1, 1\]$", r.stdout, re.M)
    assert re.search(r"^layers\.1\.ffn\.experts\.0\.w2\.weight +I8 +\[32, 32\]$", r.stdout, re.M)


def test_logits_default_to_faithful_numerics(official, faithful_logits, ids, tmp_path):
    np.save(tmp_path / "ids.npy", ids)
    r = dsv4rt("logits", official, "--ids", tmp_path / "ids.npy", "--out", tmp_path / "o.npy", "--device", "cpu")
    assert r.returncode == 0, r.stderr
    cli = np.load(tmp_path / "o.npy")
    assert rel_rows(cli, faithful_logits).max() < 1e-6
    assert rel_rows(cli, load_model(official, "exact").logits_chunked(ids, None)).max() > 1e-3


def test_faithful_prefill_is_chunking_invariant(faithful, faithful_logits, ids):
    assert rel_rows(faithful.logits_chunked(ids, [5, 1, 26]), faithful_logits).max() <= 5e-5
