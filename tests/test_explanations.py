"""Findings explained in plain words: each cause is named, with the rows it involves, and findings
alike get one summary line."""

import numpy as np
import pytest

import auditor
from auditor.findings.gate import run_gate
from auditor.question.head import Head
from conftest import mean_initialised


def planted_head(rng):
    """400 rows on an ellipsoid (every one a vertex of the hull), then: 3 mean-initialised rows
    (400-402), a copy of row 7 (403), a shorter copy of row 11 (404) and the midpoint of rows 20, 21,
    22 shrunk towards the centre (405)."""
    d = 5
    sphere = rng.standard_normal((400, d))
    sphere /= np.linalg.norm(sphere, axis=1, keepdims=True)
    W = (sphere * np.arange(1, d + 1) ** -0.5).astype(np.float32)
    added = [mean_initialised(W, 3, rng), W[7:8], 0.9 * W[11:12], 0.5 * W[20:23].mean(axis=0, keepdims=True)]
    W = np.vstack([W] + [a.astype(np.float32) for a in added])
    tokens = [f"tok{k}" for k in range(W.shape[0])]
    return W, tokens


@pytest.fixture(scope="module")
def gated():
    W, tokens = planted_head(np.random.default_rng(7))
    head = Head(weight=W, tokens=tokens, token_source="given")
    report = auditor.audit(W, progress=False)
    return run_gate(head, report)


def by_id(result):
    return {f.id: f for f in result.findings}


def test_each_planted_cause_gets_its_kind(gated):
    kinds = {f.id: f.kind for f in gated.findings}
    assert {k: kinds[k] for k in (400, 401, 402)} == {400: "mean", 401: "mean", 402: "mean"}
    assert kinds[7] == kinds[403] == "copy"
    assert kinds[404] == "shorter copy"
    assert kinds[405] == "hull"


def geometry(finding):
    """The part of an explanation after its plain words: what the certificate shows."""
    return finding.explanation.split("; ", 1)[1]


def test_explanations_name_the_rows_they_rest_on(gated):
    found = by_id(gated)
    assert geometry(found[400]).startswith("at the mean of all rows (mean-initialised)")
    assert geometry(found[403]).startswith("copy of row 7 'tok7'")
    assert geometry(found[7]).startswith("copied as row 403 'tok403'")
    assert geometry(found[404]).startswith("a shorter copy of row 11 'tok11': 0.9 times its length")
    hull = found[405]
    assert geometry(hull).startswith(f"inside the hull of {hull.support} rows, mainly ")
    assert f"{hull.competitors[0].id} 'tok{hull.competitors[0].id}'" in hull.explanation


def test_explanations_say_first_in_plain_words_what_the_finding_means_for_generation(gated):
    found = by_id(gated)
    assert found[400].explanation.startswith("never produced: not trained away from where the vocabulary's "
                                             "resizing put it; ")
    assert found[7].explanation.startswith("greedy decoding produces it, and never its copy 403 'tok403': argmax "
                                           "returns the lowest id of a tie; ")
    assert found[403].explanation.startswith("greedy decoding never produces it: it always ties with 7 'tok7', "
                                             "and argmax returns the lower id; ")
    assert found[404].explanation.startswith("never produced: 11 'tok11' scores higher wherever it could lead; ")
    hull = found[405]
    assert hull.explanation.startswith(f"never produced: whatever the context, one of {hull.support} other "
                                       "tokens scores at least as high; ")


def test_every_kind_has_one_next_step_saying_what_people_do(gated):
    from auditor.findings.explain import NEXT_STEPS

    found = by_id(gated)
    for k in (400, 404, 405):
        assert found[k].next_step == NEXT_STEPS[found[k].kind]
    assert found[7].next_step.startswith("nothing to do for this row: greedy decoding emits it")
    assert found[403].next_step.startswith("re-initialise this row and train it")
    assert set(NEXT_STEPS) == {"mean", "copy", "shorter copy", "untrained", "added", "padding", "hull", "domain",
                               "reserved", "undecided", "ceiling"}
    for kind in ("untrained", "added"):  # the audit cannot see the data: it never says a target is missing
        assert "check" in NEXT_STEPS[kind] and "include the tokens" not in NEXT_STEPS[kind]
    for kind in ("mean", "copy", "shorter copy", "untrained", "added", "hull", "reserved"):
        assert any(word in NEXT_STEPS[kind] for word in ("trained", "re-initialised", "accepted")), kind


def test_each_summary_line_has_its_next_step(gated):
    from auditor.findings.explain import NEXT_STEPS

    kinds = list(dict.fromkeys(f.kind for f in gated.findings))
    assert len(gated.next_steps) == len(gated.summaries) == len(kinds)
    assert gated.next_steps == [NEXT_STEPS[kind] for kind in kinds]


def test_padding_and_reserved_tokens_are_named_as_such_and_accepting_them_is_the_next_step(rng):
    W, tokens = planted_head(rng)
    tokens[400], tokens[405] = "[PAD]", "<|reserved_special_token_5|>"
    tokens[401] = "[unused7]"
    result = run_gate(Head(weight=W, tokens=tokens, token_source="given"), auditor.audit(W, progress=False))
    found = by_id(result)
    assert {found[k].kind for k in (400, 401, 405)} == {"reserved"}
    assert found[402].kind == "mean"
    assert found[405].explanation.startswith("a padding or reserved token, never produced, as intended; inside the "
                                             "hull of ")
    assert "accepted" in found[405].next_step and "--allow" in found[405].next_step
    assert "3 padding or reserved tokens, never produced: 400–401, 405" in result.summaries


def test_findings_alike_get_one_summary_line(gated):
    lines = gated.summaries
    assert ("3 rows at the mean of all rows: 400–402, typical of a vocabulary resized with mean initialisation"
            in lines)
    assert ("2 rows in 1 group of identical rows (7 = 403): greedy decoding emits only the lowest id of a group "
            "that can win, so 1 of them is never produced") in lines
    assert "1 row is a shorter copy of other rows: 404" in lines


def test_a_row_that_is_not_near_the_mean_is_not_called_mean_initialised(gated):
    assert all(f.kind != "mean" for f in gated.findings if f.id < 400 or f.id > 402)


def test_bounded_domain_findings_say_the_domain_keeps_them_out_of_reach(rng):
    W = rng.standard_normal((60, 3))
    W = np.vstack([W, 1.05 * W[:1]])  # outside the hull: it wins in R^3, but only far out
    b = np.zeros(61)
    b[60] = -50.0
    report = auditor.audit(W, b, domain="ball:1", progress=False)
    result = run_gate(Head(weight=W, bias=b), report)
    finding = by_id(result)[60]
    assert finding.verdict == "unargmaxable" and finding.kind == "domain"
    assert finding.explanation.startswith("never produced in ball:1; out of reach: a mix of ")
    assert any(line.startswith("1 row out of reach in ball:1: 60") for line in result.summaries)


def test_id_ranges_are_compact():
    from auditor.findings.explain import id_ranges

    assert id_ranges([5, 3, 4, 9, 11, 12]) == "3–5, 9, 11–12"
    assert id_ranges(list(range(0, 40, 2)), limit=3) == "0, 2, 4 and 17 more"


def test_copies_at_the_exact_mean_are_named_mean_initialised_and_none_of_them_is_produced(rng):
    W, _ = planted_head(rng)
    W = np.vstack([W[:400], np.tile(W[:400].astype(np.float64).mean(axis=0), (3, 1)).astype(np.float32)])
    result = run_gate(Head(weight=W), auditor.audit(W, progress=False))
    found = by_id(result)
    assert sorted(found) == [400, 401, 402]
    assert {(f.verdict, f.group_verdict, f.kind, f.greedy) for f in found.values()} == {
        ("tied", "unargmaxable", "mean", "never")}
    assert found[401].explanation.startswith("never produced, nor are its copies: not trained away from where the "
                                             "vocabulary's resizing put them; copy of row 400: they always tie")
    assert "at the mean of all rows (mean-initialised)" in found[401].explanation
    assert "3 rows at the mean of all rows: 400–402, typical of a vocabulary resized with mean initialisation" in (
        result.summaries)


def test_a_copy_shorter_only_by_rounding_says_so_and_a_larger_bias_is_no_shorter_copy():
    """Row 50 is row 3 times 1 - 2^-30 (a copy that training left unchanged, up to rounding): the text must not
    read "1 times its length" (six digits of the ratio). With a bias, row 51 (0.5 times row 4) is a shorter copy only while its bias is
    at most row 4's; raised above it, row 51 wins near z = 0 unless other rows beat it there, and the text
    must not name row 4 as the row that outscores it."""
    rng = np.random.default_rng(3)
    sphere = rng.standard_normal((50, 4))
    W = np.vstack([sphere / np.linalg.norm(sphere, axis=1, keepdims=True), np.zeros((2, 4))])
    W[50] = W[3] * (1 - 2.0 ** -30)
    W[51] = 0.5 * W[4]
    for raised in (False, True):
        b = np.full(52, 0.5)
        b[4] = 0.1
        b[51] = 0.2 if raised else 0.1  # the rows of bias 0.5 keep row 51 from leading near z = 0 either way
        head = Head(weight=W, bias=b, tokens=[f"t{k}" for k in range(52)], token_source="given")
        found = by_id(run_gate(head, auditor.audit(W, b, progress=False)))
        assert found[50].kind == "shorter copy"
        assert "a shorter copy of row 3 't3', by 9.3e-10 of its length" in found[50].explanation
        assert found[51].verdict == "unargmaxable"
        assert (found[51].kind == "shorter copy") == (not raised)


def test_rivals_that_cannot_win_themselves_are_marked():
    """A certificate may lean on rows that can never win themselves (padding at the mean): they are marked, so
    that a reader knows which rivals actually beat the token; the order stays the certificate's."""
    from types import SimpleNamespace

    from auditor.findings.finding import _competitors

    token = SimpleNamespace(convex_indices=np.array([7, 3, 8, 2, 9]),
                            convex_weights=np.array([0.4, 0.2, 0.2, 0.1, 0.1]))
    head = Head(weight=np.zeros((10, 2), np.float32), tokens=[f"t{k}" for k in range(10)])
    rivals = _competitors(head, token, cannot_win={7, 8}, unsettled={9})
    assert [(c.id, c.can_win) for c in rivals] == [(7, False), (3, True), (8, False), (2, True), (9, None)]


def test_a_rival_is_said_to_win_only_where_the_audit_proved_it(rng):
    """Through the gate on a real report: a rival that is unargmaxable is marked, one this run did not decide
    (--tokens) has can_win None, the others True."""
    W = rng.standard_normal((30, 4))
    W[29] = (W[0] + W[1] + W[2]) / 3
    report = auditor.audit(W, tokens=[29, 5, 6], progress=False)
    finding = next(f for f in run_gate(Head(weight=W), report).findings if f.id == 29)
    verdicts = {k: report.tokens[k].verdict for k in (5, 6, 29)}
    expected = {k: verdict == "argmaxable" for k, verdict in verdicts.items()}
    assert finding.competitors and all(c.can_win is expected.get(c.id) for c in finding.competitors)
    assert any(c.can_win is None for c in finding.competitors)  # a row this run did not decide


def test_an_added_row_that_moved_yet_cannot_win_is_told_from_one_still_at_the_mean(rng):
    """Rows 40 and 41 were added past the tokenizer model's 40 tokens: 40 is still at the base rows' mean, 41 lies
    halfway between two base rows (inside the hull, far from the mean): trained, yet beaten."""
    from auditor.findings.explain import NEXT_STEPS

    W = rng.standard_normal((42, 6))
    W[40] = W[:40].mean(axis=0)
    W[41] = (W[3] + W[4]) / 2
    head = Head(weight=W, tokens=[f"t{k}" for k in range(42)], base_vocab=40)
    found = {f.id: f for f in run_gate(head, auditor.audit(W, progress=False)).findings}
    assert found[40].kind == "untrained" and "still where mean initialisation put it" in found[40].explanation
    assert found[41].kind == "added" and "away from where mean initialisation puts new rows" in found[41].explanation
    assert found[41].next_step == NEXT_STEPS["added"] and "longer" in found[41].next_step
