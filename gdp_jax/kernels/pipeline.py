"""The ``cutedsl`` engine: XLA glue around the Hopper kernels (one jit-able pipeline each way).

Forward:
  kernel (:class:`~gdp_jax.kernels.chunk_prep.ChunkPrepKernel`), all chunks at once, on
    q, k, v in the 16-bit operand dtype (the plain forward of 16-bit inputs: read from the
    op's token-major tensors, L2 norm in the kernel): the chunk-local cumsum, the WY
    factors w, u, Kt = exp(G_last - G) k, the readout operands
    qg = scale exp(G) q and P = scale tril(q k^T Gam), cast to the 16-bit input dtype (u,
    decay stay float32) and masked for non-finite rows (:func:`causal_operands`); where it
    cannot run, the same in XLA (batched float32 matmuls, the inverse (I + A)^-1 on its
    kernel, :mod:`gdp_jax.kernels.wy_inverse`) - and in XLA under differentiation when
    the backward's factors are XLA's too (XLA then shares them);
  kernel (:class:`~gdp_jax.kernels.chunk_forward.ChunkForwardKernel`): the state recursion
    fused with the output and the final states, and under differentiation the start state
    of every (N + 1)-th chunk (N = recompute_chunk_num).
Backward:
  kernel (``ChunkPrepKernel`` with X): the forward's operands again and the WY inverse X
    (recomputed: nothing more is kept from the forward);
    where the kernels cannot take the backward, XLA's factors (``chunked.wy_factors``);
  XLA: chunk states from the checkpoints (N recompute steps, all groups at once) and,
    where the reverse kernel does not form it from P (``FUSED_DDO``), its operand
    ddo = P^T dO;
  kernel (:class:`~gdp_jax.kernels.state_grad.StateGradKernel`): the reverse state-gradient
    recursion, dS_end of every chunk and the initial-state gradients;
  kernel (:class:`~gdp_jax.kernels.local_grad.LocalGradKernel`): the chunk-local backward
    (dq, dk, dv, dg, dbeta; all chunks at once, every [C, C] intermediate on chip) from the
    chunk states, dS_end and the forward's WY factors - in the single-device backward
    with dq, dk, dv written token-major (:class:`gdp_jax.engine.TokenCotangents`); where
    it cannot run, the same written out in XLA
    (:func:`gdp_jax.chunked.local_grads_direct`).
  In the single-device op (:data:`TOKEN_BACKWARD`) the differentiated op's operands kernels
  and the local-gradient kernel read q, k, v token-major through a row table, no chunk
  tiles of them in XLA; with the in-op L2 norm and n >= 2 (:data:`NORM_IN_KERNELS`) they
  read the raw q, k and normalise them themselves, and the local-gradient kernel applies
  the norm's backward, so XLA does nothing for the norm.
CP (cross-device ranks and ``intra_cp``'s segments), per direction, as Megatron's: prepare
runs the recursion kernel on V + K state columns for the summary alone (no readout,
checkpoints or dS_end): columns of the state never mix, so from the start [h0' | I] with
u = [u | 0] the last K columns of the final state are its response to the sequence's start
state, and [E | M] is read off it (dfinal = [dfinal' | I], dO = [dO | 0] give
[gamma | M^T]). Apply then runs the plain single-device pass from the folded start state
(end-state gradient) on V columns. One walk more a direction than writing every V + K row
and adding the response in XLA, and faster: nothing per chunk in float32 through HBM
(benchmarks/results/CURRENT.md, s27).
"""
from __future__ import annotations

import os
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp

from gdp_jax import _vma, chunked, grid, heads
from gdp_jax.engine import (Engine, RawTokenCotangents, TokenCotangents, TokenOutputs,
                            identity_columns, mm_exact, where_has_tokens)
from gdp_jax.kernels.chunk_forward import ChunkForwardKernel
from gdp_jax.kernels.chunk_prep import ChunkPrepKernel, token_rows, u_dtype
from gdp_jax.kernels.local_grad import LocalGradKernel
from gdp_jax.kernels.state_grad import StateGradKernel
from gdp_jax.kernels import chunk_forward, wy_inverse
from gdp_jax.reference import l2_norm_scale


def acc_dtype(ab_dtype):
    """Accumulator / state dtype of the kernels: float32 (float64 only in emulated tests)."""
    return jnp.promote_types(jnp.float32, ab_dtype)


def intra_chunk(ch: grid.ChunkInputs) -> chunked.Intra:
    """:func:`gdp_jax.chunked.intra_chunk` with the WY inverse on its kernel."""
    return chunked.intra_chunk(ch, inverse=wy_inverse.unit_lower_inverse)


def readout_matrix(ch: grid.ChunkInputs, it: chunked.Intra, scale: float):
    """P = scale * tril(q k^T * Gam): [B, NC, HV, C, C] (Gam is 0 above the diagonal)."""
    return scale * chunked.causal_scores(ch.q, ch.k, it.Gam)


def forward_operands(ch: grid.ChunkInputs, scale: float, ab_dtype):
    """(w, kt, qg, p, u, decay) of the forward kernel: 16-bit, u in
    :func:`gdp_jax.kernels.chunk_prep.u_dtype`, decay float32 (as the operands kernel gives
    them)."""
    it = intra_chunk(ch)
    acc = acc_dtype(ab_dtype)
    p = readout_matrix(ch, it, scale).astype(ab_dtype)
    qg = (scale * it.gam[..., None] * ch.q).astype(ab_dtype)
    return (it.w.astype(ab_dtype), it.Kt.astype(ab_dtype), qg, p,
            it.u.astype(u_dtype(ab_dtype)),
            jnp.exp(it.G_last).astype(acc))


def causal_operands(operands):
    """The forward kernel's operands (w, kt, qg, p, u, decay) made safe for its plain MMAs,
    and ``bad`` [B, NC, HV, C]: :func:`gdp_jax.chunked.mask_nonfinite_rows`."""
    w, kt, qg, p, u, decay = operands
    (w, u, kt, qg, p), bad = chunked.mask_nonfinite_rows(w, u, kt, qg, p)
    return (w, kt, qg, p, u, decay), bad


def masked_operands(spec, ch: grid.ChunkInputs, use_kernel: bool = True, tokens=None,
                    layout: Optional[grid.ChunkLayout] = None, normalized: bool = False,
                    readout: bool = False, plain: bool = False):
    """``causal_operands(forward_operands(ch, ..))``: ((w, kt, qg, p, u, decay), bad), on
    the operands kernel when ``use_kernel`` and it takes the call (one pass per chunk),
    else in XLA. ``tokens``: the op's (q, k, v) [B, T, (n,) H or HV, K or V], from which
    the kernel reads q, k, v itself where it can (``ChunkPrepKernel.can_read_tokens``;
    ``layout`` is then the call's grid): XLA then lays out only g and beta;
    ``normalized``: their q, k are L2-normalised already (no norm in the kernel);
    ``readout``: where :func:`readout_rows_only` allows, qg and p hold the read-out rows
    alone ([.., grid.READOUT_ROWS, K / C]; :func:`forward_rows` trims the walk's rows);
    ``plain``: the plain forward's operands (nothing differentiates them) - on token-major
    inputs u in ``chunk_prep.u_dtype(.., plain=True)``."""
    B, NC, HV, _, K = ch.k.shape
    if use_kernel and ChunkPrepKernel.can_implement(
            ab_dtype=spec.ab_dtype, cdt=ch.k.dtype, K=K, V=ch.v.shape[-1], rows=B, NC=NC,
            HV=HV) is None:
        compact = readout and readout_rows_only(spec)
        if reads_tokens(spec, ch, use_kernel, tokens):
            return ChunkPrepKernel.call_tokens(spec, *tokens, ch, layout,
                                               normalized=normalized, readout_rows=compact,
                                               plain=plain)
        return ChunkPrepKernel.call(ch, scale=spec.scale, ab_dtype=spec.ab_dtype,
                                    readout_every=spec.n if compact else 1)
    return causal_operands(forward_operands(ch, spec.scale, spec.ab_dtype))


def reads_tokens(spec, ch: grid.ChunkInputs, use_kernel: bool, tokens) -> bool:
    """Does :func:`masked_operands` run the operands kernel on the token-major ``tokens``
    (the kernel takes the call and reads them: ``ChunkPrepKernel.can_read_tokens``)?"""
    B, NC, HV, _, K = ch.k.shape
    return (use_kernel and tokens is not None
            and ChunkPrepKernel.can_implement(ab_dtype=spec.ab_dtype, cdt=ch.k.dtype, K=K,
                                              V=ch.v.shape[-1], rows=B, NC=NC,
                                              HV=HV) is None
            and ChunkPrepKernel.can_read_tokens(spec, *tokens))


def walk_writes_tokens(spec, operands) -> bool:
    """Does the plain forward's walk write o token-major (:data:`chunk_forward.O_TOKENS`,
    :func:`chunk_forward.writes_o_tokens` for its launch)? Where its o tiles hold C rows on
    warpgroup MMAs: the read-out rows (qg on ``READOUT_ROWS`` rows) under
    ``chunk_forward.GMMA = "all"``, or all rows at n = 1."""
    B, _, HV, _, V = operands[4].shape                  # u [B, NC, HV, C, V]
    R, gmma = operands[2].shape[-2], chunk_forward.GMMA
    return chunk_forward.writes_o_tokens(B, HV, V) and (
        (R < grid.CHUNK and gmma == "all") or (spec.n == 1 and gmma in (True, "all")))


def saved_operands(spec, ch: grid.ChunkInputs, layout: grid.ChunkLayout, tokens=None):
    """((w, kt, qg, p, u, decay), bad, X): the differentiated forward's operands with the
    WY inverse X, for the forward walk and then kept for the backward
    (:func:`save_operands`; the caller checked :func:`kernel_backward`). One pass of the
    operands kernel with X, on the rows the recomputing forward and backward use: token-major
    inputs where :func:`token_operands` gives them (normalised in the kernel where
    :func:`norm_in_kernels`), qg, p on the read-out rows under :data:`READOUT_ONLY_GRAD`."""
    compact = READOUT_ONLY_GRAD and readout_rows_only(spec)
    read = token_operands(spec, ch, tokens)
    if read is not None:
        return ChunkPrepKernel.call_tokens(spec, *read, ch, layout, inverse=True,
                                           normalized=not norm_in_kernels(spec, tokens),
                                           readout_rows=compact)
    return ChunkPrepKernel.call(ch, scale=spec.scale, ab_dtype=spec.ab_dtype, inverse=True,
                                readout_every=spec.n if compact else 1)


def readout_rows_only(spec) -> bool:
    """Do the plain forward's operands and walk keep only the read-out rows of qg, P and
    o (:data:`READOUT_ONLY`; n >= 2 sub-steps a token with C // (C // n) = n,
    :func:`gdp_jax.grid.readout_every`)?"""
    return READOUT_ONLY and spec.n >= 2 and grid.readout_every(spec.n) == spec.n


def forward_rows(spec, operands, oc, bad):
    """The walk's output rows and the operands' ``bad`` rows [B, NC, HV, C] as the op
    reads them: all C rows, or, for operands on the read-out rows (qg with
    ``grid.READOUT_ROWS`` rows), those C // n rows of each ([.., C // n, V], [.., C // n])."""
    if operands[2].shape[-2] == grid.CHUNK:
        return oc, bad
    every = grid.readout_every(spec.n)
    return oc[..., :grid.CHUNK // every, :], grid.readout_rows(bad, every, axis=-1)


@jax.tree_util.register_pytree_node_class
class BackwardWork:
    """What the backward and the CP backward summary both need, computed once: the
    factors of the chunk-local backward (``w``, ``u``, ``X`` = (I + A)^-1, and ``it``, the
    :class:`gdp_jax.chunked.Intra` the chunk states are recomputed from) and the reverse
    kernel's operands (kt, w, qg, ddo, do, decay); ddo = P^T dO is what the output sends
    to Delta directly. ``do``: dO on all C rows (zeros off the read-out ones), for the
    chunk-local backward; the reverse kernel's may hold the read-out rows alone
    (:data:`READOUT_ONLY_BWD`: qg, P, dO on ``grid.READOUT_ROWS`` rows).

    ``on_kernel`` (:func:`kernel_backward`): the factors and operands come from one pass of
    the operands kernel with X (``ChunkPrepKernel``, as the forward's operands do), for
    the local-gradient kernel; else from XLA (``chunked.wy_factors``), with every field of
    ``it`` for the written-out backward :func:`gdp_jax.chunked.local_grads_direct`.

    ``doc`` [.., Cr, V]: all C rows or only the read-out ones (Cr = C // every,
    :func:`gdp_jax.grid.readout_rows`); ddo is then computed from those rows of P alone,
    and the kernels get do on all C rows (zeros elsewhere).

    ``fuse_ddo`` (:data:`FUSED_DDO`, on the kernel path only): the operands carry P itself
    in ddo's place and the reverse kernel forms ddo = P^T dO."""

    def __init__(self, ch: grid.ChunkInputs, doc, scale: float, ab_dtype,
                 on_kernel: bool = False, prep=None):
        acc = acc_dtype(ab_dtype)
        every = grid.every_of(doc.shape[-2])
        rows = lambda x: grid.readout_rows(x, every)
        cast = lambda x: x.astype(ab_dtype)
        do = cast(grid.from_readout_rows(doc, every))
        self.fuse_ddo = bool(on_kernel and FUSED_DDO)
        if on_kernel:
            # ``prep``: the forward's (operands, X) when it kept them (save_operands)
            if prep is None:
                operands, _, X = ChunkPrepKernel.call(
                    ch, scale=scale, ab_dtype=ab_dtype, inverse=True,
                    readout_every=backward_readout_every(doc))
                prep = (operands, X)
            (w, kt, qg, p, u, decay), self.X = prep
            do_walk = do
            if qg.shape[-2] != grid.CHUNK:
                # qg, P on the read-out rows (the first C // every of READOUT_ROWS): the
                # reverse kernel takes dO on those rows too
                pad = [(0, 0)] * (doc.ndim - 2) + [(0, qg.shape[-2] - doc.shape[-2]), (0, 0)]
                do_walk = jnp.pad(cast(doc), pad)
                rows = lambda x: x[..., :doc.shape[-2], :]
            ddo = p if self.fuse_ddo else (
                jnp.swapaxes(rows(p).astype(acc), -1, -2) @ doc.astype(acc))
            # the chunk-state recompute (states_from_checkpoints) reads w, u, Kt, G_last
            G_last = chunked.prefix_sum(ch.g, axis=-1)[..., -1]
            self.it = chunked.Intra(G_last, None, None, w.astype(acc), u.astype(acc),
                                    kt.astype(acc))
            self.w, self.u, self.do = w, u, do
            self.operands = (kt, w, qg, ddo, do_walk, decay)
            return
        self.it, self.X = chunked.wy_factors(ch, inverse=wy_inverse.unit_lower_inverse)
        self.w, self.u = self.it.w, self.it.u
        p = scale * chunked.causal_scores(rows(ch.q), ch.k, rows(self.it.Gam))  # [.., Cr, C]
        ddo = jnp.swapaxes(p, -1, -2) @ doc
        qg = scale * self.it.gam[..., None] * ch.q
        self.do = do
        self.operands = (cast(self.it.Kt), cast(self.it.w), cast(qg), ddo.astype(acc), do,
                         jnp.exp(self.it.G_last).astype(acc))

    # a pytree (its arrays the leaves), so a CP backward context can leave a jax.vmap
    def tree_flatten(self):
        return (self.X, self.it, self.w, self.u, self.do, self.operands), self.fuse_ddo

    @classmethod
    def tree_unflatten(cls, fuse_ddo, children):
        work = object.__new__(cls)
        work.X, work.it, work.w, work.u, work.do, work.operands = children
        work.fuse_ddo = fuse_ddo
        return work


# A/B switches (measurements): the chunk-local backward on its kernel where it takes the
# call (False: XLA's ``local_grads_direct``), and its factors from the operands kernel
# with dS_end in 16 bits (False: XLA's factors, float32 dS_end; XLA then shares the
# factors with the differentiated forward's operands).
LOCAL_GRAD_KERNEL = True
KERNEL_FACTORS = True
# and the differentiated forward keeping its operands and X for the backward instead of
# recomputing them (:func:`save_operands`): None = as GDP_JAX_SAVE_OPERANDS says
SAVE_OPERANDS = None
SAVE_OPERANDS_ENV = "GDP_JAX_SAVE_OPERANDS"


def save_operands() -> bool:
    """Does the differentiated forward keep its operands and the WY inverse X for the
    backward (one operands-kernel pass fewer; ~95 KB more kept a (chunk, value head) at
    K = V = 128, n >= 2)? :data:`SAVE_OPERANDS` if set, else the environment variable
    ``GDP_JAX_SAVE_OPERANDS`` ("1" on; "0" or unset off), read when the op is traced.
    Measured (H100, s36-2, benchmarks/results/CURRENT.md): fwd+bwd 8.48 -> 7.34 ms at
    (8, 4096, 16, 2) and 12.59 -> 10.84 at n = 3, the same bits; kept memory 0.54 -> 2.08 GB
    (FLA keeps 0.55), peak 2.58 -> 2.51. Off by default: a model keeps that for every layer
    until its backward."""
    if SAVE_OPERANDS is not None:
        return bool(SAVE_OPERANDS)
    v = os.environ.get(SAVE_OPERANDS_ENV, "0")
    if v not in ("0", "1"):
        raise ValueError(f"{SAVE_OPERANDS_ENV}={v!r}; expected '0' or '1'")
    return v == "1"


# and the differentiated op's operands and local-gradient kernels reading q, k, v
# token-major (:func:`token_operands`: XLA's L2-normalised per-token operands, the values
# the chunk tiles would hold) instead of chunk tiles XLA lays out (four relayouts,
# 0.13-0.20 ms each at (8, 4096, 16, 2), s33-1's trace). The same bits (GPU test); fwd+bwd
# 8.92 -> 8.67 ms at (8, 4096, 16, 2), 13.21 -> 12.79 at n = 3, 9.75 -> 9.59 at
# (2, 16384, 16, 2), 4.90 -> 4.92 at n = 1; peak memory 3.44 -> 2.98 GB (H100, s33-2:
# benchmarks/results/CURRENT.md). (In s22-1, before the read-out rows, it was no faster.)
TOKEN_BACKWARD = True
# and, with TOKEN_BACKWARD and the in-op L2 norm, those kernels reading the raw q, k and
# normalising them themselves (the token-major operands kernel's norm, ``sm90.
# l2_normalize_rows``: the same bits in each; the local-gradient kernel applies the norm's
# backward with its own factors) instead of XLA's norm passes and normalised copies
# (:func:`norm_in_kernels` says where). Errors vs float64 unchanged (GPU test); fwd+bwd
# 8.65 -> 8.57 ms at (8, 4096, 16, 2), 12.75 -> 12.73 at n = 3, 9.54 -> 9.50 at
# (2, 16384, 16, 2), peak memory 2.98 -> 2.58 GB (H100, s33-3: benchmarks/results/
# CURRENT.md): the kernels' norm costs about what XLA's passes did (s33-2's trace: the
# local-gradient kernel 3.78 -> 4.33 ms), but nothing is written for it.
NORM_IN_KERNELS = True

# and the forward without a backward (and the CP summary pass's) keeping only the read-out
# rows of qg, P and o where n >= 2 (``grid.READOUT_ROWS`` = 32 rows a chunk instead of C = 64):
# at n = 2 the operands kernel writes 12 KB less a (chunk, head) of 88 and normalises half
# the q rows, and the walk loads 12 KB less a chunk and forms o on half the rows - the
# same bits of o (GPU test). Forward 13-15% faster at n = 2, 3 (2.34 -> 1.98 ms at
# (8, 4096, 16, 2)), 7% at (1, 65536, 16, 2) under intra_cp="auto" (H100, s30-1:
# benchmarks/results/CURRENT.md).
READOUT_ONLY = True
# and, with READOUT_ONLY, the differentiated forward as well (the chunk-major operands
# kernel reads q's read-out rows compact and writes qg, P on them; the walk that writes
# the checkpoints forms o on them): the same bits of o and every gradient but dg (float32
# rounding of XLA's sums around the kernels); fwd+bwd 9.72 -> 9.47 ms at (8, 4096, 16, 2),
# 14.47 -> 14.07 at (8, 4096, 16, 3) (H100, s32-1: benchmarks/results/CURRENT.md).
READOUT_ONLY_GRAD = True
# and the backward's operands on the read-out rows (the operands kernel with X writes qg, P
# on them) with the reverse walk forming P^T dO and qg^T dO over those rows alone (k = 32
# instead of C: 21% fewer of its multiply-adds a chunk, 12 KB less loaded; not the same
# bits as all rows: the float32 sums run in another order; GPU test
# ``test_readout_only_bwd_matches``). fwd+bwd 9.60 -> 9.42 ms at (8, 4096, 16, 2), 14.15 ->
# 13.91 at n = 3, 10.67 -> 10.37 at (2, 16384, 16, 2) (H100, s32-3: benchmarks/results/
# CURRENT.md; s32-1's "no gain" had the switch off in the backward by mistake).
READOUT_ONLY_BWD = True

# and the local-gradient kernel applying the in-op L2 norm's backward to dq, dk in float32
# before their 16-bit rounding (``chunk_grad_sm90`` ``norm_bwd``: d_raw = rho (d - y
# rows(y, d)), rho = 1 / |raw row| from XLA's forward sums), instead of XLA's two passes
# over dq and dk after it: fwd+bwd 9.60 -> 9.02 ms at (8, 4096, 16, 2), 5.37 -> 5.00 at
# n = 1, 14.15 -> 13.39 at n = 3, dq, dk no farther from float64 (H100, s32-3: GPU test
# ``test_fused_norm_bwd_matches``, benchmarks/results/CURRENT.md).
FUSED_NORM_BWD = True
# and that kernel reading the output cotangent dO token-major through its row table (zeros
# on the rows that are not read out) instead of XLA's copy of dO on all C rows of every
# chunk (the pad fusion: 0.18 ms at (8, 4096, 16, 2), s32-2's trace). Opt-in, NOT yet
# measured: GPU test ``test_do_tokens_same_bits``; ``+dotok``.
DO_TOKENS = False

# and the reverse kernel forming ddo = P^T dO from P itself (StateGradKernel ``fuse_ddo``)
# instead of reading XLA's float32 product (fwd+bwd 10.20 -> 9.88 ms, peak 3.79 -> 3.26 GB
# at (8, 4096, 16, 2): benchmarks/results/CURRENT.md, s20-1)
FUSED_DDO = True


def backward_readout_every(doc) -> int:
    """The readout stride of the backward's operands (qg, P and the reverse walk's dO):
    ``doc``'s [.., C // every, V] read-out rows where :data:`READOUT_ONLY_BWD`, else 1 (all
    C rows)."""
    return grid.every_of(doc.shape[-2]) if READOUT_ONLY_BWD else 1


def local_grad_kernel(spec, ch: grid.ChunkInputs) -> bool:
    """Do these chunks' local gradients run on the local-gradient kernel?"""
    B, NC, HV, _, K = ch.k.shape
    return LOCAL_GRAD_KERNEL and LocalGradKernel.can_implement(
        ab_dtype=spec.ab_dtype, K=K, V=ch.v.shape[-1], rows=B, NC=NC, HV=HV) is None


def kernel_backward(spec, ch: grid.ChunkInputs) -> bool:
    """Does the backward of these chunks run on the kernels only (factors from the
    operands kernel with X, dS_end in 16 bits, the chunk-local gradients on the
    local-gradient kernel)? Else its factors are XLA's."""
    B, NC, HV, _, K = ch.k.shape
    return (KERNEL_FACTORS and local_grad_kernel(spec, ch)
            and ChunkPrepKernel.can_implement(ab_dtype=spec.ab_dtype, cdt=ch.k.dtype, K=K,
                                              V=ch.v.shape[-1], rows=B, NC=NC,
                                              HV=HV) is None)


def local_grads(spec, ch: grid.ChunkInputs, work: BackwardWork, S0, doc, ds_end,
                layout: Optional[grid.ChunkLayout] = None, qkv=None, rho=None, do=None,
                l2norm: bool = False):
    """The cotangents of the chunk inputs (:class:`gdp_jax.grid.ChunkInputs`, ``ch``'s
    dtypes) from the output-row cotangents ``doc`` [B, NC, HV, C, V], the end-state
    cotangents ``ds_end`` and the start states ``S0`` [B, NC, HV, K, V]. ``doc`` may hold
    only the read-out rows ([.., C // every, V]); the kernel takes all C rows: ``work``'s
    ``do``, the copy the reverse kernel reads. With the call's ``layout`` (the
    single-device op), where the kernel can, dq, dk, dv come out token-major instead
    (:class:`gdp_jax.engine.TokenCotangents`: no relayout or cast of them in XLA); with
    ``qkv`` (:func:`token_operands`) the kernel reads q, k, v token-major as well; with
    ``rho`` (:func:`row_norms`) the kernel applies the L2 norm's backward to those dq, dk
    (:class:`gdp_jax.engine.RawTokenCotangents`), or with ``l2norm`` (``qkv`` raw,
    :func:`norm_in_kernels`) normalises q, k itself and applies it with its own rho; with
    ``do`` (the op's output cotangent [B, T, HV, V], :data:`DO_TOKENS`) it reads dO
    token-major instead of ``work.do``."""
    if (layout is not None and local_grad_kernel(spec, ch)
            and LocalGradKernel.can_write_tokens(spec, ch)):
        rows = token_rows(layout, spec.n, spec.T)
        q, k, v = qkv if qkv is not None else ch[:3]
        dq, dk, dv, dg, dbeta = LocalGradKernel.call_tokens(
            q, k, v, ch.g, ch.beta, work.w, work.u, work.X, S0,
            work.do if do is None else do.astype(spec.ab_dtype),
            ds_end, rows, n=spec.n, T=spec.T, scale=spec.scale, ab_dtype=spec.ab_dtype,
            tokens_in=qkv is not None, rho=rho, do_tokens=do is not None, l2norm=l2norm)
        gates = _vma.cotangent_like((dg.astype(ch.g.dtype), dbeta.astype(ch.beta.dtype)),
                                    (ch.g, ch.beta))
        raw = rho is not None or l2norm
        return (RawTokenCotangents if raw else TokenCotangents)(dq, dk, dv, *gates)
    if local_grad_kernel(spec, ch):
        grads = LocalGradKernel.call(ch.q, ch.k, ch.v, ch.g, ch.beta, work.w, work.u,
                                     work.X, S0, work.do, ds_end, scale=spec.scale,
                                     ab_dtype=spec.ab_dtype)
        dch = grid.ChunkInputs(*(d.astype(x.dtype) for d, x in zip(grads, ch)))
        return _vma.cotangent_like(dch, ch)
    return chunked.local_grads_direct(ch, work.it, work.X, S0, doc, ds_end.astype(ch.k.dtype),
                                      spec.scale)


def row_norms(spec, tokens) -> Optional[tuple]:
    """(rho_q [B, T, H], rho_k [B, T, n, H]) float32: 1 / |row| of the op's raw q, k
    (:func:`gdp_jax.reference.l2_norm_scale`, the sums XLA shares with the forward's norm)
    for the local-gradient kernel to apply the L2 norm's backward (:data:`FUSED_NORM_BWD`),
    or None: switch off, no in-op norm, ``batch_invariant`` (its norm has its own sums), no
    token-major inputs."""
    if not (FUSED_NORM_BWD and spec.use_qk_l2norm and not spec.batch_invariant
            and tokens is not None):
        return None
    q, k = tokens.raw[:2]
    # float32 for the kernel (float64 only in emulated tests)
    dt = jnp.promote_types(jnp.float32, spec.cdt)
    rho = lambda x: l2_norm_scale(x.astype(spec.cdt))[..., 0].astype(dt)
    return rho(q), rho(k)


def token_operands(spec, ch: grid.ChunkInputs, tokens) -> Optional[tuple]:
    """The differentiated op's q, k, v for kernels that read them token-major
    (:data:`TOKEN_BACKWARD`): :class:`gdp_jax.engine.OpTokens`' per-token operands in the
    16-bit operand dtype - q [B, T, HV, K], k [B, T, n, HV, K], v [B, T, n, HV, V],
    L2-normalised, the same values the chunk inputs hold - or, where the kernels
    normalise them (:func:`norm_in_kernels`), the raw q [B, T, H, K], k [B, T, n, H, K] and
    v; None where the backward runs on chunk tiles (switch off, no tokens, a kernel that
    cannot take the call)."""
    if not TOKEN_BACKWARD or tokens is None or not kernel_backward(spec, ch):
        return None
    if not LocalGradKernel.can_write_tokens(spec, ch):
        return None
    src = tokens.raw if norm_in_kernels(spec, tokens) else tokens.tok
    qkv = tuple(x.astype(spec.ab_dtype) for x in src[:3])
    return qkv if ChunkPrepKernel.can_read_tokens(spec, *qkv) else None


def norm_in_kernels(spec, tokens) -> bool:
    """Do the differentiated op's token-major kernels (:func:`token_operands`) read the
    raw q, k (``tokens.raw``) and L2-normalise them themselves (:data:`NORM_IN_KERNELS`)?
    Only with the in-op norm, its backward in the local-gradient kernel
    (:data:`FUSED_NORM_BWD`), not ``batch_invariant`` (whose norm has its own sums), raw
    q, k already in the 16-bit operand dtype (the kernels normalise 16-bit rows; wider
    inputs are normalised before their rounding, in XLA), and n >= 2 sub-steps with
    read-out rows (``grid.readout_every(n) == n``): where every row is read out the
    backward's operands kernel with X and the norm is 134 KiB of machine code, past the
    suspected 128 KiB instruction-cache limit (docs/KERNELS.md; with READOUT_ONLY_BWD off
    it is that kernel, compiled at trace time)."""
    ab = jnp.dtype(spec.ab_dtype)
    return (NORM_IN_KERNELS and TOKEN_BACKWARD and FUSED_NORM_BWD and spec.use_qk_l2norm
            and not spec.batch_invariant and tokens is not None
            and spec.n >= 2 and grid.readout_every(spec.n) == spec.n
            and all(x.dtype == ab for x in tokens.raw[:2]))


def _flags(layout: grid.ChunkLayout):
    """(reset, seq, last) as the kernels' int32 [B, NC] flags."""
    i32 = lambda x: x.astype(jnp.int32)
    return i32(layout.reset), i32(layout.seq_of_chunk), i32(layout.is_last)


class CuTeDSLEngine(Engine):
    """The Hopper (sm_90a) engine: every sequential pass on a CuTe DSL kernel."""

    name = "cutedsl"

    @staticmethod
    def launch_limits(spec) -> Optional[str]:
        """The kernels' limits for this call's launches (the forward, reverse and inverse
        kernels share them; the CP summaries' K extra state columns included)."""
        NC = grid.num_chunks(spec.T, spec.n, spec.N, spec.packed)
        kw = dict(dtype=spec.ab_dtype, K=spec.K, V=spec.V, rows=spec.B, NC=NC, HV=spec.HV)
        return (ChunkForwardKernel.can_implement(**kw)
                or StateGradKernel.can_implement(**kw, extra_columns=spec.K, sequences=spec.N))

    @classmethod
    def head_groups(cls, spec) -> Optional[int]:
        """The fewest head groups (:mod:`gdp_jax.heads`) whose launches fit the kernels:
        1 where the whole call does, None where not even one key head a group does."""
        return heads.num_groups(spec, lambda s: cls.launch_limits(s) is None)

    @classmethod
    def can_implement(cls, spec) -> Optional[str]:
        """None where the kernels run this call - whole, or in head groups where only the
        32-bit offsets of the whole call's launches overflow - else why not."""
        why = cls.launch_limits(spec)
        if why is not None and cls.head_groups(spec) is not None:
            return None
        return why

    @staticmethod
    def _check(spec, ch, layout, extra_columns=0):
        B, NC, HV, _, K = ch.k.shape
        why = ChunkForwardKernel.can_implement(dtype=spec.ab_dtype, K=K, V=ch.v.shape[-1],
                                               rows=B, NC=NC, HV=HV,
                                               extra_columns=extra_columns,
                                               sequences=layout.seq_len.shape[0])
        if why is not None:
            raise ValueError(f"backend='cutedsl' cannot run this call: {why}")

    @staticmethod
    def _prep_kernel(spec, ch, differentiated):
        """Forward operands on the operands kernel? Always, unless differentiated with an
        XLA backward: XLA then builds the same intra-chunk factors for both and shares
        them (CSE; the kernel's are opaque to it: benchmarks/results/history/2026-12-01/
        cse_operands.md)."""
        return not differentiated or kernel_backward(spec, ch)

    def forward(self, spec, ch, layout, h0, keep_states=False, work=None, tokens=None):
        """-> (o rows, final states, residuals): the residuals are the chunk-state
        checkpoints, with :func:`save_operands` (and a kernel backward) a pair
        (checkpoints, (operands, X)). ``tokens`` (:class:`gdp_jax.engine.OpTokens`): the
        plain forward's operands kernel reads the raw q, k, v (L2 norm in the kernel);
        under differentiation the backward lays out the chunk inputs anyway, and a
        forward sharing them measured faster (benchmarks/results/CURRENT.md, s18-2) -
        unless the backward reads token-major too (:func:`token_operands`, the default):
        then both read the per-token operands, raw and normalised in the kernels where
        :func:`norm_in_kernels` says so."""
        self._check(spec, ch, layout)
        save = keep_states and work is None and save_operands() and kernel_backward(spec, ch)
        o_tokens = None
        if save:
            operands, bad, X = saved_operands(spec, ch, layout, tokens)
        elif work is not None:
            operands, bad = work
        else:
            read, normalized = None, False
            if keep_states:
                read = token_operands(spec, ch, tokens)
                normalized = read is not None and not norm_in_kernels(spec, tokens)
            elif tokens is not None:
                read = tokens.raw
            use_kernel = self._prep_kernel(spec, ch, keep_states)
            operands, bad = masked_operands(
                spec, ch, use_kernel=use_kernel, layout=layout, tokens=read,
                normalized=normalized, readout=not keep_states or READOUT_ONLY_GRAD,
                plain=not keep_states)
            if (not keep_states and reads_tokens(spec, ch, use_kernel, read)
                    and walk_writes_tokens(spec, operands)):
                # the walk writes o token-major itself, NaN on the bad rows
                rows = token_rows(layout, spec.n, spec.T)
                o_tokens = (rows, bad.astype(jnp.int32), spec.T)
        h0 = h0.astype(acc_dtype(spec.ab_dtype))
        ckpt = spec.checkpoint_stride if keep_states else 0
        oc, final, states = ChunkForwardKernel.call(
            *operands, *_flags(layout), h0, ckpt=ckpt, states_dtype=spec.checkpoint_dtype,
            o_tokens=o_tokens)
        if o_tokens is None:
            oc, bad = forward_rows(spec, operands, oc, bad)
            oc = jnp.where(bad[..., None], jnp.asarray(jnp.nan, oc.dtype), oc)
        else:
            oc = TokenOutputs(oc)
        final = where_has_tokens(layout, final, h0).astype(spec.cdt)
        if save:
            return oc, final, (states, (operands, X))
        return oc, final, states if keep_states else None

    def backward(self, spec, ch, layout, h0, doc, dfinal, states, work=None, tokens=None):
        self._check(spec, ch, layout)
        prep = None
        if isinstance(states, tuple):          # the forward kept its operands
            states, prep = states
        qkv = token_operands(spec, ch, tokens) if work is None else None
        raw = qkv is not None and norm_in_kernels(spec, tokens)
        if qkv is not None and prep is None:
            # qg, P on the read-out rows where the reverse walk takes them (the token row
            # table holds the call's n: compact only where the readout stride is n)
            every = backward_readout_every(doc)
            operands, _, X = ChunkPrepKernel.call_tokens(
                spec, *qkv, ch, layout, inverse=True, normalized=not raw,
                readout_rows=every > 1 and every == spec.n)
            prep = (operands, X)
        work = work if work is not None else BackwardWork(
            ch, doc, spec.scale, spec.ab_dtype, on_kernel=kernel_backward(spec, ch),
            prep=prep)
        S0 = chunked.states_from_checkpoints(work.it, layout, h0, states,
                                             spec.checkpoint_stride)
        # dS_end in 16 bits for the local-gradient kernel (its MMAs round it so anyway)
        on_kernel = kernel_backward(spec, ch)
        ds_end, dh0 = StateGradKernel.call(*work.operands, *_flags(layout),
                                           dfinal.astype(acc_dtype(spec.ab_dtype)),
                                           ds_dtype=spec.ab_dtype if on_kernel else None,
                                           fuse_ddo=work.fuse_ddo)
        dch = local_grads(spec, ch, work, S0, doc, ds_end, layout=layout, qkv=qkv,
                          rho=None if raw else row_norms(spec, tokens), l2norm=raw,
                          do=tokens.do if DO_TOKENS and tokens is not None else None)
        return dch, where_has_tokens(layout, dh0.astype(dfinal.dtype), dfinal)

    def forward_summaries(self, spec, ch, layout):
        N, HV, K, V = layout.seq_len.shape[0], ch.k.shape[2], ch.k.shape[-1], ch.v.shape[-1]
        return self.forward_prepare(spec, ch, layout,
                                    jnp.zeros((N, HV, K, V), acc_dtype(spec.ab_dtype)))

    def forward_prepare(self, spec, ch, layout, h0p, differentiated=False, keep_states=True,
                        tokens=None):
        """The CP rank's summary walk: the forward kernel on V + K columns from [h0p | I]
        with u = [u | 0], writing only the final states, whose K extra columns are their
        response to the sequence's start state. -> ((E, M) [N, HV, K, V], [N, HV, K, K];
        :class:`ForwardWalk` for apply's plain walk, the engine's default resume).
        Without ``keep_states`` (no backward follows) the operands kernel reads ``tokens``
        (the rank's q, k, v) itself where it can, as the plain forward does."""
        K, V = ch.k.shape[-1], ch.v.shape[-1]
        self._check(spec, ch, layout, extra_columns=K)
        operands, bad = masked_operands(
            spec, ch, use_kernel=self._prep_kernel(spec, ch, differentiated), layout=layout,
            tokens=None if keep_states else tokens, readout=not keep_states,
            plain=not keep_states)
        h0p = h0p.astype(acc_dtype(spec.ab_dtype))
        h0 = identity_columns(h0p, K)
        # u has V columns: the kernel takes the response columns' u as 0 (no [u | 0] in HBM)
        _, final, _ = ChunkForwardKernel.call(*operands, *_flags(layout), h0, ckpt=0,
                                              states_dtype=spec.checkpoint_dtype,
                                              readout=False)
        final = where_has_tokens(layout, final, h0)
        M = final[..., V:]
        E = final[..., :V] - mm_exact(M, h0p)     # the map from a zero start, whatever h0p was
        return (E, M), ForwardWalk(operands, bad)     # apply: the plain forward on it

    def backward_summaries(self, spec, ch, layout, doc, dfinal):
        return self.backward_prepare(spec, ch, layout, doc, dfinal)

    def backward_prepare(self, spec, ch, layout, doc, dfinal):
        """The CP rank's reverse summary walk: the state-gradient kernel on V + K columns
        from dfinal = [dfinal | I], dO = [dO | 0], writing only the start-state gradients,
        whose K extra columns are their response to the end-state gradient of their
        sequence. -> ((gamma, M^T) [N, HV, K, V], [N, HV, K, K]; :class:`BackwardWork`
        for apply's plain backward, the engine's default resume)."""
        K, V = ch.k.shape[-1], ch.v.shape[-1]
        self._check(spec, ch, layout, extra_columns=K)
        work = BackwardWork(ch, doc, spec.scale, spec.ab_dtype,
                            on_kernel=kernel_backward(spec, ch))
        kt, w, qg, ddo, do, decay = work.operands
        dfx = identity_columns(dfinal.astype(acc_dtype(spec.ab_dtype)), K)
        # dO, ddo on their V columns (the kernel takes the response columns' as 0)
        _, dh0 = StateGradKernel.call(kt, w, qg, ddo, do, decay, *_flags(layout), dfx,
                                      fuse_ddo=work.fuse_ddo, write_ds=False)
        dh0 = where_has_tokens(layout, dh0, dfx)
        return (dh0[..., :V].astype(dfinal.dtype), dh0[..., V:].astype(dfinal.dtype)), work


class ForwardWalk(NamedTuple):
    """The CP forward's summary walk, kept for apply's plain walk: the forward kernel's
    operands (w, kt, qg, p, u, decay) and the non-finite rows ``bad`` [B, NC, HV, C]."""
    operands: tuple
    bad: jax.Array


CUTEDSL = CuTeDSLEngine()
