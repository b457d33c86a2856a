"""The exact stage: what turns a proposal into a verdict, and the LP for whatever is left.

The float64 checks every witness and convex certificate goes through (certify.py); the margin LP with
constraint generation (lp.py); Carathéodory's reduction of a certificate to at most D rows
(caratheodory.py), pools of rows around the centre with their weights (pools.py) and the dual simplex
from a shared basis (dual_simplex.py). Nothing here imports the screen or the solvers.
"""

from auditor.engine.exact.caratheodory import reduce_support, reduce_supports
from auditor.engine.exact.certify import check_convex, check_witnesses
from auditor.engine.exact.constraint_generation import lp_decide_all
from auditor.engine.exact.dual_simplex import Basis
from auditor.engine.exact.lp import polish

__all__ = ["Basis", "check_convex", "check_witnesses", "lp_decide_all", "polish", "reduce_support", "reduce_supports"]
