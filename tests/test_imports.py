"""No import circles inside the megaopd package: every import statement (module level or inside a function) is an
edge, and the graph's strongly connected components must all be single modules (any circle fails here)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def import_graph(statements=lambda tree: ast.walk(tree)) -> dict[str, set[str]]:
    """Module -> the megaopd modules it imports, from the import statements `statements(tree)` yields (default:
    every one, at module level or inside a function)."""
    files = {".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"): p
             for p in (ROOT / "megaopd").rglob("*.py")}
    graph = {}
    for name, path in files.items():
        targets = set()
        for node in statements(ast.parse(path.read_text())):
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


# The layout (docs/architecture.md): the top of megaopd/ holds the entry point, the config schema, the errors and one
# sub-package per stage of the data flow; each stage imports only stages below it.
TOP_LEVEL = {"cli.py", "config.py", "errors.py", "data", "models", "rollout", "teachers", "objectives", "accounting",
             "run", "analysis", "verifiers", "launch"}
MAX_TOP_LEVEL = 13  # besides __init__.py

# Imports that still run back up between stages: all inside a function (none at module level), each named here so a
# new one fails and a removed one must be struck off (issue 54 item 3 removes the first).
BACK_EDGES = {
    # the KL metric reuses the loss's k3 estimator (imported late so the report reads metrics without torch)
    ("megaopd.accounting.metrics", "megaopd.objectives.losses"),
    # torchrun's entry point for a Megatron trainer rank starts the run's trainer
    ("megaopd.models.megatron.launch", "megaopd.run.trainer"),
    ("megaopd.models.megatron.launch", "megaopd.run.allocator"),
    # the teacher check scores its held-out samples the way evaluation does
    ("megaopd.teachers.check", "megaopd.run.evaluate"),
}


def stage(module: str) -> str:
    """The sub-package (stage) a module belongs to, or the top-level module itself."""
    return module.split(".")[1] if "." in module else module


def top_statements(body):
    """The statements a module runs when it is imported: at module level (under ``if``/``try`` too), not inside a
    function and not under ``if TYPE_CHECKING``."""
    for node in body:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            yield from top_statements(node.orelse)
        elif isinstance(node, (ast.If, ast.Try)):
            yield from top_statements(node.body)
            yield from top_statements(node.orelse)
            for handler in getattr(node, "handlers", []):
                yield from top_statements(handler.body)
        else:
            yield node


def module_level_graph() -> dict[str, set[str]]:
    """Like import_graph, but only the imports a module runs when it is imported (``top_statements``)."""
    return import_graph(lambda tree: top_statements(tree.body))


def stage_graph(graph: dict[str, set[str]], skip: set[tuple[str, str]] = frozenset()) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for module, targets in graph.items():
        out.setdefault(stage(module), set())
        for target in targets:
            if (module, target) not in skip and stage(target) != stage(module):
                out[stage(module)].add(stage(target))
                out.setdefault(stage(target), set())
    return out


def test_the_top_of_the_package_is_the_stages_of_the_flow():
    entries = {p.name for p in (ROOT / "megaopd").iterdir() if p.name not in ("__init__.py", "__pycache__")}
    assert entries == TOP_LEVEL
    assert len(entries) <= MAX_TOP_LEVEL


def test_no_stage_imports_a_stage_that_imports_it_at_module_level():
    assert circles(stage_graph(module_level_graph())) == []


def test_the_only_imports_back_up_between_stages_are_the_named_ones():
    graph = import_graph()
    assert circles(stage_graph(graph, skip=BACK_EDGES)) == []
    present = {(m, t) for m, targets in graph.items() for t in targets}
    assert BACK_EDGES <= present, f"no longer imported, strike off BACK_EDGES: {BACK_EDGES - present}"
    module_level = {(m, t) for m, targets in module_level_graph().items() for t in targets}
    assert not BACK_EDGES & module_level, "a named back edge is imported at module level"


def test_the_stage_checks_find_a_back_edge():
    graph = {"megaopd.models.a": {"megaopd.run.b"}, "megaopd.run.b": {"megaopd.models.a"}}
    assert circles(stage_graph(graph)) == [{"models", "run"}]
    assert circles(stage_graph(graph, skip={("megaopd.models.a", "megaopd.run.b")})) == []


if __name__ == "__main__":  # the stage graph, for docs/architecture.md: python tests/test_imports.py
    for name, targets in sorted(stage_graph(import_graph(), skip=BACK_EDGES).items()):
        print(f"{name:12s} -> {', '.join(sorted(targets)) or '-'}")
