"""The public API's types, checked as an adopter's mypy would check them (issue 45).

``make lint`` runs mypy over the docs' examples (``[tool.mypy]`` in pyproject.toml: the
testing page's and the kinds page's kinds and tests, django-stubs, strict). Here the same
run passes, and a misuse of the typed API is an error mypy names: the kind's declared
result read as another type, and a handler that does not take a context.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]

MISUSE = """
from __future__ import annotations

import jobs
from tests.docs.typed_example.jobkinds import Totals


def read(handle: jobs.JobHandle) -> int:
    totals = handle.result_as(Totals)
    return totals  # a Totals | None is not an int


@jobs.kind("billing.misdeclared")
def misdeclared(order_id: int, ctx: jobs.JobContext) -> None:  # not (ctx) -> ...
    return None
"""


def _mypy(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "mypy", "--no-incremental", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def test_typing__the_docs_examples_pass_mypy_strict():
    done = _mypy()
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Success: no issues found in 6 source files" in done.stdout, done.stdout


def test_typing__a_misuse_of_the_typed_api_is_an_error(tmp_path):
    # Outside the examples' folder: a file there would be in the other test's run too
    # (they ran at the same time in CI and the clean run failed on this misuse).
    misuse = tmp_path / "misuse.py"
    misuse.write_text(MISUSE)
    done = _mypy(str(misuse))
    print(done.stdout)
    assert done.returncode == 1, done.stdout + done.stderr
    assert 'Incompatible return value type (got "Totals | None", expected "int")' in done.stdout
    assert 'Value of type variable "H" of function cannot be' in done.stdout, done.stdout
