"""What people see of huggingface_hub: its exceptions as one-line InputErrors, its download bars on request.

A missing package, a gated or unknown model, a revision or file not found, an HTTP error or a network
failure each become one line that says what is wrong and what to do.
"""

from __future__ import annotations

import sys
from contextlib import contextmanager

from auditor.errors import InputError
from auditor.loader.hub_id import hub_id


def import_hub(repo_id: str, revision: str | None):
    """The huggingface_hub module (with its constants); raises InputError naming the extra that installs it."""
    try:
        import huggingface_hub
        import huggingface_hub.constants
    except ImportError:
        raise InputError(f"{hub_id(repo_id, revision)}: no such file or folder; as a Hugging Face Hub model id it "
                         "needs huggingface_hub: pip install 'auditor[hub]'") from None
    return huggingface_hub


@contextmanager
def progress_bars(shown: bool):
    """huggingface_hub's download bars, silenced unless asked for (a terminal, no --quiet), then restored."""
    from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars

    if shown or are_progress_bars_disabled():
        yield
        return
    disable_progress_bars()
    try:
        yield
    finally:
        enable_progress_bars()


@contextmanager
def one_line_errors(hub, label: str, repo_id: str, revision: str | None):
    """huggingface_hub's exceptions as one line each, saying what to do; an InputError passes through."""
    errors = hub.utils
    try:
        yield
    except InputError:
        raise
    except errors.GatedRepoError as error:  # before RepositoryNotFoundError, which it is a kind of
        raise InputError(f"{label}: a gated model: accept its conditions on its Hub page, then log in "
                         "(hf auth login, or HF_TOKEN)") from error
    except errors.RepositoryNotFoundError as error:
        raise InputError(f"{label}: no such file or folder, nor a model on the Hugging Face Hub at "
                         f"{hub.constants.ENDPOINT} (a private one needs a login: hf auth login, or HF_TOKEN)"
                         ) from error
    except errors.RevisionNotFoundError as error:
        raise InputError(f"{label}: the Hub model {repo_id} has no branch, tag or commit {revision!r}") from error
    except errors.LocalEntryNotFoundError as error:  # before EntryNotFoundError: recent versions derive it from it
        raise InputError(f"{label}: a file is neither in the local cache nor could it be fetched from "
                         f"{hub.constants.ENDPOINT} ({first_line(error)})") from error
    except errors.EntryNotFoundError as error:
        raise InputError(f"{label}: a file is missing on the Hub ({first_line(error)})") from error
    except errors.HfHubHTTPError as error:
        status = getattr(getattr(error, "response", None), "status_code", "an error")
        raise InputError(f"{label}: the Hub answered HTTP {status} ({first_line(error)})") from error
    except network_errors() as error:
        raise InputError(f"{label}: cannot reach the Hub at {hub.constants.ENDPOINT} "
                         f"({type(error).__name__}: {first_line(error)})") from error


def network_errors() -> tuple[type[BaseException], ...]:
    """Connection failures as the HTTP client that huggingface_hub uses raises them (it varies by version)."""
    found: list[type[BaseException]] = [ConnectionError, TimeoutError]
    for module, name in (("httpx2", "TransportError"), ("httpx", "TransportError"), ("requests", "ConnectionError"),
                         ("requests", "Timeout")):
        error = getattr(sys.modules.get(module), name, None)
        if isinstance(error, type) and issubclass(error, BaseException):
            found.append(error)
    return tuple(found)


def first_line(error: BaseException) -> str:
    """The first non-blank line of an exception's message, or its type's name when it has none."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return lines[0] if lines else type(error).__name__
