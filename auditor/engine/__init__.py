"""The engine: decides which tokens of a head can be the argmax, with a certificate for each.

``decide`` (pipeline.py) runs the stages in order; the answer is a
``Decisions`` (decisions.py). The other modules are the stages and the
float64 checks they all go through (certify.py).
"""

from auditor.engine.decisions import (ARGMAXABLE, INCONCLUSIVE, STAGES, TIED, UNARGMAXABLE, UNDECIDED, VERDICT_NAMES,
                                      Decisions)
from auditor.engine.pipeline import EngineOptions, decide

__all__ = ["ARGMAXABLE", "INCONCLUSIVE", "STAGES", "TIED", "UNARGMAXABLE", "UNDECIDED", "VERDICT_NAMES", "Decisions",
           "EngineOptions", "decide"]
