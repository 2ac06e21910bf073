"""CuTe DSL (nvidia-cutlass-dsl) kernels for Hopper (sm_90a): the ``cutedsl`` backend.

Nothing here imports cutlass at package import time; :func:`gdp_jax.kernels.fwd.import_cutlass`
does it on first use (and sets ``CUTE_DSL_ARCH=sm_90a`` if unset, so a host without a
GPU compiles for Hopper instead of the DSL's silent sm_100a default).

What runs where (forward, :mod:`gdp_jax.kernels.fwd`):
  XLA:    interleave, chunk-local cumsum, the WY system A, w/u = (I + A)^-1 [...], Kt, and
          the readout operands qg, P (batched matmuls, float32, then cast to 16 bit);
  kernel: ``wy_inverse_sm90`` (:mod:`gdp_jax.kernels.inverse`): (I + A)^-1 of every chunk
          (column forward substitution, float32; its vjp is a closed form in XLA);
  kernel: ``chunk_fwd_sm90``: sequential state recursion over chunks + chunk output +
          final states (state in registers), and under differentiation the start state of
          every (N + 1)-th chunk (``recompute_chunk_num`` = N checkpoints).
Backward (:mod:`gdp_jax.kernels.bwd`):
  XLA:    chunk states from the checkpoints (N recompute steps, all groups at once), the
          kernel operands (dv_local = P^T dO);
  kernel: ``chunk_bwd_sm90``: reverse state-gradient recursion (FLA's dhu), writing the
          gradient w.r.t. every chunk's end state and the initial-state gradients;
  XLA:    vjp of the chunk-local map (WY backward, dq/dk/dw/dg) for all chunks at once.
Context-parallel summaries (``CuTeDSLGatedDeltaProductCPBackend``): the same two
recursion kernels on V + K state columns give [E | M] (forward) and [gamma | M^T]
(reverse) in one pass each (``fwd.forward_summaries``, ``bwd.backward_summaries``).
Decoding (:mod:`gdp_jax.kernels.step`, ``gated_delta_product_step``):
  XLA:    the token's operands (L2 norm, GVA head expansion, scale, exp(g)), float32;
  kernel: ``step_sm90``: one thread per state column, the n Householder updates and the
          readout in registers; the state is read once and written once, in place.
The custom calls are ``jax.vmap``-able (:mod:`gdp_jax.kernels._batching` folds the
mapped axis into the batch rows). :mod:`gdp_jax.kernels.emulate` holds pure-JAX stand-ins
with the kernels' exact contracts (CPU tests of everything around them).
"""
