"""The solvers: iterative and closed-form methods for the tokens the screen leaves.

The interior stage's closed-form weights (interior.py), Wolfe's minimum-norm rounds for low-rank heads
(corrective.py), batched pairwise Frank-Wolfe without a bias (frank_wolfe.py) and on a domain's dual
(bounded_dual.py), maximum-entropy weights by Newton's method (tilt.py) and the origin's certificate for
rows on rays through it (anchor.py). Each only proposes: the exact stage's checks accept or reject.
"""

from auditor.engine.solvers.anchor import anchored_certificates
from auditor.engine.solvers.corrective import corrective_certificates
from auditor.engine.solvers.interior import interior_certificates
from auditor.engine.solvers.tilt import tilted_certificates

# (frank_wolfe and bounded_dual, the functions, stay in their modules: the names are the modules')
__all__ = ["anchored_certificates", "corrective_certificates", "interior_certificates", "tilted_certificates"]
