"""Kept for branches in flight: the shared test helpers now live in :mod:`gdp_jax.testing`
(issue 13). New tests import from there."""
from gdp_jax.testing import *  # noqa: F401,F403
from gdp_jax.testing import DIFF_NAMES, Inputs  # noqa: F401
