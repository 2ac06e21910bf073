"""Flax NNX ``GatedDeltaProduct`` layer: projections, short convolution, gates, the op, norm.

The layer follows the Gated DeltaProduct mixer of FLA / Megatron-Core (docs/ALGORITHMS.md)::

    x [B, T, d_model]
      -> in_proj -> q [B,T,H*K], k [B,T,n*H*K], v [B,T,n*HV*V], b [B,T,n*HV], a [B,T,HV], z [B,T,HV*V]
      -> depthwise causal short conv (+SiLU) on [q | k | v]  (restarts at packed sequence starts)
      -> q, k L2-normalised (inside the op), beta = sigmoid(b) (x2 with allow_neg_eigval)
      -> g = -exp(A_log) * softplus(a + dt_bias)   (float32; or no forget gate)
      -> gated_delta_product(q, k, v, g, beta)  -> o [B, T, HV, V]
      -> gated RMSNorm: rmsnorm(o) * weight * silu(z)  (or no output gate: rmsnorm(o) * weight)
      -> out_proj -> y [B, T, d_model]

Heads (FLA's names): ``num_heads`` = H query/key heads; ``num_v_heads`` = HV value heads
(one [K, V] state each, the output heads), a multiple of ``num_heads`` (grouped value
attention, GVA: value head h reads key head h // (HV // H)); ``num_v_heads=None`` means
HV = H. Weights of FLA's / Hugging Face's layer load with :mod:`gdp_jax.fla_weights`.

Context parallelism is a flag: construct the layer with ``cp_axis="cp"`` and call it
inside ``jax.shard_map`` with x split contiguously along T over that mesh axis
(``in_specs=P(None, "cp")``), parameters replicated, and ``cu_seqlens`` (if any) the GLOBAL
offsets, replicated. The short convolution then fetches its left halo (conv_size - 1
tokens) from the previous rank with ``lax.ppermute`` (zeros on rank 0) and still restarts
at packed sequence starts, so the layer under CP equals the layer on one device.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Optional

import jax
import jax.numpy as jnp
from jax import lax
from flax import nnx

from gdp_jax.ops import gated_delta_product
from gdp_jax.packing import cu_seqlens_from_mask
from gdp_jax.step import gated_delta_product_step

__all__ = ["GatedDeltaProduct", "GDPCache", "causal_conv1d", "conv_tail", "gated_rms_norm",
           "sequence_starts"]


# ---------------------------------------------------------------------------------------
# functional pieces (usable without the module)
# ---------------------------------------------------------------------------------------

def sequence_starts(T: int, *, cu_seqlens=None, cp_axis: Optional[str] = None):
    """Global position and global start of the sequence holding each local token.

    Args:
      T: local number of tokens (the shard length under CP).
      cu_seqlens: [N + 1] int GLOBAL offsets of packed sequences, or None (one sequence
        per batch row, starting at global position 0).
      cp_axis: mesh axis over which T is split contiguously, or None.
    Returns:
      (pos [T] int32 global positions, start [T] int32 global start of their sequence).
    """
    offset = 0
    if cp_axis is not None:
        offset = lax.axis_index(cp_axis) * T
    pos = offset + jnp.arange(T, dtype=jnp.int32)
    if cu_seqlens is None:
        return pos, jnp.zeros((T,), jnp.int32)
    cu = jnp.asarray(cu_seqlens, jnp.int32)
    return pos, cu[_sequence_of(pos, cu)]


def _sequence_of(pos, cu):
    """Index of the packed sequence holding each global position (offsets ``cu``)."""
    N = cu.shape[0] - 1
    return jnp.clip(jnp.searchsorted(cu, pos, side="right") - 1, 0, N - 1)


def causal_conv1d(x, weight, bias=None, *, cu_seqlens=None, cp_axis: Optional[str] = None,
                  activation: bool = True, tail=None):
    """Depthwise causal convolution along T, restarting at every packed sequence start.

    ``y[t, c] = act(bias[c] + sum_i weight[i, c] * x[t - (W - 1) + i, c])`` where tokens
    before the start of t's sequence count as zero (or come from ``tail``).

    Args:
      x: [B, T, D] (the local shard under CP).
      weight: [W, D] per-channel kernel, W = conv_size (tap W - 1 multiplies token t).
      bias: [D] or None.
      cu_seqlens: [N + 1] int GLOBAL offsets of packed sequences (needs B == 1), or None.
      cp_axis: shard_map mesh axis splitting T contiguously, or None. The left halo of
        W - 1 tokens comes from the previous rank via ``lax.ppermute`` (zeros on rank 0);
        needs T >= W - 1 per rank.
      activation: apply SiLU.
      tail: [N, W - 1, D] the W - 1 inputs before each sequence's start (N = B, or the
        number of packed sequences; a decoding cache's :attr:`GDPCache.conv`), or None
        (zeros). Not with ``cp_axis``.
    Returns:
      y: [B, T, D] in x.dtype.
    """
    B, T, D = x.shape
    W = weight.shape[0]
    if weight.shape != (W, D):
        raise ValueError(f"weight has shape {weight.shape}; expected [conv_size, {D}]")
    if cu_seqlens is not None and B != 1:
        raise ValueError(f"cu_seqlens needs B == 1 (packed sequences), but x has shape "
                         f"{x.shape}")
    halo = W - 1
    if tail is not None:
        _check_tail(tail, B if cu_seqlens is None else cu_seqlens.shape[0] - 1, halo, D,
                    cp_axis)
    if halo > 0:
        if cp_axis is not None:
            if T < halo:
                raise ValueError(f"the short convolution under cp_axis={cp_axis!r} needs at "
                                 f"least conv_size - 1 = {halo} tokens per rank, got T={T}")
            P = lax.axis_size(cp_axis)
            last = x[:, T - halo:]                                # to the next rank
            left = lax.ppermute(last, cp_axis, perm=[(r, r + 1) for r in range(P - 1)])
        else:
            left = jnp.zeros((B, halo, D), x.dtype)
        xp = jnp.concatenate([left, x], axis=1)                   # [B, halo + T, D]
    else:
        xp = x
    pos, start = sequence_starts(T, cu_seqlens=cu_seqlens, cp_axis=cp_axis)
    acc = jnp.zeros((B, T, D), jnp.promote_types(x.dtype, jnp.float32))
    for s in range(W):                                            # s = how far back
        xs = lax.dynamic_slice_in_dim(xp, halo - s, T, axis=1) if s else x
        valid = (pos - s >= start)[None, :, None]                 # same sequence, >= 0
        before = 0 if tail is None or s == 0 else _from_tail(tail, pos - s - start, pos,
                                                              cu_seqlens)
        acc = acc + jnp.where(valid, xs, before).astype(acc.dtype) * weight[
            W - 1 - s].astype(acc.dtype)
    if bias is not None:
        acc = acc + bias.astype(acc.dtype)
    if activation:
        acc = jax.nn.silu(acc)
    return acc.astype(x.dtype)


def _check_tail(tail, N, halo, D, cp_axis):
    if cp_axis is not None:
        raise ValueError("a convolution tail (decoding cache) cannot be used with cp_axis")
    if tuple(tail.shape) != (N, halo, D):
        raise ValueError(f"tail has shape {tuple(tail.shape)}; expected [N, conv_size - 1, "
                         f"D] = {(N, halo, D)}")


def _from_tail(tail, back, pos, cu_seqlens):
    """The tail entry ``back`` (< 0) tokens before each token's sequence start: [B, T, D]
    (zero where ``back`` >= 0, unused there, or before the tail)."""
    halo = tail.shape[1]
    idx = halo + back                                              # [T] row of the tail
    ok = ((idx >= 0) & (back < 0))[:, None]
    idx = jnp.clip(idx, 0, halo - 1)
    if cu_seqlens is None:
        return jnp.where(ok[None], tail[:, idx], 0)                # rows = batch rows
    sid = _sequence_of(pos, jnp.asarray(cu_seqlens, jnp.int32))
    return jnp.where(ok, tail[sid, idx], 0)[None]


def conv_tail(x, tail, cu_seqlens=None):
    """The last W - 1 inputs of each sequence after ``x``: the next call's ``tail``.

    x [B, T, D]; tail [N, W - 1, D] (the inputs before x, as for :func:`causal_conv1d`);
    cu_seqlens [N + 1] packed offsets (B == 1) or None (N = B). Returns [N, W - 1, D]
    (a sequence shorter than W - 1 keeps the end of its old tail).
    """
    halo = tail.shape[1]
    if cu_seqlens is None:
        return jnp.concatenate([tail.astype(x.dtype), x], axis=1)[:, x.shape[1]:]
    cu = jnp.asarray(cu_seqlens, jnp.int32)
    start, end = cu[:-1, None], cu[1:, None]
    p = end - halo + jnp.arange(halo, dtype=jnp.int32)[None]       # [N, W - 1] positions
    from_x = x[0, jnp.clip(p, 0, x.shape[1] - 1)]
    rows = jnp.arange(tail.shape[0])[:, None]
    from_tail = tail[rows, jnp.clip(halo + p - start, 0, halo - 1)].astype(x.dtype)
    return jnp.where((p >= start)[..., None], from_x, from_tail)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class GDPCache:
    """Decoding cache of one :class:`GatedDeltaProduct` layer (a pytree), one row per
    sequence (N = batch rows, or packed sequences).

    state: [N, HV, K, V] float32 (float64 for a float64 cache) recurrent state.
    conv: [N, conv_size - 1, conv_dim] the last conv_size - 1 inputs (q | k | v before the
      short convolution) of each sequence, zeros before its start; [N, 0, conv_dim]
      without a convolution.
    """
    state: jax.Array
    conv: jax.Array


def gated_rms_norm(o, z, weight, eps: float = 1e-5):
    """``rmsnorm(o) * weight * silu(z)`` over the last axis, in float32 (or wider);
    ``rmsnorm(o) * weight`` when z is None.

    Args: o [..., V]; z [..., V] or None; weight [V]. Returns [..., V] in o.dtype.
    """
    fdt = jnp.promote_types(o.dtype, jnp.float32)
    of = o.astype(fdt)
    y = of * lax.rsqrt(jnp.mean(of * of, axis=-1, keepdims=True) + eps) * weight.astype(fdt)
    if z is not None:
        y = y * jax.nn.silu(z.astype(fdt))
    return y.astype(o.dtype)


def _uniform(lo, hi):
    def init(key, shape, dtype=jnp.float32):
        return jax.random.uniform(key, shape, dtype, lo, hi)
    return init


# ---------------------------------------------------------------------------------------
# the layer
# ---------------------------------------------------------------------------------------

class GatedDeltaProduct(nnx.Module):
    """Gated DeltaProduct token mixer (one layer), Flax NNX.

    Head names follow FLA's ``GatedDeltaProduct`` layer: ``num_heads`` = H query/key heads,
    ``num_v_heads`` = HV value heads (a multiple of H; GVA: value head h reads key head
    h // (HV // H)); each value head holds one [K, V] state.

    Args:
      d_model: model width (input and output features; FLA's ``hidden_size``).
      num_heads: H, number of query/key heads.
      num_v_heads: HV, number of value heads, a multiple of num_heads; None means HV = H.
      head_k_dim: K, key/query head dim.
      head_v_dim: V, value head dim (default head_k_dim).
      num_householder: n, Householder updates per token (n_h; n = 1 is Gated DeltaNet).
      conv_size: kernel size W of the depthwise causal short convolution on q, k, v;
        0 or 1 means none (1 would be a per-channel scale: treated as none).
      conv_bias: the short convolution has a bias (FLA's default is False).
      use_forget_gate: True: g = -exp(A_log) * softplus(a + dt_bias) (float32); False: no
        decay.
      use_output_gate: True: gated RMSNorm rmsnorm(o) * weight * silu(z) with z projected
        from x; False: rmsnorm(o) * weight.
      allow_neg_eigval: beta = 2 * sigmoid(b) in (0, 2) (eigenvalues in (-1, 1), needed
        for state tracking) instead of sigmoid(b) in (0, 1).
      qkv_activation: apply SiLU to q, k, v after the short convolution (FLA always does).
      learn_initial_state: learn one start state [HV, K, V] shared by every sequence
        (zeros at init) instead of starting from zero.
      norm_eps: epsilon of the (gated) RMSNorm.
      cp_axis: shard_map mesh axis name for context parallelism, or None.
      backend: op backend, "auto" | "xla" | "cutedsl".
      recompute_chunk_num: the op's ``recompute_chunk_num`` (checkpoint memory for the
        backward: one state per N + 1 chunks), None for its default.
      intra_cp: the op's ``intra_cp`` (None, S or "auto": CP over S segments inside one
        device for rows too few to fill it); not with ``cp_axis``.
      batch_invariant: the op's ``batch_invariant`` (its outputs and gradients for a
        sequence the same bits alone, in a batch or in a pack). It covers the op only: the
        projections, convolution and norms around it are XLA's (a matmul may pick its
        algorithm by shape).
      dtype: compute dtype of the projections and the op's inputs; None follows x (bf16
        activations with float32 parameters compute in bf16, so "auto" can pick the
        kernels).
      param_dtype: parameter dtype.
      kernel_init: initializer of the input and output projection kernels ([in, out]).
      rngs: ``nnx.Rngs`` for initialisation.

    Call: ``layer(x, cu_seqlens=None, *, mask=None)`` with x [B, T, d_model] (the local T
    shard under CP), cu_seqlens [N + 1] int32 GLOBAL packed offsets (B == 1), or mask
    [B, T] (padding mask: each row's valid tokens one contiguous run, see
    :func:`cu_seqlens_from_mask`) -> y [B, T, d_model] (zero at masked tokens).

    Generation: ``cache = layer.init_cache(N)``, then ``y, cache = layer(x, cache=cache)``
    for any T >= 1: a prompt (prefill, through the chunked op from the cache's states;
    packed with cu_seqlens: one cache row per sequence), then one token at a time
    (T = 1, through :func:`gdp_jax.gated_delta_product_step`). Not with cp_axis or mask.
    """

    def __init__(self, d_model: int, num_heads: int, *, num_v_heads: Optional[int] = None,
                 head_k_dim: int = 64, head_v_dim: Optional[int] = None,
                 num_householder: int = 2, conv_size: int = 4, conv_bias: bool = True,
                 use_forget_gate: bool = True, use_output_gate: bool = True,
                 allow_neg_eigval: bool = True, qkv_activation: bool = True,
                 learn_initial_state: bool = False, norm_eps: float = 1e-5,
                 cp_axis: Optional[str] = None, backend: str = "auto",
                 recompute_chunk_num: Optional[int] = None, intra_cp=None,
                 batch_invariant: bool = False, dtype=None,
                 param_dtype=jnp.float32, kernel_init=nnx.initializers.lecun_normal(),
                 rngs: nnx.Rngs):
        num_v_heads = num_heads if num_v_heads is None else num_v_heads
        head_v_dim = head_k_dim if head_v_dim is None else head_v_dim
        for name, val in (("d_model", d_model), ("num_heads", num_heads),
                          ("num_v_heads", num_v_heads), ("head_k_dim", head_k_dim),
                          ("head_v_dim", head_v_dim), ("num_householder", num_householder)):
            if not isinstance(val, int) or val < 1:
                raise ValueError(f"{name}={val!r}; expected a positive int")
        if num_v_heads % num_heads:
            raise ValueError(f"num_v_heads={num_v_heads} (value heads) must be a multiple of "
                             f"num_heads={num_heads} (query/key heads)")
        if not isinstance(conv_size, int) or conv_size < 0:
            raise ValueError(f"conv_size={conv_size!r}; expected an int >= 0")
        self.d_model, self.num_heads, self.num_v_heads = d_model, num_heads, num_v_heads
        self.head_k_dim, self.head_v_dim = head_k_dim, head_v_dim
        self.num_householder, self.conv_size = num_householder, conv_size
        self.use_forget_gate, self.use_output_gate = use_forget_gate, use_output_gate
        self.allow_neg_eigval = allow_neg_eigval
        self.qkv_activation, self.learn_initial_state = qkv_activation, learn_initial_state
        self.norm_eps, self.cp_axis, self.backend = norm_eps, cp_axis, backend
        self.recompute_chunk_num, self.intra_cp = recompute_chunk_num, intra_cp
        if not isinstance(batch_invariant, bool):
            raise TypeError(f"batch_invariant={batch_invariant!r}; expected a bool")
        self.batch_invariant = batch_invariant
        self.dtype = dtype

        H, HV, K, V, n = num_heads, num_v_heads, head_k_dim, head_v_dim, num_householder
        # in_proj output split: [q (H*K) | k (n*H*K) | v (n*HV*V) | b (n*HV) | a (HV) | z (HV*V)]
        self.split_sizes = (H * K, n * H * K, n * HV * V, n * HV, HV if use_forget_gate else 0,
                            HV * V if use_output_gate else 0)
        self.in_proj = nnx.Linear(d_model, sum(self.split_sizes), use_bias=False,
                                  kernel_init=kernel_init, param_dtype=param_dtype, rngs=rngs)
        self.conv_dim = H * K + n * H * K + n * HV * V
        if conv_size > 1:
            bound = 1.0 / math.sqrt(conv_size)      # PyTorch's depthwise Conv1d default
            self.conv_weight = nnx.Param(
                _uniform(-bound, bound)(rngs.params(), (conv_size, self.conv_dim), param_dtype))
            self.conv_bias = nnx.Param(
                _uniform(-bound, bound)(rngs.params(), (self.conv_dim,), param_dtype)
            ) if conv_bias else None
        if use_forget_gate:
            # Mamba-2 style: A in [1, 16], dt in [1e-3, 1e-1] log-uniform.
            self.A_log = nnx.Param(jnp.log(_uniform(1.0, 16.0)(rngs.params(), (HV,))))
            dt = jnp.exp(_uniform(math.log(1e-3), math.log(1e-1))(rngs.params(), (HV,)))
            self.dt_bias = nnx.Param(dt + jnp.log(-jnp.expm1(-dt)))   # inverse softplus
        if learn_initial_state:
            self.initial_state = nnx.Param(jnp.zeros((HV, K, V), jnp.promote_types(
                param_dtype, jnp.float32)))
        self.norm_weight = nnx.Param(jnp.ones((V,), param_dtype))
        self.out_proj = nnx.Linear(HV * V, d_model, use_bias=False, kernel_init=kernel_init,
                                   param_dtype=param_dtype, rngs=rngs)

    def compute_dtype(self, x):
        """The projections' and the op's input dtype: ``dtype``, or x's when None."""
        return jnp.dtype(self.dtype if self.dtype is not None else x.dtype)

    def init_cache(self, batch_size: int, dtype=jnp.float32) -> GDPCache:
        """A fresh decoding cache for ``batch_size`` sequences (:class:`GDPCache`).

        The states are zeros (the learned start state with ``learn_initial_state``), in
        float32 (float64 for ``dtype`` float64); the convolution tail is zeros in
        ``dtype`` (float32 holds bfloat16 inputs exactly).
        """
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size={batch_size!r}; expected a positive int")
        sdt = jnp.promote_types(dtype, jnp.float32)
        shape = (batch_size, self.num_v_heads, self.head_k_dim, self.head_v_dim)
        if self.learn_initial_state:
            state = jnp.broadcast_to(self.initial_state[...].astype(sdt), shape)
        else:
            state = jnp.zeros(shape, sdt)
        halo = self.conv_size - 1 if self.conv_size > 1 else 0
        return GDPCache(state, jnp.zeros((batch_size, halo, self.conv_dim), dtype))

    def project(self, x, cu_seqlens=None, conv_tail_in=None):
        """x [B, T, d_model] -> the op's inputs and the output gate.

        Returns a dict: q [B,T,H,K], k [B,T,n,H,K], v [B,T,n,HV,V] (after conv + SiLU,
        not yet L2-normalised), g [B,T,HV] float32 or None, beta [B,T,n,HV], z [B,T,HV,V]
        or None (no output gate), and with ``conv_tail_in`` (a cache's conv
        [N, W-1, conv_dim]: the inputs before x) also conv_tail, the next cache's.
        """
        B, T, _ = x.shape
        H, HV, K, V, n = (self.num_heads, self.num_v_heads, self.head_k_dim,
                          self.head_v_dim, self.num_householder)
        h = _dense(self.in_proj, x, self.compute_dtype(x))
        idx = [sum(self.split_sizes[:i + 1]) for i in range(len(self.split_sizes) - 1)]
        q, k, v, b, a, z = jnp.split(h, idx, axis=-1)
        qkv = jnp.concatenate([q, k, v], axis=-1)
        extra = {}
        if conv_tail_in is not None:
            extra["conv_tail"] = conv_tail(qkv, conv_tail_in, cu_seqlens).astype(
                conv_tail_in.dtype)
        if self.conv_size > 1:
            bias = None if self.conv_bias is None else self.conv_bias[...]
            qkv = causal_conv1d(qkv, self.conv_weight[...], bias, cu_seqlens=cu_seqlens,
                                cp_axis=self.cp_axis, activation=self.qkv_activation,
                                tail=conv_tail_in)
        elif self.qkv_activation:
            qkv = jax.nn.silu(qkv)
        q, k, v = jnp.split(qkv, [H * K, H * K + n * H * K], axis=-1)
        fdt = jnp.promote_types(b.dtype, jnp.float32)      # float32, or float64 for f64 inputs
        beta = jax.nn.sigmoid(b.astype(fdt))
        if self.allow_neg_eigval:
            beta = 2.0 * beta
        g = None
        if self.use_forget_gate:
            A = jnp.exp(self.A_log[...].astype(fdt))
            g = -A * jax.nn.softplus(a.astype(fdt) + self.dt_bias[...].astype(fdt))
        return dict(q=q.reshape(B, T, H, K), k=k.reshape(B, T, n, H, K),
                    v=v.reshape(B, T, n, HV, V), g=g,
                    beta=beta.astype(q.dtype).reshape(B, T, n, HV),
                    z=z.reshape(B, T, HV, V) if self.use_output_gate else None, **extra)

    def readout(self, o, z):
        """o [B, T, HV, V] (the op's output), z [B, T, HV, V] or None -> y [B, T, d_model]."""
        o = gated_rms_norm(o, z, self.norm_weight[...], self.norm_eps)
        B, T = o.shape[:2]
        return _dense(self.out_proj, o.reshape(B, T, self.num_v_heads * self.head_v_dim),
                      o.dtype)

    def __call__(self, x, cu_seqlens=None, *, mask=None, cache: Optional[GDPCache] = None):
        """x [B, T, d_model] (local shard under CP), cu_seqlens [N+1] global, or mask [B, T]
        -> y [B, T, d_model]; with ``cache`` (:meth:`init_cache`, N rows) -> (y, next
        cache)."""
        if x.ndim != 3 or x.shape[-1] != self.d_model:
            raise ValueError(f"x has shape {x.shape}; expected [B, T, {self.d_model}]")
        if self.cp_axis is not None:
            from gdp_jax.cp import driver
            driver.axis_size(self.cp_axis)      # ValueError outside shard_map, not NameError
        if mask is not None:
            return self._call_masked(x, cu_seqlens, mask)
        if cu_seqlens is not None:
            if x.shape[0] != 1:
                raise ValueError(f"cu_seqlens needs B == 1 (packed sequences), but x has "
                                 f"shape {tuple(x.shape)}")
            cu_seqlens = jnp.asarray(cu_seqlens, jnp.int32)
        N = x.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1
        if cache is not None:
            self._check_cache(cache, N)
        p = self.project(x, cu_seqlens, None if cache is None else cache.conv)
        if cache is not None:
            o, state = self._mix_cached(p, cu_seqlens, cache.state)
        else:
            h0 = None
            if self.learn_initial_state:
                h0 = jnp.broadcast_to(self.initial_state[...], (N,) + self.initial_state.shape)
            o = gated_delta_product(p["q"], p["k"], p["v"], p["g"], p["beta"],
                                    initial_state=h0, cu_seqlens=cu_seqlens,
                                    use_qk_l2norm=True, cp_axis=self.cp_axis,
                                    backend=self.backend,
                                    recompute_chunk_num=self.recompute_chunk_num,
                                    intra_cp=self.intra_cp,
                                    batch_invariant=self.batch_invariant)
        y = self.readout(o, p["z"])
        return y if cache is None else (y, GDPCache(state, p["conv_tail"]))

    def _call_masked(self, x, cu_seqlens, mask):
        """Padded rows -> one packed row with cu_seqlens (padding runs are separate
        sequences whose outputs are zeroed), then back to [B, T, d_model]."""
        if cu_seqlens is not None:
            raise ValueError("pass either cu_seqlens or mask, not both")
        if self.cp_axis is not None:
            raise ValueError(f"mask is not supported with cp_axis={self.cp_axis!r}: under "
                             "context parallelism pass packed rows with GLOBAL cu_seqlens")
        B, T, D = x.shape
        cu = cu_seqlens_from_mask(mask, shape=(B, T))
        y = self(x.reshape(1, B * T, D), cu).reshape(B, T, D)
        return jnp.where(jnp.asarray(mask, bool)[..., None], y, 0).astype(y.dtype)

    def _mix_cached(self, p, cu_seqlens, state):
        """(o [B, T, HV, V], next states [N, HV, K, V] in state.dtype) from the cache's
        states: T = 1 rows through the decoding step, anything else through the op."""
        if p["q"].shape[1] == 1 and cu_seqlens is None:
            g = None if p["g"] is None else p["g"][:, 0]
            o, state_next = gated_delta_product_step(
                p["q"][:, 0], p["k"][:, 0], p["v"][:, 0], g, p["beta"][:, 0], state,
                use_qk_l2norm=True, backend=self.backend)
            return o[:, None], state_next
        o, state_next = gated_delta_product(
            p["q"], p["k"], p["v"], p["g"], p["beta"], initial_state=state,
            output_final_state=True, cu_seqlens=cu_seqlens, use_qk_l2norm=True,
            backend=self.backend, batch_invariant=self.batch_invariant)
        return o, state_next.astype(state.dtype)

    def _check_cache(self, cache, N):
        if self.cp_axis is not None:
            raise ValueError("a decoding cache cannot be used with cp_axis (generation runs "
                             "on one device)")
        if not isinstance(cache, GDPCache):
            raise TypeError(f"cache must be a GDPCache (layer.init_cache), got "
                            f"{type(cache).__name__}")
        want = (N, self.num_v_heads, self.head_k_dim, self.head_v_dim)
        if tuple(cache.state.shape) != want:
            raise ValueError(f"cache.state has shape {tuple(cache.state.shape)}; expected "
                             f"{want} (one row per sequence of x)")
        if cache.conv.shape[0] != N:
            raise ValueError(f"cache.conv has shape {tuple(cache.conv.shape)}; expected "
                             f"{N} rows (one per sequence of x)")


def _dense(linear: nnx.Linear, x, dtype):
    """``x @ kernel`` in ``dtype`` (float32 accumulation for 16-bit inputs)."""
    kernel = linear.kernel[...].astype(dtype)
    acc = jnp.promote_types(dtype, jnp.float32)
    return jnp.einsum("...i,io->...o", x.astype(dtype), kernel,
                      preferred_element_type=acc).astype(dtype)
