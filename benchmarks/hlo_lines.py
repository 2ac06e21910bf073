"""Name the kernels of a trace: join ``benchmarks.trace``'s table with the optimized HLO.

    python -m benchmarks.hlo_lines TRACE.log PROGRAM.hlo[.gz] [--top 40] [--by line]

``benchmarks.trace --hlo`` writes the compiled HLO next to its table of GPU time by
kernel name. Each of those names is an instruction of the HLO's entry computation (or of
a loop body); its metadata points at a stack frame, and the HLO's frame tables turn that
into the Python call stack that built it. Prints every kernel's time with its result
shape, the bandwidth its operand and result bytes would take at that time (a kernel
far below the HBM's ~4.8 TB/s that is not a matmul is worth a look) and the innermost
``gdp_jax`` source lines, then (``--by line``) the time summed
by the innermost line.
"""
from __future__ import annotations

import argparse
import collections
import gzip
import re


def _tables(text):
    """(file names, function names, locations, frames) of the HLO's stack-frame tables."""
    sections = {}
    current = None
    for line in text.splitlines():
        if line in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
            current = sections.setdefault(line, {})
            continue
        if current is None:
            continue
        m = re.match(r"^(\d+) (.*)$", line)
        if not m:
            current = None
            continue
        current[int(m.group(1))] = m.group(2)
    files = {i: s.strip('"') for i, s in sections.get("FileNames", {}).items()}
    funcs = {i: s.strip('"') for i, s in sections.get("FunctionNames", {}).items()}
    locs, frames = {}, {}
    for i, s in sections.get("FileLocations", {}).items():
        f = re.search(r"file_name_id=(\d+)", s)
        fn = re.search(r"function_name_id=(\d+)", s)
        ln = re.search(r"\bline=(\d+)", s)
        locs[i] = (files.get(int(f.group(1)), "?"), funcs.get(int(fn.group(1)), "?"),
                   int(ln.group(1)))
    for i, s in sections.get("StackFrames", {}).items():
        loc = int(re.search(r"file_location_id=(\d+)", s).group(1))
        parent = int(re.search(r"parent_frame_id=(\d+)", s).group(1))
        frames[i] = (loc, parent)
    return locs, frames


def stack(frame_id, locs, frames):
    """Innermost-first [(file, function, line)] of a stack frame id."""
    out, seen = [], set()
    while frame_id in frames and frame_id not in seen:
        seen.add(frame_id)
        loc, parent = frames[frame_id]
        out.append(locs.get(loc, ("?", "?", 0)))
        if parent == frame_id:
            break
        frame_id = parent
    return out


_BYTES = {"f64": 8, "f32": 4, "s32": 4, "u32": 4, "bf16": 2, "f16": 2, "s8": 1, "u8": 1,
          "pred": 1, "s64": 8}


def shape_bytes(shape):
    """Bytes of an HLO shape text (a tuple's elements summed)."""
    total = 0
    for dt, dims in re.findall(r"(\w+)\[([\d,]*)\]", shape):
        n = 1
        for d in filter(None, dims.split(",")):
            n *= int(d)
        total += n * _BYTES.get(dt, 4)
    return total


def instructions(text):
    """{instruction name: (result shape text, stack frame id or None, bytes read and
    written)} of every instruction in the module (bytes: its operands' shapes and its
    own, a lower bound on what a kernel for it moves)."""
    raw = {}
    for m in re.finditer(r"^\s+(?:ROOT )?%([\w.\-]+) = (.*)$", text, re.M):
        name, rest = m.group(1), m.group(2)
        shape = rest.split(" ")[0] if not rest.startswith("(") else rest[:rest.find(")") + 1]
        sf = re.search(r"stack_frame_id=(\d+)", rest)
        call = rest[len(shape):]
        args = re.findall(r"%([\w.\-]+)", call.split("), ")[0])
        raw.setdefault(name, (shape, int(sf.group(1)) if sf else None, args))
    out = {}
    for name, (shape, sf, args) in raw.items():
        moved = shape_bytes(shape) + sum(shape_bytes(raw[a][0]) for a in args if a in raw)
        out[name] = (shape, sf, moved)
    return out


def ours(st, depth=2):
    """The innermost ``depth`` frames in gdp_jax, as 'module.py:line function'."""
    rows = [f"{f.split('gdp_jax/')[-1]}:{ln} {fn}" for f, fn, ln in st if "gdp_jax/" in f]
    return rows[:depth]


def read_trace(path):
    """[(ms, calls, name)] from a ``benchmarks.trace`` table."""
    rows = []
    for line in open(path):
        m = re.match(r"^\s*([\d.]+) ms\s+(\d+)x\s+(\S+)", line)
        if m:
            rows.append((float(m.group(1)), int(m.group(2)), m.group(3)))
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("trace")
    ap.add_argument("hlo")
    ap.add_argument("--top", type=int, default=40)
    ap.add_argument("--depth", type=int, default=2)
    ap.add_argument("--by", choices=("kernel", "line"), default="kernel")
    a = ap.parse_args(argv)
    opener = gzip.open if a.hlo.endswith(".gz") else open
    with opener(a.hlo, "rt") as f:
        text = f.read()
    locs, frames = _tables(text)
    ins = instructions(text)
    rows = read_trace(a.trace)
    by_line = collections.Counter()
    for ms, calls, name in rows:
        shape, sf, moved = ins.get(name, ("?", None, 0))
        where = ours(stack(sf, locs, frames), a.depth) if sf else []
        by_line[where[0] if where else "(no gdp_jax frame)"] += ms
        if a.by == "kernel" and a.top > 0:
            a.top -= 1
            tbs = moved * calls / (ms * 1e-3) / 1e12 if ms else 0.0
            print(f"{ms:7.3f} ms {calls:4d}x {tbs:5.2f} TB/s {name[:36]:36s} {shape[:48]:48s} "
                  f"{' < '.join(where)}")
    if a.by == "line":
        for where, ms in by_line.most_common():
            print(f"{ms:7.3f} ms  {where}")
    print(f"total {sum(r[0] for r in rows):.3f} ms in {len(rows)} kernels")


if __name__ == "__main__":
    main()
