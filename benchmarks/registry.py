"""Named shape sets and the implementations the runner times (ours and the FLA peer).

A shape is (B, T, H, n) with K = V = 128 and HV = H unless given. An implementation is a
small object: ``available()`` says why it cannot run here (or None), ``build(x)`` takes the
ONE set of inputs of a shape (:class:`Inputs`, JAX arrays) and returns a :class:`Built` whose
callables take no arguments, so every implementation is timed on the same values.

Ours (public API only): ``cutedsl`` (recompute_chunk_num N = 0), ``cutedsl-n<N>``, ``xla``,
and ``<backend>-cp<S>`` / ``<backend>-cpauto`` (``intra_cp=S`` / "auto": CP inside the device),
``<backend>-inv`` (``batch_invariant=True``),
``cutedsl-save`` (``pipeline.SAVE_OPERANDS``: the forward's operands kept for the backward),
and any of them with ``+<switch>`` suffixes that set a module switch while the op is traced
(:data:`SWITCHES`: ``+narrow``, ``+save``, ``+pipe``, ``+flat``, ``+ro``, ``+pair``, ..), e.g. ``cutedsl+save``: ours vs ours
in one process, beside the same FLA.
Peer: ``fla`` (FLA's chunk_gated_delta_product; for the decoding step its fused recurrent
gated delta rule), in :mod:`benchmarks.fla`, imported only when asked for.
"""
from __future__ import annotations

import dataclasses
import re
from typing import Callable, NamedTuple, Optional

# ----------------------------------------------------------------------------- shapes


@dataclasses.dataclass(frozen=True)
class Shape:
    B: int
    T: int
    H: int
    n: int
    K: int = 128
    V: int = 128

    @property
    def HV(self) -> int:
        return self.H

    def label(self) -> str:
        kv = "" if (self.K, self.V) == (128, 128) else f", K={self.K}, V={self.V}"
        return f"{self.B}, {self.T}, {self.H}, {self.n}{kv}"


_MAIN = [Shape(8, 4096, 16, 1), Shape(8, 4096, 16, 2), Shape(8, 4096, 16, 3),
         Shape(2, 16384, 16, 2)]
_LONG = [Shape(1, 65536, 16, 2), Shape(1, 65536, 32, 2), Shape(1, 32768, 64, 2)]

SHAPE_SETS = {
    # forward and forward + backward: (B, T, H, n)
    "op": {"main": _MAIN, "long": _LONG, "all": _MAIN + _LONG,
           "tiny": [Shape(2, 96, 2, 2, K=16, V=16)]},
    # one decoding token: B rows, H = HV = 32 (T is 1)
    "step": {"main": [Shape(B, 1, 32, 2) for B in (1, 16, 64)],
             "tiny": [Shape(2, 1, 2, 2, K=16, V=16)]},
    # context parallel: B = 1, global T split over the mesh
    "cp": {"main": [Shape(1, T, 16, 2) for T in (32768, 131072, 524288)],
           "tiny": [Shape(1, 512, 2, 2, K=16, V=16)]},
}


def shapes(kind: str, spec: str):
    """``spec``: a set name of SHAPE_SETS[kind], or ';'-separated "B,T,H,n[,K,V]" tuples."""
    sets = SHAPE_SETS[kind]
    if spec in sets:
        return list(sets[spec])
    out = []
    for part in spec.split(";"):
        try:
            vals = [int(x) for x in part.split(",")]
            out.append(Shape(*vals))
        except (TypeError, ValueError):
            raise ValueError(f"--shapes: {part!r} is neither a set of {sorted(sets)} nor "
                             "B,T,H,n[,K,V]") from None
    return out


# ----------------------------------------------------------------------------- inputs


class Inputs(NamedTuple):
    """One shape's inputs, JAX arrays, ours layout. bf16 unless said otherwise."""
    q: object        # [B, T, H, K]
    k: object        # [B, T, n, H, K]
    v: object        # [B, T, n, HV, V]
    g: object        # [B, T, HV] float32 log-decay
    beta: object     # [B, T, n, HV] in (0.05, 1.95)
    w: object        # [B, T, HV, V] float32 (bf16-representable) loss weights
    S: object = None  # step only: [B, HV, K, V] float32 state


def make_inputs(shape: Shape, seed: int = 0, step: bool = False) -> Inputs:
    """Random inputs drawn on the default device. ``step``: one token (no T axis) + a state."""
    import jax
    return jax.block_until_ready(_jit_draw()(shape, step, jax.random.PRNGKey(seed)))


def _draw(shape, step, key):
    import jax
    import jax.numpy as jnp
    B, T, H, n, K, V, HV = shape.B, shape.T, shape.H, shape.n, shape.K, shape.V, shape.HV
    lead = (B,) if step else (B, T)
    ks = jax.random.split(key, 7)
    f32, bf = jnp.float32, jnp.bfloat16
    q = jax.random.normal(ks[0], lead + (H, K), f32).astype(bf)
    k = jax.random.normal(ks[1], lead + (n, H, K), f32).astype(bf)
    v = jax.random.normal(ks[2], lead + (n, HV, V), f32).astype(bf)
    beta = jax.random.uniform(ks[3], lead + (n, HV), f32, 0.05, 1.95).astype(bf)
    g = jax.nn.log_sigmoid(jax.random.normal(ks[4], lead + (HV,), f32) + 3.0)
    w = jax.random.normal(ks[5], lead + (HV, V), f32).astype(bf).astype(f32)
    S = 0.3 * jax.random.normal(ks[6], (B, HV, K, V), f32) if step else None
    return Inputs(q, k, v, g, beta, w, S)


def _jit_draw():
    import jax
    return jax.jit(_draw, static_argnums=(0, 1))      # one compile per shape, not seven


GRAD_NAMES = ("dq", "dk", "dv", "dg", "dbeta")


# ----------------------------------------------------------------------------- impls


@dataclasses.dataclass
class Built:
    """Callables over one shape's inputs (no arguments: the inputs are bound).

    fwd() -> o; fwdbwd() -> anything (timed); sync(x) waits for x.
    grads_of(x): the five gradients (ours layout, GRAD_NAMES order) from fwdbwd's result,
    for the correctness check; to_np(a): one of them (or fwd's o) as a float32 numpy array.
    memory(): {"peak_gb", "kept_gb", "xla_gb"} of one fwd+bwd (the keys it can measure;
    xla_gb: the bytes XLA's cost analysis gives the compiled program); fwd_memory():
    {"fwd_peak_gb"} of one forward, measured as ``memory``'s peak.
    For the step: step(S) -> S (donated) and first() -> (o, S) for the check.
    """
    sync: Callable
    fwd: Optional[Callable] = None
    fwdbwd: Optional[Callable] = None
    to_np: Optional[Callable] = None
    grads_of: Optional[Callable] = None
    memory: Optional[Callable] = None
    fwd_memory: Optional[Callable] = None
    step: Optional[Callable] = None
    first: Optional[Callable] = None
    fresh_state: Optional[Callable] = None
    release: Callable = lambda: None
    jitted: dict = dataclasses.field(default_factory=dict)   # {"fwd"/"fwdbwd": (jit fn, args)}


class OursOp:
    """gdp_jax.gated_delta_product (use_qk_l2norm, gates on), jitted value-and-grad of
    sum(o * w) w.r.t. q, k, v, g, beta. Peak = XLA's compiled temp bytes of that function;
    kept = bytes of ``jax.vjp``'s residuals beyond the inputs."""
    family = "ours"

    def __init__(self, name, backend, N=None, intra_cp=None, batch_invariant=False,
                 switches=()):
        self.name, self.backend, self.N, self.intra_cp = name, backend, N, intra_cp
        self.batch_invariant = batch_invariant
        # module switches set while the op is traced: ((module, attribute), ...)
        self.switches = tuple(switches)
        # without grad no checkpoints are kept, so the forward of N > 0 is N = 0's
        self.fwd_same_as = ("cutedsl" if backend == "cutedsl" and N and intra_cp is None
                            else None)

    def available(self) -> Optional[str]:
        if self.backend == "cutedsl":
            import jax
            if jax.devices()[0].platform != "gpu":
                return f"needs an sm_90 GPU (default device: {jax.devices()[0].platform})"
        return None

    def op(self):
        from gdp_jax import gated_delta_product
        kw = {} if self.N is None else {"recompute_chunk_num": self.N}
        if self.intra_cp is not None:
            kw["intra_cp"] = self.intra_cp
        if self.batch_invariant:
            kw["batch_invariant"] = True
        return lambda q, k, v, g, beta: gated_delta_product(
            q, k, v, g, beta, use_qk_l2norm=True, backend=self.backend, **kw)

    def switched(self, fn):
        """``fn`` with this implementation's module switches set while it runs - wrap the
        WHOLE function a jit traces (a value-and-grad: the op's backward is traced after
        the op's forward returns, and backward switches are read then)."""
        if not self.switches:
            return fn

        def run(*a):
            import importlib
            mods = [(importlib.import_module(f"gdp_jax.{sw[0]}"), sw[1]) for sw in self.switches]
            old = [getattr(m, n) for m, n in mods]
            for (m, n), sw in zip(mods, self.switches):
                setattr(m, n, sw[2] if len(sw) > 2 else True)
            try:
                return fn(*a)
            finally:
                for (m, n), o in zip(mods, old):
                    setattr(m, n, o)
        return run

    def build(self, x: Inputs) -> Built:
        import jax
        import jax.numpy as jnp
        import numpy as np
        op = self.op()
        args = (x.q, x.k, x.v, x.g, x.beta)
        # w is an argument: closed over, jit would embed it as a constant (2 GB at
        # (1, 262144, 16, 1): slow compiles, host memory)
        loss = lambda q, k, v, g, beta, w: jnp.sum(op(q, k, v, g, beta).astype(jnp.float32) * w)
        fwd = jax.jit(self.switched(op))
        vg_jit = jax.jit(self.switched(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4))))
        vg_args = args + (x.w,)
        compiled = []           # compiled once (on first use): timed and asked for its memory

        def vg(*a):
            if not compiled:
                compiled.append(vg_jit.lower(*a).compile())
            return compiled[0](*a)

        def memory():
            res = jax.jit(self.switched(lambda *a: jax.vjp(op, *a)[1]))(*args)
            kept = sum(l.nbytes for l in jax.tree_util.tree_leaves(res) if hasattr(l, "nbytes"))
            del res
            return {"peak_gb": compiled[0].memory_analysis().temp_size_in_bytes / 1e9,
                    "kept_gb": (kept - sum(a.nbytes for a in args)) / 1e9,
                    "xla_gb": xla_bytes_accessed(compiled[0]) / 1e9}

        def fwd_memory():
            temp = fwd.lower(*args).compile().memory_analysis().temp_size_in_bytes
            return {"fwd_peak_gb": temp / 1e9}

        return Built(sync=jax.block_until_ready, fwd=lambda: fwd(*args),
                     fwdbwd=lambda: vg(*vg_args), grads_of=lambda r: r[1], memory=memory,
                     fwd_memory=fwd_memory,
                     to_np=lambda a: np.asarray(a.astype(jnp.float32)),
                     jitted={"fwd": (fwd, args), "fwdbwd": (vg_jit, vg_args)})


def xla_bytes_accessed(compiled) -> float:
    """Bytes XLA's cost model says a compiled program reads and writes (its own kernels;
    an FFI custom call counts only its operands and results), nan if not reported."""
    try:
        cost = compiled.cost_analysis()
    except Exception:                      # noqa: BLE001 - not every backend reports it
        return float("nan")
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    return float((cost or {}).get("bytes accessed", float("nan")))


class OursStep:
    """gdp_jax.gated_delta_product_step, jitted with the state donated; timed as S = step(S)."""
    family = "ours"
    fwd_same_as = None

    def __init__(self, name, backend):
        self.name, self.backend = name, backend

    available = OursOp.available

    def build(self, x: Inputs) -> Built:
        import jax
        import jax.numpy as jnp
        import numpy as np
        from gdp_jax import gated_delta_product_step
        f = jax.jit(lambda q, k, v, g, beta, S: gated_delta_product_step(
            q, k, v, g, beta, S, use_qk_l2norm=True, backend=self.backend), donate_argnums=5)
        only_state = jax.jit(lambda *a: f(*a)[1], donate_argnums=5)
        a5 = (x.q, x.k, x.v, x.g, x.beta)
        return Built(sync=jax.block_until_ready, step=lambda S: only_state(*a5, S),
                     first=lambda: tuple(np.asarray(t) for t in f(*a5, jnp.array(x.S))),
                     fresh_state=lambda: jnp.array(x.S))


# ``+<switch>`` suffixes of an implementation name: a module constant of gdp_jax set while
# the op is traced - (module, attribute) turns an opt-in on, (module, attribute, value) sets
# that value (``+pipe`` / ``+flat``: the recursion walks with / without their operands a
# chunk ahead; ``+ro`` / ``+allrows``: the forward's qg, P, o on the read-out rows only or
# on all C rows; ``+rog`` / ``+allgrad``: the differentiated forward's on the read-out rows
# or all rows; ``+rob``: the backward's reverse walk's; ``+pair``: walk CTAs of two value
# tiles; ``+nb`` / ``+xlanb``: the L2 norm's backward in the local-gradient kernel or in XLA;
# ``+dotok``: that kernel reading dO token-major; ``+tb``: the backward's kernels reading
# q, k, v token-major; ``+nk``: with +tb, those kernels normalising the raw q, k themselves;
# ``+mma``: the local-gradient kernel's products as warp MMAs (the default until s38);
# ``+gmma``: as warpgroup MMAs on phases 1-8, 11-13; ``+gmmao``: and its independent
# products issued together; ``+gmmaa``: and its phases 9, 10 too (the default); ``+wg``:
# the forward walk's recursion products as warpgroup MMAs, ``+wgb``: the reverse walk's
# (both the default since s39), ``+mmaf`` / ``+mmab``: those walks on warp MMAs; ``+wgp``:
# the operands kernel's products as warpgroup MMAs, ``+mmap``: on warp MMAs; ``+wga``: the
# forward walk's read-out rows' o products too (both the default since s40); ``+gram``: k's
# norms from the operands kernel's K K^T diagonal (the default since s40), ``+normk``: k
# normalised first; ``+u16``: u in bfloat16 (chunk_prep.U16), ``+u16f``: in the plain
# forward only; ``+otok``: the plain forward's walk writes o token-major at every value
# tile (chunk_forward.O_TOKENS; "auto", the default since s43: 64-column tiles only),
# ``+xlao``: never (XLA relays o to tokens); ``+stg``: the operands kernel's 16-bit w, u
# leave through shared memory in 16-byte row pieces (chunk_prep.STAGED_STORES); ``+latev``:
# the operands kernel waits for v's tile only before its w, u products (chunk_prep.LATE_V);
# ``+prep2``: its registers capped for 2 CTAs an SM, not 3 (chunk_prep.CTAS_PER_SM);
# ``+pipe2``: it persistent and pipelined, 2 CTAs an SM (chunk_prep.PIPELINED))
SWITCHES = {"narrow": ("kernels.chunk_forward", "NARROW_TILES"),
            "pair": ("kernels.chunk_forward", "PAIR_TILES", True),
            "rog": ("kernels.pipeline", "READOUT_ONLY_GRAD", True),
            "allgrad": ("kernels.pipeline", "READOUT_ONLY_GRAD", False),
            "nb": ("kernels.pipeline", "FUSED_NORM_BWD", True),
            "dotok": ("kernels.pipeline", "DO_TOKENS", True),
            "tb": ("kernels.pipeline", "TOKEN_BACKWARD", True),
            "nk": ("kernels.pipeline", "NORM_IN_KERNELS", True),
            "xlanb": ("kernels.pipeline", "FUSED_NORM_BWD", False),
            "rob": ("kernels.pipeline", "READOUT_ONLY_BWD", True),
            "save": ("kernels.pipeline", "SAVE_OPERANDS"),
            "mma": ("kernels.local_grad", "GMMA", False),
            "wg": ("kernels.chunk_forward", "GMMA", True),
            "wga": ("kernels.chunk_forward", "GMMA", "all"),
            "wgb": ("kernels.state_grad", "GMMA", True),
            "mmaf": ("kernels.chunk_forward", "GMMA", False),
            "mmab": ("kernels.state_grad", "GMMA", False),
            "wgp": ("kernels.chunk_prep", "GMMA", True),
            "mmap": ("kernels.chunk_prep", "GMMA", False),
            "gram": ("kernels.chunk_prep", "GRAM_NORM", True),
            "normk": ("kernels.chunk_prep", "GRAM_NORM", False),
            "u16": ("kernels.chunk_prep", "U16", True),
            "u16f": ("kernels.chunk_prep", "U16", "forward"),
            "otok": ("kernels.chunk_forward", "O_TOKENS", True),
            "xlao": ("kernels.chunk_forward", "O_TOKENS", False),
            "stg": ("kernels.chunk_prep", "STAGED_STORES", True),
            "latev": ("kernels.chunk_prep", "LATE_V", True),
            "prep2": ("kernels.chunk_prep", "CTAS_PER_SM", 2),
            "pipe2": ("kernels.chunk_prep", "PIPELINED", True),
            "gmma": ("kernels.local_grad", "GMMA", True),
            "gmmao": ("kernels.local_grad", "GMMA", "overlap"),
            "gmmaa": ("kernels.local_grad", "GMMA", "all"),
            "ro": ("kernels.pipeline", "READOUT_ONLY", True),
            "allrows": ("kernels.pipeline", "READOUT_ONLY", False),
            "flat": ("kernels.chunk_forward", "PIPELINE", False),
            "pipe": ("kernels.chunk_forward", "PIPELINE", "auto")}


def _ours(name: str, bench: str):
    base, *plus = name.split("+")
    if plus:
        if bench == "step" or not base.startswith("cutedsl"):
            return None
        unknown = [p for p in plus if p not in SWITCHES]
        if unknown:
            raise ValueError(f"--impl {name!r}: unknown switch(es) {unknown} "
                             f"(known: {sorted(SWITCHES)})")
        found = _ours(base, bench)
        if found is not None:
            found.name = name
            found.switches += tuple(SWITCHES[p] for p in plus)
            found.fwd_same_as = None
        return found
    if bench == "step":
        return OursStep(name, name) if name in ("cutedsl", "xla") else None
    if name == "xla":
        return OursOp("xla", "xla")
    if name == "cutedsl":
        return OursOp("cutedsl", "cutedsl", 0)
    if name == "cutedsl-save":
        return OursOp(name, "cutedsl", 0, switches=(SWITCHES["save"],))    # = cutedsl+save
    if name in ("cutedsl-inv", "xla-inv"):
        backend = name.split("-")[0]
        return OursOp(name, backend, 0 if backend == "cutedsl" else None,
                      batch_invariant=True)
    m = re.fullmatch(r"cutedsl-n(\d+)", name)
    if m:
        return OursOp(name, "cutedsl", int(m.group(1)))
    m = re.fullmatch(r"(cutedsl|xla)-cp(\d+|auto)", name)
    if m:
        S = m.group(2)
        return OursOp(name, m.group(1), 0 if m.group(1) == "cutedsl" else None,
                      intra_cp=S if S == "auto" else int(S))
    return None


IMPL_NAMES = ("cutedsl, cutedsl-n<N> (recompute_chunk_num=N), cutedsl-save (the forward's "
              "operands kept for the backward: pipeline.SAVE_OPERANDS), xla, "
              "cutedsl-inv / xla-inv (batch_invariant=True), "
              "<backend>-cp<S> and <backend>-cpauto (intra_cp), and cutedsl* with "
              "+narrow / +save / +pipe / +flat / +ro / +allrows / +rog / +allgrad / +rob / +nb / +xlanb / +dotok / +tb / +nk / +pair / +wg / +mma / +gmma / +gmmao / +gmmaa / +otok / +xlao / +stg switch suffixes, fla")


def impl(name: str, bench: str):
    """The implementation ``name`` for ``bench`` ("fwd", "fwdbwd" or "step")."""
    if name == "fla":
        from benchmarks import fla           # no torch import until FLA is asked for
        return fla.FlaStep() if bench == "step" else fla.FlaOp()
    found = _ours(name, bench)
    if found is None:
        raise ValueError(f"--impl: unknown implementation {name!r} for {bench} "
                         f"(known: {IMPL_NAMES})")
    return found


def slice_check(arr, name: str, hr: int):
    """The part of o / a gradient the float64 reference covers: row 0, heads [0, hr).
    Rows and heads (HV = H) are independent, so this slice of the full call equals the
    reference run on the slice alone. ``name``: "o" or one of GRAD_NAMES."""
    head_axis = {"o": -2, "dq": -2, "dk": -2, "dv": -2, "dg": -1, "dbeta": -1}[name]
    idx = [slice(None)] * arr.ndim
    idx[0] = slice(0, 1)
    idx[arr.ndim + head_axis] = slice(0, hr)
    return arr[tuple(idx)]
