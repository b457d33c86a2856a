"""The screen: the cheap passes over the whole vocabulary that decide most tokens.

Exact duplicate rows first (ties.py); then one Gram pass tries formula witnesses for every token
(gram.py), after a certified int8 pass (integer_pass.py) or bfloat16 pass (low_precision.py) on large
heads; the tokens left on large heads without a bias try the whitened direction (whitened.py).
Every witness it reports is proven against a stated rounding allowance.
"""

from auditor.engine.screen.gram import ScreenResult, screen
from auditor.engine.screen.ties import duplicate_groups
from auditor.engine.screen.whitened import whitened_witnesses

__all__ = ["ScreenResult", "duplicate_groups", "screen", "whitened_witnesses"]
