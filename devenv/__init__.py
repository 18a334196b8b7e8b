"""Test-machine set-up, not part of the product: a Docker engine + local registry + binfmt (`make engine`), a one-node
Slurm (`make slurm`), debootstrapped base images (`make bases`). Imports builder; builder never imports it."""
