"""GPU audit of the cutedsl backend's robustness (issue 17, docs/ERRORS.md), sm_90 only.

What the real kernels do with: a non-finite input at one token (earlier tokens must equal
the clean run's, other packed sequences too), T = 1 and tiny lengths, empty and length-1
packed sequences, invalid traced offsets (all NaN), unnormalised keys (finite as long as
the recurrence), a loss masked over inf padding (finite). The XLA glue around the kernels
(kernels.pipeline.causal_operands, the row-causal WY inverse wrapper) is tested on CPU with
emulated kernels (tests/test_robust.py); this file checks the kernels themselves. Last real run: 2026-12-04, nvidia-h200: all 48 passed
(tests/gpu_results/GPU_TESTS.md, run s20-3: the twentieth session's final device code).

Run on the H200:
    python tests/test_robust_gpu.py --out "$OUT"          # or: pytest -m gpu -s <this file>
Every check prints one ``PASS name: numbers`` or ``FAIL name: numbers`` line; with --out the
lines also go to robust_gpu.jsonl, and pytest's log and junit xml to robust_gpu.{log,xml}.
"""
from __future__ import annotations

import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytestmark = pytest.mark.gpu

OUT_ENV = "GDP_ROBUST_GPU_OUT"
TOL = 5e-3           # FLA-style relative RMS vs the float64 reference (test_cutedsl_gpu.py)


from gdp_jax.testing import sm90_gpu_present as _gpu_ok  # noqa: E402


if __name__ != "__main__" and not _gpu_ok():
    pytest.skip("needs an sm_90 GPU", allow_module_level=True)

from gdp_jax import gated_delta_product as OP  # noqa: E402
from gdp_jax import gated_delta_product_reference as REF  # noqa: E402
from gdp_jax.testing import rel_rms  # noqa: E402

FIELDS = ("q", "k", "v", "g", "beta")


def record(name, ok, **numbers):
    """Print and (with --out) store one PASS/FAIL line; returns ok."""
    line = f"{'PASS' if ok else 'FAIL'} {name}: " + ", ".join(f"{k}={v}" for k, v in
                                                             numbers.items())
    print(line, flush=True)
    out = os.environ.get(OUT_ENV)
    if out:
        with open(os.path.join(out, "robust_gpu.jsonl"), "a") as f:
            f.write(json.dumps({"name": name, "ok": bool(ok), **{k: str(v) for k, v in
                                                                 numbers.items()}}) + "\n")
    return ok


def make(seed, B, T, n, H, HV, K, V, dtype, N=None):
    """Random inputs with unit-norm keys (stable recurrence), h0 included."""
    N = B if N is None else N
    rng = np.random.default_rng(seed)
    k = rng.standard_normal((B, T, n, H, K))
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    d = dict(q=rng.standard_normal((B, T, H, K)), k=k,
             v=rng.standard_normal((B, T, n, HV, V)),
             g=-rng.uniform(0.01, 1.0, (B, T, HV)),
             beta=rng.uniform(0.05, 1.95, (B, T, n, HV)),
             h0=rng.standard_normal((N, HV, K, V)) * 0.1)
    out = {n_: jnp.asarray(x, dtype) for n_, x in d.items() if n_ in ("q", "k", "v", "beta")}
    out["g"] = jnp.asarray(d["g"], jnp.float32)
    out["h0"] = jnp.asarray(d["h0"], jnp.float32)
    return out


def run(a, backend="cutedsl", **kw):
    return OP(a["q"], a["k"], a["v"], a["g"], a["beta"], initial_state=a["h0"],
              backend=backend, **kw)


def ref(a, **kw):
    """The float64 recurrence (call under x64)."""
    f64 = {n: jnp.asarray(x).astype(jnp.float64) for n, x in a.items()}
    return REF(f64["q"], f64["k"], f64["v"], f64["g"], f64["beta"], initial_state=f64["h0"],
               **kw)


# --- non-finite inputs --------------------------------------------------------------------

CU = np.asarray([0, 100, 100, 101, 300], np.int32)      # empty and length-1 sequences


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])     # the kernels' input dtypes
@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("name", FIELDS)
def test_nonfinite_input_is_causal(name, packed, dtype):
    """inf/NaN at token t0: outputs before t0 and of other sequences equal the clean run
    (the kernels' MMAs multiply P's zeros by later rows; the glue must keep them finite)."""
    N = len(CU) - 1 if packed else 1
    a = make(1, 1, 300, 2, 2, 4, 64, 64, jnp.dtype(dtype), N=N)
    cu = CU if packed else None
    f = jax.jit(lambda a: run(a, cu_seqlens=cu))
    clean = np.asarray(f(a), np.float32)
    ok_all = True
    for t0, value in ((150, np.inf), (200, np.nan), (100, -np.inf), (0, np.nan)):
        x = np.array(a[name], np.float32)
        x[0, t0] = value
        bad = dict(a, **{name: jnp.asarray(x, a[name].dtype)})
        o = np.asarray(f(bad), np.float32)
        end = 300 if not packed else int(min(c for c in CU if c > t0))
        keep = np.r_[0:t0, end:300]
        diff = float(np.abs(o[:, keep] - clean[:, keep]).max()) if keep.size else 0.0
        scale = float(np.abs(clean).max())
        nonfinite_after = int((~np.isfinite(o[:, t0:end])).any(axis=(0, 2, 3)).sum())
        # g = -inf wipes the state (exp(-inf) = 0): finite, as in the recurrence
        wipes = name == "g" and value == -np.inf
        ok = (bool(np.isfinite(o[:, keep]).all()) and diff <= 1e-6 * scale
              and (wipes or not np.isfinite(o[:, t0]).all()))
        ok_all &= record(f"nonfinite {name}={value} t0={t0} packed={packed} {dtype}", ok,
                         max_diff_before=diff, out_scale=scale,
                         nonfinite_tokens_from_t0=nonfinite_after)
    assert ok_all


def test_masked_loss_over_inf_padding_is_finite():
    a = make(2, 1, 256, 2, 2, 4, 64, 64, jnp.bfloat16)
    v = np.array(a["v"], np.float32)
    v[0, 200:] = np.inf
    a = dict(a, v=jnp.asarray(v, jnp.bfloat16))
    mask = (jnp.arange(256) < 200)[None, :, None, None]
    got = float(jnp.sum(jnp.where(mask, run(a).astype(jnp.float32), 0.0)))
    with jax.enable_x64(True):
        want = float(jnp.sum(jnp.where(mask, ref(a), 0.0)))
    err = abs(got - want) / (abs(want) + 1e-30)
    assert record("masked loss over inf padding", np.isfinite(got) and err < 2e-2,
                  loss=got, ref=want, rel_err=err)


def test_unnormalised_keys_stay_finite_as_long_as_the_recurrence():
    a = make(3, 1, 128, 2, 1, 2, 64, 64, jnp.bfloat16)
    a = dict(a, k=a["k"] * 10)
    o = np.asarray(run(a).astype(jnp.float32))
    f32 = {n_: x.astype(jnp.float32) for n_, x in a.items()}     # the same (bf16) numbers
    r32 = np.asarray(REF(f32["q"], f32["k"], f32["v"], f32["g"], f32["beta"],
                         initial_state=f32["h0"]))
    fo, fr = np.isfinite(o).all(axis=(0, 2, 3)), np.isfinite(r32).all(axis=(0, 2, 3))
    n_r = int(np.argmin(fr)) if not fr.all() else 128
    n_o = int(np.argmin(fo)) if not fo.all() else 128
    assert record("keys x10: finite prefix", n_o >= n_r, op_finite_tokens=n_o,
                  float32_recurrence_finite_tokens=n_r)


# --- tiny, T = 1, empty sequences ---------------------------------------------------------

@pytest.mark.parametrize("T", [1, 2, 3, 63, 64, 65])
@pytest.mark.parametrize("n", [1, 2, 3])
def test_tiny_lengths_forward_and_grad(T, n):
    a = make(4 + T, 2, T, n, 1, 2, 64, 64, jnp.bfloat16)
    errs = _fwd_grad_errors(a, None)
    assert record(f"tiny T={T} n={n}", max(errs.values()) < 2 * TOL, **errs)


@pytest.mark.parametrize("cu", [(0, 0, 1), (0, 1, 1, 2, 2), (0, 0, 0, 5), (0, 64, 64, 65),
                                (0, 1, 2, 3, 4, 5, 6, 7)])
def test_empty_and_length_one_sequences(cu):
    cu = np.asarray(cu, np.int32)
    a = make(5, 1, int(cu[-1]), 2, 1, 2, 64, 64, jnp.bfloat16, N=len(cu) - 1)
    errs = _fwd_grad_errors(a, cu)
    assert record(f"packed cu={cu.tolist()}", max(errs.values()) < 2 * TOL, **errs)


def _fwd_grad_errors(a, cu):
    """Relative RMS errors of o, final and every gradient vs the float64 reference."""
    rng = np.random.default_rng(0)
    o_shape = a["v"].shape[:2] + a["v"].shape[3:]
    wo = jnp.asarray(rng.standard_normal(o_shape))
    ws = jnp.asarray(rng.standard_normal(a["h0"].shape))

    def loss(a, fn):
        o, s = fn(a, output_final_state=True, cu_seqlens=cu)
        return jnp.sum(o.astype(wo.dtype) * wo) + jnp.sum(s.astype(ws.dtype) * ws), (o, s)

    with jax.enable_x64(True):
        (_, (o_r, s_r)), g_r = jax.value_and_grad(lambda a: loss(a, ref), has_aux=True)(
            {n: jnp.asarray(np.asarray(x, np.float64)) for n, x in a.items()})
    (_, (o, s)), g = jax.jit(jax.value_and_grad(lambda a: loss(a, run), has_aux=True))(a)
    errs = {"o": rel_rms(o, o_r), "final": rel_rms(s, s_r)}
    errs.update({f"d{n}": rel_rms(g[n], g_r[n]) for n in g})
    return {k: (v if np.isfinite(v) else float("inf")) for k, v in errs.items()}


# --- traced offsets -----------------------------------------------------------------------

@pytest.mark.parametrize("cu", [(1, 50, 100), (0, 50, 99), (0, 60, 50, 100)])
def test_invalid_traced_offsets_are_all_nan(cu):
    a = make(6, 1, 100, 2, 1, 2, 64, 64, jnp.bfloat16, N=len(cu) - 1)

    def loss(a, c):
        o, s = run(a, output_final_state=True, cu_seqlens=c)
        return jnp.sum(o.astype(jnp.float32)) + jnp.sum(s), (o, s)

    (_, (o, s)), g = jax.jit(jax.value_and_grad(loss, has_aux=True))(
        a, jnp.asarray(cu, jnp.int32))
    leaves = [o, s] + list(g.values())
    n_nan = sum(int(np.isnan(np.asarray(x, np.float32)).all()) for x in leaves)
    assert record(f"invalid traced cu={list(cu)}", n_nan == len(leaves),
                  all_nan_arrays=n_nan, arrays=len(leaves))


def main(argv):
    import argparse
    import subprocess
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    out = p.parse_args(argv).out
    os.makedirs(out, exist_ok=True)
    open(os.path.join(out, "robust_gpu.jsonl"), "w").close()
    if not _gpu_ok():
        record("gpu present", False, devices=jax.devices())
        return 1
    env = dict(os.environ, **{OUT_ENV: os.path.abspath(out)})
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "-s", "-q", "-p", "no:cacheprovider",
           os.path.abspath(__file__), f"--junitxml={os.path.join(out, 'robust_gpu.xml')}"]
    with open(os.path.join(out, "robust_gpu.log"), "w") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True)
        for line in proc.stdout:
            sys.stdout.write(line)
            log.write(line)
    rows = [json.loads(x) for x in open(os.path.join(out, "robust_gpu.jsonl"))]
    print(f"SUMMARY robust_gpu: {sum(r['ok'] for r in rows)}/{len(rows)} checks PASS, "
          f"pytest rc={proc.returncode}")
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
