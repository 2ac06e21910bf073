"""Chunkwise context parallelism (CP): Megatron's four-function protocol in JAX.

Inside ``jax.shard_map`` over a mesh axis, pass ``cp_axis="<axis>"`` to
:func:`gdp_jax.gated_delta_product`; the driver (:mod:`gdp_jax.cp.driver`) runs
prepare -> one ``all_gather`` of float32 summaries -> fold -> apply (or, for many ranks,
the log-depth ppermute scan of :mod:`gdp_jax.cp.fold`), and the mirror image in the
backward.
"""
from gdp_jax.cp.protocol import (
    CuTeDSLGatedDeltaProductCPBackend,
    GDPInputs,
    GDPSavedMetadata,
    SavedContext,
    SummarySlice,
    XlaGatedDeltaProductCPBackend,
    fold_backward,
    fold_forward,
    pack_backward_summary,
    pack_forward_summary,
    restore_saved_context,
    unpack_summary,
    validate_summary,
)
from gdp_jax.cp.driver import CPRankMetadata, rank_metadata

#: docs/API.md's name for the backends' frozen, hashable static part of the saved context
SavedMetadata = GDPSavedMetadata

__all__ = [
    "CPRankMetadata", "CuTeDSLGatedDeltaProductCPBackend", "GDPInputs", "GDPSavedMetadata",
    "SavedContext", "SavedMetadata", "SummarySlice", "XlaGatedDeltaProductCPBackend",
    "fold_backward", "fold_forward", "pack_backward_summary", "pack_forward_summary", "rank_metadata",
    "restore_saved_context", "unpack_summary", "validate_summary",
]
