"""gdp-jax benchmarks: one runner (``python -m benchmarks.run``) over a registry of shapes and
implementations (:mod:`benchmarks.registry`). See benchmarks/README.md."""
