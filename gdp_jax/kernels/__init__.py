"""CuTe DSL (nvidia-cutlass-dsl) kernels for Hopper (sm_90a): the ``cutedsl`` backend.

Nothing here imports cutlass at package import time; :func:`gdp_jax.kernels.fwd.import_cutlass`
does it on first use (and sets ``CUTE_DSL_ARCH=sm_90a`` if unset, so a host without a
GPU compiles for Hopper instead of the DSL's silent sm_100a default).

What runs where (forward):
  XLA:    interleave, chunk-local cumsum, WY factors w/u (triangular solve), Kt, and the
          readout operands qg, P (batched matmuls, float32, then cast to 16 bit);
  kernel: ``chunk_fwd_sm90``: sequential state recursion over chunks + chunk output +
          final states (state kept in registers, never written per chunk).
The backward stays on the xla backend (``chunked.chunk_backward``).
"""
