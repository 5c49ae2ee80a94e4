"""The docs say what the code does: every CLI flag the README and the guides in docs/ name
after `python -m MODULE` exists in that module's argparse, every flag of every CLI is named
there, every `kvfleet:` metric the code registers is listed, and the README stays a short
front page whose map reaches every guide."""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

from kvfleet.cli import COMMANDS
from producers.api import create_app
from workers.metrics import WorkerMetrics

ROOT = Path(__file__).resolve().parents[2]
DOC_PATHS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
README = "\n\n".join(path.read_text() for path in DOC_PATHS)  # every page, each passage its own
MODULE = re.compile(r"python -m ([a-z_.]+)|kvfleet ([a-z][a-z-]*)")
FLAG = re.compile(r"(?<![\w-])(--[a-z][a-z0-9-]*|-[a-z])\b")
KVFLEET_COMMANDS = {name: module.removesuffix(".__main__") for name, (module, _) in COMMANDS.items()}
CLIS = {"workers", "workers.serve", "workers.run_batch", "workers.finalizer", "producers.submit", "producers.status",
        "producers.api", "workers.demo", "engine.demo_model"}


def passages(text: str) -> list[str]:
    """Prose paragraphs, and each line of a code block with its comment cut off."""
    result, in_code, paragraph = [], False, []
    for line in text.splitlines():
        if line.startswith("```"):
            in_code = not in_code
            continue
        if in_code:
            result.append(line.split(" #")[0])
        elif line.strip():
            paragraph.append(line)
        else:
            result.append(" ".join(paragraph))
            paragraph = []
    return result + [" ".join(paragraph)]


def flags_by_module(text: str = README) -> dict[str, set[str]]:
    """Each flag belongs to the nearest `python -m MODULE` before it in its passage (or the
    passage's first one, when the flag comes before any)."""
    found: dict[str, set[str]] = {}
    for passage in passages(text):
        mentions = [(m.start(), m.group(1) or KVFLEET_COMMANDS.get(m.group(2))) for m in MODULE.finditer(passage)
                    if m.group(1) or m.group(2) in KVFLEET_COMMANDS]
        if not mentions:
            continue
        for _, name in mentions:
            found.setdefault(name, set())
        for flag in FLAG.finditer(MODULE.sub(lambda m: " " * len(m.group(0)), passage)):  # not python's -m
            owner = next((name for start, name in reversed(mentions) if start < flag.start()), mentions[0][1])
            found.setdefault(owner, set()).add(flag.group(1))
    return found


def option_strings(module: str) -> set[str]:
    name = module + ".__main__" if module == "workers" else module
    parser = importlib.import_module(name).build_parser()
    return {option for action in parser._actions for option in action.option_strings}


def test_every_flag_the_readme_names_exists_in_its_modules_parser():
    found = flags_by_module()
    assert set(found) >= CLIS, f"CLIs the README never shows: {sorted(CLIS - set(found))}"
    for module, flags in found.items():
        if not flags or module.startswith("benchmarks."):  # the benchmarks' own --help is their reference
            continue
        missing = flags - option_strings(module)
        assert not missing, f"README names {sorted(missing)} for python -m {module}, which has no such flag"


def test_flags_are_attributed_to_the_module_they_follow():
    text = ("Start `python -m workers --model M --no-such-flag`, then `python -m producers.submit --wait`.\n\n"
            "```bash\npython -m workers.finalizer   # = rq worker --serializer JSON\n```\n")
    found = flags_by_module(text)
    assert found == {"workers": {"--model", "--no-such-flag"}, "producers.submit": {"--wait"}, "workers.finalizer": set()}
    assert found["workers"] - option_strings("workers") == {"--no-such-flag"}


def registered_metric_names() -> set[str]:
    registries = [WorkerMetrics("w", "m").registry, create_app("redis://127.0.0.1:1/0").state.metrics_registry]
    return {metric.name for registry in registries for metric in registry.collect()
            if metric.name.startswith("kvfleet:")}


def test_every_registered_metric_is_listed_in_the_readme():
    names = registered_metric_names()
    assert len(names) >= 15
    unlisted = {name for name in names if not re.search(re.escape(name) + r"(_total|_seconds)?\b", README)}
    assert not unlisted, f"metrics missing from the README: {sorted(unlisted)}"


def test_the_worker_help_documents_requeues_and_redis_tls():
    text = importlib.import_module("workers.__main__").build_parser().format_help()
    for needle in ("--max-requeues", "cannot_fit", "rediss://", "KVFLEET_REDIS_CA", "KVFLEET_REDIS_CERT",
                   "KVFLEET_REDIS_KEY", "USER:PASSWORD@"):
        assert needle in text, needle


def test_every_flag_of_every_module_cli_is_in_the_readme():
    """The other direction: a flag the code has and the README never names is a flag nobody
    finds. A flag several CLIs share (the engine flags, --redis-url) is named once, under any
    of them; a flag of one CLI is named under that CLI."""
    found = flags_by_module()
    options = {module: option_strings(module) - {"-h", "--help"} for module in sorted(CLIS)}
    missing: dict[str, list[str]] = {}
    for module, flags in options.items():
        for flag in sorted(flags):
            owners = [other for other, other_flags in options.items() if flag in other_flags]
            if not any(flag in found.get(owner, set()) for owner in owners):
                missing.setdefault(module, []).append(flag)
    assert not missing, f"flags the README never names, by module: {missing}"


def test_the_readme_is_a_short_front_page_whose_map_reaches_every_guide():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 250
    linked = set(re.findall(r"\]\(docs/([a-z-]+\.md)\)", readme))
    assert linked == {path.name for path in (ROOT / "docs").glob("*.md")}


def test_every_relative_link_in_the_docs_reaches_a_file():
    for path in DOC_PATHS:
        for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", path.read_text()):
            if "://" not in target:
                assert (path.parent / target).exists(), f"{path.name} links to {target}, which does not exist"


CODE = re.compile(r"^[a-z]+(_[a-z]+)+$")
# (the call's name, the index of the code among its positional arguments)
CODE_ARGUMENTS = {"APIError": 2, "Error": 1, "error_line": 1, "fail": 2, "_failed_output": 2}


def error_codes_in_the_code() -> set[str]:
    """Every error code the API, the workers and the engine can answer with: the code argument of
    the calls that make errors, `error_code=` keywords, module constants `(code, message)`, the
    codes `error_code()` returns and the API's own table of Starlette's."""
    found = set()
    for package in ("producers", "workers", "jobs", "engine"):
        for path in (ROOT / package).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                found |= codes_of(node)
    return {code for code in found if CODE.match(code)}


def codes_of(node: ast.AST) -> set[str]:
    def text(value) -> set[str]:
        return {value.value} if isinstance(value, ast.Constant) and isinstance(value.value, str) else set()

    if isinstance(node, ast.Call):
        name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
        index = CODE_ARGUMENTS.get(name)
        found = text(node.args[index]) if index is not None and len(node.args) > index else set()
        found |= {code for keyword in node.keywords if keyword.arg in ("code", "error_code") for code in text(keyword.value)}
        if name in ("get",) and isinstance(node.func.value, ast.Dict):  # {404: "not_found", ...}.get(status)
            found |= {code for value in node.func.value.values for code in text(value)}
        return found
    if isinstance(node, ast.Assign) and isinstance(node.value, ast.Tuple) and len(node.value.elts) == 2 and \
            all(isinstance(target, ast.Name) and target.id.isupper() for target in node.targets):
        message = text(node.value.elts[1])
        return text(node.value.elts[0]) if message and " " in next(iter(message)) else set()  # NAME = ("code", "A message.")
    if isinstance(node, ast.FunctionDef) and node.name == "error_code":
        return {code for child in ast.walk(node) if isinstance(child, ast.Return) for code in text(child.value)}
    if isinstance(node, ast.BoolOp) and any(isinstance(value, ast.Attribute) and value.attr == "error_code"
                                            for value in node.values):  # output.error_code or "request_failed"
        return {code for value in node.values for code in text(value)}
    return set()


def test_every_error_code_users_can_meet_is_in_the_troubleshooting_table():
    codes = error_codes_in_the_code()
    assert {"invalid_api_key", "model_not_found", "worker_lost", "batch_expired", "cannot_fit", "engine_error",
            "storage_error", "quota_exceeded", "not_found", "request_failed"} <= codes  # the collection works
    table = (ROOT / "docs" / "operations.md").read_text().split("## Troubleshooting", 1)[1]
    documented = set(re.findall(r"^\| (.+?) \|", table, re.MULTILINE))
    named = {code for cell in documented for code in re.findall(r"`([a-z_]+)`", cell)}
    assert not codes - named, f"codes missing from docs/operations.md's troubleshooting table: {sorted(codes - named)}"
