"""The GPU forward on a random model of Flash sizes (hidden 4096, 64 heads of 512, indexer 64×128
top-512, window 128, hc 4) against the numpy reference. The prompt is long enough (2,200 tokens,
550 compressed entries at the end) for the indexer's top-512 to choose."""
import ml_dtypes
import numpy as np
import pytest

from conftest import rel_rows
from dsv4rt.config import CSA, HASH_MOE, HCA, MOE, SLIDING

pytestmark = pytest.mark.gpu

FLASH_SIZED = dict(
    vocab_size=1024, hidden_size=4096, num_hidden_layers=3, num_attention_heads=64, head_dim=512,
    qk_rope_head_dim=64, q_lora_rank=1024, o_groups=8, o_lora_rank=1024, sliding_window=128,
    layer_types=[SLIDING, CSA, HCA], mlp_layer_types=[HASH_MOE, MOE, MOE],
    compress_rates={CSA: 4, HCA: 128}, index_n_heads=64, index_head_dim=128, index_topk=512,
    n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=2048, hc_mult=4,
    rope_theta=10000.0, compress_rope_theta=160000.0, num_key_value_heads=1, routed_scaling_factor=1.5,
    rope_scaling=dict(type="yarn", factor=16, original_max_position_embeddings=65536, beta_fast=32, beta_slow=1),
    swiglu_limit=10.0, hc_sinkhorn_iters=20, hc_eps=1e-6, rms_norm_eps=1e-6,
)
T, SPLIT, CHUNKS = 2200, 2170, [700, 1, 1023, 476]


@pytest.fixture(scope="module")
def flash(tmp_path_factory):
    from dsv4rt.reference import load_model
    from dsv4rt.tiny import write_random_checkpoint
    path = write_random_checkpoint(tmp_path_factory.mktemp("flash") / "model", FLASH_SIZED, seed=5, tokenizer=False)
    ids = np.random.default_rng(6).integers(2, FLASH_SIZED["vocab_size"], T)
    ref = load_model(path, "exact")
    streams = []
    full = ref.forward(ref.new_state(), ids, streams)
    return path, ids, ref, full, streams


def test_flash_sized_float32_build_all_feeding_modes(rt, flash):
    from dsv4rt.model.forward import GpuModel
    path, ids, ref, full, _ = flash
    m = GpuModel(path, np.float32, runtime=rt, max_len=T, kv_bytes=256 << 20)
    assert rel_rows(m.forward(ids), full).max() < 1e-4
    m.reset()
    bounds = np.cumsum([0] + CHUNKS)
    chunked = np.concatenate([m.forward(ids[a:b]) for a, b in zip(bounds[:-1], bounds[1:])])
    assert rel_rows(chunked, full).max() < 1e-4
    m.reset()
    incr = [m.forward(ids[:SPLIT])[-1]] + [m.forward(ids[t:t + 1])[0] for t in range(SPLIT, T)]
    assert rel_rows(np.stack(incr), full[SPLIT - 1:]).max() < 1e-4


def test_flash_sized_bf16_layers_with_teacher_forcing(rt, flash):
    """Each layer alone, fed the reference's input streams of the one-prefill run, against its outputs."""
    from dsv4rt.model.forward import GpuModel
    path, ids, ref, _, streams = flash
    m = GpuModel(path, ml_dtypes.bfloat16, runtime=rt, max_len=T, kv_bytes=256 << 20)
    for i in range(m.cfg.num_layers):
        ours = m.layer_alone(i, ids, streams[i]).reshape(T, -1)
        err = rel_rows(ours, streams[i + 1].reshape(T, -1))
        print(f"flash-sized layer {i}: median {np.median(err):.4f}, within 2e-2 {np.mean(err < 2e-2):.4f}")
        assert np.mean(err < 2e-2) >= 0.99, i
