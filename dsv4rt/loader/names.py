"""Tensor names: Hugging Face layout <-> official layout (docs/formats.md#tensor-names), and the expected shapes."""
from __future__ import annotations

import re

from ..config import CSA, ModelConfig

_TOP_TO_HF = {
    "embed.weight": "model.embed_tokens.weight",
    "head.weight": "head.weight",
    "hc_head_fn": "model.hc_head.hc_fn",
    "hc_head_base": "model.hc_head.hc_base",
    "hc_head_scale": "model.hc_head.hc_scale",
}
_TOP_TO_OFFICIAL = {hf.removeprefix("model."): off for off, hf in _TOP_TO_HF.items()} | {"lm_head.weight": "head.weight"}
_HF_KV_NORM = re.compile(r"^layers\.(\d+)\.attn\.norm\.weight$")
_KV_NORM = re.compile(r"^layers\.(\d+)\.attn\.kv_norm\.weight$")
# the released checkpoints' storage (docs/formats.md#storage-formats); every other linear weight stays bf16
_FP8 = re.compile(r"\.attn\.(wq_a|wq_b|wkv|wo_a|wo_b|indexer\.wq_b)\.weight$|\.ffn\.shared_experts\.w[123]\.weight$")
_FP4 = re.compile(r"\.ffn\.experts\.\d+\.w[123]\.weight$")
_FP32 = ("ape", "attn_sink", "gate.bias")  # the rest of the float tensors are bf16, as released


def to_official(name: str) -> str | None:
    """Official name of a stored tensor of either layout; None for tensors the runtime ignores (MTP)."""
    name = name.removeprefix("model.")
    if name.startswith("mtp."):
        return None
    if name.endswith(".weight_scale_inv"):
        name = name[: -len("weight_scale_inv")] + "scale"
    name = _TOP_TO_OFFICIAL.get(name, name)
    return _HF_KV_NORM.sub(r"layers.\1.attn.kv_norm.weight", name)


def to_hf(name: str) -> str:
    """The name `transformers` writes for an official name."""
    if name in _TOP_TO_HF:
        return _TOP_TO_HF[name]
    return "model." + _KV_NORM.sub(r"layers.\1.attn.norm.weight", name)


def scale_name(weight: str) -> str:
    """Official name of the block-scale companion of a quantised `.weight`."""
    return weight.removesuffix(".weight") + ".scale"


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the model needs, official name -> logical (dequantised) shape."""
    V, D, H, hd, hc = cfg.vocab_size, cfg.hidden_size, cfg.num_heads, cfg.head_dim, cfg.hc_mult
    G, ql, ol, E, F = cfg.o_groups, cfg.q_lora_rank, cfg.o_lora_rank, cfg.n_experts, cfg.moe_inter
    nI, dI = cfg.index_n_heads, cfg.index_head_dim
    out = {"embed.weight": (V, D), "head.weight": (V, D), "norm.weight": (D,),
           "hc_head_fn": (hc, hc * D), "hc_head_base": (hc,), "hc_head_scale": (1,)}
    mix = (2 + hc) * hc
    for L in range(cfg.num_layers):
        p = f"layers.{L}."
        out |= {p + "attn_norm.weight": (D,), p + "ffn_norm.weight": (D,)}
        for part in ("attn", "ffn"):
            out |= {f"{p}hc_{part}_fn": (mix, hc * D), f"{p}hc_{part}_base": (mix,), f"{p}hc_{part}_scale": (3,)}
        a = p + "attn."
        out |= {a + "wq_a.weight": (ql, D), a + "q_norm.weight": (ql,), a + "wq_b.weight": (H * hd, ql),
                a + "wkv.weight": (hd, D), a + "kv_norm.weight": (hd,), a + "wo_a.weight": (G * ol, H * hd // G),
                a + "wo_b.weight": (D, G * ol), a + "attn_sink": (H,)}
        r = cfg.ratios[L]
        if r:
            csa = cfg.kinds[L] == CSA
            out |= _compressor(a + "compressor.", r, (2 if csa else 1) * hd, hd, D)
            if csa:
                i = a + "indexer."
                out |= {i + "wq_b.weight": (nI * dI, ql), i + "weights_proj.weight": (nI, D)}
                out |= _compressor(i + "compressor.", r, 2 * dI, dI, D)
        f = p + "ffn."
        out[f + "gate.weight"] = (E, D)
        if cfg.hash_layers[L]:
            out[f + "gate.tid2eid"] = (V, cfg.n_active)
        else:
            out[f + "gate.bias"] = (E,)
        experts = [f"{f}experts.{e}." for e in range(E)] + ([f + "shared_experts."] if cfg.n_shared else [])
        for x in experts:
            out |= {x + "w1.weight": (F, D), x + "w2.weight": (D, F), x + "w3.weight": (F, D)}
    return out


def _is_fp32(name: str) -> bool:
    return name.endswith(_FP32) or name.split(".")[-1].startswith("hc_")


def released_format(name: str) -> str:
    """How the released checkpoints store an official tensor: fp8, fp4, bf16, fp32, or int32 (hash tables)."""
    if name.endswith("tid2eid"):
        return "int32"
    return "fp8" if _FP8.search(name) else "fp4" if _FP4.search(name) else "fp32" if _is_fp32(name) else "bf16"


def _compressor(c: str, r: int, width: int, hd: int, D: int) -> dict[str, tuple[int, ...]]:
    return {c + "wkv.weight": (width, D), c + "wgate.weight": (width, D), c + "ape": (r, width), c + "norm.weight": (hd,)}
