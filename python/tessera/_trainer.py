"""tessera.Trainer: transformers' Trainer signature over the C++ train::Trainer."""
from __future__ import annotations

from . import _tessera as _C
from .state import PartialState


class Trainer(_C._Trainer):
    """transformers' Trainer(model, args, data_collator, train_dataset, eval_dataset, ...).

    model is a tessera.nn.GPT and the datasets are token files (tessera.data.TokenFile or a
    path); callbacks are transformers-style objects with any of on_log(logs),
    on_evaluate(metrics), on_save(path), on_step_end(state) (returning True stops training),
    or tessera.EarlyStoppingCallback.
    """

    def __init__(self, model=None, args=None, data_collator=None, train_dataset=None, eval_dataset=None,
                 tokenizer=None, model_init=None, compute_metrics=None, callbacks=None, optimizers=(None, None),
                 preprocess_logits_for_metrics=None, processing_class=None):
        if isinstance(model, _C.TrainingArguments):
            raise TypeError("Trainer: the first argument is the model; transformers' order is "
                            "Trainer(model, args, data_collator, train_dataset, eval_dataset, ...)")
        if model is None and model_init is not None:
            model = model_init()
        if model is None:
            raise ValueError("Trainer: `Trainer` requires either a `model` or `model_init` argument")
        if args is None:
            args = _C.TrainingArguments(output_dir="tmp_trainer")  # transformers' default
        if tuple(optimizers) != (None, None):
            raise ValueError("Trainer: optimizers are built from args (optim, learning_rate, lr_scheduler_type); "
                             "passing (optimizer, scheduler) is not supported")
        unsupported = {"data_collator": data_collator, "tokenizer": tokenizer, "processing_class": processing_class,
                       "compute_metrics": compute_metrics,
                       "preprocess_logits_for_metrics": preprocess_logits_for_metrics}
        given = [name for name, value in unsupported.items() if value is not None]
        if given:
            raise ValueError(f"Trainer: {', '.join(given)} apply to datasets of examples; a causal language "
                             "model trains on token files, which need none of them")
        if train_dataset is None:
            raise ValueError("Trainer: train_dataset is required (a tessera.data.TokenFile or its path)")
        PartialState()  # the shared process group, so this Trainer does not own (and end) it
        super().__init__(model, args, train_dataset, eval_dataset)
        for callback in callbacks or []:
            self.add_callback(callback)
