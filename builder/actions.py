"""What every generated GitHub Actions workflow shares (build.yml, lock.yml, pins.yml: builder/workflow.py;
flash-wheels.yml: builder/flashwheels.py): the checkout/python/install steps and the index mirrors' variables. Its own
module so the two generators import it, not each other."""
from __future__ import annotations

from builder.matrix.schema import INDEX_NAMES

PYTHON = "3.11"
# A mirror of an index: the repository variable TRAINBOX_INDEX_<NAME> replaces matrix.toml's URL (build.py reads it).
INDEX_ENV = {f"TRAINBOX_INDEX_{n.upper()}": "${{ vars.TRAINBOX_INDEX_" + n.upper() + " }}" for n in INDEX_NAMES}


def setup_steps(fetch_depth: int | None = None) -> list[dict]:
    checkout = {"uses": "actions/checkout@v4"}
    if fetch_depth is not None:
        checkout["with"] = {"fetch-depth": fetch_depth}
    return [
        checkout,
        {"uses": "actions/setup-python@v5", "with": {"python-version": PYTHON}},
        {"name": "Install the builder", "run": "python -m pip install -e ."},
    ]
