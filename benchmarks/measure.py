"""Timing, the log, and what each result row records about where it was measured."""
from __future__ import annotations

import datetime as dt
import glob
import hashlib
import importlib.metadata
import os
import statistics
import subprocess
import sys
import time

T0 = time.time()
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_LOG = []            # open log files (the runner adds one per run)


def log(*a):
    """Print with the seconds since start, flushed (GPU runs are read as they go), and
    append to the run's log file."""
    line = " ".join([f"[{time.time() - T0:7.1f}s]"] + [str(x) for x in a])
    print(line, flush=True)
    for f in _LOG:
        f.write(line + "\n")
        f.flush()


def log_traceback():
    """The current exception's traceback, into the log file only (the console keeps one line)."""
    import traceback
    for f in _LOG:
        f.write(traceback.format_exc()[-4000:] + "\n")
        f.flush()


def x64():
    """A context with float64 enabled (for the references), the global flag untouched."""
    import jax
    if hasattr(jax, "enable_x64"):
        return jax.enable_x64(True)
    from jax.experimental import enable_x64      # older jax
    return enable_x64()


def free_torch_cache():
    """Give torch's cached blocks back to the device (XLA allocates next), if torch is loaded."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        torch.cuda.empty_cache()


def reset_clock():
    """Start the run's clock (--deadline and the log's seconds count from here)."""
    global T0
    T0 = time.time()


def elapsed() -> float:
    return time.time() - T0


def median_ms(fn, sync, iters: int, reps: int, warmup: int = 2) -> float:
    """Median over ``reps`` of the mean per-call ms of ``iters`` back-to-back calls, after
    ``warmup`` calls; ``sync`` waits for the last call's result."""
    for _ in range(warmup):
        sync(fn())
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        for _ in range(iters):
            out = fn()
        sync(out)
        ts.append((time.perf_counter() - t) / iters * 1e3)
    return statistics.median(ts)


def median_chain_ms(step, S, sync, iters: int, reps: int, warmup: int = 3) -> float:
    """The same for a chained state update S = step(S) (the state donated each call)."""
    for _ in range(warmup):
        S = step(S)
    sync(S)
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        for _ in range(iters):
            S = step(S)
        sync(S)
        ts.append((time.perf_counter() - t) / iters * 1e3)
    return statistics.median(ts)


def _git_commit() -> str:
    if os.environ.get("GDP_BENCH_COMMIT"):
        return os.environ["GDP_BENCH_COMMIT"]
    try:
        out = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"],
                             capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "-C", ROOT, "status", "--porcelain", "gdp_jax"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
        if out.returncode == 0:
            return out.stdout.strip() + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        pass
    return "unknown (no git here; set GDP_BENCH_COMMIT)"


def source_hash() -> str:
    """sha256 prefix of gdp_jax/**/*.py: names the code even where there is no git."""
    h = hashlib.sha256()
    for p in sorted(glob.glob(os.path.join(ROOT, "gdp_jax", "**", "*.py"), recursive=True)):
        h.update(os.path.relpath(p, ROOT).encode())
        with open(p, "rb") as f:
            h.update(f.read())
    return h.hexdigest()[:12]


def _dist_version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "-"


def environment(argv, fla_version: str = "not requested") -> dict:
    """Where and on what this run measures (every row carries it)."""
    import jax
    d = jax.devices()[0]
    return {"date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "commit": _git_commit(), "gdp_jax_sources": source_hash(),
            "command": " ".join(["python -m benchmarks.run"] + list(argv)),
            "device": f"{len(jax.devices())} x {getattr(d, 'device_kind', d.platform)}",
            "jax": jax.__version__, "jaxlib": _dist_version("jaxlib"),
            "cutlass_dsl": _dist_version("nvidia-cutlass-dsl"), "fla": fla_version,
            "python": sys.version.split()[0], "kernels": kernel_compile_mode()}


def kernel_compile_mode() -> str:
    """How this run's cutedsl kernels are compiled (``gdp_jax.kernels.binding.
    kernel_shapes``): "generic (prebuilt)" objects for every shape ("generic" when none are
    prebuilt and the shape-generic mode was asked for) or "static" per-shape ones. They
    differ in speed (s34: fwd+bwd 8.57-8.59 vs 8.29-8.39 ms at (8, 4096, 16, 2) on one
    H100), so a comparison across runs must hold this fixed."""
    from gdp_jax.kernels import aot, binding
    mode = binding.kernel_shapes()
    if mode == "generic" and aot.store(binding.device_source_hash()).entries:
        return "generic (prebuilt)"
    return mode


def short_error(e: BaseException) -> str:
    """One line for a table: the exception type and the start of its message."""
    msg = " ".join(str(e).split())
    return f"{type(e).__name__}: {msg[:240]}"


def is_oom(e: BaseException) -> bool:
    s = f"{type(e).__name__} {e}".lower()
    return "resource_exhausted" in s or "out of memory" in s or "outofmemory" in s
