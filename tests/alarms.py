"""A job timeout, as the tests deal one: RQ's ``job_timeout`` and Celery's
``soft_time_limit`` raise an ordinary exception from a SIGALRM handler, wherever the main
thread is at that moment. The ``alarm`` fixture (conftest.py) installs such a handler."""

from __future__ import annotations


class Alarm(Exception):
    """What a job timeout's signal handler raises (RQ's JobTimeoutException, Celery's
    SoftTimeLimitExceeded): an ordinary Exception."""
