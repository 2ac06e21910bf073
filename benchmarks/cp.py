"""Context-parallel benchmark: the op under shard_map(cp_axis) vs one device.

For each global length T (B=1, H=HV=16, K=V=128, n_h=2, bf16 by default) it times, with
medians after warm-up and block_until_ready:
  * the single-device op on T (where it fits) and on T/P,
  * the CP op on a mesh of P devices (forward, and forward+backward),
and reports per-rank time, scaling efficiency t_1(T) / (P * t_P(T)), the all-gather's
bytes and its time measured in isolation on the same mesh (and the log-depth scan fold's;
``--fold`` picks which one the op runs, reported per case), its share of the step, and
XLA's compiled memory footprint per device (arguments + outputs + temporaries).
It also checks CP outputs and gradients against the single-device op (relative RMS).

    python benchmarks/cp.py --P 2 --T 32768 131072 524288 --packed --out results/
    python benchmarks/cp.py --tiny          # a CPU smoke run with 8 simulated devices
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time


def parse():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--P", type=int, nargs="+", default=[2], help="mesh sizes")
    p.add_argument("--T", type=int, nargs="+", default=[32768, 131072, 524288])
    p.add_argument("--H", type=int, default=16)
    p.add_argument("--K", type=int, default=128)
    p.add_argument("--V", type=int, default=128)
    p.add_argument("--nh", type=int, default=2)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--packed", action="store_true", help="also run 7 packed sequences")
    p.add_argument("--backend", default="xla")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--check-T", type=int, default=32768, help="T of the CP == 1-device check")
    p.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    p.add_argument("--tag", default="", help="suffix of the result files")
    p.add_argument("--tiny", action="store_true", help="CPU smoke test (8 host devices)")
    p.add_argument("--fold", choices=("auto", "gather", "scan"), default="auto",
                   help="CP fold: all_gather, log-depth ppermute scan, or by the cost model")
    return p.parse_args()


ARGS = parse()
os.environ["GDP_CP_FOLD"] = ARGS.fold          # read by the CP driver at trace time
if ARGS.tiny:
    os.environ.setdefault("PJRT_NPROC", "32")
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    ARGS.T, ARGS.H, ARGS.K, ARGS.V, ARGS.check_T = [512], 2, 16, 16, 512

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, PartitionSpec as P  # noqa: E402

import gdp_jax  # noqa: E402
from gdp_jax.cp import fold as cp_fold  # noqa: E402

PACKED_FRACTIONS = np.array([0.05, 0.3, 0.02, 0.18, 0.25, 0.12, 0.08])   # 7 sequences


def packed_offsets(T):
    lens = np.floor(PACKED_FRACTIONS * T).astype(np.int64)
    lens[-1] += T - lens.sum()
    return jnp.asarray(np.concatenate([[0], np.cumsum(lens)]), jnp.int32)


def make_inputs(T, key):
    H, K, V, n = ARGS.H, ARGS.K, ARGS.V, ARGS.nh
    dt = jnp.dtype(ARGS.dtype)
    ks = jax.random.split(key, 5)
    q = jax.random.normal(ks[0], (1, T, H, K), dt)
    k = jax.random.normal(ks[1], (1, T, n, H, K), jnp.float32)
    k = (k * jax.lax.rsqrt(jnp.sum(k * k, -1, keepdims=True))).astype(dt)
    v = jax.random.normal(ks[2], (1, T, n, H, V), dt)
    g = -jax.nn.softplus(jax.random.normal(ks[3], (1, T, H), jnp.float32)) * 0.1
    beta = jax.nn.sigmoid(jax.random.normal(ks[4], (1, T, n, H), jnp.float32)).astype(dt)
    return q, k, v, g, beta


def op_fn(cu, cp_axis=None):
    def f(q, k, v, g, beta):
        return gdp_jax.gated_delta_product(q, k, v, g, beta, cu_seqlens=cu, cp_axis=cp_axis,
                                           backend=ARGS.backend)
    return f


def loss_grad(f):
    def L(q, k, v, g, beta):
        o = f(q, k, v, g, beta)
        return jnp.sum(o.astype(jnp.float32) * jnp.cos(o.astype(jnp.float32)))
    return jax.grad(L, argnums=(0, 1, 2, 3, 4))


def sharded(f, mesh, cu, n_out=1):
    """shard_map of f(cu)(q, k, v, g, beta) with T split over "cp" (cu replicated)."""
    spec = P(None, "cp")
    out = spec if n_out == 1 else (spec,) * n_out
    if cu is None:
        return jax.shard_map(lambda *a: f(None)(*a), mesh=mesh, in_specs=(spec,) * 5,
                             out_specs=out)
    return jax.shard_map(lambda cu_, *a: f(cu_)(*a), mesh=mesh,
                         in_specs=(P(),) + (spec,) * 5, out_specs=out)


def timed(fn, args):
    """Compile, warm up, then the median of ARGS.iters timed calls (ms) and memory (bytes)."""
    jf = jax.jit(fn)
    t0 = time.perf_counter()
    compiled = jf.lower(*args).compile()
    compile_s = time.perf_counter() - t0
    mem = None
    try:
        ma = compiled.memory_analysis()
        mem = int(ma.argument_size_in_bytes + ma.output_size_in_bytes + ma.temp_size_in_bytes
                  - ma.alias_size_in_bytes)
    except Exception:
        pass
    for _ in range(ARGS.warmup):
        jax.block_until_ready(compiled(*args))
    ts = []
    for _ in range(ARGS.iters):
        t = time.perf_counter()
        jax.block_until_ready(compiled(*args))
        ts.append((time.perf_counter() - t) * 1e3)
    return {"ms": statistics.median(ts), "compile_s": compile_s, "mem_bytes": mem}


def guarded(f, *a):
    """Out of memory on a device is a result to report, not a crash."""
    try:
        return f(*a)
    except Exception as e:
        return {"error": f"{type(e).__name__}: {str(e)[:160]}"}


def run_case(label, T, Pn, mesh, packed, devices):
    """One (T, P, layout) case: 1-device on T and T/P, CP on P devices; fwd and fwd+bwd."""
    key = jax.random.key(T)
    x = make_inputs(T, key)
    cu = packed_offsets(T) if packed else None
    rows = {}
    for mode in ("fwd", "fwd+bwd"):
        wrap = (lambda f: f) if mode == "fwd" else loss_grad
        r = {}
        one = jax.device_put(x, devices[0])
        cu1 = None if cu is None else jax.device_put(cu, devices[0])
        r["t1_T"] = guarded(timed, wrap(op_fn(cu1)), one)
        Tp = T // Pn
        part = jax.device_put(tuple(a[:, :Tp] for a in x), devices[0])
        cup = None if cu is None else jax.device_put(packed_offsets(Tp), devices[0])
        r["t1_Tp"] = guarded(timed, wrap(op_fn(cup)), part)
        del one, part
        fn = sharded(lambda c: wrap(op_fn(c, "cp")), mesh, cu, n_out=1 if mode == "fwd" else 5)
        args = x if cu is None else (cu,) + tuple(x)
        r["tP_T"] = guarded(timed, fn, args)
        t1, tP = r["t1_T"].get("ms"), r["tP_T"].get("ms")
        r["efficiency"] = None if t1 is None or tP is None else t1 / (Pn * tP)
        rows[mode] = r
    return {"label": label, "T": T, "P": Pn, "packed": packed,
            "fold": fold_used(Pn, 1 if packed else x[0].shape[0]), **rows}


def fold_used(Pn, F):
    """The fold the CP driver picks here (same inputs as its own choice)."""
    return cp_fold.choose_fold(Pn, F * ARGS.H * ARGS.K * (ARGS.V + ARGS.K) * 4)


def scan_cost(mesh, Pn):
    """The log-depth fold alone (forward direction): its ppermute rounds and compositions."""
    H, K, V = ARGS.H, ARGS.K, ARGS.V
    x = jnp.ones((Pn, H, K, V + K), jnp.float32) * 0.5
    resets = jnp.zeros((Pn,), bool)

    def body(s):
        shift = cp_fold.ppermute_shift("cp", Pn, reverse=False)
        pos = jax.lax.axis_index("cp")
        return cp_fold.exclusive_segmented_scan(s, resets, pos, Pn, shift)

    fn = jax.shard_map(body, mesh=mesh, in_specs=P("cp"), out_specs=P("cp"))
    r = timed(fn, (x,))
    r["rounds"] = cp_fold.num_rounds(Pn)
    r["bytes_received_per_rank"] = r["rounds"] * H * K * (V + K) * 4
    return r


def allgather_cost(mesh, Pn):
    """The CP summary all-gather alone: [HV, K, V + K] float32 per rank."""
    H, K, V = ARGS.H, ARGS.K, ARGS.V
    x = jnp.ones((Pn, H, K, V + K), jnp.float32)
    fn = jax.shard_map(lambda s: jax.lax.all_gather(s[0], "cp")[None], mesh=mesh,
                       in_specs=P("cp"), out_specs=P("cp"))
    r = timed(fn, (x,))
    r["bytes_sent_per_rank"] = H * K * (V + K) * 4
    r["bytes_received_per_rank"] = Pn * H * K * (V + K) * 4
    return r


def rel_rms(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.sqrt(np.mean((a - b) ** 2)) / (np.sqrt(np.mean(b ** 2)) + 1e-30))


def check(mesh, Pn, devices, packed):
    """CP outputs and gradients vs the single-device op, per rank slice (relative RMS)."""
    T = ARGS.check_T
    x = make_inputs(T, jax.random.key(7))
    cu = packed_offsets(T) if packed else None
    one = jax.device_put(x, devices[0])
    o1 = jax.jit(op_fn(None if cu is None else jax.device_put(cu, devices[0])))(*one)
    g1 = jax.jit(loss_grad(op_fn(None if cu is None else jax.device_put(cu, devices[0]))))(*one)
    fo = sharded(lambda c: op_fn(c, "cp"), mesh, cu)
    fg = sharded(lambda c: loss_grad(op_fn(c, "cp")), mesh, cu, n_out=5)
    args = x if cu is None else (cu,) + tuple(x)
    oP = jax.jit(fo)(*args)
    gP = jax.jit(fg)(*args)
    Tl = T // Pn
    out = {"o": [rel_rms(oP[:, r * Tl:(r + 1) * Tl], o1[:, r * Tl:(r + 1) * Tl]) for r in range(Pn)]}
    for name, a, b in zip(("dq", "dk", "dv", "dg", "dbeta"), gP, g1):
        out[name] = [rel_rms(a[:, r * Tl:(r + 1) * Tl], b[:, r * Tl:(r + 1) * Tl])
                     for r in range(Pn)]
    return out


def main():
    devices = jax.devices()
    date = datetime.date.today().isoformat()
    results = {"date": date, "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
               "device": str(devices[0].device_kind), "num_devices": len(devices),
               "jax": jax.__version__, "config": {k: v for k, v in vars(ARGS).items()},
               "cases": [], "allgather": {}, "checks": {}}
    for Pn in ARGS.P:
        if Pn > len(devices):
            print(f"skip P={Pn}: only {len(devices)} devices", flush=True)
            continue
        mesh = Mesh(np.array(devices[:Pn]), ("cp",))
        for packed in ((False, True) if ARGS.packed else (False,)) if ARGS.check_T else ():
            results["checks"][f"P{Pn}_{'packed' if packed else 'batched'}"] = check(
                mesh, Pn, devices, packed)
            print("check", Pn, packed, json.dumps(results["checks"]), flush=True)
        results["allgather"][str(Pn)] = allgather_cost(mesh, Pn)
        results.setdefault("scan", {})[str(Pn)] = scan_cost(mesh, Pn)
        for T in ARGS.T:
            for packed in ((False, True) if ARGS.packed else (False,)):
                label = f"T={T} P={Pn} {'packed7' if packed else 'single'}"
                res = run_case(label, T, Pn, mesh, packed, devices)
                results["cases"].append(res)
                print(json.dumps(res), flush=True)
    os.makedirs(ARGS.out, exist_ok=True)
    stem = os.path.join(ARGS.out, f"cp_{date}{ARGS.tag}" + ("_tiny" if ARGS.tiny else ""))
    with open(stem + ".json", "w") as f:
        json.dump(results, f, indent=1)
    with open(stem + ".md", "w") as f:
        f.write(table(results))
    print(table(results))


def table(res):
    lines = [f"# CP benchmark, {res['date']} on {res['num_devices']} x {res['device']}",
             "", f"Command: `{res['command']}`  (jax {res['jax']})", "",
             "| case | fold | mode | 1 dev on T (ms) | 1 dev on T/P (ms) | CP per rank (ms) | "
             "efficiency t1(T)/(P tP) | fold collectives share | mem/rank CP (GB) | mem 1 dev T (GB) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for c in res["cases"]:
        ag = res["scan" if c.get("fold") == "scan" else "allgather"][str(c["P"])]["ms"]
        for mode in ("fwd", "fwd+bwd"):
            r = c[mode]
            ms = lambda x: f"{x['ms']:.2f}" if "ms" in x else "OOM/err"
            nag = 1 if mode == "fwd" else 2
            gb = lambda m: "-" if not m else f"{m / 1e9:.2f}"
            eff = "-" if r["efficiency"] is None else f"{r['efficiency']:.2f}"
            share = (f"{100 * nag * ag / r['tP_T']['ms']:.2f}%" if "ms" in r["tP_T"] else "-")
            lines.append(
                f"| {c['label']} | {c.get('fold', '-')} | {mode} | {ms(r['t1_T'])} | {ms(r['t1_Tp'])} | "
                f"{ms(r['tP_T'])} | {eff} | {share} | "
                f"{gb(r['tP_T'].get('mem_bytes'))} | {gb(r['t1_T'].get('mem_bytes'))} |")
    lines += ["", "All-gather alone (per call): " + ", ".join(
        f"P={p}: {v['ms']:.3f} ms, {v['bytes_received_per_rank'] / 1e6:.2f} MB received per rank"
        for p, v in res["allgather"].items()),
        "Scan fold alone (per call): " + ", ".join(
            f"P={p}: {v['ms']:.3f} ms, {v['rounds']} rounds, "
            f"{v['bytes_received_per_rank'] / 1e6:.2f} MB received per rank"
            for p, v in res.get("scan", {}).items()), "",
        "CP vs 1 device (relative RMS per rank slice): "]
    for k, v in res["checks"].items():
        lines.append(f"- {k}: " + ", ".join(f"{n} max {max(x):.2e}" for n, x in v.items()))
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
