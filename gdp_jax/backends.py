"""Backend selection: fail closed, say which backend runs and why (logged once)."""
from __future__ import annotations

import functools
import logging

import jax

log = logging.getLogger("gdp_jax")


def cutedsl_available() -> tuple[bool, str]:
    """(ok, reason): can the cutedsl backend run in this process?"""
    try:
        devs = jax.devices()
    except RuntimeError as e:  # pragma: no cover - no backend at all
        return False, f"no JAX devices ({e})"
    if devs[0].platform != "gpu":
        return False, f"the default device is {devs[0].platform}, not an sm_90 GPU"
    cc = getattr(devs[0], "compute_capability", "")
    if str(cc) != "9.0":
        return False, f"GPU compute capability {cc} is not sm_90"
    return False, "the cutedsl kernels are not part of this build yet"


@functools.lru_cache(maxsize=None)
def _log_choice(choice: str, reason: str):
    log.info("gdp_jax backend=auto picked %s (%s)", choice, reason)


def resolve(backend: str) -> str:
    """Map "auto" to a concrete backend; raise where "cutedsl" cannot run."""
    if backend == "xla":
        return "xla"
    ok, reason = cutedsl_available()
    if backend == "cutedsl":
        if not ok:
            raise ValueError(f"backend='cutedsl' cannot run here: {reason}")
        return "cutedsl"
    choice = "cutedsl" if ok else "xla"
    _log_choice(choice, reason if not ok else "sm_90 GPU with CuTe DSL")
    return choice
