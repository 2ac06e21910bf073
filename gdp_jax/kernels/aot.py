"""Kernels built ahead of time: shape-generic variant keys, the on-disk store, the runtime.

A *variant* is one compiled kernel object: the kernel name, the device-source hash, every
tensor's dtype, rank and the extents of its trailing "tile" dims (head dims, chunk length:
fixed by the variant), the compile-time keywords and the in-place aliases. The leading
dims (batch rows, chunks, heads, sequences) are NOT part of it: the object reads them from
XLA's buffer descriptors at run time, so one object serves every (B, T).

An object is what ``cutlass.jax.cutlass_call`` embeds in the HLO (an x86-64 ELF with the
host launcher and the sm_90a cubin) and the CuTe DSL runtime library's XLA FFI handlers
run. :mod:`gdp_jax.kernels.binding` compiles missing variants in-process; ``ffi/build.py``
writes every variant the kernel classes list (their ``variants()``) to a directory that
this module reads, without importing the CuTe DSL:

    <dir>/manifest.json      {"format", "cutlass_dsl", "flavor", "source_hash", "variants":
                              {digest: {"label", "fingerprint"}}}
    <dir>/<digest>.o         the object; fingerprint = sha256 of its bytes (the FFI "key")

<dir> is ``$GDP_JAX_KERNEL_DIR``, else ``ffi/build/kernels`` of this checkout.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import importlib.util
import json
import logging
import os
import pathlib
import re
import sys
import threading
from typing import NamedTuple, Optional

import jax
import jax.export

log = logging.getLogger("gdp_jax")

FORMAT = 1
ENV_DIR = "GDP_JAX_KERNEL_DIR"
_REPO = pathlib.Path(__file__).resolve().parents[2]
_RUNTIME = "libcute_dsl_runtime.so"
_lock = threading.Lock()


class Variant(NamedTuple):
    """One variant a kernel class lists: ``fn(*avals)`` calls its kernel once (abstract
    values at the canonical shape; ``what`` names it for ``ffi/build.py --only``)."""
    what: str
    fn: object
    avals: tuple


class Artifact(NamedTuple):
    """One compiled variant: the object bytes and their sha256 (the FFI handler's key)."""
    module: bytes
    fingerprint: bytes


def store_dir() -> pathlib.Path:
    """Where prebuilt variants are read from (and ``ffi/build.py`` writes by default)."""
    env = os.environ.get(ENV_DIR)
    return pathlib.Path(env) if env else _REPO / "ffi" / "build" / "kernels"


# ---------------------------------------------------------------------------- variant keys

def tensor_sig(shape, dtype, tile_dims: int) -> tuple:
    """(dtype, rank, trailing extents): what a variant fixes about one tensor. The leading
    dims may be symbolic (``jax.export``); the tile dims must be integers."""
    shape = tuple(shape)
    if not 0 <= tile_dims <= len(shape):
        raise ValueError(f"tile_dims={tile_dims} for a rank-{len(shape)} tensor")
    tail = shape[len(shape) - tile_dims:]
    if any(jax.export.is_symbolic_dim(d) for d in tail):
        raise ValueError(f"the tile dims {tail} of a kernel operand must be concrete")
    return (jax.numpy.dtype(dtype).name, len(shape), tuple(int(d) for d in tail))


def canonical_shape(sig) -> tuple:
    """The shape a variant is compiled at: extent 1 in every run-time dim."""
    _, rank, tail = sig
    return (1,) * (rank - len(tail)) + tuple(tail)


def variant_key(name: str, source_hash: str, in_sigs, out_sigs, key=(), aliases=(),
                constexprs=()) -> tuple:
    return (name, source_hash, tuple(in_sigs), tuple(out_sigs), tuple(key),
            tuple(sorted(aliases)), tuple(sorted(constexprs)))


def digest(vkey: tuple) -> str:
    """File name of a variant: sha256 of its key's repr (ints, strings, bools, tuples)."""
    return hashlib.sha256(repr(vkey).encode()).hexdigest()[:32]


def label(vkey: tuple) -> str:
    """A short readable name: kernel, dtypes, tile extents, compile-time keywords."""
    name, _, ins, _, key, _, kw = vkey
    dts = sorted({s[0] for s in ins})
    return " ".join([name, "/".join(dts)] + [str(k) for k in key]
                    + [f"{k}={v}" for k, v in kw])


# ---------------------------------------------------------------------------- the store

def cutlass_dsl_version() -> Optional[str]:
    """The installed CuTe DSL's version, read from its source (no import: that takes
    seconds), or None when it is not installed."""
    path = _cutlass_init()
    if path is None:
        return None
    m = re.search(r'^__version__\s*=\s*["\']([^"\']+)', path.read_text(), re.M)
    return m.group(1) if m else None


def _cutlass_init() -> Optional[pathlib.Path]:
    try:
        spec = importlib.util.find_spec("cutlass")
    except (ImportError, ValueError):
        return None
    return pathlib.Path(spec.origin) if spec and spec.origin else None


class Store:
    """The variants of one directory (read once; objects read on first use)."""

    def __init__(self, path: pathlib.Path, source_hash: str):
        self.path = path
        self.entries: dict[str, dict] = {}
        self.flavor: Optional[str] = None
        self.reason = self._load(source_hash)
        self._cache: dict[str, Artifact] = {}

    def _load(self, source_hash: str) -> str:
        mf = self.path / "manifest.json"
        if not mf.is_file():
            return f"no prebuilt kernels at {self.path}"
        try:
            m = json.loads(mf.read_text())
        except (OSError, ValueError) as e:
            return f"unreadable {mf} ({e})"
        if m.get("format") != FORMAT:
            return f"{mf} has format {m.get('format')}, this gdp_jax reads {FORMAT}"
        if m.get("source_hash") != source_hash:
            return (f"the prebuilt kernels at {self.path} are stale (device sources "
                    f"{m.get('source_hash')}, now {source_hash})")
        have = cutlass_dsl_version()
        if m.get("cutlass_dsl") != have:
            return (f"the prebuilt kernels at {self.path} were built by nvidia-cutlass-dsl "
                    f"{m.get('cutlass_dsl')}, installed: {have}")
        self.entries = dict(m.get("variants", {}))
        self.flavor = m.get("flavor")
        return f"{len(self.entries)} prebuilt kernels at {self.path}"

    def get(self, vkey: tuple) -> Optional[Artifact]:
        d = digest(vkey)
        if d in self._cache:
            return self._cache[d]
        entry = self.entries.get(d)
        if entry is None:
            return None
        try:
            module = (self.path / f"{d}.o").read_bytes()
        except OSError as e:
            log.warning("gdp_jax: prebuilt kernel %s unreadable (%s); compiling it",
                        entry.get("label"), e)
            return None
        fp = hashlib.sha256(module).digest()
        if fp.hex() != entry.get("fingerprint"):
            log.warning("gdp_jax: prebuilt kernel %s does not match its manifest; "
                        "compiling it", entry.get("label"))
            return None
        self._cache[d] = Artifact(module, fp)
        return self._cache[d]


_stores: dict[tuple, Store] = {}


def store(source_hash: str) -> Store:
    """The store of :func:`store_dir` (read once per directory and source hash)."""
    k = (str(store_dir()), source_hash)
    with _lock:
        if k not in _stores:
            _stores[k] = Store(store_dir(), source_hash)
            st = _stores[k]
            level = logging.INFO if st.entries or not st.path.exists() else logging.WARNING
            log.log(level, "gdp_jax cutedsl kernels: %s%s", st.reason,
                    "" if st.entries else "; compiling them at trace time "
                    "(build them once: python ffi/build.py)")
    return _stores[k]


@functools.lru_cache(maxsize=None)
def warn_missing(first_label: str) -> None:
    """Once per process: a variant is not among the prebuilt ones (later misses: DEBUG)."""
    log.warning("gdp_jax: the prebuilt cutedsl kernels lack %s; compiling it at trace time "
                "(others missing are logged at DEBUG; rebuild: python ffi/build.py)",
                first_label)


def lookup(vkey: tuple) -> Optional[Artifact]:
    """The prebuilt object of ``vkey``, or None (logged: the directory once, a missing
    variant once per process)."""
    st = store(vkey[1])
    if not st.entries:
        return None
    art = st.get(vkey)
    if art is None:
        if warn_missing.cache_info().currsize:
            log.debug("gdp_jax: no prebuilt kernel %s", label(vkey))
        else:
            warn_missing(label(vkey))
    return art


def write(path: pathlib.Path, source_hash: str, variants: dict, flavor: Optional[str]):
    """Write ``variants`` {vkey: Artifact} to ``path`` (replacing its manifest)."""
    path.mkdir(parents=True, exist_ok=True)
    entries = {}
    for vkey, art in variants.items():
        if vkey[1] != source_hash:
            raise ValueError(f"variant {label(vkey)} was compiled from other device sources")
        d = digest(vkey)
        (path / f"{d}.o").write_bytes(art.module)
        entries[d] = {"label": label(vkey), "fingerprint": art.fingerprint.hex()}
    manifest = {"format": FORMAT, "cutlass_dsl": cutlass_dsl_version(), "flavor": flavor,
                "arch": os.environ.get("CUTE_DSL_ARCH"), "source_hash": source_hash,
                "jax": jax.__version__, "python": sys.version.split()[0],
                "variants": dict(sorted(entries.items(), key=lambda kv: kv[1]["label"]))}
    tmp = path / "manifest.json.tmp"
    tmp.write_text(json.dumps(manifest, indent=1) + "\n")
    tmp.replace(path / "manifest.json")
    for old in path.glob("*.o"):        # objects of an earlier build
        if old.stem not in entries:
            old.unlink()


def harvest(lowered) -> tuple[str, Artifact]:
    """(FFI target, object) of the one CuTe DSL custom call in a ``jax.stages.Lowered``."""
    found = []

    def walk(op):
        for region in op.regions:
            for block in region.blocks:
                for o in block.operations:
                    if o.name == "stablehlo.custom_call":
                        target = str(o.attributes["call_target_name"]).strip('"')
                        if target.startswith("CuteDSLRT_"):
                            cfg = o.attributes["mhlo.backend_config"]
                            found.append((target, Artifact(cfg["module"].value_bytes,
                                                           cfg["key"].value_bytes)))
                    walk(o)

    walk(lowered.compiler_ir("stablehlo").operation)
    if len(found) != 1:
        raise RuntimeError(f"expected one CuTe DSL custom call, found {len(found)}")
    return found[0]


# ---------------------------------------------------------------------------- the runtime

def ffi_version() -> int:
    """The CuTe DSL runtime's FFI handler generation this JAX takes (the DSL's rule)."""
    return 2 if jax.version.__version_info__ >= (0, 9, 1) else 1


def target_name() -> str:
    return f"CuteDSLRT_NvJaxCutlassCall_v{ffi_version()}"


def runtime_library(flavor: Optional[str] = None) -> Optional[pathlib.Path]:
    """The CuTe DSL runtime library (``$CUTE_DSL_LIBS`` first, else next to the installed
    DSL; ``flavor``: "cu13" or "cu12", the one that compiled the objects)."""
    for lib in os.environ.get("CUTE_DSL_LIBS", "").split(":"):
        if lib.endswith("cute_dsl_runtime.so") and os.path.isfile(lib):
            return pathlib.Path(lib)
    init = _cutlass_init()
    if init is None:
        return None
    root = next((p for p in init.parents if p.name == "nvidia_cutlass_dsl"), None)
    if root is None:
        return None
    for fl in ([flavor] if flavor else []) + ["cu13", "cu12"]:
        lib = root / fl / "lib" / _RUNTIME
        if lib.is_file():
            return lib
    return None


def _stages(version: int):
    ex = f"CuteDSLRT_NvJaxCutlassCallExecute_v{version}"
    stages = {"prepare": f"CuteDSLRT_NvJaxCutlassCallPrepare_v{version}", "execute": ex}
    if version == 2:
        stages["instantiate"] = "CuteDSLRT_NvJaxCutlassCallInstantiate_v2"
    return stages


_registered: list[str] = []


def register_runtime(flavor: Optional[str] = None) -> None:
    """Register the runtime library's FFI handlers for :func:`target_name` (once; through
    the DSL when it is already imported, so the two never register twice)."""
    with _lock:
        if _registered:
            return
        if "cutlass.jax" in sys.modules:
            import cutlass.jax.ffi as cffi
            cffi.register_ffi(ffi_version())
            _registered.append("cutlass")
            return
        lib_path = runtime_library(flavor)
        if lib_path is None:
            raise RuntimeError("gdp_jax: prebuilt cutedsl kernels need the CuTe DSL runtime "
                               f"library ({_RUNTIME} of nvidia-cutlass-dsl); not found")
        lib = ctypes.CDLL(str(lib_path))

        def capsule(sym, call=False):
            fn = getattr(lib, sym)
            fn.restype = ctypes.c_void_p
            return jax.ffi.pycapsule(fn() if call else fn)

        version = ffi_version()
        if version == 2:
            jax.ffi.register_ffi_type(
                "CuteDSLRT_NvJaxCutlassCallTypes_v2",
                {"type_id": capsule("CuteDSLRT_NvJaxCutlassCallStateTypeId_v2", True),
                 "type_info": capsule("CuteDSLRT_NvJaxCutlassCallStateTypeInfo_v2", True)},
                platform="CUDA")
        jax.ffi.register_ffi_target(target_name(), {k: capsule(v) for k, v in
                                                    _stages(version).items()},
                                    platform="CUDA")
        _registered.append(str(lib_path))


def note_cutlass_imported() -> None:
    """After ``import cutlass.jax``: tell the DSL what this module already registered
    (else its first ``cutlass_call`` registers the same targets again)."""
    if not _registered or _registered[0] == "cutlass":
        return
    import cutlass.jax.ffi as cffi
    cffi._REGISTERED_FFI_CALL_TARGETS.add(target_name())
    if ffi_version() == 2:
        cffi._REGISTERED_FFI_TYPES.add("CuteDSLRT_NvJaxCutlassCallTypes_v2")
