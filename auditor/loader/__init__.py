"""The loader: a checkpoint file, model folder or Hub model id in, a Head out, reading only the head's tensors.

Sources: safetensors (single or sharded by model.safetensors.index.json),
PyTorch state dicts (.bin/.pt/.pth, single or sharded, weights_only; a training
checkpoint's state dict found inside its wrappers, nested.py), .npy/.npz,
GGUF (the auditor[gguf] extra), ONNX (the auditor[onnx] extra: the head found from the graph,
onnx_head.py), and the inference formats read without a dependency: CTranslate2's model.bin
(ctranslate2_model.py), TensorFlow Lite flatbuffers (tflite_model.py) and Kaldi nnet3 models
(kaldi_model.py); each recognised by its contents (formats.py), whatever its name. A folder may also
hold config.json (whether the head is tied, the norm's epsilon; config.py) and tokenizer.json or
vocab.txt (token strings); a character list given with --vocab names the tokens instead.
A Hub model id is resolved to files in the local cache (hub.py), which are read
as a folder's are. A PEFT adapter folder gives its changes to its base model's head (peft_adapter.py).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

from tqdm import tqdm

from auditor.errors import InputError
from auditor.loader import hub
from auditor.loader.config import read_config
from auditor.loader.ctranslate2_model import CTranslate2Store
from auditor.loader.formats import DESCRIPTIONS, INFERENCE_FILES, WEIGHT_FILES, foreign_format, identify
from auditor.loader.hub_id import is_hub_id, parse_hub_id
from auditor.loader.kaldi_model import KaldiStore
from auditor.loader.naming import choose_head, is_input_embedding
from auditor.loader.onnx_head import PADDLE_CHARACTERS, OnnxStore, paddle_characters
from auditor.loader.peft_adapter import load_adapter_head
from auditor.loader.peft_files import adapter_folder, not_an_adapter
from auditor.loader.stores import GGUFStore, NumpyStore, SafetensorsStore, TensorInfo, TorchStore, read_index
from auditor.loader.tflite_model import TfliteStore
from auditor.loader.tokens import base_vocabulary_size, read_token_strings, read_vocabulary
from auditor.question.head import FinalNorm, Head

_FOLDER_SCAN_LIMIT = 200  # files whose first bytes are read when a folder has no checkpoint: stays quick
_OPENERS = {
    "safetensors": SafetensorsStore.from_file,
    "torch-zip": TorchStore.from_file,
    "pickle": TorchStore.from_file,  # torch.load(weights_only=True) refuses any pickle that holds more than tensors
    "npy": lambda path: NumpyStore(path, archive=False),
    "npz": lambda path: NumpyStore(path, archive=True),
    "gguf": GGUFStore,
    "onnx": OnnxStore,
    "ctranslate2": CTranslate2Store,
    "tflite": TfliteStore,
    "kaldi": KaldiStore,
}


def _open_file(path: Path):
    kind = identify(path)
    return _open_index(path) if kind == "index" else _OPENERS[kind](path)


def _open_index(index: Path):
    """Shards named by a weight_map: safetensors or torch files, as the first shard's contents say."""
    first = index.parent / sorted(set(read_index(index).values()))[0]
    kind = identify(first)
    if kind == "safetensors":
        return SafetensorsStore.from_index(index)
    if kind in ("torch-zip", "pickle"):
        return TorchStore.from_index(index)
    raise InputError(f"{index}: its shards must be safetensors or PyTorch files, but {first.name} is "
                     f"{DESCRIPTIONS[kind]}")


def open_store(path: Path):
    """The tensor store behind a file or a model folder; raises InputError when there is none."""
    if not path.exists():
        raise InputError(f"{path}: no such file or folder")
    if path.is_file():
        return _open_file(path)
    for filename in WEIGHT_FILES:
        if (path / filename).is_file():
            return _open_file(path / filename)
    singles = sorted(p for p in path.iterdir() if p.suffix.lower() in (".safetensors", ".gguf"))
    refused = None  # why a model file named as an inference format's could not be taken
    if not singles:  # an exported model only where there is no checkpoint it may have been exported from
        for filename in INFERENCE_FILES:
            if (path / filename).is_file():
                try:
                    if identify(path / filename) in ("ctranslate2", "kaldi"):
                        return _open_file(path / filename)
                except InputError as error:  # OpenVINO also writes a model.bin: an .onnx beside it may be the model
                    refused = refused or error
        singles = sorted(p for p in path.iterdir() if p.suffix.lower() in (".onnx", ".tflite"))
    if not singles and refused is not None:
        raise refused
    if len(singles) == 1:
        return _open_file(singles[0])
    _refuse_foreign_folder(path)
    looked = ", ".join(WEIGHT_FILES + INFERENCE_FILES)
    found = f"; it holds {len(singles)} candidate files" if singles else ""
    raise InputError(f"{path}: no checkpoint found (looked for {looked}, or a single .safetensors, .gguf, .onnx "
                     f"or .tflite file){found}")


def _refuse_foreign_folder(folder: Path) -> None:
    """Say so when a folder with no checkpoint holds another framework's model (a SavedModel's saved_model.pb,
    a Keras .h5): that is more useful than "no checkpoint found"."""
    files = sorted(p for p in folder.iterdir() if p.is_file())
    for path in files[:_FOLDER_SCAN_LIMIT]:
        foreign = foreign_format(path)
        if foreign is not None:
            raise InputError(f"{folder}: no checkpoint found; {path.name} is {foreign.what}, which the auditor "
                             f"does not read: {foreign.advice}")


def list_tensors(path: Path, matrices: bool = False) -> list[TensorInfo]:
    """The tensors of a checkpoint with their shapes and dtypes, by name. ``matrices``: only those a head can be
    read from: 2-D tensors, and in an ONNX model convolution kernels one position wide (vocabulary x hidden x
    1 ...), which a recogniser's pointwise Conv head stores."""
    if is_hub_id(path):
        found, kernels = hub.list_tensors(str(path)), False
    else:
        store = open_store(Path(path))
        found, kernels = sorted(store.tensors().values(), key=lambda info: info.name), store.format == "onnx"
    if matrices:
        found = [info for info in found if len(info.shape) == 2
                 or (kernels and len(info.shape) > 2 and all(size == 1 for size in info.shape[2:]))]
    return found


def _norm_kind(config: dict, store, has_bias: bool) -> tuple[str, float]:
    if isinstance(store, GGUFStore):
        arch = store.metadata("general.architecture") or ""
        rms = store.metadata(f"{arch}.attention.layer_norm_rms_epsilon")
        if rms is not None:
            return "rmsnorm", float(rms)
        eps = store.metadata(f"{arch}.attention.layer_norm_epsilon")
        if eps is not None:
            return "layernorm", float(eps)
    for key in ("rms_norm_eps",):
        if key in config:
            return "rmsnorm", float(config[key])
    for key in ("layer_norm_eps", "layer_norm_epsilon", "layernorm_epsilon", "norm_eps"):
        if key in config:
            return ("layernorm" if has_bias or key != "norm_eps" else "rmsnorm"), float(config[key])
    return ("layernorm", 1e-5) if has_bias else ("rmsnorm", 1e-6)


def _flat_bias(bias):
    return bias.reshape(-1) if len(bias.shape) == 2 else bias


def load_head(path, weight: str | None = None, bias: str | None = None, progress: bool = False,
              need_norm: bool = False, store=None, vocab: Path | None = None, vocab_offset: int = 0,
              base=None) -> Head:
    """Load a head from a checkpoint file or model folder.

    ``weight`` / ``bias`` name the tensors explicitly (``weight="A@B"``: the head
    W = A @ B, kept as its factors ``head.weight`` = A and ``head.factor`` = B;
    ``.T`` after a name transposes it; in a PyTorch file a name may be the dotted path of keys
    to a tensor, ``model_state_dict.fc.weight``); otherwise known names are
    tried (see loader/naming.py). Returns a Head. Raises InputError for a
    missing path, an unreadable or unknown file, a refused pickle, or an absent
    or ambiguous head.

    ``path`` may also be a model on the Hugging Face Hub, ``org/name[@revision]`` (loader/hub.py): only the
    files the head needs are fetched, the final norm's too when ``need_norm``; the head's ``path`` is then
    the id pinned to the commit read. A Hub id may name a PEFT adapter, read as an adapter folder (below).
    ``store`` is a store already opened on ``path``.

    ``vocab`` is a file of token strings, one per line, line i naming id i + ``vocab_offset`` (a character
    list); it replaces any other source of token strings.

    A PEFT adapter folder (adapter_config.json) gives the head its changes make of its base model's head
    (loader/peft_adapter.py): ``base`` is that model (a path or Hub id), by default the adapter's own
    base_model_name_or_path; ``weight`` / ``bias`` then name the base's tensors.
    """
    vocabulary = (Path(vocab), vocab_offset) if vocab is not None else None
    if base is not None and store is not None:
        raise not_an_adapter(path, base)
    if store is None and is_hub_id(path):
        repo_id, revision = parse_hub_id(path)
        model = hub.resolve(repo_id, revision, weight=weight, bias=bias, need_norm=need_norm, progress=progress)
        if model.adapter:  # a PEFT adapter on the Hub: its files, read as an adapter folder is
            head = load_adapter_head(model.checkpoint, base, load_head, vocabulary, weight=weight, bias=bias,
                                     progress=progress, need_norm=need_norm)
        elif base is not None:
            raise not_an_adapter(path, base)
        else:
            head = _read_head(model.checkpoint, weight, bias, progress, model.store, vocabulary)
        head.path = Path(model.label)
        if model.note:
            head.notes.append(model.note)
        return head
    path = Path(path)
    adapter = adapter_folder(path) if store is None else None
    latest = _latest_trainer_checkpoint(path) if store is None and adapter is None else None
    if latest is not None:
        adapter = adapter_folder(latest[0])
    if base is not None and adapter is None:
        raise not_an_adapter(path, base)
    if adapter is not None:  # a PEFT adapter: its changes over its base model's head (loader/peft_adapter.py)
        head = load_adapter_head(adapter, base, load_head, vocabulary, weight=weight, bias=bias, progress=progress,
                                 need_norm=need_norm)
    else:
        head = _read_head(path if latest is None else latest[0], weight, bias, progress, store, vocabulary)
    if latest is not None:
        head.notes.append(latest[1])
    return head


_TRAINER_CHECKPOINT = re.compile(r"checkpoint-([0-9]+)")


def has_own_checkpoint(path) -> bool:
    """Whether a folder holds a checkpoint of its own (a weights file, or a single .safetensors, .gguf, .onnx or
    .tflite file, an inference format's model file, or a PEFT adapter's weights): a Trainer's output folder after
    ``save_model``, for one."""
    path = Path(path)
    return path.is_dir() and (any((path / name).is_file() for name in WEIGHT_FILES + INFERENCE_FILES) or any(
        p.suffix.lower() in (".safetensors", ".gguf", ".onnx", ".tflite") for p in path.iterdir() if p.is_file()))


def trainer_checkpoints(path, with_own: bool = False) -> list[tuple[int, Path]]:
    """The (step, folder) of each checkpoint-N/ folder of a Trainer's output folder, in step order; [] for any
    other path. A folder with a checkpoint of its own (the final model or adapter saved beside the checkpoint
    folders) counts only ``with_own``: a plain audit of it reads its own checkpoint."""
    path = Path(path)
    if not path.is_dir() or (not with_own and has_own_checkpoint(path)):
        return []
    return sorted((int(match[1]), child) for child in path.iterdir()
                  if child.is_dir() and (match := _TRAINER_CHECKPOINT.fullmatch(child.name)))


def _latest_trainer_checkpoint(path: Path) -> tuple[Path, str] | None:
    """A Trainer's output folder: its latest checkpoint folder and the note that says so; None for any other path."""
    steps = trainer_checkpoints(path)
    if not steps:
        return None
    step, folder = steps[-1]
    return folder, (f"{path} is a training output folder: its latest checkpoint, {folder.name}, is audited "
                    f"({len(steps)} checkpoint folder{'s' if len(steps) != 1 else ''}; audit another by its path)")


def _dotted_names(store, weight: str | None, bias: str | None, where: str) -> tuple[str | None, str | None]:
    """``weight`` and ``bias`` as the store lists them, where they are dotted paths into a training
    checkpoint (``model_state_dict.fc.weight``); names it does not know are left for choose_head to refuse."""
    if not isinstance(store, TorchStore):
        return weight, bias

    def listed(name: str, switch: bool) -> str:
        transposed = name.endswith(".T") and store.resolve(name, where, switch) is None
        stored = name[:-2] if transposed else name
        found = store.resolve(stored, where, switch)
        return name if found is None else found + (".T" if transposed else "")

    # the weight's state dict is the one its bias and final norm are looked for in
    if weight is not None:
        parts = weight.split("@") if "@" in weight else [weight]
        weight = "@".join(listed(part, switch=i == 0) for i, part in enumerate(parts))
    if bias not in (None, "none"):
        bias = listed(bias, switch=weight is None)
    return weight, bias


def _read_head(path: Path, weight: str | None, bias: str | None, progress: bool, store,
               vocabulary: tuple[Path, int] | None) -> Head:
    """The head in the checkpoint file or model folder ``path``, read from ``store`` (None: opened here),
    named by the strings of ``vocabulary`` (a --vocab file and its offset) when given."""
    store = open_store(path) if store is None else store
    folder = path if path.is_dir() else path.parent
    if hasattr(store, "read_head"):  # ONNX and the inference formats: found from the model's structure
        head = store.read_head(path, weight, bias)
        _name_tokens(head, store, folder, vocabulary)
        return head
    config = read_config(folder)
    weight, bias = _dotted_names(store, weight, bias, str(path))
    names = choose_head(store.tensors(), weight, bias, config.get("tie_word_embeddings"), str(path))
    matrices = [name for name, _ in names.factors] if names.factors else [names.weight]
    wanted = list(dict.fromkeys(n for n in (*matrices, names.bias, names.norm_weight, names.norm_bias) if n))
    loaded = {}
    with tqdm(wanted, desc="loading", file=sys.stderr, disable=not progress, leave=False, unit="tensor") as bar:
        for name in bar:
            bar.set_postfix_str(name)
            loaded[name] = store.get(name)

    if names.factors:  # W = U @ V: both factors, as named (".T" transposes: a view, no copy)
        u, v = (loaded[name].T if transposed else loaded[name] for name, transposed in names.factors)
    else:
        u, v = loaded[names.weight], None
    head = Head(weight=u, factor=v, bias=_flat_bias(loaded[names.bias]) if names.bias else None,
                weight_name=names.weight, bias_name=names.bias, tied=names.tied, path=path,
                source_format=store.format)
    head.notes += [note for note in (getattr(store, "origin", None), names.bias_note) if note]
    if not head.tied and v is None and isinstance(store, TorchStore):
        shared = store.sharing_storage(names.weight, is_input_embedding)
        if shared is not None:  # torch.save keeps one storage for tied parameters: the head is the embedding
            head.tied = True
            head.notes.append(f"{names.weight} shares its storage with the input embedding {shared}: the head is tied")
    if names.norm_weight:
        kind, eps = _norm_kind(config, store, names.norm_bias is not None)
        head.final_norm = FinalNorm(kind, loaded[names.norm_weight],
                                    loaded[names.norm_bias] if names.norm_bias else None, eps,
                                    unit_offset=str(config.get("model_type", "")).startswith("gemma"),
                                    names=tuple(n for n in (names.norm_weight, names.norm_bias) if n))
    _name_tokens(head, store, folder, vocabulary)
    return head


def _name_tokens(head: Head, store, folder: Path, vocabulary: tuple[Path, int] | None) -> None:
    """The head's token strings: a --vocab file, else the GGUF file's own, an ONNX model's PaddleOCR
    character list, or the folder's tokenizer."""
    if vocabulary is not None:
        head.tokens, note = read_vocabulary(*vocabulary, head.shape[0])
        head.token_source = str(vocabulary[0])
        head.vocab_file, head.vocab_offset = vocabulary
        head.notes.append(note)
        return
    if isinstance(store, GGUFStore):
        tokens = store.metadata("tokenizer.ggml.tokens")
        if isinstance(tokens, list):
            head.tokens, head.token_source = tokens, "tokenizer.ggml.tokens"
    elif hasattr(store, "token_strings"):  # the inference formats' own vocabulary, labels or names
        head.tokens, head.token_source, notes = store.token_strings(head.shape[0])
        head.notes += notes
        if head.tokens is not None:
            return
    elif isinstance(store, OnnxStore) and store.metadata(PADDLE_CHARACTERS) is not None:
        head.tokens, note = paddle_characters(store.metadata(PADDLE_CHARACTERS), head.shape[0])
        head.notes.append(note)
        if head.tokens is not None:
            head.token_source = f"metadata {PADDLE_CHARACTERS!r}"
            return
    if head.tokens is None and not isinstance(store, GGUFStore):
        head.tokens, head.token_source = read_token_strings(folder, head.notes)
        head.base_vocab = base_vocabulary_size(folder)
    if head.tokens is not None and len(head.tokens) < head.shape[0]:
        head.notes.append(f"rows {len(head.tokens)}..{head.shape[0] - 1} have no token string "
                          f"(the tokenizer has {len(head.tokens)} tokens)")
