"""The configs of `dsv4rt make-tiny`'s presets, apart from tiny.py so that the command line can list them
without importing the weight writers."""
from .config import CSA, HASH_MOE, HCA, MOE, SLIDING

_BASE = dict(
    vocab_size=129280, num_key_value_heads=1, rope_theta=10000.0, compress_rope_theta=160000.0,
    rope_scaling=dict(type="yarn", factor=16, original_max_position_embeddings=65536, beta_fast=32, beta_slow=1),
    compress_rates={CSA: 4, HCA: 128}, sliding_window=128, n_shared_experts=1, scoring_func="sqrtsoftplus",
    routed_scaling_factor=1.5, swiglu_limit=10.0, hc_sinkhorn_iters=20, hc_eps=1e-6, rms_norm_eps=1e-6,
    bos_token_id=0, eos_token_id=1,
)

PRESETS = {
    # the built-in chat model: every layer kind at the real ratios, small enough for a CPU
    "demo": dict(_BASE, hidden_size=128, num_hidden_layers=4, num_attention_heads=4, head_dim=64,
                 qk_rope_head_dim=16, q_lora_rank=64, o_groups=2, o_lora_rank=64,
                 layer_types=[SLIDING, CSA, HCA, CSA], mlp_layer_types=[HASH_MOE, MOE, MOE, MOE],
                 index_n_heads=8, index_head_dim=32, index_topk=16, n_routed_experts=8,
                 num_experts_per_tok=2, moe_intermediate_size=128, hc_mult=4),
    # the serving benchmark's model: Flash sizes, 8 layers, 32 experts (8.7 B parameters, 17 GB in bf16)
    "flash-slice": dict(_BASE, hidden_size=4096, num_hidden_layers=8, num_attention_heads=64, head_dim=512,
                        qk_rope_head_dim=64, q_lora_rank=1024, o_groups=8, o_lora_rank=1024,
                        layer_types=[SLIDING, CSA, HCA, CSA, HCA, CSA, HCA, CSA],
                        mlp_layer_types=[HASH_MOE] * 3 + [MOE] * 5, index_n_heads=64, index_head_dim=128,
                        index_topk=512, n_routed_experts=32, num_experts_per_tok=6, moe_intermediate_size=2048,
                        hc_mult=4),
    # the smallest model with the real vocabulary, for command-line tests
    "tiny": dict(_BASE, hidden_size=32, num_hidden_layers=3, num_attention_heads=2, head_dim=32,
                 qk_rope_head_dim=16, q_lora_rank=32, o_groups=1, o_lora_rank=32,
                 layer_types=[HCA, SLIDING, CSA], mlp_layer_types=[HASH_MOE, MOE, MOE],
                 index_n_heads=4, index_head_dim=16, index_topk=8, n_routed_experts=4,
                 num_experts_per_tok=2, moe_intermediate_size=32, hc_mult=2),
}
