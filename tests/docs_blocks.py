"""The Python code blocks of README.md and docs/: extraction, markers and name checks.

Every ```` ```python ```` block is run by ``tests/unit/test_docs_code.py`` unless the line
just before its fence (blank lines between are allowed) is a marker that says why it is not::

    <!-- docs-test: not run (needs Spark and 2 ranks); given: train_df, test_df -->

``given`` names what the block takes from the prose around it (a DataFrame, a model built
earlier). A block that is not run is still compiled, and every name it uses must be bound in
the block itself, be a builtin, or be given; every import and every attribute it reads from
an imported module (``hvd.elastic.TorchState``, ``torch.nn.Linear``) must resolve.

``python -m tests.docs_blocks`` reads import checks as JSON on stdin and prints the ones
that fail (JSON on stdout): the test runs it in a child process, so that importing the
frameworks leaves no threads in the test's own process.
"""

from __future__ import annotations

import ast
import builtins
import dataclasses
import importlib
import json
import re
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
_FENCE = re.compile(r"^(\s*)```(\w*)\s*$")
_MARKER = re.compile(
    r"^<!--\s*docs-test:\s*not run\s*\((?P<why>[^)]+)\)\s*"
    r"(?:;\s*given:\s*(?P<given>[\w,\s]+?))?\s*-->\s*$")


@dataclasses.dataclass(frozen=True)
class Block:
    """One ```` ```python ```` block of a Markdown file."""

    path: Path
    line: int  # of the opening fence, 1-based
    code: str
    run: bool  # False when a marker says why it is not run
    why: str  # the marker's reason; "" for blocks that run
    given: frozenset[str]

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(REPO)}:{self.line}"


def markdown_files() -> list[Path]:
    """README.md and every page under docs/."""
    return [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]


def blocks(path: Path) -> list[Block]:
    """The Python blocks of ``path``, with what their markers say.

    Raises:
        ValueError: A ``docs-test`` comment that is not a well-formed marker, or a fence
            left open.
    """
    lines = path.read_text().splitlines()
    found: list[Block] = []
    i = 0
    while i < len(lines):
        match = _FENCE.match(lines[i])
        if not match:
            i += 1
            continue
        indent, lang = match.groups()
        end = i + 1
        while end < len(lines) and lines[end].strip() != "```":
            end += 1
        if end == len(lines):
            raise ValueError(f"{path}:{i + 1}: the code fence is never closed")
        if lang == "python":
            body = "\n".join(line[len(indent):] for line in lines[i + 1:end])
            marker = _marker_before(path, lines, i)
            given = frozenset()
            if marker is not None and marker.group("given"):
                given = frozenset(n.strip() for n in marker.group("given").split(",") if n.strip())
            found.append(Block(path, i + 1, body + "\n", marker is None,
                               marker.group("why") if marker else "", given))
        i = end + 1
    return found


def _marker_before(path: Path, lines: list[str], fence: int) -> re.Match | None:
    j = fence - 1
    while j >= 0 and not lines[j].strip():
        j -= 1
    if j < 0 or "docs-test" not in lines[j]:
        return None
    marker = _MARKER.match(lines[j].strip())
    if marker is None:
        raise ValueError(f"{path}:{j + 1}: malformed marker {lines[j].strip()!r}; write "
                         "<!-- docs-test: not run (why); given: name, name -->")
    return marker


def free_names(tree: ast.AST) -> set[str]:
    """Names ``tree`` reads that it never binds and that are not builtins."""
    bound: set[str] = set()
    used: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            (used if isinstance(node.ctx, ast.Load) else bound).add(node.id)
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            bound.add(node.name)
        elif isinstance(node, ast.arg):
            bound.add(node.arg)
        elif isinstance(node, ast.Import | ast.ImportFrom):
            bound.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ExceptHandler) and node.name:
            bound.add(node.name)
    return used - bound - set(dir(builtins))


def import_checks(tree: ast.AST) -> list[list[Any]]:
    """What the block imports and reads from its imports, as checks for ``resolve``.

    ``["module", name]``: ``import name`` works. ``["from", module, name]``: ``from module
    import name`` works. ``["attr", [[module, object or ""], ...], [attr, ...]]``: the
    attribute chain resolves on one of the modules (or on ``object`` imported from it) that
    the name is imported as (functions of one block may import different ones as ``hvd``).
    """
    checks: list[list[Any]] = []
    roots: dict[str, list[list[str]]] = {}  # local name -> [[module, object name or ""], ...]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                checks.append(["module", alias.name])
                if alias.asname:
                    roots.setdefault(alias.asname, []).append([alias.name, ""])
                else:
                    top = alias.name.split(".")[0]
                    roots.setdefault(top, []).append([top, ""])
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for alias in node.names:
                checks.append(["from", node.module, alias.name])
                roots.setdefault(alias.asname or alias.name, []).append([node.module, alias.name])
    rebound = {node.id for node in ast.walk(tree)
               if isinstance(node, ast.Name) and not isinstance(node.ctx, ast.Load)}
    for node in ast.walk(tree):
        chain: list[str] = []
        value: ast.AST = node
        while isinstance(value, ast.Attribute):
            chain.insert(0, value.attr)
            value = value.value
        if chain and isinstance(value, ast.Name) and value.id in roots and value.id not in rebound:
            checks.append(["attr", roots[value.id], chain])
    return checks


def dotted_names(text: str) -> set[str]:
    """The ``hvd_spark.a.b`` paths that inline code in Markdown ``text`` names."""
    return set(re.findall(r"`(hvd_spark(?:\.\w+)+)", text))


def _dotted(path: str) -> Any:
    parts = path.split(".")
    for cut in range(len(parts), 0, -1):  # the longest importable module prefix
        try:
            target = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for attr in parts[cut:]:
            target = getattr(target, attr)
        return target
    raise ModuleNotFoundError(path)


def resolve(checks: list[list[Any]]) -> list[str]:
    """The checks that fail, each as a sentence (``["dotted", path]``: the module or
    attribute ``path`` exists)."""
    failures = []
    for check in checks:
        try:
            if check[0] == "dotted":
                _dotted(check[1])
            elif check[0] == "module":
                importlib.import_module(check[1])
            elif check[0] == "from":
                _from(check[1], check[2])
            else:
                _, candidates, chain = check
                errors = []
                for module, obj in candidates:
                    try:
                        target = _from(module, obj) if obj else importlib.import_module(module)
                        for attr in chain:
                            target = _attribute(target, attr)
                        break
                    except Exception as exc:  # noqa: BLE001 - the next candidate may hold it
                        errors.append(exc)
                else:
                    raise errors[-1]
        except Exception as exc:  # noqa: BLE001 - every failure is reported, by check
            failures.append(f"{check}: {type(exc).__name__}: {exc}")
    return failures


def _from(module: str, name: str) -> Any:
    mod = importlib.import_module(module)
    try:
        return getattr(mod, name)
    except AttributeError:
        return importlib.import_module(f"{module}.{name}")  # a submodule


def _attribute(target: Any, attr: str) -> Any:
    try:
        return getattr(target, attr)
    except AttributeError:
        if not hasattr(target, "__path__"):  # not a package: no submodule to import
            raise
        return importlib.import_module(f"{target.__name__}.{attr}")


if __name__ == "__main__":
    # The docs show Horovod's own imports (`import horovod.torch as hvd`) where the opt-in
    # alias serves them (HorovodRunner's ranks, the porting guide): resolve them through it.
    from hvd_spark.compat import enable_horovod_alias

    enable_horovod_alias()
    json.dump(resolve(json.load(sys.stdin)), sys.stdout)
