"""Registers per thread of each CuTe DSL kernel, compiled here for sm_90a (no GPU needed).

    python -m benchmarks.kernel_resources [--match gdp_chunk_prep] [--dtype bfloat16]

Occupancy on the H200 is set by registers as often as by shared memory: an SM holds 65536
32-bit registers, allocated per warp in units of 256, so a 128-thread CTA of R registers a
thread fits floor(65536 / (4 * 32 * ceil8(R))) times. This compiles each prebuilt variant
(``gdp_jax.kernels.aot``'s list, K = V = 128 unless ``--dims``) with the CuTe DSL keeping its
cubin, and reads the register count the assembler recorded in the cubin's ``.nv.info``
(attribute 0x2f, EIATTR_REGCOUNT; 0x11, the frame: spills), the launch's thread count,
how many CTAs an SM's registers hold, and the size of the machine code with a hash of it
(:func:`cubin_code_hash`).
"""
from __future__ import annotations

import argparse
import math
import os
import struct
import tempfile

EIATTR_REGCOUNT = 0x2F
EIATTR_FRAME_SIZE = 0x11       # local memory per thread (spills)


EIATTR_REQNTID = 0x10           # the launch's required threads (x, y, z)
EM_CUDA = 190


def _sections(path):
    """(cubin bytes, [(name, offset, size)] of its ELF sections); ``path``: a file name or
    the cubin's bytes."""
    b = path if isinstance(path, bytes) else open(path, "rb").read()
    shoff = struct.unpack_from("<Q", b, 0x28)[0]
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", b, 0x3A)
    secs = [struct.unpack_from("<IIQQQQIIQQ", b, shoff + i * shentsize) for i in range(shnum)]
    stroff = secs[shstrndx][4]

    def name(o):
        return b[stroff + o:b.index(b"\0", stroff + o)].decode()

    return b, [(name(s[0]), s[4], s[5]) for s in secs]


def cubin_registers(path) -> tuple[int, int]:
    """(registers, frame bytes) of the (one) kernel in a cubin (file name or bytes), from
    its .nv.info attributes (a frame above 0 means spills to local memory)."""
    found = _info(path)
    if EIATTR_REGCOUNT not in found:
        raise ValueError(f"{path if isinstance(path, str) else 'cubin'}: no register count "
                         f"in .nv.info")
    return found[EIATTR_REGCOUNT], found.get(EIATTR_FRAME_SIZE, 0)


def cubin_threads(path) -> int:
    """Threads of the kernel's launch (its required block size, EIATTR_REQNTID)."""
    x, y, z = _info(path)[EIATTR_REQNTID]
    return x * y * z


def _info(path) -> dict:
    """{attribute: value} of the cubin's .nv.info sections: REGCOUNT and FRAME_SIZE (the
    kernel's u32), REQNTID (x, y, z)."""
    b, secs = _sections(path)
    found = {}
    for name, start, size in secs:
        if not name.startswith(".nv.info"):
            continue
        p, end = start, start + size
        while p < end:
            fmt, attr = b[p], b[p + 1]
            if fmt == 4:                             # EIFMT_SVAL: u16 size, then data
                size_ = struct.unpack_from("<H", b, p + 2)[0]
                if attr in (EIATTR_REGCOUNT, EIATTR_FRAME_SIZE) and name == ".nv.info":
                    found[attr] = struct.unpack_from("<II", b, p + 4)[1]  # (function, value)
                elif attr == EIATTR_REQNTID:
                    found[attr] = struct.unpack_from("<III", b, p + 4)
                p += 4 + size_
            elif fmt in (2, 3):                      # EIFMT_BVAL / HVAL
                p += 4
            else:                                    # EIFMT_NVAL
                p += 2
    return found


def cubin_code_bytes(path) -> int:
    """Bytes of machine code (the .text sections) in a cubin: the instructions an SM
    fetches while a CTA runs (straight-line kernels fetch all of them once a CTA)."""
    return sum(size for name, _, size in _sections(path)[1] if name.startswith(".text"))


def cubin_code_hash(path) -> str:
    """A short hash of the machine code (the .text sections' bytes): equal hashes, the same
    instructions. The compile is not byte-reproducible: a kernel comes out as one of two or
    three instruction orders from run to run, so check a refactor that should not change a
    kernel on the sets of hashes of a few runs before and after."""
    import hashlib
    b, secs = _sections(path)
    h = hashlib.sha256()
    for name, start, size in secs:
        if name.startswith(".text"):
            h.update(b[start:start + size])
    return h.hexdigest()[:12]


def object_cubin(obj: bytes) -> bytes:
    """The sm_90a cubin inside a prebuilt kernel object (``gdp_jax.kernels.aot``: a host
    object that embeds its device ELF uncompressed)."""
    at = obj.find(b"\x7fELF", 1)
    while at > 0:
        if struct.unpack_from("<H", obj, at + 0x12)[0] == EM_CUDA:
            shoff = struct.unpack_from("<Q", obj, at + 0x28)[0]
            shentsize, shnum = struct.unpack_from("<HH", obj, at + 0x3A)
            return obj[at:at + shoff + shentsize * shnum]
        at = obj.find(b"\x7fELF", at + 1)
    raise ValueError("no sm_90a cubin in the object")


def store_resources(path) -> dict:
    """{label: (registers, frame bytes, threads, code KB)} of every object of a kernel
    build (``python ffi/build.py --out PATH``; labels as ``aot.label``: the kernel, its
    dtypes, tile extents and compile-time keywords) - the resources without compiling."""
    import json
    import pathlib
    path = pathlib.Path(path)
    out = {}
    for d, entry in json.loads((path / "manifest.json").read_text())["variants"].items():
        cubin = object_cubin((path / f"{d}.o").read_bytes())
        regs, frame = cubin_registers(cubin)
        out[entry["label"]] = (regs, frame, cubin_threads(cubin),
                               cubin_code_bytes(cubin) // 1024)
    return out


def ctas_by_registers(regs: int, threads: int) -> int:
    warps = -(-threads // 32)
    per_warp = -(-regs // 8) * 8 * 32
    return 65536 // (warps * per_warp)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--match", default="", help="substring of the variant names to compile")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--dims", default="K=128 V=128")
    p.add_argument("--set", action="append", default=[], metavar="MODULE.NAME=VALUE",
                   help="set a gdp_jax module constant first (as benchmarks.run's --set), "
                        "e.g. kernels.local_grad.SPLIT=True")
    a = p.parse_args(argv)

    d = tempfile.mkdtemp(prefix="gdp_cubins_")
    # the DSL reads these once; no prebuilt object may stand in for a compile
    os.environ.update(CUTE_DSL_ARCH="sm_90a", CUTE_DSL_KEEP="cubin,ptx", CUTE_DSL_DUMP_DIR=d,
                      GDP_JAX_KERNEL_SHAPES="generic", GDP_JAX_KERNEL_DIR=d + "/none")
    import importlib.util

    import jax
    from benchmarks.run import apply_settings
    apply_settings(a.set)
    spec = importlib.util.spec_from_file_location(
        "gdp_ffi_build", os.path.join(os.path.dirname(__file__), "..", "ffi", "build.py"))
    build = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(build)

    for v in build.all_variants():
        if a.match not in v.what or a.dtype not in v.what or (a.dims and a.dims not in v.what):
            continue
        for f in os.listdir(d):           # dumps of one signature reuse one file name
            os.remove(os.path.join(d, f))
        jax.jit(v.fn).trace(*v.avals).lower(lowering_platforms=("cuda",))
        new = [os.path.join(d, f) for f in os.listdir(d)]
        cubins = [f for f in new if f.endswith(".cubin")]
        ptx = [f for f in new if f.endswith(".ptx")]
        if not cubins:
            print(f"{v.what}: no cubin kept")
            continue
        regs, frame = cubin_registers(cubins[0])
        threads = 128
        for line in open(ptx[0]) if ptx else ():
            if ".reqntid" in line:          # ".reqntid 128, 1, 1"
                threads = math.prod(int(x) for x in line.split(".reqntid")[1].split(","))
                break
        print(f"{v.what}: {regs} registers x {threads} threads, frame {frame} B -> "
              f"{ctas_by_registers(regs, threads)} CTAs / SM by registers; "
              f"{cubin_code_bytes(cubins[0]) // 1024} KB of code "
              f"({cubin_code_hash(cubins[0])})", flush=True)

if __name__ == "__main__":
    main()
