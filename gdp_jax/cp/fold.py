"""The log-depth CP fold: a segmented prefix scan of the per-rank affine maps.

Every summary, forward ``[E | M]`` or backward ``[gamma | M^T]``, packs one affine map
``X -> A X + c`` as ``[c | A]`` ([.., K, V + K]). Composing ``x`` then ``y`` gives
``y o x = [A_y c_x + c_y | A_y A_x] = A_y [c_x | A_x] + [c_y | 0]``: one matrix product.
The fold of rank r is the composition of a contiguous run of ranks ending next to r, so it
is an EXCLUSIVE prefix scan in "scan order" (the forward: rank order, maps of ranks
[a, r); the backward: reversed rank order, maps of ranks (r, f) from the farthest back).

Packed sequences make it a SEGMENTED scan: a rank's map only carries a state across its
start boundary when its trailing (forward) / leading (backward) fragment continues from
the neighbour; otherwise composition must stop there (``reset``). The segmented operator
``(x, rx) + (y, ry) = (y if ry else y o x, rx | ry)`` is associative, so recursive doubling
(Hillis-Steele) works: after one shift that hands each rank its neighbour's map, rounds
d = 1, 2, 4, ... combine with the value d positions back, ceil(log2(P - 1)) rounds.
Each round a rank sends and receives ONE summary (``lax.ppermute``), against P summaries
received by the all_gather fold.

The scan is written against a ``shift(x, d)`` callback (the value of the position d
earlier in scan order) so tests run it over a leading axis of simulated ranks without
devices; :func:`ppermute_shift` is the device version. The reset flags depend only on the
global ``cu_seqlens``, so every rank computes all P of them locally: no flag travels.

Choosing the fold (docs/CP.md): with a per-round latency ``alpha`` and a per-rank receive
bandwidth ``beta``, for a summary of ``s`` bytes
    all_gather:  t = alpha + (P - 1) s / beta
    scan:        t = R(P) (alpha + s / beta),   R(P) = 1 + ceil(log2(P - 1))
and the scan wins when ``(P - 1 - R) s / beta > (R - 1) alpha``.
"""
from __future__ import annotations

import math
import os
from typing import Callable

import jax.numpy as jnp
from jax import lax

FOLDS = ("auto", "gather", "scan")
FOLD_ENV = "GDP_CP_FOLD"           # override of the fold choice: auto | gather | scan

# Cost model (docs/CP.md). ROUND_LATENCY_S is an assumption for one in-program collective
# round; RECEIVE_BYTES_PER_S is fitted to the measured 2-H200 all_gather (0.619 ms, one
# 2.10 MB summary received, benchmarks/results/history/2026-11-29) after that latency.
ROUND_LATENCY_S = 20e-6
MEASURED_GATHER_S, MEASURED_SUMMARY_BYTES = 0.619e-3, 16 * 128 * 256 * 4
RECEIVE_BYTES_PER_S = MEASURED_SUMMARY_BYTES / (MEASURED_GATHER_S - ROUND_LATENCY_S)


# --- the algebra (pure, any leading shape) --------------------------------------------------

def _bcast(flag, x):
    """flag [..] broadcast against x [.., *rest] (leading axes aligned)."""
    flag = jnp.asarray(flag)
    return flag.reshape(flag.shape + (1,) * (x.ndim - flag.ndim))


def identity_map(like):
    """[0 | I] with the shape and dtype of ``like`` [.., K, V + K]."""
    K = like.shape[-2]
    eye = jnp.eye(K, like.shape[-1], like.shape[-1] - K, dtype=like.dtype)
    return jnp.broadcast_to(eye, like.shape)


def compose(earlier, later):
    """The map ``later o earlier`` of two packed maps [.., K, V + K] (earlier applied first)."""
    K = later.shape[-2]
    V = later.shape[-1] - K
    A = later[..., V:]
    offset = jnp.concatenate([later[..., :V], jnp.zeros_like(A)], axis=-1)
    return A @ earlier + offset


def segmented_combine(earlier, later):
    """The segmented-scan operator on (map, reset) pairs: composition never crosses a reset
    (a reset element starts a new run: what came before it is dropped)."""
    (x, rx), (y, ry) = earlier, later
    return jnp.where(_bcast(ry, y), y, compose(x, y)), rx | ry


def doubling_shifts(P: int) -> tuple:
    """The shifts 1, 2, 4, .. of the doubling rounds after the first hand-over (P >= 1)."""
    n = math.ceil(math.log2(P - 1)) if P > 2 else 0
    return tuple(2 ** i for i in range(n))


def num_rounds(P: int) -> int:
    """Collective rounds of the scan fold: one hand-over plus the doubling rounds."""
    return 0 if P < 2 else 1 + len(doubling_shifts(P))


def exclusive_segmented_scan(x, resets, pos, P: int, shift: Callable):
    """The composition of the maps at positions [s, pos) in scan order, s the last reset
    position < pos (the identity at position 0).

    x: [.., K, V + K] this position's map ([P, ..] when simulating: ``pos`` then [P]).
    resets: [P] bool by scan position, the same on every rank: position j's map does not
      continue from position j - 1. pos: [] (or [P]) int32 scan position(s).
    shift(a, d): ``a`` of the position d earlier (any value at positions < d).
    """
    pos = jnp.asarray(pos, jnp.int32)
    # Hand-over: position p starts from the map of p - 1 (the exclusive scan).
    y = jnp.where(_bcast(pos >= 1, x), shift(x, 1), identity_map(x))
    flags = jnp.concatenate([jnp.ones((1,), bool), resets[:-1]])   # of y, by position
    for d in doubling_shifts(P):
        ry, rprev = flags[pos], flags[jnp.maximum(pos - d, 0)]
        yc, _ = segmented_combine((shift(y, d), rprev), (y, ry))
        y = jnp.where(_bcast(pos >= d, y), yc, y)
        flags = flags | jnp.concatenate([jnp.zeros((d,), bool), flags[:-d]])
    return y


def emulated_shift(a, d):
    """shift along a leading axis of simulated ranks (zeros where nothing arrives)."""
    return jnp.concatenate([jnp.zeros_like(a[:d]), a[:-d]], axis=0)


def ppermute_shift(cp_axis, P: int, reverse: bool):
    """shift over a mesh axis: position = rank (forward) or P - 1 - rank (``reverse``).

    The permutation is cyclic (the first d positions receive the last d values, which the
    scan ignores): ``jax.vmap`` batches only full permutations of its axis (the split's
    segments, :mod:`gdp_jax.cp.split`), and on a mesh every rank still sends and receives
    one summary a round."""
    def shift(a, d):
        pairs = [(i, (i - d) % P) for i in range(P)] if reverse else \
                [(i, (i + d) % P) for i in range(P)]
        return lax.ppermute(a, cp_axis, pairs)
    return shift


def fold_resets(continues_in, continues_out, first_seq, last_seq):
    """Per-rank reset flags [P] (rank order) from per-rank metadata of all P ranks.

    Forward: rank j's trailing fragment crosses its start only if its first sequence is
    also its last and continues in. Backward (mirror): its leading fragment crosses its
    end only if its first sequence is its last and continues out.
    first_seq, last_seq: [P, F] (one fragment, or B rows that all span every rank).
    """
    single = first_seq[:, 0] == last_seq[:, 0]
    return ~(continues_in & single), ~(continues_out & single)


# --- choosing the fold ----------------------------------------------------------------------

def gather_seconds(P: int, nbytes: int) -> float:
    if P < 2:
        return 0.0
    return ROUND_LATENCY_S + (P - 1) * nbytes / RECEIVE_BYTES_PER_S


def scan_seconds(P: int, nbytes: int) -> float:
    return num_rounds(P) * (ROUND_LATENCY_S + nbytes / RECEIVE_BYTES_PER_S)


def choose_fold(P: int, nbytes: int, requested=None) -> str:
    """'gather' or 'scan' for P ranks and summaries of ``nbytes`` bytes.

    ``requested`` (or, when None, the environment variable GDP_CP_FOLD) forces one;
    'auto' (the default) takes the cheaper by the cost model, ties to 'gather'.
    """
    src = "fold"
    if requested is None:
        src, requested = FOLD_ENV, os.environ.get(FOLD_ENV, "auto") or "auto"
    if requested not in FOLDS:
        raise ValueError(f"{src}={requested!r}; expected one of {FOLDS}")
    if requested != "auto":
        return requested
    return "scan" if scan_seconds(P, nbytes) < gather_seconds(P, nbytes) else "gather"
