"""``audit --format html``: one self-contained page, checked in a real headless browser (Debian's chromium).

The browser tests read the DOM after the page's script ran (``--dump-dom``) and a screenshot; they skip
when chromium is missing, except in CI (``CI`` set), which must have it.
"""

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
from html import unescape
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pytest

from conftest import run_command

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "fixtures" / "resized_demo.safetensors"
DEMO_FINDINGS = {17, 1900, 2631, 4000, 4001, 4002, 4003, 4004}
TIED = {17, 4004}


def audit_html(output: Path, *args) -> subprocess.CompletedProcess:
    """The command in this process (conftest.run_command; every path here is absolute)."""
    from auditor.cli.audit import main

    return run_command(main, *args, "--format", "html", "--output", output, "--quiet")


@pytest.fixture(scope="module")
def chromium():
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    if path is None:
        if os.environ.get("CI"):
            pytest.fail("chromium is missing: CI installs Debian's chromium (.ci/run) to test the HTML report")
        pytest.skip("chromium is not installed (apt-get install chromium): the HTML report's browser tests need it")
    return path


def browse(chromium: str, page: Path, tmp_path: Path, *options: str, fragment: str = "") -> subprocess.CompletedProcess:
    """Run headless chromium on a local page with everything that could reach the network switched off."""
    profile = tempfile.mkdtemp(prefix="chromium-", dir=tmp_path)  # a fresh profile: no state between runs
    command = [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
               "--disable-background-networking", "--disable-component-update", "--disable-sync",
               f"--user-data-dir={profile}", *options, page.resolve().as_uri() + fragment]
    return subprocess.run(command, capture_output=True, text=True, timeout=120)


class Dom(HTMLParser):
    """What the tests read from a dumped DOM: the body's data attributes, the finding rows, the plots."""

    def __init__(self, text: str):
        super().__init__()
        self.body: dict = {}
        self.rows: dict[int, bool] = {}  # id -> visible
        self.plots = 0
        self._in_plot = False
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "body":
            self.body = attrs
        elif tag == "tr" and "data-id" in attrs:
            self.rows[int(attrs["data-id"])] = "hidden" not in attrs
        elif tag == "figure" and "plot" in (attrs.get("class") or "").split():
            self._in_plot = True
        elif self._in_plot and (tag == "svg" or (tag == "img" and (attrs.get("src") or "").startswith(
                "data:image/png;base64,"))):
            self.plots += 1
            self._in_plot = False

    def visible(self) -> set[int]:
        return {k for k, shown in self.rows.items() if shown}


@pytest.fixture(scope="module")
def demo_page(tmp_path_factory):
    pytest.importorskip("matplotlib")
    page = tmp_path_factory.mktemp("html") / "r.html"
    done = audit_html(page, DEMO)
    assert done.returncode == 1, done.stderr  # the demo head has failing findings
    return page


def dump_dom(chromium, page, tmp_path, fragment="") -> Dom:
    done = browse(chromium, page, tmp_path, "--dump-dom", fragment=fragment)
    assert done.returncode == 0, done.stderr
    return Dom(done.stdout)


@pytest.mark.slow
def test_demo_page_runs_its_script_and_lists_exactly_the_findings(chromium, demo_page, tmp_path):
    dom = dump_dom(chromium, demo_page, tmp_path)
    assert dom.body.get("data-ready") == "1"
    assert "data-script-errors" not in dom.body
    assert set(dom.rows) == DEMO_FINDINGS
    assert dom.visible() == DEMO_FINDINGS


@pytest.mark.slow
def test_demo_page_has_three_inline_plots(chromium, demo_page, tmp_path):
    assert dump_dom(chromium, demo_page, tmp_path).plots == 3


@pytest.mark.slow
def test_fragment_filters_the_table_by_verdict(chromium, demo_page, tmp_path):
    dom = dump_dom(chromium, demo_page, tmp_path, fragment="#verdict=tied")
    assert "data-script-errors" not in dom.body
    assert set(dom.rows) == DEMO_FINDINGS and dom.visible() == TIED


@pytest.mark.slow
def test_fragment_filters_the_table_by_text(chromium, demo_page, tmp_path):
    dom = dump_dom(chromium, demo_page, tmp_path, fragment="#q=2631")
    assert dom.visible() == {2631}


@pytest.mark.slow
def test_page_references_nothing_on_the_network(demo_page):
    raw = demo_page.read_text(encoding="utf-8")
    assert not re.search(r"""(src|href)\s*=\s*["']?\s*(https?:)?//""", raw, flags=re.I)
    assert not re.search(r"url\(\s*['\"]?(https?:)?//", raw, flags=re.I)
    assert "@import" not in raw
    assert "default-src 'none'" in raw  # the Content-Security-Policy forbids any fetch as well


@pytest.mark.slow
def test_page_is_small_enough_to_mail(demo_page):
    assert demo_page.stat().st_size < 1_500_000


@pytest.mark.slow
def test_screenshot_shows_a_rendered_page(chromium, demo_page, tmp_path):
    from matplotlib.image import imread

    picture = tmp_path / "r.png"
    done = browse(chromium, demo_page, tmp_path, f"--screenshot={picture}", "--window-size=1280,2400")
    assert done.returncode == 0, done.stderr
    assert picture.stat().st_size > 50_000
    pixels = imread(picture)
    assert pixels.shape[:2] == (2400, 1280)
    assert pixels[..., :3].std() > 0.05  # not a blank or single-colour page


@pytest.mark.slow
def test_ceiling_audit_adds_the_ceiling_plot(chromium, tmp_path):
    pytest.importorskip("matplotlib")
    page = tmp_path / "c.html"
    done = audit_html(page, DEMO, "--tokens", "0-99,4000-4004", "--domain", "ball:30", "--ceiling", "0.5")
    assert done.returncode == 1, done.stderr
    dom = dump_dom(chromium, page, tmp_path)
    assert dom.body.get("data-ready") == "1" and "data-script-errors" not in dom.body
    assert dom.plots == 4
    assert {17, 4000, 4001, 4002, 4003, 4004} <= set(dom.rows)


# -- without a browser --------------------------------------------------------------------------

HOSTILE = ["<s>", "</script><script>document.title='owned'</script>", "a&b", '"quoted"', "it's", "<!--"]


class Elements(HTMLParser):
    """Counts start tags and checks that every non-void element is closed in order."""

    VOID = {"meta", "input", "br", "img", "link", "hr", "col", "source", "wbr", "area", "base", "embed", "track"}

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.tags: dict[str, int] = {}
        self.open: list[str] = []
        self.text: list[str] = []
        self.mismatched: list[str] = []

    def handle_starttag(self, tag, attrs):
        self.tags[tag] = self.tags.get(tag, 0) + 1
        if tag not in self.VOID:
            self.open.append(tag)

    def handle_startendtag(self, tag, attrs):
        self.tags[tag] = self.tags.get(tag, 0) + 1

    def handle_endtag(self, tag):
        if not self.open or self.open.pop() != tag:
            self.mismatched.append(tag)

    def handle_data(self, data):
        self.text.append(data)


@pytest.fixture
def hostile_folder(tmp_path):
    """A tiny model folder whose first token strings are markup, on rows that copy row 0: all are findings."""
    from safetensors.numpy import save_file

    rng = np.random.default_rng(5)
    weight = rng.standard_normal((12, 4)).astype(np.float32)
    weight[1:len(HOSTILE)] = weight[0]
    save_file({"lm_head.weight": weight}, str(tmp_path / "model.safetensors"))
    vocab = HOSTILE + [f"word{i}" for i in range(12 - len(HOSTILE))]
    (tmp_path / "vocab.txt").write_text("\n".join(vocab) + "\n", encoding="utf-8")
    return tmp_path


def test_token_strings_are_escaped(hostile_folder):
    pytest.importorskip("matplotlib")
    import auditor
    from auditor.formats import html
    from auditor.findings.gate import run_gate
    from auditor.loader import load_head

    head = load_head(hostile_folder)
    assert set(HOSTILE) <= set(head.tokens)
    result = run_gate(head, auditor.audit(head.weight, head.bias, progress=False))
    assert {f.token for f in result.findings} >= set(HOSTILE)
    page = html.render(result)
    parsed = Elements()
    parsed.feed(page)
    assert parsed.tags["script"] == 2  # the page's own two; no token string opened one
    assert not parsed.mismatched and parsed.open == []
    assert "document.title='owned'" not in page  # the quote is escaped too
    text = "".join(parsed.text)
    for token in HOSTILE:
        assert repr(token) in text  # shown as itself, quoted like the text report does


def test_table_lists_a_bounded_number_of_rows_per_verdict_and_counts_the_rest(hostile_folder, monkeypatch):
    pytest.importorskip("matplotlib")
    import auditor
    from auditor.formats import html
    from auditor.findings.gate import run_gate
    from auditor.loader import load_head

    monkeypatch.setattr(html, "_ROWS_PER_VERDICT", 2)
    head = load_head(hostile_folder)
    result = run_gate(head, auditor.audit(head.weight, head.bias, progress=False))
    tied = [f.id for f in result.findings if f.verdict == "tied"]
    page = html.render(result)
    failing = {f.id for f in result.failing}  # failing findings are listed first: a passing copy never hides one
    shown = sorted(sorted(tied, key=lambda k: (k not in failing, k))[:2])
    assert [k for k in Dom(page).rows if k in tied] == shown
    assert f"and {len(tied) - 2} more tied findings" in page


@pytest.mark.slow
def test_page_is_one_well_formed_html5_document(demo_page):
    page = demo_page.read_text(encoding="utf-8")
    assert page.startswith("<!DOCTYPE html>\n<html lang=\"en\">")
    parsed = Elements()
    parsed.feed(page)
    assert not parsed.mismatched and parsed.open == []
    assert parsed.tags["html"] == parsed.tags["head"] == parsed.tags["body"] == parsed.tags["main"] == 1
    ids = re.findall(r'\bid="([^"]+)"', page)
    assert len(ids) == len(set(ids))  # several inline SVGs, still no id twice


def test_projection_matches_an_svd_of_the_centred_rows(monkeypatch):
    from auditor.formats import plot_data

    monkeypatch.setattr(plot_data, "_BLOCK_VALUES", 7 * 16)  # blocks of 7 rows: the sums run over many blocks
    rng = np.random.default_rng(3)
    weight = (rng.standard_normal((500, 16)) * np.linspace(4, 0.5, 16) + 300.0).astype(np.float32)
    geometry = plot_data.row_geometry(weight)
    centred = weight.astype(np.float64) - weight.astype(np.float64).mean(axis=0)
    _, singular, directions = np.linalg.svd(centred, full_matrices=False)
    expected = centred @ directions[:2].T
    assert np.allclose(np.abs(geometry.projection), np.abs(expected), atol=1e-8)  # directions up to sign
    assert np.allclose(geometry.explained, singular[:2] ** 2 / (singular ** 2).sum())
    assert np.allclose(geometry.norms, np.linalg.norm(weight.astype(np.float64), axis=1))


def footer_commands(page: str) -> list[list[str]]:
    """The footer's commands, as the words a shell passes them."""
    return [shlex.split(unescape(line)) for line in re.findall(r'<code class="command">(.*?)</code>', page)]


@pytest.mark.slow
def test_footer_commands_remake_this_page_and_recheck_its_certificates(tmp_path):
    """Run as printed, the footer's audit command writes this very page and certificates file again, and its
    audit-verify command re-checks them (a path with a space: the words are quoted for a shell)."""
    pytest.importorskip("matplotlib")
    page, certs = tmp_path / "audit page.html", tmp_path / "certs.json"
    done = audit_html(page, DEMO, "--tokens", "4000-4004", "--certificates", certs)
    assert done.returncode == 1, done.stderr
    commands = footer_commands(page.read_text(encoding="utf-8"))
    head = [str(DEMO), "--weight", "weight", "--bias", "none"]
    assert commands == [["audit", *head, "--tokens", "4000-4004", "--certificates", str(certs),
                         "--format", "html", "--output", str(page)],
                        ["audit-verify", str(certs), *head]]
    page.unlink()
    certs.unlink()
    again = subprocess.run([sys.executable, "-m", "auditor", *commands[0][1:], "--quiet"], capture_output=True,
                           text=True, cwd=tmp_path)
    assert again.returncode == 1, again.stderr
    assert footer_commands(page.read_text(encoding="utf-8")) == commands
    check = subprocess.run([sys.executable, "-m", "auditor.cli.verify", *commands[1][1:]], capture_output=True,
                           text=True, cwd=tmp_path)
    assert check.returncode == 0, check.stdout + check.stderr


@pytest.mark.slow
def test_footer_of_a_page_on_stdout_writes_it_there_and_keeps_the_certificates_it_checks():
    pytest.importorskip("matplotlib")
    done = subprocess.run([sys.executable, "-m", "auditor", str(DEMO), "--tokens", "4004", "--format", "html",
                           "--quiet"], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 1, done.stderr
    head = [str(DEMO), "--weight", "weight", "--bias", "none"]
    assert footer_commands(done.stdout) == [
        ["audit", *head, "--tokens", "4004", "--certificates", "certificates.json", "--format", "html"],
        ["audit-verify", "certificates.json", *head]]


def test_missing_matplotlib_fails_before_the_audit_with_one_line(tmp_path):
    page = tmp_path / "r.html"
    block = ("import sys; sys.modules['matplotlib'] = None; from auditor.cli.audit import main; "
             f"sys.exit(main([{str(DEMO)!r}, '--format', 'html', '--output', {str(page)!r}]))")
    done = subprocess.run([sys.executable, "-c", block], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 2
    assert done.stderr == ("audit: error: --format html draws its plots with matplotlib: "
                           "pip install 'auditor[plots]'\n")
    assert not page.exists()


def small_page() -> str:
    """The page of a small head with a copied row and a row inside the hull, without its plots."""
    from auditor import audit
    from auditor.formats.html import render_page
    from auditor.formats.json_format import document
    from auditor.findings.gate import run_gate
    from auditor.question.head import Head

    W = np.array([[1, 2], [2, 1], [1, 0], [0, 1], [1, 1], [1, 0]], dtype=np.float32)  # 4 inside, 2 = 5
    return render_page(document(run_gate(Head(weight=W), audit(W, progress=False))), [], "audit head.npy")


def test_page_has_a_glossary_of_residual_margin_dual_bound_and_group_verdict():
    from html import unescape

    page = small_page()
    glossary = page[page.index('<section id="glossary">'):]
    glossary = glossary[:glossary.index("</section>")]
    terms = re.findall(r"<dt>(.*?)</dt>", glossary)
    assert {"residual", "margin", "dual bound", "group verdict"} <= set(terms)
    meaning = dict(zip(terms, (unescape(m) for m in re.findall(r"<dd>(.*?)</dd>", glossary))))
    assert "lowest id" in meaning["group verdict"] and "never the top prediction" in meaning["residual"]


def test_each_summary_on_the_page_carries_its_next_step():
    from html import unescape

    from auditor.findings.explain import NEXT_STEPS

    page = unescape(small_page())
    for kind in ("copy", "hull"):
        assert f'<p class="next">Next: {NEXT_STEPS[kind]}</p>' in page


# -- character lists: CJK token strings ------------------------------------------------------------

CJK = ["一", "二", "三", "四", "五"]


def cjk_folder(tmp_path) -> tuple[Path, Path]:
    """A 6-row head whose last row is the mean of the others (id 5, named 五 with --vocab-offset 1)."""
    from safetensors.numpy import save_file

    rows = np.random.default_rng(7).standard_normal((5, 3))
    rows /= np.linalg.norm(rows, axis=1, keepdims=True)
    save_file({"lm_head.weight": np.vstack([rows, rows.mean(axis=0)]).astype(np.float32)},
              str(tmp_path / "model.safetensors"))
    (tmp_path / "keys.txt").write_text("\n".join(CJK) + "\n", encoding="utf-8")
    return tmp_path / "model.safetensors", tmp_path / "keys.txt"


def test_cjk_token_strings_are_written_as_themselves_in_utf8(tmp_path):
    pytest.importorskip("matplotlib")
    import auditor
    from auditor.formats import html
    from auditor.findings.gate import run_gate
    from auditor.loader import load_head

    model, keys = cjk_folder(tmp_path)
    head = load_head(model, vocab=keys, vocab_offset=1)
    page = html.render(run_gate(head, auditor.audit(head.weight, head.bias, progress=False)))
    assert '<meta charset="utf-8">' in page
    parsed = Elements()
    parsed.feed(page)
    assert "'五'" in "".join(parsed.text)  # the finding's token, as itself
    assert "<code>&#x27;五&#x27;</code>" in page  # the character itself in the UTF-8 page, no reference
    words = footer_commands(page)[0]  # the footer's command names the character list again
    assert words[words.index("--vocab") + 1] == str(keys) and words[words.index("--vocab-offset") + 1] == "1"


@pytest.mark.slow
def test_cjk_token_strings_reach_the_browsers_dom(chromium, tmp_path):
    pytest.importorskip("matplotlib")
    model, keys = cjk_folder(tmp_path)
    page = tmp_path / "cjk.html"
    done = audit_html(page, model, "--vocab", keys, "--vocab-offset", "1")
    assert done.returncode == 1, done.stderr
    browsed = browse(chromium, page, tmp_path, "--dump-dom")
    assert browsed.returncode == 0, browsed.stderr
    dom = Dom(browsed.stdout)
    assert dom.body.get("data-ready") == "1" and set(dom.rows) == {5}
    assert "'五'" in browsed.stdout  # decoded as UTF-8 by the browser, not as mojibake


def test_the_banner_names_the_failing_tokens(demo_page):
    """The first thing a reviewer reads says which tokens fail, not only how many."""
    header = re.search(r'<header class="fails"><h1>[^<]*</h1><p>([^<]*)</p>', demo_page.read_text(encoding="utf-8"))
    assert header is not None
    failing = json.loads(subprocess.run([sys.executable, "-m", "auditor", str(DEMO), "--quiet", "--format", "json"],
                                        capture_output=True, text=True, check=False).stdout)["findings"]
    named = [f"{f['id']} (no string)" for f in failing if f["failing"]]  # the demo head has no token strings
    assert 0 < len(named) <= 8 and unescape(header[1]).endswith(": " + ", ".join(named) + ".")
