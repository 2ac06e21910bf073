"""The benchmark runner on CPU: a tiny shape with the xla implementation writes its three files
and a table with the expected columns; FLA and cutedsl absent here are notes, not failures."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)          # benchmarks/ is not installed with the package

from _compile_flags import TEXT as COMPILE_FLAGS  # noqa: E402
from benchmarks import registry, run  # noqa: E402


def _files(out, bench):
    names = sorted(os.listdir(out))
    stems = {os.path.splitext(n)[0] for n in names}
    assert len(stems) == 1, names
    stem = os.path.join(out, stems.pop())
    assert os.path.basename(stem).startswith(bench + "_")
    for ext in (".md", ".json", ".log"):
        assert os.path.getsize(stem + ext) > 0, ext
    with open(stem + ".json") as f:
        data = json.load(f)
    with open(stem + ".md") as f:
        md = f.read()
    return data, md


def _table(md):
    """Header cells and the data rows of the markdown table."""
    rows = [line for line in md.splitlines() if line.startswith("|")]
    cells = lambda line: [c.strip() for c in line.strip("|").split("|")]
    return cells(rows[0]), [cells(r) for r in rows[2:]]


def test_fwdbwd_tiny_xla(tmp_path):
    rc = run.main(["fwdbwd", "--impl", "xla,fla", "--shapes", "tiny", "--baseline", "xla",
                   "--iters", "2", "--reps", "2", "--out", str(tmp_path)])
    assert rc == 0
    data, md = _files(tmp_path, "fwdbwd")
    head, rows = _table(md)
    assert head[:4] == ["B, T, H, n", "impl", "fwd", "fwd+bwd"]
    assert {"peak", "kept", "check", "% roofline (fwd+bwd)"} <= set(head)
    assert [r[1] for r in rows] == ["xla"]
    row = data["rows"][0]
    assert row["fwd_ms"] > 0 and row["fwdbwd_ms"] > 0 and row["check_ok"]
    assert set(row["check"]) == {"o", *registry.GRAD_NAMES}
    for key in ("commit", "command", "device", "jax", "fla", "date", "gdp_jax_sources"):
        assert row[key], key
    assert row["command"].startswith("python -m benchmarks.run fwdbwd --impl xla,fla")
    if row["fla"].startswith("FLA not importable") or "CUDA" in row["fla"]:
        assert any(n.startswith("fla NOT RUN") for n in data["notes"])


def test_fwd_tiny_xla(tmp_path):
    """The forward benchmark: time, the check of o and the forward's peak memory."""
    rc = run.main(["fwd", "--impl", "xla", "--shapes", "tiny", "--baseline", "xla",
                   "--iters", "2", "--reps", "2", "--out", str(tmp_path)])
    assert rc == 0
    data, md = _files(tmp_path, "fwd")
    head, rows = _table(md)
    assert head[:3] == ["B, T, H, n", "impl", "fwd"] and "peak" in head
    row = data["rows"][0]
    assert row["fwd_ms"] > 0 and row["check_ok"] and set(row["check"]) == {"o"}
    assert row["fwd_peak_gb"] > 0
    assert rows[0][head.index("peak")] == f"{row['fwd_peak_gb']:.2f}"


def test_step_tiny_xla(tmp_path):
    rc = run.main(["step", "--impl", "xla", "--shapes", "tiny", "--baseline", "xla",
                   "--iters", "3", "--reps", "2", "--out", str(tmp_path)])
    assert rc == 0
    data, md = _files(tmp_path, "step")
    head, rows = _table(md)
    assert head[:3] == ["shape", "impl", "us per step"] and [r[1] for r in rows] == ["xla"]
    assert data["rows"][0]["us"] > 0 and data["rows"][0]["check_ok"]


def test_unknown_impl_and_bad_shapes_name_the_argument():
    with pytest.raises(ValueError, match="--impl"):
        registry.impl("cutedsl-fast", "fwdbwd")
    with pytest.raises(ValueError, match="--shapes"):
        registry.shapes("op", "mian")


@pytest.mark.slow
def test_cp_tiny_simulated_devices(tmp_path):
    """The cp subcommand on 2 simulated CPU devices (its own process: XLA_FLAGS)."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": ROOT}
    # no device flag (the run adds its own: --devices); the compile settings that
    # tests/conftest.py sets for the suite (tests/_compile_flags.py; CI time; a 1-iteration
    # timing on CPU is not a measurement anyway)
    env["XLA_FLAGS"] = COMPILE_FLAGS
    r = subprocess.run([sys.executable, "-m", "benchmarks.run", "cp", "--backend", "xla",
                        "--shapes", "1,128,2,2,16,16", "--devices", "2", "--P", "2",
                        "--iters", "1", "--out", str(tmp_path)],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    data, md = _files(tmp_path, "cp")
    row = data["rows"][0]
    # bf16 inputs: both paths read 16-bit operands (w, u, Kt, qg, P), but one device reads
    # its per-chunk states rounded to bf16 and the CP rank its float32 response pass: they
    # differ by bf16 rounding (1.5e-3 seen), below either one's error vs float64 (~4e-3)
    assert row["fwd+bwd"]["tP_T"]["ms"] > 0 and max(row["check"].values()) < 3e-3


def test_a_wrong_implementation_fails_its_check(tmp_path):
    """The check before timing catches an output 10% off and the table says so."""
    from benchmarks import measure, op, report

    class Wrong(registry.OursOp):
        def op(self):
            right = super().op()
            return lambda *a: right(*a) * 1.1

    args = run.parse(["fwd", "--shapes", "tiny", "--iters", "1", "--reps", "1",
                      "--out", str(tmp_path), "--baseline", "xla"])
    run_ = report.Run("fwd", str(tmp_path), measure.environment(["fwd"]))
    op.run(args, run_, [Wrong("wrong", "xla")])
    run_.close()
    (row,) = run_.rows
    assert row["check_ok"] is False and row["check"]["o"] > 0.05
    text = open(run_.stem + ".md").read()
    assert "CHECK FAILED" in text
    # how the kernels were compiled is part of every row and the header (s34: generic
    # and per-shape kernels differ by ~3.5% in fwd+bwd)
    assert row["kernels"] in ("generic (prebuilt)", "static")
    assert f"cutedsl kernels {row['kernels']}." in text


def test_cp_rank_overhead_tiny():
    """benchmarks/cp_rank: rank P - 1's four protocol functions with a real fold's
    summaries give the one-device op's tokens (and not the shard alone's), and it reports
    the overhead ratios."""
    import jax
    import jax.numpy as jnp
    from benchmarks import cp_rank
    from gdp_jax import gated_delta_product
    row = cp_rank.measure("xla", 1, 128, 2, 2, P=2, K=16, V=16, dtype="float32", iters=1,
                          reps=1)
    assert row["check_o"] < 1e-5
    assert row["overhead fwd"] > 0 and row["overhead fwd+bwd"] > 0
    x, do = cp_rank.inputs(1, 128, 2, 2, 16, 16, jnp.float32)
    rank_fwd, _, xr, _ = cp_rank.rank_functions("xla", x, do, 2)
    # under jax.jit (eagerly: op-by-op dispatch)
    alone = jax.jit(lambda *a: gated_delta_product(*a, use_qk_l2norm=True)[0])(*xr)
    assert cp_rank._rel_rms(jax.jit(rank_fwd)(*xr)[0], alone) > 1e-2   # the fold matters


def test_segments_tiny():
    """benchmarks/segments: each segment size is traced with segments forced on (the
    gradients equal the unsegmented ones to float32 rounding) and the module's thresholds
    are restored afterwards."""
    from benchmarks import segments
    from gdp_jax import recurrence
    saved = recurrence.MAX_PROBLEMS, recurrence.SEGMENT_PROBLEMS
    rows = segments.measure((1, 256, 2, 2, 16, 16), [None, 4, 8], dtype="float32",
                            iters=1, reps=1)
    assert [r["segment_problems"] for r in rows] == [None, 4, 8]
    assert all(r["fwdbwd_ms"] > 0 for r in rows)
    assert all(r["max_rel_diff_vs_first"] < 1e-5 for r in rows[1:])
    assert (recurrence.MAX_PROBLEMS, recurrence.SEGMENT_PROBLEMS) == saved
    with segments.segments(4):
        assert recurrence.segment_len(8, 2) == 2


def test_intra_cp_impl_names():
    """``<backend>-cp<S>`` / ``-cpauto`` run the op with intra_cp (CP inside the device)."""
    for name, backend, S in (("xla-cp2", "xla", 2), ("cutedsl-cp8", "cutedsl", 8),
                             ("cutedsl-cpauto", "cutedsl", "auto")):
        o = registry.impl(name, "fwdbwd")
        assert (o.backend, o.intra_cp) == (backend, S) and o.fwd_same_as is None
    for bad in ("xla-cp", "xla-cpx", "fla-cp2"):
        with pytest.raises(ValueError, match="unknown implementation"):
            registry.impl(bad, "fwdbwd")


def test_switch_suffixes_turn_kernel_opt_ins_on_only_while_tracing(monkeypatch):
    """``cutedsl-cp4+narrow+save``: the op runs with both opt-ins on, and they are off
    again after it (so the next implementation in the process sees the defaults)."""
    import gdp_jax
    from gdp_jax.kernels import chunk_forward, pipeline
    seen = []
    monkeypatch.setattr(gdp_jax, "gated_delta_product", lambda *a, **kw: seen.append(
        (chunk_forward.NARROW_TILES, pipeline.SAVE_OPERANDS, kw["backend"])))
    # both off whatever the defaults are, so the suffixes have something to turn on
    monkeypatch.setattr(chunk_forward, "NARROW_TILES", False)
    monkeypatch.setattr(pipeline, "SAVE_OPERANDS", False)
    before = (False, False)
    o = registry.impl("cutedsl-cp4+narrow+save", "fwdbwd")
    assert (o.name, o.intra_cp, o.fwd_same_as) == ("cutedsl-cp4+narrow+save", 4, None)
    o.switched(o.op())(1, 2, 3, 4, 5)
    assert seen == [(True, True, "cutedsl")]
    assert (chunk_forward.NARROW_TILES, pipeline.SAVE_OPERANDS) == before
    with pytest.raises(ValueError, match="unknown switch"):
        registry.impl("cutedsl+narow", "fwdbwd")
    with pytest.raises(ValueError, match="unknown implementation"):
        registry.impl("xla+narrow", "fwdbwd")


def test_switches_cover_the_backward_trace(monkeypatch):
    """A switch the op's backward reads (``+nb``: pipeline.FUSED_NORM_BWD) is on while a
    jitted value-and-grad traces the custom_vjp's backward - after the op's forward has
    returned (s32: the switches were set around the forward alone, so +rob and +nb
    measured the defaults) - and off again after."""
    import jax
    import jax.numpy as jnp
    from gdp_jax.kernels import pipeline
    monkeypatch.setattr(pipeline, "FUSED_NORM_BWD", False)
    seen = []

    @jax.custom_vjp
    def f(x):
        return x

    def fwd(x):
        seen.append(("fwd", pipeline.FUSED_NORM_BWD))
        return x, None

    def bwd(_, g):
        seen.append(("bwd", pipeline.FUSED_NORM_BWD))
        return (g,)

    f.defvjp(fwd, bwd)
    o = registry.impl("cutedsl+nb", "fwdbwd")
    jax.jit(o.switched(jax.grad(lambda x: f(x).sum())))(jnp.ones(3))
    assert seen == [("fwd", True), ("bwd", True)]
    assert pipeline.FUSED_NORM_BWD is False


def test_kernel_ab_configs_parse_and_reject_typos():
    from benchmarks import kernel_ab
    assert kernel_ab.parse_configs("split=1,bv=32; split=0,bv=64;") == [
        {"split": True, "bv": 32}, {"split": False, "bv": 64}]
    with pytest.raises(ValueError, match="split=0"):
        kernel_ab.parse_configs("splt=1,bv=32")


def test_set_switches_a_module_constant_and_rejects_typos(monkeypatch):
    from gdp_jax import recurrence
    monkeypatch.setattr(recurrence, "SCAN_UNROLL", dict(recurrence.SCAN_UNROLL))
    run.apply_settings(["recurrence.SCAN_UNROLL={'gpu': 4}"])
    assert recurrence.SCAN_UNROLL == {"gpu": 4}
    for bad in ("recurrence.SCAN_UNROL=1", "SCAN_UNROLL=1", "recurrence.SCAN_UNROLL"):
        with pytest.raises(SystemExit, match="--set"):
            run.apply_settings([bad])


def test_hlo_lines_names_kernels_by_source_line(tmp_path, capsys):
    """hlo_lines joins a trace table with the optimized HLO: each named instruction gets
    its shape, a bandwidth from its bytes, and the gdp_jax line that built it."""
    import re

    import jax
    import jax.numpy as jnp

    from benchmarks import hlo_lines
    from gdp_jax import chunked

    g = jnp.linspace(-3.0, 0.0, 2 * 64).reshape(2, 64)
    text = jax.jit(chunked.segment_sums).lower(g).compile().as_text()
    hlo = tmp_path / "f.hlo"
    hlo.write_text(text)
    ins = hlo_lines.instructions(text)
    named = [n for n, (_, sf, _) in ins.items() if sf is not None
             and any("chunked.py" in w for w in hlo_lines.ours(
                 hlo_lines.stack(sf, *hlo_lines._tables(text)), 3))]
    assert named, "no instruction traced back to gdp_jax/chunked.py"
    trace = tmp_path / "trace.log"
    trace.write_text("total GPU kernel time per step: 1.000 ms (1 names)\n"
                     f"   0.500 ms     2x  {named[0]}\n")
    hlo_lines.main([str(trace), str(hlo), "--depth", "3"])
    out = capsys.readouterr().out
    assert re.search(rf"0\.500 ms +2x .*{re.escape(named[0][:30])}.*chunked\.py:\d+", out)
    assert hlo_lines.shape_bytes("(f32[2,3]{1,0}, bf16[4])") == 2 * 3 * 4 + 4 * 2


def test_trace_backward_mode_writes_hlo_with_source_lines(tmp_path, capsys):
    """``benchmarks.trace --mode bwd`` runs the engine's backward alone and writes its HLO,
    whose frames reach gdp_jax/chunked.py (through the op's custom_vjp they stop at the
    op's call). On a CPU the trace has no GPU kernels; the HLO is still written."""
    from benchmarks import trace

    hlo = tmp_path / "b.hlo"
    trace.main(["--shape", "1,128,2,2,16,16", "--impl", "xla", "--mode", "bwd", "--steps", "1",
                "--out", str(tmp_path / "tr"), "--hlo", str(hlo)])
    assert "optimized HLO" in capsys.readouterr().out
    assert "gdp_jax/chunked.py" in hlo.read_text()


def test_compiled_bytes_of_both_backends_tiny():
    """benchmarks.xla_bytes compiles the fwd and fwd+bwd of the xla backend and of the
    cutedsl glue on emulated kernels (any host) and reports positive temp bytes."""
    from benchmarks import xla_bytes
    for backend in ("xla", "cutedsl-emulated"):
        res = xla_bytes.compiled_bytes((1, 70, 1, 3, 16, 8), "bfloat16", backend)
        assert res["fwd"]["temp_GB"] > 0 and res["fwdbwd"]["temp_GB"] > res["fwd"]["temp_GB"], \
            (backend, res)


def test_fit_tiny(capsys):
    """benchmarks.fit runs one fwd+bwd and reports finite gradients."""
    from benchmarks import fit
    fit.main(["--shape", "1,70,1,2", "--reps", "1"])
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["grads_finite"] is True and out["shape"] == [1, 70, 1, 2]


def test_glue_bytes_tiny(capsys):
    """benchmarks/glue_bytes: the cutedsl pipeline compiles with its kernels opaque; the
    split forward lists the V + K summary walk (o a [1] placeholder, the final states on
    V + K columns) among its largest instructions, and the emulations are restored
    afterwards."""
    from benchmarks import glue_bytes
    from gdp_jax.kernels import emulate
    before = emulate.chunk_kernel_call
    glue_bytes.main(["--shape", "1,512,2,2", "--intra-cp", "2", "--top", "40"])
    out = capsys.readouterr().out
    assert "intra_cp=2 fwd: XLA bytes accessed" in out
    assert "custom-call  (bf16[1]{0}, f32[2,2,128,256]" in out    # the summary walk
    assert emulate.chunk_kernel_call is before


def test_rounding_model_tiny():
    """benchmarks.rounding_model (a separate process: it turns on float64): every scheme's
    error vs float64 is of a 16-bit size (not 0, not blown up), and the walk forming w S
    and u from X with v - gam k S split into hi + lo stays within 10% of today's on o."""
    r = subprocess.run([sys.executable, "-m", "benchmarks.rounding_model", "--B", "1",
                        "--T", "200", "--H", "1", "--K", "64", "--V", "64"], cwd=ROOT,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    errs = {}
    for line in r.stdout.splitlines():
        parts = line.split()
        if len(parts) == 5 and parts[1] == "o":
            errs[parts[0]] = (float(parts[2]), float(parts[4]))
    assert set(errs) == {"today", "today-u16", "fla-like", "xwalk", "xwalk-split"}, r.stdout
    for o, s in errs.values():
        assert 1e-4 < o < 1e-2 and 1e-5 < s < 1e-2, errs
    assert errs["xwalk-split"][0] < 1.1 * errs["today"][0], errs


def test_roofline_ceilings_follow_the_device():
    """'% roofline' is of the measuring device's ceilings: an H100 row is not held to the
    H200's HBM bandwidth (s35's H100 tables were, before this)."""
    from benchmarks import registry, roofline
    shape = registry.shapes("op", "8,4096,16,2")[0]
    h100, h200 = "1 x NVIDIA H100 80GB HBM3", "1 x NVIDIA H200"
    assert roofline.ceilings(h100)[1:] == (3.35e12, "H100")
    assert roofline.ceilings(h200)[1:] == (4.8e12, "H200")
    assert roofline.ceilings("cpu")[2] == "H200"
    f, b = roofline.flops(shape, "fwd"), roofline.min_bytes(shape, "fwd")
    for kind, bw in ((h100, 3.35e12), (h200, 4.8e12)):
        want = 1e3 * max(f / roofline.PEAK_FLOPS, b / bw)
        assert roofline.roofline_ms(shape, "fwd", kind) == pytest.approx(want)
    assert roofline.roofline_ms(shape, "fwd", h100) > roofline.roofline_ms(shape, "fwd", h200)
    assert "3.35 TB/s (H100)" in roofline.ceilings_text(h100)
    assert roofline.step_bound_us(shape, h100) > roofline.step_bound_us(shape, h200)


def test_layers_tiny(capsys):
    """benchmarks.layers: four configurations of a 2-layer stack, finite gradients, and the
    xla backend (which never keeps operands) the same bits whether the switch is on or not."""
    from benchmarks import layers
    layers.main(["--shape", "1,70,1,2", "--layers", "2", "--impl", "xla", "--reps", "1"])
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()
            if line.startswith("{")]
    assert [(r["save_operands"], r["remat"]) for r in rows] == [
        (False, False), (False, True), (True, False), (True, True)]
    assert all(r["finite"] and r["same_bits"] for r in rows)
    with pytest.raises(SystemExit):
        layers.main(["--shape", "1,70,1,2", "--layers", "0"])
