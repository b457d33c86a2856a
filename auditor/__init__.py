"""auditor: which tokens of a vocabulary head can never be the top prediction, with proofs.

    import auditor
    report = auditor.audit(weight, bias=None, domain="unbounded")
    report.ids("unargmaxable"); report.tokens[k].witness; report.to_dict()
"""

import os

# torch's OpenMP threads (GNU libgomp in its CPU builds) wait for work by spinning: between an audit's many short
# parallel regions they hold cores a busy neighbour needs, and on a shared machine the audit slows far more than
# by its share (bench/contention.py; docs/performance.md, "Busy neighbours"). libgomp reads the policy when torch
# loads it, so it is set before anything imports torch; a choice already in the environment stands.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from auditor._version import __version__  # noqa: E402
from auditor.api import audit  # noqa: E402
from auditor.errors import AuditorError, InputError  # noqa: E402
from auditor.integrations.model import audit_model  # noqa: E402
from auditor.question.domain import Ball, Box, NonNeg, Norm, Unbounded, parse_domain  # noqa: E402
from auditor.question.norm import FinalNorm  # noqa: E402
from auditor.verdicts.certificates import Certificates, TokenVerdict, load_certificates  # noqa: E402
from auditor.verdicts.report import AuditReport  # noqa: E402
from auditor.verify import Verification, verify  # noqa: E402

__all__ = [
    "audit", "audit_model", "verify", "load_certificates", "Certificates", "AuditReport", "TokenVerdict", "Verification",
    "Ball", "Box", "NonNeg", "Norm", "Unbounded", "FinalNorm", "parse_domain", "AuditorError", "InputError", "__version__",
]
