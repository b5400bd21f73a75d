"""`dsv4rt serve`: the OpenAI-compatible HTTP server (dsv4rt/server)."""
from __future__ import annotations

import contextlib
import signal
from pathlib import Path

import click

from . import main
from .common import DEVICES, max_batched_tokens_option, numerics_option


@main.command()
@click.argument("model", type=click.Path(file_okay=False))
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", default=8000, show_default=True, type=click.IntRange(0, 65535))
@click.option("--api-key", help="require 'Authorization: Bearer KEY' on /v1 requests")
@click.option("--served-model-name", help="the model name clients send (default: MODEL's folder name)")
@click.option("--device", type=click.Choice(DEVICES), default="auto", help="auto: the GPU when one is visible")
@click.option("--max-running", default=64, show_default=True, type=click.IntRange(1), help="requests batched at once")
@click.option("--max-waiting", default=256, show_default=True, type=click.IntRange(0),
              help="queued requests beyond which new ones get 429")
@click.option("--max-model-len", default=65536, show_default=True, type=click.IntRange(2),
              help="prompt + completion positions of one request")
@click.option("--kv-gib", default=4.0, show_default=True, type=click.FloatRange(0, min_open=True),
              help="KV-cache memory")
@click.option("--max-body-bytes", default=32 << 20, show_default=True, type=click.IntRange(1))
@click.option("--grace-seconds", default=30.0, show_default=True, type=click.FloatRange(0),
              help="on SIGTERM, how long running requests may finish before they are aborted")
@numerics_option
@max_batched_tokens_option
def serve(model, host, port, api_key, served_model_name, device, max_running, max_waiting, max_model_len, kv_gib,
          max_body_bytes, grace_seconds, numerics, max_batched_tokens):
    """Serve MODEL over an OpenAI-compatible HTTP API (chat, completions, models, health, metrics)."""
    import uvicorn
    from ..server import EngineProcess, Server
    signal.signal(signal.SIGTERM, signal.default_int_handler)    # while the engine starts, as Ctrl-C: stop it
    engine = EngineProcess(model, device, kv_bytes=int(kv_gib * (1 << 30)), max_running=max_running,
                           max_len=max_model_len, numerics=numerics, max_batched_tokens=max_batched_tokens)
    try:
        name = served_model_name or Path(model).resolve().name
        server = Server(engine, name, api_key, max_waiting, max_body_bytes)
        config = uvicorn.Config(server.app(), host=host, port=port, log_level="warning", access_log=False,
                                timeout_graceful_shutdown=grace_seconds, lifespan="off")
        web = _web_server(config)

        def stop(signum, frame):
            server.draining = True
            web.force_exit = web.should_exit and signum == signal.SIGINT     # a second Ctrl-C: stop now
            web.should_exit = True
        signal.signal(signal.SIGTERM, stop)
        signal.signal(signal.SIGINT, stop)
        engine.on_exit = lambda: stop(signal.SIGTERM, None)      # its streams have ended: drain and exit 1
        click.echo(f"dsv4rt serve: {model} as '{name}' on {engine.device} (engine process {engine.process.pid}), "
                   f"http://{host}:{port}/v1", err=True)
        web.run()
        engine.abort_all()                      # past the grace period: abort what is left
    finally:
        engine.close()
    if engine.failure:
        raise RuntimeError(engine.failure)
    if not web.started:
        raise click.ClickException(f"could not listen on {host}:{port}")


def _web_server(config):
    import uvicorn

    class Web(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self):
            # serve() handles SIGTERM and SIGINT: uvicorn's own handler re-raises the signal once shut
            # down, which would end the process with the signal's status instead of 0
            yield
    return Web(config)
