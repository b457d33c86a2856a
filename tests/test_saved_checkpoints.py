"""Checkpoints as training code saves them: a head's bias beside its weight, state dicts inside
``model_state_dict``, Lightning's ``state_dict``, or any dict named by a dotted --weight path, and the
optimizer state beside them never read. Each test checks the exact tensors audited and the verdicts
against Qhull (tests/oracles.py)."""

import json

import numpy as np
import pytest
import torch
from oracles import qhull_argmaxable

from auditor.cli.audit import main as audit_main
from auditor.cli.verify import main as verify_main
from auditor.loader import load_head

N, D = 12, 3
_RNG = np.random.default_rng(20)
# Eight rows spread out and four near the middle, which only their bias can make win: auditing
# without the bias gives other verdicts (checked below), so a dropped bias cannot pass unnoticed.
W = np.vstack([_RNG.normal(size=(8, D)), 0.2 * _RNG.normal(size=(4, D))]).astype(np.float32)
B = (0.8 * _RNG.normal(size=N)).astype(np.float32)
ARGMAXABLE = qhull_argmaxable(W.astype(np.float64), B.astype(np.float64))


class Net(torch.nn.Module):
    """A small model whose one matrix is its output layer: the head is found by its shape."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv1d(1, 5, 3)
        self.fc = torch.nn.Linear(D, N)


def trained(weight=W, bias=B) -> tuple[Net, dict]:
    """(a Net holding ``weight`` and ``bias`` in fc, its Adam state after one step): the optimizer's
    moments include a matrix shaped like the head."""
    torch.manual_seed(0)
    net = Net()
    optimizer = torch.optim.Adam(net.parameters(), lr=1e-3)
    for parameter in net.parameters():
        parameter.grad = torch.ones_like(parameter)
    optimizer.step()
    with torch.no_grad():
        net.fc.weight.copy_(torch.from_numpy(weight))
        net.fc.bias.copy_(torch.from_numpy(bias))
    return net, optimizer.state_dict()


def audit_json(capsys, *args) -> dict:
    code = audit_main([*map(str, args), "--format", "json", "--quiet", "--fail-on", "none"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    return json.loads(captured.out)


def argmaxable(doc: dict) -> set[int]:
    assert doc["summary"]["n_tokens"] == N
    return set(range(N)) - {finding["id"] for finding in doc["findings"]}


def one_error_line(capsys, code: int) -> str:
    captured = capsys.readouterr()
    assert code == 2 and captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("audit: error:"), captured.err
    return lines[0]


def assert_head_is(head, weight=W, bias=B) -> None:
    assert np.array_equal(np.asarray(head.weight), weight)
    assert head.bias is not None and np.array_equal(np.asarray(head.bias), bias)


def test_the_bias_changes_the_verdicts_of_this_head():
    assert ARGMAXABLE != qhull_argmaxable(W.astype(np.float64))
    assert 0 < len(ARGMAXABLE) < N


def test_a_head_found_by_shape_takes_its_sibling_bias_and_says_so(tmp_path, capsys):
    net, _ = trained()
    torch.save(net.state_dict(), tmp_path / "net.pth")
    head = load_head(tmp_path / "net.pth")
    assert (head.weight_name, head.bias_name) == ("fc.weight", "fc.bias")
    assert_head_is(head)
    doc = audit_json(capsys, tmp_path / "net.pth")
    assert doc["head"]["bias"] == "fc.bias"
    assert argmaxable(doc) == ARGMAXABLE
    assert any("fc.bias" in note and "beside the weight" in note for note in doc["notes"])


@pytest.mark.parametrize("fmt", ["text", "markdown"])
def test_every_format_says_where_the_bias_came_from(tmp_path, capsys, fmt):
    net, _ = trained()
    torch.save(net.state_dict(), tmp_path / "net.pth")
    audit_main([str(tmp_path / "net.pth"), "--format", fmt, "--quiet", "--fail-on", "none"])
    assert "the bias is fc.bias, found beside the weight" in capsys.readouterr().out


def test_an_ambiguous_bias_is_one_line_and_exit_two(tmp_path, capsys):
    net, _ = trained()
    state = {**net.state_dict(), "decoder.output.bias": torch.zeros(N)}  # a known bias name, of another layer
    torch.save(state, tmp_path / "net.pth")
    line = one_error_line(capsys, audit_main([str(tmp_path / "net.pth"), "--quiet"]))
    assert "fc.bias [12]" in line and "decoder.output.bias [12]" in line and "--bias" in line
    doc = audit_json(capsys, tmp_path / "net.pth", "--bias", "fc.bias")
    assert doc["head"]["bias"] == "fc.bias" and argmaxable(doc) == ARGMAXABLE


def test_one_bias_stored_under_two_tied_names_is_not_ambiguous(tmp_path):
    # BERT saves its prediction bias as cls.predictions.bias and again as the decoder's bias
    torch.save({"bert.embeddings.word_embeddings.weight": torch.from_numpy(W),
                "cls.predictions.bias": torch.from_numpy(B), "cls.predictions.decoder.bias": torch.from_numpy(B)},
               tmp_path / "pytorch_model.bin")
    head = load_head(tmp_path / "pytorch_model.bin")
    assert head.bias_name == "cls.predictions.bias"
    assert_head_is(head)


def test_a_training_checkpoint_is_unwrapped_and_its_optimizer_state_never_audited(tmp_path, capsys):
    net, optimizer = trained()
    assert any(state["exp_avg"].shape == (N, D) for state in optimizer["state"].values())
    torch.save({"epoch": 7, "model_state_dict": net.state_dict(), "optimizer_state_dict": optimizer,
                "loss": 0.25}, tmp_path / "checkpoint.pth")
    head = load_head(tmp_path / "checkpoint.pth")
    assert (head.weight_name, head.bias_name) == ("fc.weight", "fc.bias")
    assert_head_is(head)
    assert any("checkpoint['model_state_dict']" in note for note in head.notes)
    assert argmaxable(audit_json(capsys, tmp_path / "checkpoint.pth")) == ARGMAXABLE


def test_a_lightning_checkpoint_loses_its_model_prefix(tmp_path, capsys):
    net, optimizer = trained()
    torch.save({"epoch": 3, "global_step": 120, "pytorch-lightning_version": "2.4.0",
                "state_dict": {f"model.{name}": tensor for name, tensor in net.state_dict().items()},
                "optimizer_states": [optimizer], "lr_schedulers": [], "hyper_parameters": {"lr": 1e-3}},
               tmp_path / "epoch=3.ckpt")
    for weight in (None, "fc.weight", "model.fc.weight", "state_dict.model.fc.weight"):
        head = load_head(tmp_path / "epoch=3.ckpt", weight=weight)
        assert (head.weight_name, head.bias_name) == ("fc.weight", "fc.bias"), weight
        assert_head_is(head)
    assert any("Lightning" in note for note in head.notes)
    assert argmaxable(audit_json(capsys, tmp_path / "epoch=3.ckpt")) == ARGMAXABLE


def test_a_dotted_weight_names_a_head_in_any_nested_dict_with_its_own_bias(tmp_path, capsys):
    other_weight, other_bias = -W[::-1].copy(), B[::-1].copy()
    ema, _ = trained(other_weight, other_bias)
    net, optimizer = trained()
    torch.save({"model_state_dict": net.state_dict(), "ema": {"model": ema.state_dict()},
                "optimizer_state_dict": optimizer}, tmp_path / "checkpoint.pt")
    head = load_head(tmp_path / "checkpoint.pt", weight="ema.model.fc.weight")
    assert (head.weight_name, head.bias_name) == ("ema.model.fc.weight", "ema.model.fc.bias")
    assert_head_is(head, other_weight, other_bias)
    assert any("checkpoint['ema']['model']" in note for note in head.notes)
    doc = audit_json(capsys, tmp_path / "checkpoint.pt", "--weight", "ema.model.fc.weight")
    assert argmaxable(doc) == qhull_argmaxable(other_weight.astype(np.float64), other_bias.astype(np.float64))
    same = load_head(tmp_path / "checkpoint.pt", weight="model_state_dict.fc.weight")
    assert (same.weight_name, same.bias_name) == ("fc.weight", "fc.bias")
    assert_head_is(same)


def test_a_dotted_path_into_optimizer_state_is_refused(tmp_path, capsys):
    net, optimizer = trained()
    torch.save({"model_state_dict": net.state_dict(), "optimizer_state_dict": optimizer}, tmp_path / "ckpt.pt")
    line = one_error_line(capsys, audit_main([str(tmp_path / "ckpt.pt"), "--weight",
                                              "optimizer_state_dict.state.1.exp_avg"]))
    assert "optimizer state" in line and "never reads" in line


def test_tensors_under_an_unknown_key_are_named_and_reachable_by_their_path(tmp_path, capsys):
    net, optimizer = trained()
    torch.save({"network": net.state_dict(), "optim": optimizer}, tmp_path / "ckpt.pt")
    line = one_error_line(capsys, audit_main([str(tmp_path / "ckpt.pt"), "--quiet"]))
    assert "network (4 tensors)" in line and "--weight network." in line and "optim" not in line.split("but")[1]
    head = load_head(tmp_path / "ckpt.pt", weight="network.fc.weight")
    assert (head.weight_name, head.bias_name) == ("network.fc.weight", "network.fc.bias")
    assert_head_is(head)


def test_audit_verify_loads_a_training_checkpoint_as_audit_does(tmp_path, capsys):
    net, optimizer = trained()
    torch.save({"model_state_dict": net.state_dict(), "optimizer_state_dict": optimizer}, tmp_path / "ckpt.pth")
    certificates = tmp_path / "certificates.json"
    code = audit_main([str(tmp_path / "ckpt.pth"), "--quiet", "--fail-on", "none", "--certificates",
                       str(certificates)])
    assert code == 0, capsys.readouterr().err
    assert json.loads(certificates.read_text())["head"]["bias_tensor"] == "fc.bias"
    capsys.readouterr()
    assert verify_main([str(certificates), str(tmp_path / "ckpt.pth"), "--quiet"]) == 0, capsys.readouterr()
