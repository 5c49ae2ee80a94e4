"""Which requests broke a step: one bad request fails alone, its neighbours go on.

A step that raises is run again in halves of its requests, each half committed when it
succeeds, until every failure is narrowed down to one request. A request that fails alone is
the one at fault; the engine ends it with an error. A failure that every request meets alone
(a lost device, a broken kernel) is no request's: `StepFailed` says so, and nothing was
committed. A step of one request is tried once more before it is blamed, so a transient
failure does not fail it.

    step fails:   [a b c d e f]
    halves:       [a b c] ok -> committed       [d e f] fails
    halves:                                     [d] ok   [e f] fails
    alone:                                               [e] fails -> e is at fault   [f] ok

Plain Python: the engines pass a callable that runs and commits a subset of a step.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Hashable
from typing import TypeVar

log = logging.getLogger("kvfleet.engine")

Key = TypeVar("Key", bound=Hashable)


class StepFailed(RuntimeError):
    """A step failed for every request in it, each alone: no request explains it. Nothing of
    the step was committed; the caller may retry its requests (a worker hands them back)."""


def isolate_failures(keys: list[Key], run: Callable[[list[Key]], None], error: Exception,
                     fatal: tuple[type[BaseException], ...] = ()) -> dict[Key, Exception]:
    """`run(keys)` raised `error`; find the keys (requests) at fault. `run(subset)` runs and
    commits just those, raising (and committing nothing) if the subset fails. Returns each
    key at fault with its own error; raises StepFailed when every key fails alone. A `fatal`
    error (the engine cannot step again) is raised as it is."""
    log.warning("engine step of %d requests failed (%s: %s); finding the request at fault", len(keys),
                type(error).__name__, error)
    if len(keys) == 1:
        try:
            run(keys)  # once more: a transient failure passes now
            return {}
        except fatal:
            raise
        except Exception as again:  # noqa: BLE001
            return {keys[0]: again}
    at_fault: dict[Key, Exception] = {}
    half = len(keys) // 2
    for part in (keys[:half], keys[half:]):
        _bisect(part, run, at_fault, fatal)
    if len(at_fault) == len(keys):
        raise StepFailed(f"the step failed for each of its {len(keys)} requests alone: "
                         f"{type(error).__name__}: {error}") from error
    return at_fault


def _bisect(keys: list[Key], run: Callable[[list[Key]], None], at_fault: dict[Key, Exception],
            fatal: tuple[type[BaseException], ...]) -> None:
    try:
        run(keys)
        return
    except fatal:
        raise
    except Exception as error:  # noqa: BLE001
        if len(keys) == 1:
            at_fault[keys[0]] = error
            return
    half = len(keys) // 2
    _bisect(keys[:half], run, at_fault, fatal)
    _bisect(keys[half:], run, at_fault, fatal)
