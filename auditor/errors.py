"""Errors meant for people: each says what is wrong and what to do."""


class AuditorError(Exception):
    """Base class of every error the auditor raises on purpose."""


class InputError(AuditorError, ValueError):
    """The weights, bias, domain or options cannot be audited as given."""
