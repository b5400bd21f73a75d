"""A GpuModel's memory from its config alone (dsv4rt/model/memory.py): the indexer's scores in row chunks within a
budget, the workspaces and weights of docs/caches.md#a-1m-token-prompt, and `dsv4rt plan --step`. No GPU needed;
tests/test_gpu_indexer_chunks.py checks these sizes against a model's arena."""
import json

import ml_dtypes
import numpy as np
import pytest

from conftest import TINY_A
from dsv4rt.config import from_dict
from dsv4rt.presets import PRESETS
from test_cli import dsv4rt

M, GIB = 1 << 20, 1 << 30
BF16 = ml_dtypes.bfloat16
FLASH_SLICE = from_dict(PRESETS["flash-slice"])


def test_score_rows_keep_a_step_within_the_budget():
    from dsv4rt.model.memory import SCORES_BUDGET, index_entries, score_rows
    assert SCORES_BUDGET == GIB
    assert index_entries(FLASH_SLICE, M) == index_entries(FLASH_SLICE, M + 1) == 262145
    assert score_rows(8192, 262145) == 1023                  # 9 launch pairs for a step of 8192 rows
    assert 1023 * 262145 * 4 <= GIB < 1024 * 262145 * 4
    assert score_rows(8192, 32768) == 8192                   # 128K positions: one pair, as without a budget
    assert score_rows(8192, 32769) == 8191
    assert score_rows(1, 262145) == 1 and score_rows(512, 262145) == 512   # decode tiers: one pair
    assert score_rows(8192, 262145, budget=1000) == 1        # less than a row: a row at a time
    assert score_rows(100_000, 1) == 65535                   # grid y bounds a launch too


def test_flash_slice_prefill_of_a_million_tokens():
    """The figures of docs/caches.md#a-1m-token-prompt."""
    from dsv4rt.model.memory import memory_plan, workspace_sizes
    for max_len, tables in ((M, 11_370_752), (M + 1, 11_371_008)):
        p = memory_plan(FLASH_SLICE, "exact", max_len=max_len, rows=8192)
        assert (p["n_max"], p["score_rows"], p["out_rows"]) == (262145, 1023, 1024)
        assert p["workspace"]["scores"] == 1_072_697_344       # 1023 × 262,145 × 4, rounded up to 256
        assert sum(p["workspace"].values()) == 4_597_550_080
        assert p["weights"] == 17_333_270_272
        assert p["other"] == {"page tables": tables, "page starts": 256, "rope tables": 2048,
                              "expert pointer tables": 6144, "cuBLAS workspaces": 3 * 32 * M}
    one_pair = workspace_sizes(FLASH_SLICE, BF16, rows=8192, out_rows=1024, max_len=M, sm_count=132,
                               scores_budget=1 << 40)
    assert one_pair["scores"] == 8192 * 262145 * 4 == 8_589_967_360
    short = workspace_sizes(FLASH_SLICE, BF16, rows=4096, out_rows=1024, max_len=4096, sm_count=132)
    assert short["scores"] == 4096 * 1025 * 4


@pytest.mark.parametrize("dtype", [np.float32, BF16])
def test_weight_bytes_are_what_the_upload_lays_out(dtype):
    from dsv4rt.loader import Checkpoint
    from dsv4rt.loader.upload import layout
    from dsv4rt.model.memory import aligned, weight_bytes
    from dsv4rt.model.weights import Converted
    with Checkpoint.open(TINY_A) as ck:
        src = Converted(ck, dtype)
        assert weight_bytes(ck.config, dtype) == aligned(layout(src, src.names())[1])


def test_released_weight_bytes_are_what_the_upload_lays_out(tmp_path):
    from dsv4rt.loader import Checkpoint
    from dsv4rt.loader.upload import layout
    from dsv4rt.model.memory import aligned, weight_bytes
    from dsv4rt.model.weights import Converted
    from dsv4rt.tiny import make_tiny
    with Checkpoint.open(make_tiny(tmp_path / "official", "tiny", 3, fmt="official")) as ck:
        src = Converted(ck, BF16, keep_quantized=True)
        assert any(n.endswith(".scale") for n in src.names())
        assert weight_bytes(ck.config, BF16, released=True) == aligned(layout(src, src.names())[1])


def test_plan_step_prints_the_gpu_build():
    r = dsv4rt("plan", "--model", "flash-slice", "--context", M, "--step", 8192, "--json")
    assert r.returncode == 0, r.stderr
    s = json.loads(r.stdout)
    b = s["gpu_build"]
    assert (s["chunk"], b["max_len"], b["rows"], b["score_rows"]) == (8192, M, 8192, 1023)
    assert b["workspace"]["scores"] == 1_072_697_344 and b["weights"] == 17_333_270_272
    # a step of 8192 reads 127 window positions and writes 127: 6 window pages a layer, not decode's 3
    assert s["bytes_per_sequence"] == 1_375_338_496
    r = dsv4rt("plan", "--model", "flash-slice", "--context", M, "--step", 8192)
    assert r.returncode == 0, r.stderr
    assert "1,023 rows × 262,145 entries a launch" in r.stdout
