"""`dsv4rt bench decode|prefill|serve`: step times against the HBM roofline, prefill throughput, and a
serving run's latencies. Each prints a table and writes JSON (--json)."""
from __future__ import annotations

import json
import os

import click
from . import main

# A kernel's device-to-device copy on the H200, read plus write (the device tool's KINDS.md; a driver
# memcpy runs on the copy engines and is slower). Pass --copy-gbps to use another measurement.
COPY_GBPS = 4300.0


def _ints(text: str) -> list[int]:
    try:
        return [int(float(x)) for x in text.split(",") if x]
    except ValueError:
        raise click.BadParameter(f"'{text}' is not a comma-separated list of numbers") from None


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
@click.option("--batch", "batches", default="1,8,32,64", show_default=True)
@click.option("--context", "contexts", default="4096,65536,1048576", show_default=True)
@click.option("--reps", default=50, show_default=True, type=int)
@click.option("--copy-gbps", default=COPY_GBPS, show_default=True, type=float)
@click.option("--json", "json_path", type=click.Path(dir_okay=False))
def decode(model_dir, batches, contexts, reps, copy_gbps, json_path):
    """Decode step time (CUDA graph replays) at each batch × context. The context is made by filling the
    caches with random entries of the right layout (no prefill), so 1M-token contexts take seconds."""
    from .. import benchmarks
    rows = benchmarks.decode(model_dir, _ints(batches), _ints(contexts), reps, copy_gbps)
    _table(rows, ["batch", "context", "step_ms", "roofline_ms", "fraction", "host_us", "gbps", "note"])
    _write(json_path, dict(kind="decode", copy_gbps=copy_gbps, context_fill="random entries", rows=rows))


@bench.command()
@click.option("--model", "model_dir", required=True, type=click.Path(file_okay=False))
@click.option("--tokens", default="8192,65536", show_default=True)
@click.option("--json", "json_path", type=click.Path(dir_okay=False))
def prefill(model_dir, tokens, json_path):
    """Prefill throughput of one prompt of each length (random token ids), through the chunked forward."""
    from .. import benchmarks
    rows = benchmarks.prefill(model_dir, _ints(tokens))
    _table(rows, ["tokens", "seconds", "tokens_per_s", "note"])
    _write(json_path, dict(kind="prefill", rows=rows))


@bench.command()
@click.option("--model", "model_dir", required=True, type=click.Path(file_okay=False))
@click.option("--requests", default=64, show_default=True, type=int)
@click.option("--prompt-len", default="64,2048", show_default=True, help="min,max prompt tokens")
@click.option("--output-len", default="16,256", show_default=True, help="min,max new tokens")
@click.option("--max-running", default=64, show_default=True, type=int)
@click.option("--seed", default=0, show_default=True, type=int)
@click.option("--json", "json_path", type=click.Path(dir_okay=False))
def serve(model_dir, requests, prompt_len, output_len, max_running, seed, json_path):
    """N requests of random lengths, all arriving at once, served by the engine to completion."""
    from .. import benchmarks
    row = benchmarks.serve(model_dir, requests, _ints(prompt_len), _ints(output_len), max_running, seed)
    _table([row], list(row))
    _write(json_path, dict(kind="serve", rows=[row]))
