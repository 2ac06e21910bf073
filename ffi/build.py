"""Prebuild every cutedsl kernel variant for sm_90a, no GPU needed.

    python ffi/build.py [--out DIR] [--only TEXT ...] [--jobs N] [--recompute 0,1]

Each kernel class of ``gdp_jax/kernels`` that has a ``variants()`` classmethod lists the
variants the backend runs (new kernel classes join without edits here); each is lowered
for cuda once, at its canonical shape, and its object (host launcher + sm_90a cubin) is
written to DIR (default: ``$GDP_JAX_KERNEL_DIR``, else ``ffi/build/kernels``) with a
manifest that :mod:`gdp_jax.kernels.aot` reads; DIR's earlier objects are replaced.
``--only``: just the variants whose name contains one of the texts. ``--recompute``: the ``recompute_chunk_num`` values to prebuild
checkpointing forwards for (others compile at trace time). Prints one line per variant.
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import importlib
import inspect
import multiprocessing
import os
import pathlib
import pkgutil
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))


def kernel_classes():
    """Every class in gdp_jax.kernels' modules with a ``variants`` classmethod."""
    import gdp_jax.kernels as pkg
    found = []
    for info in pkgutil.iter_modules(pkg.__path__):
        if info.name.endswith("sm90"):          # device code: imports the CuTe DSL
            continue
        mod = importlib.import_module(f"{pkg.__name__}.{info.name}")
        for obj in vars(mod).values():
            if (inspect.isclass(obj) and obj.__module__ == mod.__name__
                    and callable(getattr(obj, "variants", None))):
                found.append(obj)
    return found


def all_variants(recompute=(0,)):
    out = []
    for cls in kernel_classes():
        params = inspect.signature(cls.variants).parameters
        kw = {"recompute_chunk_nums": tuple(recompute)} if "recompute_chunk_nums" in params else {}
        out.extend(cls.variants(**kw))
    return out


def _select(variants, only):
    return [v for v in variants if not only or any(t in v.what for t in only)]


def _build(whats, recompute):
    """Compile the named variants in this process -> {variant key: (module, fingerprint)}."""
    import jax
    from gdp_jax.kernels import binding
    todo = [v for v in all_variants(recompute) if v.what in set(whats)]
    for v in todo:
        t = time.perf_counter()
        jax.jit(v.fn).trace(*v.avals).lower(lowering_platforms=("cuda",))
        print(f"  {v.what}: {time.perf_counter() - t:.1f} s", flush=True)
    return {k: tuple(a) for k, a in binding.compiled_variants().items()}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=pathlib.Path, default=None)
    ap.add_argument("--only", action="append", default=[])
    ap.add_argument("--jobs", type=int, default=1)
    ap.add_argument("--recompute", default="0",
                    help="comma-separated recompute_chunk_num values (default 0)")
    args = ap.parse_args(argv)
    if args.jobs < 1:
        ap.error(f"--jobs must be >= 1, got {args.jobs}")
    try:
        recompute = tuple(int(r) for r in args.recompute.split(","))
    except ValueError:
        ap.error(f"--recompute must be comma-separated ints, got {args.recompute!r}")
    if not all(0 <= r <= 64 for r in recompute):
        ap.error(f"--recompute values must be in [0, 64], got {args.recompute!r}")
    # before jax and the CuTe DSL are imported (worker processes inherit it)
    if os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a") != "sm_90a":
        sys.exit(f"ffi/build.py builds for sm_90a; CUTE_DSL_ARCH={os.environ['CUTE_DSL_ARCH']}")
    os.environ.setdefault("JAX_PLATFORMS", "cpu")   # lowering needs no GPU (and takes none)

    from gdp_jax.kernels import aot, binding
    out = args.out or aot.store_dir()
    # compile everything afresh: never read the objects being replaced
    os.environ[aot.ENV_DIR] = tempfile.mkdtemp(prefix="gdp-jax-none-")
    os.environ["GDP_JAX_KERNEL_SHAPES"] = "generic"     # what the prebuilt path runs
    whats = sorted({v.what for v in _select(all_variants(recompute), args.only)})
    if not whats:
        sys.exit(f"no kernel variant matches --only {args.only}")
    print(f"building {len(whats)} kernel variants for sm_90a -> {out}", flush=True)
    t0 = time.perf_counter()
    built = {}
    if args.jobs == 1:
        built.update(_build(whats, recompute))
    else:
        ctx = multiprocessing.get_context("spawn")
        parts = [p for p in (whats[i::args.jobs] for i in range(args.jobs)) if p]
        with cf.ProcessPoolExecutor(len(parts), mp_context=ctx) as pool:
            for res in pool.map(_build, parts, [recompute] * len(parts)):
                built.update(res)
    binding.import_cutlass()
    import cutlass.jax.ffi as cffi
    lib = cffi.find_cute_dsl_runtime_library()
    flavor = pathlib.Path(lib).parent.parent.name if lib else None
    aot.write(out, binding.device_source_hash(),
              {k: aot.Artifact(*a) for k, a in built.items()}, flavor)
    print(f"wrote {len(built)} objects ({sum(len(a[0]) for a in built.values()) / 1e6:.1f} MB)"
          f" to {out} in {time.perf_counter() - t0:.1f} s", flush=True)


if __name__ == "__main__":
    main()
