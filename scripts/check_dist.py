"""Check what a built sdist and wheel hold: the files users need, and nothing of ours else.

    python scripts/check_dist.py dist/

Run by scripts/check_build.sh after ``python -m build``. Exits non-zero naming each problem.
"""

from __future__ import annotations

import ast
import sys
import tarfile
import zipfile
from email.parser import Parser
from pathlib import Path

PACKAGES = ("simple_mutex", "celery_mutex", "rq_mutex")
NOT_SHIPPED = ("tests/", "bench/", "examples/", "scripts/", "docs/", ".ci/")


def source_version() -> str:
    """``__version__`` as written in simple_mutex/__init__.py, the one place it lives."""
    tree = ast.parse(Path("simple_mutex/__init__.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(target, ast.Name) and target.id == "__version__" for target in node.targets
        ):
            return str(ast.literal_eval(node.value))
    raise SystemExit("simple_mutex/__init__.py has no __version__")


def check_wheel(path: Path, version: str) -> list[str]:
    problems = []
    with zipfile.ZipFile(path) as wheel:
        names = wheel.namelist()
        info = next(name.split("/")[0] for name in names if ".dist-info/" in name)
        metadata = Parser().parsestr(wheel.read(f"{info}/METADATA").decode())
    problems += [f"wheel lacks {p}/py.typed" for p in PACKAGES if f"{p}/py.typed" not in names]
    problems += [
        f"wheel lacks {p}/__init__.py" for p in PACKAGES if f"{p}/__init__.py" not in names
    ]
    if f"{info}/licenses/LICENSE" not in names:
        problems.append(f"wheel lacks {info}/licenses/LICENSE")
    problems += [f"wheel ships {name}" for name in names if name.startswith(NOT_SHIPPED)]
    stray = {name.split("/")[0] for name in names} - {*PACKAGES, info}
    problems += [f"wheel ships an unexpected top-level {name!r}" for name in sorted(stray)]
    if metadata["Version"] != version:
        problems.append(f"wheel version {metadata['Version']} != __version__ {version}")
    if metadata["License-Expression"] != "MIT":
        problems.append(f"License-Expression is {metadata['License-Expression']!r}, not 'MIT'")
    classifiers = metadata.get_all("Classifier") or []
    for wanted in ("Framework :: Celery", "Typing :: Typed"):
        if wanted not in classifiers:
            problems.append(f"classifier {wanted!r} missing")
    print(f"  wheel {path.name}: {len(names)} files, version {metadata['Version']}, "
          f"License-Expression {metadata['License-Expression']}")  # fmt: skip
    return problems


def check_sdist(path: Path) -> list[str]:
    with tarfile.open(path) as sdist:
        names = {name.split("/", 1)[1] for name in sdist.getnames() if "/" in name}
    wanted = ["LICENSE", "README.md", "pyproject.toml", "PKG-INFO"]
    wanted += [f"{p}/py.typed" for p in PACKAGES]
    problems = [f"sdist lacks {name}" for name in wanted if name not in names]
    print(f"  sdist {path.name}: {len(names)} files")
    return problems


def main(dist: Path) -> int:
    version = source_version()
    wheels, sdists = sorted(dist.glob("*.whl")), sorted(dist.glob("*.tar.gz"))
    if len(wheels) != 1 or len(sdists) != 1:
        print(f"expected one wheel and one sdist in {dist}, found {wheels + sdists}")
        return 1
    problems = check_wheel(wheels[0], version) + check_sdist(sdists[0])
    for problem in problems:
        print(f"  problem: {problem}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1] if len(sys.argv) > 1 else "dist")))
