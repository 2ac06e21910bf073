"""gdp-jax: Gated DeltaProduct linear attention in JAX, with chunkwise context parallelism."""
from gdp_jax.ops import gated_delta_product
from gdp_jax.reference import gated_delta_product_reference

__all__ = ["gated_delta_product", "gated_delta_product_reference"]
__version__ = "0.1.0"
