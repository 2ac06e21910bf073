"""CuTe DSL (nvidia-cutlass-dsl) kernels for Hopper (sm_90a): the ``cutedsl`` backend.

Nothing here imports cutlass at package import time; :func:`gdp_jax.kernels.binding.import_cutlass`
does it on first use (and sets ``CUTE_DSL_ARCH=sm_90a`` if unset, so a host without a
GPU compiles for Hopper instead of the DSL's silent sm_100a default).

By role:
  device code    ``*_sm90.py`` (one kernel family each) and ``sm90.py`` (shared device
                 helpers); imported only after the CuTe DSL is.
  kernel classes one file per family, each with the static ``can_implement`` that is the
                 ONLY statement of its limits and its (vmappable) ``call``:
                 ``chunk_forward.ChunkForwardKernel`` (state recursion + output + final
                 states + checkpoints), ``state_grad.StateGradKernel`` (reverse state
                 gradient), ``chunk_prep.ChunkPrepKernel`` (the forward's per-chunk
                 operands, all chunks in parallel), ``wy_inverse.WYInverseKernel``
                 ((I + A)^-1 of every chunk; the backward's and the fallback's),
                 ``step.StepKernel`` (one decoding token, state updated in place).
  binding        ``binding.py``: one shape-generic object per kernel variant (prebuilt
                 or compiled through cutlass_call), vmap folding, varying-axes typing -
                 once for every kernel.
  prebuilt       ``aot.py``: variant keys, the objects of ``ffi/build.py`` on disk, the
                 CuTe DSL runtime's FFI handlers registered without importing the DSL.
  pipeline       ``pipeline.py``: the XLA glue, ``CuTeDSLEngine`` (the engine interface
                 of :mod:`gdp_jax.engine`) - operands, checkpoints, summaries.
  emulation      ``emulate.py``: pure-JAX stand-ins with the kernels' exact contracts
                 (CPU tests of everything around them; ``gdp_jax.testing.emulated_kernels``).
"""
