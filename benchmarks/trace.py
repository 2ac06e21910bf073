"""GPU kernel time of one of our fwd+bwd (or forward) calls, by kernel (jax.profiler trace).

Builds the registry implementation's jitted value-and-grad of sum(o * w) on the registry
inputs of one shape, runs it a few times under ``jax.profiler.trace``, reads the Perfetto
trace and prints the GPU kernels grouped by name (ms and calls per step), largest first.

    python -m benchmarks.trace --shape 8,4096,16,2 --impl cutedsl --out /tmp/gdp_trace

``--mode bwd`` traces the engine's backward alone, jitted directly: the op's custom_vjp
hides the backward's source lines from the HLO (its frames stop at the op's call).
"""
from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os


def kernel_times(out_dir, steps):
    """{kernel name: ms per step}, {name: calls per step}, from the newest trace under out_dir."""
    files = glob.glob(os.path.join(out_dir, "**", "*.trace.json.gz"), recursive=True)
    files += glob.glob(os.path.join(out_dir, "**", "perfetto_trace.json.gz"), recursive=True)
    if not files:
        raise FileNotFoundError(f"no trace json under {out_dir}")
    with gzip.open(sorted(files, key=os.path.getmtime)[-1]) as f:
        trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    pnames = {e["pid"]: e["args"]["name"] for e in events
              if e.get("ph") == "M" and e.get("name") == "process_name"}
    gpu = {p for p, nm in pnames.items() if "GPU" in nm}
    tot, cnt = collections.Counter(), collections.Counter()
    for e in events:
        if e.get("ph") == "X" and e.get("pid") in gpu:
            name = e.get("args", {}).get("hlo_op") or e["name"]
            tot[name] += e.get("dur", 0) / 1e3 / steps
            cnt[name] += 1 / steps
    return tot, cnt


def engine_backward(shape, impl: str):
    """(jitted fn, args): the ``impl`` engine's backward alone ("xla" or "cutedsl") on the
    registry inputs of ``shape`` - chunk inputs, random read-out-row cotangents, zero
    final-state cotangents and the checkpoints its own forward keeps."""
    import jax
    import jax.numpy as jnp
    from benchmarks import registry
    from gdp_jax import backends, engine
    from gdp_jax._checks import check_inputs

    x = registry.make_inputs(shape)
    spec = check_inputs(x.q, x.k, x.v, x.g, x.beta, use_qk_l2norm=True)
    eng = backends.engine("cutedsl" if impl.startswith("cutedsl") else "xla")
    prob = engine.forward_problem(spec, x.q, x.k, x.v, x.g, x.beta, None)
    h0 = engine.start_states(spec, None)
    states = jax.jit(lambda ch: eng.forward(spec, ch, prob.layout, h0,
                                            keep_states=True)[2])(prob.ch)
    from gdp_jax import grid
    # the op's backward gets the read-out rows only (engine.backward_problem)
    *lead, C, V = prob.ch.v.shape
    doc = jax.random.normal(jax.random.PRNGKey(1),
                            (*lead, C // grid.readout_every(spec.n), V), prob.ch.v.dtype)
    fn = jax.jit(lambda ch, doc, st: eng.backward(spec, ch, prob.layout, h0, doc,
                                                  jnp.zeros_like(h0), st))
    return fn, (prob.ch, doc, states)


def _write_hlo(fn, args, path):
    """The optimized HLO of the traced program ``fn(*args)`` (a jitted function)."""
    if fn is None:
        print("(no HLO: this build does not expose its jitted function)")
        return
    text = fn.lower(*args).compile().as_text()
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "wt") as f:
        f.write(text)
    print(f"optimized HLO ({len(text) / 1e6:.1f} MB of text) -> {path}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="8,4096,16,2", help="B,T,H,n[,K,V]")
    ap.add_argument("--impl", default="cutedsl",
                    help="a registry implementation of ours: cutedsl, cutedsl-n<N>, "
                         "cutedsl-cpauto (intra_cp='auto'), xla, ... (--mode bwd: cutedsl "
                         "or xla)")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--top", type=int, default=40)
    ap.add_argument("--out", default="/tmp/gdp_trace")
    ap.add_argument("--mode", choices=("fwdbwd", "fwd", "bwd"), default="fwdbwd",
                    help="trace the jitted value-and-grad (default), the forward alone, or "
                         "the engine's backward alone (jitted directly, not through the "
                         "op's custom_vjp, so the HLO names its source lines)")
    ap.add_argument("--hlo", default=None,
                    help="also write the compiled (optimized) HLO text here (gzip if .gz): "
                         "the trace's names are its fusions")
    ap.add_argument("--set", action="append", default=[], metavar="MODULE.NAME=VALUE",
                    help="set a gdp_jax module switch before tracing (as benchmarks.run's)")
    a = ap.parse_args(argv)
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    # XLA replays whole programs as CUDA graphs ("command buffers"): the trace then shows one
    # "command_buffer" entry per step instead of the kernels (seen on the H200, 2026-12-01).
    flag = "--xla_gpu_enable_command_buffer="
    if flag not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + flag).strip()
    import jax
    from benchmarks import registry
    from benchmarks.run import apply_settings

    apply_settings(a.set)
    shape = registry.shapes("op", a.shape)[0]
    if a.mode == "bwd":
        fn, args = engine_backward(shape, a.impl)
        call, sync = (lambda: fn(*args)), jax.block_until_ready
    else:
        built = registry.impl(a.impl, "fwdbwd").build(registry.make_inputs(shape))
        call, sync = (built.fwdbwd if a.mode == "fwdbwd" else built.fwd), built.sync
        fn, args = built.jitted.get(a.mode, (None, None))
    os.makedirs(a.out, exist_ok=True)
    for _ in range(3):
        sync(call())
    with jax.profiler.trace(a.out, create_perfetto_trace=True):
        for _ in range(a.steps):
            sync(call())
    tot, cnt = kernel_times(a.out, a.steps)
    if a.hlo:
        _write_hlo(fn, args, a.hlo)
    if not tot:
        print("no GPU kernels in the trace (is the default device a GPU?)")
    print(f"total GPU kernel time per step: {sum(tot.values()):.3f} ms ({len(tot)} names)")
    for name, ms in tot.most_common(a.top):
        print(f"{ms:8.3f} ms {cnt[name]:5.0f}x  {name[:110]}")


if __name__ == "__main__":
    main()
