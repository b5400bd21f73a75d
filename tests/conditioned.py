"""A released-format checkpoint (fp8 attention and shared expert, fp4 routed experts) on which faithful numerics
are well conditioned: every expert is active in every layer, the indexer keeps every compressed entry a query sees
(index_topk 80 against at most 65 at T = 260), no layer is hash-routed, so no choice can flip between two correct
implementations; what is left is act_quant's rounding. Each layer kind is present: sliding, c4a, c128a (T passes
the 128 boundary twice). Used by test_moe_order.py (CPU) and test_gpu_faithful.py."""
import numpy as np

from dsv4rt.config import CSA, HCA, MOE, SLIDING

T = 260
CONDITIONED = dict(vocab_size=1024, hidden_size=32, num_hidden_layers=3, num_attention_heads=2, head_dim=32,
                   qk_rope_head_dim=16, q_lora_rank=32, o_groups=1, o_lora_rank=32,
                   layer_types=[SLIDING, CSA, HCA], mlp_layer_types=[MOE] * 3, index_n_heads=4, index_head_dim=16,
                   index_topk=80, n_routed_experts=2, num_experts_per_tok=2, moe_intermediate_size=32, hc_mult=2)


def make_conditioned(path, seed: int = 0):
    from dsv4rt.presets import _BASE
    from dsv4rt.tiny import write_random_checkpoint
    return write_random_checkpoint(path, dict(_BASE, **CONDITIONED), seed, tokenizer=False, fmt="official")


def conditioned_ids(seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, CONDITIONED["vocab_size"], T)
