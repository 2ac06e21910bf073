"""The context-parallel benchmark: the op under shard_map over a "cp" mesh axis vs one device.

Per global length T (registry "cp" shapes) and mesh size P: the one-device op on T (where it
fits) and on T/P, the CP op on P devices, forward and forward + backward; per-rank time,
scaling efficiency t1(T) / (P tP(T)), XLA's compiled memory per device (arguments + outputs +
temporaries - aliased). Before timing, CP outputs and gradients are checked against the
one-device op on the same inputs (relative RMS per rank slice; the same compiled programs
are then timed). The all_gather of one
[HV, K, V + K] float32 summary per rank is also timed alone on the mesh. ``--fold`` sets
GDP_CP_FOLD (read by the op at trace time: gather, scan or auto = the cost model, which
picks gather at P <= 2). Real GPUs, or simulated CPU devices with ``--devices``.
"""
from __future__ import annotations

import gc
import statistics
import time

from benchmarks import measure, registry
from benchmarks.measure import log
from benchmarks.report import fmt

PACKED_FRACTIONS = (0.05, 0.3, 0.02, 0.18, 0.25, 0.12, 0.08)   # 7 packed sequences
MODES = ("fwd", "fwd+bwd")
TOL = 1e-2           # CP vs one device, rel RMS (the same arithmetic up to the fold's order)


def packed_offsets(T):
    import jax.numpy as jnp
    import numpy as np
    lens = np.floor(np.array(PACKED_FRACTIONS) * T).astype(np.int64)
    lens[-1] += T - lens.sum()
    return jnp.asarray(np.concatenate([[0], np.cumsum(lens)]), jnp.int32)


def _op(backend, cu, cp_axis=None):
    from gdp_jax import gated_delta_product
    return lambda q, k, v, g, beta: gated_delta_product(
        q, k, v, g, beta, cu_seqlens=cu, cp_axis=cp_axis, backend=backend, use_qk_l2norm=True)


def _loss_grad(f, w):
    import jax
    import jax.numpy as jnp
    return jax.grad(lambda *a: jnp.sum(f(*a).astype(jnp.float32) * w), argnums=(0, 1, 2, 3, 4))


def _compile(fn, args):
    """(compiled, record): XLA's compiled bytes per device and the compile seconds."""
    import jax
    t0 = time.perf_counter()
    compiled = jax.jit(fn).lower(*args).compile()
    rec = {"compile_s": round(time.perf_counter() - t0, 2)}
    ma = compiled.memory_analysis()
    if ma is not None:
        rec["mem_gb"] = (ma.argument_size_in_bytes + ma.output_size_in_bytes
                         + ma.temp_size_in_bytes - ma.alias_size_in_bytes) / 1e9
    return compiled, rec


def _time(compiled, args, rec, iters, warmup=2):
    """Adds the median ms of ``iters`` calls after ``warmup`` to ``rec``."""
    import jax
    for _ in range(warmup):
        jax.block_until_ready(compiled(*args))
    ts = []
    for _ in range(iters):
        t = time.perf_counter()
        jax.block_until_ready(compiled(*args))
        ts.append((time.perf_counter() - t) * 1e3)
    rec["ms"] = statistics.median(ts)
    return rec


def _timed(fn, args, iters):
    compiled, rec = _compile(fn, args)
    return _time(compiled, args, rec, iters)


def _guarded(f, *a):
    try:
        return f(*a)
    except Exception as e:           # an OOM on one device is a result, not a crash
        return {"error": ("OOM: " if measure.is_oom(e) else "") + measure.short_error(e)}


class Case:
    """One (shape, P, packed) case: inputs, the mesh and the three callables' builders."""

    def __init__(self, shape, P, packed, backend, devices):
        import numpy as np
        from jax.sharding import Mesh
        self.shape, self.P, self.packed, self.backend = shape, P, packed, backend
        self.devices = devices
        self.mesh = Mesh(np.array(devices[:P]), ("cp",))
        self.x = registry.make_inputs(shape)
        self.cu = packed_offsets(shape.T) if packed else None

    def single(self, T, mode):
        """(fn, args) of the one-device op on the first T tokens."""
        import jax
        args = jax.device_put(tuple(a[:, :T] for a in self.x[:5]), self.devices[0])
        cu = None if self.cu is None else jax.device_put(packed_offsets(T), self.devices[0])
        f = _op(self.backend, cu)
        w = jax.device_put(self.x.w[:, :T], self.devices[0])
        return (f if mode == "fwd" else _loss_grad(f, w)), args

    def sharded(self, mode):
        """(fn, args) of the CP op: T split over "cp"; cu_seqlens replicated, w sharded."""
        import jax
        from jax.sharding import PartitionSpec as P
        spec, backend, packed = P(None, "cp"), self.backend, self.cu is not None

        def body(*a):
            cu, a = (a[0], a[1:]) if packed else (None, a)
            f = _op(backend, cu, "cp")
            return f(*a) if mode == "fwd" else _loss_grad(f, a[0])(*a[1:])
        grad = mode != "fwd"
        in_specs = ((P(),) if packed else ()) + ((spec,) if grad else ()) + (spec,) * 5
        args = ((self.cu,) if packed else ()) + ((self.x.w,) if grad else ()) + tuple(self.x[:5])
        fn = jax.shard_map(body, mesh=self.mesh, in_specs=in_specs,
                           out_specs=(spec,) * 5 if grad else spec)
        return fn, args


def rank_errors(names, rP, r1, T, Pn) -> dict:
    """max relative RMS over rank slices of the CP results vs the one-device ones."""
    from gdp_jax.testing import rel_rms
    Tl = T // Pn
    return {nm: max(rel_rms(a[:, r * Tl:(r + 1) * Tl], b[:, r * Tl:(r + 1) * Tl])
                    for r in range(Pn)) for nm, a, b in zip(names, rP, r1)}


def measure_mode(case: Case, mode: str, args) -> dict:
    """One mode: the one-device op on T and on T/P, the CP op; the T and CP programs are
    compiled once, run once for the check (unless --no-check), then timed."""
    import jax
    T, Pn = case.shape.T, case.P
    out = {"t1_Tp": _guarded(lambda: _timed(*case.single(T // Pn, mode), args.iters))}
    progs = {}
    for key, (fn, a) in (("t1_T", case.single(T, mode)), ("tP_T", case.sharded(mode))):
        try:
            progs[key] = _compile(fn, a) + (a,)
        except Exception as e:
            out[key] = {"error": ("OOM: " if measure.is_oom(e) else "") + measure.short_error(e)}
    if not args.no_check and len(progs) == 2:
        try:
            r1, rP = (jax.block_until_ready(c(*a)) for c, _, a in (progs["t1_T"], progs["tP_T"]))
            names = ("o",) if mode == "fwd" else registry.GRAD_NAMES
            r1, rP = ((r1,), (rP,)) if mode == "fwd" else (r1, rP)
            out["check"] = rank_errors(names, rP, r1, T, Pn)
            del r1, rP
        except Exception as e:
            out["check_error"] = measure.short_error(e)
    for key, (c, rec, a) in progs.items():
        out[key] = _guarded(lambda: _time(c, a, rec, args.iters))
    t1, tP = out.get("t1_T", {}).get("ms"), out.get("tP_T", {}).get("ms")
    out["efficiency"] = None if not (t1 and tP) else t1 / (Pn * tP)
    return out


def allgather_ms(mesh, Pn, shape, iters):
    """The CP summary all_gather alone: [HV, K, V + K] float32 per rank."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P
    x = jnp.ones((Pn, shape.HV, shape.K, shape.V + shape.K), jnp.float32)
    fn = jax.shard_map(lambda s: jax.lax.all_gather(s[0], "cp")[None], mesh=mesh,
                       in_specs=P("cp"), out_specs=P("cp"))
    r = _timed(fn, (x,), iters)
    r["mb_received_per_rank"] = (Pn - 1) * shape.HV * shape.K * (shape.V + shape.K) * 4 / 1e6
    return r


def run(args, run_):
    import jax
    devices = jax.devices()
    table = table_md
    for Pn in args.P:
        if Pn > len(devices):
            run_.note(f"P={Pn} skipped: only {len(devices)} devices")
            continue
        for shape in registry.shapes("cp", args.shapes):
            for packed in ((False, True) if args.packed else (False,)):
                label = f"T={shape.T} P={Pn} {'packed7' if packed else 'single'}"
                if measure.elapsed() > args.deadline:
                    run_.note(f"deadline ({args.deadline:.0f} s) reached before {label}")
                    break
                row = {"bench": "cp", "case": label, "shape": shape.label(), "P": Pn,
                       "packed": packed, "fold": args.fold, "impl": args.backend,
                       "family": "ours"}
                try:
                    case = Case(shape, Pn, packed, args.backend, devices)
                    for mode in MODES:
                        row[mode] = r = measure_mode(case, mode, args)
                        log(label, mode, {k: v.get("ms", v.get("error")) for k, v in r.items()
                                          if isinstance(v, dict) and k != "check"},
                            "check", r.get("check", r.get("check_error", "-")))
                    chk = {**row["fwd"].get("check", {}), **row["fwd+bwd"].get("check", {})}
                    if chk:
                        row["check"] = chk
                        row["check_ok"] = max(chk.values()) <= TOL
                    row["allgather"] = allgather_ms(case.mesh, Pn, shape, args.iters)
                    del case
                except Exception as e:
                    row["error"] = measure.short_error(e)
                    log(label, "ERROR", row["error"])
                    measure.log_traceback()
                run_.add(row, table)
                gc.collect()
    print(run_.write(table), flush=True)


def table_md(run_) -> str:
    what = ("bf16, use_qk_l2norm, gates on. Medians in ms; 'CP per rank' = the sharded call "
            "on P devices; efficiency = t1(T) / (P tP(T)); memory = XLA's compiled bytes per "
            "device (arguments + outputs + temporaries - aliased), GB. Check = max relative "
            f"RMS over ranks of CP o and gradients vs the one-device op (tolerance {TOL}).")
    lines = run_.header("Context-parallel benchmark", what)
    lines += ["| case | fold | mode | 1 dev on T | 1 dev on T/P | CP per rank | efficiency | "
              "mem/rank CP | mem 1 dev T | all_gather alone | check max | note |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for c in run_.rows:
        chk = fmt(max(c["check"].values()), 4) if c.get("check") else "-"
        ag = c.get("allgather", {}).get("ms")
        for mode in MODES:
            r = c.get(mode, {})
            ms = lambda k: fmt(r.get(k, {}).get("ms")) if "ms" in r.get(k, {}) else \
                (r.get(k, {}).get("error", "-")[:40] or "-")
            lines.append("| " + " | ".join([
                c["case"], c["fold"], mode, ms("t1_T"), ms("t1_Tp"), ms("tP_T"),
                fmt(r.get("efficiency")), fmt(r.get("tP_T", {}).get("mem_gb")),
                fmt(r.get("t1_T", {}).get("mem_gb")), fmt(ag, 3), chk,
                c.get("error", "") or r.get("check_error", "")
                or ("CHECK FAILED" if c.get("check_ok") is False else "")]) + " |")
    return "\n".join(lines + run_.footer()) + "\n"
