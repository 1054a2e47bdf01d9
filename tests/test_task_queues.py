"""Every task queue has everything docs/contributing.md's "Adding a task queue" lists:
one check per row of that table, run on each queue of ``QUEUES``.

The table is the list: a row whose check is missing here, or a check without a row, fails
(so the checklist and this test cannot drift), and so does a check whose files the row
does not name. The ``port`` check reads the port's members from
``simple_mutex.busy.port.Call`` itself, so a member added there is a member every queue
must define.
"""

from __future__ import annotations

import ast
import re
from functools import cache
from pathlib import Path

import pytest
from checklists import CONTRIBUTING, Checks, missing, table_rows

from simple_mutex.busy import port

pytestmark = pytest.mark.fast

ROOT = Path(__file__).resolve().parent.parent
QUEUES = ("celery", "rq")


@cache
def text(path: str) -> str:
    found = ROOT / path
    return found.read_text(encoding="utf-8") if found.is_file() else ""


check: Checks[str] = Checks()
CHECKS = check.checks


def port_members() -> set[str]:
    """Every member a ``Call`` must have: its own and its ``Publisher``'s."""
    members: set[str] = set()
    for protocol in (port.Call, port.Publisher):
        members |= {n for n in vars(protocol) if not n.startswith("_")}
    return members


def defined(cls: ast.ClassDef, classes: dict[str, ast.ClassDef]) -> set[str]:
    """The names a class of the module defines, its bases' in the module included."""
    names: set[str] = set()
    for node in cls.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            names.add(node.name)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, ast.Assign):
            names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
    for base in cls.bases:
        if isinstance(base, ast.Name) and base.id in classes:
            names |= defined(classes[base.id], classes)
    return names


@check("port", "<queue>_mutex/line.py")
def _port(queue: str) -> list[str]:
    source = text(f"{queue}_mutex/line.py")
    tree = ast.parse(source) if source else ast.Module(body=[], type_ignores=[])
    classes = {n.name: n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)}
    wanted = port_members()
    return missing(
        implements_call=any(wanted <= defined(c, classes) for c in classes.values()),
        arrives_through_the_driver="driver.arrive(" in source,
        ends_through_the_driver="driver.end(" in source,
        no_loop_of_its_own="ARRIVALS" not in source,
    )


@check("package", "<queue>_mutex/__init__.py")
def _package(queue: str) -> list[str]:
    return missing(exports_is_skipped='"is_skipped"' in text(f"{queue}_mutex/__init__.py"))


@check("extra", "pyproject.toml")
def _extra(queue: str) -> list[str]:
    pyproject = text("pyproject.toml")
    return missing(
        extra=re.search(rf"^{queue} = \[", pyproject, re.MULTILINE) is not None,
        lower_bound=re.search(rf"^{queue} = \[[^\]]*>=", pyproject, re.MULTILINE) is not None,
        in_wheel=f'"{queue}_mutex*"' in pyproject,
        typed=f'{queue}_mutex = ["py.typed"]' in pyproject,
    )


@check("check_extras", "scripts/check_extras.sh", "scripts/extras/check.py")
def _check_extras(queue: str) -> list[str]:
    must = re.search(r"for must in ([^;]*);", text("scripts/check_extras.sh"))
    return missing(
        in_must_list=must is not None and queue in must[1].split(),
        check_function=f"def check_{queue}(" in text("scripts/extras/check.py"),
    )


@check("lower_bounds", "scripts/check_lower_bounds.sh")
def _lower_bounds(queue: str) -> list[str]:
    script = text("scripts/check_lower_bounds.sh")
    extras = re.search(r'^USER_EXTRAS="([^"]*)"', script, re.MULTILINE)
    return missing(
        in_user_extras=extras is not None and queue in extras[1].split(","),
        tests_run=f"tests/{queue}_mutex/" in script,
    )


@check("tests", "tests/<queue>_mutex/test_<queue>_line.py")
def _tests(queue: str) -> list[str]:
    return missing(line_tests=bool(text(f"tests/{queue}_mutex/test_{queue}_line.py")))


@check("nemesis", "tests/test_nemesis.py", "tests/nemesis/")
def _nemesis(queue: str) -> list[str]:
    tiers = re.search(r'parametrize\("tier", \[([^\]]*)\]', text("tests/test_nemesis.py"))
    return missing(nemesis_tier=tiers is not None and f'"{queue}"' in tiers[1])


@check("demo", "examples/<queue>_demo.py", "scripts/demo.sh")
def _demo(queue: str) -> list[str]:
    return missing(
        demo=bool(text(f"examples/{queue}_demo.py")),
        run_by_the_demo_command=f"examples/{queue}_demo.py" in text("scripts/demo.sh"),
    )


@check("guide", "docs/guides/<queue>.md", "mkdocs.yml")
def _guide(queue: str) -> list[str]:
    return missing(
        guide=bool(text(f"docs/guides/{queue}.md")),
        in_nav=f"guides/{queue}.md" in text("mkdocs.yml"),
    )


@check("design", "docs/design/tasks.md")
def _design(queue: str) -> list[str]:
    header = re.search(r"^\| member \|(.*)\|$", text("docs/design/tasks.md"), re.MULTILINE)
    columns = [c.strip().lower() for c in header[1].split("|")] if header else []
    return missing(port_column=queue in columns)


@check("layout", "docs/contributing.md")
def _layout(queue: str) -> list[str]:
    layout = text("docs/contributing.md").split("## Layout", 1)[1].split("```")[1]
    return missing(in_layout=f"\n{queue}_mutex/ " in layout)


@check("readme", "README.md")
def _readme(queue: str) -> list[str]:
    return missing(in_install_table=f"`simple-mutex[{queue}]`" in text("README.md"))


def checklist() -> dict[str, str]:
    return table_rows("Adding a task queue")


def test_the_checklist_and_the_checks_are_one_list() -> None:
    rows = checklist()
    assert len(rows) >= 10, "the table of 'Adding a task queue' was not found"
    assert sorted(rows) == sorted(CHECKS), "a row without a check, or a check without a row"
    for name, (files, _) in CHECKS.items():
        for file in files:
            assert f"`{file}`" in rows[name], f"row {name!r} does not name {file}"


@pytest.mark.parametrize("queue", QUEUES)
@pytest.mark.parametrize("name", sorted(CHECKS))
def test_every_task_queue_has_what_the_checklist_lists(queue: str, name: str) -> None:
    _, run = CHECKS[name]
    assert run(queue) == [], f"{queue}: see '{name}' in {CONTRIBUTING}"


def test_a_check_fails_for_a_queue_that_lacks_the_files() -> None:
    for name, (_, run) in CHECKS.items():
        assert run("ghost"), name
