"""Random small DeepSeek V4 checkpoints in the official names and dtypes, with the V4 tokenizer."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
import json
import os
import shutil
import tempfile
from pathlib import Path

import ml_dtypes
import numpy as np
from safetensors.numpy import save_file

from .config import from_dict
from .loader import expected_shapes, quant_fp4, quant_fp8, scale_name
from .loader.names import _FP4, _FP8, _is_fp32, released_format  # noqa: F401 (_FP4, _FP8: tests import them here)
from .presets import PRESETS

FORMATS = ("bf16", "official")
QUANTIZATION_CONFIG = dict(activation_scheme="dynamic", fmt="e4m3", quant_method="fp8", scale_fmt="ue8m0",
                           weight_block_size=[128, 128])


def _random(name: str, shape, rng: np.random.Generator, n_experts: int) -> np.ndarray:
    leaf = name.split(".")[-1]
    if name.endswith("tid2eid"):
        return np.stack([rng.permutation(n_experts)[:shape[1]] for _ in range(shape[0])]).astype(np.int32)
    if name.endswith("norm.weight"):
        x = 1.0 + 0.2 * rng.standard_normal(shape)
    elif leaf.endswith("_scale"):
        x = 0.5 + rng.random(shape)
    elif leaf == "attn_sink" or name == "embed.weight":
        x = rng.standard_normal(shape)
    elif leaf in ("ape", "bias") or leaf.endswith("_base"):
        x = (0.1 if leaf == "bias" else 0.5) * rng.standard_normal(shape)
    else:
        x = rng.standard_normal(shape, dtype=np.float32) / np.float32(np.sqrt(shape[-1]))
    return x.astype(np.float32 if _is_fp32(name) else ml_dtypes.bfloat16)


def _official(name: str, x: np.ndarray) -> dict[str, np.ndarray]:
    """One drawn tensor as released: itself, or its fp8/fp4 encoding with the `.scale` companion."""
    quant = {"fp8": quant_fp8, "fp4": quant_fp4}.get(released_format(name))
    if quant is None:
        return {name: x}
    q, scale = quant(x.astype(np.float32))
    return {name: q, scale_name(name): scale}


def make_tiny(out: str | Path, preset: str = "demo", seed: int = 0, fmt: str = "bf16",
              shard_gb: float | None = None) -> Path:
    """Write a preset's random checkpoint, with the V4 tokenizer, into the new folder `out`."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset '{preset}' (choose from {', '.join(PRESETS)})")
    return write_random_checkpoint(out, PRESETS[preset], seed, fmt=fmt, shard_gb=shard_gb)


def write_random_checkpoint(out: str | Path, raw: dict, seed: int = 0, tokenizer: bool = True, fmt: str = "bf16",
                            shard_gb: float | None = None) -> Path:
    """config.json `raw` and random weights in the official names, written atomically: a temporary sibling
    folder renamed at the end. fmt 'bf16': bf16/fp32 weights in one file; 'official': quantised and sharded
    (at most `shard_gb`, default 5 GB, per file) like the released checkpoints, from the same draws."""
    from .chat import tokenizer_json_path
    if fmt not in FORMATS:
        raise ValueError(f"unknown format '{fmt}' (choose from {', '.join(FORMATS)})")
    if shard_gb is not None and (fmt != "official" or not shard_gb > 0):
        raise ValueError("--shard-gb needs --format official and a positive size")
    out = Path(out)
    if out.exists():
        raise ValueError(f"{out} already exists; choose a new folder")
    cfg = from_dict(raw)
    shapes = expected_shapes(cfg)
    # one stream per tensor, drawn on every core (numpy's generators and casts release the GIL):
    # flash-slice has 8.4 billion weights
    streams = np.random.SeedSequence(seed).spawn(len(shapes))
    with ThreadPoolExecutor(os.cpu_count()) as pool:
        drawn = pool.map(lambda item: _random(*item[0], np.random.default_rng(item[1]), cfg.n_experts),
                         zip(shapes.items(), streams))
        tensors = dict(zip(shapes, drawn))
    if fmt == "official":
        raw = dict(raw, quantization_config=QUANTIZATION_CONFIG, expert_dtype="fp4")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        if fmt == "official":   # each draw dropped once encoded: flash-slice's bf16 draws alone are 17 GB
            groups = [_official(n, tensors.pop(n)) for n in list(tensors)]
            _save_sharded(tmp, groups, int((5 if shard_gb is None else shard_gb) * 1e9))
        else:
            save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "np"})
        (tmp / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
        if tokenizer:
            shutil.copyfile(tokenizer_json_path(), tmp / "tokenizer.json")
        umask = os.umask(0)
        os.umask(umask)
        for f in tmp.iterdir():
            f.chmod(0o666 & ~umask)
        tmp.chmod(0o777 & ~umask)  # mkdtemp makes it private
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _save_sharded(folder: Path, groups: list[dict[str, np.ndarray]], shard_bytes: int):
    """model-0000i-of-0000N.safetensors of at most `shard_bytes` (a larger group alone) and the index;
    a group (a weight and its scale) never straddles two shards."""
    shards: list[dict[str, np.ndarray]] = [{}]
    filled = 0
    for g in groups:
        size = sum(x.nbytes for x in g.values())
        if shards[-1] and filled + size > shard_bytes:
            shards.append({})
            filled = 0
        shards[-1].update(g)
        filled += size
    weight_map = {}
    for i, shard in enumerate(shards, 1):
        file = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(folder / file), metadata={"format": "pt"})
        weight_map |= dict.fromkeys(shard, file)
    total = sum(x.nbytes for shard in shards for x in shard.values())
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
