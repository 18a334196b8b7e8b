"""The command table: every in-image command (`trainbox NAME`), the one home of their names and kinds.

The dispatcher (listing, what runs), the help cache (which commands keep a rendered --help), the notebook helper
(what `notebook.run` may run) and the host's Slurm renderer (builder/slurm.py: which commands get a job script,
which take --config) all read this table; a new command is its module (trainbox/cli/NAME.py) plus one line here.
Pure data: no import of a package or of a library (builder/ imports it on the host), and a command's summary is read
from its module's docstring by the dispatcher, only when it lists them.
"""

from __future__ import annotations

from typing import NamedTuple


class Command(NamedTuple):
    name: str
    module: str  # trainbox/cli/<module>.py (PACKAGE)
    public: bool = True  # listed by `trainbox --help`; a hidden one runs but isn't listed
    # A trainer takes --config YAML, keeps a rendered --help (helpcache.py), starts torchrun itself
    # (runner.run_trainer) and may run from a notebook (notebook.run).
    trainer: bool = False
    slurm: bool = False  # builder/slurm.py renders a job script for it (job.sh.j2: one task per node)
    # The top-level packages it can't start without: an image of the light stack (matrix.toml: no torch) lists the
    # command as not there and refuses it in one line, instead of a ModuleNotFoundError while --help listed it.
    needs: tuple[str, ...] = ()


TRAINING = ("torch", "transformers", "trl")  # the train stack's core: the trainers and the plan (its config parsing)


# In the order `trainbox --help` lists them.
TABLE = (
    Command("jupyter", "jupyter"),
    Command("grpo", "grpo", trainer=True, slurm=True, needs=TRAINING),
    Command("qlora", "qlora", trainer=True, needs=(*TRAINING, "peft")),  # no Slurm job script offered yet
    Command("sft", "sft", trainer=True, slurm=True, needs=TRAINING),
    Command("dpo", "dpo", trainer=True, slurm=True, needs=TRAINING),
    Command("plan", "plan", needs=TRAINING),
    Command("doctor", "doctor"),
    Command("selftest", "selftest"),
    Command("nccl-check", "nccl_check", slurm=True, needs=("torch",)),
    # trainbox/cli/ray.py would shadow the `ray` package for a script run.
    Command("ray", "ray_cluster", slurm=True),
    Command("healthcheck", "healthcheck", public=False),
)
BY_NAME = {c.name: c for c in TABLE}
# Where a command's module lives in the in-image package (a name, not an import: common/ never imports trainbox).
PACKAGE = "trainbox.cli"


def names(*, public: bool | None = None, trainer: bool | None = None, slurm: bool | None = None) -> tuple[str, ...]:
    """The commands' names, in table order, filtered by kind (None: either)."""
    return tuple(c.name for c in TABLE
                 if (public is None or c.public == public) and (trainer is None or c.trainer == trainer)
                 and (slurm is None or c.slurm == slurm))


def module(name: str) -> str:
    """The module of a command (`nccl-check` lives in nccl_check.py, `ray` in ray_cluster.py); a name not in the
    table maps as `-` -> `_`."""
    c = BY_NAME.get(name)
    return c.module if c else name.replace("-", "_")


def qualified(name: str) -> str:
    """The importable name of a command's module: `trainbox.cli.nccl_check` (`python -m` it, torchrun it)."""
    return f"{PACKAGE}.{module(name)}"


def path(name: str) -> str:
    """A command's source file, relative to the folder holding the package: `trainbox/cli/nccl_check.py`."""
    return qualified(name).replace(".", "/") + ".py"
