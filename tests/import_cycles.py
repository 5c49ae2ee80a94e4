"""Import cycles between kvfleet's modules, found on grimp's graph (the one import-linter
builds): `python -m tests.import_cycles` prints each cycle and exits 1 if there is one.
Deferred imports inside functions count too: a cycle is broken by moving what both sides
share, never by hiding an import in a function."""

from __future__ import annotations

import sys

import grimp

PACKAGES = ("engine", "kvfleet_kernels", "jobs", "producers", "workers", "kvfleet", "grammar_support")


def strongly_connected(edges: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm, iterative: the groups of modules that import each other, in and out."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                group = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    group.append(member)
                    if member == node:
                        break
                groups.append(sorted(group))
    return groups


def import_cycles(packages: tuple[str, ...] = PACKAGES) -> list[list[str]]:
    graph = grimp.build_graph(*packages, include_external_packages=False)
    edges = {module: set(graph.find_modules_directly_imported_by(module)) for module in graph.modules}
    return [group for group in strongly_connected(edges) if len(group) > 1]


if __name__ == "__main__":
    cycles = import_cycles()
    for cycle in cycles:
        print("import cycle:", " <-> ".join(cycle))
    sys.exit(1 if cycles else 0)
