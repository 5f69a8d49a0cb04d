"""The Accelerator, the Trainer and the examples from Python, as one process and as a
distributed job under `tessera launch` and under PyTorch's torchrun (CPU, TCP backend)."""
import json
import sys
import pathlib

import numpy as np
import pytest

import tessera
from conftest import EXAMPLES, have_torch, launch, read_safetensors, run, torchrun

TEMPLATE = str(EXAMPLES / "train_template.py")


@pytest.fixture(scope="module")
def tokens(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "tokens.bin"
    tessera.data.write_token_file(str(path), [(i * 7 + i // 5) % 64 for i in range(6000)], vocab_size=256)
    return str(path)


def _template_args(tokens, out, batch):
    return ["--data", tokens, "--steps", "6", "--accum", "2", "--batch", str(batch), "--seq", "16", "--out", str(out)]


def _max_difference(dir_a, dir_b):
    a = read_safetensors(pathlib.Path(dir_a) / "last" / "model.safetensors")
    b = read_safetensors(pathlib.Path(dir_b) / "last" / "model.safetensors")
    assert a.keys() == b.keys() and len(a) > 10
    return max(float(np.abs(a[k].astype(np.float64) - b[k]).max()) for k in a)


@pytest.fixture(scope="module")
def one_process_run(tokens, tmp_path_factory):
    out = tmp_path_factory.mktemp("one")
    log = run([sys.executable, TEMPLATE, *_template_args(tokens, out, 8)])
    assert "done: 6 optimizer steps on 1 process(es)" in log
    return out


def test_two_process_launch_equals_one_process_with_twice_the_batch(tokens, one_process_run, tmp_path):
    log = launch(2, TEMPLATE, *_template_args(tokens, tmp_path, 4))
    assert "done: 6 optimizer steps on 2 process(es)" in log
    diff = _max_difference(one_process_run, tmp_path)
    print(f"max |weight difference| after 6 steps, 2 processes x 4 rows vs 1 x 8: {diff:.3g}")
    assert diff <= 1e-5


@pytest.mark.skipif(not have_torch(), reason="PyTorch's torchrun is not installed")
def test_torchrun_runs_the_template(tokens, one_process_run, tmp_path):
    log = torchrun(2, TEMPLATE, *_template_args(tokens, tmp_path, 4))
    assert "done: 6 optimizer steps on 2 process(es)" in log
    assert _max_difference(one_process_run, tmp_path) <= 1e-5


def test_save_state_and_load_state_resume_exactly(tokens, tmp_path):
    script = str(pathlib.Path(__file__).parent / "resume_run.py")
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    run([sys.executable, script, "--data", tokens, "--out", straight])
    run([sys.executable, script, "--data", tokens, "--out", resumed,
         "--resume-from", straight / "checkpoint"])
    a, b = np.load(straight / "final.npz"), np.load(resumed / "final.npz")
    assert sorted(a.files) == sorted(b.files)
    for k in a.files:
        assert np.array_equal(a[k], b[k]), k
    # The checkpoint is not the end state (the resumed run did train).
    ckpt = read_safetensors(straight / "checkpoint" / "model.safetensors")
    assert not np.array_equal(ckpt["transformer.wte.weight"], a["transformer.wte.weight"])


def test_load_state_of_a_damaged_checkpoint_is_refused(tokens, tmp_path):
    acc = tessera.Accelerator()
    model = tessera.nn.GPT(tessera.nn.GPTConfig(vocab_size=64, block_size=8, n_layer=1, n_head=2, n_embd=16))
    acc.prepare(model)
    acc.save_state(str(tmp_path / "state"))
    weights = tmp_path / "state" / "model.safetensors"
    raw = bytearray(weights.read_bytes())
    raw[-3] ^= 0xFF
    weights.write_bytes(bytes(raw))
    with pytest.raises(RuntimeError, match="model.safetensors"):
        acc.load_state(str(tmp_path / "state"))
    acc.end_training()


def test_gradients_are_averaged_in_the_policys_reduce_dtype():
    acc = tessera.Accelerator(mixed_precision="bf16", cpu=True)
    assert acc.reduce_dtype == "bfloat16"
    acc.end_training()
    acc = tessera.Accelerator(mixed_precision="bf16", reduce_dtype="fp32", cpu=True)
    assert acc.reduce_dtype == "float32"
    acc.end_training()
    with pytest.raises((RuntimeError, ValueError), match="reduce_dtype must be fp32 or the parameters"):
        tessera.Accelerator(mixed_precision="bf16", reduce_dtype="fp16", cpu=True)


def test_ddp_internals_walkthrough_one_and_two_processes():
    script = str(EXAMPLES / "ddp_internals.py")
    assert "all checks passed" in run([sys.executable, script])
    log = launch(2, script)
    assert "world of 2" in log and "all checks passed" in log


def test_batch_inference_is_the_same_on_three_processes():
    script = str(EXAMPLES / "batch_inference.py")
    one = run([sys.executable, script])
    three = launch(3, script)
    completions = [line for line in one.splitlines() if line.startswith("prompt")]
    assert len(completions) == 10
    assert completions == [line for line in three.splitlines() if line.startswith("prompt")]
    assert "on 3 process(es)" in three


def test_trainer_trains_logs_and_evaluates(tokens, tmp_path):
    args = tessera.TrainingArguments(output_dir=str(tmp_path / "run"), max_steps=4, per_device_train_batch_size=4,
                                     seq=16, n_layer=1, n_head=2, n_embd=16, learning_rate=3e-3,
                                     eval_strategy="no", report_to=[])
    assert args.max_steps == 4 and args.per_device_train_batch_size == 4
    model = tessera.nn.GPT(tessera.nn.GPTConfig(vocab_size=256, block_size=16, n_layer=1, n_head=2, n_embd=16))
    trainer = tessera.Trainer(args, model, tokens, eval_dataset=tokens)

    class Recorder:
        logs = []

        def on_log(self, logs):
            self.logs.append(logs)

    recorder = Recorder()
    trainer.add_callback(recorder)
    trainer.train()
    assert trainer.state["global_step"] == 4
    assert [entry["step"] for entry in recorder.logs] == [1, 2, 3, 4]
    assert recorder.logs[-1]["loss"] < recorder.logs[0]["loss"]
    metrics = trainer.evaluate()
    assert 0 < metrics["eval_loss"] < 6
    assert (tmp_path / "run" / "checkpoint-4" / "model.safetensors").exists()
    json.loads((tmp_path / "run" / "checkpoint-4" / "trainer_state.json").read_text())


def test_training_arguments_are_checked():
    with pytest.raises(ValueError, match="learning_rat"):
        tessera.TrainingArguments(learning_rat=1e-3)
    with pytest.raises(ValueError, match="max_steps|steps"):
        tessera.TrainingArguments(max_steps="many")
