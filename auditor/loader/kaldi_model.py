"""Kaldi nnet3 models in binary mode (a final.mdl: a TransitionModel, then an AmNnetSimple; or a raw network,
final.raw): the output layer's matrix and bias, the priors decoding subtracts, and names for its rows (pdf-ids)
from the TransitionModel and a phones.txt beside the model.

The file is memory-mapped (stores.map_file) and parsed in order, as Kaldi's Read functions read it (base/io-funcs,
matrix/kaldi-matrix, hmm/transition-model, nnet3/nnet-nnet, nnet3/am-nnet-simple): each matrix and vector is
skipped by the size its header gives, so no token is ever looked for inside data, and every read is checked
against the file's end. A component's fields are read generically (tokens, each followed by basic values,
matrices or vectors, up to the component's closing tag), which covers every component type; only the few
tokens that precede an integer vector are listed, since its bytes look like an integer's.

Names: a component's matrix is NAME.LinearParams (a LinearComponent's NAME.Params: the token the file writes before
it) and its bias NAME.BiasParams, in tensors() and in the head a report shows; --weight takes NAME or the
matrix's name, --bias "none", NAME.BiasParams or NAME (the component whose bias to take), and also the name a
report gives a bias the priors shift (NAME.BiasParams - log(Priors)).

Priors: where the AmNnetSimple has them, Kaldi's decodables score each pdf as the output node's value less its log
prior. When the output node's values are the head's W x + b through descriptors that copy a node's rows (a name,
Offset, Round, ReplaceIndex: an output delay) and a log-softmax, the bias audited is b - log(Priors), in float64.
Priors with one value per row of the head that cannot be applied so (the output node's values are not the head's,
or pass through a Softmax first, or a prior is not positive) are an InputError, not a silent audit of a head
decoding does not use: --bias none audits the layer's W x alone, knowingly. Every malformed file is an InputError
of one line.
"""

from __future__ import annotations

import re
import struct
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from auditor.errors import InputError
from auditor.loader.stores import TensorInfo, map_file
from auditor.question.head import Head

# components whose matrix is the W of W x + b (x: the input, spliced over the time offsets for a TdnnComponent)
HEAD_TYPES = ("NaturalGradientAffineComponent", "AffineComponent", "FixedAffineComponent", "LinearComponent",
              "TdnnComponent")
DEFAULT_HEAD = "output.affine"  # the output layer's name in every nnet3 recipe (xconfig's output-layer)
OUTPUT_NODE = "output"  # the node Kaldi's decodables read (DecodableNnetSimple and its looped, online, batch kin)

_WHITESPACE = b" \t\n\r\v\f"  # what ReadToken's operator>> stops at
_TOKEN = re.compile(rb"[^ \t\n\r\v\f]{1,1024}")
_TOKEN_LIMIT = 1024
# Kaldi's IsValidName, which component and node names obey: names are checked, and found in descriptors, with it
_VALID_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.\-]*")
_COMPONENT_TAG = re.compile(r"<[A-Za-z_][A-Za-z0-9_]*>")
_CALL = re.compile(r"([A-Za-z]+)\s*\((.*)\)", re.DOTALL)  # a descriptor such as Offset(x, -1): its kind and arguments
_INTEGER = re.compile(r"[+-]?[0-9]+")
_LOG_PRIORS = "log(Priors)"  # in a bias's name: b - log(Priors), the bias the priors shift
# WriteBasicType's size byte: sizeof(T), negated for unsigned types (a char, so 0xFC is -4)
_BASIC_SIZES = {1: 1, 2: 2, 4: 4, 8: 8, 0xFF: 1, 0xFE: 2, 0xFC: 4, 0xF8: 8}
# tokens followed by WriteIntegerVector (a size byte, an int32 count, the values), which starts like an int32
_INTEGER_VECTORS = frozenset({"<TimeOffsets>", "<Sizes>", "<ColumnMap>", "<RequiredTimeOffsets>", "<HeightMap>",
                              "<RowOffsets>"})
# a ConvolutionModel's <Offsets> are (time, height) pairs; in the scale/offset components <Offsets> is an FV
_PAIR_VECTORS = frozenset({"<Offsets>"})
_WEIGHT_TOKENS = ("<LinearParams>", "<Params>", "<FilterParams>")
# components between a head and the output node that keep each frame's argmax: LogSoftmax subtracts one value per
# frame, NoOp copies; a Softmax keeps the argmax too, but the log priors Kaldi subtracts would then meet
# probabilities, so a model with priors is refused there
_PASS_THROUGH = ("LogSoftmaxComponent", "NoOpComponent", "SoftmaxComponent")
_COMPRESSED = {"CM": "one byte per value with column headers", "CM2": "two bytes per value",
               "CM3": "one byte per value"}
_SHOWN_PHONES = 2  # phone/state labels a pdf's token string shows before "+N more"


@dataclass(frozen=True)
class _Array:
    """A matrix or vector in the file: where its first value is, its shape, and its dtype ("float32", "float64",
    or "CM"/"CM2"/"CM3": a compressed matrix, skipped and never decoded)."""

    offset: int
    shape: tuple[int, ...]
    dtype: str


@dataclass
class _Component:
    name: str
    type: str
    weight: _Array | None = None
    weight_token: str = ""
    bias: _Array | None = None
    parts: list[tuple[str, _Array]] = field(default_factory=list)  # the matrices of a CompositeComponent's parts


class _Reader:
    """Kaldi's binary basic I/O over the mapped bytes, every read checked against the file's end."""

    def __init__(self, path: Path, data):
        self.path, self.data, self.size, self.pos = path, data, len(data), 0

    def truncated(self, what: str, count: int) -> InputError:
        return InputError(f"{self.path}: a truncated Kaldi model ({what}: {count} bytes needed from byte "
                          f"{self.pos}, the file has {self.size})")

    def ends(self, where: str) -> InputError:
        return InputError(f"{self.path}: a truncated Kaldi model (the file ends at byte {self.size}, {where})")

    def bad(self, what: str) -> InputError:
        return InputError(f"{self.path}: not a readable Kaldi nnet3 model ({what}, at byte {self.pos})")

    def need(self, count: int, what: str) -> None:
        if count < 0 or self.pos + count > self.size:
            raise self.truncated(what, count)

    def room(self, items: int, least: int, what: str) -> None:
        """A count read from the file: refused before looping when its items cannot fit in the rest."""
        if items < 0:
            raise self.bad(f"{what}: a negative count {items}")
        self.need(items * least, what)

    def skip_space(self) -> None:
        while self.pos < self.size and self.data[self.pos] in _WHITESPACE:
            self.pos += 1

    def token(self, what: str) -> str:
        """ReadToken: whitespace skipped, then the characters up to the next whitespace, which is consumed."""
        self.skip_space()
        match = _TOKEN.match(self.data, self.pos, self.size)
        if match is None:
            if self.pos >= self.size:
                raise self.ends(f"where {what} should be")
            raise self.bad(f"{what} expected, found byte 0x{self.data[self.pos]:02x}")
        end = match.end()
        if end >= self.size:
            raise self.ends(f"inside {what}")
        if end - self.pos >= _TOKEN_LIMIT and self.data[end] not in _WHITESPACE:
            raise self.bad(f"{what} expected, found {_TOKEN_LIMIT} bytes without a space")
        text = bytes(self.data[self.pos:end]).decode("utf-8", errors="replace")
        self.pos = end + 1
        return text

    def expect(self, token: str, where: str) -> None:
        start = self.pos
        found = self.token(f"{token} {where}")
        if found != token:
            self.pos = start
            raise self.bad(f"{token} {where} expected, found {found[:40]!r}")

    def int32(self, what: str) -> int:
        self.need(5, what)
        if self.data[self.pos] != 4:
            raise self.bad(f"{what}: a 4-byte integer expected, found size byte 0x{self.data[self.pos]:02x}")
        value = struct.unpack_from("<i", self.data, self.pos + 1)[0]
        self.pos += 5
        return value

    def real(self, what: str) -> float:
        """ReadBasicType<float>: four bytes, or eight (a double) when the size byte says so."""
        self.need(1, what)
        size = self.data[self.pos]
        if size not in (4, 8):
            raise self.bad(f"{what}: a float expected, found size byte 0x{size:02x}")
        self.need(1 + size, what)
        value = struct.unpack_from("<f" if size == 4 else "<d", self.data, self.pos + 1)[0]
        self.pos += 1 + size
        return value

    def integers(self, what: str, pairs: bool = False) -> np.ndarray:
        """ReadIntegerVector (or ReadIntegerPairVector): the int32 size byte, an int32 count, the values."""
        self.need(5, what)
        if self.data[self.pos] != 4:
            raise self.bad(f"{what}: a vector of 4-byte integers expected, found size byte "
                           f"0x{self.data[self.pos]:02x}")
        count = struct.unpack_from("<i", self.data, self.pos + 1)[0] * (2 if pairs else 1)
        self.pos += 5
        self.room(count, 4, what)
        values = np.frombuffer(self.data, "<i4", count, self.pos)
        self.pos += 4 * count
        return values

    def dims(self, what: str, count: int) -> tuple[int, ...]:
        sizes = tuple(self.int32(f"{what}'s size") for _ in range(count))
        if any(size < 0 for size in sizes):
            raise self.bad(f"{what}: a negative size {sizes}")
        return sizes

    def matrix(self, what: str) -> _Array:
        """Matrix::Read: "FM " or "DM ", rows and columns, the values row by row; or a CompressedMatrix, skipped."""
        self.need(3, what)
        kind = bytes(self.data[self.pos:self.pos + 3])
        if kind in (b"FM ", b"DM "):
            self.pos += 3
            rows, cols = self.dims(what, 2)
            item = 4 if kind == b"FM " else 8
            self.need(rows * cols * item, what)
            array = _Array(self.pos, (rows, cols), "float32" if item == 4 else "float64")
            self.pos += rows * cols * item
            return array
        if not kind.startswith(b"CM"):
            raise self.bad(f"{what}: a matrix (FM, DM or CM) expected, found {kind!r}")
        token = self.token(what)
        if token not in _COMPRESSED:
            raise self.bad(f"{what}: a compressed matrix CM, CM2 or CM3 expected, found {token[:20]!r}")
        # CompressedMatrix's GlobalHeader less its format (the token says it): min, range, rows, columns
        self.need(16, f"{what}'s compressed-matrix header")
        rows, cols = struct.unpack_from("<ii", self.data, self.pos + 8)
        if rows < 0 or cols < 0:
            raise self.bad(f"{what}: a negative size ({rows}, {cols})")
        self.pos += 16
        size = 0 if cols == 0 else {"CM": cols * (8 + rows), "CM2": 2 * rows * cols, "CM3": rows * cols}[token]
        self.need(size, what)
        self.pos += size
        return _Array(self.pos - size, (rows, cols), token)

    def vector(self, what: str) -> _Array:
        """Vector::Read: "FV " or "DV ", the dimension, the values."""
        self.need(3, what)
        kind = bytes(self.data[self.pos:self.pos + 3])
        if kind not in (b"FV ", b"DV "):
            raise self.bad(f"{what}: a vector (FV or DV) expected, found {kind!r}")
        self.pos += 3
        (dim,) = self.dims(what, 1)
        item = 4 if kind == b"FV " else 8
        self.need(dim * item, what)
        array = _Array(self.pos, (dim,), "float32" if item == 4 else "float64")
        self.pos += dim * item
        return array

    def skip_value(self, after: str, what: str) -> None:
        """One value of a component's field, of any kind but a token."""
        byte = self.data[self.pos]
        kind = bytes(self.data[self.pos:self.pos + 3])
        if kind in (b"FM ", b"DM ") or kind.startswith(b"CM"):
            self.matrix(what)
        elif kind in (b"FV ", b"DV "):
            self.vector(what)
        elif byte in b"TF":  # WriteBasicType<bool>: one character, no size byte
            self.pos += 1
        elif byte == 4 and after in _INTEGER_VECTORS:
            self.integers(what)
        elif byte == 4 and after in _PAIR_VECTORS:
            self.integers(what, pairs=True)
        elif byte in _BASIC_SIZES:
            self.need(1 + _BASIC_SIZES[byte], what)
            self.pos += 1 + _BASIC_SIZES[byte]
        else:
            raise self.bad(f"{what}: an unexpected byte 0x{byte:02x}")


class KaldiStore:
    """A binary Kaldi nnet3 model: its components' matrices by component name, its config lines, its priors, and
    the TransitionModel's tuples (phone, HMM state, forward pdf, self-loop pdf) when it is a final.mdl."""

    format = "kaldi"

    def __init__(self, path: Path):
        self._path = Path(path)
        self._data = data = map_file(self._path, "Kaldi model")
        self._components: dict[str, _Component] = {}
        self._tuples: np.ndarray | None = None  # tuples x (phone, hmm state, forward pdf, self-loop pdf)
        self._tuple_kind = ""  # "Tuples", or "Triples" (an older TransitionModel: one pdf per state)
        self._topology_phones: np.ndarray | None = None
        self._priors: _Array | None = None
        self._parse(_Reader(self._path, data))

    # --- parsing ---------------------------------------------------------------------------------------------

    def _parse(self, r: _Reader) -> None:
        if r.size < 2 or bytes(r.data[:2]) != b"\0B":
            start = bytes(r.data[:40]).lstrip()
            if start.startswith((b"<TransitionModel>", b"<Nnet3>")):
                tool = "nnet3-copy" if start.startswith(b"<Nnet3>") else "nnet3-am-copy"
                raise InputError(f"{self._path}: a Kaldi model in text mode, which is not read: write it in binary "
                                 f"with {tool} --binary=true and audit that")
            raise InputError(f"{self._path}: not a binary Kaldi nnet3 model (one starts with \\0B<TransitionModel> "
                             "or \\0B<Nnet3>)")
        r.pos = 2
        start = r.pos
        first = r.token("the model's first token")
        r.pos = start
        if first == "<TransitionModel>":
            self._transition_model(r)
            start = r.pos
            found = r.token("<Nnet3> after the TransitionModel")
            if found != "<Nnet3>":
                r.pos = start
                kind = "an nnet2 model" if found == "<Nnet>" else "not an nnet3 model (a GMM model?)"
                raise r.bad(f"{kind}: the TransitionModel is followed by {found[:40]!r}, not <Nnet3>")
            r.pos = start
            self._nnet(r)
            r.expect("<LeftContext>", "after the network (an AmNnetSimple)")
            r.int32("the left context")
            r.expect("<RightContext>", "after the left context")
            r.int32("the right context")
            r.expect("<Priors>", "after the right context")
            self._priors = r.vector("the Priors")
        elif first == "<Nnet3>":
            self._nnet(r)
        else:
            raise r.bad(f"<TransitionModel> or <Nnet3> expected, found {first[:40]!r}")

    def _transition_model(self, r: _Reader) -> None:
        """TransitionModel::Read: the HmmTopology (binary form), the tuples, the transitions' log-probs."""
        r.expect("<TransitionModel>", "at the start")
        r.expect("<Topology>", "in the TransitionModel")
        self._topology_phones = r.integers("the Topology's phones")
        r.integers("the Topology's phone-to-entry map")
        entries = r.int32("the Topology's entry count")
        with_self_loops = entries == -1  # the extended format: each state also names a self-loop pdf class
        if with_self_loops:
            entries = r.int32("the Topology's entry count")
        r.room(entries, 5, "the Topology's entries")
        for _ in range(entries):
            states = r.int32("a Topology entry's state count")
            r.room(states, 15 if with_self_loops else 10, "a Topology entry's states")
            for _ in range(states):
                r.int32("a Topology state's pdf class")
                if with_self_loops:
                    r.int32("a Topology state's self-loop pdf class")
                transitions = r.int32("a Topology state's transition count")
                r.room(transitions, 10, "a Topology state's transitions")
                for _ in range(transitions):
                    r.int32("a transition's destination")
                    r.real("a transition's probability")
        r.expect("</Topology>", "after the Topology")
        kind = r.token("<Tuples> or <Triples>")
        if kind not in ("<Tuples>", "<Triples>"):
            raise r.bad(f"<Tuples> or <Triples> expected after the Topology, found {kind[:40]!r}")
        width = 4 if kind == "<Tuples>" else 3
        count = r.int32(f"the {kind[1:-1]}' count")
        r.room(count, 5 * width, f"the TransitionModel's {count} {kind[1:-1]}")
        # each value an int32 with its size byte: read all at once, the size bytes checked together
        fields = np.frombuffer(r.data, np.dtype([("size", "u1"), ("value", "<i4")]), count * width, r.pos)
        if np.any(fields["size"] != 4):
            raise r.bad(f"the TransitionModel's {kind[1:-1]}: a value is not a 4-byte integer")
        r.pos += 5 * width * count
        tuples = fields["value"].reshape(count, width).astype(np.int64)
        if width == 3:  # an HMM's state has one pdf, its forward and self-loop pdf alike
            tuples = np.column_stack([tuples, tuples[:, 2]])
        self._tuples, self._tuple_kind = tuples, kind[1:-1]
        closing = r.token("</Tuples> or </Triples>")
        if closing not in ("</Tuples>", "</Triples>"):
            raise r.bad(f"</Tuples> expected after the tuples, found {closing[:40]!r}")
        r.expect("<LogProbs>", "in the TransitionModel")
        r.vector("the TransitionModel's LogProbs")
        r.expect("</LogProbs>", "after the LogProbs")
        r.expect("</TransitionModel>", "after the LogProbs")

    def _nnet(self, r: _Reader) -> None:
        """Nnet::Read: the config lines (text, up to a blank line), then the components."""
        r.expect("<Nnet3>", "at the network's start")
        lines = None  # None: still on <Nnet3>'s own line, whose rest Nnet::Read eats (it must be empty)
        while True:  # then the config lines, up to a blank one
            end = r.data.find(b"\n", r.pos)
            if end < 0:
                raise r.ends("inside the network's config lines, before the blank line that ends them")
            line = bytes(r.data[r.pos:end]).decode("utf-8", errors="replace").rstrip("\r")
            if lines is None:
                if line:
                    raise r.bad(f"a new line expected after <Nnet3>, found {line[:40]!r}")
                lines = []
            elif not line:
                r.pos = end + 1
                break
            else:
                lines.append(line)
            r.pos = end + 1
        self._nodes = _config_nodes(lines)
        r.expect("<NumComponents>", "after the config lines")
        count = r.int32("the component count")
        if not 0 <= count < 100000:  # Nnet::Read's own bound
            raise r.bad(f"a component count of {count}")
        r.room(count, 20, "the components")
        for _ in range(count):
            r.expect("<ComponentName>", "before each component")
            name = r.token("a component's name")
            if not _VALID_NAME.fullmatch(name):
                raise r.bad(f"a component name expected, found {name[:40]!r}")
            component = self._component(r, name)
            self._components[name] = component
        r.expect("</Nnet3>", "after the components")

    def _component(self, r: _Reader, name: str) -> _Component:
        """One component: its type's tag, then fields (a token and its values) up to the closing tag. The matrix
        after <LinearParams> (or a LinearComponent's <Params>) and the vector after <BiasParams> are kept."""
        tag = r.token(f"{name}'s type")
        if not _COMPONENT_TAG.fullmatch(tag):
            raise r.bad(f"a component type such as <AffineComponent> expected for {name}, found {tag[:40]!r}")
        component = _Component(name, tag[1:-1])
        closing, inner, parts = f"</{component.type}>", [], 0
        after = tag
        while True:
            r.skip_space()
            if r.pos >= r.size:
                raise r.ends(f"inside {name} ({component.type}), before its {closing}")
            if r.data[r.pos] == ord("<"):
                after = r.token(f"a field of {name}")
                if inner and after == inner[-1]:
                    inner.pop()
                elif after in ("<ComponentName>", "</Nnet3>"):  # the next component, or the network's end
                    raise r.bad(f"{name} ({component.type}) does not end with {closing}")
                elif not inner and after == closing:
                    return component
                elif after.endswith("Component>") and not after.startswith("</"):
                    inner.append("</" + after[1:])  # a CompositeComponent's part: its fields up to its own tag
                    parts += 1
                continue
            what = f"{name}'s {after.strip('<>')}"
            start = r.pos
            if after in _WEIGHT_TOKENS and bytes(r.data[r.pos:r.pos + 2]) in (b"FM", b"DM", b"CM"):
                array = r.matrix(what)
                if inner:
                    component.parts.append((f"{name}.{parts}", array))
                elif component.weight is None:
                    component.weight, component.weight_token = array, after[1:-1]
            elif after == "<BiasParams>" and not inner and component.bias is None:
                component.bias = r.vector(what)
                if component.bias.shape == (0,):  # a TdnnComponent without a bias (use-bias=false) writes none
                    component.bias = None
            else:
                r.skip_value(after, what)
            if r.pos == start:
                raise r.bad(f"{what}: nothing read")
            if after in _INTEGER_VECTORS or after in _PAIR_VECTORS:
                after = after + " value"  # one vector follows such a token, no more

    # --- what the loader asks --------------------------------------------------------------------------------

    def tensors(self) -> dict[str, TensorInfo]:
        """Each component's matrix as NAME.LinearParams (NAME.Params for a LinearComponent: the token the file
        writes before it) and its bias as NAME.BiasParams, the names a head read from them reports and --weight and
        --bias take; a CompositeComponent's parts' matrices as NAME.1, NAME.2, ... (listed, never a head)."""
        infos = {}
        for component in self._components.values():
            if component.weight is not None:
                name = f"{component.name}.{component.weight_token}"
                infos[name] = TensorInfo(name, component.weight.shape, component.weight.dtype)
            if component.bias is not None:
                name = f"{component.name}.BiasParams"
                infos[name] = TensorInfo(name, component.bias.shape, component.bias.dtype)
            for name, array in component.parts:
                infos[name] = TensorInfo(name, array.shape, array.dtype)
        return infos

    def _listed(self) -> str:
        found = [f"{c.name} ({c.type}, {' x '.join(map(str, c.weight.shape))})"
                 for c in self._components.values() if c.weight is not None]
        shown = "; ".join(found[:12]) + (f"; +{len(found) - 12} more" if len(found) > 12 else "")
        return f"components with a matrix: {shown or 'none'}"

    def _find_head(self, weight: str | None) -> _Component:
        """The component --weight names (NAME, or its matrix's name NAME.LinearParams / NAME.Params); by default
        output.affine, else the component the output node's values come from."""
        if weight is not None:
            component = self._components.get(weight)
            if component is None:  # NAME.LinearParams: the name reports and tensors() give the matrix
                name, _, token = weight.rpartition(".")
                owner = self._components.get(name)
                if owner is not None and owner.weight is not None and token == owner.weight_token:
                    component = owner
            if component is None:
                raise InputError(f"{self._path}: no component {weight!r} in the Kaldi model; {self._listed()}")
            if component.weight is None:
                raise InputError(f"{self._path}: the component {component.name} ({component.type}) has no matrix; "
                                 f"{self._listed()}")
        else:
            component = self._components.get(DEFAULT_HEAD)
            if component is None or component.weight is None:
                source = self._output_source()[0]
                component = None if source is None else self._components[source.fields["component"]]
            if component is None:
                raise InputError(f"{self._path}: no {DEFAULT_HEAD} component in the Kaldi model, and the output "
                                 f"node {OUTPUT_NODE!r} is not fed by a component with a matrix; choose one with "
                                 f"--weight NAME ({self._listed()})")
        if component.type not in HEAD_TYPES:
            raise InputError(f"{self._path}: {component.name} is a {component.type}, whose matrix is not the W of "
                             f"W x + b (heads are {', '.join(HEAD_TYPES)}); {self._listed()}")
        if component.weight.dtype in _COMPRESSED:
            raise InputError(f"{self._path}: {component.name}'s {component.weight_token} are a compressed matrix "
                             f"({component.weight.dtype}: {_COMPRESSED[component.weight.dtype]}), which this reader "
                             "does not decode (Kaldi writes parameters uncompressed)")
        return component

    def _output_source(self) -> tuple[_Node | None, list[_Node], bool]:
        """Back from the output node Kaldi's decodables read, through descriptors that copy one node's rows
        (_copied_node) and components that keep each frame's argmax (_PASS_THROUGH), to the component-node with a
        matrix whose values the output node's are. Returns (that node, or None where the walk meets anything else;
        the nodes after it up to the output node, in the network's order; whether a Softmax is among them)."""
        node = self._nodes.get(OUTPUT_NODE)
        path: list[_Node] = []
        softmax = False
        while node is not None and len(path) <= len(self._nodes):  # a loop of such nodes ends the walk
            path.insert(0, node)
            source = self._nodes.get(_copied_node(node.descriptor) or "")
            if source is None or source.kind != "component-node":
                break
            component = self._components.get(source.fields.get("component", ""))
            if component is None:
                break
            if component.weight is not None:
                return source, path, softmax
            if component.type not in _PASS_THROUGH:
                break
            softmax |= component.type == "SoftmaxComponent"
            node = source
        return None, path, softmax

    def _route(self, component: _Component, path: list[_Node] | None) -> str:
        """Where the head's output goes, in words: along ``path`` to the output node when the output node's values
        are the head's (``path`` None otherwise), else as far as the config lines show one use after another."""
        if path is not None:
            return "feeding " + " then ".join(n.describe(self._components) for n in path)
        nodes = [n for n in self._nodes.values() if n.kind == "component-node"
                 and n.fields.get("component") == component.name]
        if not nodes:
            return "used by no node of the network's config"
        steps, node = [], nodes[0]
        while len(steps) <= len(self._nodes):
            users = [n for n in self._nodes.values() if node.name in n.references]
            if len(users) != 1:
                steps.append(", ".join(n.describe(self._components) for n in users[:4]) or "nothing")
                break
            user = users[0]
            steps.append(user.describe(self._components))
            kind = self._components.get(user.fields.get("component", ""))
            if (user.kind != "component-node" or _copied_node(user.descriptor) != node.name or kind is None
                    or kind.type not in _PASS_THROUGH):
                break
            node = user
        return "feeding " + " then ".join(steps)

    def _array(self, array: _Array) -> np.ndarray:
        values = np.frombuffer(self._data, "<f4" if array.dtype == "float32" else "<f8",
                               int(np.prod(array.shape)), array.offset)
        return values.reshape(array.shape).astype(np.float32 if array.dtype == "float32" else np.float64)

    def read_head(self, path: Path, weight: str | None, bias: str | None) -> Head:
        """The head: ``weight`` (NAME or NAME.LinearParams; default output.affine, else the component the output
        node's values come from) as rows (pdf-ids) x input; its BiasParams as the bias (``bias``: "none", or
        another component's, as NAME.BiasParams or NAME), less the log priors where Kaldi's decodables subtract
        them (see _apply_priors)."""
        component = self._find_head(weight)
        matrix = self._array(component.weight)
        rows, cols = matrix.shape
        source, path_nodes, softmax = self._output_source()
        reaches = source is not None and source.fields.get("component") == component.name
        route = self._route(component, path_nodes if reaches else None)
        vector, bias_name, shifted = self._bias(component, bias, rows)
        shape = f"{rows} x {cols}" + (f", bias {component.bias.shape[0]}" if component.bias is not None else "")
        notes = [f"the head is the Kaldi nnet3 component {component.name} ({component.type}, {shape}) {route}"]
        vector, bias_name = self._apply_priors(component, vector, bias_name, bias, shifted, reaches, softmax, route,
                                               notes)
        head = Head(weight=matrix, bias=vector, weight_name=f"{component.name}.{component.weight_token}",
                    bias_name=bias_name, path=path, source_format=self.format)
        head.notes += notes
        return head

    def _bias(self, component: _Component, bias: str | None, rows: int) -> tuple[np.ndarray | None, str | None, bool]:
        """The bias ``bias`` names: None, the head's own BiasParams; "none"; a component's BiasParams as
        NAME.BiasParams or NAME. The names a report gives a bias the priors shift are taken too: either followed
        by " - log(Priors)", or "-log(Priors)" alone (no BiasParams). Returns (the vector, its name, whether the
        name asks for the priors)."""
        if bias == "none":
            return None, None, False
        if bias == "-" + _LOG_PRIORS:
            return None, None, True
        if bias is not None:
            shifted = bias.endswith(" - " + _LOG_PRIORS)
            named = bias.removesuffix(" - " + _LOG_PRIORS)
            owner = self._components.get(named)
            if owner is None and named.endswith(".BiasParams"):
                owner = self._components.get(named.removesuffix(".BiasParams"))
            if owner is None or owner.bias is None or owner.bias.shape[0] != rows:
                raise InputError(f"{self._path}: --bias {bias!r} is not the BiasParams of a component with {rows} "
                                 "outputs in the Kaldi model (name one as NAME.BiasParams or NAME, or pass none)")
            return self._array(owner.bias), f"{owner.name}.BiasParams", shifted
        if component.bias is None:
            return None, None, False
        if component.bias.shape[0] != rows:
            raise InputError(f"{self._path}: {component.name}'s BiasParams have {component.bias.shape[0]} values "
                             f"for its {rows} rows")
        return self._array(component.bias), f"{component.name}.BiasParams", False

    def _apply_priors(self, component: _Component, vector: np.ndarray | None, bias_name: str | None,
                      bias: str | None, shifted: bool, reaches: bool, softmax: bool, route: str,
                      notes: list[str]) -> tuple[np.ndarray | None, str | None]:
        """Kaldi's decodables (nnet-am-decodable-simple.cc, decodable-simple-looped.cc, decodable-online-looped.cc,
        nnet-batch-compute.cc) score frame t's pdf j as acoustic_scale * (y_tj - log prior_j), y the output node's
        values, whenever the AmNnetSimple's priors are not empty. When y is the head's W x + b through row-copying
        descriptors and a log-softmax (one value per frame subtracted), the argmax is that of W x + b - log prior:
        the bias audited is b - log prior, in float64 (b as stored, the priors' log in float64), whatever --bias
        named but none. Priors with as many values as the head has rows that cannot be applied so (the output
        node's values are not the head's, a Softmax comes first, a prior is not positive) are an InputError, as
        they would leave the head decoding uses unaudited; --bias none audits the layer's W x alone, knowingly."""
        rows = component.weight.shape[0]
        count = 0 if self._priors is None else self._priors.shape[0]
        if count == 0:
            if self._priors is not None:
                notes.append("the model has no priors (a chain model, or priors never set): Kaldi's decodables use "
                             "the output node's values as they are")
            if shifted:
                raise InputError(f"{self._path}: --bias {bias!r} subtracts the log priors, but the model has none "
                                 f"(name the bias without {_LOG_PRIORS})")
            return vector, bias_name
        said = f"the model has priors ({count}), whose log Kaldi's decodables subtract from the {OUTPUT_NODE!r} node"
        if not reaches and count != rows:
            notes.append(f"{said}: {component.name} does not give that node's values, and they do not match its "
                         f"{rows} rows: not applied")
            if shifted:
                raise InputError(f"{self._path}: --bias {bias!r} subtracts the log priors, but they are not applied "
                                 f"to {component.name} ({count} priors for its {rows} rows; that node's values are "
                                 "not its)")
            return vector, bias_name
        priors = self._array(self._priors).astype(np.float64)
        bad = np.flatnonzero(~(priors > 0))
        why = None
        if not reaches:
            why = (f"its values are not {component.name}'s through row-copying descriptors (a name, Offset, Round, "
                   f"ReplaceIndex) and argmax-keeping components (LogSoftmax, NoOp): {component.name} is {route}")
        elif softmax:
            why = ("a SoftmaxComponent comes before it, so the log priors would be subtracted from probabilities, "
                   "which is not a linear head")
        elif count != rows:
            why = f"they do not match the {rows} rows of {component.name}, which gives its values"
        elif bad.size:
            why = f"prior {bad[0]} is {priors[bad[0]]}, whose log is not finite"
        if bias == "none":
            notes.append(f"{said}" + (f", but {why}" if why else "") + "; --bias none: neither the bias nor the "
                         "priors are audited")
            return None, None
        if why is not None:
            raise InputError(f"{self._path}: {said}, but {why}; so the scores decoding ranks are not W x + b - "
                             f"log(Priors) of this head. To audit {component.name}'s rows without its bias or the "
                             f"priors, knowingly, pass --weight {component.name} --bias none")
        log = np.log(priors)
        audited = -log if vector is None else vector.astype(np.float64) - log
        notes.append(f"{said}: the bias audited is {bias_name or 'zero'} - log(Priors) in float64, as decoding "
                     "scores rows (a per-frame log-softmax and time shifts do not change the argmax)")
        return audited, f"{bias_name} - {_LOG_PRIORS}" if bias_name else f"-{_LOG_PRIORS}"

    def token_strings(self, rows: int) -> tuple[list[str | None] | None, str | None, list[str]]:
        """Names for the rows (pdf-ids), as "pdf 17: a_B/1 a_I/1 +3 more": the phones and HMM states whose
        transitions use the pdf, PHONE/STATE, or PHONE/STATE:loop where only the state's self-loop uses it (a chain
        model's states have a forward and a self-loop pdf); the first two by phone id shown, "+N more" counting the
        rest; "pdf 5: (no phone)" for a pdf no tuple uses; None past the tuples' pdfs. Phones are named from a
        phones.txt beside the model (its folder, its graph/ subfolder, ../graph/ as Vosk lays a model out, or
        ../), else by their ids. Returns (strings by row, their source, notes)."""
        if self._tuples is None:
            return None, None, [("a raw nnet3 network (no TransitionModel): its rows are pdf-ids with nothing to "
                                 "name them; no token strings")]
        notes = []
        names, phones_file = self._phone_names(notes)
        uses: dict[int, dict[tuple[int, int], set[str]]] = {}
        for phone, state, forward, self_loop in self._tuples.tolist():
            uses.setdefault(forward, {}).setdefault((phone, state), set()).add("")
            uses.setdefault(self_loop, {}).setdefault((phone, state), set()).add(":loop")
        pdfs = max(uses) + 1 if uses else 0
        strings: list[str | None] = [None] * rows
        for pdf in range(min(rows, pdfs)):
            used = uses.get(pdf)
            if not used:
                strings[pdf] = f"pdf {pdf}: (no phone)"
                continue
            labels = [f"{names.get(phone, str(phone))}/{state}{min(roles)}"
                      for (phone, state), roles in sorted(used.items())]
            more = f" +{len(labels) - _SHOWN_PHONES} more" if len(labels) > _SHOWN_PHONES else ""
            strings[pdf] = f"pdf {pdf}: {' '.join(labels[:_SHOWN_PHONES])}{more}"
        if pdfs != rows:
            notes.append(f"the TransitionModel's {self._tuple_kind} use {pdfs} pdf-ids, the head has {rows} rows")
        named = f"phone names from {phones_file}" if phones_file else "phones by id"
        source = (f"the TransitionModel's {self._tuple_kind} ({len(self._tuples)}: the phones and HMM states using "
                  f"each pdf-id), {named}")
        return strings, source, notes

    def _phone_names(self, notes: list[str]) -> tuple[dict[int, str], Path | None]:
        """The first phones.txt found that names every phone of the model's Topology as a phone: one that names
        some as disambiguation symbols (#0, #1, ...) or not at all lists another phone set (Vosk's Korean model
        ships such a file: 166 phones for the model's 194), so its names would be wrong, and is passed over."""
        folder = self._path.parent
        places = (folder / "phones.txt", folder / "graph" / "phones.txt", folder.parent / "graph" / "phones.txt",
                  folder.parent / "phones.txt")
        found = [place for place in places if place.is_file()]
        used = sorted({int(p) for p in self._topology_phones}) if self._topology_phones is not None else []
        for place in found:
            try:
                lines = place.read_text(encoding="utf-8", errors="replace").splitlines()
            except OSError as error:
                notes.append(f"{place} could not be read ({error})")
                continue
            names = {}
            for line in lines:
                fields = line.split()
                if len(fields) == 2 and fields[1].isdigit():
                    names[int(fields[1])] = fields[0]
            unfit = [p for p in used if names.get(p, "#").startswith("#") or names[p] == "<eps>"]
            if not unfit:
                return names, place
            notes.append(f"{place} is not this model's phone set: of its {len(used)} phones it names "
                         f"{len(unfit)} as disambiguation symbols or not at all (phone {unfit[0]}: "
                         f"{names.get(unfit[0], 'missing')})")
        if not found:
            notes.append("no phones.txt beside the model (looked in " + ", ".join(str(p.parent) for p in places)
                         + ")")
        notes[-1] += ": phones named by id"
        return {}, None


@dataclass
class _Node:
    kind: str  # input-node, component-node, output-node, dim-range-node
    name: str
    fields: dict[str, str]
    references: frozenset[str] = frozenset()  # the node names its input descriptor mentions

    @property
    def descriptor(self) -> str:
        """The input descriptor: input=... (a dim-range-node's input-node=...)."""
        return self.fields.get("input", self.fields.get("input-node", ""))

    def describe(self, components: dict[str, _Component]) -> str:
        """The node in words, with its input where that copies a node's rows moved in time (Offset(x, 5))."""
        shift = self.descriptor if _copied_node(self.descriptor) not in (None, self.descriptor) else ""
        if self.kind == "output-node":
            return f"the output node {self.name!r}" + (f" (input={shift})" if shift else "")
        component = components.get(self.fields.get("component", ""))
        said = [component.type] if component is not None else []
        said += [f"input={shift}"] if shift else []
        return f"{self.name} ({', '.join(said)})" if said else self.name


def _copied_node(descriptor: str) -> str | None:
    """The node whose rows a descriptor copies as they are, each requested row one of that node's (nnet-descriptor.h's
    forwarding descriptors but Switch): a node name, or one inside Offset(d, t-offset[, x-offset]),
    Round(d, t-modulus) or ReplaceIndex(d, t|x, value), nested in any order. None for anything else (Append,
    Sum, IfDefined, Failover, Switch, Scale, Const), whose rows are not one node's rows unchanged."""
    text = descriptor.strip()
    while not _VALID_NAME.fullmatch(text):
        call = _CALL.fullmatch(text)
        arguments = None if call is None else _arguments(call.group(2))
        if arguments is None:
            return None
        kind, rest = call.group(1), [argument.strip() for argument in arguments[1:]]
        numbers = [bool(_INTEGER.fullmatch(argument)) for argument in rest]
        if not ((kind == "Offset" and len(rest) in (1, 2) and all(numbers))
                or (kind == "Round" and numbers == [True])
                or (kind == "ReplaceIndex" and len(rest) == 2 and rest[0] in ("t", "x") and numbers[1])):
            return None
        text = arguments[0].strip()
    return text


def _arguments(text: str) -> list[str] | None:
    """A call's arguments, split at the commas outside parentheses; None where the parentheses do not pair."""
    arguments, depth, start = [], 0, 0
    for at, char in enumerate(text):
        depth += (char == "(") - (char == ")")
        if depth < 0:
            return None
        if char == "," and depth == 0:
            arguments.append(text[start:at])
            start = at + 1
    return arguments + [text[start:]] if depth == 0 else None


def _config_nodes(lines: list[str]) -> dict[str, _Node]:
    """The config lines' nodes by name: "component-node name=X component=Y input=Append(Offset(a, -1), b)"; a
    value may hold spaces inside parentheses."""
    nodes = {}
    for line in lines:
        parts, depth, current = [], 0, ""
        for char in line.split("#")[0]:
            depth += (char == "(") - (char == ")")
            if char.isspace() and depth == 0:
                parts, current = (parts + [current] if current else parts), ""
            else:
                current += char
        parts += [current] if current else []
        if not parts:
            continue
        fields = dict(part.split("=", 1) for part in parts[1:] if "=" in part)
        if "name" in fields:
            nodes[fields["name"]] = _Node(parts[0], fields["name"], fields)
    for node in nodes.values():
        node.references = frozenset(name for name in _VALID_NAME.findall(node.descriptor) if name in nodes)
    return nodes
