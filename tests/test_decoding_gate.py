"""The gate follows greedy decoding: of a group of identical rows only the lowest id can be emitted (argmax
returns the first maximal index), and only when the group can win. Small heads check each gate class against
a plain numpy argmax; the real MiniLM head, resized as people resize it, checks the trap a user walked into."""

import json

import numpy as np
import pytest
from safetensors.numpy import save_file

import auditor
from auditor.errors import InputError
from auditor.findings.finding import gate_classes, greedy_decoding
from auditor.findings.gate import DEFAULT_FAIL_ON, parse_fail_on, run_gate
from auditor.question.head import Head
from conftest import run_command

CIRCLE = 8  # ids 0..7: points on the unit circle, every one a vertex of the hull


def circle_head() -> np.ndarray:
    """8 points on the unit circle, unevenly spaced, then 8 = a copy of 1; 9, 10, 11 = three rows at the exact
    mean of the first 8 (inside their hull); 12 = half of row 3; 13, 14 = two copies of 5."""
    angles = np.array([0.0, 0.7, 1.6, 2.2, 3.0, 3.9, 4.6, 5.5])
    W = np.stack([np.cos(angles), np.sin(angles)], axis=1)
    mean = W.mean(axis=0)
    return np.vstack([W, W[1], mean, mean, mean, 0.5 * W[3], W[5], W[5]])


NEVER = {8, 9, 10, 11, 12, 13, 14}  # what greedy decoding can never produce, by construction
TIED = {1, 5, 8, 9, 10, 11, 13, 14}


@pytest.fixture(scope="module")
def circle():
    W = circle_head()
    report = auditor.audit(W, progress=False)
    return W, report, Head(weight=W)


def greedy_tokens(W: np.ndarray, samples: int = 20000) -> set[int]:
    """The ids np.argmax (first maximal index, as greedy decoding) returns over many directions in the plane,
    the rows' own directions included (where copies tie exactly)."""
    angles = np.linspace(0, 2 * np.pi, samples, endpoint=False)
    Z = np.vstack([np.stack([np.cos(angles), np.sin(angles)], axis=1), W[:CIRCLE]])
    return set(np.argmax(Z @ W.T, axis=1).tolist())


def failing(W, report, fail_on) -> set[int]:
    return {f.id for f in run_gate(Head(weight=W), report, fail_on).failing}


def test_the_construction_is_what_numpy_argmax_says(circle):
    W, _, _ = circle
    assert greedy_tokens(W) == set(range(CIRCLE))  # 1 and 5 are emitted, their copies never are


def test_never_emitted_lists_exactly_what_greedy_decoding_cannot_produce(circle):
    W, report, _ = circle
    assert set(report.never_emitted()) == NEVER
    assert not set(report.never_emitted()) & greedy_tokens(W)


def test_tied_tokens_of_an_unargmaxable_group_are_listed_with_the_unargmaxable_ids_on_request(circle):
    _, report, _ = circle
    assert report.ids("unargmaxable") == [12]  # as before: tied tokens keep their own verdict
    assert report.ids("unargmaxable", groups=True) == [9, 10, 11, 12]
    assert {report.tokens[k].group_verdict for k in (9, 10, 11)} == {"unargmaxable"}
    assert set(report.ids("tied")) == TIED and set(report.ids("tied", groups=True)) == TIED


def test_the_default_gate_fails_on_every_token_greedy_decoding_never_produces_and_on_no_other(circle):
    W, report, _ = circle
    assert failing(W, report, DEFAULT_FAIL_ON) == NEVER
    assert "tied" not in DEFAULT_FAIL_ON


def test_fail_on_unargmaxable_fails_on_the_members_of_an_unargmaxable_group(circle):
    W, report, _ = circle
    assert failing(W, report, {"unargmaxable"}) == {9, 10, 11, 12}


def test_fail_on_never_emitted_and_fail_on_tied(circle):
    W, report, _ = circle
    assert failing(W, report, {"never-emitted"}) == NEVER
    assert failing(W, report, {"tied"}) == TIED  # every tied token, as the old default did


def test_the_report_names_the_member_greedy_decoding_emits_and_those_it_never_emits(circle):
    W, report, head = circle
    found = {f.id: f for f in run_gate(head, report).findings}
    assert {k: found[k].greedy for k in sorted(TIED)} == {1: "emits", 5: "emits", 8: "never", 9: "never",
                                                           10: "never", 11: "never", 13: "never", 14: "never"}
    assert found[1].classes == ("tied",) and found[8].classes == ("never-emitted", "tied")
    assert found[9].classes == ("unargmaxable", "never-emitted", "tied")
    assert found[1].explanation.startswith("greedy decoding produces it, and never its copy 8")
    assert found[5].explanation.startswith("greedy decoding produces it, and never its copies 13, 14")
    assert found[13].explanation.startswith("greedy decoding never produces it: it always ties with 5")
    assert found[10].explanation.startswith("never produced, nor are its copies")
    witness = report.tokens[1].witness  # the group's witness: numpy's argmax there is the lowest id
    assert int(np.argmax(W @ witness)) == 1


def test_a_group_whose_lowest_id_is_outside_the_audited_ids_still_gates_by_decoding(circle):
    W, _, _ = circle
    assert failing(W, auditor.audit(W, tokens=[1], progress=False), DEFAULT_FAIL_ON) == set()
    assert failing(W, auditor.audit(W, tokens=[8], progress=False), DEFAULT_FAIL_ON) == {8}


def test_an_inconclusive_group_fails_as_inconclusive_on_its_lowest_id_and_as_never_emitted_on_the_others():
    lowest, other = greedy_decoding("tied", "inconclusive", True), greedy_decoding("tied", "inconclusive", False)
    assert (lowest, other) == ("unknown", "never")
    assert gate_classes("tied", "inconclusive", lowest) == ("tied", "inconclusive")
    assert gate_classes("tied", "inconclusive", other) == ("never-emitted", "tied")
    assert gate_classes("inconclusive", None, "unknown") == ("inconclusive",)
    assert gate_classes("low-ceiling", None, greedy_decoding("low-ceiling", None, True)) == ("low-ceiling",)


def test_fail_on_takes_the_classes_and_names_them_when_it_does_not_know_one():
    assert parse_fail_on("never-emitted,unargmaxable") == {"never-emitted", "unargmaxable"}
    with pytest.raises(InputError, match="never-emitted"):
        parse_fail_on("never")


def test_the_command_fails_on_exact_mean_rows_with_fail_on_unargmaxable(tmp_path):
    """The trap on a small head: three new rows at the exact mean tie with each other, and their group is
    inside the hull; `--fail-on unargmaxable` must fail on them."""
    W = circle_head()[:12].astype(np.float32)
    path = tmp_path / "head.safetensors"
    save_file({"lm_head.weight": W}, str(path))
    from auditor.cli.audit import main

    done = run_command(main, path, "--fail-on", "unargmaxable", "--format", "json", "--quiet")  # in this process
    assert done.returncode == 1, done.stderr
    report = json.loads(done.stdout)
    assert {f["id"] for f in report["findings"] if f["failing"]} == {9, 10, 11}
    assert all("unargmaxable" in f["classes"] for f in report["findings"] if f["failing"])


@pytest.mark.slow
def test_the_resized_minilm_head_gates_as_greedy_decoding_emits(vocabulary):
    """The real MiniLM head resized as the issue describes: 3 rows at the exact mean (torchtune's default),
    2 rows at the mean plus N(0, 1/d) noise, and a copy of row 1996 ('the')."""
    n, d = vocabulary.shape
    rng = np.random.default_rng(20)
    mean = vocabulary.astype(np.float64).mean(axis=0)
    noisy = mean + rng.normal(0.0, d ** -0.5, size=(2, d))
    head = np.vstack([vocabulary, np.tile(mean, (3, 1)), noisy, vocabulary[[1996]]]).astype(np.float32)
    exact_mean, copy = [n, n + 1, n + 2], n + 5
    report = auditor.audit(head, progress=False)
    assert report.ids("tied") == [1996, *exact_mean, copy]
    assert {report.tokens[k].group_verdict for k in exact_mean} == {"unargmaxable"}
    assert report.tokens[copy].group_verdict == "argmaxable"

    # trap 1: --fail-on unargmaxable fails on the exact-mean rows, and the API lists them on request
    assert set(exact_mean) <= failing(head, report, {"unargmaxable"})
    assert set(exact_mean) <= set(report.ids("unargmaxable", groups=True))
    assert not set(exact_mean) & set(report.ids("unargmaxable"))

    # trap 2: 'the' is emitted (numpy's argmax at its witness), its copy never; only the copy fails by default
    witness = report.tokens[1996].witness.astype(np.float64)
    assert int(np.argmax(head.astype(np.float64) @ witness)) == 1996
    never = set(report.never_emitted())
    assert copy in never and 1996 not in never and set(exact_mean) <= never
    result = run_gate(Head(weight=head), report)
    assert {f.id for f in result.failing} == never | set(report.ids("inconclusive"))
    assert never == {*exact_mean, copy} and report.counts["argmaxable"] == n + 1  # the noisy rows can win
    found = {f.id: f for f in result.findings}
    assert found[1996].greedy == "emits" and found[copy].greedy == "never"
    assert {found[k].kind for k in exact_mean} == {"mean"}  # copies of one row at the mean: mean-initialised
    assert found[1996].explanation.startswith(f"greedy decoding produces it, and never its copy {copy}")
    assert found[copy].explanation.startswith("greedy decoding never produces it: it always ties with 1996")
