"""The demo fixture's reports, character for character against committed files (times and rounding-level
digits masked: report_masks.py): a change in layout must not change a single character a user sees."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from report_masks import masked

ROOT = Path(__file__).resolve().parent.parent
GOLDEN = Path(__file__).resolve().parent / "golden"



@pytest.mark.parametrize("form", ["text", "markdown", "json"])
@pytest.mark.slow
def test_demo_report_is_unchanged(form, tmp_path):
    out = tmp_path / f"report.{form}"
    done = subprocess.run([sys.executable, "-m", "auditor", "fixtures/resized_demo.safetensors", "--format", form,
                           "--threads", "2", "--quiet", "--output", str(out)],
                          cwd=ROOT, capture_output=True, text=True)
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
