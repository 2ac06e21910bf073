"""Which part of the packed batch-invariance difference (s21-1: dk only) comes from the
L2 norm's backward: the GPU test's comparison with use_qk_l2norm forced off, and the
largest |difference| of each differing result with it on. Run on the GPU after
``source .gpu-deps/install.sh``."""
import sys

sys.path.insert(0, ".")
import tests.test_cutedsl_gpu as t  # noqa: E402

orig = t.gated_delta_product
for norm in (False, True):
    t.gated_delta_product = lambda *a, _n=norm, **kw: orig(*a, **{**kw, "use_qk_l2norm": _n})
    for mode in ("packed", "batch"):
        try:
            t.test_sequence_alone_equals_in_company(mode)
            print(f"norm={norm} {mode}: same bits")
        except AssertionError as e:
            print(f"norm={norm} {mode}: {str(e).splitlines()[0]}")
t.gated_delta_product = orig
