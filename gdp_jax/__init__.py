"""gdp-jax: Gated DeltaProduct linear attention in JAX, with chunkwise context parallelism.

Public names: :func:`gated_delta_product` (the op), :func:`gated_delta_product_reference`
(the token recurrence), :func:`gated_delta_product_step` (one decoding token),
:func:`cu_seqlens_from_mask` / :func:`cu_seqlens_from_segment_ids` (packed offsets from
padding masks / segment ids), :mod:`gdp_jax.cp` (the context-parallel protocol and
backends).
The Flax NNX layer lives in :mod:`gdp_jax.nn` (needs the ``nn`` extra).
"""
from gdp_jax import cp
from gdp_jax.ops import gated_delta_product
from gdp_jax.packing import cu_seqlens_from_mask, cu_seqlens_from_segment_ids
from gdp_jax.reference import gated_delta_product_reference
from gdp_jax.step import gated_delta_product_step

__all__ = ["cp", "cu_seqlens_from_mask", "cu_seqlens_from_segment_ids", "gated_delta_product",
           "gated_delta_product_reference", "gated_delta_product_step"]
__version__ = "0.1.0"
