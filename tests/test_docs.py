"""Every code example in the README and the guides runs, so the docs cannot rot.

Each fenced ``python`` block of README.md and docs/**/*.md (but docs/design/, the backends'
design notes) runs; the blocks of one page run in order, as one script, in a fresh
interpreter, against real servers. The examples keep the addresses a deployment would use;
SERVERS below points them at the servers this module runs (docs/contributing.md lists the
same table for writers). A block that cannot run carries ``<!-- not-run: reason -->`` on
the line before it; a marker without a reason fails.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from servers import ROOT, load_module, scripts

pytestmark = [pytest.mark.system, pytest.mark.xdist_group("docs")]  # its servers, once

FENCE = re.compile(r"^```python[^\n]*\n(.*?)^```", re.MULTILINE | re.DOTALL)
NOT_RUN = re.compile(r"<!--\s*not-run:(.*?)-->")
POSTGRES_URL = os.environ.get("POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/test")


def pages() -> list[Path]:
    docs = ROOT / "docs"
    guides = [p for p in docs.rglob("*.md") if p.relative_to(docs).parts[0] != "design"]
    return [ROOT / "README.md", *sorted(guides)]


def examples(page: Path) -> list[tuple[int, str]]:
    """(line of its first code line, code) of every block of ``page`` that is meant to run."""
    text = page.read_text()
    found = []
    for match in FENCE.finditer(text):
        before = text[: match.start()].rstrip("\n").rsplit("\n", 1)[-1]
        marker = NOT_RUN.search(before)
        if marker is not None:
            assert marker[1].strip(), f"{page.name}: a not-run marker must give its reason"
            continue
        found.append((text.count("\n", 0, match.start()) + 2, match[1]))
    return found


def script_of(page: Path, substitutions: dict[str, str]) -> str:
    parts = []
    for line, code in examples(page):
        for written, actual in substitutions.items():
            code = code.replace(written, actual)
        parts.append(f"# {page.relative_to(ROOT)}:{line}\n{code}")
    return "\n".join(parts)


PAGES_WITH_CODE = [page for page in pages() if examples(page)]


@pytest.fixture(scope="module")
def redis_url() -> Iterator[str]:
    """A private redis-server: examples enqueue jobs no shared server should keep."""
    with scripts.redis_server() as url:
        yield url


@pytest.fixture(scope="module")
def mongodb_url() -> Iterator[str]:
    with scripts.mongo_server() as url:
        yield url.rstrip("/")


@pytest.fixture(scope="module")
def etcd_url() -> Iterator[str]:
    with scripts.etcd_server() as url:
        yield url


@pytest.fixture(scope="module")
def s3_env() -> Iterator[dict[str, str]]:
    """boto3's own variables point ``boto3.client("s3")`` at SeaweedFS; ``my-bucket`` exists."""
    import boto3

    with scripts.s3_server() as endpoint:
        env = {
            "AWS_ENDPOINT_URL_S3": endpoint,
            "AWS_ACCESS_KEY_ID": scripts.S3_ACCESS_KEY,
            "AWS_SECRET_ACCESS_KEY": scripts.S3_SECRET_KEY,
            "AWS_DEFAULT_REGION": "us-east-1",
        }
        boto3.client(
            "s3", endpoint_url=endpoint, region_name="us-east-1",
            aws_access_key_id=scripts.S3_ACCESS_KEY, aws_secret_access_key=scripts.S3_SECRET_KEY,
        ).create_bucket(Bucket="my-bucket")  # fmt: skip
        yield env


@pytest.mark.parametrize("page", PAGES_WITH_CODE, ids=lambda p: str(p.relative_to(ROOT)))
def test_examples_run(page: Path, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    """The page's python blocks, run in order as one script, exit 0 against real servers."""
    code = "\n".join(code for _, code in examples(page))
    substitutions = {"redis://127.0.0.1:6379/0": request.getfixturevalue("redis_url"),
                     "postgresql://app@db/app": POSTGRES_URL}  # fmt: skip
    env = {**os.environ}
    if "mongodb://db" in code:
        substitutions["mongodb://db"] = request.getfixturevalue("mongodb_url")
    if "etcd://etcd:2379" in code:
        url = request.getfixturevalue("etcd_url")
        substitutions["etcd://etcd:2379"] = url
        host, port = url.removeprefix("etcd://").split(":")
        substitutions['host="etcd", port=2379'] = f'host="{host}", port={port}'
    if "boto3" in code:
        env.update(request.getfixturevalue("s3_env"))
    # Imported as a module, not run as __main__: RQ refuses to enqueue __main__ functions.
    (tmp_path / "docs_example.py").write_text(script_of(page, substitutions))
    run = subprocess.run(
        [sys.executable, "-c", "import docs_example"], cwd=tmp_path, env=env,
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert run.returncode == 0, f"{page.name} examples failed:\n{run.stdout}\n{run.stderr}"


def test_the_guides_have_examples() -> None:
    """The README and every per-tier and per-integration guide carry code that runs here:
    a guide whose examples all vanished (or were all marked not-run) fails."""
    covered = {page.name for page in PAGES_WITH_CODE}
    wanted = {"README.md", "redis.md", "postgres.md", "mongo.md", "etcd.md", "s3.md", "celery.md"}
    wanted |= {"rq.md"}
    assert wanted <= covered, f"no runnable example in {sorted(wanted - covered)}"


def test_a_not_run_marker_needs_a_reason(tmp_path: Path) -> None:
    """A marked block is left out; a marker without a reason is refused."""
    page = tmp_path / "page.md"
    block = "```python\nraise SystemExit(1)\n```\n"
    page.write_text(f"<!-- not-run: needs a cluster -->\n{block}\n```python\nx = 1\n```\n")
    assert examples(page) == [(7, "x = 1\n")]  # the first line of its code
    page.write_text(f"<!-- not-run: -->\n{block}")
    with pytest.raises(AssertionError, match="reason"):
        examples(page)


def _design_nav(docs_dir: Path) -> list[object]:
    hook = load_module(ROOT / "docs" / "hooks" / "design_nav.py")
    config = hook.on_config({"docs_dir": str(docs_dir), "nav": [{"Home": "index.md"}]})
    return list(config["nav"])


def test_design_section_lists_the_design_notes(tmp_path: Path) -> None:
    """The site's "Design" section lists docs/design/*.md, and is absent with none."""
    assert _design_nav(tmp_path) == [{"Home": "index.md"}]  # no folder
    (tmp_path / "design").mkdir()
    assert _design_nav(tmp_path) == [{"Home": "index.md"}]  # an empty folder
    (tmp_path / "design" / "redis.md").write_text("# Redis\n")
    (tmp_path / "design" / "mongo.md").write_text("# Mongo\n")
    assert _design_nav(tmp_path)[-1] == {"Design": ["design/mongo.md", "design/redis.md"]}
