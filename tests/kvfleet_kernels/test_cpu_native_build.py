"""The native CPU library (kvfleet_kernels/cpu_paged_attention.py builds it on first use): it builds
here, an engine without it falls back to the torch path or says why, and a fresh machine or a build
killed midway never leaves a worker unable to start."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import torch

from engine.attention import select_backend
from kvfleet_kernels.cpu_paged_attention import load_error


def test_the_kernel_builds_here():
    # This machine has g++ and ninja: a build failure here is a bug, not an environment gap.
    assert load_error() is None


def test_backend_selection_on_the_cpu(monkeypatch):
    cpu = torch.device("cpu")
    assert select_backend("auto", cpu).name == "cpu"
    assert select_backend("torch", cpu).name == "torch"
    # No compiler: auto falls back to the reference path, an explicit "cpu" says why it cannot.
    monkeypatch.setattr("kvfleet_kernels.cpu_paged_attention.load_error", lambda: "RuntimeError: no g++")
    assert select_backend("auto", cpu).name == "torch"
    with pytest.raises(ValueError, match="could not be built.*no g\\+\\+"):
        select_backend("cpu", cpu)


def load_error_in_a_new_process(env, timeout: float) -> subprocess.CompletedProcess:
    """A fresh interpreter's load_error(), printed: what a worker starting up would see."""
    code = "from kvfleet_kernels.cpu_paged_attention import load_error; print(load_error())"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout, env=env)


def test_a_lock_left_by_a_killed_build_does_not_block_the_next_start(tmp_path):
    # torch.utils.cpp_extension waits for its lock file to vanish; a worker killed while
    # building would leave it forever. Another process must still load the kernel.
    from kvfleet_kernels import cpu_paged_attention

    assert load_error() is None
    (cpu_paged_attention.build_directory() / "lock").write_text("")
    done = load_error_in_a_new_process(os.environ, timeout=120)
    assert done.stdout.strip() == "None", done.stderr
    assert not (cpu_paged_attention.build_directory() / "lock").exists()


# A library of one op, built the way kvfleet's own is (build_library): what a fresh machine goes
# through, in seconds. The whole library's own first build is every suite's first load_error().
PROBE_SOURCE = """
#include <ATen/core/Tensor.h>
#include <torch/library.h>
void twice(const at::Tensor& x) {
  for (int64_t i = 0; i < x.numel(); ++i) x.data_ptr<int64_t>()[i] *= 2;
}
TORCH_LIBRARY(kvfleet_probe, m) { m.def("twice(Tensor(a!) x) -> ()", &twice); }
"""
BUILD_PROBE = """
import sys, torch
from pathlib import Path
from kvfleet_kernels.cpu_paged_attention import build_library
error = build_library("kvfleet_probe", [Path(sys.argv[1])], ["-O1"])
x = torch.arange(3)
print(error or torch.ops.kvfleet_probe.twice(x) or x.tolist())
"""


def test_builds_from_scratch_with_only_the_venv_on_hand(tmp_path):
    # A fresh machine: an empty extension cache, and no ninja on PATH but the pip-installed one
    # beside this interpreter (a venv's python run without activating the venv).
    tools = tmp_path / "bin"  # every tool on PATH but ninja
    tools.mkdir()
    for directory in os.environ["PATH"].split(os.pathsep):
        if Path(directory).is_dir() and Path(directory).resolve() != Path(sys.executable).parent.resolve():
            for tool in Path(directory).iterdir():
                if tool.name != "ninja" and not (tools / tool.name).exists():
                    (tools / tool.name).symlink_to(tool)
    assert shutil.which("ninja", path=str(tools)) is None
    source = tmp_path / "probe.cpp"
    source.write_text(PROBE_SOURCE)
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path / "cache"), "PATH": str(tools)}
    done = subprocess.run([sys.executable, "-c", BUILD_PROBE, str(source)], capture_output=True, text=True,
                          timeout=300, env=env)
    assert done.stdout.strip() == "[0, 2, 4]", done.stdout + done.stderr
    assert list((tmp_path / "cache").glob("kvfleet_probe-torch*/kvfleet_probe*.so"))


# The sources whose code differs most between CPUs: AMX hosts and the rest (csrc/decode_amx.h's
# KVFLEET_DECODE_AMX), avx512_vnni, AVX2 and generic integer products (csrc/quantized_linear_cpu.cpp).
# A host builds its own -march=native only, and the suite runs on one kind of host at a time: a
# declaration left inside the AMX branch once broke the whole library on every host without AMX while
# an AMX host's suite passed. So each host also compiles them for the other kind: an AVX2-only CPU
# where it has AMX, a Xeon with AMX (and avx512_vnni) where it has none.
ISA_GATED_SOURCES = ["quantized_linear_amx.cpp", "paged_prefill_amx.cpp", "quantized_linear_cpu.cpp"]


def other_kind_of_host() -> str:
    flags = Path("/proc/cpuinfo").read_text().split()
    return "-march=x86-64-v3" if "amx_tile" in flags else "-march=sapphirerapids"


@pytest.mark.skipif(os.uname().machine != "x86_64" or not Path("/proc/cpuinfo").exists(), reason="x86-64 Linux")
def test_isa_gated_sources_compile_for_the_other_kind_of_host():
    from torch.utils import cpp_extension

    from kvfleet_kernels import cpu_paged_attention

    includes = [flag for path in [*cpp_extension.include_paths(), sysconfig.get_paths()["include"]]
                for flag in ("-isystem", path)]
    flags = [flag for flag in cpu_paged_attention._CFLAGS if flag not in ("-march=native", "-O3")]
    compiles = {name: subprocess.Popen(
        ["c++", "-fsyntax-only", "-std=c++20", other_kind_of_host(), *flags, *includes,
         str(Path(cpu_paged_attention.__file__).parent / "csrc" / name)],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) for name in ISA_GATED_SOURCES}
    errors = {name: process.communicate(timeout=300)[1] for name, process in compiles.items()}
    assert all(process.returncode == 0 for process in compiles.values()), errors
