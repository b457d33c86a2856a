"""``ArgmaxabilityCallback`` for Lightning (``pip install 'auditor[lightning]'``).

    from auditor.integrations.lightning import ArgmaxabilityCallback
    trainer = lightning.Trainer(callbacks=[ArgmaxabilityCallback(tokens="added", tokenizer=tokenizer)])

After each validation it audits the live output head of the module (``get_output_embeddings()`` on the
LightningModule, or on its ``model`` attribute, as a transformers model wrapped in a LightningModule has
it; or the module ``head`` names) for the watched tokens, under torch.no_grad on the device of the weights,
and logs ``argmaxability/unargmaxable``, ``argmaxability/never_emitted`` and ``argmaxability/min_margin``
through ``trainer.logger`` (``LightningModule.log`` is refused in these hooks). Each checkpoint Lightning
saves carries the latest JSON report under the key ``"argmaxability"``. At the end of training it names the
watched tokens that cannot be produced: in a warning, or, when ``stop_at_end``, by raising
``UnproducibleTokensError``.
Only the global rank 0 audits.
"""

from __future__ import annotations

import json
import logging

try:
    import lightning
except ImportError:  # the extra is not installed: say which one
    raise ImportError("auditor.integrations.lightning needs lightning: pip install 'auditor[lightning]'") from None

from auditor.errors import InputError
from auditor.formats import FORMATS
from auditor.integrations.model import UnproducibleTokensError, audit_model, metrics, unproducible_message

logger = logging.getLogger(__name__)


class ArgmaxabilityCallback(lightning.Callback):
    """Audit the watched tokens after each validation (module docstring). ``tokens``: ``"added"`` (needs
    ``tokenizer``), ids and token strings, or None for every token; ``head``: the output head module when
    the LightningModule does not answer ``get_output_embeddings()``."""

    def __init__(self, tokens="added", *, tokenizer=None, head=None, stop_at_end: bool = False,
                 domain: str = "unbounded"):
        self.tokens, self.tokenizer, self.head = tokens, tokenizer, head
        self.stop_at_end, self.domain = stop_at_end, domain
        self.last = None
        self._warned = False

    def _model(self, pl_module):
        if callable(getattr(pl_module, "get_output_embeddings", None)):
            return pl_module
        inner = getattr(pl_module, "model", None)
        return inner if callable(getattr(inner, "get_output_embeddings", None)) else pl_module

    def _audit(self, trainer, pl_module):
        if trainer.global_rank != 0 or trainer.sanity_checking:
            return None
        try:
            result = audit_model(self._model(pl_module), self.tokens, tokenizer=self.tokenizer, head=self.head,
                                 domain=self.domain)
        except InputError as error:
            if not self._warned:
                logger.warning("argmaxability: %s", error)
                self._warned = True
            return None
        self.last = result
        for sink in trainer.loggers:
            sink.log_metrics(metrics(result), step=trainer.global_step)
        return result

    def on_validation_end(self, trainer, pl_module):
        self._audit(trainer, pl_module)

    def on_save_checkpoint(self, trainer, pl_module, checkpoint):
        if self.last is not None:
            checkpoint["argmaxability"] = json.loads(FORMATS["json"](self.last))

    def on_train_end(self, trainer, pl_module):
        # said whatever stop_at_end is: a run that ends with watched tokens it can never produce should not end
        # silently
        result = self._audit(trainer, pl_module)
        if result is None or not result.failing:
            return
        if self.stop_at_end:
            raise UnproducibleTokensError(unproducible_message(result, "at the end of training"))
        logger.warning(unproducible_message(result, "at the end of training", stopped=False))
