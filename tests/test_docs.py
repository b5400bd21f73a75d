"""Every `docs/...` page and anchor that the repository cites exists; nothing cites the founders' notes."""
from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
TEXT_SUFFIXES = {".py", ".cu", ".cuh", ".md", ".sh", ".toml", ".txt", ".cfg", ".yml", ".yaml"}
SKIP_DIRS = {".git", ".venv", "venv", "__pycache__", "build", "dist", "node_modules", ".benchmarks",
             ".pytest_cache", ".device", "shared"}
GONE = ("MODEL" + ".md", "DESIGN" + ".md")   # split so that this file does not cite them itself
CITATION = re.compile(r"(?<![\w/.-])docs/([\w/-]+\.md)(?:#([\w-]+))?")
RELATIVE_LINK = re.compile(r"\]\((?!https?:|#)([^)#\s]+\.md)(?:#([\w-]+))?\)")
IN_PAGE_LINK = re.compile(r"\]\(#([\w-]+)\)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")


def repository_files() -> list[Path]:
    """Tracked and untracked files that git does not ignore; without git, a walk that skips build outputs."""
    try:
        listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT,
                                capture_output=True, check=True).stdout.decode().split("\0")
        return [ROOT / name for name in listed if name and (ROOT / name).is_file()]
    except (OSError, subprocess.CalledProcessError):
        out = []
        for folder, dirs, files in os.walk(ROOT):
            dirs[:] = [d for d in dirs if d not in SKIP_DIRS and not d.endswith(".egg-info")]
            out += [Path(folder) / f for f in files]
        return out


def text_files() -> list[Path]:
    return sorted(p for p in repository_files() if p.suffix in TEXT_SUFFIXES or p.parent.name == ".ci")


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"`|\*\*|\[([^\]]*)\]\([^)]*\)", lambda m: m.group(1) or "", heading).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    found, seen, fenced = set(), {}, False
    for line in page.read_text(encoding="utf-8").splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        m = None if fenced else HEADING.match(line)
        if m:
            base = slug(m.group(2))
            n = seen.get(base, 0)
            seen[base] = n + 1
            found.add(base if n == 0 else f"{base}-{n}")
    return found


def citations() -> list:
    """pytest params (target page, anchor), named by where they occur: every docs/ citation and every relative
    link between docs pages."""
    out = []
    for path in text_files():
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        rel = path.relative_to(ROOT)
        for m in CITATION.finditer(text):
            out.append(pytest.param(DOCS / m.group(1), m.group(2), id=f"{rel}: {m.group(0)}"))
        if rel.parts[0] == "docs":
            for m in RELATIVE_LINK.finditer(text):
                out.append(pytest.param(path.parent / m.group(1), m.group(2), id=f"{rel}: {m.group(1)}"))
            for m in IN_PAGE_LINK.finditer(text):
                out.append(pytest.param(path, m.group(1), id=f"{rel}: #{m.group(1)}"))
    return out


def test_docs_pages_exist():
    for page in ("README.md", "model.md", "numerics.md", "formats.md", "caches.md"):
        assert (DOCS / page).is_file(), page


def test_slug_follows_github():
    assert slug("Act quant") == "act-quant"
    assert slug("9a. How far `a` and **b** are apart") == "9a-how-far-a-and-b-are-apart"
    assert slug("Pages and size classes") == "pages-and-size-classes"


def test_code_cites_docs():
    outside = [c for c in citations() if not c.id.startswith("docs/")]
    assert len(outside) >= 40, len(outside)


@pytest.mark.parametrize("page, anchor", citations())
def test_citation_resolves(page, anchor):
    assert page.is_file(), f"no page {page.relative_to(ROOT)}"
    if anchor:
        assert anchor in anchors(page), f"no heading with anchor #{anchor} in {page.relative_to(ROOT)}"


def test_nothing_cites_the_founders_notes():
    offenders = []
    for path in text_files():
        if path == Path(__file__).resolve():
            continue
        try:
            lines = path.read_text(encoding="utf-8").splitlines()
        except UnicodeDecodeError:
            continue
        offenders += [f"{path.relative_to(ROOT)}:{i}: {line.strip()}"
                      for i, line in enumerate(lines, 1) if any(name in line for name in GONE)]
    assert not offenders, "cite docs/<page>.md instead:\n" + "\n".join(offenders)
