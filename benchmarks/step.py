"""The decoding-step benchmark: one token for B rows, each implementation checked against the
float64 token recurrence, then timed as a chain S = step(S) with the state donated
(``measure.median_chain_ms``: ``--iters`` chained calls between syncs, median of ``--reps``).
Decode is bound by the state's bytes: one read + one write of [B, HV, K, V] float32.
"""
from __future__ import annotations

import gc

from benchmarks import measure, registry, roofline
from benchmarks.measure import log
from benchmarks.report import fmt, pct, ratio, status

TOL_O, TOL_S = 5e-3, 1e-4        # rel RMS vs float64: bf16 output, float32 state


def reference(x: registry.Inputs):
    import jax.numpy as jnp
    import numpy as np
    from gdp_jax import gated_delta_product_reference
    host = [np.asarray(a.astype(jnp.float32)) for a in (x.q, x.k, x.v, x.g, x.beta, x.S)]
    with measure.x64():
        q, k, v, g, beta, S = (jnp.asarray(a, jnp.float64) for a in host)
        o, s = gated_delta_product_reference(q[:, None], k[:, None], v[:, None], g[:, None],
                                             beta[:, None], initial_state=S,
                                             output_final_state=True, use_qk_l2norm=True)
        return np.asarray(o[:, 0]), np.asarray(s)


def one(impl, x, ref, args, row):
    from gdp_jax.testing import rel_rms
    built = impl.build(x)
    try:
        o, s = built.first()
        row["check"] = {"o": rel_rms(o, ref[0]), "state": rel_rms(s, ref[1])}
        row["check_ok"] = row["check"]["o"] <= TOL_O and row["check"]["state"] <= TOL_S
        log(f"B={x.q.shape[0]}", impl.name, "check", "PASS" if row["check_ok"] else "FAIL",
            f"o {row['check']['o']:.1e} (tol {TOL_O}), state {row['check']['state']:.1e} "
            f"(tol {TOL_S})")
        row["us"] = 1e3 * measure.median_chain_ms(built.step, built.fresh_state(), built.sync,
                                                  args.iters, args.reps)
        log(f"B={x.q.shape[0]}", impl.name, f"{row['us']:.1f} us per step")
    finally:
        built.release()


def run(args, run_, impls):
    order = sorted(impls, key=lambda i: i.family != "peer")
    table = lambda r: table_md(r, args.baseline)
    for shape in registry.shapes("step", args.shapes):
        if measure.elapsed() > args.deadline:
            run_.note(f"deadline ({args.deadline:.0f} s) reached before B={shape.B}")
            break
        x = registry.make_inputs(shape, args.seed, step=True)
        ref = reference(x)
        for im in order:
            row = {"bench": "step", "shape": f"B={shape.B}, H=HV={shape.H}, n={shape.n}",
                   "B": shape.B, "H": shape.H, "n": shape.n, "K": shape.K, "V": shape.V,
                   "impl": im.name, "family": im.family,
                   "bound_us": roofline.step_bound_us(shape, run_.env["device"])}
            try:
                one(im, x, ref, args, row)
            except Exception as e:
                row["error"] = ("OOM: " if measure.is_oom(e) else "") + measure.short_error(e)
                log(f"B={shape.B}", im.name, "ERROR", row["error"])
                measure.log_traceback()
            run_.add(row, table)
            gc.collect()
            measure.free_torch_cache()
    print(run_.write(table), flush=True)


def table_md(run_, baseline) -> str:
    what = ("One token, bf16 inputs, float32 state donated, use_qk_l2norm; medians in us per "
            f"step. 'time / {baseline}' = this row over {baseline}. Bound = one read + one "
            f"write of the state at {roofline.bandwidth_text(run_.env['device'])}. Check = "
            "relative RMS of o and the new state vs the float64 recurrence "
            f"(tolerances {TOL_O}, {TOL_S}).")
    lines = run_.header("Decoding step benchmark", what)
    lines += [f"| shape | impl | us per step | time / {baseline} | % of bound | bound us | "
              "check (o, state) | note |", "|---|---|---|---|---|---|---|---|"]
    for r in run_.rows:
        b = next((s for s in run_.rows if s["shape"] == r["shape"] and s["impl"] == baseline),
                 {})
        c = r.get("check")
        chk = f"{c['o']:.1e}, {c['state']:.1e}" if c else "-"
        lines.append("| " + " | ".join([r["shape"], r["impl"], fmt(r.get("us"), 1),
                                         ratio(r.get("us"), b.get("us")),
                                         pct(r["bound_us"], r.get("us")), fmt(r["bound_us"], 1),
                                         chk, status(r)]) + " |")
    return "\n".join(lines + run_.footer()) + "\n"
