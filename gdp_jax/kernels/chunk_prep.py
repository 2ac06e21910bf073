"""The forward-operands kernel (:mod:`gdp_jax.kernels.chunk_prep_sm90`): limits and call.

One pass per chunk, all chunks in parallel: chunk inputs -> the forward chunk kernel's
operands with the causal masking already applied, i.e. what
``pipeline.causal_operands(pipeline.forward_operands(ch, scale, ab_dtype))`` returns for
the chunk inputs with q, k, v rounded to the 16-bit operand dtype: ((w, kt, qg, p, u,
decay), bad). Replaces the XLA pipeline of the cutedsl forward (gate cumsums, decay
matrices, K K^T, the WY inverse, w, u, P, Kt, qg, casts, row masking) with one read of
the chunk inputs and one write of the operands.

The kernel reads q, k, v in the operand dtype, either chunk-major
(:meth:`ChunkPrepKernel.call`: XLA lays out the chunk inputs, its cast fusing into that
relayout, so they cross HBM at 16 bits) or straight from the op's token-major 16-bit
tensors (:meth:`ChunkPrepKernel.call_tokens`: a row table says where each chunk's rows
start, and the kernel applies the in-op L2 norm itself). Either way the normalised q, k
are rounded to 16 bits once, as FLA's kernels do; every later step keeps float32 (see
``chunk_prep_sm90``). The readout scale is a run-time input, so one object serves every
scale.
"""
from __future__ import annotations

import functools
from typing import Optional

import jax.numpy as jnp

from gdp_jax import grid
from gdp_jax.grid import CHUNK as C
from gdp_jax.kernels import binding
from gdp_jax.spec import Unsupported


# The forward reads q, k, v from the op's token-major inputs (16-bit ones; the L2 norm
# in the kernel) instead of their chunk-major copies laid out by XLA (False: the latter,
# an A/B switch).
TOKEN_LAYOUT = True

# u = X diag(beta) v, the [C, V] operand of the forward walk and of the local-gradient
# kernel, in bfloat16 when the operands are (as FLA keeps it) instead of float32: 16 KB
# less to write and to read back a chunk at V = 128, in the forward and again in the
# backward. Off: measured no faster (the kernels are latency-bound), less precise (the
# op's check 0.0046 -> 0.0047, o 4.1e-3 -> 4.4e-3, dq 4.0e-3 -> 4.4e-3; dg ~3x worse with
# strong gates in an emulated CPU test), 10% less peak memory (2.58 -> 2.31 GB) at
# (8, 4096, 16, 2) (H100, s35-3: benchmarks/results/CURRENT.md). float16 operands keep a
# float32 u either way: |u| may pass float16's 65504 where the inputs fit (X reaches ~1e2
# at beta ~ 2). The kernels take either dtype. "forward": only in the plain forward's
# operands on token-major inputs (nothing differentiates them: no gradient sees u's
# rounding), u in float32 under differentiation.
U16 = False
# The operands kernel's products - K K^T, Q K^T (phase 2) and w, u from X's hi + lo parts
# in registers (phase 4) - as Hopper warpgroup MMAs instead of ldmatrix + mma.sync
# (``gmma`` of ``ChunkPrepSm90``), in the warp MMAs' order: the same bits (GPU test
# ``test_operands_gmma_same_bits``), 5-6 KB less code a variant and no spills. With the
# forward walk's GMMA "all": forward 2.03 -> 1.82 ms at (8, 4096, 16, 2), fwd+bwd 7.86 ->
# 7.68 (H100, s40-1: benchmarks/results/CURRENT.md). False: warp MMAs (``+mmap``).
GMMA = True
# With the in-kernel L2 norm, k's rows enter the operands kernel's products raw and their
# norms come from the diagonal of K K^T, which phase 2 forms anyway (``gram_norm`` of
# ``ChunkPrepSm90``): no normalising pass over k's rows in registers and one 16-bit
# rounding of k fewer - closer to float64 (o 4.05e-3 -> 3.62e-3 at (8, 203, 16, 2)), bits
# differ from the XLA-normalised path by rounding (GPU test ``test_gram_norm_matches``).
# Forward 1.76 -> 1.69 ms, fwd+bwd 7.62 -> 7.54 at (8, 4096, 16, 2) (H100, s40-3:
# benchmarks/results/CURRENT.md). False: k normalised first (``+normk``).
GRAM_NORM = True
# Opt-in (s43, not yet measured): the operands kernel's 16-bit products (P, w; u where 16-bit)
# leave through shared memory as 16-byte row pieces instead of from the accumulators' 4-byte
# pairs (``staged`` of ``ChunkPrepSm90``; Nsight Compute on the H100, s43-1: 15% of the
# kernel's L2 sectors were excess ones of such partial writes). The same values.
STAGED_STORES = False
# Opt-in (s44, not yet measured): v's tile arrives in its own cp.async group, waited for
# just before phase 4 (``late_v`` of ``ChunkPrepSm90``): its 16 KB load overlaps phases
# 1-3, where today every CTA waits for q, k and v before phase 1 (phase 0 is ~26% of the
# kernel's cycles, the kernel latency-bound: s43-1). The same values.
LATE_V = False
# Measurement (s44, not yet run): the CTAs an SM the operands kernel's registers are capped
# for - 3 (the default: ~167 registers a thread, 12 warps an SM) or 2 (the assembler's
# choice, 186): do its latency-bound phases run faster per CTA with more registers and
# fewer neighbours? (What a 2-CTA pipelined kernel would start from.)
CTAS_PER_SM = 3
# Opt-in (s44, not yet run on a GPU): the operands kernel persistent and pipelined
# (``pipelined`` of ``ChunkPrepSm90``): 2 CTAs an SM, each walking its chunks while the
# next chunk's k, q (a second smem stage) and v tiles load - the structural fix for a
# kernel at 40% of its issue slots with every CTA waiting on its loads (docs/KERNELS.md,
# "What the counters say"). The same values. An int n >= 1: n CTAs (tests: every CTA walks
# many chunks at small shapes).
PIPELINED = False


def u_dtype(ab_dtype, plain: bool = False):
    """The dtype of the operand u for operands in ``ab_dtype``: bfloat16 for bfloat16
    with :data:`U16` (with "forward" only for ``plain``: the plain forward's operands),
    else the accumulation dtype (float32; float64 in the emulated CPU tests)."""
    ab = jnp.dtype(ab_dtype)
    if U16 not in (True, False, "forward"):
        raise ValueError(f"chunk_prep.U16={U16!r}; expected True, False or 'forward'")
    if (U16 is True or (U16 == "forward" and plain)) and ab == jnp.dtype(jnp.bfloat16):
        return ab
    return jnp.promote_types(jnp.float32, ab)


def as_read(ch, ab_dtype, dtype=None):
    """``ch`` (:class:`gdp_jax.grid.ChunkInputs`) as the kernel reads it: q, k, v rounded
    to the operand dtype ``ab_dtype``, then in ``dtype`` (default: their own); g, beta as
    they are."""
    back = lambda x: x.astype(ab_dtype).astype(dtype or x.dtype)
    return ch._replace(q=back(ch.q), k=back(ch.k), v=back(ch.v))


class ChunkPrepKernel:
    """Limits and the (vmappable) call of the forward-operands kernel."""

    DTYPES = ("bfloat16", "float16")
    HEAD_DIMS = (64, 128)

    @staticmethod
    def can_implement(*, ab_dtype, cdt, K: int, V: int, rows: int, NC: int,
                      HV: int) -> Optional[Unsupported]:
        """None if the kernel runs chunk inputs of dtype ``cdt`` into ``ab_dtype``
        operands with these shapes, else why not."""
        ab, cd = jnp.dtype(ab_dtype).name, jnp.dtype(cdt).name
        if ab not in ChunkPrepKernel.DTYPES or cd != "float32":
            return Unsupported(f"the cutedsl operands kernel takes float32 chunk inputs and "
                               f"16-bit operands; got {cd} -> {ab}")
        if K not in ChunkPrepKernel.HEAD_DIMS or V not in ChunkPrepKernel.HEAD_DIMS:
            return Unsupported(f"the cutedsl operands kernel takes K, V in "
                               f"{ChunkPrepKernel.HEAD_DIMS}; got K={K}, V={V}")
        if binding.grid_limit(rows, HV):
            return Unsupported(binding.grid_limit(rows, HV))
        if rows * NC * HV * C * max(K, V, C) > binding.MAX_ELEMS:
            return Unsupported(f"{rows} rows x {NC} chunks x {HV} heads are too many for "
                               f"the operands kernel's 32-bit offsets")
        return None

    @classmethod
    def call(cls, ch, *, scale: float, ab_dtype, inverse: bool = False,
             readout_every: int = 1):
        """ch (:class:`gdp_jax.grid.ChunkInputs`, float32) -> ((w, kt, qg, p, u, decay),
        bad), and with ``inverse`` ((..), bad, X): X = (I + A)^-1 [B, NC, HV, C, C]
        float32, as the kernel computed it (from the k rows it entered: a non-finite k row
        enters as zeros); ``jax.vmap``-able. ``readout_every`` = n >= 2
        (``grid.readout_every(n) == n``): qg, p on the read-out rows only, as
        :meth:`raw_call_tokens` with ``readout_rows`` gives them (ch.q's read-out rows are
        what the kernel reads)."""
        scale_rows = jnp.full(ch.k.shape[:1], scale, jnp.float32)
        if readout_every > 1:
            f = binding.vmappable(
                lambda *a: cls.raw_call(*a, ab_dtype=ab_dtype, readout_rows=True,
                                        inverse=inverse),
                out_kinds=("rows",) * 7 + ("rows" if inverse else "dummy",))
            q = grid.readout_rows(ch.q, readout_every)
            pad = [(0, 0)] * (q.ndim - 2) + [(0, grid.READOUT_ROWS - q.shape[-2]), (0, 0)]
            n = jnp.asarray([0, 0, 0, readout_every], jnp.int32)
            rows = jnp.broadcast_to(n, ch.g.shape[:2] + (4,))
            w, kt, qg, p, u, decay, bad, X = f(jnp.pad(q, pad), ch.k, ch.v, ch.g, ch.beta,
                                               scale_rows, rows)
            out = (w, kt, qg, p, u, decay), bad != 0
            return out + (X,) if inverse else out
        f = binding.vmappable(lambda *a: cls.raw_call(*a, ab_dtype=ab_dtype, inverse=inverse),
                              out_kinds=("rows",) * 7 + ("rows" if inverse else "dummy",))
        w, kt, qg, p, u, decay, bad, X = f(ch.q, ch.k, ch.v, ch.g, ch.beta, scale_rows)
        out = (w, kt, qg, p, u, decay), bad != 0
        return out + (X,) if inverse else out

    @staticmethod
    def raw_call(q, k, v, g, beta, scale, rows=None, *, ab_dtype, inverse: bool = False,
                 probe: bool = False, readout_rows: bool = False):
        """q, k [B, NC, HV, C, K], v [B, NC, HV, C, V] (cast to ``ab_dtype``), g, beta
        [B, NC, HV, C], scale [B] (float32: the readout scale of each row) ->
        w, kt, qg [B, NC, HV, C, K], p [B, NC, HV, C, C] (``ab_dtype``), u [B, NC, HV, C, V]
        (:func:`u_dtype`), decay [B, NC, HV] (float32), bad [B, NC, HV, C] (int32, nonzero:
        set the output row to NaN), X [B, NC, HV, C, C] float32 with ``inverse`` (else a
        [1] float32 placeholder). ``probe`` (measurement only): bad[..., :7] holds the SM
        clock cycles of the kernel's phases (``chunk_prep_sm90.PROBE_PHASES``) instead of
        row flags.
        ``readout_rows`` (no ``probe``): q [B, NC, HV, READOUT_ROWS, K] holds
        the chunk's read-out rows n - 1, 2n - 1, .. (then zeros), rows [B, NC, 4] int32
        their n at [.., 3] (the rest unread); qg, p as :meth:`raw_call_tokens` gives them
        with ``readout_rows``."""
        B, NC, HV, C_, K = k.shape
        V = v.shape[-1]
        if C_ != C:
            raise ValueError(f"k: chunks of {C} rows, [B, NC, HV, {C}, K]; got {k.shape}")
        if readout_rows:
            R = grid.READOUT_ROWS
            if probe:
                raise ValueError("readout_rows: not with probe")
            if q.shape != (B, NC, HV, R, K):
                raise ValueError(f"q: the read-out rows, {(B, NC, HV, R, K)}; got {q.shape}")
            if rows is None or rows.shape != (B, NC, 4) or rows.dtype != jnp.int32:
                raise ValueError(f"rows: int32 ({B}, {NC}, 4) with n at [.., 3]; got "
                                 f"{None if rows is None else (rows.dtype, rows.shape)}")
        elif rows is not None:
            raise ValueError("rows: only with readout_rows")
        why = ChunkPrepKernel.can_implement(ab_dtype=ab_dtype, cdt=k.dtype, K=K, V=V,
                                            rows=B, NC=NC, HV=HV)
        if why:
            raise ValueError(str(why))
        if scale.shape != (B,):
            raise ValueError(f"scale: one float32 per row, shape ({B},); got {scale.shape}")
        ab = jnp.dtype(ab_dtype)
        f32 = lambda x: x.astype(jnp.float32)
        to_ab = lambda x: x.astype(ab)
        if readout_rows:
            outputs = _outputs(B, NC, HV, K, V, ab, inverse=inverse, rows=grid.READOUT_ROWS)
            return binding.custom_call(
                _launcher_tokens, "gdp_chunk_prep_sm90_rows", outputs,
                (to_ab(q), to_ab(k), to_ab(v), f32(g), f32(beta), f32(scale), rows),
                tile_dims=(2, 2, 2, 1, 1, 0, 1, 2, 2, 2, 2, 2, 0, 1, 2 if inverse else 1),
                K=K, V=V, ab_name=ab.name, l2norm=False, readout_rows=True, tokens=False,
                **({"inverse": True} if inverse else {}), **_gmma(), **_staged(),
                **_late_v(), **_ctas())
        outputs = _outputs(B, NC, HV, K, V, ab, inverse)
        return binding.custom_call(_launcher, "gdp_chunk_prep_sm90", outputs,
                                   (to_ab(q), to_ab(k), to_ab(v), f32(g), f32(beta),
                                    f32(scale)),
                                   tile_dims=(2, 2, 2, 1, 1, 0, 2, 2, 2, 2, 2, 0, 1,
                                              2 if inverse else 1),
                                   K=K, V=V, ab_name=ab.name, inverse=inverse,
                                   **({"probe": True} if probe else {}), **_gmma(),
                                   **_staged(), **_late_v(), **_ctas())

    @staticmethod
    def can_read_tokens(spec, q, k, v) -> bool:
        """Can the forward operands come from the token-major inputs q [B, T, H, K],
        k [B, T, n, H, K], v [B, T, n, HV, V] directly (:meth:`call_tokens`)? They must
        already be in the 16-bit operand dtype (then nothing is cast or moved in XLA)."""
        ab = jnp.dtype(spec.ab_dtype)
        return (TOKEN_LAYOUT and ab.name in ChunkPrepKernel.DTYPES
                and all(x.dtype == ab for x in (q, k, v))
                and k.shape[-1] in ChunkPrepKernel.HEAD_DIMS
                and v.shape[-1] in ChunkPrepKernel.HEAD_DIMS
                and k.shape[2] <= C            # whole tokens in every chunk (base = 0 mod n)
                and max(q.size, k.size, v.size) <= binding.MAX_ELEMS)

    @classmethod
    def call_tokens(cls, spec, q, k, v, ch, layout, *, inverse: bool = False,
                    normalized: bool = False, readout_rows: bool = False,
                    plain: bool = False):
        """The forward operands as :meth:`call` gives them for ``ch`` (whose g and beta are
        read; its q, k, v are left to XLA's dead-code elimination), with q, k, v read by
        the kernel from the token-major inputs (:meth:`can_read_tokens`) and L2-normalised
        in it when ``spec.use_qk_l2norm`` and not ``normalized`` (q, k already are);
        ``inverse``: X as well, as :meth:`call`'s; ``readout_rows`` (n >= 2): qg, p on
        the read-out rows only, [.., READOUT_ROWS, K / C] (:meth:`raw_call_tokens`);
        ``plain``: the plain forward's operands (:func:`u_dtype`). ``jax.vmap``-able."""
        B, T, n, H, K = k.shape
        rows = token_rows(layout, n, T)
        f = binding.vmappable(
            lambda *a: cls.raw_call_tokens(*a, ab_dtype=spec.ab_dtype, inverse=inverse,
                                           l2norm=spec.use_qk_l2norm and not normalized,
                                           readout_rows=readout_rows, plain=plain),
            out_kinds=("rows",) * (8 if inverse else 7) + (() if inverse else ("dummy",)))
        scale_rows = jnp.full((B,), spec.scale, jnp.float32)
        w, kt, qg, p, u, decay, bad, X = f(
            q, k.reshape(B, T * n, H, K), v.reshape((B, T * n) + v.shape[3:]), ch.g,
            ch.beta, scale_rows, rows)
        out = (w, kt, qg, p, u, decay), bad != 0
        return out + (X,) if inverse else out

    @staticmethod
    def raw_call_tokens(q, k, v, g, beta, scale, rows, *, ab_dtype, l2norm: bool,
                        inverse: bool = False, probe: bool = False,
                        readout_rows: bool = False, plain: bool = False):
        """q [B, T, H, K], k [B, L, H, K], v [B, L, HV, V] (``ab_dtype``; L = n T
        interleaved steps), g, beta [B, NC, HV, C] float32, scale [B], rows [B, NC, 4]
        int32 (:func:`token_rows`) -> :meth:`raw_call`'s outputs for the chunk inputs those
        tensors lay out to, with q, k L2-normalised (then rounded to ``ab_dtype``) when
        ``l2norm`` (under :data:`GRAM_NORM` k's normalised rows are not rounded: the
        kernel scales the raw rows' products by their norms); ``inverse``, ``probe``: as
        :meth:`raw_call`'s. ``readout_rows`` (every row table's n >= 2 with
        C // (C // n) = n, ``grid.readout_every``): qg [B, NC, HV, R, K] and p
        [B, NC, HV, R, C], R = ``grid.READOUT_ROWS``, hold the read-out rows n - 1,
        2n - 1, .. of the chunk (row i at i // n; rows C // n.. zero), the same values as
        those rows of the full tensors. ``plain``: the plain forward's
        operands (u in :func:`u_dtype`'s dtype for it)."""
        B, NC, HV, C_ = g.shape
        K, V = k.shape[-1], v.shape[-1]
        if C_ != C:
            raise ValueError(f"g: chunks of {C} rows, [B, NC, HV, {C}]; got {g.shape}")
        ab = jnp.dtype(ab_dtype)
        why = ChunkPrepKernel.can_implement(ab_dtype=ab_dtype, cdt=g.dtype, K=K, V=V,
                                            rows=B, NC=NC, HV=HV)
        if why:
            raise ValueError(str(why))
        for name, x in (("q", q), ("k", k), ("v", v)):
            if x.dtype != ab:
                raise ValueError(f"{name}: the token-major operands kernel reads {ab.name}; "
                                 f"got {x.dtype}")
        if scale.shape != (B,):
            raise ValueError(f"scale: one float32 per row, shape ({B},); got {scale.shape}")
        if rows.shape != (B, NC, 4) or rows.dtype != jnp.int32:
            raise ValueError(f"rows: int32 ({B}, {NC}, 4); got {rows.dtype} {rows.shape}")
        if HV % k.shape[2] or q.shape[2] != k.shape[2]:
            raise ValueError(f"heads: q {q.shape[2]}, k {k.shape[2]}, v {HV}; expected "
                             f"q's = k's, dividing v's")
        outputs = _outputs(B, NC, HV, K, V, ab, inverse=inverse,
                           rows=grid.READOUT_ROWS if readout_rows else C, plain=plain)
        f32 = lambda x: x.astype(jnp.float32)
        return binding.custom_call(_launcher_tokens, "gdp_chunk_prep_sm90_tokens", outputs,
                                   (q, k, v, f32(g), f32(beta), f32(scale), rows),
                                   tile_dims=(1, 1, 1, 1, 1, 0, 1, 2, 2, 2, 2, 2, 0, 1,
                                              2 if inverse else 1),
                                   K=K, V=V, ab_name=ab.name, l2norm=l2norm,
                                   **({"inverse": True} if inverse else {}),
                                   **({"probe": True} if probe else {}),
                                   **({"readout_rows": True} if readout_rows else {}),
                                   **_gram_norm(l2norm),
                                   **_gmma(), **_staged(), **_late_v(), **_ctas())

    @classmethod
    def variants(cls):
        """The variants ``ffi/build.py`` prebuilds: per operand dtype and head dims, the
        forward's (no X) and the backward's (with X); the scale is a run-time input."""
        import jax
        from gdp_jax.kernels import aot
        out = []
        for name in cls.DTYPES:
            for K in cls.HEAD_DIMS:
                for V in cls.HEAD_DIMS:
                    S = lambda *shape: jax.ShapeDtypeStruct((1, 1, 1, C) + shape, jnp.float32)
                    for inverse in (False, True):
                        fn = functools.partial(cls.raw_call, ab_dtype=name, inverse=inverse)
                        out.append(aot.Variant(
                            f"gdp_chunk_prep_sm90 {name} K={K} V={V}"
                            + (" inverse" if inverse else ""), fn,
                            (S(K), S(K), S(V), S(), S(),
                             jax.ShapeDtypeStruct((1,), jnp.float32))))
                    # the differentiated forward's and the backward's (with X), qg and
                    # p on the read-out rows (READOUT_ONLY_GRAD, READOUT_ONLY_BWD)
                    for inverse in (False, True):
                        out.append(aot.Variant(
                            f"gdp_chunk_prep_sm90 {name} K={K} V={V} readout_rows"
                            + (" inverse" if inverse else ""),
                            functools.partial(cls.raw_call, ab_dtype=name, readout_rows=True,
                                              inverse=inverse),
                            (jax.ShapeDtypeStruct((1, 1, 1, grid.READOUT_ROWS, K),
                                                  jnp.float32),
                             S(K), S(V), S(), S(), jax.ShapeDtypeStruct((1,), jnp.float32),
                             jax.ShapeDtypeStruct((1, 1, 4), jnp.int32))))
                    # token-major q, k, v: the forward (normalised in the kernel or
                    # not; all rows or the read-out rows of qg, p) and the backward's,
                    # with X (pipeline.TOKEN_BACKWARD; all rows or, READOUT_ONLY_BWD, the
                    # read-out rows)
                    # (normalised by XLA, or raw with the norm in the kernel on the
                    # read-out rows: NORM_IN_KERNELS)
                    for l2norm, inverse, readout in ((False, False, False),
                                                     (True, False, False),
                                                     (False, True, False),
                                                     (False, True, True),
                                                     (True, True, True),
                                                     (False, False, True),
                                                     (True, False, True)):
                        T = lambda *shape: jax.ShapeDtypeStruct((1, 1, 1) + shape,
                                                                jnp.dtype(name))
                        fn = functools.partial(cls.raw_call_tokens, ab_dtype=name,
                                               l2norm=l2norm, inverse=inverse,
                                               readout_rows=readout)
                        out.append(aot.Variant(
                            f"gdp_chunk_prep_sm90_tokens {name} K={K} V={V}"
                            + (" l2norm" if l2norm else "")
                            + (" inverse" if inverse else "")
                            + (" readout_rows" if readout else ""), fn,
                            (T(K), T(K), T(V), S(), S(),
                             jax.ShapeDtypeStruct((1,), jnp.float32),
                             jax.ShapeDtypeStruct((1, 1, 4), jnp.int32))))
        return out


def _outputs(B, NC, HV, K, V, ab, inverse: bool, rows: int = C, plain: bool = False):
    """The kernel's results: w, kt, qg, p (``ab``; qg, p on ``rows`` rows), u, decay, bad,
    X (or its [1] placeholder), as :meth:`ChunkPrepKernel.raw_call` documents them (u in
    :func:`u_dtype`'s dtype for ``plain``)."""
    r = (B, NC, HV, C)
    rr = (B, NC, HV, rows)
    return (binding.out(r + (K,), ab), binding.out(r + (K,), ab), binding.out(rr + (K,), ab),
            binding.out(rr + (C,), ab), binding.out(r + (V,), u_dtype(ab, plain)),
            binding.out((B, NC, HV), jnp.float32), binding.out(r, jnp.int32),
            binding.out(r + (C,) if inverse else (1,), jnp.float32))


def token_rows(layout, n: int, T: int):
    """Where each chunk's rows start in the token-major tensors: int32 [B, NC, 4] of
    (base, count, tok, n) - chunk row i is interleaved step base + i for i < count, the
    read-out rows i = n - 1 (mod n) are token tok + i // n (``layout``: the call's
    :class:`gdp_jax.grid.ChunkLayout` for T tokens of n steps)."""
    B, NC = layout.reset.shape
    S = grid.steps_per_chunk(n, C)
    if isinstance(layout.src, grid.Contiguous):
        base = jnp.broadcast_to(jnp.arange(NC, dtype=jnp.int32) * S, (B, NC))
        count = jnp.clip(n * T - base, 0, S)
    else:
        src = layout.src.reshape(B, NC, C)
        count = jnp.sum(src >= 0, axis=-1, dtype=jnp.int32)
        base = jnp.where(count > 0, src[..., 0], 0)
    return jnp.stack([base, count, base // n, jnp.full_like(base, n)], axis=-1)


def _switch(name: str, key: str, applies: bool = True) -> dict:
    """The launchers' ``key`` constexpr where the module's bool switch ``name`` is on and
    ``applies`` (absent otherwise, so the other variants keep their keys); a value other
    than True / False is a ValueError."""
    value = globals()[name]
    if value not in (True, False):
        raise ValueError(f"chunk_prep.{name}={value!r}; expected True or False")
    return {key: True} if value and applies else {}


def _gmma() -> dict:
    """:data:`GMMA` as the launchers' ``gmma``."""
    return _switch("GMMA", "gmma")


def _staged() -> dict:
    """:data:`STAGED_STORES` as the launchers' ``staged``."""
    return _switch("STAGED_STORES", "staged")


def _late_v() -> dict:
    """:data:`LATE_V` as the launchers' ``late_v``."""
    return _switch("LATE_V", "late_v")


def _ctas() -> dict:
    """:data:`CTAS_PER_SM` and :data:`PIPELINED` as the launchers' ``ctas`` (absent at the
    default 3) and ``pipelined`` (the persistent grid: 2 CTAs an SM)."""
    if CTAS_PER_SM not in (2, 3) or isinstance(CTAS_PER_SM, bool):
        raise ValueError(f"chunk_prep.CTAS_PER_SM={CTAS_PER_SM!r}; expected 2 or 3")
    if PIPELINED is True:
        return {"ctas": 2, "pipelined": 2 * binding.SMS}
    if PIPELINED is not False and (not isinstance(PIPELINED, int) or PIPELINED < 1):
        raise ValueError(f"chunk_prep.PIPELINED={PIPELINED!r}; expected True, False or an "
                         f"int >= 1 (CTAs)")
    if PIPELINED:
        return {"ctas": 2, "pipelined": PIPELINED}
    return {} if CTAS_PER_SM == 3 else {"ctas": CTAS_PER_SM}


def _gram_norm(l2norm: bool) -> dict:
    """:data:`GRAM_NORM` as the token launcher's ``gram_norm`` (only where it normalises)."""
    return _switch("GRAM_NORM", "gram_norm", l2norm)


@functools.lru_cache(maxsize=None)
def _launcher():
    binding.import_cutlass()
    import cutlass
    import cutlass.cute as cute
    from gdp_jax.kernels import chunk_prep_sm90 as mod

    @cute.jit
    def launch(stream, q, k, v, g, beta, scale, w, kt, qg, p, u, decay, bad, X, *,
               K: cutlass.Constexpr, V: cutlass.Constexpr, ab_name: cutlass.Constexpr,
               inverse: cutlass.Constexpr, probe: cutlass.Constexpr = False,
               gmma: cutlass.Constexpr = False, staged: cutlass.Constexpr = False,
               late_v: cutlass.Constexpr = False, ctas: cutlass.Constexpr = 3,
               pipelined: cutlass.Constexpr = 0):
        # (no row table: ``scale`` fills its slot, unread)
        mod.get_kernel(K, V, ab_name, inverse, probe, gmma=gmma, staged=staged,
                       late_v=late_v, ctas=ctas, pipelined=pipelined)(
            stream, q, k, v, g, beta, scale, scale, w, kt, qg, p, u, decay, bad, X)

    return launch


@functools.lru_cache(maxsize=None)
def _launcher_tokens():
    binding.import_cutlass()
    import cutlass
    import cutlass.cute as cute
    from gdp_jax.kernels import chunk_prep_sm90 as mod

    @cute.jit
    def launch(stream, q, k, v, g, beta, scale, rows, w, kt, qg, p, u, decay, bad, X, *,
               K: cutlass.Constexpr, V: cutlass.Constexpr, ab_name: cutlass.Constexpr,
               l2norm: cutlass.Constexpr, inverse: cutlass.Constexpr = False,
               probe: cutlass.Constexpr = False, readout_rows: cutlass.Constexpr = False,
               tokens: cutlass.Constexpr = True, gmma: cutlass.Constexpr = False,
               gram_norm: cutlass.Constexpr = False, staged: cutlass.Constexpr = False,
               late_v: cutlass.Constexpr = False, ctas: cutlass.Constexpr = 3,
               pipelined: cutlass.Constexpr = 0):
        # tokens=False: the chunk-major kernel with a row table (readout_rows' n)
        mod.get_kernel(K, V, ab_name, inverse, probe=probe, tokens=tokens, l2norm=l2norm,
                       readout_rows=readout_rows, gmma=gmma, gram_norm=gram_norm,
                       staged=staged, late_v=late_v, ctas=ctas, pipelined=pipelined)(
            stream, q, k, v, g, beta, scale, rows, w, kt, qg, p, u, decay, bad, X)

    return launch
