"""Every relative link in the README and docs/ reaches a file, and every anchor a heading of it;
every file in bench/results/ is named in its index.

Anchors follow GitHub's rule: the heading's text lowercased, what is not a letter, digit, space,
hyphen or underscore dropped, spaces turned into hyphens; a repeated heading gets -1, -2, ...
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "bench" / "results" / "README.md"]
LINK = re.compile(r"(?<!\!)\[[^\]]*\]\(([^)\s]+)\)|!\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^(```|~~~)")


def prose(text: str, inline_code: bool = False) -> str:
    """The page without its fenced and indented code blocks (and inline code unless kept), where
    links are not links."""
    lines, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line.strip()):
            fenced = not fenced
            continue
        if fenced or line.startswith("    ") and not line.lstrip().startswith(("-", "|", "[", "*")):
            continue
        lines.append(line if inline_code else re.sub(r"`[^`]*`", "", line))
    return "\n".join(lines)


def slug(heading: str) -> str:
    text = re.sub(r"`|\*\*|\[([^\]]*)\]\([^)]*\)", r"\1", heading).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    found = set()
    for line in prose(page.read_text(), inline_code=True).splitlines():
        match = re.match(r"#{1,6}\s+(.*)", line)
        if not match:
            continue
        base = slug(match.group(1))
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return found


def links(page: Path) -> list[str]:
    return [a or b for a, b in LINK.findall(prose(page.read_text()))]


def broken(page: Path) -> list[str]:
    wrong = []
    for target in links(page):
        if re.match(r"[a-z]+:", target) or target.startswith("//"):
            continue  # an absolute URL: not this repository's to check
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            wrong.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            wrong.append(f"{target}: no heading with that anchor")
    return wrong


def test_a_missing_file_and_a_missing_anchor_are_found(tmp_path):
    (tmp_path / "other.md").write_text("# A heading: with `code`, and punctuation!\n")
    page = tmp_path / "page.md"
    page.write_text("[ok](other.md#a-heading-with-code-and-punctuation) [gone](missing.md) "
                    "[no anchor](other.md#elsewhere) [web](https://example.com/x)\n\n    make it [in code](nowhere.md)\n```\n[fenced](nowhere.md)\n```\n")
    assert broken(page) == ["missing.md: no such file", "other.md#elsewhere: no heading with that anchor"]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page):
    assert broken(page) == []


def test_every_result_file_is_named_in_the_results_index():
    results = ROOT / "bench" / "results"
    index = (results / "README.md").read_text()
    assert [f.name for f in sorted(results.iterdir()) if f.name != "README.md" and f.name not in index] == []
