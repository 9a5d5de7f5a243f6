"""Run mypy on the package as it is imported (``batchfleet.*``), not as the folders lie.

The folders map to packages through ``[tool.setuptools.package-dir]`` (``producer/`` is
``batchfleet.producer``), which mypy cannot follow, and the editable install reaches them
through an import hook mypy does not run. So this lays out a tree of symlinks shaped like
the installed package (``build/typecheck/batchfleet/producer`` → ``producer``), runs mypy on
it with the settings of ``[tool.mypy]``, and prints each message with the real file path.

Usage: ``python tools/typecheck.py [mypy arguments]`` (``make typecheck``).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent
TREE = ROOT / "build" / "typecheck"


def package_dirs() -> dict[str, str]:
    """``{"batchfleet.producer": "producer", ...}`` from pyproject.toml."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    mapping: dict[str, str] = config["tool"]["setuptools"]["package-dir"]
    return mapping


def build_tree() -> dict[str, str]:
    """Make the link tree; returns tree path prefix → real path prefix, longest first."""
    shutil.rmtree(TREE, ignore_errors=True)
    links: dict[str, str] = {}
    for package, folder in sorted(package_dirs().items()):
        if package.count(".") == 0:
            continue
        target = TREE / package.replace(".", "/")
        if any(target.is_relative_to(TREE / p.replace(".", "/")) for p in links):
            continue  # inside a folder already linked (worker/handlers under worker)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.symlink_to(ROOT / folder, target_is_directory=True)
        links[package] = folder
    for root, folder in package_dirs().items():
        if "." in root:
            continue
        top = TREE / root
        for source in (ROOT / folder).glob("*.py"):
            (top / source.name).symlink_to(source)
    prefixes = {str((TREE / p.replace(".", "/")).relative_to(ROOT)) + os.sep: f + os.sep
                for p, f in links.items()}  # fmt: skip
    for root, folder in package_dirs().items():
        if "." not in root:
            prefixes[str((TREE / root).relative_to(ROOT)) + os.sep] = folder + os.sep
    return dict(sorted(prefixes.items(), key=lambda kv: -len(kv[0])))


def main(argv: list[str]) -> int:
    prefixes = build_tree()
    roots = [p for p in package_dirs() if "." not in p]
    command = [sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml")]
    command += [a for p in roots for a in ("-p", p)] + argv
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    for line in (done.stdout + done.stderr).splitlines():
        for tree, real in prefixes.items():
            if line.startswith(tree):
                line = real + line[len(tree) :]
                break
        print(line)
    return done.returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
