"""Backend selection: fail closed, say which backend runs and why (logged once)."""
from __future__ import annotations

import functools
import logging

import jax

log = logging.getLogger("gdp_jax")


@functools.lru_cache(maxsize=None)
def _device_reason() -> tuple[bool, str]:
    try:
        devs = jax.devices()
    except RuntimeError as e:  # pragma: no cover - no backend at all
        return False, f"no JAX devices ({e})"
    if devs[0].platform != "gpu":
        return False, f"the default device is {devs[0].platform}, not an sm_90 GPU"
    cc = getattr(devs[0], "compute_capability", "")
    if str(cc) != "9.0":
        return False, f"GPU compute capability {cc} is not sm_90"
    # Only now (an sm_90 GPU is present) pay for importing the CuTe DSL.
    from gdp_jax.kernels import fwd
    return fwd.cutlass_importable()


def cutedsl_available(spec=None, dtype=None) -> tuple[bool, str]:
    """(ok, reason): can the cutedsl backend run in this process (for this call)?

    ``spec`` (a ``_checks.OpSpec``) and ``dtype`` (the inputs' dtype), when given, also
    check the kernels' limits (16-bit inputs, K and V in {64, 128}).
    """
    ok, reason = _device_reason()
    if not ok or spec is None:
        return ok, reason
    from gdp_jax import chunked
    from gdp_jax.kernels import fwd
    NC = chunked.num_chunks(spec.n * spec.T, spec.N, spec.packed)
    why = fwd.unsupported_reason(K=spec.K, V=spec.V, dtype=dtype if dtype is not None
                                 else spec.compute_dtype, B=spec.B, NC=NC, HV=spec.HV)
    return (False, why) if why else (True, "ok")


def _default_platform() -> str:
    try:
        return jax.devices()[0].platform
    except RuntimeError:  # pragma: no cover - no backend at all
        return "none"


def step_available(spec, dtype) -> tuple[bool, str]:
    """(ok, reason): can the cutedsl decoding step run this call (``spec``: a
    ``_checks.OpSpec`` of one token, ``dtype``: the inputs' dtype)?"""
    ok, reason = _device_reason()
    if not ok:
        return ok, reason
    from gdp_jax.kernels import step
    why = step.unsupported_reason(B=spec.B, HV=spec.HV, K=spec.K, V=spec.V, dtype=dtype)
    return (False, why) if why else (True, "ok")


@functools.lru_cache(maxsize=None)
def _log_choice(choice: str, reason: str):
    """Once per (choice, reason): INFO, or WARNING when "auto" leaves a GPU on xla (the
    slow path there; the reason says what to change)."""
    level = logging.WARNING if choice == "xla" and _default_platform() == "gpu" else logging.INFO
    log.log(level, "gdp_jax backend=auto picked %s (%s)", choice, reason)


def resolve(backend: str, spec=None, dtype=None, cp: bool = False, available=None) -> str:
    """Map "auto" to a concrete backend; raise ValueError where "cutedsl" cannot run.

    ``cp``: the call is context-parallel; "auto" then stays on xla (cutedsl under CP passes
    the GPU tests on 1 and 2 H200s but its summaries still run on xla and it has not been
    benchmarked against the xla CP path); pass backend="cutedsl" to use it.
    ``available(spec, dtype) -> (ok, reason)``: which kernels the call needs
    (default :func:`cutedsl_available`, the op's; :func:`step_available` for the step).
    """
    if backend == "xla":
        return "xla"
    ok, reason = (available or cutedsl_available)(spec, dtype)
    if backend == "cutedsl":
        if not ok:
            raise ValueError(f"backend='cutedsl' cannot run here: {reason}")
        return "cutedsl"
    if ok and cp:
        ok, reason = False, "context parallelism runs on the xla backend"
    choice = "cutedsl" if ok else "xla"
    _log_choice(choice, reason if not ok else "sm_90 GPU with CuTe DSL")
    return choice
