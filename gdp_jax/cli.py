"""The ``gdp-jax`` command line (also ``python -m gdp_jax``).

    gdp-jax check   # the op against the token recurrence on this machine: outputs + grads
    gdp-jax demo    # S3 state tracking, n_h = 1 vs 2, then a context-parallel check

Simulated CPU devices come from ``jax.config.update("jax_num_cpu_devices", n)``, which
must run before JAX starts its backends; the commands do it first (nothing here touches
a JAX device before that).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

SELF_CHECK_HINT = ("Self-check of this installation: gdp-jax check   (about a minute on CPU)\n"
                   "S3 state-tracking demo:          gdp-jax demo    (about 2 minutes on CPU)")


# ---------------------------------------------------------------------------------------
# environment (must run before JAX creates its backends)
# ---------------------------------------------------------------------------------------

def setup_cpu_devices(n: int) -> None:
    """Make JAX's CPU platform expose ``n`` devices (``jax_num_cpu_devices``).

    Also sizes the CPU client's thread pool (PJRT_NPROC, unless set): XLA sizes it by the
    core count, and with fewer threads than simulated devices the collectives of a
    multi-device program wait forever for ranks whose work sits in the same exhausted pool.
    """
    # At least 32 threads even for one device: a generous pool costs nothing and keeps
    # jaxlib kernels that wait on work queued to the same pool safe.
    os.environ.setdefault("PJRT_NPROC", str(max(4 * n, 32, os.cpu_count() or 1)))
    import jax
    try:
        jax.config.update("jax_num_cpu_devices", n)
    except RuntimeError:           # backends already started (e.g. called from a notebook)
        have = len(jax.devices("cpu"))
        if have < n:
            print(f"warning: JAX's backends were already initialised with {have} CPU "
                  f"device(s); {n} were requested", file=sys.stderr)


# ---------------------------------------------------------------------------------------
# gdp-jax check
# ---------------------------------------------------------------------------------------

CHECK_CASES = (
    # name, B, T, H, HV, K, V, n, gate, packed offsets, initial state
    ("GDN (n=1), gated", 2, 50, 2, 2, 16, 16, 1, True, None, False),
    ("GDP n=2, GVA (HV=2H), gated", 2, 70, 1, 2, 16, 8, 2, True, None, True),
    ("GDP n=3, packed, no gate", 1, 90, 2, 4, 8, 16, 3, False, (0, 7, 40, 40, 90), True),
)
# The cutedsl kernels take 16-bit inputs with K, V in {64, 128}: their own cases, in bf16.
KERNEL_CASES = (
    ("GDP n=2, GVA, K=V=128, gated", 2, 203, 2, 4, 128, 128, 2, True, None, True),
    ("GDN (n=1), GVA, K=64 V=128", 2, 203, 1, 3, 64, 128, 1, True, None, True),
    ("GDP n=3, packed, K=V=64, no gate", 1, 265, 2, 2, 64, 64, 3, False,
     (0, 70, 70, 71, 201, 265), True),
)
# Relative RMS error bounds (output and final state, gradients) per input dtype. bf16:
# the inputs are rounded once; the kernels' 16-bit operands add a few 1e-3 (as the GPU
# tests, tests/test_cutedsl_gpu.py).
TOLERANCE = {"bfloat16": (5e-3, 1e-2), "float32": (2e-4, 2e-4), "float64": (1e-9, 1e-9)}
# float32 matmuls on NVIDIA GPUs run as TF32 (10-bit mantissa) under XLA's default
# precision: float32 results there are only as exact as the bf16 bounds say.
TF32_TOLERANCE = TOLERANCE["bfloat16"]


def _tolerance(dname: str):
    """(output, gradient) bounds for inputs of dtype ``dname`` on this machine."""
    import jax
    tf32 = (dname == "float32" and jax.default_backend() == "gpu"
            and jax.config.jax_default_matmul_precision in (None, "default", "tensorfloat32"))
    return TF32_TOLERANCE if tf32 else TOLERANCE[dname]


def _check_inputs(case, dtype, seed):
    import jax
    import jax.numpy as jnp
    name, B, T, H, HV, K, V, n, gate, cu, h0 = case
    ks = jax.random.split(jax.random.key(seed), 8)
    f64 = jnp.float64
    q = jax.random.normal(ks[0], (B, T, H, K), f64)
    k = jax.random.normal(ks[1], (B, T, n, H, K), f64)
    v = jax.random.normal(ks[2], (B, T, n, HV, V), f64)
    beta = 2 * jax.nn.sigmoid(jax.random.normal(ks[3], (B, T, n, HV), f64))
    g = jax.nn.log_sigmoid(2 + jax.random.normal(ks[4], (B, T, HV), f64)) if gate else None
    N = B if cu is None else len(cu) - 1
    state = 0.1 * jax.random.normal(ks[5], (N, HV, K, V), f64) if h0 else None
    do = jax.random.normal(ks[6], (B, T, HV, V), f64)
    dfinal = jax.random.normal(ks[7], (N, HV, K, V), f64)
    cast = lambda x: None if x is None else x.astype(dtype)
    gdt = f64 if dtype == f64 else jnp.float32        # g and states: float32 or wider
    diff = dict(q=cast(q), k=cast(k), v=cast(v), beta=cast(beta),
                g=None if g is None else g.astype(gdt),
                initial_state=None if state is None else state.astype(gdt))
    cts = (do.astype(dtype), dfinal.astype(gdt))
    cu = None if cu is None else jnp.asarray(cu, jnp.int32)
    return diff, cts, cu


def _run(fn, diff, cts, cu):
    """Outputs and input gradients (one vjp with cotangents ``cts``), jitted."""
    import jax
    names = [k for k, x in diff.items() if x is not None]

    @jax.jit
    def run(xs, cts, cu):
        def f(*xs):
            kw = dict(diff, **dict(zip(names, xs)))
            return fn(kw["q"], kw["k"], kw["v"], kw["g"], kw["beta"],
                      initial_state=kw["initial_state"], output_final_state=True,
                      cu_seqlens=cu, use_qk_l2norm=True)
        out, pull = jax.vjp(f, *xs)
        return out, pull(cts)

    out, grads = run([diff[k] for k in names], cts, cu)
    return dict(o=out[0], final_state=out[1], **{"d" + k: g for k, g in zip(names, grads)})


def _rel_err(a, b):
    import numpy as np
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if not (np.all(np.isfinite(a))):
        return float("inf")
    return float(np.sqrt(np.mean((a - b) ** 2)) / (np.sqrt(np.mean(b ** 2)) + 1e-30))


def _check_plan(backend: str):
    """[(case, dtype name, backend)]: xla in float32 and float64 on the small cases, and
    where the kernels run, cutedsl (and what 'auto' picks) in bfloat16 on kernel shapes."""
    plan = [(c, d, "xla") for c in CHECK_CASES for d in ("float32", "float64")]
    if backend in ("cutedsl", "auto"):
        plan += [(c, "bfloat16", "cutedsl") for c in KERNEL_CASES]
    if backend == "auto":
        plan += [(KERNEL_CASES[0], "bfloat16", "auto")]
    return plan


def _compare(case, dname, be, seed, refs):
    """(out err, grad err, worst name, ok) of one backend on one case vs the reference."""
    import jax.numpy as jnp
    import gdp_jax
    dtype = jnp.dtype(dname)
    diff, cts, cu = _check_inputs(case, dtype, seed)
    key = (case[0], dname)
    if key not in refs:      # ground truth: the float64 token recurrence, same rounded inputs
        up = {k: None if x is None else x.astype(jnp.float64) for k, x in diff.items()}
        refs[key] = _run(gdp_jax.gated_delta_product_reference, up,
                         tuple(c.astype(jnp.float64) for c in cts), cu)
    ref = refs[key]
    op = lambda *a, **kw: gdp_jax.gated_delta_product(*a, backend=be, **kw)
    got = _run(op, diff, cts, cu)
    errs = {k: _rel_err(got[k], ref[k]) for k in ref}
    eo = max(errs["o"], errs["final_state"])
    eg = max(e for k, e in errs.items() if k.startswith("d"))
    tol_o, tol_g = _tolerance(dname)
    worst = max(errs, key=lambda k: errs[k] / (tol_g if k.startswith("d") else tol_o))
    return eo, eg, worst, eo <= tol_o and eg <= tol_g


def run_check(args) -> int:
    setup_cpu_devices(max(1, args.devices))
    import jax
    jax.config.update("jax_enable_x64", True)
    import gdp_jax
    from gdp_jax import backends

    devs = jax.devices()
    ok_cut, why = backends.cutedsl_available()
    auto = backends.resolve("auto")
    header = [f"gdp-jax {gdp_jax.__version__}, jax {jax.__version__}, {len(devs)} x "
              f"{devs[0].platform} ({devs[0].device_kind}), "
              f"{time.strftime('%Y-%m-%d %H:%M:%S %Z')}",
              f"backend='auto' resolves to {auto!r}"
              + ("" if ok_cut else f" (cutedsl unavailable: {why})")]
    print("\n".join(header), flush=True)
    backend = args.backend
    if backend == "auto" and not ok_cut:
        backend = "xla"
    elif backend == "cutedsl" and not ok_cut:
        print(f"FAIL: --backend cutedsl, but cutedsl cannot run here: {why}")
        return 1
    header.append(f"command: gdp-jax check --backend {args.backend} --devices {args.devices} "
                  f"--seed {args.seed}")
    plan = _check_plan(backend)
    total = len(plan) + (2 if args.devices > 1 else 0)
    print(f"{total} comparisons against the float64 token recurrence (each compiles "
          "first: seconds on CPU, up to a minute for the first kernel case on a GPU)",
          flush=True)

    rows, refs = [], {}
    t0 = time.perf_counter()
    for i, (case, dname, be) in enumerate(plan, 1):
        print(f"[{i}/{total}] {case[0]}, {dname}, {be} ...", end=" ", flush=True)
        t1 = time.perf_counter()
        eo, eg, worst, ok = _compare(case, dname, be, args.seed, refs)
        print(f"{'ok' if ok else 'MISMATCH'} ({time.perf_counter() - t1:.0f} s)", flush=True)
        rows.append((case[0], dname, be, eo, eg, worst, ok))
    if args.devices > 1:
        print(f"[{len(plan) + 1}-{total}/{total}] context parallel over {args.devices} "
              "devices ...", end=" ", flush=True)
        rows += _check_cp(args.devices, args.seed)
        print("done", flush=True)
    return _report(rows, time.perf_counter() - t0, header, args.out)


def _report(rows, seconds, header, out=None) -> int:
    """Print the table and the PASS/FAIL line (also to ``out``/check.md and check.json)."""
    w = max(len(r[0]) for r in rows)
    lines = [f"{'case':<{w}}  dtype     backend  out err   grad err  worst          ok"]
    for name, dname, be, eo, eg, worst, ok in rows:
        lines.append(f"{name:<{w}}  {dname:<8}  {be:<7}  {eo:.1e}   {eg:.1e}   {worst:<13}  "
                     f"{'yes' if ok else 'NO'}")
    tol = ", ".join(f"{d} {o:g}/{g:g}" for d, (o, g) in
                    ((d, _tolerance(d)) for d in TOLERANCE))
    lines += ["", f"(relative RMS error against the float64 token recurrence, outputs/"
              f"gradients; tolerance {tol}; {seconds:.0f} s)"]
    failures = sum(not r[-1] for r in rows)
    lines.append(f"FAIL: {failures} of {len(rows)} comparisons are outside tolerance"
                 if failures else f"PASS: all {len(rows)} comparisons agree with the reference")
    print("\n" + "\n".join(lines))
    if out:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "check.md"), "w") as f:
            f.write("\n".join(header + ["", "```"] + lines + ["```", ""]))
        with open(os.path.join(out, "check.json"), "w") as f:
            json.dump(dict(header=header, seconds=seconds, passed=not failures, rows=[
                dict(case=r[0], dtype=r[1], backend=r[2], out_err=r[3], grad_err=r[4],
                     worst=r[5], ok=r[6]) for r in rows]), f, indent=1)
        print(f"wrote {out}/check.md and check.json")
    return 1 if failures else 0


def _check_cp(P: int, seed: int):
    """Context parallel over P devices == the single-device op (packed, crossing ranks)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, PartitionSpec as Ps
    import gdp_jax

    devs = jax.devices()
    if len(devs) < P:
        devs = jax.devices("cpu")
    mesh = Mesh(np.array(devs[:P]), ("cp",))
    T = 16 * P
    cuts = sorted({0, T, 5, T // 2 + 3, T // 2 + 3, T - 11})
    case = (f"CP over {P} devices, packed", 1, T, 2, 4, 8, 8, 2, True, tuple(cuts), False)
    rows = []
    for dtype in (jnp.float32, jnp.float64):
        dname = jnp.dtype(dtype).name
        diff, cts, cu = _check_inputs(case, dtype, seed)
        q, k, v, g, beta = (diff[x] for x in ("q", "k", "v", "g", "beta"))
        do = cts[0]

        def loss(q, k, v, g, beta, cp_axis):
            o = gdp_jax.gated_delta_product(q, k, v, g, beta, cu_seqlens=cu,
                                            use_qk_l2norm=True, cp_axis=cp_axis)
            part = jnp.sum(o * do_local(do, cp_axis))
            return part if cp_axis is None else jax.lax.psum(part, cp_axis), o

        def do_local(do, cp_axis):
            if cp_axis is None:
                return do
            Tl = do.shape[1] // P
            return jax.lax.dynamic_slice_in_dim(do, jax.lax.axis_index(cp_axis) * Tl, Tl, 1)

        gfun = jax.grad(loss, argnums=(0, 1, 2, 3, 4), has_aux=True)
        # jitted: run eagerly (op by op) the one-device reference took ~85 of the ~110 s
        # of this check on a 2-core CPU; compiled, ~14 s (same ops, same results)
        ref_g, ref_o = jax.jit(gfun, static_argnums=5)(q, k, v, g, beta, None)
        sp = Ps(None, "cp")
        cp_fn = jax.jit(jax.shard_map(lambda *a: gfun(*a, "cp"), mesh=mesh,
                                      in_specs=(sp,) * 5, out_specs=((sp,) * 5, sp)))
        got_g, got_o = cp_fn(q, k, v, g, beta)
        eo = _rel_err(got_o, ref_o)
        eg = max(_rel_err(a, b) for a, b in zip(got_g, ref_g))
        tol_o, tol_g = _tolerance(dname)
        ok = eo <= tol_o and eg <= tol_g
        rows.append((case[0], dname, "xla", eo, eg, "vs 1 device", ok))
    return rows


# ---------------------------------------------------------------------------------------
# gdp-jax demo
# ---------------------------------------------------------------------------------------

def results_table(results) -> str:
    """Markdown table: accuracy at the training length and at eval_factor x."""
    r0 = results[0]
    lines = [f"| n_h | acc @ train length {r0.train_len} | acc @ {r0.eval_len} "
             f"({r0.eval_len // r0.train_len}x) | acc on positions {r0.train_len + 1}-"
             f"{r0.eval_len} | final train loss | seconds |",
             "| --- | --- | --- | --- | --- | --- |"]
    for r in results:
        beyond = float(r.acc_per_position[r.train_len:].mean())
        lines.append(f"| {r.num_householder} | {r.acc_train_len:.3f} | {r.acc_eval_len:.3f} "
                     f"| {beyond:.3f} | {r.losses[-1]:.3f} | {r.seconds:.0f} |")
    return "\n".join(lines)


def plot_results(results, path: str) -> None:
    from matplotlib.figure import Figure      # no pyplot: no GUI backend is touched
    import numpy as np

    fig = Figure(figsize=(7, 4))
    ax = fig.subplots()
    for r in results:
        acc = r.acc_per_position
        w = max(1, len(acc) // 64)
        smooth = np.convolve(acc, np.ones(w) / w, mode="valid")
        ax.plot(np.arange(len(smooth)) + w, smooth, label=f"n_h = {r.num_householder}")
    ax.axvline(results[0].train_len, color="gray", ls="--", lw=1, label="training length")
    ax.axhline(1 / 6, color="gray", ls=":", lw=1, label="chance (1/6)")
    ax.set_xlabel("position in the word (prefix length)")
    ax.set_ylabel("accuracy of the prefix product")
    ax.set_ylim(0, 1.02)
    ax.set_title("S3 word problem, one Gated DeltaProduct layer")
    ax.legend(loc="center right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


DEMO_NEEDS = ("flax", "optax", "matplotlib", "tqdm")


def _missing_demo_packages():
    import importlib.util
    return [m for m in DEMO_NEEDS if importlib.util.find_spec(m) is None]


def _train_all(args):
    """Train one model per n_h on one device, with a tqdm bar per model."""
    from tqdm import tqdm
    from gdp_jax import s3
    results = []
    for nh in args.nh:
        with tqdm(total=args.steps, desc=f"n_h={nh}", disable=args.no_progress,
                  dynamic_ncols=True) as bar:
            def progress(i, loss, acc):
                bar.set_postfix(loss=f"{loss:.3f}", acc=f"{acc:.3f}", refresh=False)
                bar.update(1)
            res = s3.train_s3(nh, steps=args.steps, seq_len=args.seq_len, batch=args.batch,
                              eval_factor=args.eval_factor, devices=1, lr=args.lr,
                              seed=args.seed, progress=progress)
        print(f"n_h={nh}: accuracy {res.acc_train_len:.3f} at length {res.train_len}, "
              f"{res.acc_eval_len:.3f} at length {res.eval_len} ({res.seconds:.0f} s)",
              flush=True)
        results.append(res)
    return results


# Relative RMS, float64, CP vs one device: logits, loss and parameter gradients agree to
# float64 rounding (~1e-15 measured); anything near float32 rounding is a defect.
CP_TOLERANCE = 1e-10


def _cp_check(args, results):
    """Each trained model context-parallel over ``args.devices`` CPU devices == one device."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from gdp_jax import s3
    # In float64 (training is done): equality up to float64 rounding, not float32 noise.
    jax.config.update("jax_enable_x64", True)
    P, T = args.devices, 16 * args.devices
    x, y = s3.sample_batch(np.random.default_rng(args.seed + 7), 8, T)
    ok, lines, diffs = True, [], {}
    for res in results:
        t0 = time.perf_counter()
        d = s3.cp_agreement(s3.S3Config(num_householder=res.num_householder), res.params,
                            P, x, y, dtype=jnp.float64)
        ok_i = max(d.values()) <= CP_TOLERANCE
        lines.append(f"n_h={res.num_householder}: context parallel over {P} CPU devices "
                     f"(words of {T} tokens, 16 per device) vs one device, float64, relative "
                     f"RMS difference: logits {d['logits']:.1e}, loss {d['loss']:.1e}, parameter "
                     f"gradients {d['grads']:.1e} ({time.perf_counter() - t0:.0f} s): "
                     f"{'PASS' if ok_i else 'FAIL'}")
        print(lines[-1], flush=True)
        ok, diffs[res.num_householder] = ok and ok_i, d
    return ok, "\n".join(lines), diffs


def _write_demo_outputs(args, results, cp_line, cp_diffs):
    import numpy as np
    table = results_table(results)
    png = os.path.join(args.out, "s3_accuracy.png")
    plot_results(results, png)
    with open(os.path.join(args.out, "s3_results.md"), "w") as f:
        f.write(f"S3 word problem, {args.steps} steps on one device\n\n{table}\n\n"
                f"{cp_line}\n")
    with open(os.path.join(args.out, "s3_results.json"), "w") as f:
        json.dump(dict(args={k: v for k, v in vars(args).items() if k not in ("func", "parser")},
                       cp_check=cp_diffs, results=[
            dict(num_householder=r.num_householder, train_len=r.train_len,
                 eval_len=r.eval_len, acc_train_len=r.acc_train_len,
                 acc_eval_len=r.acc_eval_len, seconds=r.seconds, losses=r.losses,
                 acc_per_position=np.asarray(r.acc_per_position).tolist())
            for r in results]), f)
    return table, png


def run_demo(args) -> int:
    missing = _missing_demo_packages()
    if missing:
        print(f"gdp-jax demo needs {', '.join(missing)} (not installed). Install the demo "
              "extra: pip install 'gdp-jax[demo]'  (from a clone: pip install -e '.[demo]')",
              file=sys.stderr)
        return 2
    setup_cpu_devices(max(1, args.devices))
    import jax

    os.makedirs(args.out, exist_ok=True)
    print(f"S3 word problem: train on words of length {args.seq_len}, test at "
          f"{args.eval_factor * args.seq_len}; {args.steps} steps per model on one "
          f"{jax.devices()[0].platform} device", flush=True)
    t0 = time.perf_counter()
    results = _train_all(args)
    ok, cp_line, cp_diffs = True, "context parallel check skipped (--devices 1)", None
    if args.devices > 1:
        ok, cp_line, cp_diffs = _cp_check(args, results)
    table, png = _write_demo_outputs(args, results, cp_line, cp_diffs)
    print("\n" + table)
    print(f"\nwrote {png}, s3_results.md, s3_results.json to {args.out}/ "
          f"({time.perf_counter() - t0:.0f} s in all)")
    return 0 if ok else 1


# ---------------------------------------------------------------------------------------
# entry point
# ---------------------------------------------------------------------------------------

def _nh_list(s: str):
    try:
        vals = [int(x) for x in s.replace(",", " ").split()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{s!r}: expected integers like '1,2'")
    if not vals or min(vals) < 1:
        raise argparse.ArgumentTypeError(f"{s!r}: expected positive integers")
    return vals


def _int_at_least(lo: int):
    def parse(s: str) -> int:
        try:
            v = int(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{s!r}: expected an integer")
        if v < lo:
            raise argparse.ArgumentTypeError(f"{s!r}: expected an integer >= {lo}")
        return v
    parse.__name__ = f"integer >= {lo}"
    return parse


def _positive_float(s: str) -> float:
    try:
        v = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{s!r}: expected a number")
    if not v > 0:
        raise argparse.ArgumentTypeError(f"{s!r}: expected a positive number")
    return v


_HelpFormatter = argparse.ArgumentDefaultsHelpFormatter     # every option's default shown


DEMO_DEFAULTS = dict(steps=400, seq_len=16, batch=16, lr=1e-2, eval_factor=8, devices=4)


def _add_check(sub):
    c = sub.add_parser(
        "check", help="check the op against the reference on this machine",
        formatter_class=_HelpFormatter,
        description="Run gated_delta_product against the float64 token recurrence: outputs, "
                    "final states and gradients. The xla backend in float32 and float64 on "
                    "small shapes; where the cutedsl kernels run (an sm_90 GPU with the "
                    "'cuda' extra), also cutedsl and 'auto' in bfloat16 on kernel shapes "
                    "(K, V in {64, 128}). One progress line per comparison; exit code 1 on "
                    "any mismatch.")
    c.add_argument("--backend", choices=("auto", "xla", "cutedsl"), default="auto",
                   help="auto: xla, plus the kernels where they can run; cutedsl: fail "
                        "when the kernels cannot run; xla: the xla backend only")
    c.add_argument("--devices", type=_int_at_least(1), default=1,
                   help="also check context parallelism over this many devices "
                        "(simulated CPU devices where there are fewer; 1: skip)")
    c.add_argument("--seed", type=int, default=0, help="seed of the random inputs")
    c.add_argument("--out", default=os.environ.get("OUT") or None,
                   help="also write check.md and check.json to this folder (default: $OUT "
                        "when set, else nothing; here: %(default)s)")
    c.set_defaults(func=run_check, parser=c)


def _add_demo(sub):
    d = sub.add_parser(
        "demo", help="S3 state tracking: n_h = 1 vs n_h = 2", formatter_class=_HelpFormatter,
        description="Train a one-layer Gated DeltaProduct model on the S3 word problem "
                    "(target = prefix product of group elements) for each n_h, on one "
                    "device; compare the accuracy at the training length and at "
                    "--eval-factor times it; then check that the trained model gives the "
                    "same logits, loss and gradients context-parallel over --devices "
                    "simulated CPU devices as on one.")
    d.add_argument("--steps", type=_int_at_least(1), default=DEMO_DEFAULTS["steps"],
                   help="training steps per model")
    d.add_argument("--seq-len", type=_int_at_least(1), default=DEMO_DEFAULTS["seq_len"],
                   help="training word length")
    d.add_argument("--batch", type=_int_at_least(1), default=DEMO_DEFAULTS["batch"],
                   help="words per training step")
    d.add_argument("--lr", type=_positive_float, default=DEMO_DEFAULTS["lr"],
                   help="peak learning rate (warm-up + cosine decay)")
    d.add_argument("--eval-factor", type=_int_at_least(1), default=DEMO_DEFAULTS["eval_factor"],
                   help="test length = this x the training length")
    d.add_argument("--nh", type=_nh_list, default=[1, 2],
                   help="Householder steps per token to compare, e.g. '1,2'")
    d.add_argument("--devices", type=_int_at_least(1), default=DEMO_DEFAULTS["devices"],
                   help="CPU devices for the context-parallel check (1: skip it)")
    d.add_argument("--out", default="gdp_jax_demo", help="output folder")
    d.add_argument("--seed", type=int, default=0, help="seed of the data and the model")
    d.add_argument("--no-progress", action="store_true", help="no progress bars")
    d.set_defaults(func=run_demo, parser=d)


def build_parser() -> argparse.ArgumentParser:
    from gdp_jax import __version__
    p = argparse.ArgumentParser(
        prog="gdp-jax", description="Gated DeltaProduct linear attention for JAX.",
        epilog=SELF_CHECK_HINT, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action="version", version=f"gdp-jax {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    _add_check(sub)
    _add_demo(sub)
    return p


def main(argv=None) -> int:
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if args.command is None:
        if unknown:
            parser.error(f"unrecognized arguments: {' '.join(unknown)}")
        parser.print_help()
        return 0
    if unknown:     # the subcommand's own usage and message, not the top-level one
        args.parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
