"""Accelerator.save_model: a model's state_dict as safetensors, sharded as transformers shards
(model-00001-of-00003.safetensors ... and model.safetensors.index.json)."""
from __future__ import annotations

import json
import os

from . import _tessera as _C
from .utils import convert_file_size_to_int

_BYTES_PER_ELEMENT = {"float64": 8, "int64": 8, "float32": 4, "int32": 4, "float16": 2, "bfloat16": 2,
                      "uint8": 1, "bool": 1}


def _nbytes(tensor):
    name = str(tensor.dtype).replace("tessera.", "")
    numel = 1
    for size in tensor.shape:
        numel *= size
    return numel * _BYTES_PER_ELEMENT.get(name, 4)


def _shards(state, limit):
    """Consecutive groups of (name, tensor) of at most `limit` bytes (a larger tensor alone)."""
    shards, current, size = [], [], 0
    for name, tensor in state:
        n = _nbytes(tensor)
        if current and size + n > limit:
            shards.append(current)
            current, size = [], 0
        current.append((name, tensor))
        size += n
    if current:
        shards.append(current)
    return shards


def save_model(accelerator, model, save_directory, max_shard_size="10GB", safe_serialization=True):
    if not safe_serialization:
        raise ValueError("save_model: safe_serialization=False (pytorch_model.bin) is not supported; "
                         "Tessera writes safetensors")
    if os.path.isfile(save_directory):
        raise ValueError(f"save_model: save_directory {save_directory} is a file, not a directory")
    limit = convert_file_size_to_int(max_shard_size)
    # Every process: under ZeRO-3 this gathers the parameters.
    state = sorted(accelerator.get_state_dict(model).items())
    if accelerator.is_main_process:
        os.makedirs(save_directory, exist_ok=True)
        shards = _shards(state, limit)
        metadata = {"format": "pt"}
        if len(shards) == 1:
            _C._save_safetensors(os.path.join(save_directory, "model.safetensors"), shards[0], metadata)
        else:
            weight_map = {}
            for i, shard in enumerate(shards):
                file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
                _C._save_safetensors(os.path.join(save_directory, file), shard, metadata)
                weight_map.update({name: file for name, _ in shard})
            index = {"metadata": {"total_size": sum(_nbytes(t) for _, t in state)}, "weight_map": weight_map}
            with open(os.path.join(save_directory, "model.safetensors.index.json"), "w") as f:
                json.dump(index, f, indent=2, sort_keys=True)
    accelerator.wait_for_everyone()
