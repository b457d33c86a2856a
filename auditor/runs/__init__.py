"""Ways to run an audit beyond one call: in blocks (blocks.py) kept in a work folder that resumes
(workdir.py), over torchrun ranks (distributed.py), as shards merged afterwards (merge.py), and over a
training run's checkpoints (trend.py)."""

from auditor.runs.blocks import AuditJob, audit_in_blocks
from auditor.runs.distributed import run_on_ranks
from auditor.runs.merge import merge_reports
from auditor.runs.workdir import WorkDir

__all__ = ["AuditJob", "WorkDir", "audit_in_blocks", "merge_reports", "run_on_ranks"]
