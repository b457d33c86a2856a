"""Every module path the repository's text names exists: dotted names (auditor.engine.exact.lp.polish) resolve
to a module and its attribute, and file paths (engine/solvers/tilt.py, auditor/runs/) to files or folders."""

import importlib
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent
TEXTS = [ROOT / "README.md", ROOT / "pyproject.toml"] + [path for folder in ("auditor", "bench", "docs", "fixtures",
                                                                            "tests")
                                                         for path in sorted((ROOT / folder).rglob("*"))
                                                         if path.suffix in (".py", ".md")
                                                         and path != pathlib.Path(__file__).resolve()]  # its examples
DOTTED = re.compile(r"\bauditor(?:\.[A-Za-z_]\w*)+")
PATH = re.compile(r"(?<![\w/])((?:auditor|engine|loader|formats|verify|cli)/[\w/]*\w(?:\.py)?)")


def _resolves(name: str) -> bool:
    parts = name.split(".")
    for split in range(len(parts), 0, -1):
        try:
            found = importlib.import_module(".".join(parts[:split]))
        except ImportError:
            continue
        for part in parts[split:]:
            if not hasattr(found, part):
                return False
            found = getattr(found, part)
        return True
    return False


def _exists(path: str) -> bool:
    return any((ROOT / candidate).exists() for candidate in (path, "auditor/" + path))


def test_every_dotted_auditor_name_resolves():
    names = {(text.relative_to(ROOT).as_posix(), match.group(0))
             for text in TEXTS for match in DOTTED.finditer(text.read_text())}
    assert sorted(entry for entry in names if not _resolves(entry[1])) == []


def test_every_path_into_the_package_exists():
    paths = {(text.relative_to(ROOT).as_posix(), match.group(1))
             for text in TEXTS for match in PATH.finditer(text.read_text())}
    assert sorted(entry for entry in paths if not _exists(entry[1])) == []


def test_the_checks_see_a_stale_name_and_a_stale_path():
    assert not _resolves("auditor.engine.lp") and _resolves("auditor.engine.exact.lp.polish")
    assert not _exists("engine/screen.py") and _exists("engine/screen/gram.py")
