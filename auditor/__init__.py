"""auditor: which tokens of a vocabulary head can never be the top prediction, with proofs.

    import auditor
    report = auditor.audit(weight, bias=None, domain="unbounded")
    report.ids("unargmaxable"); report.tokens[k].witness; report.to_dict()
"""

from auditor._version import __version__
from auditor.api import audit
from auditor.errors import AuditorError, InputError
from auditor.integrations.model import audit_model
from auditor.question.domain import Ball, Box, NonNeg, Norm, Unbounded, parse_domain
from auditor.question.norm import FinalNorm
from auditor.verdicts.certificates import Certificates, TokenVerdict, load_certificates
from auditor.verdicts.report import AuditReport
from auditor.verify import Verification, verify

__all__ = [
    "audit", "audit_model", "verify", "load_certificates", "Certificates", "AuditReport", "TokenVerdict", "Verification",
    "Ball", "Box", "NonNeg", "Norm", "Unbounded", "FinalNorm", "parse_domain", "AuditorError", "InputError", "__version__",
]
