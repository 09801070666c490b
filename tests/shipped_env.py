"""A job's Python environment, built and packed for ``spark-submit --archives``.

What a user does with ``pip install`` and ``venv-pack``, made cheap enough for CI (which
reaches no package index during the tests): a fresh virtualenv of the base interpreter
that this one runs on, holding only the distributions a job needs, hard-linked from this
environment's installed files (each distribution's ``RECORD``: the very files pip put
here), plus hvd_spark built as a wheel from the checkout under test and installed by pip;
then packed as a ``.tar.gz`` (stored, not compressed: the archive is about 1.6 GB, most
of it TensorFlow; the packages' C headers are left out).

The venv's ``bin/python`` is a link to the base interpreter, so the archive runs where that
interpreter is installed at the same path, as ``venv-pack``'s archives do. Here every
namespace host is this machine.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from collections import deque
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement

#: What a KerasEstimator job on Spark needs besides pyspark, which Spark puts on every
#: Python process's path itself (``pyspark.zip`` and py4j's zip on ``PYTHONPATH``).
JOB_EXTRAS = ("spark", "tensorflow")
_PROVIDED_BY_SPARK = {"pyspark", "py4j"}
_REPO = Path(__file__).resolve().parent.parent
_SOURCE_FILES = ("hvd_spark", "pyproject.toml", "README.md", "LICENSE")
_STEP_TIMEOUT_S = 300.0


def _name(text: str) -> str:
    return text.lower().replace("_", "-").replace(".", "-")


def distribution_closure(extras: tuple[str, ...] = JOB_EXTRAS) -> list[metadata.Distribution]:
    """The installed distributions that hvd_spark with ``extras`` requires, transitively
    (hvd_spark itself and what Spark provides excluded).

    Raises:
        RuntimeError: A required distribution is not installed here.
    """
    wanted: deque[tuple[str, frozenset[str]]] = deque(
        (text, frozenset(extras)) for text in metadata.requires("hvd-spark") or [])
    found: dict[str, metadata.Distribution] = {}
    while wanted:
        text, parent_extras = wanted.popleft()
        req = Requirement(text)
        if req.marker and not any(req.marker.evaluate({"extra": e})
                                  for e in ("", *parent_extras)):
            continue
        key = _name(req.name)
        if key in found or key in _PROVIDED_BY_SPARK:
            continue
        try:
            dist = metadata.distribution(req.name)
        except metadata.PackageNotFoundError:
            raise RuntimeError(f"{req.name} (required by the job's environment) is not "
                               "installed in this environment: install hvd_spark's "
                               f"{'/'.join(extras)} extras first") from None
        found[key] = dist
        for sub in dist.requires or []:
            wanted.append((sub, frozenset(req.extras)))
    return sorted(found.values(), key=lambda d: _name(d.metadata["Name"]))


def _site_packages(venv: Path) -> Path:
    return venv / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / \
        "site-packages"


def _link_distribution(dist: metadata.Distribution, site: Path) -> int:
    """Hard-link (copy across file systems) ``dist``'s installed files into ``site``."""
    count = 0
    for rel in dist.files or []:
        if rel.parts and rel.parts[0] == "..":  # console scripts: their shebangs are ours
            continue
        if "include" in rel.parts[:-1]:
            continue  # C headers (TensorFlow's are 290 MB): nothing imports them
        source = Path(dist.locate_file(rel))
        if not source.is_file():
            continue
        target = site / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(source, target)
        except OSError:
            shutil.copy2(source, target)
        count += 1
    return count


def _run(argv: list[str], what: str) -> None:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=_STEP_TIMEOUT_S)
    if done.returncode != 0:
        raise RuntimeError(f"{what} failed ({' '.join(argv)}):\n{done.stdout}{done.stderr}")


def base_python() -> str:
    """The interpreter this environment's virtualenv was made from."""
    return getattr(sys, "_base_executable", sys.executable)


def bare_venv(path: Path) -> Path:
    """A virtualenv with nothing but the standard library (a host's "own" Python); its
    interpreter's path."""
    _run([base_python(), "-m", "venv", "--without-pip", str(path)], "making a virtualenv")
    return path / "bin" / "python"


def build_job_env(path: Path) -> Path:
    """Build the job's virtualenv at ``path``; its interpreter's path.

    Raises:
        RuntimeError: A step failed, or a required distribution is missing here.
    """
    python = bare_venv(path)
    site = _site_packages(path)
    for dist in distribution_closure():
        _link_distribution(dist, site)
    with tempfile.TemporaryDirectory(prefix="hvd-wheel-") as tmp:
        # Build from a copy: an in-tree build would leave build/ and *.egg-info behind.
        src = Path(tmp) / "src"
        src.mkdir()
        for name in _SOURCE_FILES:
            item = _REPO / name
            if item.is_dir():
                shutil.copytree(item, src / name,
                                ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
            else:
                shutil.copy2(item, src / name)
        wheels = Path(tmp) / "wheels"
        _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
              "--no-index", "-q", "-w", str(wheels), str(src)], "building hvd_spark's wheel")
        wheel = next(wheels.glob("*.whl"))
        _run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps",
              "--no-index", "-q", str(wheel)], "installing hvd_spark's wheel")
    return python


def pack(env: Path, archive: Path) -> Path:
    """``env`` as a ``.tar.gz`` (its contents at the top, as venv-pack lays them).

    Spark unpacks a ``.tar.gz`` with the system's ``tar``, which keeps the executable bits
    and the interpreter's link to the base installation; a plain ``.tar`` or a ``.zip`` it
    unpacks in Java, which drops both ("Cannot run program ./environment/bin/python:
    Permission denied"). Level 0 (stored): gzip would cost a minute on this archive and
    every unpack decompresses it again, where copying costs seconds.
    """
    if not archive.name.endswith(".tar.gz"):
        raise ValueError(f"{archive.name}: name the archive *.tar.gz (Spark unpacks by name)")
    with tarfile.open(archive, "w:gz", compresslevel=0) as tar:
        for name in sorted(os.listdir(env)):
            tar.add(env / name, arcname=name)
    return archive
