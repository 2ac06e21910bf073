"""The reverse state-gradient kernel (:mod:`gdp_jax.kernels.chunk_bwd_sm90`): limits, call.

One CTA per (value tile, head, row) walks that row's chunks backwards with dS in
registers (dS does not depend on S): dS_end = carry (+ dfinal on a sequence's last chunk),
dDelta = ddo + Kt dS_end, dS_start = decay dS_end + qg^T dO - w^T dDelta, restarting at
``reset`` chunks. It writes dS_end of every chunk (unless ``write_ds=False``: a CP
summary, the start-state gradients alone) and the initial-state gradients.
ddo = P^T dO comes in (float32), or with ``fuse_ddo`` the kernel forms it from the
readout matrix P (16-bit [C, C]) and dO itself.
"""
from __future__ import annotations

import functools
from typing import Optional

import jax.numpy as jnp

from gdp_jax import grid
from gdp_jax.grid import CHUNK, READOUT_ROWS
from gdp_jax.kernels import binding
from gdp_jax.kernels.chunk_forward import ChunkForwardKernel

# The reverse walk's products (Kt dS, P^T dO; w^T dDelta, qg^T dO) as Hopper warpgroup
# MMAs instead of ldmatrix + mma.sync (``gmma`` of ``ChunkBwdDhSm90``; the forward walk's
# ``chunk_forward.GMMA``) - for walks of one operand set and one value tile without the
# hi + lo split; other walks keep warp MMAs. Gradients within ~1e-4 relative of the warp
# MMAs' (another summation order) and as far from float64 (GPU test
# ``test_walk_gmma_matches``); the walk alone (ddo formed inside) 0.929 -> 0.842 ms
# (BV = 64), 1.386 -> 1.237 (BV = 16) at (8, 4096, 16, 2) (H100, s39-2:
# benchmarks/results/CURRENT.md). False: warp MMAs (``+mmab``).
GMMA = True

class StateGradKernel:
    """Limits and the (vmappable) call of the reverse state-gradient kernel."""

    @staticmethod
    def can_implement(*, dtype, K: int, V: int, rows: int, NC: int, HV: int,
                      extra_columns: int = 0, sequences: Optional[int] = None):
        """The forward kernel's limits: the same operands, tiles and 32-bit offsets."""
        return ChunkForwardKernel.can_implement(dtype=dtype, K=K, V=V, rows=rows, NC=NC,
                                                HV=HV, extra_columns=extra_columns,
                                                sequences=sequences)

    @classmethod
    def call(cls, kt, w, qg, ddo, do, decay, reset, seq, last, dfinal, *,
             BV: Optional[int] = None, split: Optional[bool] = None, ds_dtype=None,
             fuse_ddo: bool = False, write_ds: bool = True):
        """:meth:`raw_call`, ``jax.vmap``-able. ``BV`` None: the forward's tile choice for
        the rows of the launch (``ChunkForwardKernel.launch_bv``)."""
        def launch(*a):
            bv = BV or ChunkForwardKernel.launch_bv(a[0], a[9])
            stages, pairs = 1, 1                # qg on the read-out rows: one set, one tile
            if a[2].shape[-2] == a[0].shape[-2]:
                stages = ChunkForwardKernel.pick_stages(a[0].shape[0], a[0].shape[2],
                                                        a[9].shape[-1], bv)
                pairs = ChunkForwardKernel.pick_pairs(a[9].shape[-1], bv, stages)
            return cls.raw_call(*a, BV=bv, split=split, ds_dtype=ds_dtype, fuse_ddo=fuse_ddo,
                                write_ds=write_ds, stages=stages,
                                **({"pairs": 2} if pairs == 2 else {}))

        f = binding.vmappable(launch, seq_arg=7, table_arg=9,
                              out_kinds=("rows" if write_ds else "dummy", "rows"))
        return f(kt, w, qg, ddo, do, decay, reset, seq, last, dfinal)

    @staticmethod
    def raw_call(kt, w, qg, ddo, do, decay, reset, seq, last, dfinal, *, BV: int,
                 split: Optional[bool] = None, ds_dtype=None, fuse_ddo: bool = False,
                 write_ds: bool = True, stages: int = 1, pairs: int = 1, gmma=None):
        """-> (dS_end [B, NC, HV, K, V] in ``ds_dtype`` (None: float32, the accumulator;
        or the operands' 16-bit dtype: what the local-gradient kernel rounds it to for its
        MMAs anyway) - a [1] placeholder with ``write_ds=False`` (the walk for dh0 alone) -,
        dh0 [N, HV, K, V] float32).

        kt, w, qg: [B, NC, HV, C, K] and do: [B, NC, HV, C, Vo] in one 16-bit dtype; ddo:
        [B, NC, HV, C, Vo] float32, or with ``fuse_ddo`` the readout matrix P
        [B, NC, HV, C, C] in the 16-bit dtype (ddo = P^T dO is formed in the kernel);
        decay: [B, NC, HV] float32; reset, seq, last: [B, NC] int32; dfinal: [N, HV, K, V]
        float32 (V: the state columns walked; dO and ddo hold the first Vo <= V of them, a
        multiple of BV, and are 0 in the rest: the CP pass's response columns). Rows of dh0
        for sequences without chunks stay unwritten. ``stages`` = 2: the next chunk's
        operands load while a chunk computes (``ChunkForwardKernel.pick_stages``; the same
        results). ``pairs`` = 2: a CTA walks two value tiles
        (``ChunkForwardKernel.pick_pairs``; the same results). ``gmma``: the products as
        warpgroup MMAs (None: :data:`GMMA` where the walk allows it - stages = pairs = 1,
        no split; True where it does not is a ValueError).
        """
        B, NC, HV, C, K = kt.shape
        V, Vo = dfinal.shape[-1], do.shape[-1]
        R = qg.shape[-2]
        if R not in (C, READOUT_ROWS) or do.shape[-2] != R:
            raise ValueError(f"qg {qg.shape}, do {do.shape}: expected {C} rows a chunk, or "
                             f"{READOUT_ROWS} read-out rows, the same for both")
        if R != C and (stages != 1 or pairs != 1):
            raise ValueError(f"the read-out rows (qg {qg.shape}) take one operand set and one "
                             f"value tile a CTA; got stages={stages}, pairs={pairs}")
        if pairs not in (1, 2) or (pairs == 2 and (stages != 1 or (V // BV) % 2)):
            raise ValueError(f"pairs={pairs}: 1, or 2 for a one-set walk (stages=1, got "
                             f"{stages}) of an even number of value tiles (V={V}, BV={BV})")
        if Vo > V or Vo % BV:
            raise ValueError(f"do has shape {do.shape}; expected at most the {V} state "
                             f"columns of dfinal {dfinal.shape}, a multiple of BV={BV}")
        ab_name = jnp.dtype(kt.dtype).name
        want = ((B, NC, HV, R, C), kt.dtype) if fuse_ddo else ((B, NC, HV, C, Vo), jnp.float32)
        if (ddo.shape, jnp.dtype(ddo.dtype)) != (want[0], jnp.dtype(want[1])):
            raise ValueError(f"{'P' if fuse_ddo else 'ddo'}: expected {jnp.dtype(want[1]).name}"
                             f" {want[0]}; got {jnp.dtype(ddo.dtype).name} {ddo.shape}")
        split = ChunkForwardKernel.default_split(kt.dtype) if split is None else bool(split)
        gmma = ChunkForwardKernel.resolve_gmma(gmma, GMMA, stages=stages, pairs=pairs,
                                               split=split, kinds=(False, True))
        ds_dtype = jnp.dtype(jnp.float32 if ds_dtype is None else ds_dtype)
        if ds_dtype not in (jnp.dtype(jnp.float32), jnp.dtype(kt.dtype)):
            raise ValueError(f"ds_dtype: float32 or the operands' {jnp.dtype(kt.dtype).name}; "
                             f"got {ds_dtype.name}")
        outputs = (binding.out((B, NC, HV, K, V) if write_ds else (1,), ds_dtype),
                   binding.out(dfinal.shape, jnp.float32))
        return binding.custom_call(_launcher, "gdp_chunk_bwd_dh_sm90", outputs,
                                   (kt, w, qg, ddo, do, decay, reset, seq, last, dfinal),
                                   tile_dims=(2, 2, 2, 2, 2, 0, 0, 0, 0, 2,
                                              2 if write_ds else 1, 2),
                                   K=K, V=V, BV=BV, ab_name=ab_name, split=split,
                                   **({"fuse_ddo": True} if fuse_ddo else {}),
                                   **({"do_cols": Vo} if Vo < V else {}),
                                   **({} if write_ds else {"write_ds": False}),
                                   **({"stages": 2} if stages == 2 else {}),
                                   **({"pairs": 2} if pairs == 2 else {}),
                                   **({"rows": R} if R != C else {}),
                                   **({"gmma": True} if gmma else {}))

    @classmethod
    def variants(cls):
        """The variants the cutedsl engine runs: per dtype and head dims, the backward
        (dS_end in the 16-bit dtype for the local-gradient kernel, float32 for the XLA
        local gradients) and the CP pass's summary walk on V + K columns (dO on the first
        V; no dS_end); ddo formed in the kernel or read; the value tiles as the forward's
        (``ChunkForwardKernel.value_tiles``)."""
        from gdp_jax.kernels import aot
        out = []
        for name in ChunkForwardKernel.DTYPES:
            for K in ChunkForwardKernel.HEAD_DIMS:
                for V in ChunkForwardKernel.HEAD_DIMS:
                    # (state columns, dS_end dtype or None: not written, fused ddo)
                    runs = [(V, name, True), (V, name, False), (V, "float32", False),
                            (V + K, None, True), (V + K, None, False)]
                    for Vx, ds, fused in runs:
                        for BV in ChunkForwardKernel.value_tiles(Vx):
                            for stages in ChunkForwardKernel.stage_counts(Vx, BV):
                                fn = functools.partial(cls.raw_call, BV=BV, ds_dtype=ds,
                                                       fuse_ddo=fused, write_ds=ds is not None,
                                                       stages=stages)
                                out.append(aot.Variant(
                                    f"gdp_chunk_bwd_dh_sm90 {name} K={K} V={Vx} "
                                    + (f"dS_end {ds}" if ds else "summary")
                                    + (" fused ddo" if fused else "") + f" BV={BV}"
                                    + (" stages=2" if stages == 2 else ""),
                                    fn, _avals(name, K, Vx, fused, do_cols=V)))
                        if fused:       # qg, P, dO on the read-out rows (READOUT_ONLY_BWD)
                            for BV in ChunkForwardKernel.value_tiles(Vx):
                                fn = functools.partial(cls.raw_call, BV=BV, ds_dtype=ds,
                                                       fuse_ddo=True, write_ds=ds is not None)
                                out.append(aot.Variant(
                                    f"gdp_chunk_bwd_dh_sm90 {name} K={K} V={Vx} "
                                    + (f"dS_end {ds}" if ds else "summary")
                                    + f" fused ddo BV={BV} rows={READOUT_ROWS}",
                                    fn, _avals(name, K, Vx, True, do_cols=V,
                                               rows=READOUT_ROWS)))
        return out


def _avals(dtype, K, V, fuse_ddo=False, do_cols=None, rows=None):
    """(kt, w, qg, ddo or P, do, decay, reset, seq, last, dfinal) at the canonical shape,
    on V state columns (dO, ddo on the first ``do_cols``; None: all); qg, P, dO on
    ``rows`` rows a chunk (None: all C)."""
    import jax
    S = lambda shape, dt: jax.ShapeDtypeStruct(shape, jnp.dtype(dt))
    C, f32, i32 = grid.CHUNK, jnp.float32, jnp.int32
    Vo, R = do_cols or V, rows or C
    ddo = S((1, 1, 1, R, C), dtype) if fuse_ddo else S((1, 1, 1, C, Vo), f32)
    return ((S((1, 1, 1, C, K), dtype),) * 2 + (S((1, 1, 1, R, K), dtype), ddo,
            S((1, 1, 1, R, Vo), dtype), S((1, 1, 1), f32)) + (S((1, 1), i32),) * 3
            + (S((1, 1, K, V), f32),))


@functools.lru_cache(maxsize=None)
def _launcher():
    binding.import_cutlass()
    import cutlass
    import cutlass.cute as cute
    from gdp_jax.kernels import chunk_bwd_sm90 as mod

    @cute.jit
    def launch(stream, kt, w, qg, ddo, do, decay, reset, seq, last, dfinal, ds_end, dh0, *,
               K: cutlass.Constexpr, V: cutlass.Constexpr, BV: cutlass.Constexpr,
               ab_name: cutlass.Constexpr, split: cutlass.Constexpr,
               fuse_ddo: cutlass.Constexpr = False, do_cols: cutlass.Constexpr = 0,
               write_ds: cutlass.Constexpr = True, stages: cutlass.Constexpr = 1,
               pairs: cutlass.Constexpr = 1, rows: cutlass.Constexpr = CHUNK,
               gmma: cutlass.Constexpr = False):
        mod.get_kernel(K, V, BV, ab_name, split, fuse_ddo, do_cols, write_ds, stages,
                       pairs, rows, gmma)(
            stream, kt, w, qg, ddo, do, decay, reset, seq, last, dfinal, ds_end, dh0)

    return launch
