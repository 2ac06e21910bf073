"""``jax.vmap`` for the kernel custom calls: fold the mapped axis into the batch axis.

``cutlass_call`` has no batching rule. The kernels already run one CTA per (value tile,
head, batch row) and look up per-sequence tables (initial states, final-state
cotangents) through a ``seq`` [B, NC] index, so M mapped problems are one problem with
M * B rows: chunk tensors [M, B, ...] -> [M B, ...], table [M, N, ...] -> [M N, ...],
``seq`` += m N. Unmapped arguments are broadcast first. Nested vmaps fold again.
"""
from __future__ import annotations

import jax.numpy as jnp
from jax import custom_batching

_MAX_ELEMS = 2 ** 31 - 1


def fold_mapped_axis(call, *, seq_arg: int, table_arg: int, out_kinds):
    """``call(*args)`` made vmappable.

    args: chunk tensors with a leading batch axis B, ``args[seq_arg]`` the int32 [B, NC]
    sequence index into ``args[table_arg]`` [N, ...] (both None: every argument is rows).
    ``out_kinds``: per output, "rows" (leading axis B or N: unfolded back to [M, ...]) or
    "dummy" (a placeholder: broadcast).
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
        if max(a.size for a in flat) > _MAX_ELEMS:
            raise ValueError(f"jax.vmap over {M} problems makes the cutedsl kernels' inputs "
                             "too large for their 32-bit offsets; map in smaller groups "
                             "(jax.lax.map) or use backend='xla'")
        outs = f(*flat)
        res = tuple(jnp.broadcast_to(o, (M,) + o.shape) if kind == "dummy"
                    else o.reshape((M, o.shape[0] // M) + o.shape[1:])
                    for o, kind in zip(outs, out_kinds))
        return res, (True,) * len(res)

    return f
