"""config.json in both spellings; missing or inconsistent keys are errors that name the key."""
import json
import os

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


@pytest.mark.parametrize("change, message", [
    ({"layer_types": 5}, "key 'layer_types' must be a list of strings, got 5"),
    ({"compress_ratios": [[4]] * 44}, "key 'compress_ratios' must be a list of integers, got [[4], [4]"),
    ({"compress_ratios": [True] * 44}, "key 'compress_ratios' must be a list of integers"),
    ({"compress_ratios": [0, 1] * 22}, "key 'compress_ratios' must hold 0 and at most two ratios above 1"),
    ({"mlp_layer_types": "moe"}, "key 'mlp_layer_types' must be a list of strings, got 'moe'"),
    ({"eos_token_id": [[1]]}, "key 'eos_token_id' must be an id or a non-empty list of ids, got [[1]]"),
    ({"eos_token_id": []}, "key 'eos_token_id' must be an id or a non-empty list of ids, got []"),
    ({"eos_token_id": 129280}, "key 'eos_token_id' must be an integer from 0 to 129279, got 129280"),
    ({"bos_token_id": -1}, "key 'bos_token_id' must be an integer from 0 to 129279, got -1"),
    ({"rope_theta": float("nan")}, "key 'rope_theta' must be a finite number above 1, got nan"),
    ({"rope_theta": -10000.0}, "key 'rope_theta' must be a finite number above 1, got -10000.0"),
    ({"rope_theta": 1}, "key 'rope_theta' must be a finite number above 1, got 1"),
    ({"compress_rope_theta": float("inf")}, "key 'compress_rope_theta' must be a finite number above 1, got inf"),
    ({"rms_norm_eps": -1e-6}, "key 'rms_norm_eps' must be a finite number in (0, 1), got -1e-06"),
    ({"hc_eps": "small"}, "key 'hc_eps' must be a number, got 'small'"),
    ({"routed_scaling_factor": float("nan")}, "key 'routed_scaling_factor' must be a finite number in (0, 100]"),
    ({"routed_scaling_factor": 1e30}, "key 'routed_scaling_factor' must be a finite number in (0, 100]"),
    ({"swiglu_limit": 0}, "key 'swiglu_limit' must be a finite number above 0, got 0"),
    ({"rope_scaling": {"type": "yarn", "factor": 0, "original_max_position_embeddings": 65536}},
     "key 'rope_scaling.factor' must be a finite number of at least 1, got 0"),
    ({"rope_scaling": {"type": "yarn", "factor": 4, "original_max_position_embeddings": 0}},
     "key 'rope_scaling.original_max_position_embeddings' must be an integer from 1 to 2147483647, got 0"),
    ({"rope_scaling": {"type": "yarn", "factor": 4, "original_max_position_embeddings": 9, "beta_slow": -1}},
     "key 'rope_scaling.beta_slow' must be a finite number above 0, got -1"),
    ({"rope_scaling": "yarn"}, "key 'rope_scaling' must be an object, got 'yarn'"),
    ({"hidden_size": 2 ** 31}, "key 'hidden_size' must be an integer from 1 to 2147483647, got 2147483648"),
    ({"hidden_size": 10 ** 5000}, "key 'hidden_size' must be an integer from 1 to 2147483647, got an integer of 16610 bits"),
    ({"hidden_size": 4096.5}, "key 'hidden_size' must be an integer, got 4096.5"),
    ({"hidden_size": True}, "key 'hidden_size' must be an integer, got True"),
    ({"head_dim": -512}, "key 'head_dim' must be an integer from 1 to 2147483647, got -512"),
    ({"hc_sinkhorn_iters": 10 ** 6}, "key 'hc_sinkhorn_iters' must be an integer from 1 to 1000, got 1000000"),
    ({"n_shared_experts": 2}, "key 'n_shared_experts' must be an integer from 0 to 1, got 2"),
    ({"num_hash_layers": -1}, "key 'num_hash_layers' must be an integer from 0 to 2147483647, got -1"),
    ({"compress_rates": {CSA: 1}}, f"key 'compress_rates.{CSA}' must be an integer from 2 to 2147483647, got 1"),
    ({"compress_rates": [4, 128]}, "key 'compress_rates' must be an object, got [4, 128]"),
    ({"quantization_config": 5}, "key 'quantization_config' must be an object, got 5"),
    ({"partial_rotary_factor": 1e-9, "qk_rope_head_dim": None}, "key 'qk_rope_head_dim' must be even, positive"),
])
def test_bad_value_is_named_with_its_range(change, message):
    with pytest.raises(ConfigError) as e:
        from_dict(dict(raw("flash"), **change))
    assert str(e.value).startswith(message), str(e.value)


def test_bad_value_in_the_hf_spelling_names_its_path():
    r = raw("flash")
    r.pop("rope_scaling")
    r["rope_parameters"] = {"main": {"rope_theta": float("nan")}, "compress": {"rope_theta": 160000.0}}
    with pytest.raises(ConfigError, match=r"^key 'rope_parameters.main.rope_theta' must be a finite number"):
        from_dict(r)


def test_file_errors_name_the_file_and_the_key(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(dict(raw("flash"), rope_theta=float("nan"))))  # json writes NaN, and reads it
    with pytest.raises(ConfigError) as e:
        ModelConfig.load(tmp_path)
    assert str(e.value) == f"{path}: key 'rope_theta' must be a finite number above 1, got nan"
    path.write_text(json.dumps(dict(raw("flash"), hidden_size=10 ** 100)))
    with pytest.raises(ConfigError) as e:
        ModelConfig.load(path)
    assert str(e.value) == f"{path}: key 'hidden_size' must be an integer from 1 to 2147483647, got an integer of 333 bits"
    path.write_text('{"hidden_size": ' + "9" * 5000 + "}")  # Python's own parser refuses past 4300 digits
    with pytest.raises(ConfigError) as e:
        ModelConfig.load(path)
    assert str(e.value) == f"{path}: config is not valid JSON (an integer of 5000 digits)"
    path.write_bytes(b'{"a": "\xff"}')
    with pytest.raises(ConfigError, match="config is not UTF-8 text"):
        ModelConfig.load(path)
    path.write_text("[" * 100000 + "]" * 100000)
    with pytest.raises(ConfigError, match="nested too deeply"):
        ModelConfig.load(path)


def test_special_files_are_refused(tmp_path):
    fifo = tmp_path / "fifo"
    fifo.mkdir()
    os.mkfifo(fifo / "config.json")  # reading it would wait for a writer forever
    with pytest.raises(ConfigError) as e:
        ModelConfig.load(fifo)
    assert str(e.value) == f"{fifo / 'config.json'}: is a FIFO, not a regular file"
    with pytest.raises(ConfigError, match="is a character device, not a regular file"):
        ModelConfig.load("/dev/zero")
    (tmp_path / "folder" / "config.json").mkdir(parents=True)
    with pytest.raises(ConfigError, match="config.json: is a folder, not a regular file"):
        ModelConfig.load(tmp_path / "folder")
