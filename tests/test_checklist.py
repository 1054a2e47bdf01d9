"""Every backend with a driver has everything docs/contributing.md's "Adding a backend"
lists: one check per row of that table, run on each such backend of the registry.

The table is the list: a row whose check is missing here, or a check without a row, fails
(so the checklist and this test cannot drift), and so does a check whose files the row
does not name.
"""

from __future__ import annotations

import ast
import re
from functools import cache
from pathlib import Path

import pytest
from checklists import CONTRIBUTING, Checks, missing, table_rows

import simple_mutex.caches
from simple_mutex.caches import registry
from simple_mutex.caches.registry import Backend

pytestmark = pytest.mark.fast

ROOT = Path(__file__).resolve().parent.parent
WITH_DRIVER = [backend for backend in registry.BACKENDS if backend.drivers]


@cache
def text(path: str) -> str:
    return (ROOT / path).read_text(encoding="utf-8")


def tier(backend: Backend) -> str:
    """The backend's folder (or module) under simple_mutex/caches/: its extra's name too."""
    return (backend.where or backend.name).split(".")[0]


def stem(backend: Backend) -> str:
    return backend.cls.removesuffix("Cache")


def suite_classes(bases: set[str]) -> set[str]:
    """The names of the test files' classes that derive from one of ``bases``."""
    found = set()
    for path in (ROOT / "tests").rglob("test_*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ClassDef):
                names = {base.id for base in node.bases if isinstance(base, ast.Name)}
                if names & bases:
                    found.add(node.name)
    return found


def fixture_params(path: str) -> str:
    """The ``params=[...]`` lists of a test file's fixtures, as text."""
    return " ".join(re.findall(r"params=\[[^\]]*\]", text(path)))


def twin(backend: Backend) -> Backend | None:
    """The other face (blocking or asyncio) of the backend, if it has one."""
    other = backend.name.removesuffix("_async")
    other = other if other != backend.name else f"{backend.name}_async"
    return next((b for b in registry.BACKENDS if b.name == other), None)


# Each check: the files its row must name (``<tier>`` as in the table), and what is missing
# for a backend (empty when it holds).
check: Checks[Backend] = Checks()
CHECKS = check.checks


@check("registry", "simple_mutex/caches/registry.py")
def _registry(b: Backend) -> list[str]:
    return missing(defines_the_class=registry.cache_class(b).__name__ == b.cls)


@check("module", "simple_mutex/caches/<tier>/")
def _module(b: Backend) -> list[str]:
    module = ROOT / "simple_mutex" / "caches" / ((b.where or b.name).replace(".", "/") + ".py")
    return missing(module_file=module.is_file())


@check("exports", "simple_mutex/caches/__init__.py")
def _exports(b: Backend) -> list[str]:
    caches = simple_mutex.caches
    return missing(
        in_all=b.cls in caches.__all__,
        lazy_import=getattr(caches, b.cls, None) is registry.cache_class(b),
        in_docstring=b.cls in (caches.__doc__ or ""),
    )


@check("layout", "docs/contributing.md")
def _layout(b: Backend) -> list[str]:
    layout = text("docs/contributing.md").split("## Layout", 1)[1].split("```")[1]
    return missing(in_layout=f" {tier(b)}/ " in layout or f" {tier(b)}.py" in layout)


@check("reference", "docs/reference.md")
def _reference(b: Backend) -> list[str]:
    entry = f"::: simple_mutex.caches.{tier(b)}.{b.cls}\n"
    return missing(reference_entry=entry in text("docs/reference.md"))


@check("extra", "pyproject.toml")
def _extra(b: Backend) -> list[str]:
    extra = re.search(rf"^{b.extra} = \[", text("pyproject.toml"), re.MULTILINE)
    return missing(extra_is_tier=b.extra == tier(b), extra_in_pyproject=extra is not None)


@check("check_extras", "scripts/check_extras.sh", "scripts/extras/check.py")
def _check_extras(b: Backend) -> list[str]:
    must = re.search(r"for must in ([^;]*);", text("scripts/check_extras.sh"))
    return missing(
        in_must_list=must is not None and b.extra in must[1].split(),
        check_function=f'"{b.extra}": check_{b.extra},' in text("scripts/extras/check.py"),
    )


@check("lower_bounds", "scripts/check_lower_bounds.sh")
def _lower_bounds(b: Backend) -> list[str]:
    script = text("scripts/check_lower_bounds.sh")
    extras = re.search(r'^USER_EXTRAS="([^"]*)"', script, re.MULTILINE)
    return missing(
        in_user_extras=extras is not None and b.extra in extras[1].split(","),
        tests_run=f"tests/caches/test_{tier(b)}.py" in script,
    )


@check("contract", "tests/caches/test_<tier>.py")
def _contract(b: Backend) -> list[str]:
    suites = suite_classes({"CacheContract"})
    return missing(contract_suite=any(name.startswith(f"Test{stem(b)}") for name in suites))


@check("behaviour", "tests/caches/test_<tier>.py")
def _behaviour(b: Backend) -> list[str]:
    if not b.schemes:
        return []  # the suite builds its caches from a URL
    suites = suite_classes({"SharedBehaviour", "LockBehaviour"})
    return missing(behaviour_suite=f"Test{stem(b)}Behaviour" in suites)


@check("faces", "tests/test_faces.py")
def _faces(b: Backend) -> list[str]:
    other = twin(b)
    if other is None:
        return []
    import test_faces

    pairs = {(sync.__name__, aio.__name__) for sync, aio in test_faces.CACHES}
    return missing(pair_in_caches={(b.cls, other.cls), (other.cls, b.cls)} & pairs != set())


@check("hostile", "tests/caches/test_hostile.py")
def _hostile(b: Backend) -> list[str]:
    return missing(hostile_tier=f'"{tier(b)}"' in fixture_params("tests/caches/test_hostile.py"))


@check("faults", "tests/test_faults.py")
def _faults(b: Backend) -> list[str]:
    return missing(faults_tier=f'"{tier(b)}"' in fixture_params("tests/test_faults.py"))


@check("guide", "docs/guides/<tier>.md", "mkdocs.yml")
def _guide(b: Backend) -> list[str]:
    page = ROOT / "docs" / "guides" / f"{tier(b)}.md"
    return missing(
        guide_names_class=page.is_file() and b.cls in page.read_text(encoding="utf-8"),
        in_nav=f": guides/{tier(b)}.md\n" in text("mkdocs.yml"),
    )


@check("doc_examples", "tests/test_docs.py")
def _doc_examples(b: Backend) -> list[str]:
    return missing(examples_run=f'"{tier(b)}.md"' in text("tests/test_docs.py"))


@check("design", "docs/design/<tier>.md", "docs/design/index.md")
def _design(b: Backend) -> list[str]:
    return missing(
        design_note=(ROOT / "docs" / "design" / f"{tier(b)}.md").is_file(),
        in_index=f"]({tier(b)}.md) |" in text("docs/design/index.md"),
    )


@check("readme", "README.md")
def _readme(b: Backend) -> list[str]:
    readme = text("README.md")
    table = readme.split("| cache | scope |", 1)[1].split("\n\n", 1)[0]
    return missing(
        in_tier_table=f"`{b.cls}" in table,
        in_install_table=f"`simple-mutex[{b.extra}]`" in readme,
    )


@check("bench", "bench/bench_<tier>.py")
def _bench(b: Backend) -> list[str]:
    return missing(bench_script=(ROOT / "bench" / f"bench_{tier(b)}.py").is_file())


def checklist() -> dict[str, str]:
    return table_rows("Adding a backend")


def test_the_checklist_and_the_checks_are_one_list() -> None:
    rows = checklist()
    assert len(rows) >= 10, "the table of 'Adding a backend' was not found"
    assert sorted(rows) == sorted(CHECKS), "a row without a check, or a check without a row"
    for name, (files, _) in CHECKS.items():
        for file in files:
            assert f"`{file}`" in rows[name], f"row {name!r} does not name {file}"


@pytest.mark.parametrize("backend", WITH_DRIVER, ids=lambda b: b.name)
@pytest.mark.parametrize("name", sorted(CHECKS))
def test_every_backend_has_what_the_checklist_lists(backend: Backend, name: str) -> None:
    _, run = CHECKS[name]
    assert run(backend) == [], f"{backend.name} ({backend.cls}): see '{name}' in {CONTRIBUTING}"


def test_a_check_fails_for_a_backend_that_lacks_the_file() -> None:
    fake = Backend("ghost", "GhostCache", ("ghost",), (), ("ghostdriver",), "ghost")
    for name in ("module", "extra", "guide", "design", "bench", "readme", "hostile"):
        assert CHECKS[name][1](fake), name
