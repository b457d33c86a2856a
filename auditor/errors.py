"""Errors meant for people, and the exit codes every command shares."""

# 0: no failing finding (or every certificate holds); 1: failing findings (or certificates that do not hold);
# 2: a usage, load or input error, said in one line
EXIT_CLEAN, EXIT_FINDINGS, EXIT_ERROR = 0, 1, 2


class AuditorError(Exception):
    """Base class of every error the auditor raises on purpose."""


class InputError(AuditorError, ValueError):
    """The weights, bias, domain or options cannot be audited as given."""
