"""The engine's arithmetic: what every phase stands on.

Rigorous bounds on floating-point rounding (rounding.py), exact products with powers of two
(power_of_two.py), the normal form a head is decided in (normal_form.py), the head on its device with
the per-row facts every stage reuses (head.py, its statistics in row_statistics.py), and the heap's free
pages handed back between stages (heap.py). Nothing here proposes or accepts a verdict.
"""

from auditor.engine.arithmetic.head import EngineHead, build_engine_head
from auditor.engine.arithmetic.normal_form import NormalForm, to_given_units
from auditor.engine.arithmetic.rounding import gamma, proven_lower, proves_positive, safe_norm

# (normal_form, the function, stays in its module: the name is the module's)
__all__ = ["EngineHead", "NormalForm", "build_engine_head", "gamma", "proven_lower", "proves_positive", "safe_norm",
           "to_given_units"]
