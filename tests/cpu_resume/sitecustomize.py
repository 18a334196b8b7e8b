"""Test-only workaround, imported by every Python of the 2-node resume job (PYTHONPATH): transformers resumes a
multi-process CPU run with torch.load(map_location=args.device), i.e. "cpu:N", and torch has no deserializer for
that tag ("don't know how to restore data location ... (tagged with cpu:0)"). GPUs ("cuda:N") are unaffected.
Reported for entrypoints/ (issue 10's area); delete this folder once the entrypoints handle it themselves."""

import torch.serialization

torch.serialization.register_package(
    11, lambda obj: None, lambda obj, location: obj if str(location).startswith("cpu:") else None)
