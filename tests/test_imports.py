"""No import circles inside the megaopd package: every import statement (module level or inside a function) is an
edge, and the graph's strongly connected components must all be single modules (any circle fails here)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def import_graph() -> dict[str, set[str]]:
    files = {".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"): p
             for p in (ROOT / "megaopd").rglob("*.py")}
    graph = {}
    for name, path in files.items():
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                # `from package import submodule` depends on the submodule; `from module import name` on the module
                subs = {f"{node.module}.{a.name}" for a in node.names} & files.keys()
                targets |= subs if len(subs) == len(node.names) else subs | {node.module}
        graph[name] = {t for t in targets if t in files and t != name}
    return graph


def circles(graph: dict[str, set[str]]) -> list[set[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    out.append(component)
    return out


def test_the_circle_finder_finds_a_circle():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [{"a", "b", "c"}]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_no_import_circles():
    assert circles(import_graph()) == []


def test_the_cpu_rehearsal_shim_is_applied_only_by_its_entry_point():
    """megaopd.models.megatron.cpu_rehearsal patches torch and megatron-core for CPU ranks: only the CPU rehearsal's trainer
    entry point (megaopd.models.megatron.cpu_launch) may import it, so no GPU run ever carries the patches."""
    importers = {name for name, targets in import_graph().items() if "megaopd.models.megatron.cpu_rehearsal" in targets}
    assert importers == {"megaopd.models.megatron.cpu_launch"}
