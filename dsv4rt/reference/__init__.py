"""numpy reference of DeepSeek V4: the oracle for every kernel and the CPU backend."""
from __future__ import annotations

import numpy as np

from .model import Model, Numerics, SequenceState


def default_numerics(cfg) -> str:
    """Real checkpoints (fp8 weights) were trained with the faithful numerics."""
    return "faithful" if cfg.quant else "exact"


def load_model(model_dir, numerics: str | None = None) -> Model:
    from ..loader import Checkpoint, expected_shapes
    with Checkpoint.open(model_dir) as ck:
        ck.validate()
        names = expected_shapes(ck.config)
        # copies: the arrays must outlive the memory map
        weights = {n: np.array(ck.raw(n) if n.endswith("tid2eid") else ck.float32(n)) for n in names}
        quantized = frozenset(n for n in names if ck.is_quantized(n))
        cfg = ck.config
    return Model(cfg, weights, Numerics.named(numerics or default_numerics(cfg)), quantized)


__all__ = ["Model", "Numerics", "SequenceState", "default_numerics", "load_model"]
