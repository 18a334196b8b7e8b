"""Fuzz the matrix loader: whatever the file holds, the answer is a Matrix or one UserError line, never a traceback."""
import copy
import datetime
import os
import tomllib

from hypothesis import HealthCheck, given, settings, strategies as st

from builder.errors import UserError
from builder.matrix import load_matrix
from builder.matrix.expand import build_matrix
from builder.paths import ROOT

BASE_TEXT = (ROOT / "matrix.toml").read_text()
BASE = tomllib.loads(BASE_TEXT)
SETTINGS = settings(max_examples=int(os.environ.get("TRAINBOX_FUZZ_EXAMPLES", "300")), deadline=None, suppress_health_check=[HealthCheck.too_slow])

# Values a TOML document can hold, small.
scalars = st.one_of(st.text(max_size=12), st.integers(-3, 20), st.booleans(), st.floats(allow_nan=False),
                    st.just(datetime.date(2026, 11, 21)),
                    st.sampled_from(["x86_64", "aarch64", "12.9", "hopper", "fa3", "gpu", "{name}", "{0}", "{x.y}",
                                     "{name!z}", "", "9.0a", ">=1,<2", "0.31.0", "2.14.0", "train", "cu129"]))
values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                       st.dictionaries(st.text(max_size=8), inner, max_size=4)),
                      max_leaves=8)


def paths(node, prefix=()):
    """Every key path in the nested dict/list document."""
    out = []
    if isinstance(node, dict):
        for k, v in node.items():
            out.append(prefix + (k,))
            out.extend(paths(v, prefix + (k,)))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            out.append(prefix + (i,))
            out.extend(paths(v, prefix + (i,)))
    return out


def mutate(doc, mutations):
    """DOC with each (path, op, value, new key) applied where the path still exists (op: set, delete, add)."""
    doc = copy.deepcopy(doc)
    for path, op, value, new_key in mutations:
        parent = doc
        try:
            for k in path[:-1]:
                parent = parent[k]
            if op == "set":
                parent[path[-1]] = value
            elif op == "delete":
                del parent[path[-1]]
            elif isinstance(parent, dict):
                parent[new_key] = value
        except (KeyError, IndexError, TypeError):
            continue   # an earlier mutation removed or retyped this path
    return doc


ALL_PATHS = paths(BASE)


def check(doc):
    try:
        m = build_matrix(ROOT / "fuzz.toml", doc)
    except UserError as e:
        text = str(e)
        assert text and "\n" not in text and "fuzz.toml" in text
        return None
    assert m.cells
    return m


@SETTINGS
@given(st.lists(st.tuples(st.sampled_from(ALL_PATHS), st.sampled_from(["set", "delete", "add"]), values,
                          st.text(min_size=1, max_size=8)), min_size=1, max_size=4))
def test_mutated_documents(mutations):
    check(mutate(BASE, mutations))


@SETTINGS
@given(st.lists(st.tuples(st.integers(0, len(BASE_TEXT) - 1), st.integers(0, 40),
                          st.text(alphabet=st.sampled_from(list('[]{}="\',.\n#abc019_-\\ ')), max_size=12)),
                min_size=1, max_size=3))
def test_mutated_text(tmp_path_factory, edits):
    text = BASE_TEXT
    for pos, length, insert in edits:
        text = text[:pos] + insert + text[pos + length:]
    p = tmp_path_factory.mktemp("fuzz") / "m.toml"
    p.write_text(text)
    try:
        load_matrix(p)
    except UserError as e:
        assert "\n" not in str(e) and str(p) in str(e)


@SETTINGS
@given(st.binary(max_size=200))
def test_arbitrary_bytes(tmp_path_factory, raw):
    p = tmp_path_factory.mktemp("fuzz") / "m.toml"
    p.write_bytes(raw)
    try:
        load_matrix(p)
    except UserError as e:
        assert "\n" not in str(e)


def test_hostile_values():
    for tag in ("{name.real}", "{name[0]}", "{arch:>{name}}", "{}", "{name!z}"):
        doc = copy.deepcopy(BASE)
        doc["naming"]["tag"] = tag
        check(doc)
    doc = copy.deepcopy(BASE)
    doc["arch"]["bad\nname"] = 3
    check(doc)
    doc = copy.deepcopy(BASE)
    doc["cell"][0]["arch"] = []
    check(doc)


def test_the_real_matrix_survives_the_harness():
    assert check(copy.deepcopy(BASE)) is not None
