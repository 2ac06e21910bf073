"""Context parallelism across 2 processes x 4 CPU devices (jax.distributed + gloo).

Spawns two copies of ``_cp_worker.py``; together they form one 8-device mesh. Each runs
the CP op forward + gradient under jit on globally sharded inputs and checks its own
addressable shards against the single-device op computed locally (float64). The
all_gather of the CP summaries then really crosses a process boundary.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from _compile_flags import TEXT as COMPILE_FLAGS

WORKER = Path(__file__).with_name("_cp_worker.py")
NUM_PROCESSES = 2
LOCAL_DEVICES = 4
TIMEOUT_S = 240
TOL = 1e-10


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env() -> dict:
    env = dict(os.environ)
    env["JAX_PLATFORMS"] = "cpu"
    # the compile settings that tests/conftest.py sets for the suite (faster compiles;
    # tests/_compile_flags.py says what they change)
    env["XLA_FLAGS"] = (f"--xla_force_host_platform_device_count={LOCAL_DEVICES} "
                        + COMPILE_FLAGS)
    # XLA's CPU thread pool is sized by the core count; collectives of several simulated
    # devices deadlock it unless PJRT_NPROC >= 2 x the device count (see conftest.py).
    env["PJRT_NPROC"] = str(4 * LOCAL_DEVICES)
    repo = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (repo, env.get("PYTHONPATH")) if p)
    return env


def _run_workers():
    port = _free_port()
    env = _env()
    procs = [subprocess.Popen([sys.executable, str(WORKER), str(i), str(NUM_PROCESSES),
                               str(port)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
             for i in range(NUM_PROCESSES)]
    deadline = time.monotonic() + TIMEOUT_S
    results = []
    try:
        for p in procs:
            try:
                out, err = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pytest.fail(f"CP worker timed out after {TIMEOUT_S} s")
            results.append((p.returncode, out, err))
    finally:
        for p in procs:                     # only the processes started here
            if p.poll() is None:
                p.kill()
                p.wait()
    return results


def test_cp_two_processes_match_single_device():
    results = _run_workers()
    for i, (rc, out, err) in enumerate(results):
        assert rc == 0, f"worker {i} exited {rc}\nstdout:\n{out[-3000:]}\nstderr:\n{err[-6000:]}"
    reports = []
    for i, (_, out, err) in enumerate(results):
        lines = [ln for ln in out.splitlines() if ln.startswith("{")]
        assert lines, f"worker {i} printed no JSON\nstdout:\n{out}\nstderr:\n{err[-3000:]}"
        reports.append(json.loads(lines[-1]))
    assert sorted(r["process"] for r in reports) == list(range(NUM_PROCESSES))
    owned = {}
    for r in reports:
        assert r["num_devices"] == NUM_PROCESSES * LOCAL_DEVICES
        assert r["num_local_devices"] == LOCAL_DEVICES
        for case, errs in r["errors"].items():
            assert r["nonzero"][case], (r["process"], case)
            bad = {k: e for k, e in errs.items() if not e <= TOL}
            assert not bad, f"process {r['process']}, {case}: errors over {TOL}: {bad}"
            owned.setdefault(case, []).extend(r["ranks"][case])
        assert set(r["errors"]) == {"batched", "packed"}
    # Between them the processes checked every rank's shard, each exactly once.
    for case, ranks in owned.items():
        assert sorted(ranks) == list(range(NUM_PROCESSES * LOCAL_DEVICES)), (case, ranks)
