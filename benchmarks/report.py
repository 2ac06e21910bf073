"""Result files of one run: <bench>_<stamp>.json (every row, with its environment),
<bench>_<stamp>.md (the table) and <bench>_<stamp>.log (what was printed)."""
from __future__ import annotations

import datetime as dt
import json
import os

from benchmarks import measure


def default_out() -> str:
    """Outside git: $OUT/bench where the GPU machine provides $OUT, else /tmp/gdp_bench/<date>."""
    if os.environ.get("OUT"):
        return os.path.join(os.environ["OUT"], "bench")
    return os.path.join("/tmp/gdp_bench", dt.date.today().isoformat())


class Run:
    """Opens the three files of one run under ``out`` and rewrites the table after each row,
    so a run cut short still leaves what it measured."""

    def __init__(self, bench: str, out: str, env: dict):
        os.makedirs(out, exist_ok=True)
        stamp = dt.datetime.now().strftime("%Y-%m-%d_%H%M%S")
        self.stem = os.path.join(out, f"{bench}_{stamp}")
        self.bench, self.env, self.rows, self.notes = bench, env, [], []
        self._log = open(self.stem + ".log", "a")
        measure._LOG.append(self._log)

    def add(self, row: dict, table_fn):
        self.rows.append({**row, **self.env})
        self.write(table_fn)

    def note(self, text: str):
        measure.log("NOTE", text)
        self.notes.append(text)

    def write(self, table_fn) -> str:
        with open(self.stem + ".json", "w") as f:
            json.dump({"bench": self.bench, "env": self.env, "notes": self.notes,
                       "rows": self.rows}, f, indent=1, default=str)
        text = table_fn(self)
        with open(self.stem + ".md", "w") as f:
            f.write(text)
        return text

    def header(self, title: str, what: str) -> list:
        e = self.env
        return [f"# {title}, {e['date']}", "",
                f"Command: `{e['command']}`", "",
                f"Device: {e['device']}; commit {e['commit']} (gdp_jax sources "
                f"{e['gdp_jax_sources']}); jax {e['jax']}, jaxlib {e['jaxlib']}, CuTe DSL "
                f"{e['cutlass_dsl']}; FLA: {e['fla']}; Python {e['python']}; cutedsl kernels "
                f"{e.get('kernels', '?')}.", "", what, ""]

    def footer(self) -> list:
        return [""] + (["Notes:"] + [f"- {n}" for n in self.notes] if self.notes else [])

    def close(self):
        measure._LOG.remove(self._log)
        self._log.close()


def fmt(x, p=2):
    return "-" if x is None else f"{x:.{p}f}"


def ratio(a, b):
    return "-" if not (a and b) else f"{a / b:.2f}"


def pct(bound, t):
    return "-" if not (bound and t) else f"{100 * bound / t:.1f}%"


def status(r) -> str:
    """The last column: why a row has no numbers, or whether its check passed."""
    if r.get("error"):
        return r["error"]
    if r.get("check_ok") is False:
        return "CHECK FAILED"
    return ""
