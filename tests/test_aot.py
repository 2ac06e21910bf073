"""Prebuilt (ahead-of-time) cutedsl kernels, on a host without a GPU.

ffi/build.py builds two variants (the WY inverse, one decoding step) into a temporary
directory; lowering for cuda must then take their objects - no CuTe DSL compile, not even
its import - at any batch size, emit exactly the program the in-process compile emits,
and fall back (saying so once) for variants that are missing, stale or corrupt.
"""
import hashlib
import importlib.util
import json
import logging
import os
import pathlib
import shutil
import subprocess
import sys

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")   # must precede `import cutlass`

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import pytest  # noqa: E402

pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl is not installed (the 'kernels' extra)")

from gdp_jax.kernels import aot, binding, wy_inverse  # noqa: E402
from gdp_jax.kernels.step import StepKernel  # noqa: E402

REPO = pathlib.Path(__file__).resolve().parents[1]
S = jax.ShapeDtypeStruct
ONLY = ("gdp_wy_inverse_sm90", "gdp_step_sm90 K=64 V=64 n=1")


def _env():
    env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    env["GDP_JAX_KERNEL_SHAPES"] = "generic"
    return env


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    out = tmp_path_factory.mktemp("kernels")
    cmd = [sys.executable, str(REPO / "ffi" / "build.py"), "--out", str(out)]
    for o in ONLY:
        cmd += ["--only", o]
    r = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    return out


@pytest.fixture
def fresh(monkeypatch):
    """No variant compiled or read yet in this process (restored afterwards)."""
    saved = dict(binding._compiled)
    binding._compiled.clear()
    aot._stores.clear()
    aot.warn_missing.cache_clear()
    jax.clear_caches()
    monkeypatch.setenv("GDP_JAX_KERNEL_SHAPES", "generic")   # auto would be static here
    yield monkeypatch
    binding._compiled.clear()
    binding._compiled.update(saved)
    aot._stores.clear()
    aot.warn_missing.cache_clear()


def _no_compile(monkeypatch):
    def boom(*a, **k):
        raise AssertionError("a kernel was compiled")
    monkeypatch.setattr(binding, "_compile", boom)
    monkeypatch.setattr(binding, "import_cutlass", boom)


def _lower(fn, *avals):
    # a fresh function each time: JAX's trace cache must not hide the kernel call
    return jax.jit(lambda *a: fn(*a)).trace(*avals).lower(lowering_platforms=("cuda",))


def _step_avals(B, HV, n, K, V):
    f = lambda *s: S(s, jnp.float32)
    return f(B, HV, K), f(B, HV, n, K), f(B, HV, n, V), f(B, HV, n), f(B, HV), f(B, HV, K, V)


def _load_build_script():
    spec = importlib.util.spec_from_file_location("gdp_ffi_build", REPO / "ffi" / "build.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_build_lists_every_kernel_class():
    build = _load_build_script()
    names = {c.__name__ for c in build.kernel_classes()}
    assert names == {"ChunkForwardKernel", "ChunkPrepKernel", "StateGradKernel", "WYInverseKernel",
                     "StepKernel", "LocalGradKernel"}
    whats = [v.what for v in build.all_variants(recompute=(0, 3))]
    for BV in (32, 64):                                  # both value tiles (pick_bv)
        assert f"gdp_chunk_fwd_sm90 bfloat16 K=128 V=128 ckpt=4 BV={BV}" in whats  # --recompute 3
        assert f"gdp_chunk_bwd_dh_sm90 float16 K=64 V=192 summary BV={BV}" in whats  # CP
        assert f"gdp_chunk_fwd_sm90 float16 K=64 V=192 ckpt=0 summary BV={BV}" in whats
        assert f"gdp_chunk_fwd_sm90 float16 K=64 V=192 ckpt=1 BV={BV}" not in whats
        assert (f"gdp_chunk_bwd_dh_sm90 float16 K=64 V=64 dS_end float16 fused ddo BV={BV}"
                in whats)                                                         # 1 device
    assert "gdp_chunk_prep_sm90 bfloat16 K=128 V=64 inverse" in whats          # backward
    for bad in (["--jobs", "0"], ["--recompute", "65"], ["--recompute", "a"]):
        with pytest.raises(SystemExit):
            build.main(bad)


def test_build_writes_manifest_and_objects(built):
    m = json.loads((built / "manifest.json").read_text())
    assert m["source_hash"] == binding.device_source_hash()
    assert m["cutlass_dsl"] == aot.cutlass_dsl_version() and m["arch"] == "sm_90a"
    assert len(m["variants"]) == 2
    for d, e in m["variants"].items():
        assert hashlib.sha256((built / f"{d}.o").read_bytes()).hexdigest() == e["fingerprint"]


def test_lowering_takes_prebuilt_objects_at_any_shape(built, fresh):
    fresh.setenv(aot.ENV_DIR, str(built))
    _no_compile(fresh)
    objs = set()
    for shape in [(3, 64, 64), (2, 5, 64, 64)]:
        target, art = aot.harvest(_lower(wy_inverse.unit_lower_inverse, S(shape, jnp.float32)))
        objs.add(art.module)
        assert target == aot.target_name()
    for B, HV in [(1, 1), (7, 3)]:
        _, art = aot.harvest(_lower(StepKernel.call, *_step_avals(B, HV, 1, 64, 64)))
        objs.add(art.module)
    files = {p.read_bytes() for p in built.glob("*.o")}
    assert objs == files            # one object per variant, from the directory
    assert binding._compiled == {}


def test_prebuilt_program_equals_in_process_compile(built, fresh, tmp_path):
    """Same object bytes, same key, same HLO: the two paths run the same cubin."""
    def programs():
        jax.clear_caches()
        return (_lower(wy_inverse.unit_lower_inverse, S((4, 64, 64), jnp.float32)).as_text(),
                _lower(StepKernel.call, *_step_avals(2, 3, 1, 64, 64)).as_text())

    fresh.setenv(aot.ENV_DIR, str(built))
    prebuilt = programs()
    assert binding._compiled == {}
    fresh.setenv(aot.ENV_DIR, str(tmp_path / "none"))
    compiled = programs()
    assert len(binding._compiled) == 2
    assert prebuilt == compiled
    assert "CuteDSLRT_NvJaxCutlassCall" in prebuilt[0]


def test_export_with_a_symbolic_batch_uses_the_prebuilt_object(built, fresh):
    """Shape-generic objects make jax.export with symbolic leading dims possible."""
    from jax import export
    fresh.setenv(aot.ENV_DIR, str(built))
    _no_compile(fresh)
    b, = export.symbolic_shape("b")
    exp = export.export(jax.jit(lambda a: wy_inverse.unit_lower_inverse(a)), platforms=["cuda"],
                        disabled_checks=[export.DisabledSafetyCheck.custom_call(
                            aot.target_name())])(S((b, 64, 64), jnp.float32))
    assert aot.target_name() in exp.mlir_module() and exp.in_avals[0].shape[0] == b
    with pytest.raises(ValueError, match="tile dims"):
        aot.tensor_sig((b, b), jnp.float32, 1)


def test_missing_variant_compiles_and_warns_once(built, fresh, caplog):
    fresh.setenv(aot.ENV_DIR, str(built))
    with caplog.at_level(logging.DEBUG, logger="gdp_jax"):
        for n in (2, 3):                                   # neither was built
            _lower(StepKernel.call, *_step_avals(1, 2, n, 64, 64))
    warns = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warns) == 1 and "lack gdp_step_sm90" in warns[0].getMessage()
    assert len(binding._compiled) == 2


@pytest.mark.parametrize("damage", ["stale", "corrupt"])
def test_damaged_store_falls_back(built, fresh, tmp_path, caplog, damage):
    bad = tmp_path / "kernels"
    shutil.copytree(built, bad)
    if damage == "stale":
        m = json.loads((bad / "manifest.json").read_text())
        m["source_hash"] = "0" * 16
        (bad / "manifest.json").write_text(json.dumps(m))
    else:
        for p in bad.glob("*.o"):
            b = bytearray(p.read_bytes())
            b[len(b) // 2] ^= 0xFF
            p.write_bytes(bytes(b))
    fresh.setenv(aot.ENV_DIR, str(bad))
    with caplog.at_level(logging.INFO, logger="gdp_jax"):
        _lower(wy_inverse.unit_lower_inverse, S((2, 64, 64), jnp.float32))
    text = " ".join(r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
    assert ("stale" if damage == "stale" else "does not match its manifest") in text
    assert len(binding._compiled) == 1                     # compiled instead


def test_prebuilt_path_never_imports_the_dsl(built):
    code = ("import sys, jax, jax.numpy as jnp\n"
            "from gdp_jax.kernels import binding, wy_inverse\n"
            "lo = jax.jit(wy_inverse.unit_lower_inverse).trace(jax.ShapeDtypeStruct("
            "(5, 64, 64), jnp.float32)).lower(lowering_platforms=('cuda',)).as_text()\n"
            "assert 'CuteDSLRT_NvJaxCutlassCall' in lo\n"
            "print('cutlass' in sys.modules, binding.cutlass_importable()[0])\n")
    env = dict(_env(), **{aot.ENV_DIR: str(built)})
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["False", "True"]


def test_bad_arguments(fresh):
    A = jnp.zeros((2, 64, 64), jnp.float32)
    with pytest.raises(ValueError, match="tile_dims"):
        binding.custom_call(lambda: None, "x", binding.out(A.shape, A.dtype), (A,),
                            tile_dims=(2,))
    with pytest.raises(ValueError, match="tile_dims"):
        aot.tensor_sig((2, 3), jnp.float32, 3)
    fresh.setenv("GDP_JAX_KERNEL_SHAPES", "dynamic")
    with pytest.raises(ValueError, match="GDP_JAX_KERNEL_SHAPES"):
        binding.kernel_shapes()


def test_static_mode_compiles_per_shape_without_the_store(built, fresh):
    fresh.setenv(aot.ENV_DIR, str(built))
    fresh.setenv("GDP_JAX_KERNEL_SHAPES", "static")
    monkey = fresh
    monkey.setattr(aot, "lookup", lambda *a: pytest.fail("the store was read"))
    txt = _lower(wy_inverse.unit_lower_inverse, S((3, 64, 64), jnp.float32)).as_text()
    assert "CuteDSLRT_NvJaxCutlassCall" in txt and binding._compiled == {}


def test_auto_mode_is_static_without_prebuilt_kernels(built, fresh, tmp_path):
    """The default ("auto"): the per-shape compile unless prebuilt kernels are present."""
    fresh.delenv("GDP_JAX_KERNEL_SHAPES")
    fresh.setenv(aot.ENV_DIR, str(tmp_path / "none"))
    assert binding.kernel_shapes() == "static"
    aot._stores.clear()
    fresh.setenv(aot.ENV_DIR, str(built))
    assert binding.kernel_shapes() == "generic"


@pytest.mark.parametrize("scale, HV", [(None, 66), (0.1, 66), (None, 2)])
def test_engine_runs_only_listed_variants(fresh, scale, HV):
    """Every kernel variant the cutedsl engine lowers (forward, backward and CP summaries,
    bf16, K = V = 128, any scale) for a call that fills the GPU (rows x heads x V / 64 >=
    132 CTAs of the recursion kernels) is one of the variants ffi/build.py prebuilds: a
    prebuilt directory then compiles nothing (the prep kernel once had the scale compiled
    in, so a non-default scale compiled it at trace time). So does a smaller call (HV = 2),
    which runs the recursion kernels on value tiles of 32 (``ChunkForwardKernel.pick_bv``:
    both tiles are prebuilt)."""
    from gdp_jax import _checks, grid
    from gdp_jax.kernels.pipeline import CUTEDSL

    build = _load_build_script()
    seen = []

    def record(launcher, vkey, aliases, constexprs):      # the key only, nothing compiled
        seen.append(vkey)
        binding._compiled[vkey] = aot.Artifact(b"x", b"0" * 32)
        return binding._compiled[vkey]

    fresh.setattr(binding, "_compile", record)
    fresh.setattr(binding, "import_cutlass", lambda: None)
    listed = [v for v in build.all_variants() if "step" not in v.what]
    for v in listed:
        jax.jit(v.fn).trace(*v.avals).lower(lowering_platforms=("cuda",))
    listed_keys = set(seen)
    seen.clear()
    binding._compiled.clear()

    B, T, n, K, V = 1, 130, 2, 128, 128
    layout = grid.make_layout(B, T, n, None)
    NC = layout.reset.shape[1]
    f32 = lambda *s: S(s, jnp.float32)
    ch = grid.ChunkInputs(f32(B, NC, HV, grid.CHUNK, K), f32(B, NC, HV, grid.CHUNK, K),
                          f32(B, NC, HV, grid.CHUNK, V), f32(B, NC, HV, grid.CHUNK),
                          f32(B, NC, HV, grid.CHUNK))
    z = jnp.zeros
    spec = _checks.check_inputs(z((B, T, 1, K), jnp.bfloat16), z((B, T, n, 1, K), jnp.bfloat16),
                                z((B, T, n, HV, V), jnp.bfloat16), None,
                                z((B, T, n, HV), jnp.bfloat16), scale=scale,
                                recompute_chunk_num=0)
    h0, doc, dfinal = f32(B, HV, K, V), f32(B, NC, HV, grid.CHUNK, V), f32(B, HV, K, V)

    def fwd_bwd(c, h, d, df):
        oc, _, states = CUTEDSL.forward(spec, c, layout, h, keep_states=True)
        return oc, CUTEDSL.backward(spec, c, layout, h, d, df, states)

    _lower(fwd_bwd, ch, h0, doc, dfinal)
    _lower(lambda c: CUTEDSL.forward_summaries(spec, c, layout)[0], ch)
    _lower(lambda c, d, df: CUTEDSL.backward_summaries(spec, c, layout, d, df)[0],
           ch, doc, dfinal)
    unlisted = set(seen) - listed_keys
    from gdp_jax.kernels.chunk_forward import ChunkForwardKernel
    tile = ChunkForwardKernel.pick_bv(B, HV, V)        # 16 / 32 / 64 by how many walks
    assert tile == (16 if HV < 33 else 32 if HV < 66 else 64)
    assert seen and any(("BV", tile) in k[-1] for k in seen)
    assert not unlisted, [k[0] for k in unlisted]


def test_build_every_variant(every_kernel_variant, fresh, tmp_path):
    """The whole build, as a user runs it (`python ffi/build.py --jobs 2`, a fresh process),
    on this CPU host: every variant the kernel classes list (of those conftest.BUILD_ONLY
    selects) is exported for sm_90a, and the manifest records each object with its
    fingerprint. The build runs once per session
    (conftest.every_kernel_variant); test_kernels_compile's op-level tests lower on its
    objects."""
    build = _load_build_script()
    out, r = every_kernel_variant
    assert r["returncode"] == 0, r["stdout"] + r["stderr"]
    m = json.loads((out / "manifest.json").read_text())
    assert m["source_hash"] == binding.device_source_hash()
    assert m["cutlass_dsl"] == aot.cutlass_dsl_version() and m["arch"] == "sm_90a"
    # variants with the same signature (e.g. K = 64, V = 64 + 64 against V = 128) share one
    # object: at most one per listed variant, and no fewer than the build wrote
    listed = build._select(build.all_variants(), r["only"])
    assert 50 < len(m["variants"]) <= len(listed)
    assert f"wrote {len(m['variants'])} objects" in r["stdout"]
    assert sorted(p.stem for p in out.glob("*.o")) == sorted(m["variants"])
    for d, e in m["variants"].items():
        assert hashlib.sha256((out / f"{d}.o").read_bytes()).hexdigest() == e["fingerprint"]
    # exactly the listed variants: their keys (traced here, nothing compiled) name the objects
    keys = []

    def record(launcher, vkey, aliases, constexprs):
        keys.append(vkey)
        binding._compiled[vkey] = aot.Artifact(b"x", b"0" * 32)
        return binding._compiled[vkey]

    fresh.setenv(aot.ENV_DIR, str(tmp_path / "none"))
    fresh.setattr(binding, "_compile", record)
    fresh.setattr(binding, "import_cutlass", lambda: None)
    for v in listed:
        jax.jit(v.fn).trace(*v.avals).lower(lowering_platforms=("cuda",))
    assert {aot.digest(k) for k in keys} == set(m["variants"])
