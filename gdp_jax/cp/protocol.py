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

import copy
import dataclasses
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
from jax import lax

from gdp_jax import _vma
from gdp_jax.engine import XLA, backward_problem, forward_problem, outputs
from gdp_jax.spec import CallSpec

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

    def spec(self, *, scale: float, num_householder: int, use_qk_l2norm: bool,
             recompute_chunk_num: int) -> CallSpec:
        """The local shard's :class:`CallSpec`, from these tensors' shapes and dtypes."""
        B, T, H, K = self.q.shape
        HV, V = self.v.shape[3], self.v.shape[4]
        if self.k.shape[2] != num_householder:
            raise ValueError(f"saved CP context: k has shape {self.k.shape}; expected "
                             f"n = num_householder = {num_householder}")
        cdt = "float64" if jnp.dtype(self.q.dtype) == jnp.float64 else "float32"
        return CallSpec(B=B, T=T, n=num_householder, H=H, HV=HV, K=K, V=V,
                        N=self.initial_state.shape[0], scale=scale,
                        input_dtype=jnp.dtype(self.q.dtype).name, compute_dtype=cdt,
                        has_gate=self.g is not None, packed=self.cu_seqlens is not None,
                        use_qk_l2norm=use_qk_l2norm, recompute_chunk_num=recompute_chunk_num)


@dataclasses.dataclass(frozen=True)
class GDPSavedMetadata:
    """Non-tensor facts needed to rebuild the saved CP context in the backward (the
    backward's spec is rebuilt from these and the saved tensors' shapes)."""
    scale: float
    num_householder: int
    use_qk_l2norm_in_kernel: bool
    recompute_chunk_num: int
    has_initial_states: bool
    has_cu_seqlens: bool
    has_gate: bool
    has_chunk_states: bool = False   # the forward kernel's chunk-state checkpoints saved
    fold: str = "gather"         # the CP fold that ran: 'gather' (all_gather) or 'scan'
    forward_only: bool = False   # from a backend's for_inference(): no backward can use it

    @classmethod
    def of(cls, spec: CallSpec, *, has_chunk_states: bool, fold: str = "gather",
           forward_only: bool = False):
        return cls(scale=spec.scale, num_householder=spec.n,
                   use_qk_l2norm_in_kernel=spec.use_qk_l2norm,
                   recompute_chunk_num=spec.recompute_chunk_num, has_initial_states=True,
                   has_cu_seqlens=spec.packed, has_gate=spec.has_gate,
                   has_chunk_states=has_chunk_states, fold=fold, forward_only=forward_only)

    def spec(self, inputs: GDPInputs) -> CallSpec:
        return inputs.spec(scale=self.scale, num_householder=self.num_householder,
                           use_qk_l2norm=self.use_qk_l2norm_in_kernel,
                           recompute_chunk_num=self.recompute_chunk_num)


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True)
class SavedContext:
    """Residual tensors (custom_vjp residuals) plus static metadata (the pytree aux data).

    inputs: the rank's :class:`GDPInputs` with the COMPOSED incoming state as
    initial_state (None entries: absent g / cu_seqlens); chunk_states: the forward
    kernel's checkpoints [B, ceil(NC / (N + 1)), HV, K, V], or None.
    """
    inputs: GDPInputs
    chunk_states: Optional[jax.Array]
    metadata: GDPSavedMetadata

    def tree_flatten(self):
        return (self.inputs, self.chunk_states), self.metadata

    @classmethod
    def tree_unflatten(cls, metadata, children):
        return cls(*children, metadata)


def restore_saved_context(saved: SavedContext, metadata_type=None):
    """SavedContext -> (GDPInputs, metadata), checking the metadata's type and that the
    tensors are the ones it describes."""
    metadata_type = metadata_type or GDPSavedMetadata
    if not isinstance(saved.metadata, metadata_type):
        raise TypeError(f"saved CP context metadata is {type(saved.metadata).__name__}; "
                        f"expected {metadata_type.__name__}")
    md, inputs = saved.metadata, saved.inputs
    if md.forward_only:
        raise ValueError("saved CP context: it came from a forward-only backend "
                         "(for_inference()), which keeps no chunk states for a backward; "
                         "run the forward with the backend itself (or its "
                         "for_differentiation()) when a backward follows")
    for name, has, x in (("initial_states", md.has_initial_states, inputs.initial_state),
                         ("g", md.has_gate, inputs.g),
                         ("cu_seqlens", md.has_cu_seqlens, inputs.cu_seqlens),
                         ("chunk_states", md.has_chunk_states, saved.chunk_states)):
        if has != (x is not None):
            raise ValueError(f"saved CP context: {name} is {'absent' if x is None else 'present'}"
                             f" but the metadata says has_{name}={has}")
    return inputs, md


# --- the backends: the protocol, once, on an engine ---------------------------------------

class _LocalForward(NamedTuple):
    spec: CallSpec
    inputs: GDPInputs
    layout: object
    ch: object
    work: Any = None            # engine work done in prepare and reused in apply


class _LocalBackward(NamedTuple):
    spec: CallSpec
    inputs: GDPInputs
    problem: Any                # gdp_jax.engine.BackwardProblem
    chunk_states: Optional[jax.Array]
    work: Any = None


def provisional_start_states(spec: CallSpec, inputs: GDPInputs):
    """[N, HV, K, V] start states as prepare knows them: the user's, with zeros for the
    first sequence when it continues in (apply folds its start state in) and for the last
    when it continues out (its summary is the map from a zero start)."""
    h0 = inputs.initial_state.astype(spec.cdt)
    f, l = inputs.first_seq, inputs.last_seq
    h0 = h0.at[f].set(jnp.where(inputs.continues_in, 0.0, h0[f]))
    return h0.at[l].set(jnp.where(inputs.continues_out, 0.0, h0[l]))


def _crossing(inputs: GDPInputs):
    """The sequences whose start state apply may change (one per row each): the first
    and the last (the same rows in the batched layout)."""
    if inputs.cu_seqlens is None:
        return (inputs.first_seq,)
    return (inputs.first_seq, inputs.last_seq)


class XlaGatedDeltaProductCPBackend:
    """The CP protocol on the pure-JAX engine (:class:`gdp_jax.engine.XlaEngine`).

    ``config``: the LOCAL shard's :class:`gdp_jax.spec.CallSpec` (the driver passes it).
    Subclasses change only :attr:`engine`.
    """

    name = "xla"
    engine = XLA

    def __init__(self, config: Optional[CallSpec] = None):
        self.config = config

    @property
    def recompute_chunk_num(self) -> int:
        return 0 if self.config is None else self.config.recompute_chunk_num

    #: True when the backward follows in the same program (set by the driver's custom_vjp
    #: forward rule): an engine may then build the forward's work the way the backward
    #: builds it, so that XLA computes it once for both.
    differentiated = False

    #: False when no backward will use the forward (set by the driver's custom_vjp primal,
    #: which runs only when nothing differentiates the call): the forward then keeps no
    #: chunk states, and the rank's cutedsl operands kernel reads q, k, v token-major.
    keeps_states = True

    def for_differentiation(self):
        """This backend with :attr:`differentiated` set."""
        new = copy.copy(self)
        new.differentiated = True
        return new

    def for_inference(self):
        """This backend for a forward that no backward follows (:attr:`keeps_states`
        False): cp_forward_apply's SavedContext then cannot start a backward
        (cp_backward_prepare raises ValueError)."""
        new = copy.copy(self)
        new.keeps_states = False
        return new

    def __hash__(self):
        return hash((type(self), self.config, self.differentiated, self.keeps_states))

    def __eq__(self, other):
        return (type(self) is type(other) and self.config == other.config
                and self.differentiated == other.differentiated
                and self.keeps_states == other.keeps_states)

    @staticmethod
    def _pack_shape(x, packed_layout: bool):
        # Packed sequences have one fragment per rank: API shape [HV, K, V + K].
        return x[0] if packed_layout else x

    def _spec(self, inputs: GDPInputs) -> CallSpec:
        """The local shard's spec: the backend's ``config``, or without one (a backend
        built bare, for the protocol by hand) the inputs' own with the op's defaults:
        scale K ** -0.5, n from k, no L2 norm."""
        if self.config is not None:
            return self.config
        return inputs.spec(scale=inputs.q.shape[-1] ** -0.5, num_householder=inputs.k.shape[2],
                           use_qk_l2norm=False, recompute_chunk_num=self.recompute_chunk_num)

    def cp_forward_prepare(self, inputs: GDPInputs):
        """Trailing-fragment summary [E | M] (zero incoming state) and the local context."""
        spec = self._spec(inputs)
        layout, ch = forward_problem(spec, inputs.q, inputs.k, inputs.v, inputs.g,
                                     inputs.beta, inputs.cu_seqlens,
                                     self.engine.input_dtypes(spec))
        (E, M), work = self.engine.forward_prepare(
            spec, ch, layout, provisional_start_states(spec, inputs),
            differentiated=self.differentiated, keep_states=self.keeps_states,
            tokens=(inputs.q, inputs.k, inputs.v))
        E, M = E[inputs.last_seq], M[inputs.last_seq]
        summary = self._pack_shape(pack_forward_summary(E, M), inputs.cu_seqlens is not None)
        return summary, _LocalForward(spec, inputs, layout, ch, work)

    def cp_forward_apply(self, local_ctx: _LocalForward, preceding: SummarySlice):
        """Fold the preceding maps into the incoming state, then run the local forward.

        Returns (o [B, T, HV, V], local final states [N, HV, K, V], SavedContext).
        """
        spec, inputs, layout, ch, work = local_ctx
        h0 = inputs.initial_state.astype(spec.cdt)
        S_in = fold_forward(preceding, h0[inputs.first_seq]).astype(spec.cdt)
        h0 = h0.at[inputs.first_seq].set(
            jnp.where(inputs.continues_in, S_in, h0[inputs.first_seq]))
        oc, final, states = self.engine.forward_resume(spec, ch, layout, h0,
                                                       _crossing(inputs), work,
                                                       keep_states=self.keeps_states)
        md = GDPSavedMetadata.of(spec, has_chunk_states=states is not None,
                                 forward_only=not self.keeps_states)
        saved = SavedContext(inputs._replace(initial_state=h0), states, md)
        return outputs(layout, oc, inputs.q.dtype), final.astype(spec.cdt), saved

    def cp_backward_prepare(self, output_grad, saved_ctx: SavedContext):
        """Leading-fragment summary [gamma | M^T] (zero outgoing-state gradient).

        output_grad: do [B, T, HV, V] (no final-state gradient), or the pair (do, dfinal
        [N, HV, K, V] for sequences ending here).
        """
        inputs, md = restore_saved_context(saved_ctx)
        spec = md.spec(inputs)
        if isinstance(output_grad, (tuple, list)):
            if len(output_grad) != 2:
                raise TypeError(f"output_grad: do or the pair (do, dfinal); got a sequence "
                                f"of {len(output_grad)}")
            do, dfinal = output_grad
        else:
            do, dfinal = output_grad, jnp.zeros_like(inputs.initial_state)
        if tuple(do.shape) != tuple(inputs.v.shape[:2]) + tuple(inputs.v.shape[3:]):
            raise ValueError(f"do has shape {tuple(do.shape)}; expected [B, T, HV, V] = "
                             f"{tuple(inputs.v.shape[:2]) + tuple(inputs.v.shape[3:])}")
        p = backward_problem(spec, inputs.q, inputs.k, inputs.v, inputs.g, inputs.beta,
                             inputs.cu_seqlens, do, dfinal, self.engine.input_dtypes(spec))
        (gamma, Mt), work = self.engine.backward_prepare(spec, p.ch, p.layout, p.doc,
                                                         p.dfinal)
        gamma, Mt = gamma[inputs.first_seq], Mt[inputs.first_seq]
        summary = self._pack_shape(pack_backward_summary(gamma, Mt),
                                   inputs.cu_seqlens is not None)
        return summary, _LocalBackward(spec, inputs, p, saved_ctx.chunk_states, work)

    def cp_backward_apply(self, bwd_ctx: _LocalBackward, following: SummarySlice):
        """Fold the following maps into the outgoing-state gradient; all local gradients.

        Returns (dq, dk, dv, dg or None, dbeta, dh0 [N, HV, K, V]); dh0 is the gradient
        w.r.t. the LOCAL start states (the driver keeps the entries of sequences that
        start on this rank).
        """
        spec, inputs, p, states, work = bwd_ctx
        dS_out = fold_backward(following, spec.V).astype(spec.cdt)
        dfinal = p.dfinal.at[inputs.last_seq].add(
            jnp.where(inputs.continues_out, dS_out, 0.0))
        dch, dh0 = self.engine.backward_resume(spec, p.ch, p.layout, inputs.initial_state,
                                               p.doc, dfinal, states, (inputs.last_seq,),
                                               work)
        dq, dk, dv, dg, dbeta = p.pull_inputs(dch)
        return dq, dk, dv, dg, dbeta, dh0


class CuTeDSLGatedDeltaProductCPBackend(XlaGatedDeltaProductCPBackend):
    """The CP protocol on the Hopper CuTe DSL engine (sm_90a,
    :class:`gdp_jax.kernels.pipeline.CuTeDSLEngine`).

    Each direction runs its recursion kernel ONCE per rank, in prepare, on V + K state
    columns (the K extra columns carry the response to the fragment's start state /
    end-state gradient): the summary comes out of it, and apply adds the folded state's
    contribution to the output rows, the chunk-state checkpoints (every (N + 1)-th chunk,
    N = ``recompute_chunk_num`` in [0, 64], saved in the SavedContext) and dS_end by
    parallel per-chunk matmuls, then (backward) runs the chunk-local gradients.
    """

    name = "cutedsl"

    def __init__(self, config: Optional[CallSpec] = None, recompute_chunk_num: int = 0):
        from gdp_jax import _checks, backends
        N = _checks.check_recompute_chunk_num(recompute_chunk_num)
        ok, reason = backends.cutedsl_available(config)
        if not ok:
            raise ValueError(f"CuTeDSLGatedDeltaProductCPBackend cannot run here: {reason}")
        super().__init__(None if config is None else config.replace(recompute_chunk_num=N))
        self._N = N

    @property
    def engine(self):
        from gdp_jax.kernels.pipeline import CUTEDSL
        return CUTEDSL

    @property
    def recompute_chunk_num(self) -> int:
        return self._N
