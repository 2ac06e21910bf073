"""Test setup: 8 simulated host devices (must be set before jax is imported) and float64."""
import os

# XLA's CPU client sizes its shared thread pool by the core count (2 in CI). Collectives of
# 8 simulated devices block pool threads while the other devices wait for one: deadlock
# (seen here). PJRT_NPROC sets the pool size.
os.environ.setdefault("PJRT_NPROC", "32")
# The suite is dominated by XLA compiles of small programs: LLVM at -O0 compiles them ~1.5x
# faster (test_properties: 67 -> 43 s) and changes no HLO pass and no floating-point
# semantics (XLA's CPU codegen does not reassociate without fast-math). Set your own
# --xla_backend_optimization_level to test optimised code.
_FLAGS = ("--xla_force_host_platform_device_count=8", "--xla_backend_optimization_level=0")
_xla_flags = os.environ.get("XLA_FLAGS", "")
for _flag in _FLAGS:
    if _flag.split("=")[0] not in _xla_flags:
        _xla_flags += " " + _flag
os.environ["XLA_FLAGS"] = _xla_flags.strip()

import gc  # noqa: E402

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_enable_x64", True)


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """Drop every compiled program after each test module. XLA's CPU client maps memory for
    each loaded executable (test_cp.py alone reaches ~16k mappings); the whole suite in one
    process passed vm.max_map_count (65530) and segfaulted inside an XLA compile."""
    yield
    jax.clear_caches()
    gc.collect()
