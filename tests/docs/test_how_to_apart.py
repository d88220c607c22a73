"""How-to pages apart from the internals (issue 45): the app's how-to pages (the "The app"
table of contents) name no mechanism a user need not know; those live on the "How it
works" pages, which the how-to pages link to."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
INTERNALS = re.compile(
    r"\bCTEs?\b|SWAP_MARGIN|advisory[ _]lock|pg_try_advisory|FOR UPDATE|SKIP LOCKED|"
    r"CLAIM_LOCK_CLASS|index scans?"
)


def _toctree(caption: str) -> list[str]:
    index = (DOCS / "index.md").read_text()
    [block] = re.findall(
        r"```\{toctree\}\n:caption: " + re.escape(caption) + r"\n(.*?)```", index, re.S
    )
    return [line for line in block.splitlines() if line and not line.startswith(":")]


def test_how_to__the_apps_pages_name_no_internals():
    pages = _toctree("The app")
    assert "app/quickstart" in pages and "app/how-it-works" not in pages
    found = [
        f"{page}.md:{n}: {line.strip()[:90]}"
        for page in pages
        for n, line in enumerate((DOCS / f"{page}.md").read_text().splitlines(), 1)
        if INTERNALS.search(line)
    ]
    assert found == [], "\n".join(found)


def test_how_it_works__holds_them_and_is_linked():
    internals = _toctree("How it works (the internals)")
    assert internals[0] == "app/how-it-works"
    text = (DOCS / "app" / "how-it-works.md").read_text()
    assert "SKIP LOCKED" in text and "advisory lock" in text
    assert "how-it-works.md#which-job-a-claim-takes" in (DOCS / "app" / "scheduling.md").read_text()
