"""The docs as a reader follows them: every relative link in README.md and docs/**/*.md reaches a file (and its
anchor, a heading's GitHub slug), every ``--flag`` a doc writes after ``fcdp COMMAND`` is one that
``fcdp COMMAND --help`` shows, the pages are few and named alike, and none carries the lab's history (a dated
work label or a reference to this project's issue tracker): a page says what is, the CHANGELOG what changed."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)|!\[[^\]]*\]\(([^)\s]+)\)")


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"`|\*\*|\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip()).lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    out, seen = set(), {}
    in_code = False
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            in_code = not in_code
        elif not in_code and (m := re.match(r"^#{1,6}\s+(.*)$", line)):
            s = slug(m.group(1))
            n = seen.get(s, 0)
            seen[s] = n + 1
            out.add(s if n == 0 else f"{s}-{n}")
    return out


def links(path: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)  # code blocks hold no links
    return [a or b for a, b in LINK.findall(text)]


def broken_links(path: Path) -> list[str]:
    out = []
    for target in links(path):
        if re.match(r"^[a-z]+:", target):  # http(s), mailto: not checked here (no network)
            continue
        file, _, anchor = target.partition("#")
        dest = (path.parent / file).resolve() if file else path
        if not dest.exists():
            out.append(f"{target} (no file {dest.relative_to(ROOT) if dest.is_relative_to(ROOT) else dest})")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            out.append(f"{target} (no heading #{anchor} in {dest.name})")
    return out


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(doc):
    assert broken_links(doc) == []


def test_the_link_check_finds_broken_links(tmp_path):
    """Broken variants: a missing file, a missing anchor; a good link and a duplicate heading's anchor pass."""
    (tmp_path / "a.md").write_text("# Title\n## Same\n## Same\n[ok](b.md#the-part) [dup](#same-1) [gone](c.md) "
                                   "[anchor](b.md#nowhere)\n```\n[in code](x.md)\n```\n")
    (tmp_path / "b.md").write_text("## The `part`\n")
    assert [b.split(" ")[0] for b in broken_links(tmp_path / "a.md")] == ["c.md", "b.md#nowhere"]


def documented_flags() -> dict[str, set[str]]:
    """``fcdp COMMAND ... --flag`` in the docs' code and inline code, by command."""
    out: dict[str, set[str]] = {}
    for doc in DOCS:
        text = doc.read_text()
        for snippet in re.findall(r"```(?:bash|sh)?\n(.*?)```", text, re.S) + re.findall(r"`([^`\n]+)`", text):
            for line in snippet.splitlines():
                for m in re.finditer(r"\bfcdp (plan|bench|demo|doctor|converge|soak|configs)\b([^;|&#]*)", line):
                    out.setdefault(m.group(1), set()).update(re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", m.group(2)))
    return out


def test_every_documented_flag_is_in_the_commands_help(capsys):
    from fcdp_deepspeed.tools import cli
    missing = {}
    for command, flags in documented_flags().items():
        try:
            cli.main([command, "--help"])
        except SystemExit:
            pass
        shown = set(re.findall(r"--[a-z][a-z0-9-]*", capsys.readouterr().out))
        if flags - shown:
            missing[command] = sorted(flags - shown)
    assert not missing, missing


#: History in a page: a dated label (``2026-12-04b``, ``on 2026-12-04 15:14 UTC``), this project's issue numbers
#: (``issue 33``, ``issues 23 and 31``, a bare ``#12``), a work session. Upstream references stay allowed when they
#: name their project (``DeepSpeed#4886``, ``pytorch#135712``) or link the tracker's URL.
HISTORY = re.compile(r"\b20\d\d-\d\d-\d\d|\bissues? \d+|(?<![\w/])#\d+\b|\bsession\s+[0-9a-z]*\d", re.I)


def history(text: str) -> list[str]:
    text = re.sub(r"\]\([^)]*\)", "]()", text)  # link targets are paths and URLs, not prose
    return [m.group(0) for m in HISTORY.finditer(text)]


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_page_carries_dates_or_issue_numbers(doc):
    assert history(doc.read_text()) == []


def test_the_history_check_finds_history():
    bad = ("measured on 2026-12-04 15:14 UTC", "(issue 26)", "issues 23 and 31", "see #12", "session 2026-12-04b",
           "session 4")
    assert [bool(history(t)) for t in bad] == [True] * len(bad)
    good = ("DeepSpeed#4886", "[pytorch#135712](https://github.com/pytorch/pytorch/issues/135712)",
            "[run](results/gpu/h200-run1.json)", "a session of training", "the issue tracker")
    assert [history(t) for t in good] == [[]] * len(good)


def test_the_docs_are_a_few_pages_named_alike():
    pages = sorted((ROOT / "docs").rglob("*.md"))
    assert len(pages) <= 15, [p.name for p in pages]
    assert all(re.fullmatch(r"[a-z0-9]+(-[a-z0-9]+)*\.md", p.name) for p in pages), [p.name for p in pages]
