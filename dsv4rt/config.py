"""ModelConfig: a DeepSeek V4 config.json in either spelling (Hugging Face or legacy)."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from .files import is_int, load_json, read_regular

SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
HASH_MOE, MOE = "hash_moe", "moe"
# sizes and ids travel to the kernels as 32-bit ints
INT_MAX = 2 ** 31 - 1


class ConfigError(ValueError):
    pass


@dataclass(frozen=True)
class Yarn:
    factor: float
    original: int
    beta_fast: float
    beta_slow: float


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    head_dim: int
    rope_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    window: int
    ratios: tuple[int, ...]            # per layer: 0 (sliding), csa ratio or hca ratio
    kinds: tuple[str, ...]             # per layer: SLIDING, CSA or HCA
    hash_layers: tuple[bool, ...]      # per layer: hash-routed MoE
    rope_theta: float
    compress_rope_theta: float
    yarn: Yarn | None                  # applies to compressed layers only
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    n_experts: int
    n_active: int
    n_shared: int
    moe_inter: int
    routed_scaling: float
    swiglu_limit: float
    hc_mult: int
    hc_iters: int
    hc_eps: float
    eps: float
    bos: int = 0
    eos: int = 1
    n_mtp: int = 0
    quant: dict = field(default_factory=dict, compare=False)

    @property
    def csa_ratio(self) -> int:
        return _ratio_of(self, CSA)

    @property
    def hca_ratio(self) -> int:
        return _ratio_of(self, HCA)

    def rope_inv_freq(self, layer: int):
        """Per-pair angular frequencies θ_i of the layer's rope table (float64)."""
        import numpy as np
        rd = self.rope_dim
        compressed = self.kinds[layer] != SLIDING
        base = self.compress_rope_theta if compressed else self.rope_theta
        theta = base ** (-np.arange(0, rd, 2, dtype=np.float64) / rd)
        if not compressed or self.yarn is None:
            return theta
        y = self.yarn

        def corr(n):
            return rd * math.log(y.original / (2 * math.pi * n)) / (2 * math.log(base))
        low = max(math.floor(corr(y.beta_fast)), 0)
        high = min(math.ceil(corr(y.beta_slow)), rd - 1)
        if high == low:
            high += 0.001  # same guard as the published YaRN code: avoids 0/0
        ramp = np.clip((np.arange(rd // 2) - low) / (high - low), 0, 1)
        return theta / y.factor * ramp + theta * (1 - ramp)

    @staticmethod
    def load(path: str | Path) -> "ModelConfig":
        path = Path(path)
        if not path.exists():
            raise ConfigError(f"{path} does not exist")
        if path.is_dir():
            path = path / "config.json"
            if not path.exists():
                raise ConfigError(f"{path}: config file not found")
        text = read_regular(path, ConfigError)
        try:
            # up to 4000 digits the key's own check names it; beyond, Python cannot even convert the number
            raw = load_json(text, most=4000)
        except UnicodeDecodeError:
            raise ConfigError(f"{path}: config is not UTF-8 text") from None
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}: config is not valid JSON ({e.msg} at line {e.lineno})") from None
        except RecursionError:
            raise ConfigError(f"{path}: config is not valid JSON (nested too deeply)") from None
        except ValueError as e:  # json_int's
            raise ConfigError(f"{path}: config is not valid JSON ({e})") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"{path}: config must be a JSON object")
        try:
            return from_dict(raw)
        except ConfigError as e:
            raise ConfigError(f"{path}: {e}") from None


def _ratio_of(cfg: ModelConfig, kind: str) -> int:
    return next((r for r, k in zip(cfg.ratios, cfg.kinds) if k == kind), {CSA: 4, HCA: 128}[kind])


def _show(v) -> str:
    if isinstance(v, int) and v.bit_length() > 64:
        return f"an integer of {v.bit_length()} bits"
    try:
        text = repr(v)
    except ValueError:  # a huge integer inside a list
        return "a value too large to print"
    return text if len(text) <= 40 else text[:37] + "..."


def _value(raw: dict, key: str, default, name: str):
    v = raw.get(key)
    if v is None:
        if default is None:
            raise ConfigError(f"missing key '{name}'")
        return default
    return v


def _int(raw: dict, key: str, default=None, low: int = 1, high: int = INT_MAX, name: str | None = None) -> int:
    name = name or key
    v = _value(raw, key, default, name)
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    if not is_int(v):
        raise ConfigError(f"key '{name}' must be an integer, got {_show(v)}")
    if not low <= v <= high:
        raise ConfigError(f"key '{name}' must be an integer from {low} to {high}, got {_show(v)}")
    return v


def _float(raw: dict, key: str, default, rule: str, ok, name: str | None = None) -> float:
    """A finite number for which ok(x) holds; `rule` says which, in words."""
    name = name or key
    v = _value(raw, key, default, name)
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ConfigError(f"key '{name}' must be a number, got {_show(v)}")
    try:
        x = float(v)
    except OverflowError:
        x = math.inf
    if not (math.isfinite(x) and ok(x)):
        raise ConfigError(f"key '{name}' must be a finite number {rule}, got {_show(v)}")
    return x


def _object(raw: dict, key: str, name: str | None = None) -> dict:
    v = raw.get(key)
    if v is not None and not isinstance(v, dict):
        raise ConfigError(f"key '{name or key}' must be an object, got {_show(v)}")
    return v or {}


def _list(raw: dict, key: str, element: type, n: int, exact: bool = True) -> list:
    """A list of `n` (at least n unless `exact`) elements of type `element`."""
    v = raw[key]
    what = {str: "strings", int: "integers"}[element]
    if not isinstance(v, list) or not all(is_int(x) if element is int else isinstance(x, element) for x in v):
        raise ConfigError(f"key '{key}' must be a list of {what}, got {_show(v)}")
    if len(v) < n or (exact and len(v) != n):
        raise ConfigError(f"key '{key}' has {len(v)} entries, num_hidden_layers is {n}")
    return v


def _layer_kinds(raw: dict, n: int) -> tuple[tuple[str, ...], tuple[int, ...]]:
    rates = _object(raw, "compress_rates")
    csa = _int(rates, CSA, _int(raw, "compress_rate_csa", 4, low=2), low=2, name=f"compress_rates.{CSA}")
    hca = _int(rates, HCA, _int(raw, "compress_rate_hca", 128, low=2), low=2, name=f"compress_rates.{HCA}")
    if raw.get("layer_types") is not None:
        kinds = _list(raw, "layer_types", str, n)
        bad = [k for k in kinds if k not in (SLIDING, CSA, HCA)]
        if bad:
            raise ConfigError(f"key 'layer_types' has unknown kinds {_show(bad)}")
    elif raw.get("compress_ratios") is not None:
        ratios = _list(raw, "compress_ratios", int, n, exact=False)[:n]  # a trailing entry belongs to the MTP layer
        nonzero = sorted({r for r in ratios if r})
        if len(nonzero) > 2 or any(r < 0 or r == 1 or r > INT_MAX for r in ratios):
            raise ConfigError(f"key 'compress_ratios' must hold 0 and at most two ratios above 1, got {_show(nonzero)}")
        if nonzero:
            csa = nonzero[0] if raw.get("compress_rate_csa") is None else csa
            hca = nonzero[-1] if raw.get("compress_rate_hca") is None else hca
        table = {0: SLIDING, csa: CSA, hca: HCA}
        if any(r not in table for r in ratios):
            raise ConfigError(f"key 'compress_ratios' holds ratios other than 0, {csa}, {hca}")
        kinds = [table[r] for r in ratios]
    else:
        raise ConfigError("missing key 'layer_types' (or legacy 'compress_ratios')")
    ratio = {SLIDING: 0, CSA: csa, HCA: hca}
    return tuple(kinds), tuple(ratio[k] for k in kinds)


def _hash_layers(raw: dict, n: int) -> tuple[bool, ...]:
    if raw.get("mlp_layer_types") is not None:
        types = _list(raw, "mlp_layer_types", str, n)
        if any(t not in (HASH_MOE, MOE) for t in types):
            raise ConfigError(f"key 'mlp_layer_types' must list {n} entries of '{HASH_MOE}' or '{MOE}'")
        return tuple(t == HASH_MOE for t in types)
    k = _int(raw, "num_hash_layers", 3, low=0)
    return tuple(i < k for i in range(n))


_ABOVE_1 = ("above 1", lambda x: x > 1)
_POSITIVE = ("above 0", lambda x: x > 0)


def _rope(raw: dict, head_dim: int) -> tuple[int, float, float, Yarn | None]:
    params = _object(raw, "rope_parameters")
    if raw.get("qk_rope_head_dim") is not None:
        rd = _int(raw, "qk_rope_head_dim")
    elif raw.get("partial_rotary_factor") is not None:
        rd = int(head_dim * _float(raw, "partial_rotary_factor", None, "in (0, 1]", lambda x: 0 < x <= 1))
    else:
        raise ConfigError("missing key 'qk_rope_head_dim' (or 'partial_rotary_factor')")
    if rd <= 0 or rd % 2 or rd > head_dim:
        raise ConfigError(f"key 'qk_rope_head_dim' must be even, positive and at most head_dim, got {rd}")
    main, comp = params.get("main"), params.get("compress")
    if isinstance(main, dict) and isinstance(comp, dict):
        theta = _float(main, "rope_theta", _float(raw, "rope_theta", 10000.0, *_ABOVE_1), *_ABOVE_1,
                       name="rope_parameters.main.rope_theta")
        ctheta = _float(comp, "rope_theta", _float(raw, "compress_rope_theta", 160000.0, *_ABOVE_1), *_ABOVE_1,
                        name="rope_parameters.compress.rope_theta")
        scaling, where = comp, "rope_parameters.compress"
    else:
        theta = _float(raw, "rope_theta", 10000.0, *_ABOVE_1)
        ctheta = _float(raw, "compress_rope_theta", 160000.0, *_ABOVE_1)
        where = "rope_scaling" if raw.get("rope_scaling") is not None else "rope_parameters"
        scaling = _object(raw, where)
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind in ("default", None):
        return rd, theta, ctheta, None
    if kind != "yarn":
        raise ConfigError(f"key '{where}' has unsupported type {_show(kind)}")
    yarn = Yarn(_float(scaling, "factor", None, "of at least 1", lambda x: x >= 1, name=f"{where}.factor"),
                _int(scaling, "original_max_position_embeddings", name=f"{where}.original_max_position_embeddings"),
                _float(scaling, "beta_fast", 32.0, *_POSITIVE, name=f"{where}.beta_fast"),
                _float(scaling, "beta_slow", 1.0, *_POSITIVE, name=f"{where}.beta_slow"))
    return rd, theta, ctheta, yarn


def from_dict(raw: dict) -> ModelConfig:
    """The checked config: every key's type and range, and the keys' agreement with each other."""
    n = _int(raw, "num_hidden_layers")
    head_dim = _int(raw, "head_dim")
    heads = _int(raw, "num_attention_heads")
    if _int(raw, "num_key_value_heads", 1) != 1:
        raise ConfigError("key 'num_key_value_heads' must be 1 (shared KV)")
    kinds, ratios = _layer_kinds(raw, n)
    rd, theta, ctheta, yarn = _rope(raw, head_dim)
    groups = _int(raw, "o_groups")
    if heads % groups:
        raise ConfigError(f"key 'o_groups' ({groups}) must divide num_attention_heads ({heads})")
    n_experts = _int(raw, "n_routed_experts")
    n_active = _int(raw, "num_experts_per_tok")
    if n_active > n_experts:
        raise ConfigError(f"key 'num_experts_per_tok' ({n_active}) exceeds n_routed_experts ({n_experts})")
    scoring = raw.get("scoring_func", "sqrtsoftplus")
    if scoring != "sqrtsoftplus":
        raise ConfigError(f"key 'scoring_func' must be 'sqrtsoftplus', got {_show(scoring)}")
    vocab = _int(raw, "vocab_size")
    cfg = ModelConfig(
        vocab_size=vocab, hidden_size=_int(raw, "hidden_size"), num_layers=n,
        num_heads=heads, head_dim=head_dim, rope_dim=rd, q_lora_rank=_int(raw, "q_lora_rank"),
        o_groups=groups, o_lora_rank=_int(raw, "o_lora_rank"), window=_int(raw, "sliding_window"),
        ratios=ratios, kinds=kinds, hash_layers=_hash_layers(raw, n), rope_theta=theta,
        compress_rope_theta=ctheta, yarn=yarn, index_n_heads=_int(raw, "index_n_heads"),
        index_head_dim=_int(raw, "index_head_dim"), index_topk=_int(raw, "index_topk"),
        n_experts=n_experts, n_active=n_active, n_shared=_int(raw, "n_shared_experts", 1, low=0, high=1),
        moe_inter=_int(raw, "moe_intermediate_size"),
        # beyond 100 the routed sum alone overflows float32 activations within a few layers
        routed_scaling=_float(raw, "routed_scaling_factor", 1.0, "in (0, 100]", lambda x: 0 < x <= 100),
        swiglu_limit=_float(raw, "swiglu_limit", 10.0, *_POSITIVE), hc_mult=_int(raw, "hc_mult"),
        # each iteration is a pass over every token's hc x hc matrix
        hc_iters=_int(raw, "hc_sinkhorn_iters", 20, high=1000),
        hc_eps=_float(raw, "hc_eps", 1e-6, "in [0, 1)", lambda x: 0 <= x < 1),
        eps=_float(raw, "rms_norm_eps", 1e-6, "in (0, 1)", lambda x: 0 < x < 1),
        bos=_int(raw, "bos_token_id", 0, low=0, high=vocab - 1), eos=_eos(raw, vocab),
        n_mtp=_int(raw, "num_nextn_predict_layers", 0, low=0), quant=_object(raw, "quantization_config"),
    )
    if cfg.index_head_dim < rd or cfg.index_head_dim % 2:
        raise ConfigError(f"key 'index_head_dim' ({cfg.index_head_dim}) must be even and at least qk_rope_head_dim")
    return cfg


def _eos(raw: dict, vocab: int) -> int:
    """eos_token_id: one id, or a non-empty list of ids whose first is the one the model emits."""
    v = raw.get("eos_token_id")
    if isinstance(v, list):
        if not v or not all(is_int(x) for x in v):
            raise ConfigError(f"key 'eos_token_id' must be an id or a non-empty list of ids, got {_show(v)}")
        return _int({"eos_token_id": v[0]}, "eos_token_id", low=0, high=vocab - 1)
    return _int(raw, "eos_token_id", 1, low=0, high=vocab - 1)
