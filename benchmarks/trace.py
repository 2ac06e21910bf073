"""GPU kernel time of one of our fwd+bwd (or forward) calls, by kernel (jax.profiler trace).

Builds the registry implementation's jitted value-and-grad of sum(o * w) on the registry
inputs of one shape, runs it a few times under ``jax.profiler.trace``, reads the Perfetto
trace and prints the GPU kernels grouped by name (ms and calls per step), largest first.

    python -m benchmarks.trace --shape 8,4096,16,2 --impl cutedsl --out /tmp/gdp_trace
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


def _write_hlo(built, mode, path):
    """The optimized HLO of the traced program, if the registry exposes its jitted function
    and arguments (``built.jitted``: {mode: (fn, args)})."""
    fn_args = getattr(built, "jitted", {}).get(mode)
    if fn_args is None:
        print(f"(no HLO: the {mode} build does not expose its jitted function)")
        return
    fn, args = fn_args
    text = fn.lower(*args).compile().as_text()
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "wt") as f:
        f.write(text)
    print(f"optimized HLO ({len(text) / 1e6:.1f} MB of text) -> {path}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="8,4096,16,2", help="B,T,H,n[,K,V]")
    ap.add_argument("--impl", default="cutedsl", help="cutedsl, cutedsl-n<N> or xla")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--top", type=int, default=40)
    ap.add_argument("--out", default="/tmp/gdp_trace")
    ap.add_argument("--mode", choices=("fwdbwd", "fwd"), default="fwdbwd",
                    help="trace the jitted value-and-grad (default) or the forward alone")
    ap.add_argument("--hlo", default=None,
                    help="also write the compiled (optimized) HLO text here (gzip if .gz): "
                         "the trace's names are its fusions")
    a = ap.parse_args(argv)
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    # XLA replays whole programs as CUDA graphs ("command buffers"): the trace then shows one
    # "command_buffer" entry per step instead of the kernels (seen on the H200, 2026-12-01).
    flag = "--xla_gpu_enable_command_buffer="
    if flag not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + flag).strip()
    import jax
    from benchmarks import registry

    shape = registry.shapes("op", a.shape)[0]
    built = registry.impl(a.impl, "fwdbwd").build(registry.make_inputs(shape))
    call = built.fwdbwd if a.mode == "fwdbwd" else built.fwd
    os.makedirs(a.out, exist_ok=True)
    for _ in range(3):
        built.sync(call())
    with jax.profiler.trace(a.out, create_perfetto_trace=True):
        for _ in range(a.steps):
            built.sync(call())
    tot, cnt = kernel_times(a.out, a.steps)
    if a.hlo:
        _write_hlo(built, a.mode, a.hlo)
    if not tot:
        print("no GPU kernels in the trace (is the default device a GPU?)")
    print(f"total GPU kernel time per step: {sum(tot.values()):.3f} ms ({len(tot)} names)")
    for name, ms in tot.most_common(a.top):
        print(f"{ms:8.3f} ms {cnt[name]:5.0f}x  {name[:110]}")


if __name__ == "__main__":
    main()
