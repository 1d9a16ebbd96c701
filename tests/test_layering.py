"""The import graph of `vllm_omni/` between its top-level packages, read from the source (AST, no import).

Why it matters: a lower floor that imports a higher one can no longer be read, tested or loaded without it
(the catalog pulled in the engine; diffusion and models imported each other both ways). What it pins: the
model code and the catalog never import the engine or the entry points (the catalog no runtime at all: it
reaches family code only through the registry's lazy "module:attr" strings), and the number of upward edges and
import cycles stays at or under the targets below. Every import counts: module-level, function-local and
type-only (`TYPE_CHECKING`) ones, since each is a dependency someone has to read.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "vllm_omni"

FLOORS = [
    "vllm_omni",  # the package root: lazy names for the user's entry points
    "entrypoints",  # Omni, AsyncOmni, the OpenAI server, the CLI
    "engine",  # orchestrator, stage clients and runtime
    "plugins",  # vLLM's plugin entry point, loaded in every vLLM process: registers the families' AR models
    "models",  # model families: pipelines, transformers, edges, topologies
    "connectors",  # stage payload transports
    "config",  # pipeline/deploy/stage config, resolved once (materializes the diffusion config)
    "diffusion",  # the diffusion runtime: engine, executor, worker, pipeline skeleton, cache, layers
    "catalog",  # what everyone reads about a model: spec, registry, shapes, resolution, tiny, edge contract
    "inputs",  # request params and the knob schema
    "outputs",
    "errors",
    "logger",
    "envs",
]
"""Top floor first: a package may import the floors below it. An import of a floor above is an upward edge."""

UPWARD_EDGES_MAX = 2
CYCLES_MAX = 2
"""The upward edges left: catalog -> config (the edge contract's `EdgeStreamConfig` / `EdgeField` types),
entrypoints -> the package root (`cli/main.py`). The cycles left (issue 24's target): attention selector <->
diffusion data, CLI main <-> serve <-> api_server."""
NEVER = {"models": {"engine", "entrypoints"},
         "catalog": {"engine", "entrypoints", "models", "diffusion", "connectors"}}
"""Packages that must not import these others at all."""


def _package(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] != "vllm_omni":
        return None
    return parts[1] if len(parts) > 1 else "vllm_omni"


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT.parent).with_suffix("")
    parts = list(rel.parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """Every vllm_omni module `path` imports, relative imports resolved."""
    module = _module_name(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            # `from package import module` imports the module; `from module import name` the module itself.
            found.update(f"{base}.{alias.name}" if _exists(f"{base}.{alias.name}") else base for alias in node.names)
    return {name for name in found if name.split(".")[0] == "vllm_omni"}


def _exists(module: str) -> bool:
    path = ROOT.parent.joinpath(*module.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def module_graph() -> dict[str, set[str]]:
    """Module -> the vllm_omni modules it imports."""
    return {_module_name(path): _imports(path) - {_module_name(path)} for path in sorted(ROOT.rglob("*.py"))}


def package_edges() -> dict[tuple[str, str], list[str]]:
    """(importing package, imported package) -> the importing files."""
    edges: dict[tuple[str, str], list[str]] = {}
    for module, targets in module_graph().items():
        src = _package(module)
        for target in targets:
            dst = _package(target)
            if dst != src:
                edges.setdefault((src, dst), []).append(module)
    return edges


def upward_edges(edges) -> list[tuple[str, str]]:
    return sorted((s, d) for s, d in edges if FLOORS.index(d) < FLOORS.index(s))


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import cycles between modules: each strongly connected group of more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups = []

    def visit(node: str) -> None:  # Tarjan
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in graph.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(groups)


def test_every_package_has_a_floor():
    packages = {_package(_module_name(p)) for p in ROOT.rglob("*.py")}
    assert packages <= set(FLOORS), sorted(packages - set(FLOORS))


def test_models_and_catalog_never_import_the_runtime_above():
    edges = package_edges()
    bad = {(s, d): files for (s, d), files in edges.items() if d in NEVER.get(s, ())}
    assert not bad, bad


def test_upward_edges_and_cycles_within_targets():
    edges = package_edges()
    up = upward_edges(edges)
    knots = cycles(module_graph())
    report = {edge: edges[edge] for edge in up}
    assert len(up) <= UPWARD_EDGES_MAX, f"{len(up)} upward edges: {report}"
    assert len(knots) <= CYCLES_MAX, f"{len(knots)} cycles: {knots}"
