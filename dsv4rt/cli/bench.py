"""`dsv4rt bench decode|prefill|serve`: step times against the HBM roofline, prefill throughput, and a
serving run's latencies. Each prints a table and writes JSON (--json)."""
from __future__ import annotations

import json
import math
import os

import click
from . import main
from .common import max_batched_tokens_option

# A kernel's device-to-device copy on the H200, read plus write (the device tool's KINDS.md; a driver
# memcpy runs on the copy engines and is slower). Pass --copy-gbps to use another measurement.
COPY_GBPS = 4300.0
# cuBLAS bf16 8192³ on the H200 (bench/kernels.py, bench/NOTES.md): the prefill's matrix ceiling.
BF16_TFLOPS = 790.0
MAX_PREFILL_TOKENS = 1 << 20     # max_position_embeddings of the released models


def _ints(ctx, param, text: str) -> list[int]:
    """A click callback: positive whole numbers, comma-separated (1e6 allowed)."""
    try:
        values = [float(x) for x in text.split(",") if x]
    except ValueError:
        values = []
    if not values or not all(math.isfinite(v) and v >= 1 and v == int(v) for v in values):
        raise click.BadParameter(f"'{text}' is not a comma-separated list of positive whole numbers")
    return [int(v) for v in values]


def _span(ctx, param, text: str) -> list[int]:
    """A click callback: min,max with 1 <= min <= max."""
    values = _ints(ctx, param, text)
    if len(values) != 2 or values[0] > values[1]:
        raise click.BadParameter(f"'{text}' must be min,max with min <= max")
    return values


def _prompt_lengths(ctx, param, text: str) -> list[int]:
    values = _ints(ctx, param, text)
    if max(values) > MAX_PREFILL_TOKENS:
        raise click.BadParameter(
            f"{max(values)} is above {MAX_PREFILL_TOKENS} tokens, the longest prompt the models take")
    return values


def _positive(ctx, param, value: float) -> float:
    if not (math.isfinite(value) and value > 0):
        raise click.BadParameter(f"{value} must be a finite number above 0")
    return value


def _write(path: str | None, data: dict) -> None:
    if path:
        tmp = f"{path}.tmp{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump(data, f, indent=1)
        os.replace(tmp, path)


def _table(rows: list[dict], cols: list[str]) -> None:
    click.echo("| " + " | ".join(cols) + " |")
    click.echo("|" + "---|" * len(cols))
    for r in rows:
        click.echo("| " + " | ".join(_fmt(r.get(c, "")) for c in cols) + " |")


def _fmt(v) -> str:
    return f"{v:.3f}" if isinstance(v, float) else str(v)


@main.group()
def bench():
    """Benchmarks on the GPU (tables on stdout, JSON with --json)."""


@bench.command()
@click.option("--model", "model_dir", required=True, type=click.Path(file_okay=False))
@click.option("--batch", "batches", default="1,8,32,64", show_default=True, callback=_ints)
@click.option("--context", "contexts", default="4096,65536,1048576", show_default=True, callback=_ints)
@click.option("--reps", default=50, show_default=True, type=click.IntRange(min=1))
@click.option("--copy-gbps", default=COPY_GBPS, show_default=True, type=float, callback=_positive)
@click.option("--json", "json_path", type=click.Path(dir_okay=False))
def decode(model_dir, batches, contexts, reps, copy_gbps, json_path):
    """Decode step time (CUDA graph replays) at each batch × context. The context is made by filling the
    caches with random entries of the right layout (no prefill), so 1M-token contexts take seconds."""
    from .. import benchmarks
    rows = benchmarks.decode(model_dir, batches, contexts, reps, copy_gbps)
    _table(rows, ["batch", "context", "step_ms", "roofline_ms", "fraction", "host_us", "gbps", "note"])
    _write(json_path, dict(kind="decode", copy_gbps=copy_gbps, context_fill="random entries", rows=rows))


@bench.command()
@click.option("--model", "model_dir", required=True, type=click.Path(file_okay=False))
@click.option("--tokens", default="8192,65536", show_default=True, callback=_prompt_lengths)
@click.option("--reps", default=3, show_default=True, type=click.IntRange(1),
              help="timed runs per length after a warm one (the median); prompts over 64K run once")
@click.option("--json", "json_path", type=click.Path(dir_okay=False))
def prefill(model_dir, tokens, reps, json_path):
    """Prefill throughput of one prompt of each length (random token ids), through the chunked forward, with the
    FLOPs a token costs (dsv4rt/model/roofline.py) and the fraction of the bf16 ceiling achieved."""
    from .. import benchmarks
    rows = benchmarks.prefill(model_dir, tokens, BF16_TFLOPS, reps=reps)
    _table(rows, ["tokens", "seconds", "tokens_per_s", "gflop_per_token", "tflops", "fraction", "note"])
    _write(json_path, dict(kind="prefill", bf16_tflops=BF16_TFLOPS, rows=rows))


@bench.command()
@click.option("--model", "model_dir", type=click.Path(file_okay=False), help="serve in this process (the GPU)")
@click.option("--url", help="drive a running `dsv4rt serve` at http://HOST:PORT over HTTP, each client streaming")
@click.option("--api-key", help="the server's --api-key")
@click.option("--against", type=click.Path(exists=True, dir_okay=False),
              help="the --json file of another serve run, shown beside this one")
@click.option("--requests", default=64, show_default=True, type=click.IntRange(min=1))
@click.option("--prompt-len", default="64,2048", show_default=True, callback=_span, help="min,max prompt tokens")
@click.option("--output-len", default="16,256", show_default=True, callback=_span, help="min,max new tokens")
@click.option("--max-running", default=64, show_default=True, type=click.IntRange(min=1))
@max_batched_tokens_option
@click.option("--seed", default=0, show_default=True, type=click.IntRange(0, 2 ** 32 - 1))
@click.option("--json", "json_path", type=click.Path(dir_okay=False))
def serve(model_dir, url, api_key, against, requests, prompt_len, output_len, max_running, max_batched_tokens, seed,
          json_path):
    """N requests of random lengths, all arriving at once, served to completion by the engine in this
    process (--model) or by a running server over HTTP (--url); the same requests either way."""
    if (model_dir is None) == (url is None):
        raise click.UsageError("give one of --model (in process) and --url (a running server)")
    rows = []
    if against:
        with open(against) as f:
            rows = [dict(r, where=r.get("where", against)) for r in json.load(f)["rows"]]
    if url:
        from ..server.load import drive, workload
        row = dict(where=url, **drive(url, workload(requests, prompt_len, output_len, seed), api_key))
    else:
        from .. import benchmarks
        row = dict(where="in process", **benchmarks.serve(model_dir, requests, prompt_len, output_len, max_running,
                                                           max_batched_tokens, seed))
    _table(rows + [row], list(row))
    _write(json_path, dict(kind="serve", rows=[row]))
