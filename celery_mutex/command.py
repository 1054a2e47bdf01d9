"""``celery -A proj mutex list|show|release``: the ``simple-mutex`` commands on the app's
own lock cache (``app.conf.mutex_cache``, prefix ``app.conf.mutex_prefix``), registered
through Celery's ``celery.commands`` entry point. The work is ``simple_mutex.admin.commands``,
shared with ``simple-mutex``; this module only finds the cache and maps the exit status
(2, one line, for a missing setting, a bad URL or a server down)."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import click

from simple_mutex import SimpleMutexError
from simple_mutex.admin import commands
from simple_mutex.busy import shared_cache
from simple_mutex.caches.adapt import as_cache
from simple_mutex.contract import ConditionalCache
from simple_mutex.errors import ConstraintValueError


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

    def ask(question: str) -> str:
        answer: Any = click.prompt(question, default="", show_default=False)
        return str(answer)

    _run(ctx, lambda cache, default: commands.release_lock(
        cache, key, prefix or default, sys.stdout, slot=slot, yes=yes, ask=ask,
        by="celery mutex release",
    ))  # fmt: skip
