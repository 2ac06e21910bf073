"""The README's CP example runs as printed and equals the single-device op."""
import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np

import gdp_jax

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def test_readme_cp_example_matches_single_device():
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    cp_block = next(b for b in blocks if "cp_axis" in b)
    ns = {}
    exec(compile(cp_block, "README.md", "exec"), ns)       # 8 host devices from conftest
    # the single-device op under jax.jit (eagerly: op-by-op dispatch, most of this test)
    o1 = jax.jit(lambda *a: gdp_jax.gated_delta_product(*a, cu_seqlens=ns["cu"],
                                                        use_qk_l2norm=True))(
        ns["q"], ns["k"], ns["v"], ns["g"], ns["beta"])
    assert ns["o"].shape == o1.shape
    np.testing.assert_allclose(np.asarray(ns["o"]), np.asarray(o1), atol=1e-5, rtol=1e-5)
    assert bool(jnp.all(jnp.isfinite(ns["o"])))
