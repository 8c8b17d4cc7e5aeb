"""The docs as a reader follows them: every relative link in README.md and docs/*.md reaches a file (and its
anchor, a heading's GitHub slug), and every ``--flag`` a doc writes after ``fcdp COMMAND`` is one that
``fcdp COMMAND --help`` shows."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
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


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
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
