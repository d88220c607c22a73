"""Where the import package ``jobs`` is, for each way this distribution is built.

In the repository the package lives two levels up (``../../jobs``: the site and the
tests use it from there); an sdist carries a copy beside this file. pyproject.toml
holds everything else (metadata, extras, package data).
"""

from __future__ import annotations

import shutil
from pathlib import Path

from setuptools import find_packages, setup
from setuptools.command.sdist import sdist

HERE = Path(__file__).resolve().parent
# An unpacked sdist has jobs/ here; a checkout has it at the repository's root.
SOURCE = "." if (HERE / "jobs" / "__init__.py").is_file() else "../.."


class SdistWithPackage(sdist):
    """Put ``jobs/`` (without caches) into the sdist, so a wheel builds from it alone."""

    def make_release_tree(self, base_dir: str, files: list[str]) -> None:
        # setuptools lists the package's files as ../../jobs/...: copied as they are named
        # they would land outside the release tree; the copy below puts them in it.
        inside = [name for name in files if not name.startswith("..")]
        super().make_release_tree(base_dir, inside)
        target = Path(base_dir) / "jobs"
        if SOURCE != "." and not target.exists():
            shutil.copytree(
                HERE / SOURCE / "jobs",
                target,
                ignore=shutil.ignore_patterns("__pycache__", "*.pyc"),
            )


setup(
    package_dir={"": SOURCE},
    packages=find_packages(where=str(HERE / SOURCE), include=["jobs", "jobs.*"]),
    cmdclass={"sdist": SdistWithPackage},
)
