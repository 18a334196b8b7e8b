"""trainbox's in-image package: the dispatcher (`python -m entrypoints`, `trainbox`) and one module per entrypoint.

Kept import-free on purpose: the dispatcher's `--help` and the healthcheck must not pay for torch/transformers.
"""
