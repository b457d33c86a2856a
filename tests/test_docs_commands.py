"""Every command in README.md and docs/*.md runs here, or the doc marks what it needs that a test cannot have.

The commands are read from the markdown itself, so a doc edit is tested as it is written:

- fenced ``sh``, ``bash``, ``shell`` and ``console`` blocks: one command a line (``\\`` continues it;
  in ``console`` only the ``$ `` lines);
- inline code that is a whole command (`audit fixtures/seed_2d.safetensors --format json`);
- fenced ``python`` blocks, run with ``exec``, one namespace for all the blocks of a doc.

Each doc runs in document order in a temporary folder of its own that holds a copy of fixtures/, so a
command may read what an earlier command of the same doc wrote; ``audit``, ``audit-verify``,
``audit-merge``, ``python`` and ``torchrun`` run this checkout with this interpreter.

Markers, visible in the docs:

- ``# exits N`` after a command (inline: ``(exits N`` right after the code): the exit code it must
  give; without it, 0;
- ``# needs the Hub``, ``# needs a GPU``, ``# needs several machines``, ``# needs a download`` or
  ``# needs your model`` (a path that stands for the reader's own checkpoint; inline: ``(needs ...``
  right after the code; in a python block, a comment anywhere in it): not run, but an ``audit``,
  ``audit-verify`` or ``audit-merge`` command must still take only flags its program has.

Rules that need no marker:

- installs (``pip install``, ``pip download``, ``git clone``) need the network: not run; the rest of
  an ``&&`` chain runs;
- ``python -m pytest`` and ``lint-imports`` are this repository's own checks, which CI runs;
- ``python bench/...`` are benchmarks of minutes: not run; the script must declare their flags;
- ``hf ...`` is the Hugging Face Hub's own command line: it needs the Hub;
- ``yaml`` blocks are CI jobs: their ``run:`` steps are flag-checked, not run;
- inline code with a placeholder (``N``, ``PATH``, ``...``, ``[--flag]``), or only a program's name
  (`python -m auditor`), names a command rather than giving one.

A command the rules leave to run that fails, or exits other than stated, fails the test.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LIMIT_S = 600

SHELL_LANGUAGES = {"sh", "bash", "shell", "console"}
PROGRAMS = {"audit", "audit-verify", "audit-merge", "python", "python3", "torchrun", "pip", "git", "hf",
            "lint-imports", "unzip"}
NEEDS = re.compile(r"\bneeds (the Hub|a GPU|several machines|a download|your model)\b")
EXITS = re.compile(r"\bexits (\d+)\b")
INLINE_MARK = re.compile(r"\s*\((needs [^)]*|exits \d+[^)]*)")
FENCE = re.compile(r"^\s*(```+|~~~+)\s*([\w+-]*)")
INSTALL = re.compile(r"^(python3? -m )?pip3? (install|download)\b|^git clone\b")
PLACEHOLDER = re.compile(r"\.\.\.|…|\s\[|(?:^|[\s/-])[A-Z][A-Z_]*(?=$|[\s/])")
AUDITOR_MODULES = {"auditor": "audit", "auditor.cli.audit": "audit", "auditor.cli.verify": "audit-verify",
                   "auditor.cli.merge": "audit-merge"}


@dataclass(frozen=True)
class Command:
    doc: str
    line: int
    text: str  # the command as the doc gives it, comment included
    code: str  # what runs: shell code, or python source
    language: str  # "shell", "python" or "ci" (a step of a yaml CI job)
    inline: bool = False
    mark: str = ""  # the comment after a shell command, the parenthesis after inline code, a python block's comments

    @property
    def where(self) -> str:
        return f"{self.doc}:{self.line}"

    @property
    def needs(self) -> str | None:
        found = NEEDS.search(self.mark)
        return found.group(0) if found else None

    @property
    def exit_code(self) -> int:
        found = EXITS.search(self.mark) if self.language == "shell" else None
        return int(found.group(1)) if found else 0


# ---- reading the docs ----------------------------------------------------------------------------------------


def _scan(text: str, stop_at_comment: bool, separator: str | None = None):
    """Split shell text outside quotes: at a comment ``#`` (returns code, comment) or at ``separator``."""
    quote, parts, start, i = None, [], 0, 0
    while i < len(text):
        ch = text[i]
        if quote:
            if ch == "\\" and quote == '"':
                i += 1
            elif ch == quote:
                quote = None
        elif ch in "'\"":
            quote = ch
        elif stop_at_comment and ch == "#" and (i == 0 or text[i - 1].isspace()):
            return text[:i].rstrip(), text[i + 1:].strip()
        elif separator and text.startswith(separator, i):
            parts.append(text[start:i].strip())
            start = i + len(separator)
            i += len(separator) - 1
        i += 1
    return (text.rstrip(), "") if stop_at_comment else [*parts, text[start:].strip()]


def split_comment(line: str) -> tuple[str, str]:
    return _scan(line, stop_at_comment=True)


def split_chain(code: str) -> list[str]:
    return _scan(code, stop_at_comment=False, separator="&&")


def _logical_lines(lines: list[str], first: int, console: bool):
    """(line number, text) of each command: continuation lines joined, comment-only and blank lines left out."""
    pending, start = "", None
    for offset, raw in enumerate(lines):
        text = raw.strip()
        if console and not pending:
            if not text.startswith("$ "):
                continue
            text = text[2:].strip()
        if not pending and (not text or text.startswith("#")):
            continue
        if start is None:
            start = first + offset
        if text.endswith("\\"):
            pending += text[:-1].rstrip() + " "
            continue
        yield start, pending + text
        pending, start = "", None


def _yaml_steps(lines: list[str], first: int):
    """(line number, text) of each ``run:`` command of a CI job, ``run: |`` blocks split into commands."""
    i = 0
    while i < len(lines):
        found = re.match(r"^(\s*)(?:- )?run:\s*(.*)$", lines[i])
        i += 1
        if not found:
            continue
        if found.group(2) not in ("|", ">"):
            yield first + i - 1, found.group(2)
            continue
        indent, body, start = len(found.group(1)), [], first + i
        while i < len(lines) and (not lines[i].strip() or len(lines[i]) - len(lines[i].lstrip()) > indent):
            body.append(lines[i])
            i += 1
        yield from _logical_lines(body, start, console=False)


def _program(code: str) -> list[str]:
    """The words of a command, leading environment assignments (``OMP_NUM_THREADS=2``) left out."""
    try:
        words = shlex.split(code)
    except ValueError:
        return code.split()
    while words and re.match(r"^[A-Za-z_]\w*=", words[0]):
        words.pop(0)
    return words


def _is_command(code: str) -> bool:
    words = _program(code)
    return bool(words) and words[0] in PROGRAMS


def read_commands(path: Path) -> list[Command]:
    """Every command of one markdown file, in document order."""
    doc = str(path.relative_to(ROOT))
    lines = path.read_text(encoding="utf-8").splitlines()
    commands, i = [], 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if opening:
            fence, language = opening.group(1), opening.group(2).lower()
            body_start = i + 1
            i += 1
            while i < len(lines) and not lines[i].strip().startswith(fence):
                i += 1
            body = lines[body_start:i]
            i += 1
            first = body_start + 1
            if language in SHELL_LANGUAGES:
                for number, text in _logical_lines(body, first, console=language == "console"):
                    code, comment = split_comment(text)
                    commands.append(Command(doc, number, text, code, "shell", mark=comment))
            elif language == "python":
                source = "\n".join(body)
                comments = " ".join(split_comment(line)[1] for line in body)
                commands.append(Command(doc, first, source, source, "python", mark=comments))
            elif language in ("yaml", "yml"):
                for number, text in _yaml_steps(body, first):
                    code, comment = split_comment(text)
                    commands.append(Command(doc, number, text, code, "ci", mark=comment))
            continue
        for found in re.finditer(r"(`+)(.+?)\1", lines[i]):
            code = found.group(2).strip()
            if _is_command(code):
                after = INLINE_MARK.match(lines[i][found.end():])
                commands.append(Command(doc, i + 1, code, code, "shell", inline=True,
                                        mark=after.group(1) if after else ""))
        i += 1
    return commands


def unlabelled_commands(path: Path) -> list[str]:
    """Command lines in fenced blocks without a language: they would escape the test."""
    lines, found, inside = path.read_text(encoding="utf-8").splitlines(), [], None
    for number, line in enumerate(lines, 1):
        opening = FENCE.match(line)
        if inside is None and opening:
            inside = (opening.group(1), bool(opening.group(2)))  # (its fence, whether it names a language)
            continue
        if inside is not None:
            if line.strip().startswith(inside[0]):
                inside = None
            elif not inside[1] and _looks_like_a_command(line.strip()):
                found.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    return found


def _looks_like_a_command(line: str) -> bool:
    """A command, or a ``$ `` prompt's, but not a usage line ``audit PATH [--flag ...]``."""
    if line.startswith("$ "):
        return True
    words = line.split()
    return _is_command(line) and not (len(words) > 1 and (words[1].isupper() or " [--" in line))


# ---- what is run, and why not --------------------------------------------------------------------------------


def why_not_run(command: Command) -> str | None:
    """The marker or rule that keeps a command from running here, or None when it runs."""
    if command.language == "ci":
        return "a step of a CI job"
    if command.language == "python":
        return command.needs
    segments = [segment for segment in split_chain(command.code) if not INSTALL.match(segment)]
    if not segments:
        return "an install: needs the network"
    words = _program(segments[0])
    if words[:3] == ["python", "-m", "pytest"] or words[:1] == ["lint-imports"]:
        return "this repository's own checks, which CI runs"
    if words[:1] == ["python"] and len(words) > 1 and words[1].startswith("bench/"):
        return "a benchmark"
    if words[:1] == ["hf"]:
        return "the Hub's own command line: needs the Hub"
    if command.inline and PLACEHOLDER.search(command.code):
        return "a placeholder: names a command"
    if command.inline and _is_bare_name(words):
        return "a program's name"
    return command.needs


def _is_bare_name(words: list[str]) -> bool:
    if words[:2] == ["python", "-m"]:
        return len(words) <= 3
    if words[:1] == ["torchrun"]:
        return "-m" not in words and not any(word.endswith(".py") for word in words)
    return len(words) <= 1


def runnable_code(command: Command) -> str:
    """The shell code to run: the command without its installs."""
    return " && ".join(segment for segment in split_chain(command.code) if not INSTALL.match(segment))


ALL_COMMANDS = [command for path in DOCS for command in read_commands(path)]


# ---- running -------------------------------------------------------------------------------------------------


def _workspace(tmp_path: Path) -> tuple[Path, dict]:
    """A folder with a copy of fixtures/, and an environment whose programs run this checkout."""
    work, bin_dir = tmp_path / "work", tmp_path / "bin"
    shutil.copytree(ROOT / "fixtures", work / "fixtures")
    bin_dir.mkdir()
    launchers = {"audit": "-m auditor", "audit-verify": "-m auditor.cli.verify", "audit-merge": "-m auditor.cli.merge",
                 "python": "", "python3": "", "torchrun": "-m torch.distributed.run"}
    for name, module in launchers.items():
        launcher = bin_dir / name
        launcher.write_text(f'#!/bin/sh\nexec "{sys.executable}" {module} "$@"\n')
        launcher.chmod(0o755)
    env = {**os.environ, "PATH": os.pathsep.join([str(bin_dir), os.environ.get("PATH", "")]),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    env.setdefault("OMP_NUM_THREADS", "1")
    return work, env


def _run_shell(command: Command, work: Path, env: dict) -> str | None:
    """None when the command exits as the doc says, else what went wrong."""
    try:
        done = subprocess.run(["bash", "-c", runnable_code(command)], cwd=work, env=env, capture_output=True,
                              text=True, timeout=LIMIT_S)
    except subprocess.TimeoutExpired:
        return f"ran past {LIMIT_S} s"
    if done.returncode == command.exit_code:
        return None
    tail = "\n    ".join((done.stderr or done.stdout).strip().splitlines()[-6:])
    return f"exited {done.returncode}, the doc says {command.exit_code}:\n    {tail}"


def _run_python(command: Command, namespace: dict) -> str | None:
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            exec(compile(command.code, command.where, "exec"), namespace)
    except Exception as error:  # noqa: BLE001 - any failure of a doc's example is the finding
        return f"raised {type(error).__name__}: {error}"
    return None


def _docs_with_commands_to_run() -> list:
    params = []
    for path in DOCS:
        doc = str(path.relative_to(ROOT))
        if any(command.doc == doc and why_not_run(command) is None for command in ALL_COMMANDS):
            params.append(pytest.param(doc, id=doc))
    return params


@pytest.mark.slow
@pytest.mark.parametrize("doc", _docs_with_commands_to_run())
def test_every_command_of_the_doc_runs_and_exits_as_it_says(doc, tmp_path, monkeypatch):
    work, env = _workspace(tmp_path)
    monkeypatch.chdir(work)
    namespace: dict = {"__name__": "__doc_example__"}
    failures = []
    for command in (command for command in ALL_COMMANDS if command.doc == doc):
        if why_not_run(command) is not None:
            continue
        failure = (_run_python(command, namespace) if command.language == "python"
                   else _run_shell(command, work, env))
        if failure:
            failures.append(f"{command.where}: {command.text.splitlines()[0]}\n  {failure}")
    assert not failures, ("commands that fail: fix them, or mark what they need (`# needs the Hub`, "
                          "`# needs your model`, ...) or their exit code (`# exits 1`)\n" + "\n".join(failures))


# ---- what is not run is still checked ------------------------------------------------------------------------


def _options_in(help_text: str) -> set[str]:
    return set(re.findall(r"(?<![\w-])--[a-z0-9][a-z0-9-]*", help_text))


def _auditor_options(program: str) -> set[str]:
    from auditor.cli import audit, merge, verify

    main = {"audit": audit.main, "audit-verify": verify.main, "audit-merge": merge.main}[program]
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        main(["--help"])
    return _options_in(out.getvalue())


def _script_options(script: Path) -> set[str]:
    """The flags a benchmark's argparse parser declares, read from its source (running it imports torch)."""
    return set(re.findall(r"add_argument\(\s*[\"'](--[a-z0-9-]+)[\"']", script.read_text(encoding="utf-8")))


def _flags_by_program(code: str) -> tuple[str, list[str]] | None:
    """(program, the --flags given to it) for the commands whose flags can be checked, else None."""
    words = _program(code)
    if not words:
        return None
    if words[0] in ("audit", "audit-verify", "audit-merge"):
        program, args = words[0], words[1:]
    elif words[0] in ("python", "python3", "torchrun") and "-m" in words:
        at = words.index("-m")
        if at + 1 >= len(words) or words[at + 1] not in AUDITOR_MODULES:
            return None
        program, args = AUDITOR_MODULES[words[at + 1]], words[at + 2:]
    elif words[0] == "python" and len(words) > 1 and words[1].startswith("bench/"):
        program, args = words[1], words[2:]
    else:
        return None
    return program, [arg.split("=")[0] for arg in args if arg.startswith("--")]


def test_the_commands_not_run_take_only_flags_their_program_has():
    options: dict[str, set[str]] = {}
    wrong = []
    for command in ALL_COMMANDS:
        if command.language == "python" or why_not_run(command) is None:
            continue
        for segment in split_chain(command.code):
            found = _flags_by_program(segment)
            if found is None or PLACEHOLDER.search(segment) and command.inline:
                continue
            program, flags = found
            if program.startswith("bench/") and not (ROOT / program).is_file():
                wrong.append(f"{command.where}: {program} does not exist")
                continue
            if program not in options:
                options[program] = (_script_options(ROOT / program) if program.startswith("bench/")
                                    else _auditor_options(program))
            unknown = [flag for flag in flags if flag not in options[program]]
            if unknown:
                wrong.append(f"{command.where}: {segment}\n  {program} has no {', '.join(unknown)}")
    assert not wrong, "commands with flags their program does not take:\n" + "\n".join(wrong)


def test_no_command_hides_in_a_block_without_a_language():
    hidden = [line for path in DOCS for line in unlabelled_commands(path)]
    assert not hidden, "commands in ``` blocks without a language are not tested: make them ```sh\n" + "\n".join(hidden)


def test_every_marker_is_one_the_test_knows():
    """A `# needs ...` the test does not know would leave its command to run and fail: say which ones exist."""
    unknown = [f"{command.where}: {command.mark}" for command in ALL_COMMANDS
               if re.search(r"\bneeds\b", command.mark) and command.needs is None and command.language != "python"]
    assert not unknown, ("markers are: needs the Hub, a GPU, several machines, a download, your model\n"
                         + "\n".join(unknown))


def test_commands_are_read_with_their_exit_codes_chains_and_comments():
    """The reading itself: the README's demo command, its install left out and its `# exits 1` kept."""
    readme = [command for command in ALL_COMMANDS if command.doc == "README.md"]
    demo = [command for command in readme if "audit fixtures/resized_demo.safetensors" in command.code]
    assert demo and all(command.exit_code == 1 for command in demo)
    assert [runnable_code(command) for command in demo if not command.inline][0] == \
        "audit fixtures/resized_demo.safetensors"
    assert split_chain("pip install x && audit 'a && b' && y") == ["pip install x", "audit 'a && b'", "y"]
    assert split_comment("python -c \"print('#')\"   # exits 1") == ("python -c \"print('#')\"", "exits 1")


def test_ci_runs_the_test_command_readme_gives():
    """.ci/run's pytest line is README's full-suite command, word for word (CI runs what README promises)."""
    readme = (ROOT / "README.md").read_text()
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()
          if line.strip().startswith("python -m pytest")]
    assert len(ci) == 1
    full = [line for line in readme.splitlines() if "lint-imports && python -m pytest" in line]
    assert len(full) == 1 and full[0].strip().endswith("&& " + ci[0])
