"""`dsv4rt generate`: complete a file of prompts in one batch."""
from __future__ import annotations

import json
import time

import click

from . import main
from ..files import read_regular
from .common import DEVICES, max_batched_tokens_option, numerics_option, option_name, resolve_device
from ..reference.sampling import SamplingParams


def _read_prompts(path: str) -> list[str]:
    data = read_regular(path, lambda message: ValueError(f"--prompts: {message}"))
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise ValueError(f"--prompts: {path}: not UTF-8 text") from None
    prompts = [line.rstrip("\r") for line in text.split("\n") if line.strip()]
    if not prompts:
        raise ValueError(f"--prompts: {path}: no prompts (one per line)")
    return prompts


@main.command()
@click.argument("model", type=click.Path(file_okay=False))
@click.option("--prompts", "prompts_path", required=True, type=click.Path(dir_okay=False), help="one prompt a line")
@click.option("--max-new-tokens", default=128, show_default=True, type=int)
@click.option("--temperature", default=0.7, show_default=True, type=float, help="0: greedy")
@click.option("--top-p", default=0.95, show_default=True, type=float)
@click.option("--top-k", default=0, show_default=True, type=int, help="0 disables the cut")
@click.option("--seed", type=int, help="default: a fresh seed")
@click.option("--chat/--raw", default=True, show_default=True, help="wrap each prompt as a user turn, or feed it as is")
@click.option("--json", "as_json", is_flag=True, help="one JSON object a line: ids, text, finish reason")
@click.option("--stats", is_flag=True, help="print time to first token and throughput on stderr")
@click.option("--device", type=click.Choice(DEVICES), default="auto", help="auto: the GPU when one is visible")
@numerics_option
@click.option("--no-prefix-cache", is_flag=True, help="compute every prompt from its first token")
@max_batched_tokens_option
def generate(model, prompts_path, max_new_tokens, temperature, top_p, top_k, seed, chat, as_json, stats, device,
             numerics, no_prefix_cache, max_batched_tokens):
    """Complete every prompt of a file, batched by the serving engine."""
    from ..chat import encode_prompt_ids
    from ..engine import Engine
    params = SamplingParams(temperature, top_p, top_k, max_new_tokens, seed).check(option_name)
    prompts = _read_prompts(prompts_path)
    device = resolve_device(device)
    off = {"prefix_cache_blocks": 0, "prefix_cache_bytes": 0} if no_prefix_cache else {}
    engine = Engine(model, device, numerics=numerics, max_batched_tokens=max_batched_tokens, **off)
    # a typed marker such as <｜Assistant｜> stays text in a chat-wrapped prompt
    inputs = [encode_prompt_ids(engine.tokenizer, [{"role": "user", "content": p}]) for p in prompts] if chat \
        else prompts
    start = time.perf_counter()
    outputs = engine.generate(inputs, params)
    seconds = time.perf_counter() - start
    for i, (prompt, out) in enumerate(zip(prompts, outputs)):
        if as_json:
            click.echo(json.dumps(dict(index=i, prompt=prompt, prompt_ids=out.prompt_ids, token_ids=out.token_ids,
                                       text=out.text, finish_reason=out.finish_reason), ensure_ascii=False))
        else:
            click.echo(f"--- {i} ({out.finish_reason})\n{out.text}")
    if stats:
        firsts = [o.first_token_s for o in outputs if o.first_token_s is not None]
        generated = sum(len(o.token_ids) for o in outputs)
        ttft = f"{1e3 * sum(firsts) / len(firsts):.1f} ms mean, {1e3 * max(firsts):.1f} ms max" if firsts else "n/a"
        click.echo(f"requests {len(outputs)}, prompt tokens {sum(len(o.prompt_ids) for o in outputs)}, "
                   f"generated tokens {generated}; time to first token {ttft}; "
                   f"{seconds:.2f} s, {generated / seconds:.1f} tokens/s{_hbm(engine, seconds)}", err=True)
        if engine.prefix is not None:
            p = engine.prefix.stats
            click.echo(f"prefix cache: {p.hits} hits, {p.blocks_reused} blocks reused, {p.tokens_skipped} tokens skipped",
                       err=True)


def _hbm(engine, seconds: float) -> str:
    """Achieved HBM bandwidth: the bytes each step had to read (dsv4rt.model.roofline) over the run's time."""
    from ..engine.gpu_runner import GpuRunner
    if not isinstance(engine.runner, GpuRunner):
        return ""
    from ..model.roofline import decode_bytes
    m = engine.runner.model
    sizes = {name: a.nbytes for name, a in m.w.items()}
    total = sum(n * decode_bytes(m.cfg, sizes, batch, context, m.dtype.itemsize)
                for (batch, context), n in engine.step_shapes.items())
    return f", {total / seconds / 1e9:.1f} GB/s of HBM reads"
