"""The front page and docs/ point at things that exist, and the Quickstart is what CI runs.

A renamed file or a moved section must not leave a dead link or a name a reader cannot find.
"""

import re
import subprocess
from pathlib import Path

from conftest import REPO

PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
CODE_SPAN = re.compile(r"`([^`\s]+)`")


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)  # no headings in code blocks
    return {slug(m) for m in re.findall(r"^#+ (.+)$", text, re.M)}


def tracked_files() -> list[str]:
    return subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True,
                          check=True).stdout.split()


def test_every_relative_link_resolves():
    broken = []
    for page in PAGES:
        for target in LINK.findall(page.read_text()):
            if re.match(r"[a-z]+:", target):  # https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            resolved = (page.parent / path).resolve() if path else page
            if not resolved.exists():
                broken.append(f"{page.name}: {target} (no such file)")
            elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
                broken.append(f"{page.name}: {target} (no such heading)")
    assert not broken, "\n".join(broken)


def test_every_file_named_in_the_docs_exists():
    """`harness/checkpoint.py`, `slurm/multinode.sh`, or a bare `metrics.py` that is somewhere."""
    files = tracked_files()
    names = {Path(f).name for f in files}
    missing = []
    for page in PAGES:
        text = page.read_text()
        for name in set(CODE_SPAN.findall(text)):
            if not re.fullmatch(r"[\w./-]+\.(py|sh|md)", name) or name.startswith(("http", "~")):
                continue
            if name not in files and name not in names:
                missing.append(f"{page.name}: {name}")
    assert not missing, "\n".join(missing)


def test_the_quickstart_has_two_commands_the_tour_and_the_tests():
    """The first is run by test_tour.py (as `python tour.py`); the second is what .ci/run runs."""
    quickstart = (REPO / "README.md").read_text().split("## Quickstart")[1].split("\n## ")[0]
    commands = re.findall(r"```bash\n(.+?)\n```", quickstart)
    assert len(commands) == 2, commands
    install = "python3 -m venv .venv && . .venv/bin/activate && pip install -r "
    assert commands[0] == install + "requirements.txt && python tour.py"
    assert commands[1].startswith(install + "requirements-test.txt && python -m pytest")
    ci = (REPO / ".ci" / "run").read_text()
    assert "grep -m1 -E '^python3 -m venv .*requirements-test\\.txt' README.md" in ci
    assert (REPO / "requirements-test.txt").read_text().startswith("-r requirements.txt")
