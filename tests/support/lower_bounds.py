"""Print ``name==LOWER`` for the ``>=`` bound of every dependency pyproject.toml declares (core, test, lab).

Exits 1 naming a dependency without one.

`make test-lowest` installs with these as constraints: uv's lowest-direct resolution alone still lifts a direct
dependency above its bound when a transitive pick came first (torch's newest fsspec took datasets to 5.2, not 3.0),
so the bound the package declares would go untested.
"""

import re
import sys
import tomllib
from pathlib import Path

project = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())["project"]
extras = project["optional-dependencies"]
for req in project["dependencies"] + extras["test"] + extras["lab"]:
    m = re.match(r"([A-Za-z0-9_.-]+)\s*(?:\[[^]]*\])?\s*([^;]*)", req)
    lower = [s.strip()[2:] for s in m.group(2).split(",") if s.strip().startswith(">=")]
    if not lower:  # an unbounded dependency would be tested at whatever the resolver picked
        sys.exit(f"lower_bounds.py: {req!r} has no >= bound to test; give it one")
    print(f"{m.group(1)}=={lower[0]}")
