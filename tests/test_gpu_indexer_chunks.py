"""Prefill steps whose indexer runs in row chunks (a scores budget below the step's [rows, n_max] float32 scores,
dsv4rt/model/memory.py) against the same model with one launch pair a step: the rows are independent, so the logits
agree bit for bit, and so with the reference as tests/test_gpu_forward.py checks it. Also: a captured step of
chunks replays the eager one, and a model's arena holds what memory.memory_plan says."""
import ml_dtypes
import numpy as np
import pytest

from conftest import REAL_RATIOS, TINY_A, rel_rows, replays_the_eager_step
from dsv4rt.config import CSA, HASH_MOE, HCA, MOE, SLIDING

pytestmark = pytest.mark.gpu
BF16 = ml_dtypes.bfloat16
CHUNK = 48          # rows a launch pair: real-ratios' 640-row prefill in 14 chunks, the last of 16 rows
# index_head_dim 128: the bf16 build scores on the tensor cores (indexer_scores_mma), from fp4 keys when faithful
MID = dict(vocab_size=1024, hidden_size=256, num_hidden_layers=3, num_attention_heads=2, head_dim=128,
           qk_rope_head_dim=64, q_lora_rank=128, o_groups=2, o_lora_rank=128, layer_types=[SLIDING, CSA, HCA],
           mlp_layer_types=[HASH_MOE, MOE, MOE], index_n_heads=4, index_head_dim=128, index_topk=16,
           n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=128, hc_mult=2)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from dsv4rt.presets import _BASE
    from dsv4rt.tiny import make_tiny, write_random_checkpoint
    root = tmp_path_factory.mktemp("chunks")
    return {"mid": write_random_checkpoint(root / "mid", dict(_BASE, **MID), 2, tokenizer=False),
            "official": make_tiny(root / "official", "tiny", 3, fmt="official")}


def pair(rt, path, dtype, numerics=None):
    """The model with one launch pair a step, and again with the indexer in chunks of CHUNK rows."""
    from dsv4rt.model.forward import GpuModel
    kw = dict(runtime=rt, max_len=1024, kv_bytes=128 << 20, numerics=numerics)
    one = GpuModel(path, dtype, **kw)
    chunked = GpuModel(path, dtype, scores_budget=CHUNK * one.n_max * 4 + 3, **kw)
    assert (one.score_rows, chunked.score_rows) == (one.rows, CHUNK) and one.rows > CHUNK
    return one, chunked


def feed(m, ids, chunks):
    m.reset()
    bounds = np.cumsum([0, *chunks])
    return np.concatenate([m.forward(ids[a:b]) for a, b in zip(bounds[:-1], bounds[1:])])


@pytest.mark.parametrize("dtype", [np.float32, BF16])
def test_row_chunks_give_the_one_launch_logits_and_the_reference(rt, dtype):
    g = dict(np.load(REAL_RATIOS / "golden.npz"))
    one, chunked = pair(rt, REAL_RATIOS, dtype)
    ids = g["input_ids"]
    for chunks, ref in (([len(ids)], g["logits_full"]), (g["chunks"], g["logits_chunked"])):
        ours = feed(chunked, ids, chunks)
        assert np.array_equal(ours, feed(one, ids, chunks))
        err = rel_rows(ours, ref)
        if dtype == np.float32:
            assert err.max() < 1e-4
        else:
            assert np.median(err) <= 3e-2 and np.mean(ours.argmax(-1) == ref.argmax(-1)) >= 0.9


def test_faithful_row_chunks_match_the_official_code(rt):
    """tiny-a in faithful numerics: the fp4 indexer's q rotation runs per chunk too; 1e-4 from the official code."""
    f = dict(np.load(TINY_A / "faithful_fp32.npz"))
    one, chunked = pair(rt, TINY_A, np.float32, "faithful")
    ours = chunked.forward(f["input_ids"])
    assert np.array_equal(ours, one.forward(f["input_ids"]))
    assert rel_rows(ours, f["logits_full"]).max() < 1e-4


@pytest.mark.parametrize("numerics", ["exact", "faithful"])
def test_tensor_core_indexer_in_row_chunks(rt, models, numerics):
    one, chunked = pair(rt, models["mid"], BF16, numerics)
    ids = np.random.default_rng(4).integers(2, MID["vocab_size"], 300)
    assert np.array_equal(chunked.forward(ids), one.forward(ids))


def test_a_captured_step_of_chunks_replays_the_eager_one(rt):
    from dsv4rt.model.forward import GpuModel
    ids = dict(np.load(REAL_RATIOS / "golden.npz"))["input_ids"]
    m = GpuModel(REAL_RATIOS, BF16, runtime=rt, max_len=1024, kv_bytes=128 << 20, scores_budget=CHUNK * 257 * 4)
    assert (m.n_max, m.score_rows) == (257, CHUNK)
    assert replays_the_eager_step(m, ids, 200, 100)   # 100 rows: chunks of 48, 48 and 4


@pytest.mark.parametrize("name, dtype, numerics", [("real-ratios", np.float32, "exact"), ("real-ratios", BF16, "exact"),
                                                   ("official", BF16, "faithful")])
def test_the_arena_holds_what_the_memory_plan_says(rt, models, name, dtype, numerics):
    from dsv4rt.model.forward import GpuModel
    from dsv4rt.model.memory import aligned, memory_plan
    kv = 100 << 20
    used = rt.arena.used
    m = GpuModel(REAL_RATIOS if name == "real-ratios" else models[name], dtype, runtime=rt, max_len=3000, kv_bytes=kv,
                 max_batch=3, numerics=numerics)
    plan = memory_plan(m.cfg, numerics, max_len=3000, max_batch=3, dtype=dtype, sm_count=rt.device.sm_count,
                       arch=rt.device.arch)
    assert rt.arena.used - used == plan["total"] + aligned(kv)
    assert (m.rows, m.out_rows, m.score_rows) == (plan["rows"], plan["out_rows"], plan["score_rows"])
