"""The `dsv4rt` command line. Every failure is one line on stderr and a non-zero exit."""
from __future__ import annotations

import sys

import click

from .common import one_line


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
        except (MemoryError, ValueError, OSError, RuntimeError, KeyError) as e:
            click.echo(f"error: {one_line(e)}", err=True)
            sys.exit(1)


@click.group(cls=Commands)
@click.version_option(package_name="dsv4rt")
def main():
    """Serve DeepSeek V4 from Python without PyTorch."""


# the command modules register themselves on `main`
from . import bench, build, chat, generate, model_tools, plan, serve, template  # noqa: E402,F401

__all__ = ["main"]
