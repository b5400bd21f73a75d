"""KV plan: page geometry, three size classes, and the cache sizes of docs/caches.md#bytes-per-token."""
import json
import math
import os
import subprocess
import sys

import pytest

from conftest import FIXTURES, TINY_A
from dsv4rt.config import CSA, HCA, SLIDING, ModelConfig, from_dict
from dsv4rt.kv.plan import LARGE, MEDIUM, SMALL, build_plan
from test_cli import assert_one_line_error, dsv4rt

CONFIGS = FIXTURES / "configs"
GIB, N = 1 << 30, 1 << 20
BLOCKS = N // 256


def flash():
    return ModelConfig.load(CONFIGS / "deepseek-v4-flash.json")


def pro():
    return ModelConfig.load(CONFIGS / "deepseek-v4-pro.json")


def tiny_a(**change):
    raw = json.loads((TINY_A / "config.json").read_text())
    raw.update(change)
    return from_dict(raw)


@pytest.mark.parametrize("numerics, main, index, classes", [
    ("exact", 1024, 256, (65536, 16384, 2048)),
    ("faithful", 584, 68, (37376, 4352, 1168)),   # 448 e4m3 + 64 bf16 rope + 7 scales + 1 pad; 64 e2m1 + 4 scales
    ("fast", 584, 68, (37376, 4352, 1168)),       # faithful's caches
])
def test_real_models_fall_into_three_classes(numerics, main, index, classes):
    for cfg in (flash(), pro()):
        plan = build_plan(cfg, numerics)
        assert plan.class_page_bytes == classes
        k = {k.name: k for k in plan.kinds}
        assert (k["window"].entry_bytes, k["compressed_c4a"].entry_bytes, k["indexer"].entry_bytes) == (main, main, index)
        assert k["window"].page_bytes == k["compressed_c4a"].page_bytes == classes[LARGE] == 64 * main
        assert k["indexer"].page_bytes == classes[MEDIUM] and k["compressed_c128a"].page_bytes == classes[SMALL]
        for kind in plan.kinds:
            assert kind.page_bytes <= kind.class_page_bytes == classes[kind.size_class]
            assert kind.class_page_bytes % 16 == 0


def test_flash_state_pages():
    exact = {k.name: k for k in build_plan(flash(), "exact").kinds}
    assert [(exact[n].entry_bytes, exact[n].positions_per_page, exact[n].page_bytes)
            for n in ("state_main_c4a", "state_indexer", "state_c128a")] == [
        (8192, 8, 65536), (2048, 8, 16384), (4096, 16, 65536)]
    faithful = {k.name: k for k in build_plan(flash(), "faithful").kinds}
    assert [(faithful[n].positions_per_page, faithful[n].page_bytes, faithful[n].class_page_bytes)
            for n in ("state_main_c4a", "state_indexer", "state_c128a")] == [
        (4, 32768, 37376), (2, 4096, 4352), (9, 36864, 37376)]
    assert (exact["state_c128a"].stride, exact["state_c128a"].width) == (128, 128)
    assert (exact["state_main_c4a"].stride, exact["state_main_c4a"].width) == (4, 8)


# Expected bytes for one 2^20-token sequence, from the docs/caches.md#bytes-per-token figures: every compressed and
# indexer layer holds 4096 blocks; a window straddles 3 pages of 64 tokens; a state window straddles
# at most ceil((width-1)/P)+1 pages of P tokens.
EXPECTED = {
    ("flash", "exact"): dict(
        per_token=21 * (1024 + 256) / 4 + 20 * 1024 / 128,
        entries=BLOCKS * (21 * 65536 + 21 * 16384 + 20 * 2048),
        windows=43 * 3 * 65536, states=21 * 2 * 65536 + 21 * 2 * 16384 + 20 * 9 * 65536, model_md=6.72),
    ("pro", "exact"): dict(
        per_token=30 * (1024 + 256) / 4 + 31 * 1024 / 128,
        entries=BLOCKS * (30 * 65536 + 30 * 16384 + 31 * 2048),
        windows=61 * 3 * 65536, states=30 * 2 * 65536 + 30 * 2 * 16384 + 31 * 9 * 65536, model_md=9.62),
    ("flash", "faithful"): dict(
        per_token=21 * (584 + 68) / 4 + 20 * 584 / 128,
        entries=BLOCKS * (21 * 37376 + 21 * 4352 + 20 * 1168),
        windows=43 * 3 * 37376, states=21 * 3 * 37376 + 21 * 5 * 4352 + 20 * 16 * 37376, model_md=3.44),
    ("pro", "faithful"): dict(
        per_token=30 * (584 + 68) / 4 + 31 * 584 / 128,
        entries=BLOCKS * (30 * 37376 + 30 * 4352 + 31 * 1168),
        windows=61 * 3 * 37376, states=30 * 3 * 37376 + 30 * 5 * 4352 + 31 * 16 * 37376, model_md=4.92),
}


@pytest.mark.parametrize("model, numerics", list(EXPECTED))
def test_sequence_of_a_million_tokens_matches_model_md(model, numerics):
    e = EXPECTED[model, numerics]
    s = build_plan({"flash": flash, "pro": pro}[model](), numerics).summary(N, batch=3)
    assert s["bytes_per_token"] == s["ideal_bytes_per_token"] == e["per_token"]   # no page padding on these
    assert s["bytes_per_sequence"] == e["entries"] + e["windows"] + e["states"]
    assert s["overhead_bytes"] == e["windows"] + e["states"]
    assert s["total_bytes"] == 3 * s["bytes_per_sequence"]
    # docs/caches.md quotes the entries alone to 2 decimals (its faithful figures from "about 82 B per
    # token per layer", 0.008 GiB above the exact formula). Windows and states are a fixed 18-34 MiB
    # per sequence, at most 0.6% of it, so the totals land within 0.5% of the quoted figures.
    entries_gib = e["entries"] / GIB
    assert abs(entries_gib - e["model_md"]) <= (0.005 if numerics == "exact" else 0.01)
    assert s["overhead_bytes"] < 0.006 * s["bytes_per_sequence"]
    assert abs(s["bytes_per_sequence"] / GIB - e["model_md"]) / e["model_md"] < 0.005


def test_per_kind_breakdown_flash_faithful():
    kinds = {k["name"]: k for k in build_plan(flash(), "faithful").summary(N)["kinds"]}
    assert kinds["compressed_c4a"] == dict(
        name="compressed_c4a", layers=21, entry_bytes=584, positions_per_page=256, page_bytes=37376,
        size_class="large", class_page_bytes=37376, page_waste_bytes=0, pages_per_layer=4096,
        pages_per_sequence=21 * 4096, bytes_per_sequence=21 * 4096 * 37376)
    assert kinds["state_main_c4a"]["page_waste_bytes"] == 37376 - 4 * 8192
    assert kinds["window"]["pages_per_layer"] == 3 and kinds["state_c128a"]["pages_per_layer"] == 16


def test_small_model_formulas():
    cfg = tiny_a()   # head_dim 32, rope 16, index_head_dim 16, ratios 4 and 16, window 16
    exact = build_plan(cfg, "exact")
    assert exact.class_page_bytes == (64 * 64, 64 * 32, 16 * 64)
    faithful = build_plan(cfg, "faithful")
    # main: 16 e4m3 + 16*2 bf16 + ceil(16/64) scale = 49 -> 56; indexer: 8 e2m1 + ceil(16/32) scale = 9
    assert faithful.class_page_bytes == (64 * 56, 64 * 9, 16 * 56)
    k = {k.name: k for k in faithful.kinds}
    assert (k["state_main_c4a"].positions_per_page, k["state_indexer"].positions_per_page,
            k["state_c128a"].positions_per_page) == (3584 // 512, 576 // 256, 3584 // 256)
    assert k["compressed_c4a"].layers == (2, 4) and k["compressed_c128a"].layers == (0, 3)
    assert k["window"].layers == (0, 1, 2, 3, 4)
    assert build_plan(cfg).numerics == "exact" and build_plan(flash()).numerics == "faithful"



def test_the_float32_build_keeps_float32_main_rows_in_faithful_numerics():
    """The tight-check build stores faithful main entries as float32 rows of the rounded values (4·head_dim) and the
    indexer keys packed as in bf16; the bf16 build's faithful plan is unchanged."""
    for cfg in (flash(), pro()):
        k = {k.name: k for k in build_plan(cfg, "faithful", element_bytes=4).kinds}
        assert (k["window"].entry_bytes, k["compressed_c4a"].entry_bytes, k["compressed_c128a"].entry_bytes,
                k["indexer"].entry_bytes) == (2048, 2048, 2048, 68)
        assert build_plan(cfg, "faithful", element_bytes=4).class_page_bytes == (64 * 2048, 4352, 2 * 2048)
        assert build_plan(cfg, "exact", element_bytes=4).class_page_bytes == (64 * 2048, 64 * 512, 2 * 2048)
        assert build_plan(cfg, "faithful").class_page_bytes == (37376, 4352, 1168)
    small = {k.name: k.entry_bytes for k in build_plan(tiny_a(), "faithful", element_bytes=4).kinds}
    assert (small["window"], small["indexer"]) == (4 * 32, 9)   # 8 e2m1 bytes and a scale at index_head_dim 16


@pytest.mark.parametrize("element_bytes", [2, 4])
@pytest.mark.parametrize("numerics", ["exact", "faithful"])
def test_entry_sizes_are_the_kernels(numerics, element_bytes):
    """What the plan gives each main and indexer entry is what the launchers check the caches against."""
    import ml_dtypes
    import numpy as np
    from dsv4rt.kv.entries import indexer_entry_bytes, kv_entry_bytes
    dtype = {2: ml_dtypes.bfloat16, 4: np.float32}[element_bytes]
    faithful = numerics == "faithful"
    for cfg in (flash(), pro(), tiny_a()):
        k = {k.name: k.entry_bytes for k in build_plan(cfg, numerics, element_bytes).kinds}
        assert k["window"] == k["compressed_c4a"] == kv_entry_bytes(dtype, cfg.head_dim, cfg.rope_dim, faithful)
        assert k["indexer"] == indexer_entry_bytes(dtype, cfg.index_head_dim, faithful)

def test_models_lacking_some_kinds_still_have_three_classes():
    only_sliding = build_plan(tiny_a(layer_types=[SLIDING] * 5), "exact")
    assert [k.name for k in only_sliding.kinds] == ["window"]
    # without c128a layers the config has no c128a ratio: the small class follows the default 128
    assert only_sliding.class_page_bytes == (4096, 2048, 2 * 64)
    no_c128a = build_plan(tiny_a(layer_types=[SLIDING, CSA, CSA, SLIDING, CSA]), "faithful")
    assert "compressed_c128a" not in [k.name for k in no_c128a.kinds]
    assert no_c128a.class_page_bytes == (3584, 576, 2 * 56)
    assert no_c128a.bytes_per_token == 3 * (3584 + 576) / 256


def test_bad_ratio_and_numerics():
    with pytest.raises(ValueError, match="compress ratio 3 does not divide"):
        build_plan(tiny_a(compress_rates={CSA: 3, HCA: 16}))
    with pytest.raises(ValueError, match="numerics must be one of"):
        build_plan(tiny_a(), "fp8")


def test_columns_of_a_step():
    k = {k.name: k for k in build_plan(flash(), "exact").kinds}
    window, c128a, c4a = k["window"], k["state_c128a"], k["state_main_c4a"]
    assert window.columns(0, 1) == [(0, 1)]
    assert window.columns(200, 201) == [(1, 4)]               # reads 73..199, writes 200: pages 1, 2, 3
    assert window.columns(200, 5000) == [(1, 4), (76, 79)]    # reads 73..199, leaves 4873..4999 for the next
    assert window.columns(200, 250) == [(1, 4)]
    assert window.keep_from(5) == 0 and window.keep_from(500) == 373
    assert c128a.columns(127, 128) == [(0, 8)]                # token 127 closes the window: nothing written
    assert c128a.columns(128, 129) == [(8, 9)]
    assert c128a.columns(0, 128) == []
    assert c4a.columns(9, 10) == [(0, 2)]                     # reads 4..8 (previous and current window)
    assert k["compressed_c4a"].columns(300, 600) == [(0, 3)]


@pytest.mark.parametrize("chunk", [1, 2, 7, 64, 127, 128, 300, 5000])
def test_page_bound_holds_for_every_step(chunk):
    for kind in build_plan(flash(), "faithful").kinds + build_plan(tiny_a(), "exact").kinds:
        bound = kind.pages(3000, chunk)
        steps = [(start, min(stop, 3000)) for start in range(0, 3000, 5)
                 for stop in [*range(start + 1, start + chunk, max(1, chunk // 25)), start + chunk]]
        worst = max(sum(b - a for a, b in kind.columns(start, stop)) for start, stop in steps)
        assert worst <= bound
        if kind.name == "window" and chunk == 1:
            assert worst == bound


def test_plan_command_table(tmp_path):
    r = dsv4rt("plan", "--model", CONFIGS / "deepseek-v4-flash.json", "--context", N, "--numerics", "exact")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].split() == ["kind", "layers", "entry", "B", "pos/page", "page", "B", "class", "pages/layer", "MiB/seq"]
    assert lines[2].split() == ["compressed_c4a", "21", "1,024", "256", "65,536", "large", "4,096", "5376.00"]
    assert "size classes: large 65,536 B, medium 16,384 B, small 2,048 B" in r.stdout
    assert "bytes per token: 6,880.00" in r.stdout
    expected = sum(EXPECTED["flash", "exact"][p] for p in ("entries", "windows", "states")) / GIB
    assert f"per sequence of 1,048,576 tokens: {expected:.4f} GiB" in r.stdout


def test_plan_command_json_defaults_to_faithful_for_fp8_checkpoints():
    r = dsv4rt("plan", "--model", CONFIGS / "deepseek-v4-pro.json", "--context", N, "--batch", 8, "--json")
    assert r.returncode == 0, r.stderr
    s = json.loads(r.stdout)
    e = EXPECTED["pro", "faithful"]
    assert s["numerics"] == "faithful" and s["batch"] == 8 and s["size_classes"] == [37376, 4352, 1168]
    assert s["bytes_per_token"] == e["per_token"]
    assert s["total_bytes"] == 8 * (e["entries"] + e["windows"] + e["states"])
    assert {k["name"] for k in s["kinds"]} == {"window", "compressed_c4a", "indexer", "state_main_c4a",
                                               "state_indexer", "compressed_c128a", "state_c128a"}


@pytest.mark.parametrize("args, message", [
    (["--model", "/no/such/model", "--context", 10], "does not exist"),
    (["--model", TINY_A, "--context", 0], "--context must be positive"),
    (["--model", TINY_A, "--context", 10, "--batch", -1], "--batch must be positive"),
    (["--model", TINY_A, "--step", 8], "give both"),
])
def test_plan_command_errors(args, message):
    assert_one_line_error(dsv4rt("plan", *args), message)


def test_plan_of_a_folder_uses_its_config():
    r = dsv4rt("plan", "--model", TINY_A, "--context", 1000, "--json")
    s = json.loads(r.stdout)
    assert s["numerics"] == "exact" and s["size_classes"] == [4096, 2048, 1024]
    # 2 c4a layers keep 4 blocks of 4096 + 2048 B, 2 c128a layers 4 blocks of 1024 B
    assert s["bytes_per_token"] == (2 * (4096 + 2048) + 2 * 1024) / 256
    assert math.isclose(s["ideal_bytes_per_token"], s["bytes_per_token"])
    # 4 blocks per compressed layer; the 16-token window straddles 2 pages of 64, each state 2 pages
    assert s["bytes_per_sequence"] == (4 * (2 * 4096 + 2 * 2048 + 2 * 1024) + 2 * 5 * 4096
                                       + 2 * (2 * 4096 + 2 * 2048 + 2 * 4096))


def test_the_plan_imports_nothing_of_the_gpu_model():
    """kv/ sits below model/: the entry sizes the plan needs live in kv/entries.py."""
    code = "import sys, dsv4rt.kv.plan; print(sorted(m for m in sys.modules if m.startswith('dsv4rt.model')))"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                       env=dict(os.environ, PYTHONPATH=str(FIXTURES.parent.parent)))
    assert r.stdout.strip() == "[]"
