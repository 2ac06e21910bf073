"""Flax NNX ``GatedDeltaProduct`` layer: projections, short convolution, gates, the op, norm.

The layer follows the Gated DeltaProduct mixer of FLA / Megatron-Core (ALGORITHMS.md 4.5)::

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

import math
from typing import Optional

import jax
import jax.numpy as jnp
from jax import lax
from flax import nnx

from gdp_jax.ops import gated_delta_product
from gdp_jax.packing import cu_seqlens_from_mask

__all__ = ["GatedDeltaProduct", "causal_conv1d", "gated_rms_norm", "sequence_starts"]


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
    N = cu.shape[0] - 1
    sid = jnp.clip(jnp.searchsorted(cu, pos, side="right") - 1, 0, N - 1)
    return pos, cu[sid]


def causal_conv1d(x, weight, bias=None, *, cu_seqlens=None, cp_axis: Optional[str] = None,
                  activation: bool = True):
    """Depthwise causal convolution along T, restarting at every packed sequence start.

    ``y[t, c] = act(bias[c] + sum_i weight[i, c] * x[t - (W - 1) + i, c])`` where tokens
    before the start of t's sequence count as zero.

    Args:
      x: [B, T, D] (the local shard under CP).
      weight: [W, D] per-channel kernel, W = conv_size (tap W - 1 multiplies token t).
      bias: [D] or None.
      cu_seqlens: [N + 1] int GLOBAL offsets of packed sequences (needs B == 1), or None.
      cp_axis: shard_map mesh axis splitting T contiguously, or None. The left halo of
        W - 1 tokens comes from the previous rank via ``lax.ppermute`` (zeros on rank 0);
        needs T >= W - 1 per rank.
      activation: apply SiLU.
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
    if halo > 0:
        if cp_axis is not None:
            if T < halo:
                raise ValueError(f"the short convolution under cp_axis={cp_axis!r} needs at "
                                 f"least conv_size - 1 = {halo} tokens per rank, got T={T}")
            P = lax.axis_size(cp_axis)
            tail = x[:, T - halo:]
            left = lax.ppermute(tail, cp_axis, perm=[(r, r + 1) for r in range(P - 1)])
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
        acc = acc + jnp.where(valid, xs, 0).astype(acc.dtype) * weight[W - 1 - s].astype(
            acc.dtype)
    if bias is not None:
        acc = acc + bias.astype(acc.dtype)
    if activation:
        acc = jax.nn.silu(acc)
    return acc.astype(x.dtype)


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
    """

    def __init__(self, d_model: int, num_heads: int, *, num_v_heads: Optional[int] = None,
                 head_k_dim: int = 64, head_v_dim: Optional[int] = None,
                 num_householder: int = 2, conv_size: int = 4, conv_bias: bool = True,
                 use_forget_gate: bool = True, use_output_gate: bool = True,
                 allow_neg_eigval: bool = True, qkv_activation: bool = True,
                 learn_initial_state: bool = False, norm_eps: float = 1e-5,
                 cp_axis: Optional[str] = None, backend: str = "auto", dtype=None,
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

    def project(self, x, cu_seqlens=None):
        """x [B, T, d_model] -> the op's inputs and the output gate.

        Returns a dict: q [B,T,H,K], k [B,T,n,H,K], v [B,T,n,HV,V] (after conv + SiLU,
        not yet L2-normalised), g [B,T,HV] float32 or None, beta [B,T,n,HV], z [B,T,HV,V]
        or None (no output gate).
        """
        B, T, _ = x.shape
        H, HV, K, V, n = (self.num_heads, self.num_v_heads, self.head_k_dim,
                          self.head_v_dim, self.num_householder)
        h = _dense(self.in_proj, x, self.compute_dtype(x))
        idx = [sum(self.split_sizes[:i + 1]) for i in range(len(self.split_sizes) - 1)]
        q, k, v, b, a, z = jnp.split(h, idx, axis=-1)
        qkv = jnp.concatenate([q, k, v], axis=-1)
        if self.conv_size > 1:
            bias = None if self.conv_bias is None else self.conv_bias[...]
            qkv = causal_conv1d(qkv, self.conv_weight[...], bias, cu_seqlens=cu_seqlens,
                                cp_axis=self.cp_axis, activation=self.qkv_activation)
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
                    z=z.reshape(B, T, HV, V) if self.use_output_gate else None)

    def readout(self, o, z):
        """o [B, T, HV, V] (the op's output), z [B, T, HV, V] or None -> y [B, T, d_model]."""
        o = gated_rms_norm(o, z, self.norm_weight[...], self.norm_eps)
        B, T = o.shape[:2]
        return _dense(self.out_proj, o.reshape(B, T, self.num_v_heads * self.head_v_dim),
                      o.dtype)

    def __call__(self, x, cu_seqlens=None, *, mask=None):
        """x [B, T, d_model] (local shard under CP), cu_seqlens [N+1] global, or mask [B, T]
        -> [B, T, d_model]."""
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
        p = self.project(x, cu_seqlens)
        h0 = None
        if self.learn_initial_state:
            N = x.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1
            h0 = jnp.broadcast_to(self.initial_state[...], (N,) + self.initial_state.shape)
        o = gated_delta_product(p["q"], p["k"], p["v"], p["g"], p["beta"], initial_state=h0,
                                cu_seqlens=cu_seqlens, use_qk_l2norm=True,
                                cp_axis=self.cp_axis, backend=self.backend)
        return self.readout(o, p["z"])

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


def _dense(linear: nnx.Linear, x, dtype):
    """``x @ kernel`` in ``dtype`` (float32 accumulation for 16-bit inputs)."""
    kernel = linear.kernel[...].astype(dtype)
    acc = jnp.promote_types(dtype, jnp.float32)
    return jnp.einsum("...i,io->...o", x.astype(dtype), kernel,
                      preferred_element_type=acc).astype(dtype)
