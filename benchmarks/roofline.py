"""The FLOP and byte model of the op and the H200 ceilings the tables quote fractions of.

FLOPs per real token per head, chunk size C = 64 (the matrix products of the chunkwise form,
tiles counted densely; /work/shared/design/PERFORMANCE.md 2b):
  forward   (4n+2)KV + 6nCK + 4nCV + (2/3)nC^2
  backward  n (16KV + 16CK + 10CV + 4C^2)        (an estimate: n times the GDN backward)
Minimum HBM bytes per token per head (bf16 tensors, float32 g), a fully fused kernel:
  forward   inputs I = 2(K + nK + nV + n) + 4, plus the output 2V
  fwd+bwd   the forward, then inputs + dO read and dq, dk, dv, dbeta, dg written: 3I + 4V
Decoding step: one read and one write of the float32 state [B, HV, K, V].
The roofline time is max(FLOPs / peak FLOP/s, bytes / peak bytes/s) of the device the run
measures on (:func:`ceilings`): the H200's by default, the H100's when the device says so.
"""
from __future__ import annotations

C = 64
PEAK_FLOPS = 790e12            # dense bf16 matmul measured on the lent H200 (8192^3, torch)
PEAK_BYTES_PER_S = 4.8e12      # H200 HBM3e nominal (a device-to-device copy measured 4.3)
# the H100 SXM (80 GB HBM3): the same GH100 SMs and clocks as the H200 (its matmul peak
# taken as the H200's measured one), HBM3 at 3.35 TB/s nominal
H100_BYTES_PER_S = 3.35e12


def ceilings(device_kind: str = "") -> tuple:
    """(peak FLOP/s, peak HBM bytes/s, name) for a jax ``device_kind`` ("NVIDIA H100 80GB
    HBM3", "NVIDIA H200", ..; anything else: the H200's, the machine the tables are for)."""
    if "H100" in device_kind.upper():
        return PEAK_FLOPS, H100_BYTES_PER_S, "H100"
    return PEAK_FLOPS, PEAK_BYTES_PER_S, "H200"


def bandwidth_text(device_kind: str = "") -> str:
    """'4.8 TB/s (H200)': the HBM ceiling a table's bounds are of."""
    _, b, name = ceilings(device_kind)
    return f"{b / 1e12:.3g} TB/s ({name})"


def ceilings_text(device_kind: str = "") -> str:
    """'790 TFLOP/s, 4.8 TB/s (H200)': what a table's roofline fractions are of."""
    return f"{ceilings(device_kind)[0] / 1e12:.0f} TFLOP/s, {bandwidth_text(device_kind)}"


def _flops_fwd_token(n, K, V):
    return (4 * n + 2) * K * V + 6 * n * C * K + 4 * n * C * V + (2 / 3) * n * C * C


def _flops_bwd_token(n, K, V):
    return n * (16 * K * V + 16 * C * K + 10 * C * V + 4 * C * C)


def _input_bytes_token(n, K, V):
    return 2 * (K + n * K + n * V + n) + 4


def flops(shape, mode: str) -> float:
    """Model FLOPs of one call; ``mode`` "fwd" or "fwdbwd"."""
    per = _flops_fwd_token(shape.n, shape.K, shape.V)
    if mode == "fwdbwd":
        per += _flops_bwd_token(shape.n, shape.K, shape.V)
    return shape.B * shape.T * shape.H * per


def min_bytes(shape, mode: str) -> float:
    """Minimum HBM traffic of one call; ``mode`` "fwd" or "fwdbwd"."""
    i, o = _input_bytes_token(shape.n, shape.K, shape.V), 2 * shape.V
    per = i + o if mode == "fwd" else 3 * i + 2 * o
    return shape.B * shape.T * shape.H * per


def roofline_ms(shape, mode: str, device_kind: str = "") -> float:
    peak_f, peak_b, _ = ceilings(device_kind)
    return 1e3 * max(flops(shape, mode) / peak_f, min_bytes(shape, mode) / peak_b)


def step_state_bytes(shape) -> float:
    """Decoding step: the float32 state read once and written once."""
    return 2 * shape.B * shape.HV * shape.K * shape.V * 4


def step_bound_us(shape, device_kind: str = "") -> float:
    return 1e6 * step_state_bytes(shape) / ceilings(device_kind)[1]
