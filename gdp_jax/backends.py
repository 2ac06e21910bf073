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
    from gdp_jax.kernels import binding
    return binding.cutlass_importable()


def engine(backend: str):
    """The engine of a resolved backend name ("xla" or "cutedsl")."""
    if backend == "cutedsl":
        from gdp_jax.kernels.pipeline import CUTEDSL
        return CUTEDSL
    from gdp_jax.engine import XLA
    return XLA


def cutedsl_available(spec=None) -> tuple[bool, str]:
    """(ok, reason): can the cutedsl backend run in this process (for this call)?

    ``spec`` (a :class:`gdp_jax.spec.CallSpec`), when given, is held against the kernels'
    limits first (their ``can_implement``; no CuTe DSL import needed), then the device.
    """
    if spec is not None:
        from gdp_jax.kernels.pipeline import CuTeDSLEngine
        why = CuTeDSLEngine.can_implement(spec)
        if why:
            return False, why
    return _device_reason()


def _default_platform() -> str:
    try:
        return jax.devices()[0].platform
    except RuntimeError:  # pragma: no cover - no backend at all
        return "none"


def step_available(spec) -> tuple[bool, str]:
    """(ok, reason): can the cutedsl decoding step run this call (``spec``: the
    :class:`gdp_jax.spec.CallSpec` of one token)?"""
    from gdp_jax.kernels.step import StepKernel
    why = StepKernel.can_implement(dtype=spec.ab_dtype, B=spec.B, HV=spec.HV, K=spec.K,
                                   V=spec.V)
    if why:
        return False, why
    return _device_reason()


@functools.lru_cache(maxsize=None)
def _log_choice(choice: str, reason: str):
    """Once per (choice, reason): INFO, or WARNING when "auto" leaves a GPU on xla (the
    slow path there; the reason says what to change)."""
    level = logging.WARNING if choice == "xla" and _default_platform() == "gpu" else logging.INFO
    log.log(level, "gdp_jax backend=auto picked %s (%s)", choice, reason)


def resolve(backend: str, spec=None, cp: bool = False, available=None) -> str:
    """Map "auto" to a concrete backend; raise ValueError where "cutedsl" cannot run.

    ``cp``: the call is context-parallel; "auto" then stays on xla (cutedsl under CP passes
    the GPU tests on 1 and 2 H200s but its summaries still run on xla and it has not been
    benchmarked against the xla CP path); pass backend="cutedsl" to use it.
    ``available(spec) -> (ok, reason)``: which kernels the call needs
    (default :func:`cutedsl_available`, the op's; :func:`step_available` for the step).
    """
    if backend == "xla":
        return "xla"
    ok, reason = (available or cutedsl_available)(spec)
    if backend == "cutedsl":
        if not ok:
            raise getattr(reason, "error", ValueError)(
                f"backend='cutedsl' cannot run here: {reason}")
        return "cutedsl"
    if ok and cp:
        ok, reason = False, "context parallelism runs on the xla backend"
    choice = "cutedsl" if ok else "xla"
    _log_choice(choice, reason if not ok else "sm_90 GPU with CuTe DSL")
    return choice
