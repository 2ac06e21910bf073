"""Test setup: 8 simulated host devices (must be set before jax is imported) and float64."""
import os

# XLA's CPU client sizes its shared thread pool by the core count (2 in CI). Collectives of
# 8 simulated devices block pool threads while the other devices wait for one: deadlock
# (seen here). PJRT_NPROC sets the pool size.
os.environ.setdefault("PJRT_NPROC", "32")
# The suite runs the defaults whatever the user's environment says: tests that count kernel
# calls assume the recomputing backward (their saved-operands cases set the switch).
os.environ.pop("GDP_JAX_SAVE_OPERANDS", None)
# The suite is dominated by XLA compiles of small programs: LLVM at -O0 and XLA's elemental
# fusion emitter compile them faster (tests/_compile_flags.py says what each changes). Set
# either flag yourself to test XLA's default CPU code generation.
# Not on a machine with an NVIDIA GPU (empty there: tests/_compile_flags.py says why).
from _compile_flags import FLAGS as _COMPILE_FLAGS  # noqa: E402

_FLAGS = ("--xla_force_host_platform_device_count=8",) + _COMPILE_FLAGS
_xla_flags = os.environ.get("XLA_FLAGS", "")
for _flag in _FLAGS:
    if _flag.split("=")[0] not in _xla_flags:
        _xla_flags += " " + _flag
os.environ["XLA_FLAGS"] = _xla_flags.strip()

import gc  # noqa: E402

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_enable_x64", True)
# Start the backends now, with the 8 devices above: an in-process CLI call
# (cli.setup_cpu_devices, e.g. test_cli's `check`) would otherwise set
# jax_num_cpu_devices for the whole worker when it ran first there (seen: test_cp's P4 and
# P8 cases then found 2 devices).
jax.devices()


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """Drop every compiled program after each test module. XLA's CPU client maps memory for
    each loaded executable (test_cp.py alone reaches ~16k mappings); the whole suite in one
    process passed vm.max_map_count (65530) and segfaulted inside an XLA compile."""
    yield
    jax.clear_caches()
    gc.collect()


# The kernel variants the suite's build compiles (``ffi/build.py --only``, any text
# matching): bfloat16 at K = V = 128 and K = V = 64 (84 of the 445 variants). The bfloat16
# half alone was 636 of CI's 2308 s (2026-12-07, 216 variants, 2 cores). The other head-dim
# pairs and float16 are the same code on other constants: test_kernels_compile compiles them
# per shape, the op-level lowerings that need one compile it when traced, and the GPU
# machine builds every bfloat16 variant each session (benchmarks/run_gpu_measurements.sh).
# GDP_JAX_TEST_BUILD_ALL=1 builds every variant.
BUILD_ONLY = (() if os.environ.get("GDP_JAX_TEST_BUILD_ALL")
              else ("bfloat16 K=128 V=128", "bfloat16 K=64 V=64"))


@pytest.fixture(scope="session")
def every_kernel_variant(tmp_path_factory):
    """``python ffi/build.py --jobs 2`` (the variants :data:`BUILD_ONLY` names, for sm_90a)
    run ONCE per test session, shared by the pytest-xdist workers: the first test that asks
    for it builds (the largest single cost of the suite: 171-996 s on 2 cores for every
    variant, 2026-12-04/06), the others wait for it on a file lock and read the same
    directory. ``(out_dir, result)``; ``result`` has the build's returncode, stdout,
    stderr (each user asserts on them) and ``only`` (the ``--only`` texts)."""
    import fcntl
    import json
    import pathlib
    import subprocess
    import sys

    repo = pathlib.Path(__file__).resolve().parents[1]
    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent                       # the session's directory, shared by workers
    out, done = base / "every-kernel-variant", base / "every-kernel-variant.json"
    with open(base / "every-kernel-variant.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not done.exists():
            env = dict(os.environ, GDP_JAX_KERNEL_SHAPES="generic",
                       PYTHONPATH=f"{repo}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
            cmd = [sys.executable, str(repo / "ffi" / "build.py"), "--out", str(out),
                   "--jobs", "2"] + [f"--only={t}" for t in BUILD_ONLY]
            try:
                # generous: a timeout fails every test that needs the build, and CI
                # machines vary (s31 saw 833 s where s30 saw 264 s)
                r = subprocess.run(cmd, env=env, capture_output=True, text=True,
                                   timeout=2400)
                res = dict(returncode=r.returncode, stdout=r.stdout, stderr=r.stderr)
            except subprocess.TimeoutExpired as e:     # recorded: the other worker waits once
                res = dict(returncode=None, stdout=str(e.stdout), stderr=f"timed out: {e}")
            done.write_text(json.dumps(dict(res, only=BUILD_ONLY)))
    return out, json.loads(done.read_text())
