"""Lua scripts run by their SHA1 (EVALSHA), so a script's text crosses the network (and is
hashed by Redis) once per server instead of on every call: the per-result and per-pull scripts
carry a kilobyte of shared functions (jobs/backlog.py), which EVAL would send each time.

A server that does not know the script yet (a fresh start, SCRIPT FLUSH, another node of a
cluster) answers NOSCRIPT and ran nothing: the call is sent again with EVAL, which also
caches it there. In a pipeline, the calls that got NOSCRIPT are sent again, one by one.
(redis-py's own `Script` loads scripts before a pipeline runs them, which its cluster
pipeline does not implement: `script_load_for_pipeline` raises there.)
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import redis
from redis.exceptions import NoScriptError


class LuaScript:
    def __init__(self, text: str) -> None:
        self.text = text
        self.sha = hashlib.sha1(text.encode()).hexdigest()

    def __call__(self, r: redis.Redis, keys: Sequence[str], args: Sequence[Any] = ()) -> Any:
        # execute_command: redis-py's cluster client routes EVALSHA by its keys
        try:
            return r.execute_command("EVALSHA", self.sha, len(keys), *keys, *args)
        except NoScriptError:
            return r.execute_command("EVAL", self.text, len(keys), *keys, *args)

    def queue(self, pipe, keys: Sequence[str], args: Sequence[Any] = ()) -> None:
        pipe.execute_command("EVALSHA", self.sha, len(keys), *keys, *args)


def run_all(r: redis.Redis, calls: list[tuple[LuaScript, Sequence[str], Sequence[Any]]],
            raise_on_error: bool = True) -> list[Any]:
    """Each (script, keys, args) in one pipelined round trip; a call the server answered
    NOSCRIPT (it did not run) is sent again with its text. Any other error is raised, or with
    `raise_on_error` False returned in its place."""
    if not calls:
        return []
    pipe = r.pipeline(transaction=False)
    for script, keys, args in calls:
        script.queue(pipe, keys, args)
    replies = pipe.execute(raise_on_error=False)
    for index, ((script, keys, args), reply) in enumerate(zip(calls, replies)):
        if isinstance(reply, NoScriptError):
            try:
                replies[index] = r.execute_command("EVAL", script.text, len(keys), *keys, *args)
            except redis.ResponseError as error:
                if raise_on_error:
                    raise
                replies[index] = error
        elif isinstance(reply, Exception) and raise_on_error:
            raise reply
    return replies
