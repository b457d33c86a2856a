"""Every figure README.md quotes in its prose (a time in seconds or minutes) is one that docs/performance.md
gives, where each figure stands with the command that measured it: README is a summary, never a second source."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# a time as the docs write it: "8.63 s", "2.19–2.33 s", "0.130 s", "14 min 7 s"
FIGURE = re.compile(r"(?<![\w.])[0-9]+(?:\.[0-9]+)?(?:–[0-9]+(?:\.[0-9]+)?)? (?:min [0-9]+ s|s|ms)\b")


def prose(markdown: str) -> str:
    """The text outside fenced blocks: a block shows a command's output, whose time line is one run's."""
    return re.sub(r"^```.*?^```", "", markdown, flags=re.MULTILINE | re.DOTALL)


def test_every_time_readme_quotes_is_in_performance_md():
    readme = prose((ROOT / "README.md").read_text(encoding="utf-8"))
    performance = (ROOT / "docs" / "performance.md").read_text(encoding="utf-8")
    quoted = FIGURE.findall(readme)
    assert quoted, "README quotes no time: the pattern no longer reads it"
    missing = [figure for figure in quoted if figure not in performance]
    assert not missing, f"README.md quotes times docs/performance.md does not give: {missing}"


def test_readme_quotes_no_time_in_loose_words():
    """"about 11 minutes" cannot be checked against a table: README gives the table's own figure."""
    readme = prose((ROOT / "README.md").read_text(encoding="utf-8"))
    loose = re.findall(r"\babout [0-9][^ ]* (?:s|seconds|minutes?)\b", readme)
    assert not loose, f"README.md gives times in loose words: {loose}"


def test_ci_md_lists_every_class_the_gate_takes():
    from auditor.findings.finding import GATE_CLASSES

    ci = (ROOT / "docs" / "ci.md").read_text(encoding="utf-8")
    listed = re.search(r"`--fail-on` takes the classes (.*?), or `none`", ci, flags=re.DOTALL)
    assert listed is not None
    assert set(re.findall(r"`([a-z-]+)`", listed[1])) == set(GATE_CLASSES)
