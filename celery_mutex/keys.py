"""Lock keys of tasks, from the task's bound signature with defaults applied, so
``charge(7)`` and ``charge(order_id=7)`` lock the same key. An omitted key is the task name
plus every bound argument in a stable encoding (UUID, datetime, Decimal, Enum, dicts in
any order); a list of argument names, the task name plus those (``[]``: the task name
alone, celery-once's ``keys=[]`` and celery-singleton's ``unique_on=[]``).
"""

from __future__ import annotations

import datetime as dt
import decimal
import enum
import inspect
import json
import uuid
import warnings
from collections.abc import Callable, Mapping
from typing import Any

from simple_mutex import ConstraintTypeError, ConstraintValueError
from simple_mutex.busy import template_fields
from simple_mutex.decorator import key_function

from .errors import ConstantKeyWarning

KeyOf = Callable[[str, tuple[Any, ...], Mapping[str, Any]], str]
"""(task name, args, kwargs) -> lock key."""


def user_signature(run: Callable[..., Any], bound: bool) -> inspect.Signature:
    """The task's own arguments: ``self`` dropped for ``bind=True`` tasks."""
    signature = inspect.signature(run)
    params = list(signature.parameters.values())
    return signature.replace(parameters=params[1:]) if bound else signature


def make_key_of(
    task_name: str, run: Callable[..., Any], bound: bool, key: object, *, permits: object = 1
) -> KeyOf:
    """The key function of a task; a template naming a missing argument fails here, and a
    template naming none on a task with arguments warns (ConstantKeyWarning), unless
    ``permits`` > 1: one semaphore for the whole task is a plain concurrency cap."""
    signature = user_signature(run, bound)

    def logic(*args: Any, **kwargs: Any) -> Any: ...

    logic.__signature__ = signature  # type: ignore[attr-defined]
    logic.__qualname__ = task_name

    if key is None:
        return lambda name, args, kwargs: (
            name + ":" + stable_encoding(_bound_arguments(signature, name, args, kwargs))
        )
    if isinstance(key, list | tuple):
        names = list(key)
        known = set(signature.parameters)
        bad = [n for n in names if not isinstance(n, str) or n not in known]
        if bad:
            raise ConstraintValueError(
                f"{task_name}: key argument names {bad!r} are not arguments of the "
                f"task; its arguments are: {', '.join(sorted(known)) or '(none)'}"
            )

        def from_names(name: str, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> str:
            arguments = _bound_arguments(signature, name, args, kwargs)
            return name + ":" + stable_encoding({n: arguments[n] for n in names})

        return from_names
    if isinstance(key, str) or callable(key):
        fn = key_function(logic, key)
        constant = isinstance(key, str) and not template_fields(key)
        if constant and signature.parameters and permits == 1:
            _warn_constant(task_name, str(key), signature)
        return lambda name, args, kwargs: fn(*args, **kwargs)
    raise ConstraintTypeError(
        f"{task_name}: mutex key must be a template like 'order.{{order_id}}', a callable, "
        f"a list of argument names, or omitted; got {key!r}"
    )


def _warn_constant(task_name: str, key: str, signature: inspect.Signature) -> None:
    names = list(signature.parameters)
    meant = key if key in names else names[0]  # unique_on="c" copied as key: "c"
    warnings.warn(
        f"{task_name}: mutex key {key!r} names no argument, so every call of the task "
        f"shares one lock whatever its arguments ({', '.join(names)}). To lock per "
        f"argument, name it: key='{{{meant}}}' or key={[meant]!r}. If one lock for "
        "the whole task is meant, say so with key=[] (the task name) or a callable "
        f"(key=lambda *args, **kwargs: {key!r})",
        ConstantKeyWarning,
        stacklevel=2,  # the task is named: where Celery builds it says little
    )


def _bound_arguments(
    signature: inspect.Signature, task_name: str, args: tuple[Any, ...], kwargs: Mapping[str, Any]
) -> dict[str, Any]:
    try:
        bound = signature.bind(*args, **kwargs)
    except TypeError as exc:
        raise ConstraintTypeError(f"arguments do not fit {task_name}: {exc}") from None
    bound.apply_defaults()
    return dict(bound.arguments)


def stable_encoding(value: Any) -> str:
    """A canonical text of argument values: equal values, equal text, on any process."""
    return json.dumps(_canonical(value), sort_keys=True, separators=(",", ":"))


def _canonical(value: Any) -> Any:
    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, float):
        return repr(value)  # exact, and 1.0 stays apart from 1
    if isinstance(value, enum.Enum):
        return {"enum": f"{type(value).__qualname__}.{value.name}"}
    if isinstance(value, uuid.UUID):
        return str(value)  # kombu's JSON may deliver a UUID as a str: keep them equal
    if isinstance(value, dt.datetime):
        if value.tzinfo is not None:
            value = value.astimezone(dt.timezone.utc)
        return {"datetime": value.isoformat()}
    if isinstance(value, dt.date | dt.time | dt.timedelta):
        return {type(value).__name__: str(value)}
    if isinstance(value, decimal.Decimal):
        return {"decimal": str(value.normalize())}
    if isinstance(value, Mapping):
        return {"dict": sorted(([_key_text(k), _canonical(v)] for k, v in value.items()))}
    if isinstance(value, list | tuple):
        return [_canonical(v) for v in value]
    if isinstance(value, set | frozenset):
        return {"set": sorted(stable_encoding(v) for v in value)}
    if isinstance(value, bytes):
        return {"bytes": value.hex()}
    pk = getattr(value, "pk", None)  # a Django model, say: its type and primary key
    if pk is not None:
        model = f"{type(value).__module__}.{type(value).__qualname__}"
        return {"model": model, "pk": _canonical(pk)}
    raise ConstraintTypeError(
        f"cannot build a stable lock key from a {type(value).__qualname__}; pass key= as a "
        "template or a callable that picks what identifies the work"
    )


def _key_text(key: Any) -> str:
    return key if isinstance(key, str) else stable_encoding(key)
