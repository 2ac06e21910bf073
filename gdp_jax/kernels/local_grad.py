"""The chunk-local gradient kernel (:mod:`gdp_jax.kernels.chunk_grad_sm90`): limits and call.

One pass per chunk, all chunks in parallel: what :func:`gdp_jax.chunked.local_grads_direct`
computes - the cotangents (dq, dk, dv, dg, dbeta) of the chunk inputs from the output-row
cotangents, the end-state cotangents dS_end and the start states S0 - with every [C, C]
intermediate in shared memory instead of HBM (XLA's version moves each of them through
HBM at least once: 11 of the 18 ms of a cutedsl fwd+bwd at (8, 4096, 16, 2) before this
kernel, benchmarks/results/history/2026-12-02).

The forward's WY factors w, u and X = (I + A)^-1 are inputs (the operands kernel
recomputes them for the backward: ``gdp_jax.kernels.pipeline.BackwardWork``).
:meth:`LocalGradKernel.call_tokens` has dq, dk, dv come out in the op's token-major
layout (16-bit) instead of float32 chunk tiles: the single-device backward's path for
bfloat16 (:meth:`LocalGradKernel.can_write_tokens`).
"""
from __future__ import annotations

import functools
from typing import Optional

import jax.numpy as jnp

from gdp_jax.grid import CHUNK as C
from gdp_jax.kernels import binding
from gdp_jax.kernels.chunk_prep import u_dtype
from gdp_jax.spec import Unsupported

# dq, dk, dv straight into the op's token-major layout where the kernel can
# (:meth:`LocalGradKernel.can_write_tokens`; False: chunk-major float32, relaid by XLA)
TOKEN_GRADS = True
# and that kernel's CTAs in (head, chunk, row) order, where the chunks fit grid y
# (binding.MAX_GRID_Y): those resident at once write whole token rows [.., HV, K]
TOKEN_HEAD_MAJOR = True
# warps along N of the kernel's CTA (4 along M): 1, 2 or 4 (4, 8 or 16 warps; 16 made the
# kernel 18% slower, s20-1: 128 registers and every warp converting its [C, C] operands)
WARPS_N = 2
# the [C, C] float32 factors entering the MMAs as hi + lo (True: an opt-in precision mode)
# or in one 16-bit rounding (False, a third fewer MMAs: fwd+bwd 9.72 -> 9.23 ms at
# (8, 4096, 16, 2), s20-2, with every gradient still closer to float64 than FLA's:
# benchmarks/results/CURRENT.md). The prebuilt variants are this setting's.
SPLIT = False
# the kernel's products as Hopper warpgroup MMAs (wgmma, ``chunk_grad_sm90.ChunkGradSm90``'s
# ``gmma``) instead of warp MMAs (mma.sync): True for phases 1-8, 11-13; "overlap": and
# independent products issued together (its ``overlap``); "all": and phases 9, 10 too (its
# ``gmma_all``). "all" is the default since s38: fwd+bwd 8.49 -> 8.03 ms at (8, 4096, 16, 2),
# the kernel alone 4.45 -> 4.04 ms (H100, benchmarks/results/CURRENT.md). It needs 8 warps
# (WARPS_N = 2) and, for "all", one 16-bit rounding of the [C, C] factors (not SPLIT): this
# default steps down where those settings ask (SPLIT: True; WARPS_N != 2: False); an
# explicit ``gmma=`` argument that cannot run is a ValueError. Both 16-bit dtypes (float16
# since s39-1: its GPU tests pass, H100).
GMMA = "all"


class LocalGradKernel:
    """Limits and the (vmappable) call of the chunk-local gradient kernel."""

    DTYPES = ("bfloat16", "float16")
    HEAD_DIMS = (64, 128)

    @staticmethod
    def can_implement(*, ab_dtype, K: int, V: int, rows: int, NC: int,
                      HV: int) -> Optional[Unsupported]:
        """None if the kernel runs these shapes with ``ab_dtype`` operands, else why not."""
        ab = jnp.dtype(ab_dtype).name
        if ab not in LocalGradKernel.DTYPES:
            return Unsupported(f"the cutedsl local-gradient kernel takes 16-bit operands; "
                               f"got {ab}")
        if K not in LocalGradKernel.HEAD_DIMS or V not in LocalGradKernel.HEAD_DIMS:
            return Unsupported(f"the cutedsl local-gradient kernel takes K, V in "
                               f"{LocalGradKernel.HEAD_DIMS}; got K={K}, V={V}")
        if binding.grid_limit(rows, HV):
            return Unsupported(binding.grid_limit(rows, HV))
        if rows * NC * HV * max(C * max(K, V, C), K * V) > binding.MAX_ELEMS:
            return Unsupported(f"{rows} rows x {NC} chunks x {HV} heads are too many for "
                               f"the local-gradient kernel's 32-bit offsets")
        return None

    @classmethod
    def call(cls, q, k, v, g, beta, w, u, X, S0, doc, ds_end, *, scale: float, ab_dtype,
             split: Optional[bool] = None, ablate: str = "",
             warps_n: Optional[int] = None, gmma=None):
        """-> (dq, dk [B, NC, HV, C, K], dv [B, NC, HV, C, V], dg, dbeta [B, NC, HV, C]),
        float32; ``jax.vmap``-able.

        q, k, w: [B, NC, HV, C, K]; v, u, doc: [B, NC, HV, C, V]; g, beta: [B, NC, HV, C];
        X: [B, NC, HV, C, C]; S0, ds_end: [B, NC, HV, K, V] (any float dtypes: q, k, v,
        w, doc and S0 enter the kernel in ``ab_dtype``, ds_end in ``ab_dtype`` if it is
        in it, the rest in float32). ``split``, ``ablate``, ``warps_n``, ``gmma``: as
        :meth:`raw_call`'s.
        """
        wn = WARPS_N if warps_n is None else warps_n
        f = binding.vmappable(lambda *a: cls.raw_call(*a, ab_dtype=ab_dtype, split=split,
                                                      ablate=ablate, warps_n=wn, gmma=gmma),
                              out_kinds=("rows",) * 5)
        # float32 for the kernel (raw_call casts); float64 only in emulated tests
        scale_rows = jnp.full(k.shape[:1], scale, jnp.promote_types(jnp.float32, ab_dtype))
        return f(q, k, w, doc, v, g, beta, scale_rows, X, u, S0, ds_end)

    @staticmethod
    def raw_call(q, k, w, doc, v, g, beta, scale, X, u, S0, ds_end, *, ab_dtype,
                 split: Optional[bool] = None, ablate: str = "",
                 warps_n: Optional[int] = None, gmma=None):
        """:meth:`call` on its operands in the kernel's order, ``scale`` [B] float32 (one
        per row). ``split``: the float32 [C, C] factors enter the MMAs as hi + lo (None:
        :data:`SPLIT`);
        ``warps_n``: warps along N (4, 8 or 16 warps a CTA; None: :data:`WARPS_N`);
        ``gmma``: False (warp MMAs), True (warpgroup MMAs), "overlap" (and independent
        products issued together), "all" (and phases 9, 10; not with ``split``); 8 warps
        only; None: :data:`GMMA`, stepped down to what ``split`` / ``warps_n`` allow;
        ``ablate``: parts of the kernel
        skipped, for timing them only (the results are wrong; see
        ``chunk_grad_sm90.ChunkGradSm90``)."""
        B, NC, HV, K, V = _checked_dims(k, v, scale, ab_dtype)
        ab = jnp.dtype(ab_dtype)
        rows = (B, NC, HV, C)
        outputs = (binding.out(rows + (K,), jnp.float32), binding.out(rows + (K,), jnp.float32),
                   binding.out(rows + (V,), jnp.float32), binding.out(rows, jnp.float32),
                   binding.out(rows, jnp.float32))
        return binding.custom_call(
            _launcher, "gdp_chunk_grad_sm90", outputs,
            _kernel_args(q, k, w, doc, v, g, beta, scale, X, u, S0, ds_end, ab),
            tile_dims=(2, 2, 2, 2, 2, 1, 1, 0, 2, 2, 2, 2, 2, 2, 2, 1, 1),
            K=K, V=V, ab_name=ab.name, ablate=ablate, **_mma_kind(warps_n, gmma, split))

    @staticmethod
    def can_write_tokens(spec, ch) -> bool:
        """Can this call's chunk-local gradients dq, dk, dv come out of the kernel in the
        op's token-major layout (:meth:`call_tokens`)? The kernel must take the call, with
        whole tokens in every chunk (n <= C), and not in float16: the results are rounded
        to the operand dtype BEFORE the L2-norm backward and the GVA head sum, and dk
        before the norm's backward is |k| times larger than after it - float16's range
        (65504) may not hold it where the final gradient fits (bfloat16 has float32's
        range). float16 calls keep the float32 chunk tiles."""
        B, NC, HV, _, K = ch.k.shape
        V = ch.v.shape[-1]
        return (TOKEN_GRADS and spec.n <= C
                and jnp.dtype(spec.ab_dtype) != jnp.dtype(jnp.float16)
                and LocalGradKernel.can_implement(ab_dtype=spec.ab_dtype, K=K, V=V, rows=B,
                                                  NC=NC, HV=HV) is None
                and B * spec.n * spec.T * HV * max(K, V) <= binding.MAX_ELEMS)

    @classmethod
    def call_tokens(cls, q, k, v, g, beta, w, u, X, S0, doc, ds_end, rows, *, n: int,
                    T: int, scale: float, ab_dtype, split: Optional[bool] = None,
                    tokens_in: bool = False, rho=None, do_tokens: bool = False,
                    l2norm: bool = False):
        """:meth:`call` with dq, dk, dv written in the op's token-major layout, in
        ``ab_dtype``: -> (dq [B, T, HV, K], dk [B, T, n, HV, K], dv [B, T, n, HV, V],
        dg, dbeta [B, NC, HV, C] float32). ``rows`` [B, NC, 4]: the chunk grid's row table
        (:func:`gdp_jax.kernels.chunk_prep.token_rows` for T tokens of n steps); every
        step of every row must be some chunk's row (true of every valid layout).
        ``tokens_in``: q [B, T, H, K], k [B, T, n, H, K], v [B, T, n, HV, V] come
        token-major too (in ``ab_dtype``; H divides HV), read by the kernel through
        ``rows`` - else they are chunk tiles as :meth:`call`'s. ``rho`` = (rho_q [B, T, H],
        rho_k [B, T, n, H]) float32, 1 / |row| of the raw q, k of an op with the in-op L2
        norm (:func:`gdp_jax.reference.l2_norm_scale`; q, k the normalised rows): dq, dk
        come out as the cotangents of the raw rows (the norm's backward applied per value
        head, before the GVA head sum). ``do_tokens``: ``doc`` is the op's output cotangent
        token-major [B, T, HV, V] (in ``ab_dtype``), read on the read-out rows through
        ``rows``. ``l2norm`` (with ``tokens_in``, no ``rho``): q, k are the raw rows of an
        op with the in-op L2 norm; the kernel normalises them itself (as the token-major
        operands kernel does: the same bits) and applies the norm's backward with its own
        rho. ``jax.vmap``-able."""
        norm = rho is not None
        f = binding.vmappable(
            lambda *a: cls.raw_call_tokens(*a[:13], n=n, T=T, ab_dtype=ab_dtype, split=split,
                                           tokens_in=tokens_in,
                                           rho=tuple(a[13:]) if norm else None,
                                           do_tokens=do_tokens, l2norm=l2norm),
            out_kinds=("rows",) * 5)
        scale_rows = jnp.full(w.shape[:1], scale, jnp.promote_types(jnp.float32, ab_dtype))
        if tokens_in:
            B = q.shape[0]
            k = k.reshape((B, n * T) + k.shape[3:])
            v = v.reshape((B, n * T) + v.shape[3:])
        extra = ()
        if norm:
            rho_q, rho_k = rho
            rdt = scale_rows.dtype
            extra = (rho_q.astype(rdt),
                     rho_k.reshape((rho_k.shape[0], n * T) + rho_k.shape[3:]).astype(rdt))
        dq, dk, dv, dg, dbeta = f(q, k, w, doc, v, g, beta, scale_rows, X, u, S0, ds_end,
                                  rows, *extra)
        B, _, HV = g.shape[:3]
        return (dq, dk.reshape((B, T, n, HV) + dk.shape[3:]),
                dv.reshape((B, T, n, HV) + dv.shape[3:]), dg, dbeta)

    @staticmethod
    def raw_call_tokens(q, k, w, doc, v, g, beta, scale, X, u, S0, ds_end, rows, *, n: int,
                        T: int, ab_dtype, split: Optional[bool] = None,
                        warps_n: Optional[int] = None, tokens_in: bool = False, rho=None,
                        do_tokens: bool = False, l2norm: bool = False,
                        gmma=None):
        """:meth:`raw_call` plus the row table ``rows`` [B, NC, 4] int32 -> dq [B, T, HV, K],
        dk [B, n T, HV, K], dv [B, n T, HV, V] (``ab_dtype``: chunk row i < count is step
        base + i, dq only on the read-out rows, token tok + i // n), dg, dbeta
        [B, NC, HV, C] float32. ``tokens_in``: q [B, T, H, K], k [B, n T, H, K],
        v [B, n T, HV, V] in ``ab_dtype``, read through the same rows (chunk rows without
        a token row read as zeros). ``rho`` = (rho_q [B, T, H], rho_k [B, n T, H]) float32:
        dq, dk as the raw rows' cotangents (:meth:`call_tokens`). ``do_tokens``: ``doc``
        [B, T, HV, V] token-major in ``ab_dtype``. ``l2norm`` (``tokens_in``, no ``rho``):
        q, k raw, normalised in the kernel, dq, dk the raw rows' cotangents."""
        if l2norm and (not tokens_in or rho is not None):
            raise ValueError("l2norm: q, k token-major (tokens_in) and no rho (the kernel "
                             "computes its own)")
        # the chunk-grid tensors' dims: k, v's (as raw_call's), or w, u's with tokens_in
        B, NC, HV, K, V = _checked_dims(w, u, scale, ab_dtype) if tokens_in else \
            _checked_dims(k, v, scale, ab_dtype)
        if rows.shape != (B, NC, 4) or rows.dtype != jnp.int32:
            raise ValueError(f"rows: int32 ({B}, {NC}, 4); got {rows.dtype} {rows.shape}")
        if not 1 <= n <= C or T < 1 or B * n * T * HV * max(K, V) > binding.MAX_ELEMS:
            raise ValueError(f"n={n}, T={T}: expected 1 <= n <= {C} and token-major "
                             f"outputs within the kernel's 32-bit offsets")
        ab = jnp.dtype(ab_dtype)
        tok = 2
        if do_tokens and (tuple(doc.shape) != (B, T, HV, V) or doc.dtype != ab):
            raise ValueError(f"doc: token-major {ab.name} {(B, T, HV, V)}; got {doc.dtype} "
                             f"{tuple(doc.shape)}")
        if tokens_in:
            _check_token_inputs(q, k, v, B, n, T, HV, K, V, ab)
            tok = 1
        rows_ = (B, NC, HV, C)
        outputs = (binding.out((B, T, HV, K), ab), binding.out((B, n * T, HV, K), ab),
                   binding.out((B, n * T, HV, V), ab), binding.out(rows_, jnp.float32),
                   binding.out(rows_, jnp.float32))
        extra, extra_dims, launcher, name = (), (), _launcher_tokens, \
            "gdp_chunk_grad_sm90_tokens"
        if rho is not None or l2norm:
            # with l2norm the kernel's own factors: [1, 1, 1] placeholders, unread
            extra = _checked_row_norms(rho, B, n, T, HV) if rho is not None else \
                (jnp.zeros((1, 1, 1), jnp.float32),) * 2
            extra_dims, launcher = (0, 0), _launcher_tokens_norm
            name = "gdp_chunk_grad_sm90_tokens_norm"
        return binding.custom_call(
            launcher, name, outputs,
            _kernel_args(q, k, w, doc, v, g, beta, scale, X, u, S0, ds_end, ab) + (rows,)
            + extra,
            tile_dims=(tok, tok, 2, 1 if do_tokens else 2, tok, 1, 1, 0, 2, 2, 2, 2, 1)
            + extra_dims
            + (1, 1, 1, 1, 1),
            K=K, V=V, ab_name=ab.name,
            head_major=bool(TOKEN_HEAD_MAJOR) and NC <= binding.MAX_GRID_Y,
            **_mma_kind(warps_n, gmma, split),
            **({"tokens_in": True} if tokens_in else {}),
            **({"do_tokens": True} if do_tokens else {}),
            **({"l2norm": True} if l2norm else {}))

    @classmethod
    def variants(cls):
        """The variants ``ffi/build.py`` prebuilds: per operand dtype and head dims (the
        scale is a run-time input)."""
        import jax
        from gdp_jax.kernels import aot
        out = []
        for name in cls.DTYPES:
            for K in cls.HEAD_DIMS:
                for V in cls.HEAD_DIMS:
                    S = lambda *shape, dt=jnp.float32: jax.ShapeDtypeStruct(
                        (1, 1, 1) + shape, dt)
                    ab = jnp.dtype(name)
                    fn = functools.partial(cls.raw_call, ab_dtype=name)
                    args = lambda ds: (S(C, K, dt=ab), S(C, K, dt=ab), S(C, K, dt=ab),
                                       S(C, V, dt=ab), S(C, V, dt=ab), S(C), S(C),
                                       jax.ShapeDtypeStruct((1,), jnp.float32),
                                       S(C, C), S(C, V, dt=u_dtype(ab)), S(K, V, dt=ab),
                                       S(K, V, dt=ds))
                    for ds in (ab, jnp.dtype(jnp.float32)):    # dS_end: 1 GPU, CP
                        out.append(aot.Variant(
                            f"gdp_chunk_grad_sm90 {name} K={K} V={V} dS_end {ds.name}", fn,
                            args(ds)))
                    # token-major dq, dk, dv (the single-device op's backward: dS_end 16-bit)
                    table = (jax.ShapeDtypeStruct((1, 1, 4), jnp.int32),)
                    fn = functools.partial(cls.raw_call_tokens, n=1, T=1, ab_dtype=name)
                    out.append(aot.Variant(
                        f"gdp_chunk_grad_sm90_tokens {name} K={K} V={V}", fn,
                        args(ab) + table))
                    # and the L2 norm's backward on dq, dk (pipeline.FUSED_NORM_BWD)
                    rho = (jax.ShapeDtypeStruct((1, 1, 1), jnp.float32),) * 2
                    fn = functools.partial(
                        lambda *a, **kw: cls.raw_call_tokens(*a[:13], rho=a[13:], **kw),
                        n=1, T=1, ab_dtype=name)
                    out.append(aot.Variant(
                        f"gdp_chunk_grad_sm90_tokens {name} K={K} V={V} norm", fn,
                        args(ab) + table + rho))
                    # and dO read token-major (pipeline.DO_TOKENS)
                    fn = functools.partial(
                        lambda *a, **kw: cls.raw_call_tokens(*a[:13], rho=a[13:], **kw),
                        n=1, T=1, ab_dtype=name, do_tokens=True)
                    a = list(args(ab))
                    a[3] = jax.ShapeDtypeStruct((1, 1, 1, V), ab)
                    out.append(aot.Variant(
                        f"gdp_chunk_grad_sm90_tokens {name} K={K} V={V} norm do tokens", fn,
                        tuple(a) + table + rho))
                    # and q, k, v read token-major (pipeline.TOKEN_BACKWARD)
                    R = lambda d: jax.ShapeDtypeStruct((1, 1, 1, d), ab)
                    a = list(args(ab))
                    a[0], a[1], a[4] = R(K), R(K), R(V)
                    fn = functools.partial(cls.raw_call_tokens, n=1, T=1, ab_dtype=name,
                                           tokens_in=True)
                    out.append(aot.Variant(
                        f"gdp_chunk_grad_sm90_tokens {name} K={K} V={V} tokens in", fn,
                        tuple(a) + table))
                    # and raw q, k normalised in the kernel, the norm's backward on its
                    # own factors (pipeline.NORM_IN_KERNELS)
                    fn = functools.partial(cls.raw_call_tokens, n=1, T=1, ab_dtype=name,
                                           tokens_in=True, l2norm=True)
                    out.append(aot.Variant(
                        f"gdp_chunk_grad_sm90_tokens {name} K={K} V={V} tokens in l2norm",
                        fn, tuple(a) + table))
        return out


def _mma_kind(warps_n, gmma, split) -> dict:
    """The launchers' split, warps_n and (only when on, so the warp-MMA variants' keys stay
    as they were) gmma, from the call's arguments or :data:`SPLIT`, :data:`WARPS_N`,
    :data:`GMMA` (the default steps down to what split / warps_n allow; an explicit
    ``gmma`` does not)."""
    split = SPLIT if split is None else bool(split)
    wn = int(WARPS_N if warps_n is None else warps_n)
    if gmma is None:
        gm = False if wn != 2 else True if GMMA == "all" and split else GMMA
    else:
        gm = gmma
    if gm not in (False, True, "overlap", "all"):
        raise ValueError(f"gmma: False, True, 'overlap' or 'all'; got {gm!r}")
    if gm and wn != 2:
        raise ValueError(f"gmma (warpgroup MMAs) needs warps_n=2 (two 4-warp groups); "
                         f"got warps_n={wn}")
    if gm == "all" and split:
        raise ValueError("gmma='all' needs one 16-bit rounding of the [C, C] factors "
                         "(split=False)")
    return {"split": split, "warps_n": wn, **({"gmma": True} if gm else {}),
            **({"overlap": True} if gm in ("overlap", "all") else {}),
            **({"gmma_all": True} if gm == "all" else {})}


def _checked_row_norms(rho, B, n, T, HV):
    """(rho_q, rho_k) checked: float32 [B, T, H] and [B, n T, H] with H dividing HV."""
    rho_q, rho_k = rho
    H = rho_q.shape[-1] if rho_q.ndim == 3 else 0
    for name, x, want in (("rho_q", rho_q, (B, T, H)), ("rho_k", rho_k, (B, n * T, H))):
        if tuple(x.shape) != want or x.dtype != jnp.float32:
            raise ValueError(f"{name}: float32 {want}; got {x.dtype} {tuple(x.shape)}")
    if H < 1 or HV % H:
        raise ValueError(f"rho_q, rho_k have {H} heads, the call {HV} value heads: "
                         "expected a divisor")
    return rho_q, rho_k


def _checked_dims(k, v, scale, ab_dtype):
    """(B, NC, HV, K, V) of a call with k [B, NC, HV, C, K], v [.., V] (or w, u: the same
    shapes) and ``scale`` [B]; ValueError where the kernel cannot take it."""
    B, NC, HV, C_, K = k.shape
    V = v.shape[-1]
    why = LocalGradKernel.can_implement(ab_dtype=ab_dtype, K=K, V=V, rows=B, NC=NC, HV=HV)
    if why:
        raise ValueError(str(why))
    if C_ != C:
        raise ValueError(f"k: chunks of {C} rows, [B, NC, HV, {C}, K]; got {k.shape}")
    if scale.shape != (B,):
        raise ValueError(f"scale: one float32 per row, shape ({B},); got {scale.shape}")
    return B, NC, HV, K, V


def _check_token_inputs(q, k, v, B, n, T, HV, K, V, ab):
    """ValueError unless q [B, T, H, K], k [B, n T, H, K], v [B, n T, HV, V] are in
    ``ab`` with H dividing HV."""
    H = q.shape[2] if q.ndim == 4 else 0
    want = {"q": (B, T, H, K), "k": (B, n * T, H, K), "v": (B, n * T, HV, V)}
    for name, x in (("q", q), ("k", k), ("v", v)):
        if tuple(x.shape) != want[name] or x.dtype != ab:
            raise ValueError(f"{name}: token-major {ab.name} {want[name]}; got {x.dtype} "
                             f"{tuple(x.shape)}")
    if H < 1 or HV % H:
        raise ValueError(f"q, k have {H} heads, v {HV}: expected a divisor of v's")


def _kernel_args(q, k, w, doc, v, g, beta, scale, X, u, S0, ds_end, ab):
    """The kernel's inputs in its dtypes: q, k, w, doc, v, S0 in ``ab``, u and ds_end in
    ``ab`` if they are in it, the rest float32."""
    f32 = lambda x: x.astype(jnp.float32)
    to_ab = lambda x: x.astype(ab)
    return (to_ab(q), to_ab(k), to_ab(w), to_ab(doc), to_ab(v), f32(g), f32(beta), f32(scale),
            f32(X), u if u.dtype == ab else f32(u), to_ab(S0),
            ds_end if ds_end.dtype == ab else f32(ds_end))


@functools.lru_cache(maxsize=None)
def _launcher():
    binding.import_cutlass()
    import cutlass
    import cutlass.cute as cute
    from gdp_jax.kernels import chunk_grad_sm90 as mod

    @cute.jit
    def launch(stream, q, k, w, doc, v, g, beta, scale, X, u, S0, ds_end, dq, dk, dv, dg,
               dbeta, *, K: cutlass.Constexpr, V: cutlass.Constexpr,
               ab_name: cutlass.Constexpr, split: cutlass.Constexpr,
               ablate: cutlass.Constexpr, warps_n: cutlass.Constexpr,
               gmma: cutlass.Constexpr = False, overlap: cutlass.Constexpr = False,
               gmma_all: cutlass.Constexpr = False):
        # (no row table, no row norms: ``scale`` fills their slots, unread)
        mod.get_kernel(K, V, ab_name, split, ablate, warps_n, gmma=gmma, overlap=overlap,
                       gmma_all=gmma_all)(
            stream, q, k, w, doc, v, g, beta, scale, X, u, S0, ds_end, scale, scale, scale,
            dq, dk, dv, dg, dbeta)

    return launch


@functools.lru_cache(maxsize=None)
def _launcher_tokens():
    binding.import_cutlass()
    import cutlass
    import cutlass.cute as cute
    from gdp_jax.kernels import chunk_grad_sm90 as mod

    @cute.jit
    def launch(stream, q, k, w, doc, v, g, beta, scale, X, u, S0, ds_end, rows, dq, dk, dv,
               dg, dbeta, *, K: cutlass.Constexpr, V: cutlass.Constexpr,
               ab_name: cutlass.Constexpr, split: cutlass.Constexpr,
               head_major: cutlass.Constexpr, warps_n: cutlass.Constexpr,
               tokens_in: cutlass.Constexpr = False, do_tokens: cutlass.Constexpr = False,
               gmma: cutlass.Constexpr = False, overlap: cutlass.Constexpr = False,
               gmma_all: cutlass.Constexpr = False):
        # (no row norms: ``scale`` fills their slots, unread)
        mod.get_kernel(K, V, ab_name, split, warps_n=warps_n, tokens=True,
                       head_major=head_major, tokens_in=tokens_in, do_tokens=do_tokens,
                       gmma=gmma, overlap=overlap, gmma_all=gmma_all)(
            stream, q, k, w, doc, v, g, beta, scale, X, u, S0, ds_end, rows, scale, scale,
            dq, dk, dv, dg, dbeta)

    return launch


@functools.lru_cache(maxsize=None)
def _launcher_tokens_norm():
    binding.import_cutlass()
    import cutlass
    import cutlass.cute as cute
    from gdp_jax.kernels import chunk_grad_sm90 as mod

    @cute.jit
    def launch(stream, q, k, w, doc, v, g, beta, scale, X, u, S0, ds_end, rows, rho_q, rho_k,
               dq, dk, dv, dg, dbeta, *, K: cutlass.Constexpr, V: cutlass.Constexpr,
               ab_name: cutlass.Constexpr, split: cutlass.Constexpr,
               head_major: cutlass.Constexpr, warps_n: cutlass.Constexpr,
               tokens_in: cutlass.Constexpr = False, do_tokens: cutlass.Constexpr = False,
               l2norm: cutlass.Constexpr = False, gmma: cutlass.Constexpr = False,
               overlap: cutlass.Constexpr = False, gmma_all: cutlass.Constexpr = False):
        mod.get_kernel(K, V, ab_name, split, warps_n=warps_n, tokens=True,
                       head_major=head_major, tokens_in=tokens_in, norm_bwd=True,
                       do_tokens=do_tokens, l2norm=l2norm, gmma=gmma, overlap=overlap,
                       gmma_all=gmma_all)(
            stream, q, k, w, doc, v, g, beta, scale, X, u, S0, ds_end, rows, rho_q, rho_k,
            dq, dk, dv, dg, dbeta)

    return launch
