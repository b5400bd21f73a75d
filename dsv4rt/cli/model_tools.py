"""Commands that work on a checkpoint: logits, inspect, make-tiny."""
from __future__ import annotations

import io
from collections import Counter
from pathlib import Path

import click
import numpy as np

from . import main
from ..files import read_regular
from ..presets import PRESETS
from .common import DEVICES, numerics_option, resolve_device, save_npy_atomic


def _read_ids(path: str) -> np.ndarray:
    data = read_regular(path, lambda message: ValueError(f"--ids: {message}"))
    try:
        ids = np.load(io.BytesIO(data), allow_pickle=False)
    except (OSError, ValueError, EOFError) as e:
        raise ValueError(f"--ids: {path}: not a readable .npy file ({str(e).splitlines()[0]})") from None
    if ids.ndim != 1 or not np.issubdtype(ids.dtype, np.integer) or len(ids) == 0:
        raise ValueError(f"--ids: {path}: token ids must be a non-empty 1-D integer array, got {ids.dtype} {ids.shape}")
    return ids.astype(np.int64)


def _parse_chunks(text: str | None, tokens: int) -> list[int] | None:
    if not text:
        return None
    try:
        chunks = [int(c) for c in text.split(",")]
    except ValueError:
        raise ValueError(f"--chunks must be comma-separated integers, got '{text}'") from None
    from ..reference.model import check_chunks
    check_chunks(chunks, tokens, lambda message: ValueError(f"--chunks: {message}"))
    return chunks


@main.command()
@click.argument("model", type=click.Path(file_okay=False))
@click.option("--ids", "ids_path", required=True, type=click.Path(dir_okay=False), help="int .npy of token ids")
@click.option("--out", required=True, type=click.Path(dir_okay=False), help="float32 .npy [T, vocab]")
@click.option("--chunks", help="prefill chunk sizes, e.g. 40,1,56 (default: one chunk)")
@click.option("--device", type=click.Choice(DEVICES), default="auto")
@numerics_option
@click.option("--storage", type=click.Choice(["bf16", "float32"]), default="bf16", show_default=True,
              help="GPU storage type (float32: the kernels' tight-check build)")
def logits(model, ids_path, out, chunks, device, numerics, storage):
    """Write the logits of every position of a prompt, fed in the given chunks."""
    from ..config import ModelConfig
    from ..reference import default_numerics, load_model
    from ..reference.model import check_ids
    # every option is checked before the weights are read
    ids = _read_ids(ids_path)
    chunk_sizes = _parse_chunks(chunks, len(ids))
    if not Path(out).resolve().parent.is_dir():
        raise ValueError(f"--out: folder {Path(out).parent} does not exist")
    cfg = ModelConfig.load(model)
    check_ids(ids, cfg.vocab_size, lambda message: ValueError(f"--ids: {message}"))
    numerics = numerics or default_numerics(cfg)
    where = resolve_device(device)
    if where == "cpu":
        logits_all = load_model(model, numerics).logits_chunked(ids, chunk_sizes)
    else:
        logits_all = _gpu_logits(model, ids, chunk_sizes, storage, numerics)
    save_npy_atomic(out, logits_all.astype(np.float32))


def _gpu_logits(model, ids, chunk_sizes, storage, numerics) -> np.ndarray:
    import ml_dtypes
    from ..model.forward import GpuModel
    chunk_sizes = chunk_sizes or [len(ids)]
    m = GpuModel(model, np.float32 if storage == "float32" else ml_dtypes.bfloat16, max_len=len(ids),
                 numerics=numerics)
    bounds = np.cumsum([0] + chunk_sizes)
    return np.concatenate([m.forward(ids[a:b]) for a, b in zip(bounds[:-1], bounds[1:])])


@main.command()
@click.argument("model", type=click.Path(file_okay=False))
def inspect(model):
    """List a checkpoint's tensors, dtypes, layer kinds and parameter counts."""
    from ..loader import Checkpoint
    with Checkpoint.open(model) as ck:
        cfg = ck.config
        names = sorted(ck.names())
        for n in names:
            click.echo(f"{n:60s} {ck.stored_dtype(n):8s} {list(ck.logical_shape(n))}")
        # block scales of fp8/fp4 weights are metadata, not parameters
        counts = {n: int(np.prod(ck.logical_shape(n))) for n in names if not n.endswith(".scale")}
        dtypes = Counter(ck.stored_dtype(n) for n in names)
    total = sum(counts.values())
    experts = sum(c for n, c in counts.items() if ".ffn.experts." in n)
    per_token = total - experts + experts * cfg.n_active // cfg.n_experts
    click.echo(f"\nlayers: {cfg.num_layers} = " + ", ".join(
        f"{cfg.kinds.count(k)} {k}" for k in dict.fromkeys(cfg.kinds)))
    click.echo("layer kinds: " + " ".join(
        f"{i}:{'sliding' if r == 0 else f'c{r}a'}{'/hash' if h else ''}"
        for i, (r, h) in enumerate(zip(cfg.ratios, cfg.hash_layers))))
    click.echo(f"tensors: {len(names)} ({', '.join(f'{v} {k}' for k, v in sorted(dtypes.items()))})")
    click.echo(f"parameters: {total:,} total, {experts:,} in routed experts, {per_token:,} active per token")


@main.command("make-tiny")
@click.argument("out", type=click.Path(file_okay=False))
@click.option("--preset", default="demo", show_default=True, type=click.Choice(list(PRESETS)),
              help="demo: the chat demo; tiny: the smallest; flash-slice: Flash sizes, 8 layers (17 GB)")
@click.option("--seed", default=0, show_default=True, type=click.IntRange(0, 2 ** 32 - 1))
@click.option("--format", "fmt", type=click.Choice(["bf16", "official"]), default="bf16", show_default=True,
              help="official: fp8/fp4 weights with block scales, sharded, as released")
@click.option("--shard-gb", type=float, help="official format: most bytes per shard, in GB  [default: 5]")
def make_tiny_cmd(out, preset, seed, fmt, shard_gb):
    """Write a random small model (official names and dtypes, the V4 tokenizer)."""
    from ..tiny import make_tiny
    click.echo(f"wrote {make_tiny(out, preset, seed, fmt, shard_gb)}")
