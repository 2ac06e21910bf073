"""``python -m gdp_jax``: the same command line as the ``gdp-jax`` console script."""
import sys

from gdp_jax.cli import main

if __name__ == "__main__":
    sys.exit(main())
