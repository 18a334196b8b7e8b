"""The matrix the real-GPU-image test and benchmark build from: matrix.toml with the two substitutions this machine
forces (see tests/test_gpu_image.py): CUDA 13.0 cells locked for python 3.11 (the debootstrapped bookworm base), and
Hopper on SDPA (FA3's wheel lives on an index not reachable here)."""
from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def write_test_matrix(ctx: Path) -> Path:
    text = (ROOT / "matrix.toml").read_text()
    cuda13 = text.index('[cuda."13.0"]')
    head, tail = text[:cuda13], text[cuda13:]
    tail = tail.replace('python = "3.12"', 'python = "3.11"', 1)
    text = (head + tail).replace('cuda_arch_list = "9.0a"\nattention = "fa3"',
                                 'cuda_arch_list = "9.0a"\nattention = "sdpa"')
    assert text.count('python = "3.11"') >= 2 and 'attention = "sdpa"\nmin_cuda = "12.3"' in text
    path = ctx / "matrix.toml"
    path.write_text(text)
    return path
