"""Rules `make test` enforces on the whole tree, each proven able to fail: the "must
not import" table of ARCHITECTURE.md (import-linter's `lint-imports`) and no pickle
anywhere (ruff's S301 and TID251)."""

from __future__ import annotations

import importlib.metadata
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("engine", "kvfleet_kernels", "jobs", "producers", "workers", "kvfleet", "grammar_support")
LINT_IMPORTS = str(Path(sys.executable).with_name("lint-imports"))


def lint_imports(tree: Path) -> subprocess.CompletedProcess:
    return subprocess.run([LINT_IMPORTS, "--config", str(tree / "pyproject.toml")], cwd=tree, capture_output=True,
                          text=True, env={**os.environ, "PYTHONPATH": str(tree)}, timeout=120)


@pytest.fixture
def tree(tmp_path) -> Path:
    """A copy of the packages and the contracts, to break on purpose."""
    for package in PACKAGES:
        shutil.copytree(ROOT / package, tmp_path / package, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    return tmp_path


def test_the_tree_keeps_every_contract(tree):
    result = lint_imports(tree)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "7 kept, 0 broken" in result.stdout


@pytest.mark.parametrize("module, line, message", [
    ("engine/_probe.py", "from jobs import keys\n", "engine is not allowed to import jobs"),
    ("engine/_probe.py", "import redis\n", "engine is not allowed to import redis"),
    ("jobs/_probe.py", "import torch\n", "jobs is not allowed to import torch"),
    ("producers/_probe.py", "from engine import LLM\n", "producers is not allowed to import engine"),
    ("workers/_probe.py", "import producers.api\n", "workers is not allowed to import producers"),
    ("kvfleet_kernels/_probe.py", "from engine import config\n", "kvfleet_kernels is not allowed to import engine"),
    ("workers/_probe.py", "import kvfleet.cli\n", "workers is not allowed to import kvfleet"),
    ("grammar_support/_probe.py", "from jobs import keys\n", "grammar_support is not allowed to import jobs"),
])
def test_a_forbidden_import_fails_the_check(tree, module, line, message):
    (tree / module).write_text(line)
    result = lint_imports(tree)
    assert result.returncode != 0
    assert message in result.stdout and "1 broken" in result.stdout


def test_pickle_fails_ruff(tmp_path):
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    (tmp_path / "clean.py").write_text("import json\n\nprint(json.loads('1'))\n")
    ruff = str(Path(sys.executable).with_name("ruff"))
    assert subprocess.run([ruff, "check", "clean.py"], cwd=tmp_path, capture_output=True).returncode == 0
    (tmp_path / "probe.py").write_text("import pickle\n\nprint(pickle.loads(b''))\n")
    result = subprocess.run([ruff, "check", "probe.py"], cwd=tmp_path, capture_output=True, text=True)
    assert result.returncode != 0 and "TID251" in result.stdout and "S301" in result.stdout
    (tmp_path / "probe.py").write_text("from cloudpickle import dumps\n\nprint(dumps(1))\n")
    result = subprocess.run([ruff, "check", "probe.py"], cwd=tmp_path, capture_output=True, text=True)
    assert result.returncode != 0 and "no pickle in kvfleet" in result.stdout


def import_cycles(tree: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tests.import_cycles"], cwd=tree, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": f"{tree}{os.pathsep}{ROOT}"}, timeout=120)


def test_no_module_of_kvfleet_is_part_of_an_import_cycle(tree):
    result = import_cycles(tree)
    assert result.returncode == 0, result.stdout + result.stderr


def test_an_import_cycle_fails_the_check_even_behind_a_deferred_import(tree):
    (tree / "jobs" / "_probe_a.py").write_text("from jobs import _probe_b\n")
    (tree / "jobs" / "_probe_b.py").write_text("def later():\n    from jobs import _probe_a  # noqa\n")
    result = import_cycles(tree)
    assert result.returncode == 1
    assert "import cycle: jobs._probe_a <-> jobs._probe_b" in result.stdout


def test_tarjan_finds_every_cycle_and_only_cycles():
    from tests.import_cycles import strongly_connected

    edges = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": {"e"}, "e": {"d"}, "f": {"a"}}
    groups = [g for g in strongly_connected(edges) if len(g) > 1]
    assert sorted(groups) == [["a", "b", "c"], ["d", "e"]]


def test_no_package_shadows_an_installed_distribution():
    """kvfleet's top-level packages sit on sys.path beside site-packages, so a name another
    installed distribution also ships hides one from the other. transformers 5.25 made Hugging
    Face's `kernels` a dependency and imports it at start; kvfleet's kernels package was named
    `kernels` then, and every model load failed (hence `kvfleet_kernels`)."""
    owners = importlib.metadata.packages_distributions()
    shared = {package: owners[package] for package in PACKAGES
              if set(owners.get(package, ())) - {"kvfleet"}}
    assert not shared, f"top-level names other distributions also ship: {shared}"
