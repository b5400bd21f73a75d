"""ModelConfig: a DeepSeek V4 config.json in either spelling (Hugging Face or legacy)."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
HASH_MOE, MOE = "hash_moe", "moe"


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
        try:
            text = path.read_text()
        except FileNotFoundError:
            raise ConfigError(f"{path}: config file not found") from None
        except OSError as e:
            raise ConfigError(f"{path}: cannot read config ({e.strerror})") from None
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}: config is not valid JSON ({e.msg} at line {e.lineno})") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"{path}: config must be a JSON object")
        try:
            return from_dict(raw)
        except ConfigError as e:
            raise ConfigError(f"{path}: {e}") from None


def _ratio_of(cfg: ModelConfig, kind: str) -> int:
    return next((r for r, k in zip(cfg.ratios, cfg.kinds) if k == kind), {CSA: 4, HCA: 128}[kind])


def _get(raw: dict, key: str, kind=int, default=None):
    if key not in raw or raw[key] is None:
        if default is None:
            raise ConfigError(f"missing key '{key}'")
        return default
    v = raw[key]
    if kind is int and (isinstance(v, bool) or not isinstance(v, int)):
        if isinstance(v, float) and v.is_integer():
            return int(v)
        raise ConfigError(f"key '{key}' must be an integer, got {v!r}")
    if kind is float and (isinstance(v, bool) or not isinstance(v, (int, float))):
        raise ConfigError(f"key '{key}' must be a number, got {v!r}")
    return kind(v)


def _positive(raw: dict, key: str, default=None) -> int:
    v = _get(raw, key, int, default)
    if v <= 0:
        raise ConfigError(f"key '{key}' must be positive, got {v}")
    return v


def _layer_kinds(raw: dict, n: int) -> tuple[tuple[str, ...], tuple[int, ...]]:
    rates = raw.get("compress_rates") or {}
    if not isinstance(rates, dict):
        raise ConfigError("key 'compress_rates' must be an object")
    csa = int(rates.get(CSA, raw.get("compress_rate_csa", 4)))
    hca = int(rates.get(HCA, raw.get("compress_rate_hca", 128)))
    if raw.get("layer_types") is not None:
        kinds = list(raw["layer_types"])
        if len(kinds) != n:
            raise ConfigError(f"key 'layer_types' has {len(kinds)} entries, num_hidden_layers is {n}")
        bad = [k for k in kinds if k not in (SLIDING, CSA, HCA)]
        if bad:
            raise ConfigError(f"key 'layer_types' has unknown kinds {bad}")
    elif raw.get("compress_ratios") is not None:
        ratios = list(raw["compress_ratios"])
        if len(ratios) < n:
            raise ConfigError(f"key 'compress_ratios' has {len(ratios)} entries, num_hidden_layers is {n}")
        ratios = ratios[:n]  # a trailing entry belongs to the MTP layer
        nonzero = sorted({r for r in ratios if r})
        if len(nonzero) > 2 or any(not isinstance(r, int) or r < 0 for r in ratios):
            raise ConfigError(f"key 'compress_ratios' must hold 0 and at most two ratios, got {nonzero}")
        if nonzero:
            csa = nonzero[0] if raw.get("compress_rate_csa") is None else csa
            hca = nonzero[-1] if raw.get("compress_rate_hca") is None else hca
        table = {0: SLIDING, csa: CSA, hca: HCA}
        if any(r not in table for r in ratios):
            raise ConfigError(f"key 'compress_ratios' holds ratios other than 0, {csa}, {hca}")
        kinds = [table[r] for r in ratios]
    else:
        raise ConfigError("missing key 'layer_types' (or legacy 'compress_ratios')")
    if csa <= 1 or hca <= 1:
        raise ConfigError(f"key 'compress_rates' must hold ratios above 1, got {csa} and {hca}")
    ratio = {SLIDING: 0, CSA: csa, HCA: hca}
    return tuple(kinds), tuple(ratio[k] for k in kinds)


def _hash_layers(raw: dict, n: int) -> tuple[bool, ...]:
    if raw.get("mlp_layer_types") is not None:
        types = list(raw["mlp_layer_types"])
        if len(types) != n or any(t not in (HASH_MOE, MOE) for t in types):
            raise ConfigError(f"key 'mlp_layer_types' must list {n} entries of '{HASH_MOE}' or '{MOE}'")
        return tuple(t == HASH_MOE for t in types)
    k = _get(raw, "num_hash_layers", int, 3)
    return tuple(i < k for i in range(n))


def _rope(raw: dict, head_dim: int) -> tuple[int, float, float, Yarn | None]:
    params = raw.get("rope_parameters") or {}
    if not isinstance(params, dict):
        raise ConfigError("key 'rope_parameters' must be an object")
    if raw.get("qk_rope_head_dim") is not None:
        rd = _positive(raw, "qk_rope_head_dim")
    elif raw.get("partial_rotary_factor") is not None:
        rd = int(head_dim * _get(raw, "partial_rotary_factor", float))
    else:
        raise ConfigError("missing key 'qk_rope_head_dim' (or 'partial_rotary_factor')")
    if rd % 2 or rd > head_dim:
        raise ConfigError(f"key 'qk_rope_head_dim' must be even and at most head_dim, got {rd}")
    main, comp = params.get("main"), params.get("compress")
    if isinstance(main, dict) and isinstance(comp, dict):
        theta = float(main.get("rope_theta", raw.get("rope_theta", 10000.0)))
        ctheta = float(comp.get("rope_theta", raw.get("compress_rope_theta", 160000.0)))
        scaling = comp
    else:
        theta = _get(raw, "rope_theta", float, 10000.0)
        ctheta = _get(raw, "compress_rope_theta", float, 160000.0)
        scaling = raw.get("rope_scaling") or params
    kind = scaling.get("rope_type", scaling.get("type", "default")) if isinstance(scaling, dict) else "default"
    if kind in ("default", None):
        return rd, theta, ctheta, None
    if kind != "yarn":
        raise ConfigError(f"key 'rope_scaling' has unsupported type '{kind}'")
    try:
        yarn = Yarn(float(scaling["factor"]), int(scaling["original_max_position_embeddings"]),
                    float(scaling.get("beta_fast", 32)), float(scaling.get("beta_slow", 1)))
    except KeyError as e:
        raise ConfigError(f"missing key 'rope_scaling.{e.args[0]}'") from None
    return rd, theta, ctheta, yarn


def from_dict(raw: dict) -> ModelConfig:
    n = _positive(raw, "num_hidden_layers")
    head_dim = _positive(raw, "head_dim")
    heads = _positive(raw, "num_attention_heads")
    if raw.get("num_key_value_heads", 1) != 1:
        raise ConfigError("key 'num_key_value_heads' must be 1 (shared KV)")
    kinds, ratios = _layer_kinds(raw, n)
    rd, theta, ctheta, yarn = _rope(raw, head_dim)
    groups = _positive(raw, "o_groups")
    if heads % groups:
        raise ConfigError(f"key 'o_groups' ({groups}) must divide num_attention_heads ({heads})")
    n_experts = _positive(raw, "n_routed_experts")
    n_active = _positive(raw, "num_experts_per_tok")
    if n_active > n_experts:
        raise ConfigError(f"key 'num_experts_per_tok' ({n_active}) exceeds n_routed_experts ({n_experts})")
    scoring = raw.get("scoring_func", "sqrtsoftplus")
    if scoring != "sqrtsoftplus":
        raise ConfigError(f"key 'scoring_func' must be 'sqrtsoftplus', got {scoring!r}")
    hc = _positive(raw, "hc_mult")
    cfg = ModelConfig(
        vocab_size=_positive(raw, "vocab_size"), hidden_size=_positive(raw, "hidden_size"), num_layers=n,
        num_heads=heads, head_dim=head_dim, rope_dim=rd, q_lora_rank=_positive(raw, "q_lora_rank"),
        o_groups=groups, o_lora_rank=_positive(raw, "o_lora_rank"), window=_positive(raw, "sliding_window"),
        ratios=ratios, kinds=kinds, hash_layers=_hash_layers(raw, n), rope_theta=theta,
        compress_rope_theta=ctheta, yarn=yarn, index_n_heads=_positive(raw, "index_n_heads"),
        index_head_dim=_positive(raw, "index_head_dim"), index_topk=_positive(raw, "index_topk"),
        n_experts=n_experts, n_active=n_active, n_shared=_get(raw, "n_shared_experts", int, 1),
        moe_inter=_positive(raw, "moe_intermediate_size"),
        routed_scaling=_get(raw, "routed_scaling_factor", float, 1.0),
        swiglu_limit=_get(raw, "swiglu_limit", float, 10.0), hc_mult=hc,
        hc_iters=_positive(raw, "hc_sinkhorn_iters", 20), hc_eps=_get(raw, "hc_eps", float, 1e-6),
        eps=_get(raw, "rms_norm_eps", float, 1e-6), bos=_get(raw, "bos_token_id", int, 0),
        eos=_eos(raw), n_mtp=_get(raw, "num_nextn_predict_layers", int, 0),
        quant=raw.get("quantization_config") or {},
    )
    if cfg.n_shared not in (0, 1):
        raise ConfigError(f"key 'n_shared_experts' must be 0 or 1, got {cfg.n_shared}")
    if cfg.index_head_dim < rd or cfg.index_head_dim % 2:
        raise ConfigError(f"key 'index_head_dim' ({cfg.index_head_dim}) must be even and at least qk_rope_head_dim")
    return cfg


def _eos(raw: dict) -> int:
    v = raw.get("eos_token_id", 1)
    return int(v[0]) if isinstance(v, list) and v else _get(raw, "eos_token_id", int, 1)
