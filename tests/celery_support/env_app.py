"""The one place the suites' worker apps read their settings from the environment.

Every app a real ``celery worker`` (or ``celery beat``) subprocess runs is configured by
variables the test sets: ``<env>_BROKER``, ``<env>_BACKEND``, ``<env>_QUEUE``,
``<env>_CACHE`` and ``<env>_PREFIX`` (``CM`` for the Celery suites, ``NEM`` for the
nemesis), so that each run gets its own queue, lock prefix and record keys.
"""

from __future__ import annotations

from os import environ
from typing import Any

from celery import Celery

REDIS = "redis://127.0.0.1:6379/11"


def app_from_env(
    name: str,
    env: str = "CM",
    *,
    broker: str = REDIS,
    backend: str = REDIS,
    queue: str = "cmtest",
    cache: str = REDIS,
    prefix: str = "cmtest.",
    **conf: Any,
) -> Celery:
    """The app ``name``: each keyword is the default of its ``<env>_*`` variable; ``conf``
    adds (or overrides) plain settings. One task at a time per child
    (``worker_prefetch_multiplier=1``) unless ``conf`` says otherwise."""
    app = Celery(name, set_as_current=False)
    app.conf.update(
        broker_url=environ.get(f"{env}_BROKER", broker),
        result_backend=environ.get(f"{env}_BACKEND", backend),
        task_default_queue=environ.get(f"{env}_QUEUE", queue),
        mutex_cache=environ.get(f"{env}_CACHE", cache),
        mutex_prefix=environ.get(f"{env}_PREFIX", prefix),
        worker_prefetch_multiplier=1,
        broker_connection_retry_on_startup=True,
    )
    app.conf.update(conf)
    return app
