"""The four-function CP backend protocol, its summaries and its saved context.

Per rank (docs/ALGORITHMS.md 3): a fragment of a sequence maps the state entering it to the
state leaving it affinely, ``S_out = M S_in + E``; gradients flow back as
``dS_in = M^T dS_out + gamma``. A rank sends the float32 summary of its TRAILING fragment
forward, packed ``[E | M]``, and of its LEADING fragment backward, packed ``[gamma | M^T]``:
``[HV, K, V + K]`` for packed sequences (one fragment), ``[B, HV, K, V + K]`` in the batched
layout (every row spans all ranks).

    cp_forward_prepare(inputs)                      -> (summary, local_ctx)
    cp_forward_apply(local_ctx, preceding)          -> (output, final_states, saved_ctx)
    cp_backward_prepare((do, dfinal), saved_ctx)    -> (summary, bwd_ctx)
    cp_backward_apply(bwd_ctx, following)           -> (dq, dk, dv, dg, dbeta, dh0)

The driver owns the collectives and the rank masks; backends see only local tensors and
masked slices (:class:`SummarySlice`) of the gathered summaries.
"""
from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
from jax import lax

from gdp_jax import _vma, chunked

SUMMARY_DTYPE = jnp.float32        # float64 only when the whole op runs in float64
SUMMARY_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.float64))


def summary_dtype(compute_dtype):
    """float32, or float64 for float64 computations (exact tests)."""
    return jnp.promote_types(SUMMARY_DTYPE, compute_dtype)


# --- summaries ----------------------------------------------------------------------------

def pack_forward_summary(E, M):
    """[.., HV, K, V] state update E and [.., HV, K, K] transition M -> [.., HV, K, V + K]."""
    return jnp.concatenate([E, M], axis=-1).astype(summary_dtype(E.dtype))


def pack_backward_summary(gamma, Mt):
    """[.., HV, K, V] gradient gamma and [.., HV, K, K] transposed transition -> [.., HV, K, V+K]."""
    return jnp.concatenate([gamma, Mt], axis=-1).astype(summary_dtype(gamma.dtype))


def unpack_summary(packed, V: int):
    """[.., HV, K, V + K] -> (first V columns, last K columns)."""
    validate_summary(packed, V=V)
    return packed[..., :V], packed[..., V:]


def validate_summary(packed, *, V: int, K: Optional[int] = None):
    """Raise if ``packed`` is not a float32 (or float64) ``[.., HV, K, V + K]`` summary."""
    if not hasattr(packed, "dtype") or jnp.dtype(packed.dtype) not in SUMMARY_DTYPES:
        raise TypeError(f"CP summary has dtype {getattr(packed, 'dtype', type(packed))}; "
                        "expected float32 (float64 for float64 inputs)")
    if packed.ndim < 3:
        raise ValueError(f"CP summary has shape {packed.shape}; expected [.., HV, K, V + K]")
    Kp = packed.shape[-2]
    if K is not None and Kp != K:
        raise ValueError(f"CP summary has shape {packed.shape}; expected K={K} rows")
    if packed.shape[-1] != V + Kp:
        raise ValueError(f"CP summary has shape {packed.shape}; expected last dim "
                         f"V + K = {V} + {Kp}")


class SummarySlice(NamedTuple):
    """The gathered summaries of all P ranks and which of them this rank composes.

    packed: [P, F, HV, K, V + K] float32 (F fragments: 1 packed, B batched); mask: [P] bool.
    A static-shape stand-in for Megatron's ``gathered[a:r]`` / ``gathered[r+1:f]`` slices.
    """
    packed: jax.Array
    mask: jax.Array


def fold_forward(preceding: SummarySlice, start_state):
    """Compose the preceding ranks' maps in causal order: S <- M_j S + E_j for masked j.

    start_state: [F, HV, K, V] the state entering the first of them (the sequence's initial
    state, or zeros). Returns the state entering this rank, float32.
    """
    V = start_state.shape[-1]

    def step(S, xs):
        packed, on = xs
        E, M = packed[..., :V], packed[..., V:]
        return jnp.where(on, M @ S + E, S), None

    xs = (preceding.packed, preceding.mask)
    init = start_state.astype(summary_dtype(preceding.packed.dtype))
    S, _ = lax.scan(step, _vma.like(init, xs), xs)
    return S


def fold_backward(following: SummarySlice, V: int):
    """Compose the following ranks' maps from the farthest back: dS <- M_j^T dS + gamma_j.

    Returns the gradient w.r.t. the state leaving this rank, [F, HV, K, V] float32.
    """
    packed = following.packed

    def step(dS, xs):
        p, on = xs
        gamma, Mt = p[..., :V], p[..., V:]
        return jnp.where(on, Mt @ dS + gamma, dS), None

    init = jnp.zeros(packed.shape[1:-1] + (V,), packed.dtype)
    xs = (packed, following.mask)
    dS, _ = lax.scan(step, _vma.like(init, xs), xs, reverse=True)
    return dS


# --- inputs and saved context -------------------------------------------------------------

class GDPInputs(NamedTuple):
    """One rank's local inputs (API shapes with the LOCAL T) and its boundary facts.

    initial_state: [N, HV, K, V] user start states (zeros where none); packed sequences
      keep their global index 0..N-1 (pieces not on this rank have zero local length).
    cu_seqlens: [N + 1] LOCAL offsets, or None (batched: every row is one fragment).
    first_seq, last_seq: [F] int32 sequences holding the rank's first / last token.
    continues_in, continues_out: [] bool, the first / last sequence crosses the rank's
      start / end boundary.
    """
    q: jax.Array
    k: jax.Array
    v: jax.Array
    g: Optional[jax.Array]
    beta: jax.Array
    initial_state: jax.Array
    cu_seqlens: Optional[jax.Array]
    first_seq: jax.Array
    last_seq: jax.Array
    continues_in: jax.Array
    continues_out: jax.Array


@dataclasses.dataclass(frozen=True)
class GDPSavedMetadata:
    """Non-tensor facts needed to rebuild the saved CP context in the backward."""
    scale: float
    num_householder: int
    use_qk_l2norm_in_kernel: bool
    recompute_chunk_num: int
    has_initial_states: bool
    has_cu_seqlens: bool
    has_gate: bool
    config: Any                  # gdp_jax.ops.OpConfig (frozen, hashable)
    has_chunk_states: bool = False   # the forward kernel's chunk-state checkpoints saved
    fold: str = "gather"         # the CP fold that ran: 'gather' (all_gather) or 'scan'

    @property
    def num_tensors(self) -> int:
        return (9 + int(self.has_gate) + int(self.has_cu_seqlens)
                + int(self.has_chunk_states))


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True)
class SavedContext:
    """Residual tensors (custom_vjp residuals) plus static metadata (the pytree aux data)."""
    tensors: tuple
    metadata: GDPSavedMetadata

    def tree_flatten(self):
        return self.tensors, self.metadata

    @classmethod
    def tree_unflatten(cls, metadata, tensors):
        return cls(tuple(tensors), metadata)


def save_context(inputs: GDPInputs, metadata: GDPSavedMetadata,
                 chunk_states=None) -> SavedContext:
    """Tensor order: q, k, v, beta, initial_state (composed), first_seq, last_seq,
    continues_in, continues_out, [g], [cu_seqlens], [chunk-state checkpoints]."""
    t = (inputs.q, inputs.k, inputs.v, inputs.beta, inputs.initial_state, inputs.first_seq,
         inputs.last_seq, inputs.continues_in, inputs.continues_out)
    if metadata.has_gate:
        t += (inputs.g,)
    if metadata.has_cu_seqlens:
        t += (inputs.cu_seqlens,)
    if metadata.has_chunk_states:
        t += (chunk_states,)
    return SavedContext(t, metadata)


def restore_saved_context(saved: SavedContext, metadata_type=None):
    """SavedContext -> (GDPInputs, metadata), checking the metadata type and tensor count."""
    metadata_type = metadata_type or GDPSavedMetadata
    if not isinstance(saved.metadata, metadata_type):
        raise TypeError(f"saved CP context metadata is {type(saved.metadata).__name__}; "
                        f"expected {metadata_type.__name__}")
    md = saved.metadata
    if len(saved.tensors) != md.num_tensors:
        raise ValueError(f"saved CP context holds {len(saved.tensors)} tensors; expected "
                         f"{md.num_tensors} for has_gate={md.has_gate}, "
                         f"has_cu_seqlens={md.has_cu_seqlens}")
    q, k, v, beta, h0, first, last, cin, cout, *rest = saved.tensors
    g = rest.pop(0) if md.has_gate else None
    cu = rest.pop(0) if md.has_cu_seqlens else None
    return GDPInputs(q, k, v, g, beta, h0, cu, first, last, cin, cout), md


def saved_chunk_states(saved: SavedContext):
    """The chunk-state checkpoints of a restored context (None if it keeps none)."""
    return saved.tensors[-1] if saved.metadata.has_chunk_states else None


# --- the xla backend ----------------------------------------------------------------------

class _LocalForward(NamedTuple):
    inputs: GDPInputs
    layout: chunked.ChunkLayout
    ch: chunked.ChunkInputs
    shared: Any = None          # backend work done in prepare and reused in apply


class _LocalBackward(NamedTuple):
    inputs: GDPInputs
    metadata: GDPSavedMetadata
    layout: chunked.ChunkLayout
    ch: chunked.ChunkInputs
    pull_inputs: Any
    doc: jax.Array
    dfinal: jax.Array
    chunk_states: Optional[jax.Array]
    shared: Any = None


class XlaGatedDeltaProductCPBackend:
    """The CP protocol on the pure-JAX chunkwise engine (:mod:`gdp_jax.chunked`)."""

    name = "xla"
    recompute_chunk_num = 0

    def _forward_summaries(self, ch, layout, q_dtype):
        """((E, M) of every local sequence, work to reuse in apply): here the parallel
        composition of the chunk maps (no extra sequential pass over chunks)."""
        return chunked.forward_summaries(ch, layout), None

    def _backward_summaries(self, ch, layout, doc, dfinal, q_dtype):
        """((gamma, M^T) of every local sequence, work to reuse in apply)."""
        return chunked.backward_summaries(ch, layout, doc, dfinal, self.config.scale), None

    def __init__(self, config):
        self.config = config          # gdp_jax.ops.OpConfig of the LOCAL shard

    def __hash__(self):
        return hash((type(self), self.config, self.recompute_chunk_num))

    def __eq__(self, other):
        return (type(self) is type(other) and self.config == other.config
                and self.recompute_chunk_num == other.recompute_chunk_num)

    def _local_forward(self, ch, layout, h0, q_dtype, shared):
        """(output rows, final states, chunk-state checkpoints or None) of the local shard
        from start states h0 (``shared``: what :meth:`_forward_summaries` computed)."""
        oc, final, _ = chunked.chunk_forward(ch, layout, h0, self.config.scale)
        return oc, final, None

    def _local_backward(self, ch, layout, h0, doc, dfinal, chunk_states, q_dtype, shared):
        """(chunk-input cotangents, start-state gradients) of the local shard."""
        return chunked.chunk_backward(ch, layout, h0, doc, dfinal, self.config.scale)

    def _chunks(self, inputs: GDPInputs, layout):
        cfg = self.config
        return cfg.chunk_inputs(layout, inputs.q, inputs.k, inputs.v, inputs.g, inputs.beta)

    @staticmethod
    def _pack_shape(x, packed_layout: bool):
        # Packed sequences have one fragment per rank: API shape [HV, K, V + K].
        return x[0] if packed_layout else x

    def cp_forward_prepare(self, inputs: GDPInputs):
        """Trailing-fragment summary [E | M] (zero incoming state) and the local context."""
        cfg = self.config
        layout = cfg.layout(inputs.cu_seqlens)
        ch = self._chunks(inputs, layout)
        (E, M), shared = self._forward_summaries(ch, layout, inputs.q.dtype)
        E, M = E[inputs.last_seq], M[inputs.last_seq]
        summary = self._pack_shape(pack_forward_summary(E, M), inputs.cu_seqlens is not None)
        return summary, _LocalForward(inputs, layout, ch, shared)

    def cp_forward_apply(self, local_ctx: _LocalForward, preceding: SummarySlice):
        """Fold the preceding maps into the incoming state, then run the local forward.

        Returns (o [B, T, HV, V], local final states [N, HV, K, V], SavedContext).
        """
        cfg = self.config
        inputs, layout, ch, shared = local_ctx
        h0 = inputs.initial_state.astype(cfg.cdt)
        S_in = fold_forward(preceding, h0[inputs.first_seq]).astype(cfg.cdt)
        h0 = h0.at[inputs.first_seq].set(
            jnp.where(inputs.continues_in, S_in, h0[inputs.first_seq]))
        oc, final, states = self._local_forward(ch, layout, h0, inputs.q.dtype, shared)
        o = chunked.from_chunks(layout, oc).astype(inputs.q.dtype)
        md = GDPSavedMetadata(
            scale=cfg.scale, num_householder=cfg.n, use_qk_l2norm_in_kernel=cfg.use_qk_l2norm,
            recompute_chunk_num=self.recompute_chunk_num, has_initial_states=True,
            has_cu_seqlens=inputs.cu_seqlens is not None, has_gate=inputs.g is not None,
            config=cfg, has_chunk_states=states is not None)
        return o, final, save_context(inputs._replace(initial_state=h0), md, states)

    def cp_backward_prepare(self, output_grad, saved_ctx: SavedContext):
        """Leading-fragment summary [gamma | M^T] (zero outgoing-state gradient).

        output_grad: (do [B, T, HV, V], dfinal [N, HV, K, V] for sequences ending here).
        """
        from gdp_jax.ops import chunk_shape, readout_cotangent
        inputs, md = restore_saved_context(saved_ctx)
        cfg = md.config
        do, dfinal = output_grad
        layout = cfg.layout(inputs.cu_seqlens)
        ch, pull = jax.vjp(lambda *a: cfg.chunk_inputs(layout, *a),
                           inputs.q, inputs.k, inputs.v, inputs.g, inputs.beta)
        doc = readout_cotangent(layout, do.astype(cfg.cdt),
                                chunk_shape(cfg, layout, inputs.v.shape[-1]))
        dfinal = dfinal.astype(cfg.cdt)
        (gamma, Mt), shared = self._backward_summaries(ch, layout, doc, dfinal, inputs.q.dtype)
        gamma, Mt = gamma[inputs.first_seq], Mt[inputs.first_seq]
        summary = self._pack_shape(pack_backward_summary(gamma, Mt),
                                   inputs.cu_seqlens is not None)
        return summary, _LocalBackward(inputs, md, layout, ch, pull, doc, dfinal,
                                       saved_chunk_states(saved_ctx), shared)

    def cp_backward_apply(self, bwd_ctx: _LocalBackward, following: SummarySlice):
        """Fold the following maps into the outgoing-state gradient; all local gradients.

        Returns (dq, dk, dv, dg or None, dbeta, dh0 [N, HV, K, V]); dh0 is the gradient
        w.r.t. the LOCAL start states (the driver keeps the entries of sequences that
        start on this rank).
        """
        inputs, md, layout, ch, pull, doc, dfinal, states, shared = bwd_ctx
        cfg = md.config
        V = inputs.v.shape[-1]
        dS_out = fold_backward(following, V).astype(cfg.cdt)
        dfinal = dfinal.at[inputs.last_seq].add(
            jnp.where(inputs.continues_out, dS_out, 0.0))
        dch, dh0 = self._local_backward(ch, layout, inputs.initial_state, doc, dfinal, states,
                                        inputs.q.dtype, shared)
        dq, dk, dv, dg, dbeta = pull(dch)
        return dq, dk, dv, dg, dbeta, dh0


class CuTeDSLGatedDeltaProductCPBackend(XlaGatedDeltaProductCPBackend):
    """The CP protocol with the local passes on the Hopper CuTe DSL kernels (sm_90a).

    ``cp_forward_apply`` runs the fused forward chunk kernel, which also keeps the start
    state of every (N + 1)-th chunk, N = ``recompute_chunk_num`` in [0, 64] (saved in the
    SavedContext, [B, ceil(NC / (N + 1)), HV, K, V], bf16 for bf16 inputs else float32).
    ``cp_backward_apply`` recomputes the missing states from those checkpoints and runs
    the reverse dS kernel (:mod:`gdp_jax.kernels.bwd`). The two prepare steps run the
    same kernels on V + K state columns: [E | M] and [gamma | M^T] come out of one forward
    / one reverse pass (``kernels.fwd.forward_summaries``, ``kernels.bwd.backward_summaries``).
    """

    name = "cutedsl"

    # prepare and apply share the XLA work (WY factors, kernel operands): computed once.
    def _forward_summaries(self, ch, layout, q_dtype):
        from gdp_jax.kernels import fwd as kernel_fwd
        operands = kernel_fwd.chunk_operands(ch, self.config.scale, q_dtype)
        E, M = kernel_fwd.forward_summaries(ch, layout, self.config.scale, q_dtype, operands)
        return _vma.like((E, M), ch), operands

    def _backward_summaries(self, ch, layout, doc, dfinal, q_dtype):
        from gdp_jax.kernels import bwd as kernel_bwd
        shared = kernel_bwd.shared_backward_work(ch, doc, self.config.scale, q_dtype)
        gamma, Mt = kernel_bwd.backward_summaries(ch, layout, doc, dfinal, self.config.scale,
                                                  q_dtype, shared)
        return _vma.like((gamma.astype(dfinal.dtype), Mt.astype(dfinal.dtype)), ch, doc,
                         dfinal), shared

    def __init__(self, config=None, recompute_chunk_num: int = 0):
        from gdp_jax import _checks, backends
        _checks.check_recompute_chunk_num(recompute_chunk_num)
        ok, reason = backends.cutedsl_available()
        if not ok:
            raise ValueError(f"CuTeDSLGatedDeltaProductCPBackend cannot run here: {reason}")
        super().__init__(config)
        self.recompute_chunk_num = recompute_chunk_num

    def _local_forward(self, ch, layout, h0, q_dtype, shared):
        from gdp_jax.kernels import fwd as kernel_fwd
        oc, final, states = kernel_fwd.chunk_forward(ch, layout, h0, self.config.scale,
                                                     q_dtype, ckpt=self.recompute_chunk_num + 1,
                                                     operands=shared)
        # The custom call's results carry no varying-axes type: give them the inputs'.
        return _vma.like((oc, final.astype(h0.dtype), states), ch, h0)

    def _local_backward(self, ch, layout, h0, doc, dfinal, chunk_states, q_dtype, shared):
        from gdp_jax.kernels import bwd as kernel_bwd
        return kernel_bwd.chunk_backward(ch, layout, h0, chunk_states,
                                         self.recompute_chunk_num + 1, doc, dfinal,
                                         self.config.scale, q_dtype, shared)
