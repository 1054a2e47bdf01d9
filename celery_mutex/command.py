"""``celery -A proj mutex list|show|release|step-over|watch|serve``: the ``simple-mutex`` commands
on the app's own lock cache (``app.conf.mutex_cache``, prefix ``app.conf.mutex_prefix``),
registered through Celery's ``celery.commands`` entry point. The work is
``simple_mutex.admin.commands`` and ``simple_mutex.admin.serve``, shared with
``simple-mutex``; this module only finds the cache and maps the exit status (2, one line,
for a missing setting, a bad URL or a server down)."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Any

import click

from simple_mutex import SimpleMutexError
from simple_mutex.admin import commands
from simple_mutex.admin.serve import TOKEN_ENV
from simple_mutex.admin.serve import serve as serve_page
from simple_mutex.busy import shared_cache
from simple_mutex.caches.adapt import as_cache
from simple_mutex.contract import ConditionalCache
from simple_mutex.errors import ConstraintValueError

from .line import end_stepped_over


def _cache_of(ctx: click.Context) -> tuple[ConditionalCache, str]:
    conf = ctx.find_root().obj.app.conf
    spec = conf.get("mutex_cache")
    if spec is None:
        raise ConstraintValueError(
            "app.conf.mutex_cache is not set: set it to your lock cache's URL "
            "(e.g. 'redis://host:6379/0'), or run simple-mutex with that URL"
        )
    prefix = conf.get("mutex_prefix") or "mutex."
    return as_cache(shared_cache(spec)), prefix


def _run(ctx: click.Context, work: Callable[[ConditionalCache, str], int]) -> None:
    try:
        cache, prefix = _cache_of(ctx)
        status = work(cache, prefix)
    except SimpleMutexError as exc:
        click.echo(commands.one_line(exc), err=True)
        status = 2
    ctx.exit(status)


_PREFIX = click.option(
    "--prefix", default=None, help="the locks' prefix (default: app.conf.mutex_prefix or mutex.)"
)


@click.group(name="mutex")
def mutex() -> None:
    """See and free simple-mutex locks in the app's mutex_cache."""


@mutex.command(name="list")
@_PREFIX
@click.option("--json", "json_output", is_flag=True, help="print a JSON array")
@click.pass_context
def list_(ctx: click.Context, prefix: str | None, json_output: bool) -> None:
    """List the live locks."""
    _run(ctx, lambda cache, default: commands.list_locks(
        cache, prefix or default, sys.stdout, json_output=json_output))  # fmt: skip


@mutex.command()
@click.argument("key")
@_PREFIX
@click.pass_context
def show(ctx: click.Context, key: str, prefix: str | None) -> None:
    """Show one key in full (every slot of a semaphore)."""
    _run(ctx, lambda cache, default: commands.show_lock(cache, key, prefix or default, sys.stdout))


@mutex.command()
@click.argument("key")
@_PREFIX
@click.option("--slot", type=int, default=None, help="which permit of a semaphore to free")
@click.option("--yes", is_flag=True, help="do not ask first")
@click.pass_context
def release(ctx: click.Context, key: str, prefix: str | None, slot: int | None, yes: bool) -> None:
    """Free the holder of KEY, exactly the one read (refused if it changed since)."""
    _run(ctx, lambda cache, default: commands.release_lock(
        cache, key, prefix or default, sys.stdout, slot=slot, yes=yes, ask=_ask,
        by="celery mutex release",
    ))  # fmt: skip


@mutex.command(name="step-over")
@click.argument("key")
@click.argument("ticket", type=int)
@_PREFIX
@click.option("--yes", is_flag=True, help="do not ask first")
@click.pass_context
def step_over(ctx: click.Context, key: str, ticket: int, prefix: str | None, yes: bool) -> None:
    """Step over TICKET of KEY's line (`show KEY` lists them): that call never runs (its
    result is stored REVOKED), and the calls behind it go on at a worker's next sweep."""
    app = ctx.find_root().obj.app
    _run(ctx, lambda cache, default: commands.step_over_call(
        cache, key, ticket, prefix or default, sys.stdout, yes=yes, ask=_ask,
        by="celery mutex step-over", ended=lambda message: end_stepped_over(app, message),
    ))  # fmt: skip


def _ask(question: str) -> str:
    answer: Any = click.prompt(question, default="", show_default=False)
    return str(answer)


@mutex.command()
@_PREFIX
@click.option("--interval", type=float, default=1.0, help="seconds between refreshes")
@click.pass_context
def watch(ctx: click.Context, prefix: str | None, interval: float) -> None:
    """A live table of holders, takeovers and parked calls, until Ctrl-C."""
    if not 0 < interval <= 3600:
        raise click.BadParameter("must be seconds in (0, 3600]", param_hint="--interval")
    _run(ctx, lambda cache, default: commands.watch_locks(
        cache, prefix or default, sys.stdout, interval=interval))  # fmt: skip


@mutex.command()
@_PREFIX
@click.option("--host", default="127.0.0.1", help="the address to listen on")
@click.option("--port", type=int, default=8765, help="the port (0: any free one)")
@click.option("--interval", type=float, default=1.0, help="seconds between reads of the cache")
@click.option("--actions", is_flag=True, help=f"allow the page's actions ({TOKEN_ENV})")
@click.pass_context
def serve(
    ctx: click.Context, prefix: str | None, host: str, port: int, interval: float, actions: bool
) -> None:
    """A live web page of held keys, lines and events (simple-mutex serve), until Ctrl-C."""

    def work(cache: ConditionalCache, default: str) -> int:
        try:
            return serve_page(cache, prefix or default, sys.stdout, host=host, port=port,
                              interval=interval, actions=actions,
                              token=os.environ.get(TOKEN_ENV) or None)  # fmt: skip
        except OSError as exc:
            click.echo(commands.one_line(f"cannot listen on {host}:{port}: {exc}"), err=True)
            return 2

    _run(ctx, work)
