"""`dsv4rt plan --gpus N`: weights per GPU in the released formats and the cache tokens left room for
(the README's table and docs/parallel.md#memory)."""
import json

import pytest

from conftest import FIXTURES, TINY_A
from dsv4rt.config import ModelConfig
from dsv4rt.parallel.plan import group_plan
from test_cli import assert_one_line_error, dsv4rt

CONFIGS = FIXTURES / "configs"
GIB = 1 << 30

# model, GPUs: weight bytes on the fullest GPU, cache tokens at 140 GiB a GPU less 4 GiB of workspace
FIGURES = {
    ("flash", 1): (156_006_389_980, 0),
    ("flash", 2): (79_198_060_380, 19_017_095),
    ("flash", 4): (40_793_895_580, 29_945_220),
    ("flash", 8): (21_591_813_180, 35_409_283),
    ("pro", 8): (112_973_891_468, 6_569_692),
}
TOTAL = {"flash": 156_006_389_980, "pro": 850_738_896_844}
PER_TOKEN = {"flash": 21 * (584 + 68) / 4 + 20 * 584 / 128, "pro": 30 * (584 + 68) / 4 + 31 * 584 / 128}


@pytest.mark.parametrize("model, gpus", list(FIGURES))
def test_plan_json_for_flash_and_pro(model, gpus):
    r = dsv4rt("plan", "--model", CONFIGS / f"deepseek-v4-{model}.json", "--gpus", gpus, "--json")
    assert r.returncode == 0, r.stderr
    s = json.loads(r.stdout)
    per_gpu, tokens = FIGURES[model, gpus]
    assert (s["weight_bytes_total"], s["weight_bytes_per_gpu"], s["kv_tokens"]) == (TOTAL[model], per_gpu, tokens)
    assert s["kv_numerics"] == "faithful" and s["kv_bytes_per_token"] == PER_TOKEN[model]
    assert s["fits"] == (tokens > 0)
    if tokens:
        assert tokens == (140 * GIB - per_gpu - 4 * GIB) // PER_TOKEN[model]
    assert s["weight_bytes_replicated"] == gpus * per_gpu - TOTAL[model]


def test_flash_is_about_145_gib_and_needs_two_h200s():
    flash = ModelConfig.load(CONFIGS / "deepseek-v4-flash.json")
    assert TOTAL["flash"] / GIB == pytest.approx(145.3, abs=0.05)
    assert not group_plan(flash, 1)["fits"] and group_plan(flash, 1, gpu_memory=150 * GIB)["fits"]
    # less memory per GPU leaves fewer tokens, exactly the bytes removed over the bytes per token
    a, b = group_plan(flash, 2), group_plan(flash, 2, gpu_memory=130 * GIB)
    assert a["kv_tokens"] - b["kv_tokens"] in (10 * GIB // PER_TOKEN["flash"], 10 * GIB // PER_TOKEN["flash"] + 1)


def test_plan_text_with_gpus_and_context():
    r = dsv4rt("plan", "--model", CONFIGS / "deepseek-v4-flash.json", "--gpus", 2, "--gpu-memory", 141,
               "--workspace", 2, "--context", 1 << 20)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0] == "2 GPUs of 141 GiB, 2 GiB each set aside for workspace"
    assert lines[1] == "weights: 145.29 GiB in all, 73.76 GiB on the fullest GPU (2.23 GiB held more than once)"
    tokens = (141 * GIB - FIGURES["flash", 2][0] - 2 * GIB) // PER_TOKEN["flash"]
    assert lines[2] == (f"cache: {int(tokens):,} tokens at 3,514.25 B per token (faithful numerics), "
                        "every GPU holding every sequence's cache")
    assert lines[3].split()[0] == "kind" and "per sequence of 1,048,576 tokens" in r.stdout


def test_plan_text_when_nothing_fits():
    r = dsv4rt("plan", "--model", CONFIGS / "deepseek-v4-flash.json", "--gpus", 1)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[-1] == "the weights and workspace do not fit: no room for a cache"


@pytest.mark.parametrize("args, message", [
    (["--model", CONFIGS / "deepseek-v4-flash.json", "--gpus", 3], "cannot split 64 attention heads over 3 GPUs"),
    (["--model", TINY_A, "--gpus", 8], "cannot split 4 attention heads over 8 GPUs"),
    (["--model", TINY_A], "give --context, --gpus or both"),
    (["--model", TINY_A, "--gpus", 2, "--gpu-memory", 0], "--gpu-memory must be positive"),
])
def test_plan_gpus_errors(args, message):
    assert_one_line_error(dsv4rt("plan", *args), message)


@pytest.mark.parametrize("page", ["README.md", "docs/parallel.md"])
def test_the_tables_in_the_docs_are_these_figures(page):
    text = (FIXTURES.parent.parent / page).read_text()
    for (model, gpus), (per_gpu, tokens) in FIGURES.items():
        start = f"| {model.capitalize()} | {gpus} | {TOTAL[model] / GIB:.2f} GiB | {per_gpu / GIB:.2f} GiB |"
        end = f" {tokens:,} |" if tokens else " does not fit |"
        assert [line.endswith(end) for line in text.splitlines() if line.startswith(start)] == [True], start
