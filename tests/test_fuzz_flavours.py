"""Fuzz [flavour.NAME] names, files and sdists (issue 29: the surfaces the matrix fuzzers missed). Whatever the
flavours say: one UserError line naming the file, or a matrix where every cell name has one source, every `files`
folder is a real folder of the build context (never a link, never outside the .dockerignore allowlist), every sdist
is a package the flavour installs, and packages are keyed by their PEP 503 names."""
from __future__ import annotations

import copy
import os
import re
import tomllib

from hypothesis import HealthCheck, example, given, settings, strategies as st
from packaging.utils import canonicalize_name

from builder.errors import UserError
from builder.matrix import load_matrix
from builder.matrix.locknames import lock_names
from builder.paths import ROOT
from test_fuzz_cli import hostile, toml_doc
from test_fuzz_matrix import mutate  # the matrix fuzzer's document mutations

SETTINGS = settings(max_examples=int(os.environ.get("TRAINBOX_FUZZ_EXAMPLES", "60")), deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
DOC = tomllib.loads((ROOT / "matrix.toml").read_text())
REAL = load_matrix()
# what the build context holds: the .dockerignore allowlist's folders (locks/ only for its *.txt files)
CONTEXT_TOPS = ("images", "trainbox", "common", "wheelhouse", "locks")

folders = st.one_of(hostile, st.sampled_from([
    "images", "images/notebooks", "images/notebooks/unsloth", "images/smoke-x86_64", "images/certs", "trainbox",
    "wheelhouse", "locks", "builder", "builder/templates", "tests", "devenv", ".git", ".github/workflows", "..",
    "../x", "images/../builder", "images//notebooks", "images/./notebooks", "/etc", "images/notebooks/unsloth/",
    "images/smoke-x86_64/Dockerfile", "a" * 300]))
packages = st.one_of(hostile, st.sampled_from(sorted(
    {p for c in REAL.cells for p in c.pins} | {"antlr4-python3-runtime", "ANTLR4_Python3.Runtime", "TRL", "trl",
                                               "liger_kernel", "Liger-Kernel", "no-such-package-xyz", "-e", "a b"})))
names = st.one_of(hostile, st.sampled_from(["a", "x", "smoke", "unsloth", "verl", "A", "-a", "a" * 33, "unsloth-stack",
                                            "ampere", "x86_64"]))
cell_refs = st.sampled_from(sorted({c.name for c in REAL.cells if not c.flavour}
                                   | {c.tag for c in REAL.cells if not c.flavour}))
flavour_tables = st.fixed_dictionaries(
    {"cells": st.lists(cell_refs, min_size=1, max_size=2, unique=True),
     "packages": st.dictionaries(packages, st.sampled_from(["6.0.3", "1.15.0", "4.8.5", "1.0"]), min_size=1,
                                 max_size=3)},
    optional={"files": st.dictionaries(folders, st.sampled_from(["/workspace/x", "/opt/y"]), max_size=2),
              "sdists": st.lists(packages, min_size=1, max_size=3)})
cell_name_templates = st.sampled_from(["{name}-{flavour}", "{name}", "{flavour}", "{name}{flavour}", "x-{flavour}"])


def one_source_per_name(m) -> None:
    sources: dict[str, set] = {}
    for c in m.cells:
        sources.setdefault(c.name, set()).add((c.flavour, c.base.name) if c.flavour else (None, c.cuda, c.gpu,
                                                                                           c.stack.split("+")[0]))
    for name, s in sources.items():
        flavoured = {x for x in s if x[0]}
        assert not (flavoured and len(s) > len(flavoured)) and len(flavoured) <= 1, (name, s)


def check(doc: dict, tmp_path_factory) -> None:
    path = tmp_path_factory.mktemp("flavours") / "matrix.toml"
    path.write_text(toml_doc(doc))
    try:
        m = load_matrix(path)
    except UserError as e:
        assert "\n" not in str(e) and str(path) in str(e), str(e)
        return
    one_source_per_name(m)
    assert len({c.tag for c in m.cells}) == len(m.cells)
    for c in m.cells:
        assert all(p == canonicalize_name(p) for p in c.pins), c.pins
        for src, _dest in c.files:
            real = (ROOT / src)
            assert src.split("/")[0] in CONTEXT_TOPS and src.split("/")[0] != "locks", src
            assert real.is_dir() and os.path.realpath(real) == str(real), src
            assert not any(p.is_symlink() for p in real.rglob("*")), src
        if c.flavour:
            lock = ROOT / "locks" / f"{c.venv}.txt"
            locked = lock_names(lock.read_text()) if lock.is_file() else set()
            for pkg in c.sdists:
                assert pkg == canonicalize_name(pkg) and (pkg in c.pins or pkg in locked or not lock.is_file()), pkg


@SETTINGS
@given(fname=names, table=flavour_tables, template=cell_name_templates)
@example(fname="a", table={"cells": ["smoke"], "packages": {"pyyaml": "6.0.3"}}, template="{name}")
@example(fname="x", table={"cells": ["smoke-x86_64"], "packages": {"trl": "1.15.0", "TRL": "1.16.0"}},
         template="{name}-{flavour}")
@example(fname="x", table={"cells": ["smoke-x86_64"], "packages": {"pyyaml": "6.0.3"},
                           "files": {"builder/templates": "/x"}, "sdists": ["no-such-package-xyz"]},
         template="{name}-{flavour}")
def test_a_new_flavour(tmp_path_factory, fname, table, template):
    doc = copy.deepcopy(DOC)
    doc["flavour"][fname] = table
    doc["naming"]["flavour_cell_name"] = template
    check(doc, tmp_path_factory)


@SETTINGS
@given(st.lists(st.tuples(st.sampled_from([("flavour", f, k) for f in DOC["flavour"]
                                           for k in ("files", "sdists", "packages", "remove", "cells")]
                                          + [("naming", "flavour_cell_name"), ("cell", 0, "name")]),
                          st.sampled_from(["set", "delete"]),
                          st.one_of(folders, st.lists(packages, max_size=3),
                                    st.dictionaries(folders, st.just("/x"), max_size=2),
                                    st.dictionaries(packages, st.just("1.15.0"), max_size=2), cell_name_templates),
                          st.just("")), min_size=1, max_size=3))
def test_mutated_flavours(tmp_path_factory, mutations):
    check(mutate(DOC, mutations), tmp_path_factory)


def test_the_real_matrix_passes_the_invariants(tmp_path_factory):
    one_source_per_name(REAL)
    check(copy.deepcopy(DOC), tmp_path_factory)
    assert any(c.files for c in REAL.cells) and any(c.sdists for c in REAL.cells)
    assert not re.search(r"[A-Z_.]", " ".join(p for c in REAL.cells for p in c.pins))
