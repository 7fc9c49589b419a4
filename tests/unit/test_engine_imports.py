"""engine/ imports form no circle, counting the imports inside functions too (a lazy import that
closes a circle is a circle that only hides until something imports in another order)."""

from __future__ import annotations

import ast
import os

ENGINE = os.path.join(
    os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "engine"
)


def engine_modules() -> dict[str, str]:
    modules = {}
    for folder, _, files in os.walk(ENGINE):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                module = os.path.relpath(path, os.path.dirname(ENGINE))[:-3].replace(os.sep, ".")
                modules[module.removesuffix(".__init__")] = path
    return modules


def import_graph() -> dict[str, set[str]]:
    """Module -> the engine modules it names in an import (`from a.b import c` names a.b, and a.b.c
    where c is a module); a package's own __init__ running first is not an edge."""
    modules = engine_modules()
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for module, path in modules.items():
        for node in ast.walk(ast.parse(open(path).read())):
            if isinstance(node, ast.Import):
                named = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                named = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
            else:
                continue
            graph[module] |= {n for n in named if n in modules and n != module}
    return graph


def circles(graph: dict[str, set[str]]) -> list[set[str]]:
    """Strongly connected components of more than one module (Tarjan's)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(component)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_circles_are_found():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [{"a", "b", "c"}]


def test_engine_imports_form_no_circle():
    assert circles(import_graph()) == []
