"""The product's modules import one another one way: no import circle among them.

A circle works until someone imports its modules in another order (or moves a lazy import to the
top of a file), and then fails with a half-initialised module. The graph is read from the source
with `ast`, counting imports inside functions too: a lazy import is still an edge, and was how
common/job.py and common/builtin_jobs.py imported each other.
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("cli", "common", "coordinator", "monitor", "worker")  # folder == idlegrad.<folder>


def product_modules() -> dict[str, Path]:
    """Dotted name -> source file, for every module of the product's subpackages."""
    modules = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = ["idlegrad", package, *path.relative_to(ROOT / package).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join(parts)] = path
    return modules


def imported_names(module: str, path: Path) -> set[str]:
    """Every module name an import statement anywhere in the file may load (candidates: for
    `from a import b`, both `a` and `a.b`; the caller keeps the ones that are modules)."""
    is_package = path.name == "__init__.py"
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                anchor = module.split(".")
                if not is_package:
                    anchor = anchor[:-1]
                anchor = anchor[:len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            out.add(base)
            out.update(f"{base}.{alias.name}" for alias in node.names)
    return out


def import_graph() -> dict[str, set[str]]:
    modules = product_modules()
    return {name: {other for other in imported_names(name, path)
                   if other in modules and other != name}
            for name, path in modules.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str]:
    """One import circle as [a, b, ..., a], or [] when the graph has none."""
    done: set[str] = set()
    stack: list[str] = []
    on_stack: set[str] = set()

    def visit(node: str) -> list[str]:
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph[node]):
            if nxt in on_stack:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in done:
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        on_stack.discard(node)
        done.add(node)
        return []

    for start in sorted(graph):
        if start not in done:
            found = visit(start)
            if found:
                return found
    return []


def test_every_product_module_imports():
    for name in product_modules():
        if not name.endswith(".__main__"):  # a script: importing it runs the command
            importlib.import_module(name)


def test_the_graph_sees_relative_lazy_and_package_imports():
    """The reader of imports itself: an edge it missed would hide a circle."""
    graph = import_graph()
    assert "idlegrad.common.errors" in graph["idlegrad.common.job_loading"]  # from .errors import
    assert "idlegrad.common.builtin_jobs" in graph["idlegrad.common.job_loading"]  # lazy, `from . import`
    assert "idlegrad.common.job" in graph["idlegrad.worker.engine"]  # from ..common.job import
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) == []


def test_no_import_circle_among_the_products_modules():
    cycle = find_cycle(import_graph())
    assert not cycle, "import circle: " + " -> ".join(cycle)


LAYER = {"cli": 2, "coordinator": 1, "worker": 1, "monitor": 1, "common": 0}
# The one crossing: the simulator's workers are the daemon's own session (sans-IO), driven in
# virtual time, so that the simulated fleet follows the real worker's protocol rules.
ACROSS = {("idlegrad.coordinator.sim_worker", "idlegrad.worker.session")}


def test_the_sides_import_downwards_only():
    """cli -> coordinator | worker | monitor -> common: common imports no side, and the sides
    never import each other (they meet on the wire), but for the simulator's `ACROSS`."""
    wrong = [f"{a} -> {b}" for a, targets in sorted(import_graph().items()) for b in sorted(targets)
             if a.split(".")[1] != b.split(".")[1] and (a, b) not in ACROSS
             and LAYER[a.split(".")[1]] <= LAYER[b.split(".")[1]]]
    assert not wrong, "imports against the layers: " + "; ".join(wrong)


def test_what_the_simulator_takes_from_the_worker_imports_only_common():
    """The worker's session, run inside the coordinator's simulator, brings no worker code
    with it (no socket, no torch): it imports from common alone."""
    graph = import_graph()
    for _, taken in ACROSS:
        assert graph[taken] and all(m.split(".")[1] == "common" for m in graph[taken]), \
            graph[taken]
