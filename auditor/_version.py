"""The package's version, in a module of its own so that every layer can name it without importing the package."""

__version__ = "0.2.0"
# Certificates, reports and work-folder blocks of earlier versions may rest on a bfloat16 allowance
# half as wide as it must be (bfloat16's unit roundoff taken as 2^-9): they are decided again, never reused.
SOUND_SINCE = (0, 2, 0)


def version_tuple(version: str) -> tuple[int, ...]:
    """"0.2.0" -> (0, 2, 0); anything unreadable -> () (before every version)."""
    try:
        return tuple(int(part) for part in str(version).split("."))
    except ValueError:
        return ()
