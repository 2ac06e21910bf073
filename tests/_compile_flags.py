"""XLA CPU compile settings for the test suite (CI time), shared by tests/conftest.py and
the tests that start their own processes (CLI, notebooks, benchmarks, CP workers).

The suite is dominated by XLA compiles of small programs on CPU; both settings change
how XLA's CPU backend compiles, not the HLO the library builds:

- ``--xla_backend_optimization_level=0``: LLVM at -O0 (~1.5x faster compiles; no HLO
  pass and no floating-point semantics change: XLA's CPU codegen does not reassociate
  without fast-math).
- ``--xla_cpu_use_fusion_emitters=false`` (jaxlib < 0.11 only): XLA's CPU fusions are emitted by its
  elemental (loop) IR emitter instead of the MLIR fusion emitters (compiles 2-3x faster:
  a float64 op + reference gradient program 3.4 -> 1.2 s CPU; tests/test_properties.py
  42.5 -> 25.5 s). XLA's fusion pass then fuses slightly less (the op's float64 gradient
  at T = 77: 215 loop fusions instead of 227; its result was bitwise the same).
  Fast-math stays off.

Set either flag yourself in XLA_FLAGS (conftest only adds flags that are absent) to test
XLA's default CPU code generation. Both are empty on a machine with an NVIDIA GPU
(``GPU_HOST``): XLA's GPU backend reads the optimization level as well, and the GPU tests
(and the processes the suite starts there) must compile the XLA glue as users get it (s21:
a bitwise batch-invariance result differed between a pytest run and a plain one).
"""
import importlib.metadata
import os


def _jaxlib_version():
    try:
        return tuple(int(x) for x in importlib.metadata.version("jaxlib").split(".")[:2])
    except (importlib.metadata.PackageNotFoundError, ValueError):
        return (0, 0)


# The emitter switch exists up to jaxlib 0.10; jaxlib 0.11.2 (the GPU machine's) rejects it as
# an unknown flag and exits at its first start - inside pytest's output capture, so a whole
# run ended with status 1 and no output (s16-3, tests/gpu_results/GPU_TESTS.md). Read from
# the installed jaxlib's metadata: jax itself must not be imported before XLA_FLAGS is set.
GPU_HOST = os.path.exists("/dev/nvidiactl")
FLAGS = () if GPU_HOST else ("--xla_backend_optimization_level=0",) + (
    ("--xla_cpu_use_fusion_emitters=false",) if _jaxlib_version() < (0, 11) else ())
TEXT = " ".join(FLAGS)
