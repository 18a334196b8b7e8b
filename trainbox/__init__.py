"""trainbox's in-image package: the dispatcher (`python -m trainbox`, `trainbox`) and one module per entrypoint.

Kept import-free on purpose: the dispatcher's `--help` and the healthcheck must not pay for torch/transformers.
The one thing done here (stdlib logging only): drop known-harmless library notices that look like errors
(quiet.py), in every process that imports an entrypoint: the dispatcher's children, torchrun's ranks, a notebook.
"""

from trainbox import quiet as _quiet

_quiet.install()
