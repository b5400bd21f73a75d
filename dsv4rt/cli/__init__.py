"""The `dsv4rt` command line. Every failure is one line on stderr and a non-zero exit."""
from __future__ import annotations

import sys

import click


class Commands(click.Group):
    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except click.UsageError as e:  # a bad option: its one line, without the usage text around it
            click.echo(f"error: {e.format_message()}", err=True)
            sys.exit(e.exit_code)
        except (click.exceptions.Exit, click.ClickException, click.Abort):
            raise
        except KeyboardInterrupt:
            click.echo("", err=True)
            sys.exit(130)
        except MemoryError:
            click.echo("error: out of host memory", err=True)
            sys.exit(1)
        except (ValueError, OSError, RuntimeError, KeyError) as e:
            msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            click.echo(f"error: {msg}", err=True)
            sys.exit(1)


@click.group(cls=Commands)
@click.version_option(package_name="dsv4rt")
def main():
    """Serve DeepSeek V4 from Python without PyTorch."""


# the command modules register themselves on `main`
from . import bench, build, chat, generate, model_tools, plan, serve, template  # noqa: E402,F401

__all__ = ["main"]
