"""``ArgmaxabilityCallback``: the audit inside a transformers Trainer (``pip install 'auditor[transformers]'``).

    from auditor.integrations.transformers import ArgmaxabilityCallback
    trainer = Trainer(model=model, args=args, train_dataset=data, processing_class=tokenizer)
    trainer.add_callback(ArgmaxabilityCallback(trainer, tokens="added"))

At evaluation and at each save it audits the live output head (``get_output_embeddings()``: tied or not,
PEFT's active copy through the wrapper) for the watched tokens, under torch.no_grad on the device of the
weights. It logs ``argmaxability/unargmaxable`` and ``argmaxability/never_emitted`` (how many watched
tokens cannot win, and how many greedy decoding never produces) and ``argmaxability/min_margin`` (the
smallest lead of a watched token, 0 while one cannot win) through ``trainer.log``, so they reach
TensorBoard, W&B or whatever the Trainer reports to; given no trainer it appends them to
``state.log_history``. At a save it writes the JSON report, as ``audit --format json`` writes it, into the
checkpoint folder (``checkpoint-N/argmaxability.json``).

The gate is every push but a checkpoint's: ``trainer.push_to_hub()`` (also through ``save_model`` with
``push_to_hub=True``, and after an interrupted run) raises ``UnproducibleTokensError`` naming the watched
tokens that cannot be produced. The pushes the Trainer makes as it saves its checkpoints during training
(``hub_strategy`` ``every_save``, ``checkpoint``, ``all_checkpoints``) only warn: a token that cannot win yet
at step 10 may win by step 30. At the end of training it says what it found, in a warning when a watched
token cannot be produced, and raises only when ``stop_at_end``. Under DDP only the main process audits and
writes; a head sharded by FSDP or ZeRO-3 is reported in one warning, once, with what to do instead.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

try:
    from transformers import TrainerCallback
except ImportError:  # the extra is not installed: say which one
    raise ImportError("auditor.integrations.transformers needs transformers: pip install 'auditor[transformers]'") from None

from auditor.errors import InputError
from auditor.formats import FORMATS
from auditor.integrations.model import UnproducibleTokensError, audit_model, metrics, unproducible_message

logger = logging.getLogger(__name__)

REPORT_NAME = "argmaxability.json"


class ArgmaxabilityCallback(TrainerCallback):
    """Audit the watched tokens of the live output head at evaluation and save events (module docstring).

    ``trainer``: the Trainer whose ``log`` the metrics go through (None: ``state.log_history`` only).
    ``tokens``: ``"added"`` (the ids past the tokenizer model's own vocabulary; needs the Trainer's
    ``processing_class``), ids and token strings, or None for every token. ``stop_on_push`` and
    ``stop_at_end`` say where a watched token that cannot be produced stops the run."""

    def __init__(self, trainer=None, tokens="added", *, stop_on_push: bool = True, stop_at_end: bool = False,
                 domain: str = "unbounded", report_name: str = REPORT_NAME):
        self.trainer = trainer
        self.tokens = tokens
        self.stop_on_push, self.stop_at_end = stop_on_push, stop_at_end
        self.domain, self.report_name = domain, report_name
        self.last = None  # the latest GateResult
        self._step = None  # the step self.last was audited at
        self._warned = False
        # A push is a checkpoint's when the Trainer makes it while it saves a checkpoint: between the end of a step
        # (or epoch) that asks for a save and on_save, which the Trainer calls right after the checkpoint's push.
        # Any other push (trainer.push_to_hub(), also after an interrupted run) is gated.
        self._saving = False

    def _audit(self, state, model, processing_class):
        if not state.is_world_process_zero or model is None:
            return None
        if self._step == state.global_step and self.last is not None:
            return self.last  # evaluation and save at one step: one audit
        try:
            result = audit_model(model, self.tokens, tokenizer=processing_class, domain=self.domain)
        except InputError as error:
            if not self._warned:
                logger.warning("argmaxability: %s", error)
                self._warned = True
            return None
        self.last, self._step = result, state.global_step
        self._log(state, metrics(result))
        return result

    def _log(self, state, values: dict) -> None:
        if self.trainer is not None:
            self.trainer.log(dict(values))
        else:
            state.log_history.append({**values, "step": state.global_step})

    def on_evaluate(self, args, state, control, model=None, processing_class=None, **kwargs):
        self._audit(state, model, processing_class)

    def on_save(self, args, state, control, model=None, processing_class=None, **kwargs):
        self._saving = False
        result = self._audit(state, model, processing_class)
        if result is None:
            return
        folder = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
        if os.path.isdir(folder):
            result.head.path = Path(folder)  # the report names the checkpoint it belongs to
            with open(os.path.join(folder, self.report_name), "w", encoding="utf-8") as file:
                file.write(FORMATS["json"](result))

    def on_step_end(self, args, state, control, **kwargs):
        self._saving = bool(control.should_save)  # the flow callbacks, called first, have decided

    on_epoch_end = on_step_end

    def on_push_begin(self, args, state, control, model=None, processing_class=None, **kwargs):
        if self._saving:  # a checkpoint's push: the run goes on, and the tokens may yet learn to win
            self._saving = False
            self._check(state, model, processing_class, f"at the checkpoint push of step {state.global_step}",
                        stop=False)
        elif self.stop_on_push:
            self._check(state, model, processing_class, "before the push to the Hub", stop=True)

    def on_train_end(self, args, state, control, model=None, processing_class=None, **kwargs):
        self._saving = False
        self._check(state, model, processing_class, "at the end of training", stop=self.stop_at_end)

    def _check(self, state, model, processing_class, where: str, stop: bool) -> None:
        """Audit the weights as they are now; with findings that fail, raise (``stop``) or warn."""
        self._step = None  # the weights may have changed since the last audit
        result = self._audit(state, model, processing_class)
        if result is None or not result.failing:
            return
        if stop:
            raise UnproducibleTokensError(unproducible_message(result, where))
        logger.warning(unproducible_message(result, where, stopped=False))
