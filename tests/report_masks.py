"""Masks for comparing a report with a committed one: what may differ between two correct runs.

Wall-clock times differ from run to run. Floating-point numbers differ in their last digits from one
BLAS, thread count or numpy build to another (sums reduced in another order): they are compared to 9
significant digits, and numbers below 1e-11 in magnitude (residuals at the rounding level) only as such.
"""

import re

_TIMES = re.compile(r"\d+\.\d+ s \(load \d+\.\d+ s, audit \d+\.\d+ s\)")
_TIMING_FIELDS = re.compile(r'("[a-z_]+_s"): [0-9.e+-]+')
_FLOAT = re.compile(r"-?(?:\d+\.\d+(?:e[+-]?\d+)?|\d+e[+-]?\d+)")


def _rounded(match: re.Match) -> str:
    value = float(match.group())
    return "ROUNDING" if abs(value) < 1e-11 else f"{value:.9g}"


def masked(text: str) -> str:
    text = _TIMES.sub("T s (load T s, audit T s)", text)
    text = _TIMING_FIELDS.sub(r"\1: T", text)
    return _FLOAT.sub(_rounded, text)
