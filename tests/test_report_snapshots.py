"""The demo fixture's reports, character for character against committed files (times and rounding-level
digits masked: report_masks.py): a change in layout must not change a single character a user sees."""

import json
from pathlib import Path

import pytest
from conftest import run_command
from report_masks import masked

ROOT = Path(__file__).resolve().parent.parent
GOLDEN = Path(__file__).resolve().parent / "golden"



@pytest.mark.parametrize("form", ["text", "markdown", "json"])
@pytest.mark.slow
def test_demo_report_is_unchanged(form, tmp_path, monkeypatch):
    from auditor.cli.audit import main

    out = tmp_path / f"report.{form}"
    monkeypatch.chdir(ROOT)  # the reports name the fixture by this relative path
    done = run_command(main, "fixtures/resized_demo.safetensors", "--format", form, "--threads", "2", "--quiet",
                       "--output", out)  # in this process: test_stdout.py runs `python -m auditor` itself
    assert done.returncode == 1, done.stderr  # the demo has findings
    expected = (GOLDEN / f"resized_demo.{form}").read_text(encoding="utf-8")
    assert masked(out.read_text(encoding="utf-8")) == masked(expected)


@pytest.mark.parametrize("form", ["text", "markdown"])
def test_the_reports_render_from_the_json_document_alone(form):
    """Every format is a rendering of the JSON document: the committed JSON report gives the committed text and
    markdown reports, with no head and no audit."""
    from auditor.formats import DOCUMENT_FORMATS

    doc = json.loads((GOLDEN / "resized_demo.json").read_text(encoding="utf-8"))
    expected = (GOLDEN / f"resized_demo.{form}").read_text(encoding="utf-8")
    assert masked(DOCUMENT_FORMATS[form](doc)) == masked(expected)


def test_the_html_page_renders_from_the_json_document_and_its_plots():
    from auditor.formats.html import render_page

    doc = json.loads((GOLDEN / "resized_demo.json").read_text(encoding="utf-8"))
    page = render_page(doc, [], "audit fixtures/resized_demo.safetensors --format html --output report.html")
    assert page.startswith("<!DOCTYPE html>") and page.endswith("</html>\n")
    for finding in doc["findings"]:
        assert f">{finding['id']}<" in page
