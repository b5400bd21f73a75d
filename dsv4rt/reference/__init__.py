"""numpy reference of DeepSeek V4: the oracle for every kernel and the CPU backend."""
from __future__ import annotations

import numpy as np

from .model import Model, Numerics, SequenceState


def default_numerics(cfg) -> str:
    """Real checkpoints (fp8 weights) were trained with the faithful numerics."""
    return "faithful" if cfg.quant else "exact"


def checkpoint_weights(ck) -> dict:
    """Every tensor the model needs, dequantised to float32 (hash tables stay integer). Copies: the
    arrays must outlive the memory map."""
    from ..loader import expected_shapes
    return {n: np.array(ck.raw(n) if n.endswith("tid2eid") else ck.float32(n)) for n in expected_shapes(ck.config)}


def load_model(model_dir, numerics: str | None = None) -> Model:
    from ..loader import Checkpoint
    with Checkpoint.open(model_dir) as ck:
        ck.validate()
        weights = checkpoint_weights(ck)
        quantized = frozenset(n for n in weights if ck.is_quantized(n))
        cfg = ck.config
    return Model(cfg, weights, Numerics.named(numerics or default_numerics(cfg)), quantized)


__all__ = ["Model", "Numerics", "SequenceState", "checkpoint_weights", "default_numerics", "load_model"]
