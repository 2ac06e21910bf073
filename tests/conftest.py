"""Test setup: 8 simulated host devices (must be set before jax is imported) and float64."""
import os

# XLA's CPU client sizes its shared thread pool by the core count (2 in CI). Collectives of
# 8 simulated devices block pool threads while the other devices wait for one: deadlock
# (seen here). PJRT_NPROC sets the pool size.
os.environ.setdefault("PJRT_NPROC", "32")
_FLAGS = ("--xla_force_host_platform_device_count=8",)
_xla_flags = os.environ.get("XLA_FLAGS", "")
for _flag in _FLAGS:
    if _flag.split("=")[0] not in _xla_flags:
        _xla_flags += " " + _flag
os.environ["XLA_FLAGS"] = _xla_flags.strip()

import jax  # noqa: E402

jax.config.update("jax_enable_x64", True)
