"""Files and streams: written whole or not at all, refused before the work, read back with one-line errors."""

from __future__ import annotations

import contextlib
import json
import os
import sys
import tempfile
import threading
from pathlib import Path

from auditor.errors import InputError


def check_writable(path: Path) -> None:
    """Refuse an output path before any work is done, rather than after."""
    folder = path.resolve().parent
    if not folder.is_dir():
        raise InputError(f"{path}: the folder {folder} does not exist")
    if path.is_dir():
        raise InputError(f"{path}: is a folder, not a file")
    if not os.access(folder, os.W_OK):
        raise InputError(f"{path}: the folder {folder} is not writable")


def write_atomically(files: dict[Path, str]) -> None:
    """Write every file via a temporary beside it, then rename them all: readers never see half a
    report, and a failure leaves none of them behind."""
    mask = os.umask(0)
    os.umask(mask)
    temporaries: dict[Path, str] = {}
    path = None  # the file being written, for the error message
    try:
        for path, text in files.items():
            handle, temporary = tempfile.mkstemp(dir=path.resolve().parent, prefix=f".{path.name}.", suffix=".tmp")
            temporaries[path] = temporary
            with os.fdopen(handle, "w", encoding="utf-8") as stream:
                stream.write(text)
                stream.flush()
                os.fsync(stream.fileno())
            os.chmod(temporary, 0o666 & ~mask)  # mkstemp makes 0600; a report should be as readable as any file
        for path, temporary in temporaries.items():
            os.replace(temporary, path)
    except OSError as error:
        for temporary in temporaries.values():
            Path(temporary).unlink(missing_ok=True)
        raise InputError(f"cannot write {path}: {error.strerror or error}") from None
    except BaseException:
        for temporary in temporaries.values():
            Path(temporary).unlink(missing_ok=True)
        raise


def read_json_report(path: Path, label: str):
    """The parsed JSON of a report file; ``label`` starts each error line (the path, or the option and path)."""
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise InputError(f"{label}: no such file") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise InputError(f"{label}: not a JSON report ({error})") from None


_solver_output_to_stderr = False


def send_solver_output_to_stderr(enabled: bool = True) -> None:
    """Where ``quiet_stdout`` sends a solver's own lines: to standard error (``--debug``) or nowhere."""
    global _solver_output_to_stderr
    _solver_output_to_stderr = enabled


_redirecting = threading.Lock()  # guards the count and the descriptor swaps below
_redirections = 0  # blocks inside quiet_stdout now, on any thread
_saved_stdout: int | None = None  # descriptor 1 as it was before the first of them


@contextlib.contextmanager
def quiet_stdout():
    """Send what native code prints to standard output (a solver's banner) to the null device inside the
    block, or to standard error after ``send_solver_output_to_stderr()`` (``--debug``).

    Standard output carries the report (``--format json`` is piped into other tools), so nothing else may reach
    it; the redirection is of file descriptor 1 itself, which C and C++ libraries write to directly. Descriptor 1
    is the process's: blocks on several threads at once (the exact stage's workers) share one redirection, made
    by the first to enter and undone by the last to leave (two that swapped it on their own could put the null
    device back in place of the report's stream).
    """
    global _redirections, _saved_stdout
    with _redirecting:
        if _redirections == 0:
            if sys.stdout is not None:  # None under pythonw and some services
                sys.stdout.flush()
            try:
                _saved_stdout = os.dup(1)
            except OSError:  # no descriptor 1 at all: nothing can reach it
                _saved_stdout = None
            if _saved_stdout is not None:
                if _solver_output_to_stderr:
                    if sys.stderr is not None:
                        sys.stderr.flush()
                    os.dup2(2, 1)
                else:
                    with open(os.devnull, "wb") as null:
                        os.dup2(null.fileno(), 1)
        _redirections += 1
    try:
        yield
    finally:
        with _redirecting:
            _redirections -= 1
            if _redirections == 0 and _saved_stdout is not None:
                if sys.stdout is not None:
                    sys.stdout.flush()
                os.dup2(_saved_stdout, 1)
                os.close(_saved_stdout)
                _saved_stdout = None
