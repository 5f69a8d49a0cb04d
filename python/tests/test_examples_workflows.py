"""The ports of Accelerate's workflows in examples/python run (tiny settings): the training
loop (1 and 2 processes), gradient accumulation with mixed precision, and resuming after a
preemption, which must end with the same weights as an uninterrupted run."""
import sys

import numpy as np

from conftest import EXAMPLES, launch, read_safetensors, run


def test_accelerate_training_loop_runs_and_saves_the_model(tmp_path):
    script = EXAMPLES / "accelerate_training_loop.py"
    args = ["--epochs", "2", "--steps-per-epoch", "3", "--seq", "16"]
    one = run([sys.executable, script, *args, "--out", tmp_path / "one"])
    assert "epoch 1: eval loss" in one and "done: 2 epochs on 1 process(es)" in one
    assert (tmp_path / "one" / "model" / "model.safetensors").is_file()
    two = launch(2, script, *args, "--out", tmp_path / "two")
    assert "over 6 batches" in two and "done: 2 epochs on 2 process(es)" in two


def test_accumulation_with_mixed_precision_trains_bf16_parameters(tmp_path):
    out = run([sys.executable, EXAMPLES / "accumulate_mixed_precision.py", "--steps", "3", "--accum", "2",
               "--seq", "16"])
    assert "done: 3 optimizer steps of 2 micro-batches, parameters bfloat16" in out
    losses = [float(line.split("loss ")[1].split()[0]) for line in out.splitlines() if line.startswith("step ")]
    assert len(losses) == 3 and losses[-1] < losses[0]


def test_a_preempted_run_resumed_ends_with_the_uninterrupted_weights(tmp_path):
    script = EXAMPLES / "resume_preemptible.py"
    common = ["--epochs", "2", "--steps-per-epoch", "4", "--checkpoint-every", "2"]
    run([sys.executable, script, *common, "--out", tmp_path / "straight"])
    preempted = run([sys.executable, script, *common, "--out", tmp_path / "resumed", "--stop-after", "3"])
    assert "preempted after step 3" in preempted
    resumed = run([sys.executable, script, *common, "--out", tmp_path / "resumed"])
    assert "at step 2 (epoch 0)" in resumed and "done: 8 optimizer steps" in resumed
    a = read_safetensors(tmp_path / "straight" / "model" / "model.safetensors")
    b = read_safetensors(tmp_path / "resumed" / "model" / "model.safetensors")
    assert a.keys() == b.keys() and len(a) > 10
    for name in a:
        assert np.array_equal(a[name], b[name]), name


def test_fine_tuning_a_classifier_reports_metrics_and_stops_early(tmp_path):
    script = EXAMPLES / "finetune_classifier.py"
    out = run([sys.executable, script, "--out", tmp_path / "one", "--epochs", "4", "--train-rows", "160",
               "--eval-rows", "32"])
    evaluations = [line for line in out.splitlines() if line.startswith("epoch ")]
    assert 1 <= len(evaluations) <= 4 and "eval_f1" in evaluations[0]  # the on_log callback saw them
    assert "predict: 32 rows" in out and "loaded the best model" in out
    accuracy = float(out.split("evaluate: eval_accuracy ")[1].split()[0])
    assert accuracy > 0.8  # the label is the kind of the review's words: learnt in 4 epochs
    # Two processes: each trains on its share of every batch, the evaluation gathers every row once.
    two = launch(2, script, "--out", tmp_path / "two", "--epochs", "4", "--train-rows", "160", "--eval-rows", "32")
    assert "predict: 32 rows" in two and "on 2 process(es)" in two
    assert float(two.split("evaluate: eval_accuracy ")[1].split()[0]) > 0.8
