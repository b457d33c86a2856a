"""The engine: decides which tokens of a head can be the argmax, with a certificate for each.

``decide`` (pipeline.py) runs the stages in order (stages.py runs each and records what it proved);
the answer is a ``Decisions`` (decisions.py). The phases are rooms of their own, each importing only
those below it:

- ``screen/``: exact ties, and the int8, bfloat16 and float32 passes with the whitened witnesses;
- ``solvers/``: the interior stage, the minimum-norm rounds, Frank-Wolfe, Newton and the origin's route;
- ``ceiling/``: probability ceilings over bounded domains;
- ``exact/``: the float64 checks every proposal goes through, the LP, Carathéodory, pools, the dual simplex;
- ``arithmetic/``: rounding bounds, powers of two, the normal form and the engine head.
"""

from auditor.engine.decisions import (ARGMAXABLE, INCONCLUSIVE, STAGES, TIED, UNARGMAXABLE, UNDECIDED, VERDICT_NAMES,
                                      Decisions)
from auditor.engine.options import EngineOptions
from auditor.engine.pipeline import decide

__all__ = ["ARGMAXABLE", "INCONCLUSIVE", "STAGES", "TIED", "UNARGMAXABLE", "UNDECIDED", "VERDICT_NAMES", "Decisions",
           "EngineOptions", "decide"]
