"""The folders are the layers, and the map says so (issue 22).

* ``_core`` decides and does no I/O: its modules, and what they import of the package,
  import nothing that sleeps, blocks, spawns or touches a socket or a file.
* The lower layers never import the higher ones: ``_core`` imports no ``_runtime``,
  neither imports the user API, the backends or the integrations.
* ``docs/contributing.md`` names every module of ``simple_mutex/`` (its Layout map), and
  every name it gives exists.
* Every public import path of DESIGN §3 and §9 still imports.
"""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.fast

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "simple_mutex"

# What a module of _core may import: computation only.
CORE_STDLIB = {"__future__", "collections", "dataclasses", "typing", "hashlib", "json",
               "re", "string", "math", "functools", "secrets", "enum", "datetime",
               "urllib"}  # fmt: skip
# records.py reads the host name and pid once, for the record's holder fields: the one
# allowed look at the process (no I/O per lock cycle).
ALLOWED = {("records.py", "os"), ("records.py", "socket")}
CORE_PACKAGE = {"simple_mutex._core", "simple_mutex.contract", "simple_mutex.errors"}


def _imports(path: Path) -> list[tuple[str, bool]]:
    """Every module ``path`` imports, and whether only for type checking."""
    tree = ast.parse(path.read_text())
    found: list[tuple[str, bool]] = []
    typing_only: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            typing_only |= {id(n) for n in ast.walk(node)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name, id(node) in typing_only) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0 or path.parent.name != "_core", f"{path}: relative import"
            module = node.module or ""
            if module == "simple_mutex._core" or module == "simple_mutex":
                found += [(f"{module}.{a.name}", id(node) in typing_only) for a in node.names]
            else:
                found.append((module, id(node) in typing_only))
    return found


CORE = sorted(p for p in (PACKAGE / "_core").glob("*.py"))


@pytest.mark.parametrize("path", CORE, ids=[p.name for p in CORE])
def test_the_core_imports_nothing_that_waits_or_does_io(path: Path) -> None:
    for module, typing_only in _imports(path):
        if typing_only:
            continue
        top = module.split(".")[0]
        if top == "simple_mutex":
            assert any(module == m or module.startswith(m + ".") for m in CORE_PACKAGE), (
                f"{path.name} imports {module}: the core may use only the core, the "
                "contract and the errors"
            )
        else:
            assert top in CORE_STDLIB or (path.name, top) in ALLOWED, (
                f"{path.name} imports {module}, which may wait or do I/O"
            )


def test_what_the_core_leans_on_does_no_io_either() -> None:
    """The contract and the errors, which the core imports, import no I/O module."""
    for name in ("contract.py", "errors.py"):
        for module, typing_only in _imports(PACKAGE / name):
            top = module.split(".")[0]
            assert typing_only or top in CORE_STDLIB | {"inspect"}, (name, module)


def test_the_runtime_does_not_reach_up_into_the_user_api_or_the_backends() -> None:
    upper = ("simple_mutex.mutex", "simple_mutex.lease", "simple_mutex.caches",
             "simple_mutex.decorator", "celery_mutex", "rq_mutex",
             "simple_mutex.admin")  # fmt: skip
    for path in sorted((PACKAGE / "_runtime").glob("*.py")):
        for module, _ in _imports(path):
            assert not module.startswith(upper), f"{path.name} imports {module}"


def test_the_integrations_use_no_private_module_of_the_core() -> None:
    """celery_mutex and rq_mutex reach the core through its public modules (what both
    share is in simple_mutex.busy), never through _core or _runtime."""
    for path in sorted([*(ROOT / "celery_mutex").glob("*.py"), *(ROOT / "rq_mutex").glob("*.py")]):
        for module, _ in _imports(path):
            assert not module.startswith("simple_mutex._"), f"{path.name} imports {module}"


# Underscored names that are the public API of what they are read on: a NamedTuple's
# methods (our Entry, urllib's SplitResult), underscored only to keep clear of field names.
NAMEDTUPLE_API = {"_replace", "_asdict", "_fields", "_make", "_field_defaults"}
# Private names a cache module reads or sets on an object that is not ``self``/``cls``,
# by module (under simple_mutex/caches/) and expression. Only objects of our own belong
# here; a driver's object is used through its public API, whatever its version.
OWN_OBJECTS = {
    # from_url sets them on the MongoCache it has just built.
    ("mongo/sync.py", "cache._connect"),
    ("mongo/sync.py", "cache._client"),
}
# Private names of a driver's objects a cache module still reads, by module and
# expression, each with the reason it cannot be helped. None: the last one (pymongo's
# ``MongoClient._duplicate``, a forked child's copy of a client the user passed) gave way
# to public API: a URL or a client factory makes each process's own client, and a client
# passed as it is is used on (pymongo >= 4.3 resets it in a forked child).
DRIVER_PRIVATE: set[tuple[str, str]] = set()


def _private_reads(path: Path) -> list[str]:
    """``value._name`` (not a dunder) on anything but ``self``/``cls``, spelled as an
    attribute or as ``getattr``/``hasattr``/``setattr``/``delattr`` with a literal."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute):
            value, name = node.value, node.attr
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "hasattr", "setattr", "delattr")
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and isinstance(node.args[1].value, str)
        ):
            value, name = node.args[0], node.args[1].value
        else:
            continue
        if not name.startswith("_") or (name.startswith("__") and name.endswith("__")):
            continue
        if isinstance(value, ast.Name) and value.id in ("self", "cls"):
            continue
        if name not in NAMEDTUPLE_API:
            found.append(f"{ast.unparse(value)}.{name}")
    return found


def test_no_cache_module_reads_a_private_attribute_of_a_driver_object() -> None:
    """A driver's private attributes change without notice between the versions we
    support (redis-py 4.6 to 8): caches use public API only (issue 22)."""
    caches = PACKAGE / "caches"
    found = {
        (str(path.relative_to(caches)), expression)
        for path in sorted(caches.rglob("*.py"))
        for expression in _private_reads(path)
    }
    assert found - OWN_OBJECTS - DRIVER_PRIVATE == set(), "private attributes of a driver"
    assert found >= OWN_OBJECTS | DRIVER_PRIVATE, "an exception no longer needed: drop it"


def test_the_private_read_check_sees_both_spellings(tmp_path: Path) -> None:
    probe = tmp_path / "probe.py"
    probe.write_text(
        "conn._sock\ngetattr(conn, '_writer', None)\nself._own\nentry._replace()\n"
        "self._cache._max_block\ntype(x).__name__\n"
    )
    found = sorted(_private_reads(probe))
    assert found == ["conn._sock", "conn._writer", "self._cache._max_block"]


def _layout_block() -> str:
    text = (ROOT / "docs" / "contributing.md").read_text()
    section = text[text.index("## Layout") :]
    return section[section.index("```\n") + 4 : section.index("\n```", section.index("```\n") + 4)]


def test_the_contributing_map_names_every_module_and_nothing_else() -> None:
    block = _layout_block()
    lines = block.splitlines()
    # The block of simple_mutex/: up to the next top-level folder.
    end = next(i for i, line in enumerate(lines) if line.startswith("celery_mutex/"))
    ours = "\n".join(lines[1:end])
    named: set[str] = set()
    folder = ""
    for line in ours.splitlines():
        head = re.match(r"  (\S+/)", line)
        if head:
            folder = head.group(1)
        elif re.match(r"  \S", line):
            folder = ""
        # A line of a folder may name a folder of its own ("redis/ sync.py ..."): the
        # modules after it on that line are in it.
        sub = ""
        for word in re.findall(r"(?<![\w/])\w+/(?=\s)|\b\w+\.py\b", line):
            if word.endswith("/"):
                sub = "" if folder == word else word
            else:
                named.add(folder + sub + word)
    files = {str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py")}
    # A folder's __init__.py comes with the folder, unless the map says what it holds.
    folders = {name.rsplit("/", 1)[0] + "/" for name in named if "/" in name}
    folders |= {f.split("/")[0] + "/" for f in folders}
    named |= {f + "__init__.py" for f in folders}
    assert files - named == set(), "modules the map of docs/contributing.md leaves out"
    assert named - files == set(), "names in the map of docs/contributing.md that do not exist"


def test_the_readme_names_the_same_folders_as_the_map_and_the_package() -> None:
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## How it is built") :]
    section = section[: section.index("\n## ")]
    in_readme = set(re.findall(r"`(\w+)/`", section)) - {"simple_mutex"}
    in_map = set(re.findall(r"^  (\w+)/ ", _layout_block(), re.M))
    on_disk = {p.parent.name for p in PACKAGE.glob("*/__init__.py")}
    assert in_readme == in_map == on_disk


def test_the_tests_mirror_the_packages() -> None:
    """A folder of tests is a folder of simple_mutex/ or an integration package, and each
    of those with tests of its own has its folder (the support folders hold no tests)."""
    tests = ROOT / "tests"
    folders = {p.parent.name for p in tests.glob("*/test_*.py")}
    package_folders = {p.parent.name for p in PACKAGE.glob("*/__init__.py")}
    integrations = {"celery_mutex", "rq_mutex"}
    assert folders <= package_folders | integrations, "test folders that mirror nothing"
    assert integrations <= folders
    # Nothing of an integration or a package folder is tested from the top level.
    top = {p.stem.removeprefix("test_") for p in tests.glob("test_*.py")}
    strays = {t for t in top if t.split("_")[0] in {"celery", "rq", "beat", "cli", "fenced"}}
    assert strays == set(), f"tests of a folder at the top of tests/: {strays}"
    assert {"contract.py", "behaviour.py", "conftest.py"} <= {p.name for p in tests.glob("*.py")}


PUBLIC = [
    "simple_mutex", "simple_mutex.caches", "simple_mutex.contract", "simple_mutex.errors",
    "simple_mutex.events", "simple_mutex.testing", "simple_mutex.pytest_plugin",
    "simple_mutex.contrib.prometheus", "simple_mutex.contrib.opentelemetry",
    "simple_mutex.fenced", "simple_mutex.journal", "simple_mutex.journal.timeline",
    "simple_mutex.admin", "simple_mutex.admin.cli", "simple_mutex.busy",
    "celery_mutex", "celery_mutex.beat", "rq_mutex",
]  # fmt: skip


@pytest.mark.parametrize("name", PUBLIC)
def test_every_public_import_path_imports(name: str) -> None:
    importlib.import_module(name)  # the test extras install every sink's package


# DESIGN §3's imports, module by module, in its order.
DESIGN_3 = {
    "simple_mutex": [
        "with_simple_mutex", "Mutex", "Semaphore", "Lease", "InMemoryCache", "DiskCache",
        "cache_from_url", "SimpleMutexError", "ConstraintError", "MalfunctionError",
        "SimpleMutexAcquireTimeoutError", "SimpleMutexLeaseExpiredError",
        "SimpleCacheConditionError",
    ],
    "simple_mutex.caches": ["RedisCache", "PostgresCache", "MongoCache", "S3Cache"],
    "celery_mutex": ["MutexTask"],
    "celery_mutex.beat": ["MutexScheduler"],
    "rq_mutex": ["mutex_job"],
}  # fmt: skip


@pytest.mark.parametrize(
    ("module", "name"), [(module, name) for module, names in DESIGN_3.items() for name in names]
)
def test_each_name_of_design_section_3_imports(module: str, name: str) -> None:
    assert hasattr(importlib.import_module(module), name)  # as `from module import name`


CITED_RULE = re.compile(r"lifecycle\s+(?:#\s*)?rule\s+(?:#\s*)?(\d+)")


def test_the_code_cites_only_what_the_repository_holds() -> None:
    """The design travels with the code: a comment or docstring names a page of docs/, a
    lifecycle rule of docs/design/lifecycle.md by its number, never a design document or
    an issue number the repository does not have."""
    rules = re.findall(r"^(\d+)\. ", (ROOT / "docs/design/lifecycle.md").read_text(), re.M)
    for package in ("simple_mutex", "celery_mutex", "rq_mutex"):
        for path in sorted((ROOT / package).rglob("*.py")):
            text = path.read_text()
            outside = re.findall(r"DESIGN|§|\bissues? #?\d+", text)
            assert outside == [], f"{path.relative_to(ROOT)} cites {outside}"
            for rule in CITED_RULE.findall(text):
                assert rule in rules, f"{path.relative_to(ROOT)} cites lifecycle rule {rule}"
            for page in re.findall(r"docs/[\w/.-]+\.md", text):
                assert (ROOT / page).is_file(), f"{path.relative_to(ROOT)} cites {page}"


def test_the_user_docs_cite_no_issue_or_design_document() -> None:
    """What users read (the README, the changelog, docs/) names no issue number and no
    design document the repository lacks: the reader has neither. (An upstream project's
    issue is cited by its repository and ``#``, as in "celery-once issues #114".)"""
    pages = [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").rglob("*.md"))]
    for path in pages:
        text = path.read_text()
        outside = re.findall(r"DESIGN|§|\bissues? \d+", text)
        assert outside == [], f"{path.relative_to(ROOT)} cites {outside}"


def _import_graph() -> dict[str, set[str]]:
    """Module -> the modules of the three packages it imports, at any depth of its code
    (a function-level import holds a circle open as well as a top-level one). A package's
    ``__init__`` re-exports its modules and is left out: a facade, not a layer."""
    modules: dict[str, Path] = {}
    for package in ("simple_mutex", "celery_mutex", "rq_mutex"):
        for path in (ROOT / package).rglob("*.py"):
            if path.name != "__init__.py":
                modules[".".join(path.relative_to(ROOT).with_suffix("").parts)] = path
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = name.split(".")[: -node.level] if node.level else []
                module = ".".join([*base, *([node.module] if node.module else [])])
                targets = [module, *(f"{module}.{alias.name}" for alias in node.names)]
            else:
                continue
            found |= {t for t in targets if t in modules and t != name}
        graph[name] = found
    return graph


def test_no_module_of_the_three_packages_imports_itself_round_a_circle() -> None:
    graph = _import_graph()

    def circle_from(start: str) -> list[str] | None:
        path, seen = [start], {start}

        def walk(node: str) -> list[str] | None:
            for nxt in sorted(graph[node]):
                if nxt == start:
                    return [*path, start]
                if nxt not in seen:
                    seen.add(nxt)
                    path.append(nxt)
                    if (found := walk(nxt)) is not None:
                        return found
                    path.pop()
            return None

        return walk(start)

    circles = [c for c in map(circle_from, sorted(graph)) if c is not None]
    assert circles == [], f"import circles: {' ; '.join(' -> '.join(c) for c in circles)}"
