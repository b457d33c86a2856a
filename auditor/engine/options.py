"""What a caller may set for the engine: iteration budgets, the tolerance, and the head sizes that switch passes on."""

from __future__ import annotations

from dataclasses import dataclass, field

from auditor.engine.arithmetic import head as head_module


@dataclass
class EngineOptions:
    frank_wolfe_iterations: int = 100
    newton_iterations: int = 40
    min_norm_rounds: int = 40  # rounds of the fully corrective minimum-norm method per token (corrective.py)
    lp_rounds: int = 10  # rounds of constraint generation per token before the LP over all rows
    #                    (exact/constraint_generation.py)
    residual_tol: float = 1e-10
    defer_flat: bool = False  # bounded domains: leave tokens whose dual value is zero up to the tolerance
    #                           inconclusive rather than solve an LP (the norm domain settles them in R^d)
    # a witness must lead by more than the tolerance a convex certificate may rest on (head.witness_lead),
    # so that no token can hold both and the verdict does not depend on which is found first; the
    # norm domain's reduced head, whose convex certificates also come from the head as given, does not
    decide_at_tolerance: bool = True
    # heads of at least this many entries (n d) are screened in bfloat16 first (low_precision.py), and,
    # without a bias, try whitened witnesses before Frank-Wolfe: below them neither pays for itself
    bfloat16_entries: int = field(default_factory=lambda: head_module.BFLOAT16_ENTRIES)
    whitened_entries: int = field(default_factory=lambda: head_module.WHITENED_ENTRIES)
    # heads without a bias of at least this many entries take the int8 pass instead of the bfloat16 one
    # where the device's int8 product is exact (integer_pass.py)
    int8_entries: int = field(default_factory=lambda: head_module.INT8_ENTRIES)
