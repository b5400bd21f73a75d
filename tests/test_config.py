"""config.json in both spellings; missing or inconsistent keys are errors that name the key."""
import json

import pytest

from conftest import FIXTURES, REAL_RATIOS, TINY_A
from dsv4rt.config import CSA, HCA, SLIDING, ConfigError, ModelConfig, from_dict

CONFIGS = FIXTURES / "configs"


def raw(name):
    return json.loads((CONFIGS / f"deepseek-v4-{name}.json").read_text())


def test_flash_config():
    c = ModelConfig.load(CONFIGS / "deepseek-v4-flash.json")
    assert (c.hidden_size, c.num_layers, c.num_heads, c.head_dim, c.rope_dim) == (4096, 43, 64, 512, 64)
    assert c.kinds[:2] == (SLIDING, SLIDING) and c.kinds.count(CSA) == 21 and c.kinds.count(HCA) == 20
    assert c.ratios[2:4] == (4, 128) and c.hash_layers == (True,) * 3 + (False,) * 40
    assert (c.index_n_heads, c.index_head_dim, c.index_topk, c.n_experts, c.n_active) == (64, 128, 512, 256, 6)
    assert (c.o_groups, c.o_lora_rank, c.q_lora_rank, c.window, c.hc_mult, c.n_mtp) == (8, 1024, 1024, 128, 4, 1)
    assert c.yarn.factor == 16 and c.yarn.original == 65536 and c.compress_rope_theta == 160000
    assert c.routed_scaling == 1.5 and c.quant["fmt"] == "e4m3"


def test_pro_config():
    c = ModelConfig.load(CONFIGS / "deepseek-v4-pro.json")
    assert (c.hidden_size, c.num_layers, c.num_heads, c.q_lora_rank, c.o_groups) == (7168, 61, 128, 1536, 16)
    assert c.kinds[:2] == (HCA, HCA) and c.kinds.count(CSA) == 30 and c.kinds.count(HCA) == 31
    assert c.index_topk == 1024 and c.n_experts == 384 and c.routed_scaling == 2.5


def test_legacy_and_hf_spellings_agree():
    legacy = raw("flash")
    hf = {k: v for k, v in legacy.items() if k not in ("compress_ratios", "num_hash_layers", "qk_rope_head_dim",
                                                        "rope_scaling")}
    kinds = {0: SLIDING, 4: CSA, 128: HCA}
    hf["layer_types"] = [kinds[r] for r in legacy["compress_ratios"][:43]]
    hf["compress_rates"] = {CSA: 4, HCA: 128}
    hf["mlp_layer_types"] = ["hash_moe"] * 3 + ["moe"] * 40
    hf["partial_rotary_factor"] = 64 / 512
    main = {"rope_type": "default", "rope_theta": 10000.0}
    hf["rope_parameters"] = {"main": main, "compress": {
        "rope_type": "yarn", "rope_theta": 160000.0, "factor": 16, "original_max_position_embeddings": 65536,
        "beta_fast": 32, "beta_slow": 1}}
    assert from_dict(hf) == from_dict(legacy)


def test_golden_configs_load():
    a = ModelConfig.load(TINY_A)
    assert a.ratios == (16, 0, 4, 16, 4) and a.yarn is None and a.rope_dim == 16
    b = ModelConfig.load(REAL_RATIOS)
    assert b.ratios == (128, 0, 4, 128, 4) and b.yarn is not None


def test_yarn_table_follows_model_md():
    c = from_dict(raw("flash"))
    plain = 160000.0 ** (-__import__("numpy").arange(0, 64, 2) / 64)
    f = c.rope_inv_freq(2)
    assert f[0] == plain[0] and abs(f[-1] - plain[-1] / 16) < 1e-20  # fast dims kept, slow dims divided
    assert (c.rope_inv_freq(0) == 10000.0 ** (-__import__("numpy").arange(0, 64, 2) / 64)).all()


@pytest.mark.parametrize("drop", ["hidden_size", "num_hidden_layers", "head_dim", "q_lora_rank", "o_groups",
                                  "index_topk", "n_routed_experts", "vocab_size", "sliding_window"])
def test_missing_key_is_named(drop):
    r = raw("flash")
    del r[drop]
    with pytest.raises(ConfigError, match=f"'{drop}'"):
        from_dict(r)


@pytest.mark.parametrize("change, key", [
    ({"compress_ratios": [0, 4]}, "compress_ratios"),
    ({"o_groups": 7}, "o_groups"),
    ({"num_experts_per_tok": 300}, "num_experts_per_tok"),
    ({"num_key_value_heads": 8}, "num_key_value_heads"),
    ({"hidden_size": "big"}, "hidden_size"),
    ({"scoring_func": "softmax"}, "scoring_func"),
    ({"qk_rope_head_dim": 1024}, "qk_rope_head_dim"),
    ({"rope_scaling": {"type": "yarn", "factor": 4}}, "original_max_position_embeddings"),
    ({"layer_types": ["sliding_attention"] * 3}, "layer_types"),
    ({"mlp_layer_types": ["moe"]}, "mlp_layer_types"),
])
def test_inconsistent_key_is_named(change, key):
    r = dict(raw("flash"), **change)
    with pytest.raises(ConfigError, match=key):
        from_dict(r)


def test_file_errors(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        ModelConfig.load(tmp_path)
    (tmp_path / "config.json").write_text("{oops")
    with pytest.raises(ConfigError, match="not valid JSON"):
        ModelConfig.load(tmp_path)
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(ConfigError, match="JSON object"):
        ModelConfig.load(tmp_path)
