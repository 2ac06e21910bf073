"""The import graph of gdp_jax: no cycles, no module importing from a layer above it.

Read from the sources with ``ast`` (nothing is imported, so no side effects and no
CuTe DSL import). Every ``import`` counts, including those inside functions: the package
uses function-level imports deliberately to defer heavy or device-only imports (the CuTe
DSL kernel bodies ``kernels/*_sm90.py``, ``kernels.*`` from ``backends`` only once an
sm_90 GPU is seen, flax-backed ``s3`` from ``cli``); deferring changes when a module
loads, not which layer it depends on, so they obey the same table. An import of a
submodule (``gdp_jax.kernels.binding``) is an edge to that module only, not to the packages
above it.

``KNOWN_BACK_EDGES`` lists allowed violations (none today): the test fails on any new one,
and on a listed one that no longer exists (delete it from the list).
"""
from __future__ import annotations

import ast
import pathlib

import pytest

PKG = pathlib.Path(__file__).resolve().parents[1] / "gdp_jax"

# Layer of every module, bottom (0) to top; a module may import its own layer or below.
# Same-layer imports are allowed here and policed by the cycle check.
LAYERS = {
    # 0: leaf helpers: the call spec and argument checks, varying-axes typing, packing
    "gdp_jax.spec": 0, "gdp_jax._checks": 0, "gdp_jax._vma": 0, "gdp_jax._prefix": 0,
    "gdp_jax.packing": 0,
    "gdp_jax.heads": 0,
    # 1: the float64 token recurrence, the NaN guard, the CP fold algebra, the op's L2 norm
    "gdp_jax.reference": 1, "gdp_jax._guard": 1, "gdp_jax.cp.fold": 1,
    "gdp_jax.norm": 1,
    # 2: the chunk grid; 3: the XLA chunked algorithm and its two-level passes; 4: the engine
    # interface + XLA engine
    "gdp_jax.grid": 2, "gdp_jax.chunked": 3, "gdp_jax.recurrence": 3, "gdp_jax.engine": 4,
    # 5: CuTe DSL device code and the one binding module
    "gdp_jax.kernels.sm90": 5, "gdp_jax.kernels.chunk_fwd_sm90": 5,
    "gdp_jax.kernels.chunk_bwd_sm90": 5, "gdp_jax.kernels.wy_inverse_sm90": 5,
    "gdp_jax.kernels.step_sm90": 5, "gdp_jax.kernels.chunk_prep_sm90": 5,
    "gdp_jax.kernels.chunk_grad_sm90": 5,
    "gdp_jax.kernels.binding": 5, "gdp_jax.kernels.aot": 5,
    # 6: kernel classes (limits + calls), and their emulation
    "gdp_jax.kernels.chunk_forward": 6, "gdp_jax.kernels.state_grad": 6,
    "gdp_jax.kernels.wy_inverse": 6, "gdp_jax.kernels.step": 6, "gdp_jax.kernels.emulate": 6,
    "gdp_jax.kernels.chunk_prep": 6, "gdp_jax.kernels.local_grad": 6,
    # 7: the CuTe DSL engine (the pipeline's XLA glue)
    "gdp_jax.kernels.pipeline": 7, "gdp_jax.kernels": 7,
    # 8: backend selection; 9: the decoding step (the op's T = 1 path uses it)
    "gdp_jax.backends": 8, "gdp_jax.step": 9,
    # 10: context parallelism (protocol + driver); 11: the op (dispatches to CP for cp_axis)
    "gdp_jax.cp.protocol": 10, "gdp_jax.cp.driver": 10, "gdp_jax.cp.split": 10, "gdp_jax.cp": 10,
    "gdp_jax.ops": 11,
    # 12: the flax layer and FLA weight loading; 13: the S3 model built from it
    "gdp_jax.nn": 12, "gdp_jax.fla_weights": 12, "gdp_jax.s3": 13,
    # 14: the public facade; 15: its users (command line, testing helpers); 16: entry point
    "gdp_jax": 14, "gdp_jax.cli": 15, "gdp_jax.testing": 15, "gdp_jax.__main__": 16,
}

# Edges (importer, imported) allowed to break the rules: none.
KNOWN_BACK_EDGES: set = set()


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(PKG.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, pathlib.Path]:
    return {_module_name(p): p for p in sorted(PKG.rglob("*.py"))}


def _resolve(name: str, modules) -> str:
    """The module an imported dotted name lives in: ``gdp_jax.kernels.binding`` itself,
    ``gdp_jax.grid.CHUNK`` -> ``gdp_jax.grid``."""
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
    assert "gdp_jax.ops" in graph and "gdp_jax.kernels.pipeline" in graph   # the parse works
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
