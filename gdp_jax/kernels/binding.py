"""Binding CuTe DSL kernels to XLA: the one place that calls ``cutlass_call``.

What every kernel call needs, done once here:

- the CuTe DSL import (lazy; ``CUTE_DSL_ARCH=sm_90a`` so a host without a GPU compiles for
  Hopper instead of the DSL's sm_100a default);
- compile keys that include a hash of the device sources (``kernels/*_sm90.py`` and
  ``kernels/sm90.py``): editing a kernel can never reuse a stale binary in one process;
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

import jax
import jax.numpy as jnp
from jax import custom_batching

from gdp_jax import _vma

MAX_ELEMS = 2 ** 31 - 1      # the kernels index with 32-bit offsets (static layouts)
_HERE = pathlib.Path(__file__).resolve().parent


@functools.lru_cache(maxsize=None)
def import_cutlass():
    """Import the CuTe DSL once (ImportError or the DSL's own load error if it cannot)."""
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
    import cutlass  # noqa: F401
    import cutlass.cute  # noqa: F401
    import cutlass.jax  # noqa: F401
    return cutlass


def cutlass_importable() -> tuple[bool, str]:
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


def custom_call(launch, name: str, outputs, args, *, key=(), aliases=None, **constexprs):
    """Run ``launch`` (a ``cute.jit`` function of (stream, *args, *outputs)) as an XLA
    custom call on ``args``; returns the results typed like ``outputs``
    (``jax.ShapeDtypeStruct``s), with the operands' varying mesh axes.

    ``key``: everything besides shapes that selects the compiled variant; ``aliases``:
    {input index: output index} buffers updated in place; ``constexprs``: the launcher's
    compile-time keyword arguments.
    """
    import_cutlass()
    import cutlass.jax as cjax

    shapes = tuple((tuple(a.shape), jnp.dtype(a.dtype).name) for a in args)
    call = cjax.cutlass_call(
        launch,
        output_shape_dtype=outputs,
        input_output_aliases=aliases or {},
        use_static_tensors=True,
        compile_key=(name, device_source_hash(), shapes, tuple(key),
                     tuple(sorted(constexprs.items()))),
        **constexprs,
    )
    return _vma.like(call(*args), args)


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
