"""The fleets the docs start, and their code blocks.

A guide marks a fenced block ```` ```bash fleet ```` for the command that starts the fleet its
examples talk to (`python -m workers.serve ... --port 8000`), and ```` ```bash runnable ```` or
```` ```python runnable ```` for a block a reader runs against it. A test starts each fleet
command once, exactly as written but on a free port, and runs every runnable block of the pages
that start it, with the port a block names replaced by its fleet's. (One test a fleet, not one a
block: pytest-xdist 3.8's xdist_group marks do nothing under pytest 9, so blocks spread over the
test processes would start the fleet once in each.)"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from tests.services import start_serve

ROOT = Path(__file__).resolve().parents[2]
DOC_PATHS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(\w+) (fleet|runnable)\n(.*?)^```$", re.MULTILINE | re.DOTALL)
BANNER = re.compile(r"serving '[^']+' at http://127\.0\.0\.1:(\d+)/v1 \(redis (\S+)\)")
START_SECONDS = 300  # the first start on a fresh machine builds the native CPU kernels


@dataclass
class Block:
    doc: Path
    line: int
    language: str  # bash | python
    kind: str  # fleet | runnable
    code: str

    @property
    def name(self) -> str:
        return f"{self.doc.name}:{self.line}"


def blocks(doc: Path) -> list[Block]:
    text = doc.read_text()
    return [Block(doc, text.count("\n", 0, match.start()) + 1, match.group(1), match.group(2), match.group(3))
            for match in FENCE.finditer(text)]


def documented_port(command: str) -> int:
    return int(re.search(r"--port (\d+)", command).group(1))


@dataclass
class Fleet:
    command: str
    log: Path
    process: subprocess.Popen
    port: int
    redis_url: str


@contextmanager
def started(command: str, folder: Path) -> Iterator[Fleet]:
    """The fleet `command` starts, exactly as written but on a free port, until the block ends."""
    prefix = "python -m workers.serve "
    assert command.startswith(prefix), command
    arguments = command.removeprefix(prefix).replace(f"--port {documented_port(command)}", "").split()
    process, port = start_serve(arguments, folder, timeout=START_SECONDS)  # its own Redis; one core
    try:
        log = folder / "serve.log"
        fleet = Fleet(command, log, process, port, BANNER.search(log.read_text()).group(2))
        yield fleet
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()


def fleet_of(doc: Path) -> str | None:
    """The fleet command a page starts (at most one a page), or None."""
    commands = [block.code.strip() for block in blocks(doc) if block.kind == "fleet"]
    assert len(commands) <= 1, f"{doc.name} starts {len(commands)} fleets; its blocks would not know which"
    return commands[0] if commands else None


def run_block(block: Block, fleet: Fleet | None, workdir: Path) -> subprocess.CompletedProcess:
    """Run a runnable block as a reader would after `source .venv/bin/activate`, in `workdir`
    (which holds the repository's examples/), against its page's fleet."""
    code = block.code
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", "OMP_NUM_THREADS": "1"}
    if fleet is not None:  # the guides say: the Redis the fleet prints; the examples default to its port
        code = re.sub(rf"(127\.0\.0\.1|localhost):{documented_port(fleet.command)}\b", f"127.0.0.1:{fleet.port}",
                      code)
        env["KVFLEET_REDIS_URL"] = fleet.redis_url
        env["OPENAI_BASE_URL"] = f"http://127.0.0.1:{fleet.port}/v1"
    if not (workdir / "examples").exists():
        (workdir / "examples").symlink_to(ROOT / "examples")
    argv = ["bash", "-euo", "pipefail", "-c", code] if block.language == "bash" else [sys.executable, "-c", code]
    return subprocess.run(argv, cwd=workdir, env=env, capture_output=True, text=True, timeout=300)


def failure(block: Block, done: subprocess.CompletedProcess) -> str | None:
    """What went wrong with a block's run, or None: it must exit 0 and print something."""
    if done.returncode == 0 and done.stdout.strip():
        return None
    return (f"{block.name} (exit {done.returncode}):\n{block.code}\nstdout:\n{done.stdout[-2000:]}\n"
            f"stderr:\n{done.stderr[-2000:]}")
