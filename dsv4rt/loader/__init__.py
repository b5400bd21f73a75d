"""Checkpoint loading: safetensors via mmap, both tensor-name layouts, fp8/fp4 weight formats."""
from .checkpoint import Checkpoint
from .formats import (dequant_fp4, dequant_fp8, e8m0_to_float32, fp4_scale_shape, fp8_scale_shape, quant_fp4,
                      quant_fp8)
from .names import expected_shapes, scale_name, to_hf, to_official
from .safetensors import CheckpointError, SafetensorsFile

__all__ = ["Checkpoint", "CheckpointError", "SafetensorsFile", "expected_shapes", "scale_name", "to_hf",
           "to_official", "dequant_fp4", "dequant_fp8", "e8m0_to_float32", "fp4_scale_shape", "fp8_scale_shape",
           "quant_fp4", "quant_fp8"]
