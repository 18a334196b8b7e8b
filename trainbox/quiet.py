"""Known-harmless library notices that look like errors, dropped so a normal start or run reads clean.

- bitsandbytes on a CPU with AVX512-BF16: "Failed to load CPU gemm_4bit_forward from kernels-community: No module
  named 'kernels'" at import; it falls back to its own CPU code (the optional `kernels` package is not in the image).
- liger-kernel 0.8.x: "Backend impl '...' for op '...' could not be imported" per alternative backend (other vendors'
  accelerators) whose dependencies are absent; liger still reports a missing implementation on its own when none is
  left for an op.
- torchao 0.18 (the memory plan's 8-bit AdamW; transformers imports it at every model build once installed): "Failed
  to load .../_C_*.so" / "Skipping import of cpp extensions" for its compiled quantization kernels that don't match
  this torch or machine (the optimizers are torch code and never use them), and torch 2.11+'s "<enum ...> is an Enum
  subclass and is now natively supported by torch.compile" for the enums torchao still registers as pytree constants.
`install()` is idempotent; TRAINBOX_VERBOSE=1 keeps everything.
"""

from __future__ import annotations

import logging
import os

DROP = {
    "bitsandbytes.backends.cpu.ops": ("Failed to load CPU gemm_4bit_forward from kernels-community",),
    "liger_kernel.backends.registry": ("Backend impl ",),
    "torchao": ("Failed to load ", "Skipping import of cpp extensions"),
    "torch.utils._pytree": ("%s is an Enum subclass and is now natively supported",),
}
_installed = False


class _Drop(logging.Filter):
    def __init__(self, prefixes: tuple[str, ...]):
        super().__init__()
        self.prefixes = prefixes

    def filter(self, record: logging.LogRecord) -> bool:
        return not (isinstance(record.msg, str) and record.msg.startswith(self.prefixes))


def install() -> None:
    global _installed
    if _installed or os.environ.get("TRAINBOX_VERBOSE", "") not in ("", "0"):
        return
    for name, prefixes in DROP.items():
        logging.getLogger(name).addFilter(_Drop(prefixes))  # the logger object exists before the library imports
    _installed = True
