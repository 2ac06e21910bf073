"""The forward chunk kernel (:mod:`gdp_jax.kernels.chunk_fwd_sm90`): its limits and its call.

One CTA per (value tile of BV state columns, head, row) walks that row's chunks in order
with the state in registers: Delta = u - w S, o = qg S + P Delta, S <- decay S + Kt^T Delta,
restarting from the sequence's initial state at ``reset`` chunks; it writes the output
rows, the final state of every sequence and, with ``ckpt`` > 0, the start state of every
ckpt-th chunk (the backward's checkpoints). The per-chunk start states never reach HBM.
"""
from __future__ import annotations

import functools
from typing import Optional

import jax.numpy as jnp

from gdp_jax.grid import CHUNK as C
from gdp_jax.grid import READOUT_ROWS
from gdp_jax.kernels import binding
from gdp_jax.kernels.chunk_prep import u_dtype
from gdp_jax.spec import Unsupported, checkpoint_dtype


# Opt-in (off): the recursion kernels (forward and reverse) split the state and Delta (dS
# and dDelta) into hi + lo bfloat16 parts for bfloat16 inputs. On the H200 at
# (8, 4096, 16, 2) the split costs 0.16 ms of the forward kernel's 0.85 and 0.23 ms of the
# reverse's 1.07 (benchmarks/prep_probe.py, s18-1). Off, o's error vs float64 on the GPU
# tests' ungated cases is 5.7-5.8e-3 instead of 4.6e-3, still below FLA's 6.6-7.0e-3 on
# the same inputs (benchmarks/peer_precision.py, s17-4): plain 16-bit operands, as FLA's.
BF16_SPLIT = False
# Value tiles of 16 columns for the recursion kernels where even 32-wide tiles leave SMs
# without a CTA (few rows x heads: one long sequence). Twice the walks, each with half the
# MMAs of a chunk; every CTA still loads the chunk's [C, K] operands (from L2: the value
# tiles of a head share them). Same bits as 32-wide tiles (GPU test). On: at
# (1, 65536, 16, 2) forward 7.81 -> 6.79 ms, fwd+bwd 26.56 -> 24.81 ms on the H200
# (benchmarks/results/CURRENT.md, s24).
NARROW_TILES = True
# Opt-in, NOT yet run on a GPU (s28: written and compiled for sm_90a; the device was not
# lent again): the recursion walks' operands one chunk ahead (``stages`` = 2 of the
# forward walk ``ChunkFwdSm90`` and the reverse ``ChunkBwdDhSm90``: a second set of
# operand tiles in shared memory, so one CTA an SM at most). "auto" where the launch has
# at most one CTA an SM anyway (few rows x heads: long sequences), True for every launch
# of value tiles <= 32 (A/B only), False never (the default until measured: the GPU test
# ``test_pipelined_walk_same_bits`` and ``bash benchmarks/run_gpu_measurements.sh 6``).
# Walks with two operand sets keep warp MMAs (:data:`GMMA`): the same bits as the warp-MMA
# walks; the reverse walk's sums then differ from the default's by float32 rounding.
PIPELINE = False
# Opt-in: a forward walk CTA of 8 warps walks two adjacent value tiles, its two 4-warp
# groups sharing one copy of each chunk's w, Kt, qg, P in shared memory (``pairs`` = 2 of
# ``ChunkFwdSm90``): half the operand loads of two one-tile CTAs, the same products in the
# same order (the same bits as the warp-MMA walks - tile pairs keep warp MMAs, :data:`GMMA`
# - GPU test ``test_pair_tiles_same_bits`` passes). True: every
# one-set walk with an even number of value tiles; False: never. Off: within noise (fwd
# 1.94 -> 1.93 ms at (8, 4096, 16, 2), 2.87 -> 2.84 at n = 3; H100, s32-1).
PAIR_TILES = False
# The forward walk's recursion products (w S, Kt^T Delta; qg S, P Delta on all rows) as
# Hopper warpgroup MMAs instead of ldmatrix + mma.sync (``gmma`` of ``ChunkFwdSm90``) - for
# walks of one operand set and one tile group without the hi + lo split (stages = pairs =
# 1, split off); other walks keep warp MMAs. The same bits as the warp MMAs (GPU test
# ``test_walk_gmma_matches``); the walk alone 0.738 -> 0.659 ms (BV = 64) and 1.167 ->
# 1.062 (BV = 16) at (8, 4096, 16, 2), forward at (1, 65536, 16, 2) 5.76 -> 5.28 ms
# (H100, s39-2: benchmarks/results/CURRENT.md). "all" (the default since s40): the
# read-out rows' o products too, on qg, P tiles of C rows (zeros past the read-out rows;
# the walk at BV = 64 then needs 240 registers instead of 255 and a 40-byte spill frame;
# the same bits - ``test_walk_gmma_matches[..forward-all]``); with the operands kernel's
# GMMA the forward 2.03 -> 1.82 ms at (8, 4096, 16, 2) (H100, s40-1). True: the read-out
# rows' o products on warp MMAs (``+wg``); False: every product on warp MMAs (``+mmaf``).
GMMA = "all"
# When on, the op's plain forward on token-major inputs gets o from the walk token-major,
# [B, T, HV, V] (``o_tokens`` of ``ChunkFwdSm90``: read-out row r of a chunk to token
# tok + r of the row table, NaN on the operands kernel's bad rows) - no XLA pass relaying
# [B, NC, HV, R, V] rows to tokens after the walk (0.086 ms of the 1.64 ms forward at
# (8, 4096, 16, 2), H100 trace s43). For wgmma walks whose o tiles hold C rows. "auto"
# (the default): walks of 64-column value tiles only (:func:`writes_o_tokens`): there
# the forward is 2-9% faster (1.08 -> 0.98, 1.67 -> 1.59, 2.46 -> 2.36 ms at
# (8, 4096, 16, n = 1, 2, 3)), while the narrower tiles of a launch with few rows x heads
# lose 2% (2.17 -> 2.22 at (2, 16384, 16, 2)) - each CTA's store then carries the row
# table for a quarter or half of the products (H100, s43-1: benchmarks/results/CURRENT.md).
O_TOKENS = "auto"


def writes_o_tokens(rows: int, HV: int, V: int) -> bool:
    """Does a plain forward walk of ``rows`` x ``HV`` heads on V value columns write o
    token-major under :data:`O_TOKENS` (True; False; "auto": where :meth:`pick_bv
    <ChunkForwardKernel.pick_bv>` takes 64-column tiles)? Any other value is refused."""
    return o_tokens_tile(ChunkForwardKernel.pick_bv(rows, HV, V))


def o_tokens_tile(BV: int) -> bool:
    """:data:`O_TOKENS`' rule for walks of value tiles of BV columns."""
    if O_TOKENS not in (True, False, "auto"):
        raise ValueError(f"chunk_forward.O_TOKENS={O_TOKENS!r}; expected True, False or "
                         f"'auto'")
    return O_TOKENS is True or (O_TOKENS == "auto" and BV == 64)


class ChunkForwardKernel:
    """Limits, tile choice and the (vmappable) call of the forward chunk kernel."""

    DTYPES = ("bfloat16", "float16")
    HEAD_DIMS = (64, 128)

    @staticmethod
    def can_implement(*, dtype, K: int, V: int, rows: int, NC: int, HV: int,
                      extra_columns: int = 0,
                      sequences: Optional[int] = None) -> Optional[Unsupported]:
        """None if the kernel runs these shapes, else why not. ``extra_columns``: state
        columns beyond V, as the CP summary walks run; those walks write only the
        per-sequence final states [``sequences`` (None: up to rows x NC), HV, K,
        V + extra_columns], no per-chunk tensor, so every per-chunk extent is V wide."""
        name = jnp.dtype(dtype).name
        if name == "float64":   # no kernel takes it (no float64 tensor cores): argument error
            return Unsupported("q has dtype float64 (k, v too); the cutedsl kernels take 16-bit "
                               "inputs (bfloat16/float16)", TypeError)
        dims = ChunkForwardKernel.HEAD_DIMS
        if K not in dims or V not in dims:
            return Unsupported(f"the cutedsl kernels support head dims K, V in {dims}; got "
                               f"K={K} (q, k), V={V} (v)")
        if name not in ChunkForwardKernel.DTYPES:
            return Unsupported(f"q has dtype {name} (k, v too); the cutedsl kernels take "
                               f"bfloat16/float16 inputs (16-bit tensor-core operands)")
        if binding.grid_limit(rows, HV):
            return Unsupported(binding.grid_limit(rows, HV))
        if rows * NC * HV * max(C * max(K, V, C), K * V) > binding.MAX_ELEMS:
            return Unsupported(f"{rows} rows x {NC} chunks x {HV} heads are too many for "
                               f"the kernel's 32-bit offsets")
        N = rows * NC if sequences is None else sequences
        if extra_columns and N * HV * K * (V + extra_columns) > binding.MAX_ELEMS:
            return Unsupported(f"{N} sequences x {HV} heads of [{K}, {V + extra_columns}] "
                               f"CP summary states are too many for the kernel's 32-bit "
                               f"offsets")
        return None

    # streaming multiprocessors of the GPUs the kernels target (tests patch this one)
    SMS = binding.SMS

    @staticmethod
    def pick_bv(rows: int, HV: int, V: int) -> int:
        """Value-tile width of the recursion kernels (forward and reverse): 64 when that
        still gives every SM a CTA, else 32 (twice the CTAs, for few rows x heads); 16 with
        :data:`NARROW_TILES` when 32 still leaves SMs idle.

        Both run two CTAs an SM (shared memory; registers). At BV = 32 every CTA re-reads
        the [C, K] operands of its chunk for a quarter of the state, and (8, 4096, 16, 2)
        makes 512 CTAs: two waves of 264. BV = 64 makes 256, one wave: forward 0.96 ->
        0.83 ms, reverse 1.17 -> 1.01 ms, kernels alone on the H200
        (benchmarks/prep_probe.py). Results are the same: the state's value columns are
        independent."""
        if V % 64 == 0 and rows * HV * (V // 64) >= ChunkForwardKernel.SMS:
            return 64
        if NARROW_TILES and rows * HV * (V // 32) < ChunkForwardKernel.SMS:
            return 16
        return 32

    @classmethod
    def pick_stages(cls, rows: int, HV: int, V: int, BV: int) -> int:
        """2 (operands loaded a chunk ahead) where :data:`PIPELINE` allows it for this
        launch of rows x HV x V / BV CTAs, else 1. The second operand set takes the
        shared memory of a second CTA, so "auto" uses it only where the launch gives no
        SM two CTAs; never at BV = 64 (its registers are full)."""
        if PIPELINE is False or BV > 32:
            return 1
        if PIPELINE is True:
            return 2
        if PIPELINE != "auto":
            raise ValueError(f"chunk_forward.PIPELINE={PIPELINE!r}; expected 'auto', True "
                             f"or False")
        return 2 if rows * HV * (V // BV) <= cls.SMS else 1

    @staticmethod
    def pick_pairs(V: int, BV: int, stages: int) -> int:
        """2 (a CTA walks two value tiles on one copy of the shared operands) where
        :data:`PAIR_TILES` is on, the walk has one operand set and an even number of
        value tiles; else 1."""
        if PAIR_TILES not in (True, False):
            raise ValueError(f"chunk_forward.PAIR_TILES={PAIR_TILES!r}; expected True or "
                             f"False")
        return 2 if PAIR_TILES and stages == 1 and (V // BV) % 2 == 0 else 1

    @classmethod
    def launch_bv(cls, rows_operand, state) -> int:
        """:meth:`pick_bv` for a launch: rows_operand [rows, NC, HV, C, K] as the kernel
        receives it, state [N, HV, K, V] (the walked columns)."""
        return cls.pick_bv(rows_operand.shape[0], rows_operand.shape[2], state.shape[-1])

    @staticmethod
    def resolve_gmma(gmma, default, *, stages: int, pairs: int, split: bool, kinds):
        """A walk's products as warpgroup MMAs (one of ``kinds``): ``gmma``, or None for
        ``default`` (a module's GMMA switch) where the walk can take them - one operand set,
        one value tile a CTA, no hi + lo split - and False where it cannot; an explicit
        value the walk cannot take, or a value not in ``kinds``, is a ValueError."""
        can = stages == 1 and pairs == 1 and not split
        if gmma is None:
            gmma = default if can else False
        if gmma not in kinds:
            raise ValueError(f"gmma: one of {kinds}; got {gmma!r}")
        if gmma and not can:
            raise ValueError(f"gmma (warpgroup MMAs) needs stages=1, pairs=1, split=False; "
                             f"got stages={stages}, pairs={pairs}, split={split}")
        return gmma

    @staticmethod
    def default_split(dtype) -> bool:
        """Split the recurrent operands into hi + lo parts for bfloat16 (8-bit mantissa)
        while ``BF16_SPLIT`` is on; float16 (11-bit) is accurate enough without."""
        return BF16_SPLIT and jnp.dtype(dtype) == jnp.dtype(jnp.bfloat16)

    @staticmethod
    def num_checkpoints(NC: int, ckpt: int) -> int:
        """Chunk-state checkpoints kept for ``ckpt`` = recompute_chunk_num + 1 (0: none)."""
        return -(-NC // ckpt) if ckpt > 0 else 0

    @classmethod
    def call(cls, w, kt, qg, p, u, decay, reset, seq, last, h0, *, BV: Optional[int] = None,
             split: Optional[bool] = None, ckpt: int = 0, states_dtype=jnp.float32,
             readout: bool = True, o_tokens: Optional[tuple] = None):
        """:meth:`raw_call`, ``jax.vmap``-able. ``BV`` None: :meth:`pick_bv` for the rows
        of the launch, after ``jax.vmap`` (or ``intra_cp``'s segments) folded into them.
        ``o_tokens``: (rows, bad, T), as :meth:`raw_call`'s."""
        extra = tuple(o_tokens[:2]) if o_tokens is not None else ()

        def launch(*a):
            bv = BV or cls.launch_bv(a[0], a[9])
            kw = {}
            if o_tokens is not None:
                kw["o_tokens"] = (a[10], a[11], o_tokens[2])
            stages = 1 if kw else cls.pick_stages(a[0].shape[0], a[0].shape[2],
                                                  a[9].shape[-1], bv)
            pairs = 1 if kw else cls.pick_pairs(a[9].shape[-1], bv, stages)
            return cls.raw_call(*a[:10], BV=bv, split=split, ckpt=ckpt,
                                states_dtype=states_dtype, readout=readout, stages=stages,
                                **({"pairs": 2} if pairs == 2 else {}), **kw)

        f = binding.vmappable(
            launch,
            seq_arg=7, table_arg=9, out_kinds=("rows" if readout else "dummy", "rows",
                                               "rows" if ckpt else "dummy"))
        return f(w, kt, qg, p, u, decay, reset, seq, last, h0, *extra)

    @staticmethod
    def raw_call(w, kt, qg, p, u, decay, reset, seq, last, h0, *, BV: int,
                 split: Optional[bool] = None, ckpt: int = 0, states_dtype=jnp.float32,
                 readout: bool = True, stages: int = 1, pairs: int = 1, gmma=None,
                 o_tokens: Optional[tuple] = None):
        """Per-chunk operands -> (o rows [B, NC, HV, R, V], final [N, HV, K, V], states
        [B, ceil(NC / ckpt), HV, K, V] in ``states_dtype`` (float32 or the operand dtype),
        or a [1] float32 placeholder when ckpt = 0). ``readout=False``: the walk alone (qg,
        p are not read; o is a [1] placeholder): the CP pass's summary walk.

        w, kt: [B, NC, HV, C, K]; qg: [B, NC, HV, R, K], p: [B, NC, HV, R, C] (16-bit, one
        dtype) with R = C, or R = ``READOUT_ROWS`` (32) rows holding the read-out rows
        n - 1, 2n - 1, .. of each chunk (n >= 2; padding after them): o then has those
        rows, with the same bits as the matching rows of R = C; u: [B, NC, HV, C, Vu] in
        float32 or the 16-bit dtype (``chunk_prep.u_dtype``), the first Vu <= V state
        columns' (the rest take u = 0: the CP pass's response columns; Vu a multiple of
        BV); decay: [B, NC, HV] float32;
        reset, seq, last: [B, NC] int32; h0: [N, HV, K, V] float32 (V: the state columns
        walked). Final rows of sequences without a last chunk are left unwritten.
        ``states`` holds the start state of chunks 0, ckpt, 2 ckpt, ... ``stages`` = 2:
        the next chunk's operands load while a chunk computes (:meth:`pick_stages`; the
        same results). ``pairs`` = 2: a CTA walks two value tiles (:meth:`pick_pairs`; the
        same results). ``gmma``: the recursion's products as warpgroup MMAs, "all" with
        the read-out rows' o products too (None: :data:`GMMA`, where the walk allows it;
        an explicit one where it does not is a ValueError). ``o_tokens`` (rows, bad, T): o
        comes back token-major, [B, T, HV, V] - the read-out rows' outputs at their tokens
        (rows [B, NC, 4] int32 the row table, ``chunk_prep.token_rows``; bad
        [B, NC, HV, C] int32 the operands kernel's rows whose outputs are NaN) - for a
        wgmma walk whose o tiles hold C rows (R = C at n = 1, or the read-out rows under
        ``GMMA = "all"``); stages = pairs = 1.
        """
        B, NC, HV, C_, K = w.shape
        if o_tokens is not None:
            rows, bad, T = o_tokens
            if rows.shape != (B, NC, 4) or rows.dtype != jnp.int32:
                raise ValueError(f"o_tokens: rows must be int32 {(B, NC, 4)}; got "
                                 f"{rows.dtype} {rows.shape}")
            if bad.shape != (B, NC, HV, C_) or bad.dtype != jnp.int32:
                raise ValueError(f"o_tokens: bad must be int32 {(B, NC, HV, C_)}; got "
                                 f"{bad.dtype} {bad.shape}")
            if not readout or stages != 1 or pairs != 1:
                raise ValueError(f"o_tokens: a readout walk with stages=1, pairs=1; got "
                                 f"readout={readout}, stages={stages}, pairs={pairs}")
        V, Vu = h0.shape[-1], u.shape[-1]
        if pairs not in (1, 2) or (pairs == 2 and (stages != 1 or (V // BV) % 2)):
            raise ValueError(f"pairs={pairs}: 1, or 2 for a one-set walk (stages=1, got "
                             f"{stages}) of an even number of value tiles (V={V}, BV={BV})")
        if Vu > V or Vu % BV:
            raise ValueError(f"u has shape {u.shape}; expected at most the {V} state columns "
                             f"of h0 {h0.shape}, a multiple of BV={BV}")
        R = qg.shape[-2] if readout else C_
        if R != C_ and (R != READOUT_ROWS or p.shape[-2:] != (R, C_)):
            raise ValueError(f"qg {qg.shape}, p {p.shape}: expected {C_} rows a chunk, or "
                             f"{READOUT_ROWS} read-out rows")
        ab_name = jnp.dtype(w.dtype).name
        split = ChunkForwardKernel.default_split(w.dtype) if split is None else bool(split)
        gmma = ChunkForwardKernel.resolve_gmma(gmma, GMMA, stages=stages, pairs=pairs,
                                               split=split, kinds=(False, True, "all"))
        n_ckpt = ChunkForwardKernel.num_checkpoints(NC, ckpt)
        states_dtype = jnp.dtype(states_dtype) if ckpt else jnp.dtype(jnp.float32)
        if states_dtype.name not in ("float32", ab_name):
            raise ValueError(f"states_dtype must be float32 or {ab_name}; got {states_dtype}")
        if o_tokens is not None and not (gmma == "all" or (gmma and R == C_)):
            raise ValueError(f"o_tokens: a walk whose o tiles hold C rows on warpgroup MMAs "
                             f"(gmma 'all', or True with all {C_} rows); got gmma={gmma!r} "
                             f"with {R} rows")
        o_shape = (B, NC, HV, R, V)
        if o_tokens is not None:
            o_shape = (B, o_tokens[2], HV, V)
        outputs = (binding.out(o_shape if readout else (1,), w.dtype),
                   binding.out(h0.shape, jnp.float32),
                   binding.out((B, n_ckpt, HV, K, V) if ckpt else (1,), states_dtype))
        args = (w, kt, qg, p, u, decay, reset, seq, last, h0)
        tile_dims = (2, 2, 2, 2, 2, 0, 0, 0, 0, 2)
        launcher, name, tables = _launcher, "gdp_chunk_fwd_sm90", {}
        if o_tokens is not None:
            # the row table and the bad rows
            args += tuple(o_tokens[:2])
            tile_dims += (1, 1)
            launcher, name = _launcher_rows, "gdp_chunk_fwd_sm90_rows"
            tables = dict(o_tokens=True)
        return binding.custom_call(launcher, name, outputs, args,
                                   tile_dims=tile_dims + (
                                       2 if readout and o_tokens is None else 1, 2,
                                       2 if ckpt else 1),
                                   key=(states_dtype.name,), K=K, V=V, BV=BV,
                                   ab_name=ab_name, split=split, ckpt=ckpt,
                                   readout=bool(readout), u_cols=Vu if Vu < V else 0,
                                   stages=int(stages),
                                   **({"rows": R} if R != C_ else {}),
                                   **({"pairs": 2} if pairs == 2 else {}),
                                   **({"gmma": True} if gmma else {}),
                                   **({"gmma_rows": True} if gmma == "all" and R < C_
                                      else {}), **tables)

    @classmethod
    def variants(cls, recompute_chunk_nums=(0,)):
        """The variants the cutedsl engine runs (``ffi/build.py`` prebuilds them): per
        dtype and head dims, the forward alone (ckpt 0), under differentiation (with the
        checkpoints of each ``recompute_chunk_nums``) and the CP rank's pass on V + K
        columns (u on the first V), the summary walk; each with every value tile
        ``pick_bv`` picks (64 for calls that fill the GPU, 32 for few rows x heads, 16 for
        fewer)."""
        from gdp_jax.kernels import aot
        out = []
        for name in cls.DTYPES:
            for K in cls.HEAD_DIMS:
                for V in cls.HEAD_DIMS:
                    # (state columns, ckpt, readout); a forward that nothing
                    # differentiates keeps no checkpoints
                    runs = ([(V, 0, True)] + [(V, r + 1, True) for r in recompute_chunk_nums]
                            + [(V + K, 0, False)])
                    for (Vx, ckpt, readout) in runs:
                        for BV in cls.value_tiles(Vx):
                            for stages in cls.stage_counts(Vx, BV):
                                fn = functools.partial(cls.raw_call, BV=BV, ckpt=ckpt,
                                                       states_dtype=checkpoint_dtype(name),
                                                       readout=readout, stages=stages)
                                out.append(aot.Variant(
                                    f"gdp_chunk_fwd_sm90 {name} K={K} V={Vx} ckpt={ckpt}"
                                    + ("" if readout else " summary") + f" BV={BV}"
                                    + (" stages=2" if stages == 2 else ""),
                                    fn, _avals(name, K, Vx, u_cols=V)))
                    # the forward on the read-out rows (n >= 2), alone or differentiated
                    for ckpt in [0] + [r + 1 for r in recompute_chunk_nums]:
                        for BV in cls.value_tiles(V):
                            for stages in cls.stage_counts(V, BV):
                                fn = functools.partial(cls.raw_call, BV=BV, stages=stages,
                                                       ckpt=ckpt,
                                                       states_dtype=checkpoint_dtype(name))
                                out.append(aot.Variant(
                                    f"gdp_chunk_fwd_sm90 {name} K={K} V={V} ckpt={ckpt} "
                                    f"BV={BV} rows={READOUT_ROWS}"
                                    + (" stages=2" if stages == 2 else ""),
                                    fn, _avals(name, K, V, rows=READOUT_ROWS)))
                    # O_TOKENS: the plain forward writing o token-major, all rows and the
                    # read-out rows, on the value tiles it applies to ("auto": 64 only)
                    o_tiles = [BV for BV in cls.value_tiles(V) if o_tokens_tile(BV)]
                    for rows in (C, READOUT_ROWS) if o_tiles else ():
                        for BV in o_tiles:
                            fn = functools.partial(cls._rows_call, BV=BV)
                            out.append(aot.Variant(
                                f"gdp_chunk_fwd_sm90_rows {name} K={K} V={V} ckpt=0 "
                                f"BV={BV}" + (f" rows={rows}" if rows < C else "")
                                + " o_tokens",
                                fn, _avals(name, K, V, rows=rows, tokens=True)))
        return out

    @classmethod
    def _rows_call(cls, *a, BV: int):
        """:meth:`raw_call` as the plain forward runs it under :data:`O_TOKENS`
        (``_avals(.., tokens=True)``'s operands: the row table, the bad rows; o for T = 1
        token)."""
        return cls.raw_call(*a[:10], BV=BV, o_tokens=(a[10], a[11], 1))

    @classmethod
    def stage_counts(cls, V: int, BV: int):
        """Every stage count :meth:`pick_stages` may pick for value tiles of BV on V
        state columns."""
        return sorted({cls.pick_stages(r, 1, V, BV) for r in (1, cls.SMS * BV)})

    @classmethod
    def value_tiles(cls, V: int):
        """Every value tile :meth:`pick_bv` may pick for V state columns."""
        rows = (1, -(-cls.SMS // max(V // 32, 1)), cls.SMS)   # each width's smallest call
        return sorted({cls.pick_bv(r, 1, V) for r in rows})


def _avals(dtype, K, V, u_cols=None, rows=C, tokens=False):
    """The kernel's operands at the canonical shape (one row, chunk, head, sequence), on V
    state columns (u on the first ``u_cols``; None: all), qg and p on ``rows`` rows;
    ``tokens``: the row table and the bad rows after h0 (o written token-major)."""
    import jax
    S = lambda shape, dt: jax.ShapeDtypeStruct(shape, jnp.dtype(dt))
    f32, i32 = jnp.float32, jnp.int32
    if tokens:
        return _avals(dtype, K, V, u_cols, rows) + (S((1, 1, 4), i32), S((1, 1, 1, C), i32))
    return ((S((1, 1, 1, C, K), dtype),) * 2 + (S((1, 1, 1, rows, K), dtype),
            S((1, 1, 1, rows, C), dtype),
            S((1, 1, 1, C, u_cols or V), u_dtype(dtype)), S((1, 1, 1), f32))
            + (S((1, 1), i32),) * 3
            + (S((1, 1, K, V), f32),))


@functools.lru_cache(maxsize=None)
def _launcher_rows():
    """:func:`_launcher` with the row table and the operands kernel's ``bad`` rows: o
    written token-major (``o_tokens``)."""
    binding.import_cutlass()
    import cutlass
    import cutlass.cute as cute
    from gdp_jax.kernels import chunk_fwd_sm90 as mod

    @cute.jit
    def launch(stream, w, kt, qg, p, u, decay, reset, seq, last, h0, table, bad, o,
               final, states, *, K: cutlass.Constexpr, V: cutlass.Constexpr,
               BV: cutlass.Constexpr, ab_name: cutlass.Constexpr, split: cutlass.Constexpr,
               ckpt: cutlass.Constexpr, readout: cutlass.Constexpr,
               u_cols: cutlass.Constexpr, stages: cutlass.Constexpr,
               rows: cutlass.Constexpr = C, gmma: cutlass.Constexpr = False,
               gmma_rows: cutlass.Constexpr = False, o_tokens: cutlass.Constexpr = False):
        mod.get_kernel(K, V, BV, ab_name, split, ckpt, readout, u_cols, stages, rows,
                       1, gmma, gmma_rows, o_tokens)(
            stream, w, kt, qg, p, u, decay, reset, seq, last, h0, o, final, states, table,
            bad)

    return launch


@functools.lru_cache(maxsize=None)
def _launcher():
    binding.import_cutlass()
    import cutlass
    import cutlass.cute as cute
    from gdp_jax.kernels import chunk_fwd_sm90 as mod

    @cute.jit
    def launch(stream, w, kt, qg, p, u, decay, reset, seq, last, h0, o, final, states, *,
               K: cutlass.Constexpr, V: cutlass.Constexpr, BV: cutlass.Constexpr,
               ab_name: cutlass.Constexpr, split: cutlass.Constexpr,
               ckpt: cutlass.Constexpr, readout: cutlass.Constexpr,
               u_cols: cutlass.Constexpr, stages: cutlass.Constexpr,
               rows: cutlass.Constexpr = C, pairs: cutlass.Constexpr = 1,
               gmma: cutlass.Constexpr = False, gmma_rows: cutlass.Constexpr = False):
        mod.get_kernel(K, V, BV, ab_name, split, ckpt, readout, u_cols, stages, rows,
                       pairs, gmma, gmma_rows)(
            stream, w, kt, qg, p, u, decay, reset, seq, last, h0, o, final, states)

    return launch
