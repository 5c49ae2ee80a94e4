"""The CPU worker's process: cores for its threads and for serve's services, and the
allocator the launchers preload."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from engine import cpu_runtime
from engine.cpu_runtime import core_plan, cpu_quota, physical_cores, thread_plan
from workers import allocator
from workers.allocator import allocator_env, find_allocator

TWO_WAY_SMT = {cpu: {cpu % 4, cpu % 4 + 4} for cpu in range(8)}  # 4 cores, CPUs n and n + 4 siblings


@pytest.fixture
def smt_host(monkeypatch):
    monkeypatch.setattr(cpu_runtime, "first_sibling", lambda cpu, cpus: min(TWO_WAY_SMT[cpu] & cpus | {cpu}))


def test_one_thread_per_physical_core(smt_host):
    assert physical_cores(set(range(8))) == [0, 1, 2, 3]
    assert physical_cores({1, 5, 6}) == [1, 6]  # 6's sibling 2 is not ours: 6 stands for its core


def test_serve_gives_the_services_the_last_core_from_four_cores(smt_host):
    assert core_plan(set(range(8))) == ({0, 1, 2, 4, 5, 6}, {3, 7})
    assert core_plan({0, 1, 4, 5}) == ({0, 1, 4, 5}, {0, 1, 4, 5})  # two cores: everything shares


def test_this_host_has_its_own_cpus_as_cores():
    cpus = os.sched_getaffinity(0)
    cores = physical_cores(cpus)
    assert cores and set(cores) <= cpus


def test_allocator_env_preloads_once_and_obeys_kvfleet_malloc(monkeypatch):
    monkeypatch.setattr(allocator, "find_allocator", lambda name: f"/lib/lib{name}.so")
    env = allocator_env({"LD_PRELOAD": "/lib/other.so"})
    assert env["LD_PRELOAD"] == "/lib/libtcmalloc.so:/lib/other.so"
    assert allocator_env(env) == env  # already there: unchanged, so a re-exec happens once
    assert allocator_env({"KVFLEET_MALLOC": "jemalloc"})["LD_PRELOAD"] == "/lib/libjemalloc.so"
    assert "LD_PRELOAD" not in allocator_env({"KVFLEET_MALLOC": "glibc"})
    with pytest.raises(ValueError, match="KVFLEET_MALLOC must be glibc, tcmalloc or jemalloc"):
        allocator_env({"KVFLEET_MALLOC": "mimalloc"})


def test_no_allocator_installed_leaves_the_env_alone(monkeypatch):
    monkeypatch.setattr(allocator, "find_allocator", lambda name: None)
    assert allocator_env({"PATH": "/bin"}) == {"PATH": "/bin"}


@pytest.mark.skipif(find_allocator("tcmalloc") is None, reason="libtcmalloc-minimal4 is not installed")
def test_a_cli_restarts_itself_on_tcmalloc():
    code = ("from workers.allocator import reexec_with_allocator, preloaded_allocator; "
            "reexec_with_allocator(); print(preloaded_allocator())")
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "KVFLEET_MALLOC")}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert done.stdout.strip() == "tcmalloc", done.stderr
    glibc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           env={**env, "KVFLEET_MALLOC": "glibc"}, timeout=60)
    assert glibc.stdout.strip() == "glibc malloc"


PIN_THREADS = """
import json, os, torch
from engine.cpu_runtime import pin_threads
cores = pin_threads("cpu")
torch.ones(1 << 22).sum()  # a parallel region: every OpenMP thread exists
allowed = [open(f"/proc/self/task/{t}/status").read().split("Cpus_allowed_list:")[1].split()[0]
           for t in os.listdir("/proc/self/task")]
print(json.dumps({"cores": cores, "threads": torch.get_num_threads(), "allowed": allowed}))
"""


def run_pin_threads(cpus: set[int] | None = None, **env: str) -> dict:
    base = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    done = subprocess.run([sys.executable, "-c", PIN_THREADS], capture_output=True, text=True, timeout=300,
                          env={**base, **env}, preexec_fn=cpus and (lambda: os.sched_setaffinity(0, cpus)))
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_pin_threads_runs_one_pinned_openmp_thread_per_core():
    found = run_pin_threads()
    assert found["cores"] == physical_cores(os.sched_getaffinity(0))
    assert found["threads"] == len(found["cores"])
    assert {str(core) for core in found["cores"]} <= set(found["allowed"])  # one thread pinned to each core


HOST_CPUS = set(range(os.cpu_count() or 1))  # the kernel keeps those of the cgroup's cpuset


@pytest.mark.skipif(len(physical_cores(HOST_CPUS)) < 2, reason="needs two cores")
def test_an_explicit_omp_num_threads_below_the_cores_runs_that_many_threads_unpinned():
    # On every CPU of the host: an in-process test may have pinned this test process's thread.
    found = run_pin_threads(HOST_CPUS, OMP_NUM_THREADS="1")
    assert found["cores"] == [] and found["threads"] == 1
    assert len(set(found["allowed"])) == 1  # every thread of it may run where the process may
    assert found["allowed"][0] not in {str(cpu) for cpu in HOST_CPUS}  # and that is more than one CPU


def test_thread_plan_takes_the_least_of_cores_omp_num_threads_and_quota():
    cores = [0, 1, 2, 3]
    assert thread_plan(cores, {}, None) == (4, cores)  # one pinned thread per core
    assert thread_plan(cores, {"OMP_NUM_THREADS": "8"}, None) == (4, cores)
    assert thread_plan(cores, {"OMP_NUM_THREADS": "2"}, None) == (2, [])  # shares the cores: unpinned
    assert thread_plan(cores, {"OMP_NUM_THREADS": "junk"}, 2.5) == (2, [])  # a 2.5-CPU limit
    assert thread_plan(cores, {}, 0.5) == (1, [])


def test_cpu_quota_reads_cgroup_v2_then_v1(tmp_path):
    (tmp_path / "cpu.max").write_text("250000 100000\n")
    assert cpu_quota(tmp_path) == 2.5
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert cpu_quota(tmp_path) is None
    (tmp_path / "cpu.max").unlink()
    (tmp_path / "cpu").mkdir()
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("400000\n")
    (tmp_path / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert cpu_quota(tmp_path) == 4.0
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")
    assert cpu_quota(tmp_path) is None
    assert cpu_quota(tmp_path / "absent") is None
