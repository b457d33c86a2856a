"""``audit-verify`` and ``auditor.load_certificates``: a certificates file re-checked against a checkpoint.

The true head passes; a head where one flagged row was moved out of the hull
fails with exactly that id; tampered witnesses and convex weights fail;
files and heads that do not fit are errors (exit 2, one line).
"""

import copy
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import auditor
from auditor.cli.audit import main as audit_main
from auditor.cli.verify import main as verify_main
from conftest import run_command

DEMO = Path(__file__).resolve().parent.parent / "fixtures" / "resized_demo.safetensors"
ADDED = [4000, 4001, 4002, 4003]  # the demo's mean-initialised rows; 4004 is a copy of 17


# Both commands run in this process (conftest.run_command): their output, not an interpreter's start-up.
def audit_cli(*args):
    return run_command(audit_main, *args)


def verify_cli(*args):
    return run_command(verify_main, *args)


def failed_ids(done) -> set[int]:
    """The ids of the per-token failure lines (every line but the summary)."""
    lines = done.stdout.strip().splitlines()
    assert lines and lines[-1].startswith("audit-verify:"), done.stdout
    return {int(line.split()[0]) for line in lines[:-1]}


def one_error_line(done) -> str:
    assert done.returncode == 2, (done.returncode, done.stdout, done.stderr)
    assert "Traceback" not in done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("audit-verify: error:"), done.stderr
    return lines[0]


def moved_out_of_hull(weight: np.ndarray, k: int) -> np.ndarray:
    """A copy of the head whose row k lies just beyond the hull, along the direction the rows spread least in.

    Past the largest projection of any row on u it is outside the hull; so close to
    the hull, and along a direction every row barely uses, it out-votes no other
    token's witness.
    """
    rows = weight.astype(np.float64)
    centre = rows.mean(axis=0)
    u = np.linalg.eigh(np.cov(rows.T))[1][:, 0]
    reach = float(((rows - centre) @ u).max())
    moved = weight.copy()
    moved[k] = (centre + 1.5 * reach * u).astype(weight.dtype)
    assert float((moved[k].astype(np.float64) - centre) @ u) > reach  # outside the hull, by construction
    return moved


@pytest.fixture(scope="module")
def demo_certificates(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("demo") / "certificates.json"
    done = audit_cli(DEMO, "--certificates", path, "--quiet")
    assert done.returncode == 1, done.stderr  # the demo has findings
    return path


def tampered(source: Path, target: Path, edit) -> Path:
    document = json.loads(source.read_text())
    edit({entry["id"]: entry for entry in document["tokens"]}, document)
    target.write_text(json.dumps(document))
    return target


# -- the true head and a moved row -------------------------------------------------------------------


@pytest.mark.slow
def test_true_head_passes_on_the_command_line(demo_certificates):
    done = verify_cli(demo_certificates, DEMO)
    assert done.returncode == 0, done.stdout + done.stderr
    assert len(done.stdout.strip().splitlines()) == 1
    # tokens and tie groups are counted apart: the demo's 4005 tokens, and its one group (17 and its copy 4004)
    assert done.stdout.strip() == "audit-verify: 4005 tokens and 1 tie group checked, all hold"


def test_true_head_passes_in_python_from_the_file_and_from_its_json(demo_certificates):
    weight = load_file(str(DEMO))["weight"]
    certificates = auditor.load_certificates(demo_certificates)
    assert certificates.n_tokens == 4005 and certificates.hidden_size == 64 and str(certificates.domain) == "unbounded"
    assert certificates.ids("unargmaxable") == [1900, 2631, *ADDED] and certificates.ids("tied") == [17, 4004]
    assert certificates.witness_formulas  # the screen's witnesses are written as formulas
    assert auditor.verify(certificates, weight).ok
    assert auditor.verify(json.loads(demo_certificates.read_text()), weight).ok


@pytest.mark.slow
def test_formula_witnesses_resolve_to_the_audits_own_bits():
    weight = load_file(str(DEMO))["weight"]
    report = auditor.audit(weight, progress=False)
    resolved = auditor.verdicts.certificates.parse_certificates(json.loads(json.dumps(report.to_dict()))).resolve(weight)
    assert resolved.witness_formulas == {}
    for k in range(report.n_tokens):
        ours, theirs = resolved.tokens[k].witness, report.tokens[k].witness
        assert (ours is None and theirs is None) or np.array_equal(ours, theirs), k


@pytest.mark.slow
def test_a_flagged_row_moved_out_of_the_hull_fails_with_exactly_its_id(demo_certificates, tmp_path):
    moved = tmp_path / "moved.safetensors"
    save_file({"weight": moved_out_of_hull(load_file(str(DEMO))["weight"], 4000)}, str(moved))
    done = verify_cli(demo_certificates, moved)
    assert done.returncode == 1, done.stdout + done.stderr
    assert failed_ids(done) == {4000}
    assert "convex" in done.stdout and done.stdout.strip().endswith("1 failed: 4000")


# -- tampered certificates ---------------------------------------------------------------------------


@pytest.mark.slow
def test_a_witness_formula_with_its_scale_negated_fails(demo_certificates, tmp_path):
    document = json.loads(demo_certificates.read_text())
    k = next(t["id"] for t in document["tokens"] if isinstance(t.get("witness"), dict))

    def negate(entries, _):
        entries[k]["witness"]["scale"] = -entries[k]["witness"]["scale"]

    done = verify_cli(tampered(demo_certificates, tmp_path / "c.json", negate), DEMO)
    assert done.returncode == 1 and failed_ids(done) == {k}
    assert "witness" in done.stdout


@pytest.mark.slow
def test_a_witness_list_copied_from_another_token_fails(demo_certificates, tmp_path):
    document = json.loads(demo_certificates.read_text())
    listed = [t for t in document["tokens"] if isinstance(t.get("witness"), list) and t["verdict"] == "argmaxable"]
    victim, donor = listed[0], listed[1]  # the donor's witness makes the donor, not the victim, win

    def swap(entries, _):
        entries[victim["id"]]["witness"] = list(donor["witness"])

    certificates = tampered(demo_certificates, tmp_path / "c.json", swap)
    done = verify_cli(certificates, DEMO)
    assert done.returncode == 1 and failed_ids(done) == {victim["id"]}
    result = auditor.verify(auditor.load_certificates(certificates), load_file(str(DEMO))["weight"])
    assert result.failed == [victim["id"]] and result.reasons[victim["id"]][0].startswith("witness:")


@pytest.mark.slow
def test_convex_weights_in_another_order_fail(demo_certificates, tmp_path):
    def reverse(entries, _):  # still non-negative and summing to 1, but another combination of rows
        entries[4001]["convex"]["weights"].reverse()

    done = verify_cli(tampered(demo_certificates, tmp_path / "c.json", reverse), DEMO)
    assert done.returncode == 1 and failed_ids(done) == {4001}
    assert "convex weights" in done.stdout


@pytest.mark.slow
def test_a_dropped_certificate_is_an_error_not_an_undecided_token(demo_certificates, tmp_path):
    def drop(entries, document):
        document["tokens"] = [t for t in document["tokens"] if t["id"] != 4002]

    line = one_error_line(verify_cli(tampered(demo_certificates, tmp_path / "c.json", drop), DEMO))
    assert "counts say 6 unargmaxable tokens but it lists 5" in line


# -- every stated number ----------------------------------------------------------------------------


def edit_field(k: int, path: tuple, value):
    def edit(entries, _):
        *parents, last = path
        entry = entries[k]
        for key in parents:
            entry = entry[key]
        entry[last] = value
    return edit


def stated_numbers_fail(certificates: Path, head: Path, tmp_path: Path, k: int, path: tuple, value, field: str):
    """The file with one number edited fails on exactly token k, and the failure names the field."""
    done = verify_cli(tampered(certificates, tmp_path / "edited.json", edit_field(k, path, value)), head)
    assert done.returncode == 1, done.stdout + done.stderr
    assert failed_ids(done) == {k}, done.stdout
    line = next(line for line in done.stdout.splitlines() if line.split()[0] == str(k))
    reasons = line.split(None, 2)[2].split("; ")  # after the id and the verdict
    assert any(reason.startswith(f"{field}: ") for reason in reasons), line


@pytest.mark.slow
def test_a_margin_edited_upwards_fails_naming_the_margin(demo_certificates, tmp_path):
    document = json.loads(demo_certificates.read_text())
    for kind in (dict, list):  # a screen's formula witness and a witness written out
        k = next(t["id"] for t in document["tokens"]
                 if t["verdict"] == "argmaxable" and isinstance(t.get("witness"), kind))
        stated_numbers_fail(demo_certificates, DEMO, tmp_path, k, ("margin",), 99.0, "margin")


@pytest.mark.slow
def test_a_residual_edited_downwards_fails_naming_the_residual(demo_certificates, tmp_path):
    document = json.loads(demo_certificates.read_text())
    entry = max((t for t in document["tokens"] if "convex" in t), key=lambda t: t["convex"]["residual"])
    assert entry["convex"]["residual"] > 0
    # The demo's reduced weights reproduce their rows to about 1e-17, below what any float64 check can
    # resolve, so first 1e-12 of weight moves between two rows: the weights then miss w_k by about 1e-12,
    # still far inside the tolerance (they still prove the verdict), and a stated residual 1024 times
    # below that is one they cannot give.
    weights = entry["convex"]["weights"]
    weights[0] += 1e-12
    weights[1] -= 1e-12
    moved = demo_certificates.parent / "moved.json"
    moved.write_text(json.dumps(document))
    W = load_file(str(DEMO))["weight"].astype(np.float64)
    indices = entry["convex"]["indices"]
    beta = np.asarray(weights) / np.sum(weights)
    residual = float(np.linalg.norm(beta @ (W[indices] - W[entry["id"]])))
    assert 1e-13 < residual < 1e-10
    stated_numbers_fail(moved, DEMO, tmp_path, entry["id"], ("convex", "residual"), residual / 1024, "residual")


@pytest.mark.slow
def test_a_bias_gap_edited_below_zero_fails_naming_the_bias_gap(demo_certificates, tmp_path):
    # the demo has no bias: every gap is exactly 0, and a file that claims -1 claims what no weights give
    stated_numbers_fail(demo_certificates, DEMO, tmp_path, 4001, ("convex", "bias_gap"), -1.0, "bias_gap")


def test_inconclusive_bounds_that_contradict_each_other_fail(demo_certificates, tmp_path):
    weight = load_file(str(DEMO))["weight"]
    document = json.loads(demo_certificates.read_text())
    entry = next(t for t in document["tokens"] if t["id"] == 4001)
    entry.update(verdict="inconclusive", bounds={"margin_lower": 0.5, "margin_upper": -0.5})
    entry.pop("convex")
    document["counts"]["unargmaxable"] -= 1
    document["counts"]["inconclusive"] += 1
    result = auditor.verify(document, weight)
    assert result.failed == [4001] and result.reasons[4001][0].startswith("bounds: margin_lower")
    entry["bounds"] = {"margin_lower": -0.5, "margin_upper": 0.5}
    assert auditor.verify(document, weight).ok


@pytest.fixture(scope="module")
def ball_ceilings(tmp_path_factory):
    """A biased head audited in ball:10 with probability ceilings: residuals there are dual bounds."""
    weight, bias = small_head(np.random.default_rng(8))
    folder = tmp_path_factory.mktemp("ball")
    head = folder / "head.safetensors"
    save_file({"lm_head.weight": weight, "lm_head.bias": bias}, str(head))
    certificates = folder / "c.json"
    done = audit_cli(head, "--domain", "ball:10", "--ceiling", "0.5", "--certificates", certificates, "--quiet")
    assert done.returncode in (0, 1), done.stderr
    return certificates, head


@pytest.mark.slow
def test_ball_certificates_with_ceilings_hold_untampered(ball_ceilings):
    certificates, head = ball_ceilings
    done = verify_cli(certificates, head)
    assert done.returncode == 0 and done.stdout.strip() == "audit-verify: 120 tokens and 0 tie groups checked, all hold", \
        done.stdout + done.stderr


@pytest.mark.slow
def test_a_dual_bound_edited_downwards_fails_naming_it(ball_ceilings, tmp_path):
    certificates, head = ball_ceilings
    entry = next(t for t in json.loads(certificates.read_text())["tokens"] if t["id"] == 118)
    assert entry["verdict"] == "unargmaxable"
    stated_numbers_fail(certificates, head, tmp_path, 118, ("convex", "residual"),
                        entry["convex"]["residual"] - 1.0, "residual (the dual bound)")
    stated_numbers_fail(certificates, head, tmp_path, 118, ("convex", "bias_gap"),
                        entry["convex"]["bias_gap"] - 1.0, "bias_gap")


@pytest.mark.slow
def test_probability_bounds_edited_fail_naming_them(ball_ceilings, tmp_path):
    certificates, head = ball_ceilings
    tokens = json.loads(certificates.read_text())["tokens"]
    low = min(tokens, key=lambda t: t["max_probability"]["lower"])
    high = max(tokens, key=lambda t: t["max_probability"]["lower"])
    assert low["max_probability"]["lower"] < 0.5 and high["max_probability"]["lower"] > 0.5
    stated_numbers_fail(certificates, head, tmp_path, low["id"], ("max_probability", "lower"),
                        min(1.0, 2 * low["max_probability"]["upper"] + 0.01), "max_probability.lower")
    stated_numbers_fail(certificates, head, tmp_path, high["id"], ("max_probability", "upper"),
                        high["max_probability"]["lower"] / 2, "max_probability.upper")
    stated_numbers_fail(certificates, head, tmp_path, high["id"], ("max_probability", "point"),
                        [0.0] * 5, "max_probability.lower")


# -- errors ------------------------------------------------------------------------------------------


def test_a_looser_tolerance_written_into_the_file_is_refused(demo_certificates, tmp_path):
    def loosen(tokens, document):
        document["tolerances"]["residual_tol"] = 1e6

    with pytest.raises(auditor.InputError, match="residual_tol"):
        auditor.load_certificates(tampered(demo_certificates, tmp_path / "loose.json", loosen))


def test_findings_relabelled_as_bare_ties_are_refused(demo_certificates, tmp_path):
    def relabel(tokens, document):
        for k in (4000, 4001):
            tokens[k].pop("convex")
            tokens[k]["verdict"] = "tied"
        document["counts"]["unargmaxable"] -= 2
        document["counts"]["tied"] += 2

    with pytest.raises(auditor.InputError, match="tied_with"):
        auditor.load_certificates(tampered(demo_certificates, tmp_path / "ties.json", relabel))


def test_verifying_a_biased_file_without_its_bias_is_an_error(tmp_path):
    rng = np.random.default_rng(2)
    weight, bias = rng.standard_normal((40, 3)), rng.standard_normal(40)
    document = auditor.audit(weight, bias, progress=False).to_dict()
    with pytest.raises(auditor.InputError, match="with a bias"):
        auditor.verify(document, weight)
    assert auditor.verify(document, weight, bias).ok


def test_a_file_without_argmaxable_tokens_loads_and_checks_the_rest(tmp_path):
    rng = np.random.default_rng(3)
    weight = np.vstack([rng.standard_normal((50, 3)), np.zeros((1, 3))])  # the origin: inside the hull
    report = auditor.audit(weight, progress=False)
    certificates = report.to_dict(include_argmaxable=False)
    result = auditor.verify(certificates, weight)
    assert result.ok and result.checked == len(report.ids("unargmaxable")) >= 1


def test_missing_certificates_file_is_an_error(tmp_path):
    line = one_error_line(verify_cli(tmp_path / "absent.json", DEMO))
    assert "absent.json: no such file" in line


@pytest.mark.slow
def test_an_audit_report_is_not_a_certificates_file(tmp_path):
    report = tmp_path / "report.json"
    seed = DEMO.parent / "seed_2d.safetensors"
    assert audit_cli(seed, "--format", "json", "--output", report, "--quiet").returncode == 1
    line = one_error_line(verify_cli(report, seed))
    assert "this is an audit report, not a certificates file; write one with audit --certificates FILE" in line


def test_a_head_of_another_shape_is_an_error(demo_certificates):
    line = one_error_line(verify_cli(demo_certificates, DEMO.parent / "seed_2d.safetensors"))
    assert "5 x 2" in line and "4005 x 64" in line


def test_another_domain_is_an_error(demo_certificates):
    line = one_error_line(verify_cli(demo_certificates, DEMO, "--domain", "ball:10"))
    assert "--domain ball:10" in line and "unbounded" in line


def test_a_missing_checkpoint_is_an_error(demo_certificates, tmp_path):
    assert "no such file" in one_error_line(verify_cli(demo_certificates, tmp_path / "absent.safetensors"))


@pytest.mark.slow
def test_a_bias_the_audit_left_out_is_an_error_that_says_bias_none(tmp_path):
    rng = np.random.default_rng(5)
    head = tmp_path / "head.safetensors"
    save_file({"lm_head.weight": rng.standard_normal((40, 3)).astype(np.float32),
               "lm_head.bias": rng.standard_normal(40).astype(np.float32)}, str(head))
    certificates = tmp_path / "c.json"
    assert audit_cli(head, "--bias", "none", "--certificates", certificates, "--quiet").returncode in (0, 1)
    assert "--bias none" in one_error_line(verify_cli(certificates, head))
    assert verify_cli(certificates, head, "--bias", "none").returncode == 0


def test_malformed_documents_raise_one_line_input_errors(demo_certificates, tmp_path):
    garbage = tmp_path / "garbage.json"
    garbage.write_text("{not json")
    with pytest.raises(auditor.InputError, match=r"garbage\.json: not JSON"):
        auditor.load_certificates(garbage)
    document = json.loads(demo_certificates.read_text())
    for change, message in (({"schema_version": 2}, "schema_version 2"),
                            ({"kind": "auditor-baseline"}, "kind 'auditor-baseline'"),
                            ({"centre": [0.0] * 3}, "centre has 3 entries, expected 64")):
        broken = tmp_path / "broken.json"
        broken.write_text(json.dumps({**document, **change}))
        with pytest.raises(auditor.InputError, match=rf"broken\.json: .*{message}") as raised:
            auditor.load_certificates(broken)
        assert "\n" not in str(raised.value)
    missing_head = {key: value for key, value in document.items() if key != "head"}
    with pytest.raises(auditor.InputError, match="no 'head' field"):
        auditor.verify(missing_head, load_file(str(DEMO))["weight"])
    out_of_range = copy.deepcopy(document)
    next(t for t in out_of_range["tokens"] if "convex" in t)["convex"]["indices"][0] = -1
    with pytest.raises(auditor.InputError, match="convex index -1"):  # numpy would silently read the last row
        auditor.verify(out_of_range, load_file(str(DEMO))["weight"])


def test_the_certificates_file_says_what_it_is(demo_certificates):
    document = json.loads(demo_certificates.read_text())
    assert document["schema_version"] == 1 and document["kind"] == "auditor-certificates"
    assert document["tool"] == {"name": "auditor", "version": auditor.__version__}


# -- bounded and norm domains ------------------------------------------------------------------------


def small_head(rng, n=120, d=5):
    """Random rows of varied norms with a bias, and two rows at the mean of others (inside the hull)."""
    rows = rng.standard_normal((n, d)) * rng.lognormal(0.0, 0.3, (n, 1))
    rows[-2:] = rows[:-2].mean(axis=0) + 1e-3 * rng.standard_normal((2, d))
    return rows.astype(np.float32), (0.1 * rng.standard_normal(n)).astype(np.float32)


@pytest.mark.slow
def test_ball_domain_certificates_hold_and_a_tampered_witness_fails(tmp_path):
    weight, bias = small_head(np.random.default_rng(8))
    head = tmp_path / "head.safetensors"
    save_file({"lm_head.weight": weight, "lm_head.bias": bias}, str(head))
    certificates = tmp_path / "c.json"
    assert audit_cli(head, "--domain", "ball:10", "--certificates", certificates, "--quiet").returncode in (0, 1)
    loaded = auditor.load_certificates(certificates)
    assert str(loaded.domain) == "ball:10" and loaded.has_bias
    assert {118, 119} <= set(loaded.ids("unargmaxable"))
    done = verify_cli(certificates, head)
    assert done.returncode == 0 and "all hold" in done.stdout, done.stdout + done.stderr
    assert verify_cli(certificates, head, "--domain", "ball:10").returncode == 0
    k = loaded.ids("argmaxable")[0]
    z = loaded.resolve(weight).tokens[k].witness

    def stretch(entries, _):  # the same direction, but of length 20: it still wins, outside the ball
        entries[k]["witness"] = [float(v) for v in z * (20 / np.linalg.norm(z))]

    done = verify_cli(tampered(certificates, tmp_path / "t.json", stretch), head)
    assert done.returncode == 1 and failed_ids(done) == {k} and "outside the ball:10 domain" in done.stdout


@pytest.mark.slow
def test_norm_domain_certificates_hold_and_a_borrowed_pre_norm_fails(tmp_path):
    weight, bias = small_head(np.random.default_rng(9), n=60, d=4)
    rng = np.random.default_rng(10)
    head = tmp_path / "model.safetensors"
    save_file({"lm_head.weight": weight, "lm_head.bias": bias,
               "model.norm.weight": rng.uniform(0.5, 1.5, 4).astype(np.float32),
               "model.norm.bias": (0.1 * rng.standard_normal(4)).astype(np.float32)}, str(head))
    (tmp_path / "config.json").write_text(json.dumps({"layer_norm_eps": 1e-5}))
    certificates = tmp_path / "c.json"
    assert audit_cli(head, "--domain", "norm", "--certificates", certificates, "--quiet").returncode in (0, 1)
    document = json.loads(certificates.read_text())
    assert document["final_norm"]["kind"] == "layernorm"
    winners = [t for t in document["tokens"] if t["verdict"] == "argmaxable"]
    assert winners and all("pre_norm" in t and "witness" not in t for t in winners)
    done = verify_cli(certificates, head)
    assert done.returncode == 0 and "all hold" in done.stdout, done.stdout + done.stderr
    victim, donor = winners[0], winners[1]

    def borrow(entries, _):
        entries[victim["id"]]["pre_norm"] = list(donor["pre_norm"])

    done = verify_cli(tampered(certificates, tmp_path / "t.json", borrow), head)
    assert done.returncode == 1 and failed_ids(done) == {victim["id"]}
    line = one_error_line(verify_cli(certificates, head, "--norm-unit-offset"))
    assert "unit_offset" in line


# -- the real vocabulary -----------------------------------------------------------------------------


@pytest.mark.slow
def test_real_resized_head_passes_and_fails_with_exactly_the_moved_row(resized_minilm, resized_minilm_audit, tmp_path):
    """all-MiniLM-L6-v2's folder with four mean-initialised rows and a copied row added (conftest.resized_minilm,
    as in test_checkpoints), and the audit command's certificates of it (exit 1: made once for both modules)."""
    folder, tensors = resized_minilm
    certificates = resized_minilm_audit[3]
    done = verify_cli(certificates, folder)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.strip().endswith("all hold")

    moved = tmp_path / "moved"
    moved.mkdir()
    shutil.copy(folder / "config.json", moved / "config.json")
    name = "embeddings.word_embeddings.weight"
    save_file({**tensors, name: moved_out_of_hull(tensors[name], 30522)}, str(moved / "model.safetensors"))
    done = verify_cli(certificates, moved)
    assert done.returncode == 1 and failed_ids(done) == {30522}, done.stdout
    assert done.stdout.strip().endswith("1 failed: 30522")


def test_a_radius_with_many_digits_is_written_so_that_it_reads_back_exactly():
    for radius in (10.0, 0.1, 1.23456789, 2.0**-30, 1 / 3):
        for domain in (auditor.Ball(radius), auditor.Box(radius)):
            assert auditor.parse_domain(str(domain)) == domain
    assert str(auditor.Ball(10.0)) == "ball:10"


def test_another_head_of_the_same_shape_is_named_in_the_first_line_and_the_list_is_capped(tmp_path):
    """Certificates checked against a head whose rows were shuffled: nearly every witness and weight fails, so
    the first line says that this is probably not the audited head, and the per-token lines stop at 50."""
    certs = tmp_path / "certificates.json"
    assert audit_cli(DEMO, "--tokens", "0-199", "--certificates", certs, "--quiet").returncode in (0, 1)
    weight = load_file(str(DEMO))["weight"]
    other = tmp_path / "other.safetensors"
    save_file({"weight": np.ascontiguousarray(weight[np.random.default_rng(0).permutation(len(weight))])}, str(other))
    done = verify_cli(certs, other)
    assert done.returncode == 1, done.stderr
    lines = done.stdout.strip().splitlines()
    assert lines[0].startswith("audit-verify: ") and "is probably not the head they were written for" in lines[0]
    assert str(DEMO) in lines[0] or "resized_demo.safetensors" in lines[0]
    assert lines[-2].strip().startswith("... and ") and len(lines) == 1 + 50 + 2
    assert verify_cli(certs, DEMO).returncode == 0
