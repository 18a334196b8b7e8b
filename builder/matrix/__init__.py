"""matrix.toml -> Matrix: the document read and checked (document.py, schema.py, axes.py, packages.py, facts.py,
fabric.py), expanded into frozen Cell objects plus the combinations the rules exclude (expand.py, flavours.py), and
every value a cell renders checked against its grammar (grammar.py). The data model is model.py."""
from __future__ import annotations

from pathlib import Path

from builder.matrix.document import read_document
from builder.matrix.expand import build_matrix
from builder.matrix.grammar import check_cell_values
from builder.matrix.model import Cell, Exclusion, Matrix
from builder.paths import ROOT

__all__ = ["DEFAULT_MATRIX", "Cell", "Exclusion", "Matrix", "load_matrix", "read_document"]

DEFAULT_MATRIX = ROOT / "matrix.toml"


def load_matrix(path: str | Path = DEFAULT_MATRIX) -> Matrix:
    """PATH read, checked and expanded: the Matrix, or one UserError naming what is wrong and where."""
    path = Path(path)
    where = str(path)
    data = read_document(path)
    matrix = build_matrix(path, data)
    for cell in matrix.cells:
        check_cell_values(where, cell)
    return matrix
