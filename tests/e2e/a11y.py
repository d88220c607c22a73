"""axe-core in the real browser: run it on a page, keep what is serious.

axe-core is vendored (``tests/e2e/vendor/axe.min.js``, see the README there), so
the tests need no network. It is evaluated through Playwright's protocol channel,
which a page's Content-Security-Policy does not govern, so a strict CSP on the
site cannot hide a page from the check.
"""

from __future__ import annotations

from pathlib import Path

AXE_JS = (Path(__file__).parent / "vendor" / "axe.min.js").read_text()
# Issue 32: moderate findings fail the browser tests too (landmarks, headings, regions).
BLOCKING = ("moderate", "serious", "critical")
VIEWPORTS = {"desktop": {"width": 1366, "height": 900}, "phone": {"width": 390, "height": 844}}

_RUN = """async () => {
  const result = await axe.run(document, {resultTypes: ["violations"]});
  return result.violations.map(v => ({
    id: v.id, impact: v.impact, help: v.help,
    nodes: v.nodes.map(n => n.target.join(" ")).slice(0, 5), count: v.nodes.length,
  }));
}"""


def violations(page) -> list[dict]:
    """Every axe-core violation on the page as it is now (rule id, impact, some targets)."""
    if not page.evaluate("typeof window.axe !== 'undefined'"):
        page.evaluate(AXE_JS)
    return page.evaluate(_RUN)


def blocking(found: list[dict]) -> list[dict]:
    return [v for v in found if v["impact"] in BLOCKING]


def describe(found: list[dict]) -> str:
    return "; ".join(f"{v['id']} ({v['impact']}, {v['count']}x: {v['nodes']})" for v in found)


def scroll_width(page) -> int:
    return page.evaluate("document.documentElement.scrollWidth")
