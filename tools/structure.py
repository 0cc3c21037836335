"""Measure the source tree's structure: import circles between modules, imports between top-level
packages, files over 600 lines and functions over 80 (the house rules). Imports inside functions and
under TYPE_CHECKING count too: they are dependencies all the same.

    python3 tools/structure.py            # from the repository's root
"""

from __future__ import annotations

import ast
import sys
from collections import Counter, defaultdict
from pathlib import Path

MAX_FILE = 600
MAX_FUNCTION = 80


def modules(src: Path) -> dict[str, Path]:
    found = {}
    for path in sorted(src.rglob("*.py")):
        parts = list(path.relative_to(src).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def _target(mod: str, is_pkg: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = mod.split(".") if is_pkg else mod.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def edges(mods: dict[str, Path]) -> dict[str, set[str]]:
    out: dict[str, set[str]] = defaultdict(set)
    for mod, path in mods.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = _target(mod, path.name == "__init__.py", node)
                names = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            for name in names:
                while name not in mods and "." in name:
                    name = name.rsplit(".", 1)[0]
                if name in mods and name != mod:
                    out[mod].add(name)
    return out


def circles(graph: dict[str, set[str]], nodes: list[str]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []
    for root in nodes:
        if root in index:
            continue
        work = [(root, iter(sorted(graph.get(root, ()))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on.add(root)
        while work:
            v, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on:
                    low[v] = min(low[v], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    found.append(sorted(comp))
    return sorted(found, key=len, reverse=True)


def package(mod: str) -> str:
    """dsec's subpackages one by one; any other top-level package (dsec_bench) as a whole."""
    parts = mod.split(".")
    return ".".join(parts[:2]) if parts[0] == "dsec" and len(parts) > 1 else parts[0]


def main(root: Path) -> None:
    src = root / "src"
    mods = modules(src)
    graph = edges(mods)
    print(f"modules: {len(mods)}")
    for comp in circles(graph, list(mods)):
        print(f"circle of {len(comp)}: {', '.join(comp)}")
    between: dict[str, Counter[str]] = defaultdict(Counter)
    for a, targets in graph.items():
        for b in targets:
            if package(a) != package(b):
                between[package(a)][package(b)] += 1
    for a in sorted(between):
        print(f"{a} -> " + ", ".join(f"{b} ({n})" for b, n in sorted(between[a].items())))
    for problem in oversized(root, mods):
        print(problem)


def oversized(root: Path, mods: dict[str, Path]) -> list[str]:
    """Files over MAX_FILE lines and functions over MAX_FUNCTION, as lines to print."""
    out = []
    for path in mods.values():
        text = path.read_text()
        if (lines := text.count("\n")) > MAX_FILE:
            out.append(f"file over {MAX_FILE} lines: {path.relative_to(root)} ({lines})")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                length = (node.end_lineno or node.lineno) - node.lineno + 1
                if length > MAX_FUNCTION:
                    out.append(f"function over {MAX_FUNCTION} lines: {path.relative_to(root)}:{node.name} ({length})")
    return out


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path.cwd())
