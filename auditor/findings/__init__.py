"""What a report means for a release: the findings with their rivals (finding.py), in plain words
(explain.py), new since a baseline (baseline.py), and which of them fail the run (gate.py)."""

from auditor.findings.baseline import Baseline
from auditor.findings.finding import Finding
from auditor.findings.gate import AllowList, GateResult, run_gate

__all__ = ["AllowList", "Baseline", "Finding", "GateResult", "run_gate"]
