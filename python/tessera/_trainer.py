"""tessera.Trainer: transformers' Trainer signature over the C++ train::Trainer."""
from __future__ import annotations

from typing import NamedTuple, Optional

from . import _tessera as _C
from .state import PartialState


class EvalPrediction:
    """transformers' EvalPrediction: predictions (logits [N, num_labels]) and label_ids [N] as
    NumPy arrays of the whole evaluation set in dataset order; ``logits, labels = eval_pred``."""

    def __init__(self, predictions, label_ids):
        self.predictions, self.label_ids = predictions, label_ids

    def __iter__(self):
        return iter((self.predictions, self.label_ids))

    def __getitem__(self, i):
        return (self.predictions, self.label_ids)[i]

    def __len__(self):
        return 2


class PredictionOutput(NamedTuple):
    """transformers' PredictionOutput of Trainer.predict (metrics named test_*)."""
    predictions: object
    label_ids: Optional[object]
    metrics: Optional[dict]


class Trainer(_C._Trainer):
    """transformers' Trainer(model, args, data_collator, train_dataset, eval_dataset, tokenizer,
    model_init, compute_metrics, callbacks, ...).

    The model picks the task. A causal language model (tessera.nn.GPT, Llama) trains on token
    files (tessera.data.TokenFile or a path). A sequence classifier (BertForSequenceClassification,
    AutoModelForSequenceClassification.from_pretrained(...)) trains on tessera.data.ExampleDataset
    rows batched by data_collator (default: DataCollatorWithPadding(tokenizer)), and
    compute_metrics(EvalPrediction) -> dict names the evaluation's metrics (eval_<name>);
    without it accuracy, f1, precision and recall are reported. Callbacks are
    tessera.EarlyStoppingCallback or objects with any of on_log(logs), on_evaluate(metrics),
    on_save(path), on_step_end(state) (returning True stops training).
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
        if preprocess_logits_for_metrics is not None:
            raise ValueError("Trainer: preprocess_logits_for_metrics is not supported (compute_metrics gets the "
                             "logits)")
        if train_dataset is None:
            raise ValueError("Trainer: train_dataset is required")
        tokenizer = tokenizer if tokenizer is not None else processing_class
        classifier = isinstance(model, _C.nn.SequenceClassifier)
        if classifier and data_collator is None:
            if tokenizer is None:
                raise ValueError("Trainer: a sequence classifier needs data_collator or tokenizer (its pad token "
                                 "pads the batches, as DataCollatorWithPadding(tokenizer))")
            data_collator = _C.data.DataCollatorWithPadding(tokenizer)
        if not classifier:
            given = [name for name, value in (("data_collator", data_collator), ("compute_metrics", compute_metrics))
                     if value is not None]
            if given:
                raise ValueError(f"Trainer: {', '.join(given)} apply to a sequence classifier's examples; a causal "
                                 "language model trains on token files")
        self.tokenizer = self.processing_class = tokenizer
        PartialState()  # the shared process group, so this Trainer does not own (and end) it
        super().__init__(model, args, train_dataset, eval_dataset, data_collator, compute_metrics)
        for callback in callbacks or []:
            self.add_callback(callback)

    def predict(self, test_dataset, ignore_keys=None, metric_key_prefix="test"):
        """Logits and labels of test_dataset in its order, with metrics named test_*."""
        if ignore_keys is not None or metric_key_prefix != "test":
            raise ValueError("Trainer.predict: ignore_keys and metric_key_prefix other than 'test' are not supported")
        predictions, label_ids, metrics = self._predict(test_dataset)
        return PredictionOutput(predictions, label_ids, metrics)
