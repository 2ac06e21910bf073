"""The XLA glue around the cutedsl kernels, compiled (not run) on any host.

    JAX_PLATFORMS=cpu python -m benchmarks.glue_bytes --shape 1,65536,16,2 [--intra-cp 4]
        [--mode fwd|fwdbwd] [--top 12]

Every kernel call of the cutedsl pipeline becomes an opaque ``jax.pure_callback`` with the
kernel's exact operands and results (their shapes from the emulations in
``gdp_jax.kernels.emulate``), so XLA can neither fold nor look into them; the program is
then compiled for this host (nothing runs) and the script prints XLA's cost analysis
("bytes accessed": the reads and writes of XLA's own instructions; the opaque kernels'
are not counted) and the entry computation's largest instructions, kernels included
(output and operand MiB, the op that made them). A CPU's fusion choices differ from a GPU's, so read the numbers as a
before / after proxy for the HBM traffic the glue adds around the kernels, not as GPU
bytes. Inputs as the benchmark runner draws them (bf16, gates on, ``use_qk_l2norm``).
"""
from __future__ import annotations

import argparse
import functools
import re

import numpy as np

_KERNELS = ("local_grad_call", "local_grad_tokens_call", "chunk_prep_call",
            "chunk_prep_tokens_call", "chunk_kernel_call",
            "dh_kernel_call", "inverse_kernel_call")
_BYTES = {"bf16": 2, "f16": 2, "f32": 4, "f64": 8, "s32": 4, "u32": 4, "s64": 8, "u64": 8,
          "pred": 1, "s8": 1, "u8": 1}


def _opaque(f):
    """The emulated kernel ``f`` as a callback of the same signature XLA cannot see into."""
    import jax
    import numpy as np

    def call(*args, **kw):
        out = jax.eval_shape(functools.partial(f, **kw), *args)
        arrays = [a for a in jax.tree.leaves(args) if hasattr(a, "dtype")]
        zeros = lambda *_: jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), out)
        return jax.pure_callback(zeros, out, *arrays, vmap_method="broadcast_all")
    return call


def _nbytes(types: str) -> int:
    total = 0
    for m in re.finditer(r"(\w+)\[([0-9,]*)\]", types):
        if m.group(1) in _BYTES:
            total += _BYTES[m.group(1)] * int(np.prod([int(d) for d in m.group(2).split(",")
                                                       if d] or [1]))
    return total


def largest(hlo_text: str, top: int):
    """(out + operand bytes, out bytes, opcode, what) of the entry's biggest instructions."""
    entry = [c for c in re.split(r"\n(?=\S)", hlo_text) if c.startswith("ENTRY")][0]
    sizes, rows = {}, []
    for line in entry.splitlines()[1:]:
        m = re.match(r"\s*(?:ROOT )?(%?[\w.\-]+) = (.*?) ([\w\-]+)\((.*)", line)
        if not m:
            continue
        name, types, op, rest = m.groups()
        sizes[name] = _nbytes(types)
        if op in ("parameter", "constant", "get-tuple-element", "tuple", "bitcast"):
            continue
        operands = re.findall(r"(%[\w.\-]+)", rest.split(", kind=")[0])
        meta = re.search(r'op_name="([^"]*)"', line)
        src = re.search(r'source_file="([^"]*)" source_line=(\d+)', line)
        where = f" {src.group(1).rsplit('/', 1)[-1]}:{src.group(2)}" if src else ""
        rows.append((sizes[name] + sum(sizes.get(o, 0) for o in operands), sizes[name], op,
                     types[:48] + "  " + (meta.group(1)[-40:] if meta else "") + where))
    return sorted(rows, key=lambda r: -r[0])[:top]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="1,65536,16,2", help="B,T,H,n (K = V = 128)")
    p.add_argument("--intra-cp", default=None, help="the op's intra_cp (S or auto)")
    p.add_argument("--mode", choices=("fwd", "fwdbwd"), default="fwd")
    p.add_argument("--top", type=int, default=12)
    p.add_argument("--set", action="append", default=[], metavar="MODULE.NAME=VALUE",
                   help="set a gdp_jax module switch before tracing (as benchmarks.run's), "
                        "e.g. kernels.pipeline.SAVE_OPERANDS=True")
    a = p.parse_args(argv)
    from benchmarks.run import apply_settings
    apply_settings(a.set)

    import jax
    import jax.numpy as jnp
    import gdp_jax
    from gdp_jax import testing
    from gdp_jax.kernels import emulate

    B, T, H, n = (int(x) for x in a.shape.split(","))
    K = V = 128
    S = None if a.intra_cp is None else (a.intra_cp if a.intra_cp == "auto" else int(a.intra_cp))
    bf, f32 = jnp.bfloat16, jnp.float32
    args = [jax.ShapeDtypeStruct(s, d) for s, d in (
        ((B, T, H, K), bf), ((B, T, n, H, K), bf), ((B, T, n, H, V), bf), ((B, T, H), f32),
        ((B, T, n, H), bf))]

    def fwd(*x):
        return gdp_jax.gated_delta_product(*x, use_qk_l2norm=True, backend="cutedsl",
                                           intra_cp=S)

    def fwdbwd(*x):
        o, pull = jax.vjp(fwd, *x)
        return o, pull(o)

    saved = {n_: getattr(emulate, n_) for n_ in _KERNELS}
    try:
        for n_ in _KERNELS:
            setattr(emulate, n_, _opaque(saved[n_]))
        with testing.emulated_kernels():
            compiled = jax.jit(fwd if a.mode == "fwd" else fwdbwd).lower(*args).compile()
    finally:
        for n_, f in saved.items():
            setattr(emulate, n_, f)
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    print(f"{a.shape} intra_cp={S} {' '.join([a.mode] + a.set)}: XLA bytes accessed "
          f"{cost.get('bytes accessed', 0) / 2**30:.2f} GiB (its own instructions; the "
          f"kernels' not counted), temporaries "
          f"{compiled.memory_analysis().temp_size_in_bytes / 2**30:.2f} GiB")
    for total, out, op, what in largest(compiled.as_text(), a.top):
        print(f"  {total / 2**20:8.0f} MiB (out {out / 2**20:6.0f}) {op:12s} {what}")

if __name__ == "__main__":
    main()
