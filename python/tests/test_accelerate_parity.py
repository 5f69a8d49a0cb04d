"""The Python API against Accelerate's and transformers' behaviour: each fixed bug has a test
named after the behaviour; the Accelerate methods run as one process and as two."""
import os
import sys
import pathlib

import numpy as np
import pytest

import tessera
from tessera import nn, data
from conftest import launch, run

HERE = pathlib.Path(__file__).parent
RNG = np.random.default_rng(7)


def tiny_gpt(**overrides):
    settings = dict(vocab_size=64, block_size=8, n_layer=1, n_head=2, n_embd=16)
    settings.update(overrides)
    return nn.GPT(nn.GPTConfig(**settings))


@pytest.fixture
def token_file(tmp_path):
    path = tmp_path / "tokens.bin"
    data.write_token_file(str(path), RNG.integers(0, 64, 3001), vocab_size=64)
    return str(path)


# ---- the process group is shared ----
def test_a_second_accelerator_keeps_working_after_the_first_is_dropped():
    first = tessera.Accelerator(cpu=True)
    second = tessera.Accelerator(cpu=True)
    del first
    second.wait_for_everyone()
    assert list(second.gather(tessera.ones(2)).shape) == [2]
    third = tessera.Accelerator(cpu=True)  # after end_training too
    second.end_training()
    tessera.Accelerator(cpu=True).wait_for_everyone()
    del third


def test_a_trainer_after_another_trainer_and_an_accelerator_keeps_working(token_file, tmp_path):
    acc = tessera.Accelerator(cpu=True)
    for i in range(2):
        args = tessera.TrainingArguments(output_dir=str(tmp_path / f"run{i}"), max_steps=1,
                                         per_device_train_batch_size=2, seq=8, report_to=[], save_strategy="no")
        trainer = tessera.Trainer(model=tiny_gpt(), args=args, train_dataset=token_file)
        trainer.train()
        assert trainer.state["global_step"] == 1
        del trainer
    acc.wait_for_everyone()


# ---- Trainer arguments that used to be accepted and ignored ----
def test_report_to_an_unavailable_tracker_is_refused_before_training(tmp_path):
    with pytest.raises(ValueError, match="report_to.*wandb"):
        tessera.TrainingArguments(output_dir=str(tmp_path), report_to=["wandb"])


def test_report_to_jsonl_writes_the_metrics_file(token_file, tmp_path):
    args = tessera.TrainingArguments(output_dir=str(tmp_path / "run"), max_steps=2, per_device_train_batch_size=2,
                                     seq=8, report_to=["jsonl"], logging_steps=1, save_strategy="no")
    tessera.Trainer(model=tiny_gpt(), args=args, train_dataset=token_file).train()
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert len([line for line in lines if '"loss"' in line]) == 2


def test_early_stopping_patience_stops_a_run_whose_eval_loss_does_not_improve(token_file, tmp_path):
    # No step improves the evaluation loss by the threshold (1 nat), so the run stops after 1 + patience
    # evaluations.
    common = dict(max_steps=20, per_device_train_batch_size=2, seq=8, report_to=[], learning_rate=1e-4,
                  eval_strategy="steps", eval_steps=1, save_strategy="no", eval_batches=1)
    args = tessera.TrainingArguments(output_dir=str(tmp_path / "a"), early_stopping_patience=2,
                                     early_stopping_threshold=1.0, **common)
    trainer = tessera.Trainer(model=tiny_gpt(), args=args, train_dataset=token_file, eval_dataset=token_file)
    trainer.train()
    assert trainer.state["global_step"] == 3
    # transformers' way: the callback object.
    args = tessera.TrainingArguments(output_dir=str(tmp_path / "b"), **common)
    trainer = tessera.Trainer(model=tiny_gpt(), args=args, train_dataset=token_file, eval_dataset=token_file,
                              callbacks=[tessera.EarlyStoppingCallback(early_stopping_patience=3,
                                                                                   early_stopping_threshold=1.0)])
    trainer.train()
    assert trainer.state["global_step"] == 4


def test_trainer_takes_hugging_faces_argument_order(token_file, tmp_path):
    args = tessera.TrainingArguments(output_dir=str(tmp_path), max_steps=1, per_device_train_batch_size=2, seq=8,
                                     report_to=[], save_strategy="no")
    trainer = tessera.Trainer(tiny_gpt(), args, None, token_file)  # model, args, data_collator, train_dataset
    trainer.train()
    assert trainer.state["global_step"] == 1
    with pytest.raises(TypeError, match="first argument is the model"):
        tessera.Trainer(args, tiny_gpt())


# ---- the DataLoader has epochs ----
def test_dataloader_len_is_the_epoch_and_every_epoch_yields_it(token_file):
    loader = data.DataLoader(data.TokenFile(token_file), batch_size=2, seq_len=8, max_batches=3)
    assert len(loader) == 3
    first = [np.asarray(x) for x, _ in loader]
    assert len(loader) == 3 and loader.epoch == 1
    second = [np.asarray(x) for x, _ in loader]
    assert len(first) == len(second) == 3
    # The stream continues: epoch 1 is batches 3..5.
    np.testing.assert_array_equal(second[0], np.asarray(loader.batch_at(3)[0]))
    loader.set_epoch(0)
    np.testing.assert_array_equal(np.asarray(next(iter(loader))[0]), first[0])


def test_skip_first_batches_skips_within_the_current_epoch(token_file):
    loader = data.DataLoader(data.TokenFile(token_file), batch_size=2, seq_len=8, max_batches=4)
    acc = tessera.Accelerator(cpu=True)
    acc.prepare(loader)
    list(loader)  # epoch 0
    skipped = acc.skip_first_batches(loader, 3)
    batches = [np.asarray(x) for x, _ in skipped]
    assert len(batches) == 1
    np.testing.assert_array_equal(batches[0], np.asarray(loader.batch_at(7)[0]))
    with pytest.raises(ValueError, match="not below"):
        acc.skip_first_batches(loader, 4)


# ---- from_pretrained is in evaluation mode ----
def test_from_pretrained_returns_a_model_in_eval_mode(tmp_path):
    model = tiny_gpt(dropout=0.5)
    assert model.training
    model.save_pretrained(str(tmp_path / "gpt"))
    loaded = nn.GPT.from_pretrained(str(tmp_path / "gpt"))
    assert not loaded.training
    idx = tessera.tensor([[1, 2, 3, 4]])
    np.testing.assert_array_equal(np.asarray(loaded(idx)), np.asarray(loaded(idx)))  # no dropout


# ---- Accelerate's shapes of arguments ----
def test_split_between_processes_splits_each_value_of_a_dict():
    acc = tessera.Accelerator(cpu=True)
    inputs = {"prompt": ["a", "b", "c"], "ids": [1, 2, 3]}
    with acc.split_between_processes(inputs) as share:
        assert share == inputs  # one process: everything
    with pytest.raises(ValueError, match="different lengths"):
        with acc.split_between_processes({"a": [1], "b": [1, 2]}):
            pass
    with tessera.PartialState().split_between_processes(("x", "y")) as share:
        assert share == ("x", "y")


def test_gather_takes_nested_lists_tuples_and_dicts_of_tensors():
    acc = tessera.Accelerator(cpu=True)
    out = acc.gather({"a": tessera.ones(2), "b": (tessera.zeros(1), [tessera.full([3], 2.0)])})
    assert isinstance(out["b"], tuple) and isinstance(out["b"][1], list)
    assert np.asarray(out["b"][1][0]).tolist() == [2.0, 2.0, 2.0]
    with pytest.raises(TypeError, match="Unsupported type str"):
        acc.gather(["text"])
    assert acc.gather_for_metrics(["a", "b"]) == ["a", "b"]  # objects: gather_object


def test_a_wrong_keyword_is_a_type_error_naming_it(token_file):
    with pytest.raises(TypeError, match="unexpected keyword argument 'batch_sise'"):
        data.DataLoader(data.TokenFile(token_file), batch_sise=2, seq_len=8)
    with pytest.raises(TypeError, match="missing required argument 'seq_len'"):
        data.DataLoader(data.TokenFile(token_file), batch_size=2)
    with pytest.raises(TypeError, match="unexpected keyword argument 'n_layers'"):
        nn.GPTConfig(n_layers=2)
    with pytest.raises(TypeError, match="unexpected keyword argument 'learning_rate'"):
        tessera.optim.AdamW(tiny_gpt().parameters(), learning_rate=1e-3)
    with pytest.raises(TypeError, match="unexpected keyword argument 'gradient_accumulation'"):
        tessera.Accelerator(gradient_accumulation=2)


def test_a_bad_mixed_precision_is_a_value_error():
    with pytest.raises(ValueError, match="Unknown mixed_precision mode: fp17"):
        tessera.Accelerator(mixed_precision="fp17")


# ---- the methods that were missing ----
def test_accelerate_methods_on_one_process(tmp_path):
    out = run([sys.executable, str(HERE / "parity_job.py"), str(tmp_path)])
    assert "parity checks passed on 1 process(es)" in out


def test_accelerate_methods_on_two_processes(tmp_path):
    out = launch(2, str(HERE / "parity_job.py"), str(tmp_path))
    assert "parity checks passed on 2 process(es)" in out


def test_notebook_launcher_starts_processes_that_meet(tmp_path):
    result = tmp_path / "ranks.txt"
    out = run([sys.executable, str(HERE / "notebook_job.py"), str(result)])
    assert "launched" in out and result.read_text().strip() == "2 [0, 1]"


def test_notebook_launcher_refuses_after_an_accelerator_exists():
    tessera.Accelerator(cpu=True)
    with pytest.raises(ValueError, match="inside your training function"):
        tessera.notebook_launcher(lambda: None, num_processes=2)


def test_partial_state_is_shared_and_knows_the_process():
    a, b = tessera.PartialState(), tessera.PartialState()
    assert a.process_index == b.process_index == 0 and a.num_processes == 1 and a.is_main_process
    assert a.distributed_type == "NO" and str(a.device) == "cpu"
    calls = []
    a.on_local_main_process(lambda: calls.append(1))()
    with a.main_process_first():
        calls.append(2)
    assert calls == [1, 2]


def test_find_executable_batch_size_halves_after_out_of_memory():
    tried = []

    @tessera.find_executable_batch_size(starting_batch_size=64)
    def train(batch_size, scale):
        tried.append(batch_size)
        if batch_size > 8:
            raise MemoryError("CUDA out of memory (simulated)")
        return batch_size * scale

    assert train(3) == 24 and tried == [64, 32, 16, 8]
    with pytest.raises(TypeError, match="Batch size was passed"):
        train(4, 3)

    @tessera.find_executable_batch_size(starting_batch_size=2)
    def never_fits(batch_size):
        raise MemoryError("out of memory")

    with pytest.raises(RuntimeError, match="No executable batch size found, reached zero"):
        never_fits()

    @tessera.find_executable_batch_size(starting_batch_size=4)
    def other_error(batch_size):
        raise KeyError("not memory")

    with pytest.raises(KeyError):
        other_error()


def test_autocast_runs_matmuls_in_bf16_only_inside_the_block():
    acc = tessera.Accelerator(mixed_precision="bf16", cpu=True)
    a, b = tessera.randn(4, 8), tessera.randn(8, 3)
    with acc.autocast():
        inside = tessera.matmul(a, b)
    outside = tessera.matmul(a, b)
    assert inside.dtype == tessera.bfloat16 and outside.dtype == tessera.float32
    np.testing.assert_allclose(np.asarray(inside.float()), np.asarray(a) @ np.asarray(b), rtol=0.05, atol=0.05)
    with tessera.Accelerator(cpu=True).autocast():  # "no": nothing changes
        assert tessera.matmul(a, b).dtype == tessera.float32


def test_save_model_shards_as_transformers_does(tmp_path):
    acc = tessera.Accelerator(cpu=True)
    model = tiny_gpt()
    acc.prepare(model)
    acc.save_model(model, str(tmp_path / "one"))
    from conftest import read_safetensors
    whole = read_safetensors(tmp_path / "one" / "model.safetensors")
    state = model.state_dict()
    assert sorted(whole) == sorted(state)
    for name, tensor in state.items():
        np.testing.assert_array_equal(whole[name], np.asarray(tensor))
    acc.save_model(model, str(tmp_path / "shards"), max_shard_size="8KB")
    import json
    index = json.loads((tmp_path / "shards" / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    merged = {}
    for f in files:
        merged.update(read_safetensors(tmp_path / "shards" / f))
    assert sorted(merged) == sorted(state)
    with pytest.raises(ValueError, match="not in a valid format"):
        acc.save_model(model, str(tmp_path / "bad"), max_shard_size="ten gigs")


def test_register_for_checkpointing_refuses_objects_without_state_dict():
    with pytest.raises(ValueError, match="Item at index 1, `int`"):
        tessera.Accelerator(cpu=True).register_for_checkpointing(tiny_gpt(), 3)


def test_deepspeed_and_fsdp_plugins_set_the_zero_stage(tmp_path):
    acc = tessera.Accelerator(cpu=True, deepspeed_plugin=tessera.DeepSpeedPlugin(zero_stage=2))
    assert acc.zero_stage == 2
    config = {"zero_optimization": {"stage": 1}, "train_micro_batch_size_per_gpu": "auto"}
    acc = tessera.Accelerator(cpu=True, deepspeed_plugin=tessera.DeepSpeedPlugin(hf_ds_config=config))
    assert acc.zero_stage == 1
    acc = tessera.Accelerator(cpu=True, fsdp_plugin=tessera.FullyShardedDataParallelPlugin(
        sharding_strategy="SHARD_GRAD_OP"))
    assert acc.zero_stage == 2
    assert tessera.FullyShardedDataParallelPlugin(sharding_strategy=1).sharding_strategy == "FULL_SHARD"
    # Hybrid sharding: within the node (one process here: a shard group of 1).
    assert tessera.FullyShardedDataParallelPlugin(sharding_strategy=4).sharding_strategy == "HYBRID_SHARD"
    acc = tessera.Accelerator(cpu=True, fsdp_plugin=tessera.FullyShardedDataParallelPlugin(
        sharding_strategy="_HYBRID_SHARD_ZERO2"))
    assert acc.zero_stage == 2
    with pytest.raises(ValueError, match="contradicts"):
        tessera.Accelerator(cpu=True, zero_stage=1, deepspeed_plugin=tessera.DeepSpeedPlugin(zero_stage=3))
    with pytest.raises(ValueError, match="cannot be used together"):
        tessera.Accelerator(deepspeed_plugin=tessera.DeepSpeedPlugin(), fsdp_plugin=tessera.FullyShardedDataParallelPlugin())
    with pytest.raises(ValueError, match="auto_wrap_policy is not supported"):
        tessera.FullyShardedDataParallelPlugin(auto_wrap_policy=object())
    with pytest.raises(ValueError, match="sharding_strategy must be one of"):
        tessera.FullyShardedDataParallelPlugin(sharding_strategy="HALF_SHARD")


def test_llama_takes_transformers_config_names_and_starts_near_uniform():
    config = nn.LlamaConfig(vocab_size=50, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16)
    assert config.head_dim == 4 and config.num_key_value_heads == 2
    model = nn.Llama(config)
    idx = tessera.tensor([[1, 2, 3, 4, 5]])
    assert list(model(idx).shape) == [1, 5, 50]
    loss = model.loss(idx, idx)
    assert abs(loss.item() - np.log(50)) < 1.0
    with pytest.raises(ValueError, match="num_key_value_heads|num_attention_heads"):
        nn.LlamaConfig(num_attention_heads=4, num_key_value_heads=3, hidden_size=16)
