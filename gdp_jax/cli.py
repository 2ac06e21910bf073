"""The ``gdp-jax`` command line (also ``python -m gdp_jax``).

    gdp-jax check   # the op against the token recurrence on this machine: outputs + grads
    gdp-jax demo    # S3 state tracking, n_h = 1 vs 2, context-parallel over 8 CPU devices

On CPU, simulated devices need ``XLA_FLAGS=--xla_force_host_platform_device_count=N``
before JAX starts its backend; the commands set it (nothing here touches a JAX device
before that).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

SELF_CHECK_HINT = ("Self-check of this installation: gdp-jax check   (about a minute on CPU)\n"
                   "S3 state-tracking demo:          gdp-jax demo    (a few minutes on CPU)")


# ---------------------------------------------------------------------------------------
# environment (must run before JAX creates its backends)
# ---------------------------------------------------------------------------------------

def _backends_started() -> bool:
    if "jax" not in sys.modules:
        return False
    try:
        from jax._src import xla_bridge
        return bool(getattr(xla_bridge, "_backends", {}))
    except Exception:  # pragma: no cover - private API moved
        return False


def setup_cpu_devices(n: int) -> None:
    """Make JAX's CPU platform expose ``n`` devices (sets XLA_FLAGS, PJRT_NPROC).

    Besides the device count this sizes the CPU client's thread pool (PJRT_NPROC, unless
    set): XLA sizes it by the core count, and with fewer threads than simulated devices
    the collectives of a multi-device program wait forever for ranks whose work sits in
    the same exhausted pool.
    """
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split()
             if not f.startswith("--xla_force_host_platform_device_count")]
    flags.append(f"--xla_force_host_platform_device_count={n}")
    # At least 32 threads even for one device: a generous pool costs nothing and keeps
    # jaxlib kernels that wait on work queued to the same pool (the LAPACK triangular
    # solves the chunked engine used before 2026-11-29 deadlocked a pool of 2) safe.
    os.environ.setdefault("PJRT_NPROC", str(max(4 * n, 32, os.cpu_count() or 1)))
    os.environ["XLA_FLAGS"] = " ".join(flags)
    if _backends_started():
        print("warning: JAX's backends were already initialised; the device count "
              f"{n} may not take effect", file=sys.stderr)


# ---------------------------------------------------------------------------------------
# gdp-jax check
# ---------------------------------------------------------------------------------------

CHECK_CASES = (
    # name, B, T, H, HV, K, V, n, gate, packed offsets, initial state
    ("GDN (n=1), gated", 2, 50, 2, 2, 16, 16, 1, True, None, False),
    ("GDP n=2, GVA (HV=2H), gated", 2, 70, 1, 2, 16, 8, 2, True, None, True),
    ("GDP n=3, packed, no gate", 1, 90, 2, 4, 8, 16, 3, False, (0, 7, 40, 40, 90), True),
)
TOLERANCE = {"float32": 2e-4, "float64": 1e-9}


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
    gdt = jnp.float32 if dtype == jnp.float32 else f64
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


def run_check(args) -> int:
    setup_cpu_devices(max(1, args.devices))
    import jax
    jax.config.update("jax_enable_x64", True)
    import jax.numpy as jnp
    import gdp_jax
    from gdp_jax import backends

    devs = jax.devices()
    ok_cut, why = backends.cutedsl_available()
    auto = backends.resolve("auto")
    print(f"gdp-jax {gdp_jax.__version__}, jax {jax.__version__}, "
          f"{len(devs)} x {devs[0].platform} ({devs[0].device_kind})")
    print(f"backend='auto' resolves to {auto!r}"
          + ("" if ok_cut else f" (cutedsl unavailable: {why})"))
    backend_list = ["xla"] + ([auto] if auto != "xla" else [])

    rows, failures = [], 0
    t0 = time.perf_counter()
    for case in CHECK_CASES:
        for dtype in (jnp.float32, jnp.float64):
            dname = jnp.dtype(dtype).name
            diff, cts, cu = _check_inputs(case, dtype, args.seed)
            # Ground truth: the token recurrence in float64 on the same (rounded) inputs.
            up = {k: None if x is None else x.astype(jnp.float64) for k, x in diff.items()}
            ref = _run(gdp_jax.gated_delta_product_reference, up,
                       tuple(c.astype(jnp.float64) for c in cts), cu)
            for be in backend_list:
                if be == "cutedsl" and dtype == jnp.float64:
                    continue
                op = lambda *a, **kw: gdp_jax.gated_delta_product(*a, backend=be, **kw)
                got = _run(op, diff, cts, cu)
                errs = {k: _rel_err(got[k], ref[k]) for k in ref}
                worst = max(errs, key=errs.get)
                ok = errs[worst] <= TOLERANCE[dname]
                failures += not ok
                rows.append((case[0], dname, be, errs["o"],
                             max(e for k, e in errs.items() if k.startswith("d")),
                             worst, ok))
    if args.devices > 1:
        rows_cp, fail_cp = _check_cp(args.devices, args.seed)
        rows += rows_cp
        failures += fail_cp
    w = max(len(r[0]) for r in rows)
    print(f"\n{'case':<{w}}  dtype    backend  out err   grad err  worst          ok")
    for name, dname, be, eo, eg, worst, ok in rows:
        print(f"{name:<{w}}  {dname:<7}  {be:<7}  {eo:.1e}   {eg:.1e}   {worst:<13}  "
              f"{'yes' if ok else 'NO'}")
    print(f"\n(relative RMS error against the float64 token recurrence; tolerance "
          f"float32 {TOLERANCE['float32']:g}, float64 {TOLERANCE['float64']:g}; "
          f"{time.perf_counter() - t0:.0f} s)")
    if failures:
        print(f"FAIL: {failures} of {len(rows)} comparisons are outside tolerance")
        return 1
    print(f"PASS: all {len(rows)} comparisons agree with the reference")
    return 0


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
    rows, fails = [], 0
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
        ref_g, ref_o = gfun(q, k, v, g, beta, None)
        sp = Ps(None, "cp")
        cp_fn = jax.jit(jax.shard_map(lambda *a: gfun(*a, "cp"), mesh=mesh,
                                      in_specs=(sp,) * 5, out_specs=((sp,) * 5, sp)))
        got_g, got_o = cp_fn(q, k, v, g, beta)
        eo = _rel_err(got_o, ref_o)
        eg = max(_rel_err(a, b) for a, b in zip(got_g, ref_g))
        ok = max(eo, eg) <= TOLERANCE[dname]
        fails += not ok
        rows.append((case[0], dname, "xla", eo, eg, "vs 1 device", ok))
    return rows, fails


# ---------------------------------------------------------------------------------------
# gdp-jax demo
# ---------------------------------------------------------------------------------------

class _Progress:
    """tqdm when installed, else a one-line text bar."""

    def __init__(self, total: int, desc: str, enabled: bool = True):
        self.total, self.desc, self.enabled, self.n = total, desc, enabled, 0
        self.bar = None
        self.t0 = time.perf_counter()
        if enabled:
            try:
                from tqdm import tqdm
                self.bar = tqdm(total=total, desc=desc, leave=True, dynamic_ncols=True)
            except ImportError:
                pass

    def update(self, loss: float, acc: float):
        self.n += 1
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.set_postfix(loss=f"{loss:.3f}", acc=f"{acc:.3f}", refresh=False)
            self.bar.update(1)
            return
        if self.n % max(1, self.total // 50) and self.n != self.total:
            return
        width = 30
        done = int(width * self.n / self.total)
        el = time.perf_counter() - self.t0
        sys.stdout.write(f"\r{self.desc} [{'#' * done}{'.' * (width - done)}] {self.n}/"
                         f"{self.total} loss {loss:.3f} acc {acc:.3f} {el:.0f}s")
        sys.stdout.flush()
        if self.n == self.total:
            sys.stdout.write("\n")

    def close(self):
        if self.bar is not None:
            self.bar.close()


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
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, ax = plt.subplots(figsize=(7, 4))
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
    plt.close(fig)


def run_demo(args) -> int:
    setup_cpu_devices(max(1, args.devices))
    import numpy as np
    import jax
    from gdp_jax import s3

    os.makedirs(args.out, exist_ok=True)
    devs = jax.devices()
    where = (f"context-parallel over {args.devices} {devs[0].platform} devices "
             f"({args.seq_len // args.devices} tokens per device)" if args.devices > 1
             else f"on one {devs[0].platform} device")
    print(f"S3 word problem: train on words of length {args.seq_len}, test at "
          f"{args.eval_factor * args.seq_len}; {args.steps} steps, {where}")
    t0 = time.perf_counter()
    results = []
    for nh in args.nh:
        bar = _Progress(args.steps, f"n_h={nh}", enabled=not args.no_progress)
        res = s3.train_s3(nh, steps=args.steps, seq_len=args.seq_len, batch=args.batch,
                          eval_factor=args.eval_factor, devices=args.devices, lr=args.lr,
                          seed=args.seed, progress=lambda i, l, a: bar.update(l, a))
        bar.close()
        print(f"n_h={nh}: accuracy {res.acc_train_len:.3f} at length {res.train_len}, "
              f"{res.acc_eval_len:.3f} at length {res.eval_len} ({res.seconds:.0f} s)")
        results.append(res)
    table = results_table(results)
    png = os.path.join(args.out, "s3_accuracy.png")
    plot_results(results, png)
    with open(os.path.join(args.out, "s3_results.md"), "w") as f:
        f.write(f"S3 word problem, {args.steps} steps, {where}\n\n{table}\n")
    with open(os.path.join(args.out, "s3_results.json"), "w") as f:
        json.dump(dict(args={k: v for k, v in vars(args).items() if k != "func"}, results=[
            dict(num_householder=r.num_householder, train_len=r.train_len,
                 eval_len=r.eval_len, acc_train_len=r.acc_train_len,
                 acc_eval_len=r.acc_eval_len, seconds=r.seconds, losses=r.losses,
                 acc_per_position=np.asarray(r.acc_per_position).tolist())
            for r in results]), f)
    print("\n" + table)
    print(f"\nwrote {png}, s3_results.md, s3_results.json to {args.out}/ "
          f"({time.perf_counter() - t0:.0f} s in all)")
    return 0


# ---------------------------------------------------------------------------------------
# entry point
# ---------------------------------------------------------------------------------------

def _nh_list(s: str):
    try:
        vals = [int(x) for x in s.replace(",", " ").split()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--nh {s!r}: expected integers like '1,2'")
    if not vals or min(vals) < 1:
        raise argparse.ArgumentTypeError(f"--nh {s!r}: expected positive integers")
    return vals


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="gdp-jax", description="Gated DeltaProduct linear attention for JAX.",
        epilog=SELF_CHECK_HINT, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", metavar="COMMAND")

    c = sub.add_parser("check", help="check the op against the reference on this machine",
                       description="Run gated_delta_product (xla backend and the 'auto' "
                                   "backend) against the float64 token recurrence: "
                                   "outputs, final states and gradients, float32 and "
                                   "float64. Exit code 1 on any mismatch.")
    c.add_argument("--devices", type=int, default=1,
                   help="also check context parallelism over this many devices "
                        "(simulated on CPU; default 1: skip)")
    c.add_argument("--seed", type=int, default=0)
    c.set_defaults(func=run_check)

    d = sub.add_parser("demo", help="S3 state tracking: n_h = 1 vs n_h = 2",
                       description="Train a one-layer Gated DeltaProduct model on the S3 "
                                   "word problem (target = prefix product of group "
                                   "elements), context-parallel over simulated CPU "
                                   "devices, and compare n_h values at the training "
                                   "length and at 4x it.")
    d.add_argument("--devices", type=int, default=8,
                   help="devices for context parallelism (default 8; 1 = no CP)")
    d.add_argument("--steps", type=int, default=DEMO_DEFAULTS["steps"],
                   help="training steps per model")
    d.add_argument("--seq-len", type=int, default=DEMO_DEFAULTS["seq_len"],
                   help="training word length (a multiple of --devices)")
    d.add_argument("--batch", type=int, default=DEMO_DEFAULTS["batch"],
                   help="words per training step")
    d.add_argument("--lr", type=float, default=DEMO_DEFAULTS["lr"])
    d.add_argument("--eval-factor", type=int, default=4,
                   help="test length = this x the training length (default 4)")
    d.add_argument("--nh", type=_nh_list, default=[1, 2],
                   help="Householder steps per token to compare, e.g. '1,2' (default)")
    d.add_argument("--out", default="gdp_jax_demo", help="output folder (default ./gdp_jax_demo)")
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--no-progress", action="store_true", help="no progress bar")
    d.set_defaults(func=run_demo)
    return p


DEMO_DEFAULTS = dict(steps=400, seq_len=16, batch=16, lr=1e-2)


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    if getattr(args, "seq_len", None) and args.devices > 1 and args.seq_len % args.devices:
        parser.error(f"--seq-len {args.seq_len} must be a multiple of --devices {args.devices}")
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
