"""`dsv4rt plan`: the KV cache a model needs for a context and batch, kind by kind; with --step, what the GPU build
holds besides (docs/caches.md#a-1m-token-prompt); with --gpus, the weights each GPU of a group holds and the cache
tokens left room for (docs/parallel.md#memory)."""
from __future__ import annotations

import json
import math
from pathlib import Path

import click

from . import main
from .common import numerics_option
from ..config import ModelConfig, from_dict
from ..kv.plan import CLASS_NAMES, build_plan, default_numerics
from ..parallel.plan import GPU_MEMORY, WORKSPACE, group_plan
from ..presets import PRESETS

GIB, MIB = 1 << 30, 1 << 20


@main.command("plan")
@click.option("--model", required=True, type=click.Path(),
              help=f"checkpoint folder, its config.json, or a make-tiny preset ({', '.join(PRESETS)})")
@click.option("--context", type=int, help="tokens per sequence")
@click.option("--batch", default=1, show_default=True, type=int, help="sequences held at once")
@numerics_option
@click.option("--step", type=click.IntRange(1), help="with --context: the bf16 GPU build's weights, workspaces and "
              "page tables for --batch sequences of --context positions fed in steps of this many tokens (an H200)")
@click.option("--gpus", type=int, help="GPUs of one host the model is split over")
@click.option("--gpu-memory", default=GPU_MEMORY / GIB, show_default=True, type=float, help="GiB per GPU (--gpus)")
@click.option("--workspace", default=WORKSPACE / GIB, show_default=True, type=float,
              help="GiB per GPU set aside for activations, workspaces and graphs (--gpus)")
@click.option("--json", "as_json", is_flag=True, help="print JSON instead of a table")
def plan_cmd(model, context, batch, numerics, step, gpus, gpu_memory, workspace, as_json):
    """Print the KV cache plan: kinds, page sizes, size classes and totals; with --gpus, memory per GPU."""
    if step is not None and context is None:
        raise ValueError("--step sizes the build for --context positions: give both")
    if context is None and gpus is None:
        raise ValueError("give --context, --gpus or both")
    if context is not None and context <= 0:
        raise ValueError(f"--context must be positive, got {context}")
    if batch <= 0:
        raise ValueError(f"--batch must be positive, got {batch}")
    if not (math.isfinite(gpu_memory) and gpu_memory > 0 and math.isfinite(workspace) and workspace >= 0):
        raise ValueError(f"--gpu-memory must be positive and --workspace not negative, got {gpu_memory}, {workspace}")
    cfg = from_dict(PRESETS[model]) if model in PRESETS and not Path(model).exists() else ModelConfig.load(model)
    g = group_plan(cfg, gpus, round(gpu_memory * GIB), round(workspace * GIB), numerics) if gpus is not None else {}
    s = build_plan(cfg, numerics).summary(context, batch, step or 1) if context is not None else {}
    b = {}
    if step is not None:
        from ..model.memory import memory_plan     # the GPU model's modules, only when asked for
        b = memory_plan(cfg, numerics or default_numerics(cfg), max_len=context, rows=min(step, context),
                        max_batch=batch)
    if as_json:
        click.echo(json.dumps(dict(model=str(model), **s, **g, **(dict(gpu_build=b) if b else {})), indent=2))
        return
    if g:
        _print_group(g)
    if s:
        _print_cache(s, context, batch)
    if b:
        _print_build(b, s["total_bytes"])


def _print_group(g: dict):
    click.echo(f"{g['gpus']} GPU{'s' if g['gpus'] > 1 else ''} of {g['gpu_memory_bytes'] / GIB:g} GiB, "
               f"{g['workspace_bytes'] / GIB:g} GiB each set aside for workspace")
    click.echo(f"weights: {g['weight_bytes_total'] / GIB:.2f} GiB in all, {g['weight_bytes_per_gpu'] / GIB:.2f} GiB "
               f"on the fullest GPU ({g['weight_bytes_replicated'] / GIB:.2f} GiB held more than once)")
    if not g["fits"]:
        click.echo("the weights and workspace do not fit: no room for a cache")
        return
    click.echo(f"cache: {g['kv_tokens']:,} tokens at {g['kv_bytes_per_token']:,.2f} B per token "
               f"({g['kv_numerics']} numerics), every GPU holding every sequence's cache")


def _print_cache(s: dict, context: int, batch: int):
    click.echo(f"{'kind':17s} {'layers':>6s} {'entry B':>8s} {'pos/page':>8s} {'page B':>8s} {'class':>6s} "
               f"{'pages/layer':>11s} {'MiB/seq':>10s}")
    for k in s["kinds"]:
        click.echo(f"{k['name']:17s} {k['layers']:6d} {k['entry_bytes']:8,d} {k['positions_per_page']:8d} "
                   f"{k['page_bytes']:8,d} {k['size_class']:>6s} {k['pages_per_layer']:11,d} "
                   f"{k['bytes_per_sequence'] / MIB:10.2f}")
    classes = ", ".join(f"{n} {b:,} B" for n, b in zip(CLASS_NAMES, s["size_classes"]))
    click.echo(f"\nnumerics {s['numerics']}; size classes: {classes}")
    click.echo(f"bytes per token: {s['bytes_per_token']:,.2f} (entries alone: {s['ideal_bytes_per_token']:,.2f})")
    click.echo(f"per sequence of {context:,} tokens: {s['bytes_per_sequence'] / GIB:.4f} GiB "
               f"(windows, states and padding: {s['overhead_bytes'] / MIB:.2f} MiB)")
    click.echo(f"for {batch} sequence{'s' if batch > 1 else ''}: {s['total_bytes'] / GIB:.4f} GiB")


def _print_build(b: dict, cache: int):
    click.echo(f"\nGPU build ({b['dtype']}, {b['numerics']} numerics, {b['sm_count']} SMs): max_len {b['max_len']:,}, "
               f"steps of {b['rows']:,} rows")
    click.echo(f"{'weights':22s} {b['weights'] / MIB:12,.2f} MiB")
    click.echo(f"{'step workspace':22s} {sum(b['workspace'].values()) / MIB:12,.2f} MiB")
    for name, size in sorted(b["workspace"].items(), key=lambda x: -x[1]):
        note = f"  {b['score_rows']:,} rows × {b['n_max']:,} entries a launch" if name == "scores" else ""
        click.echo(f"  {name:20s} {size / MIB:12,.2f} MiB{note}")
    for name, size in b["other"].items():
        click.echo(f"{name:22s} {size / MIB:12,.2f} MiB")
    click.echo(f"in all {b['total'] / GIB:.4f} GiB; with the cache above {(b['total'] + cache) / GIB:.4f} GiB")
