"""Binding CuTe DSL kernels to XLA: the one place that calls ``cutlass_call``.

What every kernel call needs, done once here:

- one compiled object per *variant* (:mod:`gdp_jax.kernels.aot`: dtypes, tile extents,
  compile-time keywords; not the batch, chunk, head or sequence counts, which the object
  reads from XLA's buffers at run time), taken from the prebuilt ones of ``ffi/build.py``
  when present, else compiled once per process at trace time (at its canonical shape, so
  both give the same bytes) and emitted as a ``jax.ffi.ffi_call`` to the CuTe DSL
  runtime's handler;
- the CuTe DSL import (only when a variant must be compiled; ``CUTE_DSL_ARCH=sm_90a`` so
  a host without a GPU compiles for Hopper instead of the DSL's sm_100a default);
- compile keys that include a hash of the device sources (``kernels/*_sm90.py`` and
  ``kernels/sm90.py``): editing a kernel can never reuse a stale binary (in memory or on
  disk);
- ``jax.vmap``: ``cutlass_call`` has no batching rule; :func:`vmappable` folds a mapped
  axis into the batch rows (the kernels run one CTA per (value tile, head, row) and look
  per-sequence tables up through an int32 ``seq`` [B, NC] index, so M mapped problems
  are one problem with M * B rows: chunk tensors [M, B, ...] -> [M B, ...], table
  [M, N, ...] -> [M N, ...], ``seq`` += m N);
- varying-axes typing under ``shard_map``: a custom call's results carry none, so they
  get the union of their operands' (:func:`gdp_jax._vma.like`).
"""
from __future__ import annotations

import functools
import hashlib
import os
import pathlib
import threading

import jax
import jax.numpy as jnp
from jax import custom_batching

from gdp_jax import _vma
from gdp_jax.kernels import aot

MAX_ELEMS = 2 ** 31 - 1      # 32-bit extents (and offsets, in the per-shape objects)
MAX_GRID_Y = 65535           # CTAs along a launch grid's y (and z) axis
SMS = 132                    # streaming multiprocessors of the targets (H100 / H200 SXM)


def grid_limit(rows: int, heads: int):
    """Why the kernels' launch grids (a CTA per (.., head, row): heads along y, rows along
    z) cannot hold ``rows`` x ``heads``, or None."""
    if rows > MAX_GRID_Y or heads > MAX_GRID_Y:
        return (f"{rows} rows x {heads} heads: the cutedsl kernels launch a CTA per row and "
                f"head, at most {MAX_GRID_Y} of each")
    return None
_HERE = pathlib.Path(__file__).resolve().parent


@functools.lru_cache(maxsize=None)
def import_cutlass():
    """Import the CuTe DSL once (ImportError or the DSL's own load error if it cannot)."""
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
    import cutlass  # noqa: F401
    import cutlass.cute  # noqa: F401
    import cutlass.jax  # noqa: F401
    aot.note_cutlass_imported()
    return cutlass


def cutlass_importable() -> tuple[bool, str]:
    """(ok, reason): can kernels be run here? Prebuilt ones need only the DSL's runtime
    library (no import: it takes seconds); otherwise the DSL must import."""
    st = aot.store(device_source_hash())
    if kernel_shapes() == "generic" and st.entries and aot.runtime_library(st.flavor):
        return True, f"ok ({st.reason})"
    try:
        import_cutlass()
    except Exception as e:  # ImportError, or the DSL's own load errors
        return False, f"nvidia-cutlass-dsl cannot be imported ({type(e).__name__}: {e})"
    return True, "ok"


@functools.lru_cache(maxsize=None)
def device_source_hash() -> str:
    """sha256 (16 hex digits) of every device source file: part of every compile key."""
    h = hashlib.sha256()
    for path in sorted(_HERE.glob("*sm90*.py")):
        h.update(path.name.encode())
        h.update(path.read_bytes())
    return h.hexdigest()[:16]


def kernel_shapes() -> str:
    """How kernels are compiled (``GDP_JAX_KERNEL_SHAPES``): "generic", one object per
    variant for every (B, T) (leading dims read at run time), prebuilt ones used when
    present; "static", one compile per shape with every extent baked in (5-9 KB less
    machine code a kernel; the op's fwd+bwd ~3.5% faster than on generic objects at
    (8, 4096, 16, 2), H100, s34); "auto" (default): generic when prebuilt kernels are
    present (``python ffi/build.py``), else static. Benchmarks record which
    (``benchmarks.measure.kernel_compile_mode``)."""
    mode = os.environ.get("GDP_JAX_KERNEL_SHAPES", "auto")
    if mode not in ("auto", "generic", "static"):
        raise ValueError(f"GDP_JAX_KERNEL_SHAPES={mode!r}; expected 'auto', 'generic' or "
                         f"'static'")
    if mode == "auto":
        mode = "generic" if aot.store(device_source_hash()).entries else "static"
    return mode


_compiled: dict = {}        # variant key -> aot.Artifact compiled in this process
_compile_lock = threading.RLock()


def compiled_variants() -> dict:
    """{variant key: aot.Artifact} of every generic variant this process compiled
    (what ``ffi/build.py`` writes)."""
    return dict(_compiled)


def custom_call(launcher, name: str, outputs, args, *, tile_dims, key=(), aliases=None,
                **constexprs):
    """Run the kernel of ``launcher()`` (a ``cute.jit`` function of (stream, *args,
    *outputs), built only when it must be compiled) as an XLA custom call on ``args``;
    returns the results typed like ``outputs`` (``jax.ShapeDtypeStruct``s), with the
    operands' varying mesh axes.

    ``tile_dims``: per tensor (args, then outputs), how many trailing dims the compiled
    variant fixes (head dims, chunk length); the leading ones are read at run time.
    ``key``: everything else besides shapes that selects the variant; ``aliases``:
    {input index: output index} buffers updated in place; ``constexprs``: the launcher's
    compile-time keyword arguments.
    """
    outputs = tuple(outputs) if isinstance(outputs, (tuple, list)) else outputs
    outs = outputs if isinstance(outputs, tuple) else (outputs,)
    aliases = dict(aliases or {})
    if len(tile_dims) != len(args) + len(outs):
        raise ValueError(f"tile_dims has {len(tile_dims)} entries for {len(args)} args and "
                         f"{len(outs)} outputs of {name}")
    if kernel_shapes() == "static":
        res = _static_call(launcher, name, outputs, args, key, aliases, constexprs)
        return _vma.like(res, args)
    sigs = [aot.tensor_sig(t.shape, t.dtype, d) for t, d in zip(tuple(args) + outs, tile_dims)]
    vkey = aot.variant_key(name, device_source_hash(), sigs[:len(args)], sigs[len(args):],
                           key, aliases.items(), constexprs.items())
    art = _compiled.get(vkey)
    if art is None:
        art = aot.lookup(vkey)
        if art is not None:
            aot.register_runtime(aot.store(vkey[1]).flavor)
    if art is None:
        art = _compile(launcher, vkey, aliases, constexprs)
    call = jax.ffi.ffi_call(aot.target_name(), outs, input_output_aliases=aliases)
    res = call(*args, module=art.module, key=art.fingerprint)
    res = tuple(res) if isinstance(outputs, tuple) else res[0]
    return _vma.like(res, args)


def _compile(launcher, vkey, aliases, constexprs):
    """Compile one generic variant at its canonical shape (extent 1 in the run-time dims)
    through ``cutlass_call`` and take its object out of the lowered module."""
    with _compile_lock:
        if vkey in _compiled:
            return _compiled[vkey]
        import_cutlass()
        import cutlass.jax as cjax

        _, _, in_sigs, out_sigs, _, _, _ = vkey

        def spec(sig):      # run-time dims: no divisibility assumed; tile dims: their extent
            shape = aot.canonical_shape(sig)
            div = tuple(1 if i < sig[1] - len(sig[2]) else d for i, d in enumerate(shape))
            return cjax.TensorSpec(static=False, divisibility=div)

        avals = [jax.ShapeDtypeStruct(aot.canonical_shape(s), s[0]) for s in in_sigs]
        outs = tuple(jax.ShapeDtypeStruct(aot.canonical_shape(s), s[0]) for s in out_sigs)
        call = cjax.cutlass_call(launcher(), output_shape_dtype=outs,
                                 input_spec=tuple(spec(s) for s in in_sigs),
                                 output_spec=tuple(spec(s) for s in out_sigs),
                                 input_output_aliases=aliases, compile_key=vkey,
                                 **constexprs)
        lowered = jax.jit(lambda *a: call(*a)).trace(*avals).lower(
            lowering_platforms=("cuda",))
        target, art = aot.harvest(lowered)
        if target != aot.target_name():
            raise RuntimeError(f"cutlass_call emitted {target}, expected {aot.target_name()}")
        _compiled[vkey] = art
        return art



def _static_call(launcher, name, outputs, args, key, aliases, constexprs):
    """The per-shape compile (every extent baked into the object)."""
    import_cutlass()
    import cutlass.jax as cjax

    shapes = tuple((tuple(a.shape), jnp.dtype(a.dtype).name) for a in args)
    call = cjax.cutlass_call(
        launcher(),
        output_shape_dtype=outputs,
        input_output_aliases=aliases,
        use_static_tensors=True,
        compile_key=(name, device_source_hash(), shapes, tuple(key),
                     tuple(sorted(constexprs.items()))),
        **constexprs,
    )
    return call(*args)


def vmappable(call, *, seq_arg=None, table_arg=None, out_kinds):
    """``call(*args)`` made ``jax.vmap``-able by folding the mapped axis into the rows.

    args: tensors with a leading batch axis B; ``args[seq_arg]`` the int32 [B, NC]
    sequence index into ``args[table_arg]`` [N, ...] (both None: every argument is rows).
    ``out_kinds``: per output, "rows" (leading axis B or N: unfolded back to [M, ...]) or
    "dummy" (a placeholder: broadcast). Unmapped arguments are broadcast first; nested
    vmaps fold again.
    """
    f = custom_batching.custom_vmap(call)

    @f.def_vmap
    def rule(M, in_batched, *args):
        args = [a if b else jnp.broadcast_to(a, (M,) + a.shape)
                for a, b in zip(args, in_batched)]
        if seq_arg is not None:
            N = args[table_arg].shape[1]
            offset = (jnp.arange(M, dtype=jnp.int32) * N).reshape(
                (M,) + (1,) * (args[seq_arg].ndim - 1))
            args[seq_arg] = args[seq_arg] + offset
        flat = [a.reshape((M * a.shape[1],) + a.shape[2:]) for a in args]
        if max(a.size for a in flat) > MAX_ELEMS:
            raise ValueError(f"jax.vmap over {M} problems makes the cutedsl kernels' inputs "
                             "too large for their 32-bit offsets; map in smaller groups "
                             "(jax.lax.map) or use backend='xla'")
        outs = f(*flat)
        res = tuple(jnp.broadcast_to(o, (M,) + o.shape) if kind == "dummy"
                    else o.reshape((M, o.shape[0] // M) + o.shape[1:])
                    for o, kind in zip(outs, out_kinds))
        return res, (True,) * len(res)

    return f


def out(shape, dtype):
    return jax.ShapeDtypeStruct(tuple(shape), jnp.dtype(dtype))
