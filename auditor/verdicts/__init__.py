"""What an audit answers: a verdict and its certificate per token (certificates.py: the certificates file
written and read back checked) and the report of a whole audit (report.py)."""

from auditor.verdicts.certificates import Certificates, TokenVerdict, load_certificates
from auditor.verdicts.report import AuditReport

__all__ = ["AuditReport", "Certificates", "TokenVerdict", "load_certificates"]
