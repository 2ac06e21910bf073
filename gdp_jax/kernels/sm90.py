"""Shared device-side building blocks of the sm_90a chunk kernels (``chunk_fwd_sm90``,
``chunk_bwd_sm90``).

Both kernels run the same machinery: 16-bit operand tiles in swizzled shared memory,
128-bit cp.async loads of them from global memory, SM80-style warp MMA (mma.sync
m16n8k16, 4 warps split M, float32 accumulators) fed through ldmatrix, and float32
accumulators written back to shared memory as 16-bit MMA operands, optionally split into
hi + lo parts. These helpers are plain Python run at trace time: each call emits its CuTe
ops in place, as if written out in the kernel. Every compile key carries a hash of all
device sources, this file included (:func:`gdp_jax.kernels.binding.device_source_hash`).

Shapes: ``C`` is the chunk length (steps), tiles are row-major [rows, cols] of the 16-bit
operand dtype ``ab`` unless a docstring says otherwise.

This module imports cutlass; import it only from the kernel modules (lazily).
"""
from __future__ import annotations

import dataclasses

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass.cute.nvgpu import OperandMajorMode, cpasync, warp, warpgroup

C = 64             # chunk length (steps); equals gdp_jax.grid.CHUNK
NUM_THREADS = 128  # 4 warps per CTA
MMA_K = 16         # the K extent of one mma.sync (one k-block of the operand fragments)
# rows of qg, P and o a chunk where only the read-out rows are kept (n >= 2 sub-steps a
# token: rows n - 1, 2n - 1, .., C // n <= 32 of them; the rest of the 32 are padding)
READOUT_ROWS = 32   # equals gdp_jax.grid.READOUT_ROWS


def ab_type(ab_name: str):
    """The CuTe dtype of a 16-bit operand dtype name ("bfloat16" or "float16")."""
    return {"bfloat16": cutlass.BFloat16, "float16": cutlass.Float16}[ab_name]


# ------------------------------------------------------------------ host side (in @cute.jit)
def smem_layout(rows: int, cols: int):
    """Swizzled row-major [rows, cols] 16-bit smem tile (cols a multiple of 16, rows of 8):
    conflict-free ldmatrix and 128-bit cp.async. The swizzle XORs row bits into the 16-byte
    unit of a row, so the 8 rows one ldmatrix reads land in 8 different 16-byte bank
    groups: 3 bits for 128-byte rows (64 columns), 2 for 64-byte, 1 for 32-byte rows
    (rows r and r + 4 swap their two units)."""
    assert cols % 16 == 0 and rows % 8 == 0
    w = 64 if cols % 64 == 0 else 32 if cols % 32 == 0 else 16
    atom = cute.make_composed_layout(
        cute.make_swizzle({64: 3, 32: 2, 16: 1}[w], 3, 3), 0,
        cute.make_layout((8, w), stride=(w, 1)))
    return cute.tile_to_shape(atom, (rows, cols), (0, 1))


def smem_tile(ab, layout, count: int = 1):
    """A ``cute.struct`` field holding ``count`` ``ab`` tiles of ``layout`` back to back
    (1024-byte aligned, as the 8-row swizzle atom needs; :func:`own_tile` picks one)."""
    return cute.struct.Align[cute.struct.MemRange[ab, count * cute.cosize(layout)], 1024]


def g2s_copy(ab, cols: int, threads: int = NUM_THREADS):
    """Tiled copy gmem -> smem of [*, cols] ``ab`` tiles by ``threads`` threads: 128-bit
    cp.async (8 elements), one row per cols/8 threads."""
    atom = cute.make_copy_atom(cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL),
                               ab, num_bits_per_copy=128)
    tpr = cols // 8
    return cute.make_tiled_copy_tv(
        atom, cute.make_layout((threads // tpr, tpr), stride=(tpr, 1)),
        cute.make_layout((1, 8)))


def warp_mma(ab, warps_n: int = 1):
    """Tiled warp MMA: mma.sync m16n8k16 on ``ab`` operands with float32 accumulation, 4
    warps stacked along M (NUM_THREADS // 32) times ``warps_n`` along N (warp w at
    M index w % 4, N index w // 4; one step of the tiled MMA: M, N, K = 64,
    16 warps_n, 16)."""
    return cute.make_tiled_mma(
        warp.MmaF16BF16Op(ab, cutlass.Float32, (16, 8, 16)),
        (NUM_THREADS // 32, warps_n, 1),
        permutation_mnk=(NUM_THREADS // 32 * 16, 16 * warps_n, 16),
    )


def warp_mma_rows(ab, BV: int):
    """Tiled warp MMA of the [READOUT_ROWS, BV] products: 2 warps along M times 2 along N
    (warp w at M index w % 2, N index w // 2; one step: M, N, K = 32, min(BV, 32), 16, so
    a warp holds 16 columns of a step, 8 at BV = 16 - see :func:`ldmatrix_copies`)."""
    return cute.make_tiled_mma(
        warp.MmaF16BF16Op(ab, cutlass.Float32, (16, 8, 16)), (2, 2, 1),
        permutation_mnk=(READOUT_ROWS, min(BV, 32), 16))


# ---------------------------------------------------------------- device side (in @cute.kernel)
def zero_below(copy, t, rows: int, cols: int, ab):
    """``copy``'s (:func:`g2s`) partition of the top ``rows`` rows of the smem tile ``t``
    [2 rows, cols], after this thread zeroed its share of the rows below: a tile that a
    [C, *] warpgroup MMA reads whole, of which only ``rows`` rows are loaded."""
    top, bottom = (copy.dest(cute.local_tile(t, (rows, cols), (i, 0))) for i in (0, 1))
    for e in range(cute.size(bottom)):
        bottom[e] = cutlass.Float32(0.0).to(ab)
    return top


def top_rows_view(g, cols: int):
    """A [C, cols] view of the row-major gmem rows ``g`` [rows, cols] (rows < C) for a
    [C, *] accumulator's :func:`c_tile`: only the warps holding accumulator rows < rows
    (warps < rows // 16) may store through it."""
    return cute.make_tensor(g.iterator, cute.make_layout((C, cols), stride=(cols, 1)))


def own_tile(field, layout, grp, pairs: int):
    """The tile of ``layout`` that 4-warp group ``grp`` owns in the smem ``field`` (a
    ``smem_tile`` of ``pairs`` tiles; each a multiple of the 1024-byte swizzle atom, so
    every tile keeps the alignment the swizzle and 128-bit accesses need)."""
    if pairs == 1:
        return field.get_tensor(layout)
    n = cute.cosize(layout)
    return cute.make_tensor(field.data_ptr() + cute.assume(grp * n, divby=n), layout)


def tile_group(tidx, vt, pairs: int):
    """(group, thread index within the group, value tile) of a walk CTA of ``pairs``
    4-warp groups on as many adjacent value tiles (block x index ``vt``): each group's
    MMA and store partitions are those of a one-tile CTA of NUM_THREADS threads."""
    if pairs == 1:
        return 0, tidx, vt
    grp = tidx // NUM_THREADS
    return grp, tidx % NUM_THREADS, vt * pairs + grp


def transpose_view(t, rows: int, cols: int):
    """View of a [rows, cols] smem tensor as [cols, rows] (no data movement)."""
    return cute.composition(t, cute.make_layout((cols, rows), stride=(rows, 1)))


# The local-gradient and operands kernels' gmem tensors with 32-bit strides in the
# shape-generic objects (``offsets32``): 6-7 KB less machine code each; fwd+bwd 8.60 ->
# 8.41 ms at (8, 4096, 16, 2) on prebuilt objects (H100, s35-2: benchmarks/results/
# CURRENT.md). Its value is part of every compile key (it is in this file's source hash).
OFFSETS32 = True


def offsets32(t):
    """With :data:`OFFSETS32`, the compact row-major gmem tensor ``t`` with strides built
    from its extents (else ``t`` as it is): where the extents are dynamic (the
    shape-generic objects) the strides are 32-bit products of them, so the kernel's
    offsets are 32-bit arithmetic instead of 64-bit multiply-adds of 64-bit stride
    parameters (as the per-shape objects' constant strides already are; every kernel
    keeps its tensors below 2^31 elements, ``binding.MAX_ELEMS``). Static extents give the
    same static strides. Host side (a kernel's ``__call__``)."""
    if not OFFSETS32:
        return t
    strides, acc = [], 1
    for e in reversed(t.shape):
        strides.append(acc)
        acc = acc * e
    layout = cute.make_layout(t.shape, stride=tuple(reversed(strides)))
    return cute.make_tensor(t.iterator, layout)


def make_acc(thr_mma, shape):
    """This thread's float32 accumulator fragment of an MMA result tile of ``shape``
    [M, N] (registers, uninitialised)."""
    return cute.make_rmem_tensor(thr_mma.partition_shape_C(shape), cutlass.Float32)


def c_tile(thr_mma, m, shape, coord):
    """This thread's elements, in accumulator layout, of the ``shape`` tile at tile
    coordinate ``coord`` of the 2-D gmem tensor ``m`` (load() / store() it)."""
    return thr_mma.partition_C(cute.local_tile(m, shape, coord))


def c_tile_or_zero(thr_mma, m, shape, vt, tiles: int):
    """:func:`c_tile` at column tile ``vt`` of ``m``, which holds ``tiles`` column tiles,
    loaded as float32 - and 0 for ``vt >= tiles`` (it then reads the last tile, in bounds
    and finite, and multiplies by 0): state columns an operand leaves out are 0."""
    x = c_tile(thr_mma, m, shape, (0, cutlass.min(vt, tiles - 1))).load().to(cutlass.Float32)
    return x * cutlass.select_(vt < tiles, cutlass.Float32(1.0), cutlass.Float32(0.0))


def ldmatrix_copies(tiled_mma, ab, tidx, b_matrices: int = 4):
    """This thread's ldmatrix copies smem -> MMA fragments: (A from a K-major tile,
    A from an M-major tile (transposed load), both x4, B from an N-major view (transposed
    load; x``b_matrices``: 2 where a warp holds 8 columns of a step of the tiled MMA))."""
    ldsm = cute.make_copy_atom(warp.LdMatrix8x8x16bOp(transpose=False, num_matrices=4), ab)
    ldsm_t = cute.make_copy_atom(warp.LdMatrix8x8x16bOp(transpose=True, num_matrices=4), ab)
    ldsm_b = ldsm_t if b_matrices == 4 else cute.make_copy_atom(
        warp.LdMatrix8x8x16bOp(transpose=True, num_matrices=b_matrices), ab)
    return (cute.make_tiled_copy_A(ldsm, tiled_mma).get_slice(tidx),
            cute.make_tiled_copy_A(ldsm_t, tiled_mma).get_slice(tidx),
            cute.make_tiled_copy_B(ldsm_b, tiled_mma).get_slice(tidx))


def readout_operands(tiled_mma_o, tidx, ab, K: int, BV: int, sS, sSl, sD, sDl):
    """The o products' side of a walk on the read-out rows (tiled MMA ``warp_mma_rows``):
    (this thread's MMA slice, its A ldmatrix copy for qg / P tiles, and the B operands S,
    S lo, Delta, Delta lo read from the walk's smem tiles ``sS`` [K, BV], ``sD`` [C, BV]
    in this tiling's partition; ldmatrix x2 where a warp holds 8 columns, BV = 16)."""
    thr = tiled_mma_o.get_slice(tidx)
    cA, _, cBt = ldmatrix_copies(tiled_mma_o, ab, tidx, 2 if BV < 32 else 4)
    view = lambda t, rows: operand(thr, cBt, transpose_view(t, rows, BV), False)
    return thr, cA, view(sS, K), view(sSl, K), view(sD, C), view(sDl, C)


# The three helpers below are frozen dataclasses: the DSL's dynamic loops treat an object
# whose method is called in the loop body as loop-carried state unless it is a frozen
# dataclass (read-only), and these hold only trace-time views.

L2_EPS = 1e-6       # gdp_jax.reference.L2_EPS (this module must not import jax)


def l2_normalize_rows(r, t, lanes: int, pieces: int, ab, row_scale=None, crd=None,
                      group: int = 4):
    """The in-op L2 norm of the rows a thread holds 8 columns of (``r``: registers, ``t``:
    their smem tile, both overwritten with the 16-bit normalised values; the first
    ``pieces`` of them, a ``g2s_copy`` partition: a row spread over ``lanes`` consecutive
    lanes, which reduce by butterfly shuffles): x / m rsqrt(sum (x / m)^2 + eps / m^2)
    with m = max |x| where > 1, else 1 - ``gdp_jax.reference.l2_normalize``. Every kernel
    that normalises rows this way gets the same bits for the same row (the same sums in
    the same order). ``row_scale`` (an smem vector [rows], with ``crd`` the partition's
    coordinates): the row's factor 1 / |row| (``gdp_jax.reference.l2_norm_scale``), stored
    by every lane of the row (the same value).

    Each step runs for ``group`` pieces before the next (their shuffles issue back to
    back): one piece after another, a thread waited out every shuffle's and the rsqrt's
    latency in turn; all of a thread's pieces at once would hold more registers than the
    operands kernel has (spills)."""
    for g0 in range(0, pieces, group):
        _l2_normalize_pieces(r, t, lanes, range(g0, min(pieces, g0 + group)), ab, row_scale,
                             crd)


def _l2_normalize_pieces(r, t, lanes, ms, ab, row_scale, crd):
    """:func:`l2_normalize_rows` of the pieces ``ms``, step by step over all of them."""
    F32 = cutlass.Float32
    rounds = range(lanes.bit_length() - 1)
    mx = {m: F32(0.0) for m in ms}
    for m in ms:
        for e in range(8 * m, 8 * m + 8):
            mx[m] = cute.arch.fmax(mx[m], cute.math.absf(r[e].to(F32)))
    for sh in rounds:
        for m in ms:
            mx[m] = cute.arch.fmax(mx[m], cute.arch.shuffle_sync_bfly(mx[m], offset=1 << sh))
    # NaN anywhere in the row: |x| comparisons skip it, the sum below does not
    inv = {m: pick(mx[m] > F32(1.0), F32(1.0) / mx[m], F32(1.0)) for m in ms}
    ss = {m: F32(0.0) for m in ms}
    for m in ms:
        for e in range(8 * m, 8 * m + 8):
            y = r[e].to(F32) * inv[m]
            ss[m] = ss[m] + y * y
    for sh in rounds:
        for m in ms:
            ss[m] = ss[m] + cute.arch.shuffle_sync_bfly(ss[m], offset=1 << sh)
    for m in ms:
        d = inv[m] * cute.math.rsqrt(ss[m] + F32(L2_EPS) * (inv[m] * inv[m]))
        for e in range(8 * m, 8 * m + 8):
            y = (r[e].to(F32) * d).to(ab)
            r[e] = y
            t[e] = y
        if row_scale is not None:
            row_scale[crd[8 * m][0]] = d        # every lane of the row: the same value


@dataclasses.dataclass(frozen=True)
class Operand:
    """One MMA operand of this thread: its register fragment ``frag`` and the ldmatrix copy
    that fills it from an smem view, one k-block of MMA_K at a time: ``op.load(kb)``, then
    ``op[kb]`` (see ``mma_split_b``). Build it with ``operand``."""
    copy: object
    src: object
    dst: object
    frag: object

    def load(self, kb: int):
        cute.copy(self.copy, self.src[None, None, kb], self.dst[None, None, kb])

    def __getitem__(self, kb: int):
        return self.frag[None, None, kb]


def operand(thr_mma, copy, s, is_a: bool) -> Operand:
    """The A (``is_a``: ``s`` is [M, K]) or B (``s`` is [N, K]) operand read from the smem
    view ``s`` by the ldmatrix thread copy ``copy`` (one of ``ldmatrix_copies``)."""
    if is_a:
        frag = thr_mma.make_fragment_A(thr_mma.partition_A(s))
    else:
        frag = thr_mma.make_fragment_B(thr_mma.partition_B(s))
    return Operand(copy, copy.partition_S(s), copy.retile(frag), frag)


def mma_split_b(tiled_mma, k_blocks: int, products, b: Operand, b_lo: Operand, split: bool,
                plain=()):
    """Warp MMAs over ``k_blocks`` k-blocks of MMA_K: acc += a B for each (acc, a) of
    ``products``, where the B operand (shared by all) is ``b``, plus ``b_lo`` in split mode
    (each product done again with the lo part); first acc += a b2 for each (acc, a, b2) of
    ``plain`` (a B operand that is not split). Per k-block, in this order: ldmatrix of the
    A operands (plain's, then products'), of the B operands (plain's, then ``b``), the
    MMAs, then in split mode ldmatrix of ``b_lo`` and its MMAs."""
    for kb in range(k_blocks):
        for _, a, _ in plain:
            a.load(kb)
        for _, a in products:
            a.load(kb)
        for _, _, b2 in plain:
            b2.load(kb)
        b.load(kb)
        for acc, a, b2 in plain:
            cute.gemm(tiled_mma, acc, a[kb], b2[kb], acc)
        for acc, a in products:
            cute.gemm(tiled_mma, acc, a[kb], b[kb], acc)
        if split:
            b_lo.load(kb)
            for acc, a in products:
                cute.gemm(tiled_mma, acc, a[kb], b_lo[kb], acc)


@dataclasses.dataclass(frozen=True)
class RegOperand:
    """An MMA operand already in registers (``frag`` [values, tiles, k-blocks]): the
    ``Operand`` interface of ``mma_split_b`` with nothing to load."""
    frag: object

    def load(self, kb: int):
        pass

    def __getitem__(self, kb: int):
        return self.frag[None, None, kb]


def pick(cond, x, y):
    """float32 ``x if cond else y`` (a select: the unpicked value's inf or NaN never
    leaks, as it would through arithmetic masking)."""
    return cutlass.Float32(cutlass.select_(cond, x, y))


@dataclasses.dataclass(frozen=True)
class G2S:
    """This thread's part of a ``g2s_copy`` (build it with ``g2s``): ``dest(s)`` partitions
    an smem tile once, ``load(g, shape, dst)`` starts the cp.async of the whole ``shape``
    tile of the 2-D gmem tensor ``g`` into it (then cute.arch.cp_async_commit_group /
    cp_async_wait_group)."""
    copy: object
    thr: object

    def dest(self, s):
        return self.thr.partition_D(s)

    def load(self, g, shape, dst):
        cute.copy(self.copy, self.thr.partition_S(cute.local_tile(g, shape, (0, 0))), dst)


def g2s(tiled_copy, tidx) -> G2S:
    """This thread's ``G2S`` of the tiled copy ``tiled_copy`` (a ``g2s_copy``)."""
    return G2S(tiled_copy, tiled_copy.get_slice(tidx))


@dataclasses.dataclass(frozen=True)
class AccToSmem:
    """Writes accumulator-layout values of one tile shape to 16-bit smem tiles of that
    shape (an MMA operand of the next product) through a 16-bit register fragment ``r16``
    (build it with ``acc_to_smem``). ``dest(s)`` partitions an smem tile once; ``store``
    writes an ``ab`` value; ``store_split`` writes a float32 value x as hi = ab(x) and, with
    ``split``, lo = ab(x - hi) (the split store: hi + lo carries x to ~2^-16 relative)."""
    ab: object
    r16: object
    atom: object
    thr: object
    src: object

    def dest(self, s):
        return self.thr.partition_D(s)

    def store(self, x16, dst):
        self.r16.store(x16)
        cute.copy(self.atom, self.src, dst)

    def store_split(self, x, dst_hi, dst_lo, split: bool):
        hi = x.to(self.ab)
        self.store(hi, dst_hi)
        if split:
            self.store((x - hi.to(cutlass.Float32)).to(self.ab), dst_lo)


def acc_to_smem(tiled_mma, tidx, acc, ab) -> AccToSmem:
    """The ``AccToSmem`` of the tiles shaped like the accumulator fragment ``acc``."""
    r16 = cute.make_fragment_like(acc, ab)
    atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), ab)
    thr = cute.make_tiled_copy_C(atom, tiled_mma).get_slice(tidx)
    return AccToSmem(ab, r16, atom, thr, thr.retile(r16))


@dataclasses.dataclass(frozen=True)
class Recurrent:
    """A recursion walk's two recurrent tiles (built by ``recurrent``): the [K, BV] state
    (or state gradient) and the [C, BV] Delta (or -dDelta) as float32 accumulators
    ``acc_S``, ``acc_D``; their 16-bit smem copies as B operands ``S``, ``D`` (and the lo
    parts ``Sl``, ``Dl``, the same tiles as ``S``, ``D`` unless ``split``); the writers
    ``toS``, ``toD`` and their smem destinations ``tCsS``, ``tCsSl``, ``tCsD``, ``tCsDl``."""
    acc_S: object
    acc_D: object
    S: Operand
    Sl: Operand
    D: Operand
    Dl: Operand
    toS: AccToSmem
    toD: AccToSmem
    tCsS: object
    tCsSl: object
    tCsD: object
    tCsDl: object


def recurrent(tiled_mma, thr_mma, tidx, cBt, ab, st, sS_layout, sD_layout, K: int, BV: int,
              split: bool) -> Recurrent:
    """The :class:`Recurrent` tiles of a walk whose shared-memory struct ``st`` holds
    ``sS``, ``sD`` (and ``sSl``, ``sDl`` with ``split``); ``acc_S`` starts at zero."""
    sS = st.sS.get_tensor(sS_layout)
    sD = st.sD.get_tensor(sD_layout)
    sSl, sDl = sS, sD
    if split:
        sSl = st.sSl.get_tensor(sS_layout)
        sDl = st.sDl.get_tensor(sD_layout)
    acc_S = make_acc(thr_mma, (K, BV))
    acc_D = make_acc(thr_mma, (C, BV))
    acc_S.fill(0.0)
    view = lambda s, rows: operand(thr_mma, cBt, transpose_view(s, rows, BV), False)
    toS = acc_to_smem(tiled_mma, tidx, acc_S, ab)
    toD = acc_to_smem(tiled_mma, tidx, acc_D, ab)
    return Recurrent(acc_S, acc_D, view(sS, K), view(sSl, K), view(sD, C), view(sDl, C),
                     toS, toD, toS.dest(sS), toS.dest(sSl), toD.dest(sD), toD.dest(sDl))


def chunk_scalars():
    """Registers for one chunk's scalars, loaded a chunk early by ``load_chunk_scalars``:
    (int32 [seq, reset, last], float32 [decay])."""
    return (cute.make_rmem_tensor((3,), cutlass.Int32),
            cute.make_rmem_tensor((1,), cutlass.Float32))


def load_chunk_scalars(scalars, mSeq, mReset, mLast, mDecay, b, c, hv):
    """Chunk c's sequence index, reset and last flags ([B, NC] int32) and decay
    ([B, NC, HV] float32) into ``scalars`` (a ``chunk_scalars`` pair)."""
    si, sf = scalars
    si[0] = mSeq[b, c]
    si[1] = mReset[b, c]
    si[2] = mLast[b, c]
    sf[0] = mDecay[b, c, hv]


# ------------------------------ warpgroup MMAs (wgmma): the walks, the operands kernel
def wg_tiled(ab, BV: int, a_k_major: bool, b_k_major: bool = False, reg_a: bool = False,
             warpgroups: int = 1):
    """A CTA's warpgroup MMA (its 4 warps as one warpgroup, m64 nBV k16, float32
    accumulators): A [64-row blocks, K] K-major (read as stored) or M-major (the [K', M]
    tile read transposed), from registers with ``reg_a``; B [BV, K] N-major (a [K, BV]
    tile read transposed) or with ``b_k_major`` K-major (a [BV, K] tile as stored). Its
    accumulator partition is the same for every operand mode and source, so one set of
    accumulators, c_tile and acc_to_smem serves them all (and it gives a thread the rows
    of the 4-warp warp MMAs' accumulators: rows r and r + 8 of its warp's 16).
    ``warpgroups`` = 2: a CTA of two warpgroups, each taking half of BV (m64 n(BV/2))."""
    mode = lambda k: OperandMajorMode.K if k else OperandMajorMode.MN
    t = sm90_utils.make_trivial_tiled_mma(
        ab, ab, mode(a_k_major), mode(b_k_major), cutlass.Float32, (1, warpgroups, 1),
        tiler_mn=(C, BV // warpgroups),
        a_source=warpgroup.OperandSource.RMEM if reg_a else warpgroup.OperandSource.SMEM)
    t.set(warpgroup.Field.ACCUMULATE, True)          # every product adds to its acc
    return t


def gmma_view(t, rows: int, cols: int, k_major: bool, ab):
    """The 16-bit smem tile ``t`` [rows, cols] (:func:`smem_layout`: rows of ``cols``
    elements, 128 / 64 / 32-byte swizzle by the row width) as a wgmma operand tensor:
    [rows, cols] K-major, else [cols, rows] (read transposed: M- or N-major) - the same
    bytes, the swizzle moved onto the pointer where the descriptors read it."""
    w = 64 if cols % 64 == 0 else 32 if cols % 32 == 0 else 16
    A = warpgroup.SmemLayoutAtomKind
    kind = ({64: A.K_SW128, 32: A.K_SW64, 16: A.K_SW32} if k_major
            else {64: A.MN_SW128, 32: A.MN_SW64, 16: A.MN_SW32})[w]
    shape, order = ((rows, cols), (0, 1)) if k_major else ((cols, rows), (1, 0))
    lay = cute.tile_to_shape(warpgroup.make_smem_layout_atom(kind, ab), shape, order)
    return cute.make_tensor(cute.recast_ptr(t.iterator, lay.inner, ab), lay.outer)


def wg_operand(tiled, thr, t, rows: int, cols: int, k_major: bool, is_a: bool, ab):
    """The wgmma fragment (descriptors) of the ``ab`` smem tile ``t`` [rows, cols] as the
    A (``is_a``) or B operand of ``tiled`` (its slice ``thr``); ``k_major`` as
    :func:`gmma_view`."""
    v = gmma_view(t, rows, cols, k_major, ab)
    if is_a:
        return tiled.make_fragment_A(thr.partition_A(v))
    return tiled.make_fragment_B(thr.partition_B(v))


def wg_products(groups, kb_outer: bool = False):
    """acc += A B for each (tiled, k_blocks, [(acc, A fragment, B fragment), ...]) group,
    all issued as one committed wgmma group and waited for (the accumulators' and register
    A operands' last writes by other instructions fenced first). Groups in turn; within a
    group product after product, or with ``kb_outer`` per k-block the products in order -
    :func:`mma_split_b`'s order, so that an accumulator two products share sums its terms
    as the warp MMAs do (the same bits)."""
    warpgroup.fence()
    for tiled, k_blocks, products in groups:
        if kb_outer:
            for kb in range(k_blocks):          # (a trace-time helper: unrolled)
                for acc, a, b in products:
                    cute.gemm(tiled, acc, a[None, None, kb], b[None, None, kb], acc)
        else:
            for acc, a, b in products:
                for kb in range(k_blocks):
                    cute.gemm(tiled, acc, a[None, None, kb], b[None, None, kb], acc)
    warpgroup.commit_group()
    warpgroup.wait_group(0)


def barrier(gmma: bool):
    """A CTA barrier; with ``gmma`` a proxy fence first, so that what cp.async and the
    threads' stores wrote to smem is what the wgmma descriptors read (async proxy)."""
    if gmma:
        cute.arch.fence_view_async_shared()
    cute.arch.sync_threads()
