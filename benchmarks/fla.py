"""The peer: FLA (PyTorch / Triton) on the same inputs as ours, in the same process.

FLA's autotune is never restricted: a comparison against FLA cut to one Triton config was
wrong by about 4x once. Its tuned choices can be cached on disk (TRITON_CACHE_AUTOTUNING=1,
which the GPU machine's .gpu-deps/install.sh sets) so a fresh machine does not re-tune.

Layout: FLA takes the n Householder steps interleaved on the time axis: k [B, T*n, H, K],
v [B, T*n, HV, V], beta [B, T*n, HV] = ours reshaped (t-major, step-minor), g [B, T, HV].

FLA 0.6.0 refuses its gated backward on Hopper with triton < 3.7.1 (its issue #640: wrong
results in some cases). For timing this module sets ``fla.ops.common.chunk_o.TRITON_ABOVE_3_7_1
= True`` where that flag exists; the check column shows what those gradients are worth.
"""
from __future__ import annotations

import inspect
from typing import Optional

from benchmarks.registry import Built, Inputs


def _missing() -> Optional[str]:
    try:
        import torch
        import fla  # noqa: F401
    except Exception as e:          # ImportError, or a broken CUDA/triton install
        return f"FLA not importable here ({type(e).__name__}: {e})"
    if not torch.cuda.is_available():
        return "FLA needs a CUDA GPU (torch.cuda.is_available() is False)"
    return None


def version() -> str:
    """'fla X, torch Y, triton Z', or why FLA is absent."""
    why = _missing()
    if why:
        return why
    import fla
    import torch
    try:
        import triton
        tv = triton.__version__
    except ImportError:
        tv = "-"
    return f"fla {getattr(fla, '__version__', '?')}, torch {torch.__version__}, triton {tv}"


def _torch(x, requires_grad=False):
    """A JAX array as a CUDA torch tensor of the same dtype (bf16 or float32), via the host."""
    import numpy as np
    import torch
    dt = torch.bfloat16 if str(x.dtype) == "bfloat16" else torch.float32
    t = torch.from_numpy(np.array(x.astype("float32"))).cuda().to(dt).contiguous()
    return t.requires_grad_() if requires_grad else t


def _sync(_=None):
    import torch
    torch.cuda.synchronize()


class FlaOp:
    """fla.ops.gated_delta_product.chunk_gated_delta_product(use_qk_l2norm_in_kernel=True);
    fwd+bwd = forward + o.backward(w). Peak = max_memory_allocated during fwd+bwd (or
    the forward alone) minus what was allocated before; kept = memory_allocated after the
    forward minus before, minus o."""
    name, family, fwd_same_as = "fla", "peer", None

    def available(self):
        return _missing()

    def build(self, x: Inputs) -> Built:
        import torch
        import fla.ops.common.chunk_o as chunk_o
        from fla.ops.gated_delta_product import chunk_gated_delta_product
        if hasattr(chunk_o, "TRITON_ABOVE_3_7_1"):
            chunk_o.TRITON_ABOVE_3_7_1 = True        # timing only, see the module docstring
        B, T, n, H, K = x.k.shape
        HV, V = x.v.shape[-2:]
        q = _torch(x.q, True)
        k = _torch(x.k.reshape(B, T * n, H, K), True)
        v = _torch(x.v.reshape(B, T * n, HV, V), True)
        beta = _torch(x.beta.reshape(B, T * n, HV), True)
        g = _torch(x.g, True)
        w = _torch(x.w).to(torch.bfloat16)
        leaves = (q, k, v, g, beta)

        def fwd_grad():
            return chunk_gated_delta_product(q, k, v, g, beta, num_householder=n,
                                             use_qk_l2norm_in_kernel=True)[0]

        def fwd():
            with torch.no_grad():
                return fwd_grad()

        def fwdbwd():
            for t in leaves:
                t.grad = None
            o = fwd_grad()
            o.backward(w)
            return o

        def grads_of(_):
            return (q.grad, k.grad.reshape(B, T, n, H, K), v.grad.reshape(B, T, n, HV, V),
                    g.grad, beta.grad.reshape(B, T, n, HV))

        def memory():
            for t in leaves:
                t.grad = None
            _sync()
            before = torch.cuda.memory_allocated()
            o = fwd_grad()
            _sync()
            kept = torch.cuda.memory_allocated() - before - o.nbytes
            del o
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            fwdbwd()
            _sync()
            return {"peak_gb": (torch.cuda.max_memory_allocated() - base) / 1e9,
                    "kept_gb": kept / 1e9}

        def fwd_memory():
            _sync()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            o = fwd()
            _sync()
            peak = torch.cuda.max_memory_allocated() - base
            del o
            return {"fwd_peak_gb": peak / 1e9}

        def release():
            for t in leaves:
                t.grad = None
            torch.cuda.empty_cache()

        return Built(sync=_sync, fwd=fwd, fwdbwd=fwdbwd,
                     to_np=lambda a: a.detach().float().cpu().numpy(), grads_of=grads_of,
                     memory=memory, fwd_memory=fwd_memory, release=release)


class FlaStep:
    """fla.ops.gated_delta_rule.fused_recurrent_gated_delta_rule on the n interleaved
    sub-steps of one token (how FLA's GDP layer decodes): k, v, beta as [B, n, H, .], q only
    at the last sub-step, g at the first. Keyword names are checked against its signature."""
    name, family, fwd_same_as = "fla", "peer", None

    def available(self):
        return _missing()

    def build(self, x: Inputs) -> Built:
        import torch
        from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule as fn
        params = set(inspect.signature(fn).parameters)
        B, n, H, K = x.k.shape
        HV = x.v.shape[-2]
        qi = torch.zeros(B, n, H, K, device="cuda", dtype=torch.bfloat16)
        qi[:, -1] = _torch(x.q)
        gi = torch.zeros(B, n, HV, device="cuda", dtype=torch.float32)
        gi[:, 0] = _torch(x.g)
        S0 = _torch(x.S)
        kw = dict(q=qi, k=_torch(x.k), v=_torch(x.v), g=gi, beta=_torch(x.beta),
                  scale=K ** -0.5, initial_state=S0, output_final_state=True)
        if "use_qk_l2norm_in_kernel" not in params:
            raise TypeError(f"FLA's fused_recurrent_gated_delta_rule{inspect.signature(fn)} "
                            "has no use_qk_l2norm_in_kernel")
        kw["use_qk_l2norm_in_kernel"] = True
        missing = [p for p in kw if p not in params]
        if missing:
            raise TypeError(f"FLA's fused_recurrent_gated_delta_rule lacks {missing}")

        def step(S):
            with torch.no_grad():
                return fn(**{**kw, "initial_state": S})[1]

        def first():
            with torch.no_grad():
                o, s = fn(**kw)
            return o[:, -1].float().cpu().numpy(), s.float().cpu().numpy()

        return Built(sync=_sync, step=step, first=first, fresh_state=lambda: S0.clone(),
                     release=torch.cuda.empty_cache)
