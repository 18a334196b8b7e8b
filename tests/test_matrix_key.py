"""A matrix key a cell copies is one Cell field (issue 30): the field names its table (model.from_table), schema.py
allows the key there and expand.py copies it, with no edit of either. Here a field is added to Cell as a subclass, as
if model.py had it, and a copy of matrix.toml gives it a value: the value reaches the cells, a typo of it is refused."""
from __future__ import annotations

import dataclasses
import importlib
from contextlib import contextmanager

import pytest

from builder.errors import UserError
from builder.matrix import axes, expand, load_matrix, model, schema
from builder.paths import ROOT

# every table a Cell field may come from -> schema.py's (allowed keys, required keys) of it
SCHEMAS = {"cell": ("CELL_KEYS", "REQUIRED_CELL"), "arch": ("ARCH_KEYS", "REQUIRED_ARCH"),
           "cuda": ("CUDA_KEYS", "REQUIRED_CUDA"), "gpu": ("GPU_KEYS", "REQUIRED_GPU"),
           "torch_variant": ("VARIANT_KEYS", "REQUIRED_VARIANT"), "naming": ("NAMING_KEYS", "REQUIRED_NAMING")}


def test_schema_allows_every_copied_key_where_its_field_says():
    assert set(SCHEMAS) == set(model.CELL_TABLES)
    copied = 0
    for f in dataclasses.fields(model.Cell):
        key = f.metadata.get("trainbox.matrix")
        for table in key.tables if key else ():
            allowed, required = (getattr(schema, n) for n in SCHEMAS[table])
            assert allowed[f.name] == key.type, (table, f.name)
            assert (f.name in required) == key.required, (table, f.name)
            copied += 1
    assert copied >= 12   # platform, uv_platform, base_image (x2), python (x2), build_image, min_driver...
    # the keys a cell copies that were listed in schema.py before issue 30, still required where they were
    assert {"base_image", "python", "min_driver"} <= set(schema.REQUIRED_CUDA)
    assert {"repository", "version", "source"} <= set(schema.REQUIRED_NAMING)
    assert "cuda_arch_list" in schema.REQUIRED_GPU and "default_index" not in schema.REQUIRED_VARIANT


def test_from_table_refuses_an_unknown_table():
    with pytest.raises(ValueError, match="tables must be among"):
        model.from_table("gpus")


@contextmanager
def cell_with(name: str, spec, annotation=str | None):
    """Cell with one more field, as if model.py declared it; the modules that read Cell's fields when imported
    (schema's key sets, axes' and expand's imports of them) re-read it, and are restored after."""
    original = model.Cell
    model.Cell = dataclasses.make_dataclass("Cell", [(name, annotation, spec)], bases=(original,), frozen=True,
                                            kw_only=True)
    try:
        for module in (schema, axes, expand):
            importlib.reload(module)
        yield
    finally:
        model.Cell = original
        for module in (schema, axes, expand):
            importlib.reload(module)


def matrix_with(tmp_path, *edits: tuple[str, str]):
    text = (ROOT / "matrix.toml").read_text()
    for anchor, replacement in edits:
        assert text.count(anchor) == 1, anchor
        text = text.replace(anchor, replacement)
    path = tmp_path / "matrix.toml"
    path.write_text(text)
    return path


def test_a_new_key_reaches_the_cells_and_a_typo_is_refused(tmp_path):
    with cell_with("nccl_floor", model.from_table("cuda", default=None)):
        m = load_matrix(matrix_with(tmp_path, ('[cuda."13.0"]\n', '[cuda."13.0"]\nnccl_floor = "2.27.3"\n')))
        assert {c.nccl_floor for c in m.cells if c.cuda == "13.0"} == {"2.27.3"}   # flavour cells: their base's
        assert {c.nccl_floor for c in m.cells if c.cuda != "13.0"} == {None}       # no value, no [cuda] row
        with pytest.raises(UserError) as e:
            load_matrix(matrix_with(tmp_path, ('[cuda."13.0"]\n', '[cuda."13.0"]\nnccl_flor = "2.27.3"\n')))
        assert "cuda.'13.0': unknown key 'nccl_flor'" in str(e.value) and "nccl_floor" in str(e.value)
        with pytest.raises(UserError, match=r"cuda.'13.0': nccl_floor must be a string, got int"):
            load_matrix(matrix_with(tmp_path, ('[cuda."13.0"]\n', '[cuda."13.0"]\nnccl_floor = 2\n')))
    with pytest.raises(UserError, match="unknown key 'nccl_floor'"):   # without the field, no such key
        load_matrix(matrix_with(tmp_path, ('[cuda."13.0"]\n', '[cuda."13.0"]\nnccl_floor = "2.27.3"\n')))


def test_a_required_key_is_required_in_every_row(tmp_path):
    with cell_with("nvlink", model.from_table("gpu", required=True, type=bool, default=False), bool):
        edits = [(f"[gpu.{g}]\n", f"[gpu.{g}]\nnvlink = {v}\n") for g, v in (("ampere", "true"), ("hopper", "true"))]
        with pytest.raises(UserError, match=r"gpu.blackwell: missing required key 'nvlink'"):
            load_matrix(matrix_with(tmp_path, *edits))
        m = load_matrix(matrix_with(tmp_path, *edits, ("[gpu.blackwell]\n", "[gpu.blackwell]\nnvlink = false\n")))
        assert {(c.gpu, c.nvlink) for c in m.cells} == {("ampere", True), ("hopper", True), ("blackwell", False),
                                                        (None, False)}


def test_an_explicit_cell_overrides_a_key_before_its_cuda(tmp_path):
    with cell_with("note", model.from_table("cell", "cuda", default=None)):
        m = load_matrix(matrix_with(tmp_path, ('[cuda."13.0"]\n', '[cuda."13.0"]\nnote = "cuda"\n'),
                                    ('[[cell]]\nname = "smoke"\n', '[[cell]]\nname = "smoke"\nnote = "smoke"\n')))
        assert {c.note for c in m.cells if c.name == "smoke"} == {"smoke"}
        assert {c.note for c in m.cells if c.cuda == "13.0"} == {"cuda"}
