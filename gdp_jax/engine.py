"""The engine interface: how one backend runs the chunk grid, forward and backward.

Two users are written ONCE against it: the single-device ``custom_vjp`` of the op
(:mod:`gdp_jax.ops`) and the CP protocol (:mod:`gdp_jax.cp.protocol`). An engine sees
only chunk tensors (:class:`gdp_jax.grid.ChunkInputs`, [B, NC, HV, C, X]), the layout and
per-sequence tables [N, HV, K, V]; the relayouts around it live in :mod:`gdp_jax.grid`.

    forward(spec, ch, layout, h0, keep_states, work, tokens) -> (o rows, final, states)
    backward(spec, ch, layout, h0, doc, dfinal, states, work, tokens) -> (cotangents, dh0)
    forward_summaries(spec, ch, layout)                    -> ((E, M), work)
    backward_summaries(spec, ch, layout, doc, dfinal)      -> ((gamma, M^T), work)
    input_dtypes(spec)   -> {ChunkInputs field: dtype} read narrower than the compute dtype

and the CP rank's pair around them (defaults: the summaries, then the plain pass):

    forward_prepare(spec, ch, layout, h0p, differentiated, keep_states, tokens)
                                                           -> ((E, M), work)
    forward_resume(spec, ch, layout, h0, seqs, work, keep_states)
                                                           -> (o rows, final, states)
    backward_prepare(spec, ch, layout, doc, dfinal)        -> ((gamma, M^T), work)
    backward_resume(spec, ch, layout, h0, doc, dfinal, states, seqs, work)
                                                           -> (cotangents, dh0)

Output rows and their cotangents ``doc`` are [B, NC, HV, Cr, V]: all Cr = C rows of every
chunk, or only its read-out rows (Cr = C // every, every = ``grid.readout_every(n)``,
:func:`gdp_jax.grid.readout_rows`). :func:`backward_problem` gives read-out rows; an
engine's forward may return either (:func:`outputs` takes both) and its backward must take
either (the stride is ``grid.every_of(doc.shape[-2])``).
``tokens``: the single-device op's token-major inputs (:class:`OpTokens`: q, k, v as
given and the per-token operands ``ch`` is laid out from), for an engine that reads them
directly (the chunk tensors it then leaves unread cost nothing: XLA drops them).
Cotangents: :class:`gdp_jax.grid.ChunkInputs` of the chunk inputs, or from the
single-device ``backward`` a :class:`TokenCotangents` (q, k, v already token-major).
``states``: what the forward keeps for the backward under differentiation (the start
state of every (recompute_chunk_num + 1)-th chunk, in the engine's layout). ``work``: what
a summary pass computed that the matching apply pass can reuse (None: compute it).
Summaries: S_end = M S_start + E per sequence, [N, HV, K, V] and [N, HV, K, K]; and
dS_start = M^T dS_end + gamma with no gradient from beyond the sequence's end.
CP pair: ``h0p`` are provisional start states [N, HV, K, V] (zero for the sequences whose
start state is folded in later); resume gets the true ``h0`` / ``dfinal``, which differ
from the prepare's only for the sequences ``seqs`` (a tuple of [B] index arrays, one
sequence per row each), so an engine may resume from what prepare computed instead of
walking the chunks a second time. ``differentiated``: the backward follows in the same
program (an engine may build shared work the way the backward does, for XLA's CSE);
``keep_states`` False: no backward follows at all (resume returns states None, and the
pass need not write any); ``tokens`` there: the rank's (q, k, v) as the caller gave them.

The xla engine is here; the CuTe DSL engine is :class:`gdp_jax.kernels.pipeline.CuTeDSLEngine`.
"""
from __future__ import annotations

import dataclasses
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
from jax import lax

from gdp_jax import _vma, chunked, grid, recurrence
from gdp_jax.spec import CallSpec


class Engine:
    """Base class (the interface above). Engines are stateless singletons: hashable, so
    they can be ``custom_vjp`` static arguments."""

    name = "engine"

    @staticmethod
    def can_implement(spec: CallSpec) -> Optional[str]:
        """None if this engine runs the call, else a sentence saying why not."""
        return None

    def input_dtypes(self, spec) -> dict:
        """{ChunkInputs field: dtype} of the chunk inputs this engine reads narrower than
        the compute dtype: :func:`forward_problem` casts them before the relayout to the
        grid (fewer bytes moved; the same values as a cast after it)."""
        return {}

    def forward(self, spec, ch, layout, h0, keep_states=False, work=None, tokens=None):
        raise NotImplementedError

    def backward(self, spec, ch, layout, h0, doc, dfinal, states, work=None, tokens=None):
        raise NotImplementedError

    def forward_summaries(self, spec, ch, layout):
        raise NotImplementedError

    def backward_summaries(self, spec, ch, layout, doc, dfinal):
        raise NotImplementedError

    def forward_prepare(self, spec, ch, layout, h0p, differentiated=False, keep_states=True,
                        tokens=None):
        return self.forward_summaries(spec, ch, layout)

    def forward_resume(self, spec, ch, layout, h0, seqs, work, keep_states=True):
        return self.forward(spec, ch, layout, h0, keep_states=keep_states, work=work)

    def backward_prepare(self, spec, ch, layout, doc, dfinal):
        return self.backward_summaries(spec, ch, layout, doc, dfinal)

    def backward_resume(self, spec, ch, layout, h0, doc, dfinal, states, seqs, work):
        return self.backward(spec, ch, layout, h0, doc, dfinal, states, work=work)

    def __repr__(self):
        return f"<{type(self).__name__}>"


def where_has_tokens(layout, x, fallback):
    """x per sequence [N, ...], ``fallback`` for sequences without tokens (no chunk wrote
    them)."""
    return jnp.where((layout.seq_len > 0)[:, None, None, None], x, fallback)


# --- one-pass CP ranks: a pass on V + K state columns and its response --------------------
# Columns of the state never mix, so a pass from the start [h0p | I] with v = [v | 0] (or,
# backward, from dfinal = [dfinal | I] with dO = [dO | 0]) gives in its last K columns the
# response of every output row, chunk state and final state to the start state (end-state
# gradient) of the chunk's sequence; apply then adds that response to the change of the
# start state (parallel matmuls) instead of walking the chunks a second time.

def zero_columns(x, K: int):
    """[..., V] -> [..., V + K]: x next to K zero columns."""
    return jnp.concatenate([x, jnp.zeros(x.shape[:-1] + (K,), x.dtype)], axis=-1)


def identity_columns(x, K: int):
    """[..., K, V] -> [..., K, V + K]: x next to an identity (the response columns)."""
    eye = jnp.broadcast_to(jnp.eye(K, dtype=x.dtype), x.shape[:-1] + (K,))
    return jnp.concatenate([x, eye], axis=-1)


def mm_exact(a, b):
    """a @ b in full float32 (no TF32: these add a state's response to exact values)."""
    return jnp.matmul(a, b, precision=lax.Precision.HIGHEST)


def add_response(x, V: int, seq_of_rows, seqs, delta):
    """x[..., :V] + x[..., V:] @ delta[s] on the chunks of the sequences s in ``seqs``.

    x: [B, R, HV, r, V + K] per chunk (R chunks, r rows each), whose last K columns are
    the response to the start (end-gradient) state of the chunk's sequence;
    seq_of_rows: [B, R]; seqs: tuple of [B] sequence indices (a repeat of an earlier entry
    is skipped); delta: [N, HV, K, V]. Parallel per-chunk matmuls, in delta's dtype.
    Only the chunks of ``seqs`` read their K columns: every sequence restarts them at I."""
    acc = delta.dtype
    out = x[..., :V].astype(acc)
    for j, s in enumerate(seqs):
        on = seq_of_rows == s[:, None]
        for t in seqs[:j]:
            on = on & (s != t)[:, None]
        corr = _response(x[..., V:], delta[s])
        out = out + jnp.where(on[:, :, None, None, None], corr, 0.0)
    return out


_RESPONSE = "bnhrk,bhkv->bnhrv"


def _response(xk, d):
    """xk [B, R, HV, r, K] @ d [B, HV, K, V] per chunk, in d's dtype."""
    return jnp.einsum(_RESPONSE, xk.astype(d.dtype), d, precision=lax.Precision.HIGHEST)


class ForwardResponse(NamedTuple):
    """A CP rank's forward pass on V + K columns, kept from prepare for apply.

    h0p: [N, HV, K, V] the provisional start states; o: [B, NC, HV, Cr, V + K] output rows
    (Cr = C or the read-out rows); final: [N, HV, K, V + K]; states: the V + K checkpoints
    in the engine's layout (None: kept for no backward); bad: [B, NC, HV, Cr] output rows
    to set to NaN, or None (already NaN in o)."""
    h0p: jax.Array
    o: jax.Array
    final: jax.Array
    states: Optional[jax.Array]
    bad: Optional[jax.Array]


class XlaBackwardResponse(NamedTuple):
    """The xla engine's CP backward pass on V + K columns, kept for apply (blocked grid
    [L, B, ...]): the WY factors (it, X) and forward operands x it computed, the
    provisional dfinal [N, HV, K, V], dS_end [L, B, HV, K, V + K] and the start-state
    gradients [N, HV, K, V + K]."""
    it: chunked.Intra
    X: jax.Array
    x: recurrence.Forward
    dfinal: jax.Array
    dS_end: jax.Array
    first: jax.Array


def resume_rows_and_final(work: ForwardResponse, layout, h0, seqs):
    """A :class:`ForwardResponse` resumed from the true start states ``h0`` [N, HV, K, V]:
    (o rows [B, NC, HV, C, V] with ``work.bad`` rows NaN, final states [N, HV, K, V],
    delta = h0 - h0p, 0 outside ``seqs``) - the checkpoints are the engine's (its
    layout)."""
    V = h0.shape[-1]
    delta = h0.astype(work.h0p.dtype) - work.h0p
    o = add_response(work.o, V, layout.seq_of_chunk, seqs, delta)
    if work.bad is not None:
        o = jnp.where(work.bad[..., None], jnp.asarray(jnp.nan, o.dtype), o)
    final = work.final[..., :V] + mm_exact(work.final[..., V:], delta)
    return o, where_has_tokens(layout, final, h0), delta


def _add_response_time_major(x, V: int, seq, seqs, delta):
    """:func:`add_response` on the blocked grid's [L, B, ...] layout (``seq`` [L, B])."""
    out = add_response(jnp.moveaxis(x, 0, 1), V, jnp.moveaxis(seq, 0, 1), seqs, delta)
    return jnp.moveaxis(out, 0, 1)


def narrow_dtype(spec):
    """The xla engine's storage dtype of its big chunk operands (w, u, Kt, qg, P, v, dO)
    for 16-bit inputs, None otherwise (float32 / float64 inputs keep the compute dtype
    everywhere). Products accumulate in float32 (``chunked.mm``)."""
    return spec.ab_dtype if spec.ab_dtype.itemsize == 2 else None


def walk_dtype(spec):
    """The dtype of the per-chunk states and dS_end the xla scans keep ([.., K, V] per
    chunk): the checkpoint dtype where it is 16-bit (bfloat16 inputs), else None (the
    compute dtype; float16's range is too small for states)."""
    dt = spec.checkpoint_dtype
    return dt if dt.itemsize == 2 else None


# The chunk inputs the xla engine reads in the 16-bit input dtype (for 16-bit inputs): v
# always (exact: it came from there); q and / or k (L2-normalised, GVA-repeated,
# interleaved) rounded after the L2 norm, as a 16-bit caller's own would be - half the
# bytes of the chunk tensors the most fusions read. q is on: on the H200 (s14-2) it took
# fwd+bwd 13.65 -> 13.44 ms at (8, 4096, 16, 1), 24.82 -> 24.21 at n = 2, 35.78 -> 35.38
# at n = 3, 30.91 -> 30.34 at (2, 16384, 16, 2), peak -0.2 to -0.4 GB, the check vs
# float64 3.6-4.2e-3 -> 4.0-4.5e-3 (FLA 5.3-5.9e-3). k is off: it moves the CLI check's
# n = 3 case (bf16, CPU) to 5.03e-3, past its 5e-3 bound (tests/test_cli.py); q alone
# gives 4.67e-3 there, neither 4.64e-3.
NARROW_INPUTS = ("v", "q")


def _narrow_inputs(ch, dt):
    """The fields of :data:`NARROW_INPUTS` in the 16-bit dtype ``dt`` (None: unchanged);
    g and beta as they are."""
    if dt is None:
        return ch
    return ch._replace(**{f: getattr(ch, f).astype(dt) for f in NARROW_INPUTS})


# The backward's chunk-local gradients run on blocks of about this many (chunk, row, head)
# problems at a time (a ``lax.map`` over blocks of consecutive chunks): their float32
# temporaries ([.., C, K] and [.., C, C] per chunk, a dozen of them) are then the size of
# one block, not of the whole grid. None: all chunks at once.
LOCAL_GRAD_PROBLEMS = None


def _block_count(L: int, per_chunk: int, problems) -> int:
    """Blocks of consecutive chunks for L chunks of ``per_chunk`` problems: the fewest
    that divide L with at most ``problems`` problems each (1: no blocking; blocks that
    would be under a quarter of ``problems`` are not worth their loop)."""
    if problems is None or L * per_chunk <= problems:
        return 1
    for nb in range(-(-L * per_chunk // problems), L + 1):
        if L % nb == 0:
            return nb if (L // nb) * per_chunk * 4 >= problems else 1
    return 1


def local_grads_in_blocks(chb, it, X, S0, docb, dS_end, scale, problems=None):
    """:func:`gdp_jax.chunked.local_grads_direct` on the blocked grid [L, R, HV, ...], in
    blocks of consecutive chunks of at most ``problems`` (default
    :data:`LOCAL_GRAD_PROBLEMS`) problems each: the same values, bounded temporaries."""
    problems = LOCAL_GRAD_PROBLEMS if problems is None else problems
    L, R, HV = chb.k.shape[:3]
    nb = _block_count(L, R * HV, problems)
    if nb == 1:
        return chunked.local_grads_direct(chb, it, X, S0, docb, dS_end, scale)
    split = lambda a: a.reshape((nb, L // nb) + a.shape[1:])
    out = lax.map(lambda a: chunked.local_grads_direct(*a, scale),
                  jax.tree_util.tree_map(split, (chb, it, X, S0, docb, dS_end)))
    return jax.tree_util.tree_map(lambda a: a.reshape((L,) + a.shape[2:]), out)


class XlaEngine(Engine):
    """Pure JAX: any device and dtype, float64 included. The chunk-local math is
    :mod:`gdp_jax.chunked`, the sequential passes :mod:`gdp_jax.recurrence` (two-level,
    on the blocked grid); under differentiation the forward keeps the start state of
    every (recompute_chunk_num + 1)-th chunk for the backward. The CP summaries compose
    the per-chunk affine maps in parallel (no sequential pass)."""

    name = "xla"

    def input_dtypes(self, spec):
        nd = narrow_dtype(spec)
        return {} if nd is None else dict.fromkeys(NARROW_INPUTS, nd)

    @staticmethod
    def _blocking(spec, ch):
        """(the blocked grid, chunks per segment or None): long calls run in segments
        (:func:`gdp_jax.recurrence.segment_len`), on one level padded to whole segments."""
        B, NC, HV = ch.k.shape[:3]
        stride = spec.checkpoint_stride
        Ls = recurrence.segment_len(NC, B * HV, stride)
        if Ls is not None:
            return recurrence.Blocking(B, NC, Ls * -(-NC // Ls)), Ls
        return recurrence.Blocking(B, NC, recurrence.block_len(NC, stride)), None

    def forward(self, spec, ch, layout, h0, keep_states=False, work=None, tokens=None):
        """Output rows on the read-out rows only ([.., C // every, V]); ``tokens`` unused."""
        blk, Ls = self._blocking(spec, ch)
        nd = narrow_dtype(spec)
        chb, f = blk.tree_block(_narrow_inputs(ch, nd)), recurrence.flags(blk, layout)
        stride = spec.checkpoint_stride if keep_states else 0
        batched = recurrence.is_batched(blk, layout)
        if Ls is not None:
            o, final, states = recurrence.forward_segmented(
                chb, f, h0, spec.N, stride, spec.checkpoint_dtype, spec.scale, Ls, batched,
                grid.readout_every(spec.n), nd, walk_dtype(spec))
        else:
            o, final, states = self._walk(spec, blk, chb, f, h0, stride, spec.checkpoint_dtype,
                                          batched)
        final = where_has_tokens(layout, final, h0)
        return blk.unblock(o), final, states

    @staticmethod
    def _walk(spec, blk, chb, f, h0, stride, states_dtype, batched=False,
              narrow_states=True):
        """The one-level forward on the blocked grid: (o rows (the read-out rows) with NaN
        for ``bad`` rows, final states, checkpoints in ``states_dtype``), on 16-bit
        operands for 16-bit inputs (:func:`narrow_dtype`; the CP prepare's response pass
        too: the same rounded operands as one device). ``narrow_states``: the per-chunk
        states in :func:`walk_dtype`; the CP prepare keeps them in the compute dtype (its
        response columns are added to them before they are rounded)."""
        nd = narrow_dtype(spec)
        _, _, x, bad = recurrence.factors_and_operands(chb, spec.scale,
                                                       grid.readout_every(spec.n), nd)
        o, final, states = recurrence.forward(blk, x, f, h0, spec.N, stride, states_dtype,
                                              batched, walk_dtype(spec) if narrow_states else None)
        return jnp.where(bad[..., None], jnp.asarray(jnp.nan, o.dtype), o), final, states

    def backward(self, spec, ch, layout, h0, doc, dfinal, states, work=None, tokens=None):
        blk, Ls = self._blocking(spec, ch)
        nd, wd = narrow_dtype(spec), walk_dtype(spec)
        # dO in the 16-bit input dtype: exact (o, so its cotangent, has q's dtype)
        chb = blk.tree_block(_narrow_inputs(ch, nd))
        docb = blk.block(doc if nd is None else doc.astype(nd))
        f = recurrence.flags(blk, layout)
        stride = spec.checkpoint_stride
        batched = recurrence.is_batched(blk, layout)
        if Ls is not None:
            if states is None:      # not kept (a direct caller): recompute them
                stride = 1
                states = recurrence.forward_segmented(chb, f, h0, spec.N, 1, h0.dtype,
                                                      spec.scale, Ls, batched, narrow=nd)[2]
            dchb, first = recurrence.backward_segmented(chb, docb, f, h0, dfinal, states,
                                                        spec.N, stride, spec.scale, Ls,
                                                        batched, nd, wd)
        else:
            it, X, x, _ = recurrence.factors_and_operands(chb, spec.scale,
                                                          grid.every_of(doc.shape[-2]), nd)
            if states is None:      # not kept (a direct caller): recompute them
                stride = 1
                states = recurrence.forward(blk, x, f, h0, spec.N, 1, h0.dtype, batched)[2]
            S0 = recurrence.states_from_checkpoints(x, f, h0, states, stride, batched)
            rev = recurrence.Reverse(it.w, it.Kt, it.G_last, x.qg, x.P, docb)
            dS_end, first = recurrence.reverse(blk, rev, f, dfinal, spec.N, batched, wd)
            dchb = local_grads_in_blocks(chb, it, X, S0, docb, dS_end, spec.scale)
        dh0 = where_has_tokens(layout, first, dfinal)
        return blk.tree_unblock(dchb), dh0

    def forward_summaries(self, spec, ch, layout):
        return chunked.forward_summaries(ch, layout), None

    def backward_summaries(self, spec, ch, layout, doc, dfinal):
        return chunked.backward_summaries(ch, layout, doc, dfinal, spec.scale), None

    # The CP rank's pair: one pass per direction on V + K columns where the pass is one
    # level (no segments, no two-level blocking), else the summaries and a second pass.

    def _one_level(self, spec, ch):
        blk, Ls = self._blocking(spec, ch)
        return blk if Ls is None and blk.NB == 1 else None

    def forward_prepare(self, spec, ch, layout, h0p, differentiated=False, keep_states=True,
                        tokens=None):
        """The forward on v = [v | 0] from [h0p | I], keeping its checkpoints (in the
        compute dtype: apply adds their response to them before they are rounded to the
        checkpoint dtype; none without ``keep_states``): ((E, M),
        :class:`ForwardResponse`). ``tokens`` unused."""
        blk = self._one_level(spec, ch)
        if blk is None:
            return self.forward_summaries(spec, ch, layout)
        K, V = ch.k.shape[-1], ch.v.shape[-1]
        h0p = h0p.astype(spec.cdt)
        h0x = identity_columns(h0p, K)
        c = _narrow_inputs(ch, narrow_dtype(spec))
        chb = blk.tree_block(c._replace(v=zero_columns(c.v, K)))
        o, final, states = self._walk(spec, blk, chb, recurrence.flags(blk, layout), h0x,
                                      spec.checkpoint_stride if keep_states else 0, spec.cdt,
                                      recurrence.is_batched(blk, layout), narrow_states=False)
        o = blk.unblock(o)
        final = where_has_tokens(layout, final, h0x)
        M = final[..., V:]
        E = final[..., :V] - mm_exact(M, h0p)    # the map from a zero start
        return (E, M), ForwardResponse(h0p, o, final, states, None)

    def forward_resume(self, spec, ch, layout, h0, seqs, work, keep_states=True):
        if not isinstance(work, ForwardResponse):
            return super().forward_resume(spec, ch, layout, h0, seqs, work, keep_states)
        blk = self._one_level(spec, ch)
        o, final, delta = resume_rows_and_final(work, layout, h0, seqs)
        if work.states is None:
            return o, final, None
        seq_ck = blk.block(layout.seq_of_chunk)[::spec.checkpoint_stride]    # [NG, B]
        states = _add_response_time_major(work.states, h0.shape[-1], seq_ck, seqs, delta)
        return o, final, states.astype(spec.checkpoint_dtype)

    def backward_prepare(self, spec, ch, layout, doc, dfinal):
        """The reverse pass from dfinal = [dfinal | I] with dO = [dO | 0]:
        ((gamma, M^T), :class:`XlaBackwardResponse`)."""
        blk = self._one_level(spec, ch)
        if blk is None:
            return self.backward_summaries(spec, ch, layout, doc, dfinal)
        K, V = ch.k.shape[-1], ch.v.shape[-1]
        nd = narrow_dtype(spec)
        chb, f = blk.tree_block(_narrow_inputs(ch, nd)), recurrence.flags(blk, layout)
        it, X = chunked.wy_factors(chb, narrow=nd)
        x, _ = recurrence.forward_operands(chb, it, spec.scale, grid.every_of(doc.shape[-2]),
                                           nd)
        dfx = identity_columns(dfinal, K)
        doc = doc if nd is None else doc.astype(nd)
        rev = recurrence.Reverse(it.w, it.Kt, it.G_last, x.qg, x.P,
                                 blk.block(zero_columns(doc, K)))
        dS_end, first = recurrence.reverse(blk, rev, f, dfx, spec.N,
                                           recurrence.is_batched(blk, layout))
        first = where_has_tokens(layout, first, dfx)
        return ((first[..., :V], first[..., V:]),
                XlaBackwardResponse(it, X, x, dfinal, dS_end, first))

    def backward_resume(self, spec, ch, layout, h0, doc, dfinal, states, seqs, work):
        if not isinstance(work, XlaBackwardResponse):
            return super().backward_resume(spec, ch, layout, h0, doc, dfinal, states, seqs,
                                           work)
        blk, V = self._one_level(spec, ch), dfinal.shape[-1]
        f = recurrence.flags(blk, layout)
        ddf = dfinal - work.dfinal                       # 0 outside ``seqs``
        dS_end = _add_response_time_major(work.dS_end, V, f.seq, seqs, ddf)
        wd = walk_dtype(spec)   # the local gradients read what one device's would
        dS_end = dS_end if wd is None else dS_end.astype(wd)
        dh0 = work.first[..., :V] + mm_exact(work.first[..., V:], ddf)
        S0 = recurrence.states_from_checkpoints(work.x, f, h0, states, spec.checkpoint_stride,
                                                recurrence.is_batched(blk, layout))
        chb = blk.tree_block(_narrow_inputs(ch, narrow_dtype(spec)))
        dchb = chunked.local_grads_direct(chb, work.it, work.X, S0, blk.block(doc), dS_end,
                                          spec.scale)
        dh0 = where_has_tokens(layout, dh0, dfinal)
        return blk.tree_unblock(dchb), dh0


XLA = XlaEngine()


# --- the grid around an engine: shared by the single-device op and the CP backends --------

class OpTokens(NamedTuple):
    """The single-device op's inputs token-major, for an engine that reads them itself:
    ``raw`` = (q [B, T, H, K], k [B, T, n, H, K], v [B, T, n, HV, V]) as the caller gave
    them; ``tok`` = :func:`gdp_jax.grid.tokens_of`'s per-token operands (q, k, v, g,
    beta: L2-normalised, GVA-repeated to HV heads, in the compute dtype) - the values the
    chunk inputs are laid out from; in the backward ``do`` = the output cotangent
    [B, T, HV, V] token-major (compute dtype), for kernels that read it themselves."""
    raw: tuple
    tok: tuple
    do: Optional[jax.Array] = None


class TokenOutputs(NamedTuple):
    """Output rows an engine's forward may return instead of chunk rows: o [B, T, HV, V]
    token-major already (:func:`outputs` only casts it)."""
    o: jax.Array


class TokenCotangents(NamedTuple):
    """Cotangents an engine's backward may return instead of chunk-input ones: q, k, v
    already in the token-major layout of :func:`gdp_jax.grid.token_inputs`' operands -
    q [B, T, HV, K], k [B, T, n, HV, K], v [B, T, n, HV, V] (any float dtype) - and g,
    beta on the chunk grid [B, NC, HV, C] (those of :class:`gdp_jax.grid.ChunkInputs`)."""
    q: jax.Array
    k: jax.Array
    v: jax.Array
    g: jax.Array
    beta: jax.Array


class RawTokenCotangents(TokenCotangents):
    """:class:`TokenCotangents` whose q, k cotangents are already those of the raw
    (un-normalised) q, k of an op with the in-op L2 norm - per value head, before the GVA
    head sum (the engine applied the norm's backward itself)."""


class ForwardProblem(NamedTuple):
    layout: grid.ChunkLayout
    ch: grid.ChunkInputs


class BackwardProblem(NamedTuple):
    layout: grid.ChunkLayout
    ch: grid.ChunkInputs
    pull_inputs: object          # ChunkInputs / TokenCotangents -> (dq, dk, dv, dg, dbeta)
    doc: jax.Array               # [B, NC, HV, C // every, V] read-out-row cotangents
    dfinal: jax.Array            # [N, HV, K, V] final-state cotangents (compute dtype)
    tokens: OpTokens             # the inputs token-major (Engine.backward's ``tokens``)


def _cast_fields(tok, dtypes):
    """Per-token operands (:func:`gdp_jax.grid.tokens_of`) with the fields named in
    ``dtypes`` ({ChunkInputs field: dtype}) cast."""
    return tuple(x.astype(dtypes[f]) if f in dtypes else x
                 for f, x in zip(grid.ChunkInputs._fields, tok))


def forward_problem(spec: CallSpec, q, k, v, g, beta, cu_seqlens,
                    dtypes=None) -> ForwardProblem:
    """The layout and chunk inputs of one call; ``dtypes``: an engine's
    :meth:`Engine.input_dtypes` (its narrow fields come in those dtypes)."""
    layout = grid.layout_of(spec, cu_seqlens)
    tok = _cast_fields(grid.tokens_of(spec, q, k, v, g, beta), dtypes or {})
    return ForwardProblem(layout, grid.steps_to_chunks(layout, *tok))


def backward_problem(spec: CallSpec, q, k, v, g, beta, cu_seqlens, do, dfinal,
                     dtypes=None):
    """The chunk inputs (``dtypes``: :func:`forward_problem`) with their vjp, and the
    cotangents on the grid (``doc`` on the read-out rows of every chunk only,
    :func:`gdp_jax.grid.readout_every`)."""
    layout = grid.layout_of(spec, cu_seqlens)
    tok, pull_tokens = jax.vjp(lambda *a: grid.tokens_of(spec, *a), q, k, v, g, beta)
    # the same map without the L2 norm (RawTokenCotangents: the engine pulled through it)
    pull_plain = pull_tokens
    if spec.use_qk_l2norm:
        _, pull_plain = jax.vjp(lambda *a: grid.tokens_of(
            dataclasses.replace(spec, use_qk_l2norm=False), *a), q, k, v, g, beta)
    ch = grid.steps_to_chunks(layout, *_cast_fields(tok, dtypes or {}))
    # the relayout is linear: its vjp at the compute-dtype operands takes the engine's
    # cotangents whatever ``dtypes`` cast
    _, pull_steps = jax.vjp(lambda *t: grid.steps_to_chunks(layout, *t), *tok)
    # g and beta alone (TokenCotangents: the engine laid q, k, v out itself)
    _, pull_gates = jax.vjp(lambda g_, b_: tuple(grid.steps_to_chunks(layout, *tok[:3], g_,
                                                                       b_))[3:], *tok[3:])

    # a Partial (a pytree of its residuals), so the problem can leave a jax.vmap
    pull_inputs = jax.tree_util.Partial(_pull_inputs, pull_tokens, pull_plain, pull_steps,
                                        pull_gates, tuple(tok))
    doc = grid.readout_cotangent(layout, do.astype(spec.cdt), grid.readout_every(spec.n))
    return BackwardProblem(layout, ch, pull_inputs, doc, dfinal.astype(spec.cdt),
                           OpTokens((q, k, v), tok, do.astype(spec.cdt)))


def _pull_inputs(pull_tokens, pull_plain, pull_steps, pull_gates, tok, dch):
    """:class:`BackwardProblem`'s ``pull_inputs``: chunk-input (or token-major)
    cotangents -> those of (q, k, v, g, beta)."""
    if isinstance(dch, TokenCotangents):
        dg, dbeta = pull_gates((dch.g.astype(tok[3].dtype), dch.beta.astype(tok[4].dtype)))
        dqkv = tuple(d.astype(t.dtype) for d, t in zip(dch[:3], tok[:3]))
        pull = pull_plain if isinstance(dch, RawTokenCotangents) else pull_tokens
        return pull(_vma.cotangent_like(dqkv, tuple(tok[:3])) + (dg, dbeta))
    return pull_tokens(pull_steps(dch))


def outputs(layout, oc, dtype):
    """Output rows [B, NC, HV, C or C // every, V] (or :class:`TokenOutputs`) -> o
    [B, T, HV, V] in ``dtype``."""
    if isinstance(oc, TokenOutputs):
        return oc.o.astype(dtype)
    return grid.from_chunks(layout, oc).astype(dtype)


def start_states(spec: CallSpec, h0):
    """h0 [N, HV, K, V] in the compute dtype, or zeros for None: made here, inside the
    op, so they are never kept as a custom_vjp residual."""
    if h0 is not None:
        return h0.astype(spec.cdt)
    return jnp.zeros((spec.N, spec.HV, spec.K, spec.V), spec.cdt)
