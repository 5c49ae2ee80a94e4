"""The fleets the docs start, and their code blocks.

A guide marks a fenced block ```` ```bash fleet ```` for the command that starts the fleet its
examples talk to (`python -m workers.serve ... --port 8000`), and ```` ```bash runnable ```` or
```` ```python runnable ```` for a block a reader runs against it. The tests start each fleet
command once a session, exactly as written but on a free port, and run every runnable block
with the port it names replaced by its fleet's."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from tests.services import free_port

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
    port: int = 0
    redis_url: str = ""

    def wait_until_serving(self) -> None:
        deadline = time.monotonic() + START_SECONDS
        while not (match := BANNER.search(self.log.read_text())):
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"`{self.command}` did not come up:\n{self.log.read_text()[-4000:]}")
            time.sleep(0.2)
        self.port, self.redis_url = int(match.group(1)), match.group(2)

    def stop(self) -> None:
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.process.kill()


@dataclass
class Fleets:
    """Every fleet command the docs name, started once a session, on a free port each."""

    folder: Path
    running: dict[str, Fleet] = field(default_factory=dict)

    def get(self, command: str) -> Fleet:
        if command not in self.running:
            port = free_port()
            argv = command.replace(f"--port {documented_port(command)}", f"--port {port}").split()
            assert argv[:2] == ["python", "-m"], command
            log = self.folder / f"fleet-{len(self.running)}.log"
            env = {**os.environ, "KVFLEET_REDIS_URL": "", "OMP_NUM_THREADS": "1"}  # its own Redis; one core
            process = subprocess.Popen([sys.executable, *argv[1:], "--drain-seconds", "5"], env=env,
                                       stdout=log.open("w"), stderr=subprocess.STDOUT)
            self.running[command] = fleet = Fleet(command, log, process)
            fleet.wait_until_serving()
        return self.running[command]


def run_block(block: Block, fleets: Fleets, workdir: Path) -> subprocess.CompletedProcess:
    """Run a runnable block as a reader would after `source .venv/bin/activate`, in `workdir`
    (which holds the repository's examples/), against its page's fleets."""
    code = block.code
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", "OMP_NUM_THREADS": "1"}
    doc_fleets = [fleets.get(other.code.strip()) for other in blocks(block.doc) if other.kind == "fleet"]
    for fleet in doc_fleets:
        code = re.sub(rf"(127\.0\.0\.1|localhost):{documented_port(fleet.command)}\b", f"127.0.0.1:{fleet.port}",
                      code)
    if doc_fleets:  # the guides say: the Redis the fleet prints; the examples default to its port
        env["KVFLEET_REDIS_URL"] = doc_fleets[0].redis_url
        env["OPENAI_BASE_URL"] = f"http://127.0.0.1:{doc_fleets[0].port}/v1"
    if not (workdir / "examples").exists():
        (workdir / "examples").symlink_to(ROOT / "examples")
    argv = ["bash", "-euo", "pipefail", "-c", code] if block.language == "bash" else [sys.executable, "-c", code]
    return subprocess.run(argv, cwd=workdir, env=env, capture_output=True, text=True, timeout=300)
