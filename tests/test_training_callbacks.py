"""The audit inside a training loop: a real transformers Trainer on a tiny GPT-2 built from a config, whose
vocabulary gains two tokens; one is a training target, the other never appears. The callback's metrics
show the first becoming argmaxable and the second staying unargmaxable, and a report lands in each
checkpoint folder (Lightning: in each checkpoint). ``audit_model`` on the same live model gives findings
with the gate. The checkpoints the tests load with pickle are the ones they wrote."""

import json

import numpy as np
import pytest
import torch

import auditor

transformers = pytest.importorskip("transformers")

from tokenizers import Tokenizer, models, pre_tokenizers  # noqa: E402

WORDS = [f"w{k}" for k in range(400)]


def tiny_model_and_tokenizer():
    torch.manual_seed(0)
    vocab = {word: k for k, word in enumerate(["<unk>", *WORDS])}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>", pad_token="<unk>")
    config = transformers.GPT2Config(vocab_size=len(vocab), n_positions=32, n_embd=16, n_layer=1, n_head=2,
                                     bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(config)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|end|>", "<|never|>"]})
    model.resize_token_embeddings(len(tokenizer))  # the new rows at the mean of the old ones
    return model, tokenizer


class Texts(torch.utils.data.Dataset):
    """Sequences of words that each end with <|end|>: the token to learn. <|never|> appears nowhere."""

    def __init__(self, tokenizer, count=64):
        rng = np.random.default_rng(1)
        self.items = []
        for _ in range(count):
            text = " ".join(rng.choice(WORDS, 6)) + " <|end|>"
            ids = tokenizer(text)["input_ids"]
            self.items.append({"input_ids": torch.tensor(ids), "labels": torch.tensor(ids)})

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


@pytest.mark.slow
def test_the_trainer_callback_logs_the_added_tokens_and_writes_a_report_per_checkpoint(tmp_path):
    from auditor.integrations.transformers import REPORT_NAME, ArgmaxabilityCallback

    model, tokenizer = tiny_model_and_tokenizer()
    end, never = tokenizer.convert_tokens_to_ids(["<|end|>", "<|never|>"])
    before = auditor.audit_model(model, "added", tokenizer=tokenizer)
    assert {f.id: f.verdict for f in before.findings} == {end: "unargmaxable", never: "unargmaxable"}
    assert all(f.kind == "untrained" for f in before.findings) and before.exit_code == 1

    args = transformers.TrainingArguments(output_dir=str(tmp_path / "out"), per_device_train_batch_size=8,
                                          num_train_epochs=5, learning_rate=3e-3, save_steps=20, eval_steps=20,
                                          eval_strategy="steps", logging_steps=20, report_to=[], use_cpu=True,
                                          disable_tqdm=True)
    data = Texts(tokenizer)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data, eval_dataset=data,
                                   processing_class=tokenizer)
    trainer.add_callback(ArgmaxabilityCallback(trainer, tokens="added", stop_on_push=True))
    trainer.train()

    logged = [entry for entry in trainer.state.log_history if "argmaxability/unargmaxable" in entry]
    assert len(logged) >= 2
    assert logged[-1]["argmaxability/unargmaxable"] == 1  # <|never|> stays; <|end|> became argmaxable
    assert logged[-1]["argmaxability/never_emitted"] == 1
    checkpoints = sorted((tmp_path / "out").glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))
    assert len(checkpoints) >= 2
    for folder in checkpoints:
        report = json.loads((folder / REPORT_NAME).read_text(encoding="utf-8"))
        assert report["summary"]["n_tokens"] == len(tokenizer)
        # the head by its path in the model, and the checkpoint the report belongs to
        assert report["head"]["weight"] == "lm_head.weight" and report["head"]["path"] == str(folder)
        assert {f["id"] for f in report["findings"]} <= {end, never}
    last = json.loads((checkpoints[-1] / REPORT_NAME).read_text(encoding="utf-8"))
    assert {f["id"]: f["verdict"] for f in last["findings"]} == {never: "unargmaxable"}
    after = auditor.audit_model(model, "added", tokenizer=tokenizer)
    assert after.report.tokens[end].verdict == "argmaxable" and after.report.tokens[never].verdict == "unargmaxable"
    # the saved checkpoint, audited by the command, agrees with the live model
    assert auditor.audit_model(model, ["<|never|>"], tokenizer=tokenizer).findings[0].id == never


def test_audit_model_reads_the_live_head_and_refuses_what_it_cannot(tmp_path):
    model, tokenizer = tiny_model_and_tokenizer()
    result = auditor.audit_model(model, tokenizer=tokenizer)  # every token
    assert result.report.n_tokens == len(tokenizer)
    assert result.head.tied  # GPT-2 ties its head to the input embedding
    end = tokenizer.convert_tokens_to_ids("<|end|>")
    assert result.report.tokens[end].verdict == "unargmaxable"
    with pytest.raises(auditor.InputError, match="needs the tokenizer"):
        auditor.audit_model(model, "added")
    with pytest.raises(auditor.InputError, match="no output head"):
        auditor.audit_model(torch.nn.Linear(4, 4))
    with pytest.raises(auditor.InputError, match="sharded"):
        sharded = torch.nn.Linear(4, 10)
        sharded.weight = torch.nn.Parameter(torch.zeros(0))
        auditor.audit_model(None, head=sharded)


@pytest.mark.slow
def test_the_lightning_callback_logs_through_the_trainers_logger_and_fills_each_checkpoint(tmp_path, caplog):
    lightning = pytest.importorskip("lightning")
    from auditor.integrations.lightning import ArgmaxabilityCallback

    model, tokenizer = tiny_model_and_tokenizer()
    end, never = tokenizer.convert_tokens_to_ids(["<|end|>", "<|never|>"])

    class Module(lightning.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = model

        def training_step(self, batch, _):
            return self.model(**batch).loss

        def validation_step(self, batch, _):
            self.log("val_loss", self.model(**batch).loss)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=3e-3)

    loader = torch.utils.data.DataLoader(Texts(tokenizer), batch_size=8,
                                         collate_fn=lambda items: {k: torch.stack([i[k] for i in items]) for k in items[0]})
    sink = lightning.pytorch.loggers.CSVLogger(str(tmp_path), name="run")
    checkpoints = lightning.pytorch.callbacks.ModelCheckpoint(dirpath=str(tmp_path / "ckpt"), every_n_train_steps=20,
                                                              save_top_k=-1)
    trainer = lightning.Trainer(max_epochs=5, val_check_interval=4, logger=sink, enable_progress_bar=False,
                                callbacks=[ArgmaxabilityCallback(tokens="added", tokenizer=tokenizer), checkpoints],
                                accelerator="cpu", enable_model_summary=False, num_sanity_val_steps=0)
    with caplog.at_level("WARNING", logger="auditor.integrations.lightning"):
        trainer.fit(Module(), loader, loader)
    # without stop_at_end the run still ends saying which watched token it can never produce
    assert any("at the end of training" in r.getMessage() and "<|never|>" in r.getMessage() for r in caplog.records)

    sink.save()
    with open(f"{sink.log_dir}/metrics.csv", encoding="utf-8") as file:
        rows = [line.split(",") for line in file.read().splitlines()]
    header, rows = rows[0], rows[1:]
    column = header.index("argmaxability/unargmaxable")
    logged = [float(row[column]) for row in rows if row[column]]
    assert len(logged) >= 2 and logged[-1] == 1  # <|never|> stays; <|end|> became argmaxable
    saved = sorted((tmp_path / "ckpt").glob("*.ckpt"))
    assert saved
    for path in saved:
        document = torch.load(path, weights_only=False)["argmaxability"]
        assert {f["id"] for f in document["findings"]} <= {end, never}
    assert {f["id"] for f in torch.load(saved[-1], weights_only=False)["argmaxability"]["findings"]} == {never}


@pytest.mark.parametrize("name", ["transformers", "lightning"])
def test_a_missing_extra_is_named_in_one_message(name):
    import subprocess
    import sys

    code = (f"import sys; sys.modules[{name!r}] = None\n"  # as if it were not installed
            f"import auditor.integrations.{name}")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 1
    assert f"ImportError: auditor.integrations.{name} needs {name}: pip install 'auditor[{name}]'" in done.stderr


class _FakeHubApi:
    """What Trainer asks of the Hub when it pushes (create_repo, upload_folder), recorded and answered at once."""

    def __init__(self):
        self.uploads = []

    def create_repo(self, repo_id, **kwargs):
        return type("RepoUrl", (), {"repo_id": repo_id})()

    def upload_folder(self, **kwargs):
        from concurrent.futures import Future

        self.uploads.append(kwargs["commit_message"])
        done = Future()
        done.set_result(None)
        return done if kwargs.get("run_as_future") else None


def pushing_trainer(tmp_path, monkeypatch):
    """A Trainer with push_to_hub=True and hub_strategy="every_save" (a push at each of its saves, every 8 steps
    of 24), the Hub faked, and the callback watching the added tokens: (trainer, the fake Hub)."""
    import transformers.trainer

    from auditor.integrations.transformers import ArgmaxabilityCallback

    hub = _FakeHubApi()
    monkeypatch.setattr(transformers.trainer, "hf_api", lambda: hub)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model, tokenizer = tiny_model_and_tokenizer()
    args = transformers.TrainingArguments(output_dir=str(tmp_path / "out"), per_device_train_batch_size=8,
                                          num_train_epochs=3, learning_rate=3e-3, save_steps=8, report_to=[],
                                          use_cpu=True, disable_tqdm=True, push_to_hub=True,
                                          hub_model_id="org/tiny", hub_strategy="every_save")
    trainer = transformers.Trainer(model=model, args=args, train_dataset=Texts(tokenizer), processing_class=tokenizer)
    trainer.add_callback(ArgmaxabilityCallback(trainer, tokens="added"))
    return trainer, hub


@pytest.mark.slow
def test_checkpoint_pushes_warn_and_only_the_final_push_is_gated(tmp_path, monkeypatch, caplog):
    """push_to_hub=True with hub_strategy="every_save": the Trainer pushes at every checkpoint. Those pushes warn
    while <|never|> cannot win; training runs to its end and says so; the final push_to_hub() raises."""
    from auditor.integrations.model import UnproducibleTokensError

    trainer, hub = pushing_trainer(tmp_path, monkeypatch)
    with caplog.at_level("WARNING", logger="auditor.integrations.transformers"):
        trainer.train()  # completes: checkpoint pushes do not stop it
    checkpoint_pushes = [message for message in hub.uploads if message.startswith("Training in progress")]
    assert len(checkpoint_pushes) >= 2 and trainer.state.global_step == 24
    warnings = [record.getMessage() for record in caplog.records]
    assert sum("at the checkpoint push of step" in message and "<|never|>" in message for message in warnings) >= 2
    assert any("at the end of training" in message and "<|never|>" in message for message in warnings)
    assert not any("stopped" in message for message in warnings)
    uploads = len(hub.uploads)
    with pytest.raises(UnproducibleTokensError, match="stopped before the push to the Hub.*<\\|never\\|>"):
        trainer.push_to_hub()
    assert len(hub.uploads) == uploads  # nothing was pushed


@pytest.mark.slow
def test_a_push_after_an_interrupted_run_is_still_gated(tmp_path, monkeypatch):
    """Training stopped by an error after a checkpoint: the push the user makes next is the final one."""
    from auditor.integrations.model import UnproducibleTokensError

    class Interrupt(transformers.TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 10:
                raise KeyboardInterrupt

    trainer, hub = pushing_trainer(tmp_path, monkeypatch)
    trainer.add_callback(Interrupt())
    with pytest.raises(KeyboardInterrupt):
        trainer.train()
    uploads = len(hub.uploads)
    with pytest.raises(UnproducibleTokensError, match="stopped before the push to the Hub"):
        trainer.push_to_hub()
    assert len(hub.uploads) == uploads
