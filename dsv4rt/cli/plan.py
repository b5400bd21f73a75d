"""`dsv4rt plan`: the KV cache a model needs for a context and batch, kind by kind."""
from __future__ import annotations

import json

import click

from . import main
from ..config import ModelConfig
from ..kv.plan import CLASS_NAMES, NUMERICS, build_plan

GIB, MIB = 1 << 30, 1 << 20


@main.command("plan")
@click.option("--model", required=True, type=click.Path(), help="checkpoint folder or its config.json")
@click.option("--context", required=True, type=int, help="tokens per sequence")
@click.option("--batch", default=1, show_default=True, type=int, help="sequences held at once")
@click.option("--numerics", type=click.Choice(NUMERICS), help="default: faithful for fp8 checkpoints")
@click.option("--json", "as_json", is_flag=True, help="print JSON instead of a table")
def plan_cmd(model, context, batch, numerics, as_json):
    """Print the KV cache plan: kinds, page sizes, size classes and totals."""
    if context <= 0:
        raise ValueError(f"--context must be positive, got {context}")
    if batch <= 0:
        raise ValueError(f"--batch must be positive, got {batch}")
    s = build_plan(ModelConfig.load(model), numerics).summary(context, batch)
    if as_json:
        click.echo(json.dumps(dict(model=str(model), **s), indent=2))
        return
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
