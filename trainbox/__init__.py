"""trainbox's in-image package: the dispatcher (`python -m trainbox`, `trainbox`) and one module per entrypoint.

Kept import-free on purpose: the dispatcher's `--help` and the healthcheck must not pay for torch/transformers.
Two things are done here (standard library only), in every process that imports an entrypoint (the dispatcher's
children, torchrun's ranks, a notebook): drop known-harmless library notices that look like errors (quiet.py), and
end quietly where stdout's reader went away (`trainbox plan ... | head`: common/pipes.py's last-resort hook).
"""

from common import pipes as _pipes
from trainbox import quiet as _quiet

_quiet.install()
_pipes.install_hook()
