"""Load the weights of FLA's (and Hugging Face's) ``GatedDeltaProduct`` layer into ours.

FLA keeps separate projections (``q_proj``, ``k_proj``, ``v_proj``, ``b_proj``, ``a_proj``,
``g_proj``, ``o_proj``; PyTorch ``Linear`` weights are [out, in]) and three depthwise
convolutions (``q_conv1d`` ...; weights [channels, 1, W]); we keep one fused ``in_proj``
([in, out], columns [q | k | v | b | a | z]) and one convolution over [q | k | v]
([W, channels]). The per-head orders agree: k and v columns are (n, head, dim), b columns
(n, head), and FLA's GVA repeats key head h for value heads h * g .. h * g + g - 1, which is
our value head -> key head map h // g. FLA always applies SiLU after the convolution and
L2-normalises q and k inside the op, as our layer does with ``qkv_activation=True``.

Usage::

    layer = GatedDeltaProduct(**fla_layer_kwargs(hidden_size=..., head_dim=..., ...),
                              rngs=nnx.Rngs(0))
    load_fla_weights(layer, {name: tensor.float().numpy() for name, tensor in sd.items()},
                     prefix="model.layers.0.attn.")   # Hugging Face checkpoints
"""
from __future__ import annotations

from typing import Mapping

import numpy as np

__all__ = ["fla_layer_kwargs", "load_fla_weights"]


def fla_layer_kwargs(*, hidden_size: int, head_dim: int, num_heads: int,
                     num_v_heads=None, expand_v: float = 2, num_householder: int = 2,
                     use_output_gate: bool = True, use_short_conv: bool = True,
                     conv_size: int = 4, conv_bias: bool = False, norm_eps: float = 1e-5,
                     use_forget_gate: bool = True, allow_neg_eigval: bool = True) -> dict:
    """Our layer's constructor arguments for an FLA ``GatedDeltaProduct`` config."""
    head_v_dim = head_dim * expand_v
    if head_v_dim != int(head_v_dim):
        raise ValueError(f"head_dim * expand_v = {head_v_dim} is not an integer")
    return dict(d_model=hidden_size, num_heads=num_heads, num_v_heads=num_v_heads,
                head_k_dim=head_dim, head_v_dim=int(head_v_dim),
                num_householder=num_householder, conv_size=conv_size if use_short_conv else 0,
                conv_bias=conv_bias, use_forget_gate=use_forget_gate,
                use_output_gate=use_output_gate, allow_neg_eigval=allow_neg_eigval,
                qkv_activation=True, norm_eps=norm_eps)


def _get(state_dict, prefix, name, shape):
    key = prefix + name
    if key not in state_dict:
        raise ValueError(f"weight {key!r} is missing from the state dict (the layer's "
                         "configuration expects it)")
    w = np.asarray(state_dict[key])
    if w.shape != tuple(shape):
        raise ValueError(f"weight {key!r} has shape {w.shape}; expected {tuple(shape)} for "
                         "this layer's configuration")
    return w


def load_fla_weights(layer, state_dict: Mapping[str, object], prefix: str = "") -> None:
    """Copy FLA-named weights (NumPy-convertible arrays) into ``layer`` in place.

    Raises ValueError naming the key when a weight is missing or its shape disagrees with
    the layer's configuration (build the layer with :func:`fla_layer_kwargs`).
    """
    H, HV, K, V, n = (layer.num_heads, layer.num_v_heads, layer.head_k_dim,
                      layer.head_v_dim, layer.num_householder)
    D = layer.d_model
    rows = [("q_proj.weight", H * K), ("k_proj.weight", n * H * K),
            ("v_proj.weight", n * HV * V), ("b_proj.weight", n * HV)]
    if layer.use_forget_gate:
        rows.append(("a_proj.weight", HV))
    if layer.use_output_gate:
        rows.append(("g_proj.weight", HV * V))
    kernel = np.concatenate([_get(state_dict, prefix, name, (out, D)).T
                             for name, out in rows], axis=1)
    pdt = layer.in_proj.kernel[...].dtype
    layer.in_proj.kernel[...] = kernel.astype(pdt)
    if layer.conv_size > 1:
        W = layer.conv_size
        convs = [("q_conv1d", H * K), ("k_conv1d", n * H * K), ("v_conv1d", n * HV * V)]
        weight = np.concatenate([_get(state_dict, prefix, f"{name}.weight", (c, 1, W))[:, 0]
                                 for name, c in convs], axis=0)
        layer.conv_weight[...] = weight.T.astype(pdt)               # [W, channels]
        if layer.conv_bias is not None:
            layer.conv_bias[...] = np.concatenate(
                [_get(state_dict, prefix, f"{name}.bias", (c,)) for name, c in convs]
            ).astype(pdt)
    if layer.use_forget_gate:
        layer.A_log[...] = _get(state_dict, prefix, "A_log", (HV,)).astype(
            layer.A_log[...].dtype)
        layer.dt_bias[...] = _get(state_dict, prefix, "dt_bias", (HV,)).astype(
            layer.dt_bias[...].dtype)
    layer.norm_weight[...] = _get(state_dict, prefix, "o_norm.weight", (V,)).astype(pdt)
    layer.out_proj.kernel[...] = _get(state_dict, prefix, "o_proj.weight",
                                      (D, HV * V)).T.astype(pdt)
