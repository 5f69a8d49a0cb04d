"""tessera.data: token files (llm.c's layout), tokenizers, the DataLoader of token windows, and
datasets of labelled examples with their samplers, collators and ExampleLoader."""
from collections.abc import Mapping

from ._tessera.data import (  # noqa: F401
    Tokenizer, ByteTokenizer, BpeTokenizer, WordPieceTokenizer, load_tokenizer, TokenFile,
    write_token_file, DataLoader, ExampleDataset, DistributedSampler, EvalSampler,
    seeded_permutation, DataCollatorWithPadding, DataCollatorForLanguageModeling, build_wordpiece_vocab,
)


class _Columns:
    """A dict of equally long columns (lists or NumPy arrays) seen as rows of dicts."""

    def __init__(self, columns):
        lengths = {key: len(column) for key, column in columns.items()}
        if not lengths:
            raise ValueError("dataset: the dict has no columns")
        if len(set(lengths.values())) != 1:
            raise ValueError(f"dataset: columns of different lengths {lengths}")
        self._columns = columns
        self._length = next(iter(lengths.values()))

    def __len__(self):
        return self._length

    def __getitem__(self, i):
        return {key: column[i] for key, column in self._columns.items()}


def _rows(dataset):
    if isinstance(dataset, Mapping):
        return _Columns(dataset)
    if not (hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__")):
        raise TypeError("dataset: a dict of columns, or an object with __len__ and __getitem__ "
                        f"returning dicts, not {type(dataset).__name__}")
    return dataset


class ExampleLoader:
    """PyTorch's DataLoader over labelled examples: batches of `batch_size` rows through
    `collate_fn` (e.g. DataCollatorWithPadding). The dataset is an ExampleDataset, a dict of
    columns (lists or NumPy arrays) or anything with __len__ and __getitem__ giving dicts
    (a Hugging Face datasets.Dataset does).

    Training (evaluation=False): torch's DistributedSampler order over `world_size` ranks
    (shuffle with seed + epoch; call set_epoch(e) each epoch), drop_last as PyTorch's
    sampler and loader have it, group_by_length as Hugging Face's LengthGroupedSampler.
    Evaluation: dataset order, every rank the same number of full batches, the padding rows
    of the last round repeating the dataset's start; batch_info(k) says how many rows of a
    batch are real, which is what gather_for_metrics keeps.
    """

    def __init__(self, dataset, batch_size=8, *, collate_fn, shuffle=False, seed=0,
                 drop_last=False, group_by_length=False, rank=0, world_size=1, evaluation=False):
        self.dataset = _rows(dataset)
        if len(self.dataset) == 0:
            raise ValueError("ExampleLoader: the dataset is empty")
        if batch_size < 1:
            raise ValueError(f"ExampleLoader: batch_size {batch_size} must be at least 1")
        if collate_fn is None or not callable(collate_fn):
            raise ValueError("ExampleLoader: collate_fn must be a collator "
                             "(e.g. DataCollatorWithPadding(tokenizer))")
        if evaluation and (shuffle or drop_last or group_by_length):
            raise ValueError("ExampleLoader: evaluation keeps every example once in dataset "
                             "order; shuffle, drop_last and group_by_length are for training")
        self.batch_size, self.collate_fn, self.drop_last = batch_size, collate_fn, drop_last
        self.evaluation = evaluation
        n = len(self.dataset)
        if evaluation:
            self._eval = EvalSampler(n, batch_size, rank=rank, num_replicas=world_size)
            return
        lengths = None
        if group_by_length:
            lengths = (self.dataset.lengths() if hasattr(self.dataset, "lengths")
                       else [len(self.dataset[i]["input_ids"]) for i in range(n)])
        self._sampler = DistributedSampler(n, num_replicas=world_size, rank=rank,
                                           shuffle=shuffle, seed=seed, drop_last=drop_last,
                                           lengths=lengths, batch_size=batch_size)
        self.set_epoch(0)

    def set_epoch(self, epoch):
        if not self.evaluation:
            self._sampler.set_epoch(epoch)
            self._indices = self._sampler.indices()

    def __len__(self):
        if self.evaluation:
            return len(self._eval)
        n, b = len(self._indices), self.batch_size
        return n // b if self.drop_last else (n + b - 1) // b

    def batch_info(self, k):
        """(dataset indices, how many of them are real) of batch k of this epoch."""
        if not 0 <= k < len(self):
            raise IndexError(f"ExampleLoader: batch {k} is outside [0, {len(self)})")
        if self.evaluation:
            return self._eval.batch(k)
        indices = self._indices[k * self.batch_size:(k + 1) * self.batch_size]
        return indices, len(indices)

    def __iter__(self):
        for k in range(len(self)):
            indices, _ = self.batch_info(k)
            yield self.collate_fn([self.dataset[i] for i in indices])
