"""One process of the 2-process CP check (run by tests/test_cp_multiprocess.py).

Usage: python _cp_worker.py PROCESS_ID NUM_PROCESSES PORT

The parent sets JAX_PLATFORMS=cpu, XLA_FLAGS (4 devices, the suite's compile flags:
_compile_flags.py) and
PJRT_NPROC. Every process builds the same global inputs (same seed, numpy), shards them
over the global mesh of all processes' devices, runs the CP op forward + gradient under
jit, and compares ITS addressable shards with the plain single-device op on the full
arrays computed locally (one local device, outside the mesh). Prints one JSON line:
{"process": i, "errors": {case: {quantity: rel max error}}, ...}.
"""
from __future__ import annotations

import json
import sys

import numpy as np

import jax

jax.config.update("jax_enable_x64", True)
jax.config.update("jax_cpu_collectives_implementation", "gloo")

import jax.numpy as jnp  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

AXIS = "cp"
SHARDED = ("q", "k", "v", "g", "beta")


def make_inputs(seed, B, T, n, H, HV, K, V, N):
    """Deterministic float64 inputs (numpy only, identical on every process)."""
    rng = np.random.default_rng(seed)
    kd = rng.standard_normal((B, T, n, H, K))
    kd = kd / np.linalg.norm(kd, axis=-1, keepdims=True) * rng.uniform(0.5, 1.0, (B, T, n, H, 1))
    return {
        "q": rng.standard_normal((B, T, H, K)),
        "k": kd,
        "v": rng.standard_normal((B, T, n, HV, V)),
        "g": -rng.uniform(1e-3, 1.0, (B, T, HV)),
        "beta": rng.uniform(0.0, 2.0, (B, T, n, HV)),
        "initial_state": 0.5 * rng.standard_normal((N, HV, K, V)),
    }


def rel_max(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    den = float(np.max(np.abs(b))) if b.size else 0.0
    return float(np.max(np.abs(a - b)) / max(den, 1e-300)) if b.size else 0.0


def loss_fn(op_call):
    def loss(args, cu, wo, ws):
        o, s = op_call(args, cu)
        return jnp.sum(o * wo) + jnp.sum(s * ws), (o, s)
    return jax.value_and_grad(loss, has_aux=True)


def call(args, cu, **kw):
    import gdp_jax
    return gdp_jax.gated_delta_product(
        args["q"], args["k"], args["v"], args["g"], args["beta"],
        initial_state=args["initial_state"], output_final_state=True, cu_seqlens=cu, **kw)


def run_case(mesh, seed, B, T, n, H, HV, K, V, cu):
    N = B if cu is None else len(cu) - 1
    host = make_inputs(seed, B, T, n, H, HV, K, V, N)
    rng = np.random.default_rng(seed + 1)
    host_w = {"wo": rng.standard_normal((B, T, HV, V)), "ws": rng.standard_normal((N, HV, K, V))}

    def put(x, spec):
        sharding = NamedSharding(mesh, spec)
        return jax.make_array_from_callback(x.shape, sharding, lambda idx: x[idx])

    spec = lambda name: P(None, AXIS) if name in SHARDED else P()
    args = {k: put(x, spec(k)) for k, x in host.items()}
    wo, ws = put(host_w["wo"], P(None, AXIS)), put(host_w["ws"], P())
    cu_g = None if cu is None else put(np.asarray(cu, np.int32), P())

    def cp_call(a, c):
        local = lambda a_, c_: call(a_, c_, cp_axis=AXIS)
        in_specs = ({k: spec(k) for k in a},)
        if c is None:
            f = jax.shard_map(lambda a_: local(a_, None), mesh=mesh, in_specs=in_specs,
                              out_specs=(P(None, AXIS), P()))
            return f(a)
        f = jax.shard_map(local, mesh=mesh, in_specs=in_specs + (P(),),
                          out_specs=(P(None, AXIS), P()))
        return f(a, c)

    (val, (o, s)), grads = jax.jit(loss_fn(cp_call))(args, cu_g, wo, ws)
    n_proc_devs = len(jax.local_devices())
    assert len(o.addressable_shards) == n_proc_devs

    # Single-device reference on this process's first local device, full arrays.
    dev = jax.local_devices()[0]
    loc = lambda x: jax.device_put(x, dev)
    largs = {k: loc(x) for k, x in host.items()}
    lcu = None if cu is None else loc(np.asarray(cu, np.int32))
    (val1, (o1, s1)), grads1 = jax.jit(loss_fn(lambda a, c: call(a, c)))(
        largs, lcu, loc(host_w["wo"]), loc(host_w["ws"]))
    o1, s1 = np.asarray(o1), np.asarray(s1)
    grads1 = {k: np.asarray(x) for k, x in grads1.items()}

    def shard_err(arr, ref):
        """max |shard - ref[shard.index]| over this process's shards, / max |ref|."""
        num = max(float(np.max(np.abs(np.asarray(sh.data) - ref[sh.index])))
                  for sh in arr.addressable_shards)
        return num / max(float(np.max(np.abs(ref))), 1e-300)

    errors = {"o": shard_err(o, o1), "final": shard_err(s, s1)}
    for k in grads1:
        errors["d" + k] = shard_err(grads[k], grads1[k])
    # The scalar loss is replicated: every process holds the same value.
    errors["loss"] = rel_max(np.asarray(val.addressable_data(0)), np.asarray(val1))
    ranks = sorted({int(sh.index[1].start or 0) // (T // len(mesh.devices.flat))
                    for sh in o.addressable_shards})
    nonzero = bool(np.abs(o1).max() > 0 and all(np.abs(grads1[k]).max() > 0 for k in grads1))
    return errors, ranks, nonzero


def main():
    pid, nproc, port = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=nproc,
                               process_id=pid)
    assert jax.process_index() == pid and jax.process_count() == nproc
    devices = jax.devices()
    mesh = Mesh(np.array(devices), (AXIS,))
    P_ = len(devices)
    out = {"process": pid, "num_devices": P_, "num_local_devices": len(jax.local_devices()),
           "errors": {}, "ranks": {}, "nonzero": {}}
    cases = {
        # batched rows spanning every rank of both processes, GVA, K != V, n = 2
        "batched": dict(seed=1, B=2, T=4 * P_, n=2, H=1, HV=2, K=4, V=3, cu=None),
        # packed sequences on 8 ranks of 3 tokens (process boundary at token 12):
        # [0, 7) spans ranks 0-2, [7, 7) is empty, [10, 14) crosses the process boundary,
        # [14, 15) has length 1 and ends on a rank boundary, [15, 24) starts on one
        "packed": dict(seed=2, B=1, T=3 * P_, n=3, H=2, HV=2, K=3, V=5,
                       cu=(0, 7, 7, 10, 14, 15, 3 * P_)),
    }
    for name, c in cases.items():
        errs, ranks, nonzero = run_case(mesh, **c)
        out["errors"][name] = errs
        out["ranks"][name] = ranks
        out["nonzero"][name] = nonzero
    print(json.dumps(out), flush=True)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main()
