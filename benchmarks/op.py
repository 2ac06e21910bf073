"""The fwd and fwdbwd benchmarks: every implementation on the same inputs of each shape,
checked against a float64 reference, then timed; peak and kept memory of one fwd+bwd.

Per shape: inputs drawn once (:func:`registry.make_inputs`); the reference is the xla
backend in float64 on row 0 and the first ``--check-heads`` heads (rows and heads are
independent, so that slice of every full call must match it); then per implementation
(peers first: torch gives its cache back, XLA's pool keeps what it took) the first call
(compile included) is checked, then timed (``measure.median_ms``), then memory.
Loss = sum(o * w), w fixed random (bf16 values); fwd+bwd = value and gradients w.r.t.
q, k, v, g, beta (FLA: forward + o.backward(w)).
"""
from __future__ import annotations

import gc
import time

from benchmarks import measure, registry, roofline
from benchmarks.measure import log
from benchmarks.report import fmt, pct, ratio, status

TOL = 2e-2           # rel RMS vs float64 for bf16 inputs (seen: ours ~2.5e-3, FLA ~4.6e-3)


def reference(x: registry.Inputs, hr: int, with_grads: bool) -> dict:
    """float64 o (and gradients) of the xla backend on row 0, heads [0, hr)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from gdp_jax import gated_delta_product
    sl = [np.asarray(registry.slice_check(a, nm, hr).astype(jnp.float32)) for a, nm in
          zip((x.q, x.k, x.v, x.g, x.beta, x.w), ("dq", "dk", "dv", "dg", "dbeta", "o"))]
    with measure.x64():
        a64 = [jnp.asarray(a, jnp.float64) for a in sl]
        op = lambda *a: gated_delta_product(*a, use_qk_l2norm=True, backend="xla")
        if not with_grads:
            return {"o": np.asarray(jax.jit(op)(*a64[:5]))}
        loss = lambda *a: (lambda o: (jnp.sum(o * a64[5]), o))(op(*a))
        (_, o), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4),
                                                   has_aux=True))(*a64[:5])
        out = {"o": np.asarray(o)}
        out.update({nm: np.asarray(g) for nm, g in zip(registry.GRAD_NAMES, grads)})
    return out


def _check(row, ref, name, got, hr, to_np):
    from gdp_jax.testing import rel_rms
    if ref is None:
        return
    e = rel_rms(to_np(registry.slice_check(got, name, hr)), ref[name])
    row.setdefault("check", {})[name] = e
    row["check_max"] = max(row["check"].values())
    row["check_ok"] = row["check_max"] <= TOL


def one(impl, x, shape, mode, ref, args, row):
    """Check, time and measure ``impl`` on ``x``; fills ``row``."""
    t = time.perf_counter()
    built = impl.build(x)
    try:
        o = built.fwd()
        built.sync(o)
        _check(row, ref, "o", o, args.check_heads, built.to_np)
        del o
        if mode == "fwdbwd":
            r = built.fwdbwd()
            built.sync(r)
            for nm, gr in zip(registry.GRAD_NAMES, built.grads_of(r)):
                _check(row, ref, nm, gr, args.check_heads, built.to_np)
            del r
        row["first_call_s"] = round(time.perf_counter() - t, 2)     # compile, autotune, run
        if "check" in row:
            log(shape.label(), impl.name, "check", "PASS" if row["check_ok"] else "FAIL",
                " ".join(f"{k} {v:.1e}" for k, v in row["check"].items()), f"(tol {TOL})")
        if impl.fwd_same_as is None:
            row["fwd_ms"] = measure.median_ms(built.fwd, built.sync, args.iters, args.reps)
            if mode == "fwd" and built.fwd_memory is not None:
                row.update(built.fwd_memory())
            log(shape.label(), impl.name, f"fwd {row['fwd_ms']:.3f} ms"
                + (f", peak {row['fwd_peak_gb']:.2f} GB" if "fwd_peak_gb" in row else ""))
        if mode == "fwdbwd":
            row["fwdbwd_ms"] = measure.median_ms(built.fwdbwd, built.sync, args.iters,
                                                 args.reps)
            row.update(built.memory())
            log(shape.label(), impl.name, f"fwd+bwd {row['fwdbwd_ms']:.3f} ms, peak "
                f"{row['peak_gb']:.2f} GB, kept {row['kept_gb']:.2f} GB")
    finally:
        built.release()


def run(args, run_, impls):
    import jax
    mode = args.bench
    order = sorted(impls, key=lambda i: i.family != "peer")
    shapes = registry.shapes("op", args.shapes)
    table = lambda r: table_md(r, mode, args.baseline)
    for si, shape in enumerate(shapes):
        if measure.elapsed() > args.deadline:
            run_.note(f"deadline ({args.deadline:.0f} s) reached: not run "
                      + "; ".join(s.label() for s in shapes[si:]))
            break
        base = {"bench": mode, "shape": shape.label(), **vars_(shape),
                "roofline_ms": roofline.roofline_ms(shape, mode, run_.env["device"]),
                "roofline_fwd_ms": roofline.roofline_ms(shape, "fwd", run_.env["device"])}
        try:
            x = registry.make_inputs(shape, args.seed)
            ref = None if args.no_check else reference(x, min(args.check_heads, shape.H),
                                                       mode == "fwdbwd")
        except Exception as e:
            run_.note(f"{shape.label()}: inputs/reference failed: {measure.short_error(e)}")
            measure.log_traceback()
            gc.collect()
            continue
        for im in order:
            row = {**base, "impl": im.name, "family": im.family}
            if measure.elapsed() > args.deadline:
                row["error"] = "skipped: deadline"
                run_.add(row, table)
                continue
            try:
                one(im, x, shape, mode, ref, args, row)
            except Exception as e:       # an OOM or a failure at one shape: record, go on
                row["error"] = ("OOM: " if measure.is_oom(e) else "") + measure.short_error(e)
                log(shape.label(), im.name, "ERROR", row["error"])
                measure.log_traceback()
            run_.add(row, table)
            gc.collect()
            measure.free_torch_cache()
        del x, ref
        gc.collect()
        jax.clear_caches()
    print(run_.write(table), flush=True)


def vars_(shape):
    return {"B": shape.B, "T": shape.T, "H": shape.H, "n": shape.n, "K": shape.K, "V": shape.V}


def table_md(run_, mode, baseline) -> str:
    what = ("bf16, use_qk_l2norm, gates on; medians in ms after warm-up. 'time / "
            f"{baseline}' = this row's time over {baseline}'s at the same shape. '% roofline' = "
            "roofline time / time, roofline = max(model FLOPs / peak, minimum bytes / "
            f"bandwidth) at {roofline.ceilings_text(run_.env['device'])} (benchmarks/"
            "roofline.py). Check = max relative RMS error of o"
            + (" and the five gradients" if mode == "fwdbwd" else "")
            + f" vs float64 (xla backend) on row 0, the first heads; tolerance {TOL}.")
    if mode == "fwdbwd":
        what += (" Memory in GB of one fwd+bwd: 'peak' = temporary memory (XLA's compiled "
                 "temp size; FLA: max_memory_allocated minus what was allocated before), "
                 "'kept' = kept for the backward beyond the inputs; 'XLA GB' = the bytes "
                 "XLA's cost analysis gives the compiled fwd+bwd (its own kernels; a kernel "
                 "call counts its operands and results).")
    else:
        what += (" 'peak' = temporary memory of one forward (XLA's compiled temp size; FLA: "
                 "max_memory_allocated minus what was allocated before, its output included).")
    lines = run_.header("Forward + backward benchmark" if mode == "fwdbwd"
                        else "Forward benchmark", what)
    if mode == "fwdbwd":
        lines += [f"| B, T, H, n | impl | fwd | fwd+bwd | time / {baseline} (fwd, fwd+bwd) | "
                  "% roofline (fwd+bwd) | peak | kept | XLA GB | check | first call s | note |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    else:
        lines += [f"| B, T, H, n | impl | fwd | time / {baseline} | % roofline | peak | "
                  "check | first call s | note |", "|---|---|---|---|---|---|---|---|---|"]
    rows = run_.rows
    for r in rows:
        b = next((s for s in rows if s["shape"] == r["shape"] and s["impl"] == baseline), {})
        fwd = r.get("fwd_ms")
        if fwd is None and r.get("impl", "").startswith("cutedsl-n"):
            fwd = next((s.get("fwd_ms") for s in rows if s["shape"] == r["shape"]
                        and s["impl"] == "cutedsl"), None)
        chk = fmt(r.get("check_max"), 4) if "check_max" in r else "-"
        if mode == "fwdbwd":
            cells = [r["shape"], r["impl"], fmt(fwd), fmt(r.get("fwdbwd_ms")),
                     f"{ratio(fwd, b.get('fwd_ms'))}, {ratio(r.get('fwdbwd_ms'), b.get('fwdbwd_ms'))}",
                     pct(r["roofline_ms"], r.get("fwdbwd_ms")), fmt(r.get("peak_gb")),
                     fmt(r.get("kept_gb")), fmt(r.get("xla_gb"), 1), chk,
                     fmt(r.get("first_call_s"), 1), status(r)]
        else:
            cells = [r["shape"], r["impl"], fmt(fwd), ratio(fwd, b.get("fwd_ms")),
                     pct(r["roofline_fwd_ms"], fwd), fmt(r.get("fwd_peak_gb")), chk,
                     fmt(r.get("first_call_s"), 1), status(r)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines + run_.footer()) + "\n"
