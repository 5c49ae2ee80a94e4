"""The shape the code keeps (STYLE.md, DEVELOPERS.md): functions a screen long, modules of
one idea, route handlers at module level. Triton kernel bodies in kvfleet_kernels/ are exempt."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("engine", "jobs", "producers", "workers", "grammar_support", "kvfleet")
MAX_FUNCTION_LINES = 60
MAX_MODULE_LINES = 400
ROUTE_METHODS = {"get", "post", "put", "patch", "delete", "api_route", "websocket", "middleware", "exception_handler"}


def modules(packages=PACKAGES, root: Path = ROOT):
    for package in packages:
        yield from sorted((root / package).rglob("*.py"))


def long_functions(path: Path, root: Path = ROOT) -> list[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return [f"{path.relative_to(root)}:{node.lineno} {node.name}: {node.end_lineno - node.lineno + 1} lines"
            for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES]


def nested_route_handlers(path: Path, root: Path = ROOT) -> list[str]:
    """Functions decorated as routes (`@router.get(...)`, `@app.middleware(...)`) inside another function."""
    found = []
    for outer in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if not isinstance(outer, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for inner in ast.walk(outer):
            if inner is outer or not isinstance(inner, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for decorator in inner.decorator_list:
                call = decorator.func if isinstance(decorator, ast.Call) else decorator
                if isinstance(call, ast.Attribute) and call.attr in ROUTE_METHODS:
                    found.append(f"{path.relative_to(root)}:{inner.lineno} {inner.name} inside {outer.name}")
    return found


def test_no_function_is_longer_than_a_screen():
    found = [line for path in modules() for line in long_functions(path)]
    assert not found, found


def test_no_module_is_longer_than_one_idea():
    found = [f"{path.relative_to(ROOT)}: {n} lines" for path in modules((*PACKAGES, "kvfleet_kernels"))
             if (n := len(path.read_text(encoding="utf-8").splitlines())) > MAX_MODULE_LINES]
    assert not found, found


def test_route_handlers_live_at_module_level():
    found = [line for path in modules(("producers", "workers")) for line in nested_route_handlers(path)]
    assert not found, found


def test_the_checks_can_fail(tmp_path):
    probe = tmp_path / "producers" / "_shape_probe.py"
    probe.parent.mkdir()
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    probe.write_text(f"def long():\n{body}\n\n\ndef factory(router):\n    @router.get('/x')\n    def handler():\n"
                     f"        return 1\n")
    assert long_functions(probe, tmp_path) == [f"producers/_shape_probe.py:1 long: {MAX_FUNCTION_LINES + 1} lines"]
    assert nested_route_handlers(probe, tmp_path) == ["producers/_shape_probe.py:66 handler inside factory"]


def test_reply_event_types_are_matched_only_in_jobs_online():
    """Producers and workers use the typed events; only jobs/online.py reads the "type" string."""
    found = [f"{path.relative_to(ROOT)}: {line.strip()}" for path in modules(("producers", "workers", "jobs"))
             if path != ROOT / "jobs" / "online.py"
             for line in path.read_text(encoding="utf-8").splitlines()
             if re.search(r"event\w*\[\"type\"\]|event\w*\.get\(\"type\"", line)]
    assert not found, found
