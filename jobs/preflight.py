"""What every process checks before it says it is serving: a configuration it cannot work
with is one clear line at start-up, not a traceback on the first finished batch.

    python -m producers.api / python -m workers / python -m workers.finalizer
        -> check_startup(r): the finalize queue's Redis (KVFLEET_QUEUE_URL with a cluster), and
           the default output (KVFLEET_DEFAULT_OUTPUT) exists and can be written with the
           credentials at hand

An outage (a storage endpoint that does not answer yet) is not a configuration error: it is
logged, and the process starts and retries as it always does.
"""

from __future__ import annotations

import logging

import redis

from jobs.connection import queue_connection
from jobs.storage import STORAGE_ERRORS, default_output, describe_error, is_permanent_error, open_storage

log = logging.getLogger("kvfleet")


class StartupError(Exception):
    """The configuration cannot work; the message is the one line to print."""


def check_startup(r: redis.Redis, needs_queue: bool = True) -> None:
    if needs_queue:
        try:
            queue_connection(r)
        except ValueError as error:
            raise StartupError(str(error)) from None
    check_default_output(r)


def check_default_output(r: redis.Redis) -> None:
    url = default_output()
    try:
        open_storage(url, r).check_writable()
    except ValueError as error:
        raise StartupError(f"KVFLEET_DEFAULT_OUTPUT: {error}") from None
    except STORAGE_ERRORS as error:
        if is_permanent_error(error) or isinstance(error, OSError):
            raise StartupError(f"KVFLEET_DEFAULT_OUTPUT {url}: {describe_error(error)}") from None
        log.warning("KVFLEET_DEFAULT_OUTPUT %s does not answer yet (%s); starting anyway", url, describe_error(error))
