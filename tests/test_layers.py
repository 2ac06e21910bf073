"""The import graph of gdp_jax: no cycles, no module importing from a layer above it.

Read from the sources with ``ast`` (nothing is imported, so no side effects and no
CuTe DSL import). Every ``import`` counts, including those inside functions: the package
uses function-level imports deliberately to defer heavy or device-only imports (the CuTe
DSL kernel bodies ``kernels/*_sm90.py``, ``kernels.*`` from ``backends`` only once an
sm_90 GPU is seen, flax-backed ``s3`` from ``cli``); deferring changes when a module
loads, not which layer it depends on, so they obey the same table. An import of a
submodule (``gdp_jax.kernels.fwd``) is an edge to that module only, not to the packages
above it.

The known violations are listed in ``KNOWN_BACK_EDGES`` (issue 13 removes them): the test
fails on any new one, and on a listed one that no longer exists (delete it from the list).
"""
from __future__ import annotations

import ast
import pathlib

import pytest

PKG = pathlib.Path(__file__).resolve().parents[1] / "gdp_jax"

# Layer of every module, bottom (0) to top; a module may import its own layer or below.
# Same-layer imports are allowed here and policed by the cycle check.
LAYERS = {
    # 0: leaf helpers, no gdp_jax imports: argument checks, varying-axes typing, packing
    "gdp_jax._vma": 0, "gdp_jax._checks": 0, "gdp_jax.packing": 0,
    # 1: the float64 token recurrence, the NaN guard, the CP fold algebra
    "gdp_jax.reference": 1, "gdp_jax._guard": 1, "gdp_jax.cp.fold": 1,
    # 2: the XLA chunked algorithm
    "gdp_jax.chunked": 2,
    # 3: CuTe DSL kernel bodies and the vmap folding helper
    "gdp_jax.kernels._batching": 3, "gdp_jax.kernels.chunk_fwd_sm90": 3,
    "gdp_jax.kernels.chunk_bwd_sm90": 3, "gdp_jax.kernels.wy_inverse_sm90": 3,
    "gdp_jax.kernels.step_sm90": 3, "gdp_jax.kernels.sm90": 3,
    # 4: the kernels' XLA glue and bindings, and their emulation
    "gdp_jax.kernels": 4, "gdp_jax.kernels.fwd": 4, "gdp_jax.kernels.bwd": 4,
    "gdp_jax.kernels.inverse": 4, "gdp_jax.kernels.step": 4, "gdp_jax.kernels.emulate": 4,
    # 5: backend selection; 6: the decoding step (the op's T = 1 path uses it)
    "gdp_jax.backends": 5, "gdp_jax.step": 6,
    # 7: context parallelism (protocol + driver); 8: the op (dispatches to CP for cp_axis)
    "gdp_jax.cp.protocol": 7, "gdp_jax.cp.driver": 7, "gdp_jax.cp": 7, "gdp_jax.ops": 8,
    # 9: the flax layer and FLA weight loading; 10: the S3 model built from it
    "gdp_jax.nn": 9, "gdp_jax.fla_weights": 9, "gdp_jax.s3": 10,
    # 11: the public facade; 12: its users (command line, testing helpers); 13: entry point
    "gdp_jax": 11, "gdp_jax.cli": 12, "gdp_jax.testing": 12, "gdp_jax.__main__": 13,
}

# Edges (importer, imported) known to break the rules, left for issue 13's restructure:
# each closes a cycle and points upward (or back within the kernels' glue).
KNOWN_BACK_EDGES = {
    # issue 13: the chunk grid helpers (chunk_shape, readout_cotangent) live in ops.py;
    # they belong in one chunk-grid module below both (imported inside a method).
    ("gdp_jax.cp.protocol", "gdp_jax.ops"),
    # issue 13: kernels/fwd.py is a grab-bag that inverse.py takes shared helpers from,
    # while fwd.py calls the inverse (function-level import to load at all).
    ("gdp_jax.kernels.fwd", "gdp_jax.kernels.inverse"),
}


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(PKG.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, pathlib.Path]:
    return {_module_name(p): p for p in sorted(PKG.rglob("*.py"))}


def _resolve(name: str, modules) -> str:
    """The module an imported dotted name lives in: ``gdp_jax.kernels.fwd`` itself,
    ``gdp_jax.ops.chunk_shape`` -> ``gdp_jax.ops``."""
    while name not in modules:
        name = name.rpartition(".")[0]
    return name


def _imports(mod: str, path: pathlib.Path, modules) -> set[str]:
    """gdp_jax modules that ``mod`` imports anywhere in its source (functions included)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out |= {_resolve(a.name, modules) for a in node.names
                    if a.name.split(".")[0] == "gdp_jax"}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:                    # relative: from the importer's package
                pkg = mod.split(".") if path.name == "__init__.py" else mod.split(".")[:-1]
                pkg = pkg[:len(pkg) - node.level + 1]
                base = ".".join(pkg + ([base] if base else []))
            if base.split(".")[0] != "gdp_jax":
                continue
            # `from pkg import sub` imports the submodule sub; `from mod import name` mod
            out |= {_resolve(f"{base}.{a.name}", modules) for a in node.names}
    out.discard(mod)
    return out


def import_graph() -> dict[str, set[str]]:
    """{module: the gdp_jax modules it imports} for every module of the package."""
    modules = _modules()
    return {m: _imports(m, p, modules) for m, p in modules.items()}


def find_cycle(graph: dict[str, set[str]]):
    """One import cycle as a list [a, b, ..., a], or None (depth-first search)."""
    state, stack = {}, []

    def visit(m):
        state[m] = "open"
        stack.append(m)
        for d in sorted(graph.get(m, ())):
            if state.get(d) == "open":
                return stack[stack.index(d):] + [d]
            if d not in state and (c := visit(d)):
                return c
        stack.pop()
        state[m] = "done"
        return None

    for m in sorted(graph):
        if m not in state and (c := visit(m)):
            return c
    return None


def _without_known(graph):
    return {m: {d for d in deps if (m, d) not in KNOWN_BACK_EDGES} for m, deps in graph.items()}


def test_every_module_has_a_layer():
    graph = import_graph()
    assert "gdp_jax.ops" in graph and "gdp_jax.kernels.fwd" in graph    # the parse works
    missing = sorted(set(graph) - set(LAYERS))
    assert not missing, f"place these modules in tests/test_layers.py LAYERS: {missing}"
    stale = sorted(set(LAYERS) - set(graph))
    assert not stale, f"LAYERS names modules that no longer exist: {stale}"


def test_known_back_edges_still_exist():
    """A fixed violation must leave the allow-list (so it cannot come back unnoticed)."""
    graph = import_graph()
    gone = sorted((m, d) for m, d in KNOWN_BACK_EDGES if d not in graph.get(m, ()))
    assert not gone, f"remove these fixed edges from KNOWN_BACK_EDGES: {gone}"


def test_no_import_cycles():
    cycle = find_cycle(_without_known(import_graph()))
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_no_module_imports_from_a_layer_above():
    graph = _without_known(import_graph())
    up = sorted((m, d, LAYERS[m], LAYERS[d]) for m, deps in graph.items() for d in deps
                if LAYERS[d] > LAYERS[m])
    assert not up, "upward imports (importer, imported, its layer, their layer): " + str(up)


@pytest.mark.parametrize("graph,bad", [
    ({"a": {"b"}, "b": {"c"}, "c": {"a"}}, True),
    ({"a": {"b"}, "b": {"c"}, "c": set()}, False),
    ({"a": {"a2"}, "a2": set(), "b": {"a", "a2"}}, False),
])
def test_find_cycle_itself(graph, bad):
    """The checker can fail: it finds a planted cycle and passes a DAG."""
    c = find_cycle(graph)
    assert (c is not None) == bad
    if bad:
        assert c[0] == c[-1] and all(b in graph[a] for a, b in zip(c, c[1:]))
