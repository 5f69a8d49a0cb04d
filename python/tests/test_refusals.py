"""Bad input from Python gets a clear Python exception naming the problem (PyTorch's,
Accelerate's and Hugging Face's type and wording where they have one) instead of a crash, a
message about something else, or a silently wrong result. What used to crash the interpreter
runs in a child process, so that a regression fails one test instead of the whole suite."""
import math
import subprocess
import sys

import numpy as np
import pytest

import tessera
from tessera import nn, optim, data
from conftest import python_env


def run_child(code):
    """Runs `code` in a fresh interpreter; returns (exit status, stderr)."""
    r = subprocess.run([sys.executable, "-c", code], env=python_env(), capture_output=True, text=True,
                       timeout=300)
    return r.returncode, r.stderr


def tiny_gpt():
    return nn.GPT(nn.GPTConfig(vocab_size=32, block_size=8, n_layer=1, n_head=2, n_embd=8),
                  generator=tessera.Generator(1))


# ---- what crashed (SIGSEGV) ----

@pytest.mark.parametrize("assignment, what", [
    ("self.fc = tessera.nn.Linear(2, 2)", "module"),
    ("self.w = self.register_parameter('w', tessera.ones(2))", "parameter"),
    ("self.register_buffer('b', tessera.ones(2))", "buffer"),
])
def test_assigning_before_module_init_raises_attribute_error(assignment, what):
    code = f"""
import tessera
class Early(tessera.nn.Module):
    def __init__(self):
        {assignment}
        super().__init__()
try:
    Early()
except AttributeError as e:
    print(e)
    raise SystemExit(3 if str(e) == "cannot assign {what} before Module.__init__() call" else 4)
"""
    status, err = run_child(code)
    assert status == 3, f"exit status {status}: {err[-2000:]}"


def test_unwrap_model_of_a_non_module_is_a_type_error():
    code = """
import tessera
acc = tessera.Accelerator(cpu=True)
for bad in (None, 5):
    try:
        acc.unwrap_model(bad)
        raise SystemExit(4)
    except TypeError as e:
        want = "Accelerator.unwrap_model: model must be a tessera.nn.Module, got " + type(bad).__name__
        if str(e) != want:
            print(e)
            raise SystemExit(5)
model = tessera.nn.Linear(2, 2)
raise SystemExit(3 if acc.unwrap_model(model) is model else 6)
"""
    status, err = run_child(code)
    assert status == 3, f"exit status {status}: {err[-2000:]}"


def test_releasing_a_deep_graph_does_not_overflow_the_stack():
    code = """
import tessera
x = tessera.ones(3, requires_grad=True)
y = x
for _ in range(200000):
    y = y * 1.0
del y
print("released")
"""
    status, err = run_child(code)
    assert status == 0, f"exit status {status}: {err[-2000:]}"


# ---- tensors ----

def test_an_out_of_range_tensor_index_is_an_index_error_naming_index_and_size():
    x = tessera.tensor(np.arange(6.0).reshape(3, 2))
    with pytest.raises(IndexError, match="index 5 is out of bounds for dimension 0 with size 3"):
        x[tessera.tensor([0, 5])]
    with pytest.raises(IndexError, match="index -4 is out of bounds for dimension 1 with size 2"):
        x[:, tessera.tensor([-4])]
    # Negative entries count from the end, as PyTorch's.
    np.testing.assert_array_equal(np.asarray(x[tessera.tensor([-1, 0])]), [[4.0, 5.0], [0.0, 1.0]])


def test_to_an_unknown_device_names_the_device():
    with pytest.raises(ValueError, match="unknown device 'tpu'"):
        tessera.zeros(3).to("tpu")
    assert tessera.zeros(3).to("float64").dtype == tessera.float64


def test_iterating_over_a_0d_tensor_is_a_type_error():
    with pytest.raises(TypeError, match="iteration over a 0-d tensor"):
        list(tessera.tensor(3.0))
    rows = list(tessera.tensor(np.arange(6.0).reshape(3, 2)))
    assert [r.tolist() for r in rows] == [[0.0, 1.0], [2.0, 3.0], [4.0, 5.0]]


def test_multinomial_with_nan_says_it_contains_nan():
    with pytest.raises(ValueError, match="contain NaN"):
        tessera.multinomial(tessera.tensor([0.5, math.nan]), 1)
    with pytest.raises(ValueError, match="non-negative"):
        tessera.multinomial(tessera.tensor([0.5, -0.1]), 1)


def test_generate_with_negative_max_new_tokens_is_a_value_error():
    with pytest.raises(ValueError, match="max_new_tokens must be >= 0, got -5"):
        tiny_gpt().generate(tessera.tensor([[1, 2]]), -5)


# ---- optimizers ----

def test_adamw_refuses_a_negative_learning_rate_and_an_empty_parameter_list():
    p = tessera.zeros(2, requires_grad=True)
    with pytest.raises(ValueError, match="Invalid learning rate: -1.0"):
        optim.AdamW([p], lr=-1)
    with pytest.raises(ValueError, match="Invalid learning rate: nan"):
        optim.AdamW([p], lr=math.nan)
    with pytest.raises(ValueError, match="optimizer got an empty parameter list"):
        optim.AdamW([])
    with pytest.raises(ValueError, match="Invalid learning rate"):
        optim.SGD([p], lr=-0.5)


def test_a_parameter_listed_twice_is_refused_not_updated_twice():
    p, q = tessera.zeros(2, requires_grad=True), tessera.zeros(3, requires_grad=True)
    with pytest.raises(ValueError, match=r"more than once .*parameter 2 is parameter 0"):
        optim.AdamW([p, q, p])
    model = tiny_gpt()  # tied embedding and head: each parameter once
    optim.AdamW(model.parameters())


def test_optimizer_load_state_dict_names_the_expected_keys():
    opt = optim.AdamW([tessera.zeros(2, requires_grad=True)])
    with pytest.raises(ValueError, match="'tensors'.*'scalars'.*\\['x'\\]"):
        opt.load_state_dict({"x": 1})
    opt.load_state_dict(opt.state_dict())


# ---- data, Trainer, Accelerator ----

def test_write_token_file_refuses_ids_not_below_the_vocabulary(tmp_path):
    with pytest.raises(ValueError, match="token 2 is 300, not below vocab_size 256"):
        data.write_token_file(str(tmp_path / "t.bin"), [1, 2, 300, 400], vocab_size=256)
    assert not (tmp_path / "t.bin").exists()
    data.write_token_file(str(tmp_path / "t.bin"), [1, 2, 255], vocab_size=256)


def test_training_arguments_with_nan_name_the_setting():
    with pytest.raises(ValueError, match="learning_rate must be a finite number, got nan"):
        tessera.TrainingArguments(learning_rate=math.nan)


def tiny_run(tmp_path):
    tokens = str(tmp_path / "t.bin")
    data.write_token_file(tokens, list(range(32)) * 8, vocab_size=32)
    args = tessera.TrainingArguments(output_dir=str(tmp_path / "run"), max_steps=1, per_device_train_batch_size=2,
                                     seq=4, report_to=[])
    return args, tokens


def test_trainer_of_a_non_model_is_a_type_error_naming_the_argument(tmp_path):
    args, tokens = tiny_run(tmp_path)
    with pytest.raises(TypeError, match="Trainer: model must be a tessera.nn.GPT, Llama or a sequence classifier.*got str"):
        tessera.Trainer("gpt2", args, train_dataset=tokens)


def test_add_callback_of_a_non_callback_is_a_type_error(tmp_path):
    args, tokens = tiny_run(tmp_path)
    trainer = tessera.Trainer(tiny_gpt(), args, train_dataset=tokens)
    with pytest.raises(TypeError, match="add_callback: callback must have .*on_log.*got int"):
        trainer.add_callback(5)


def test_accelerator_refuses_zero_bucket_bytes_at_construction():
    with pytest.raises(ValueError, match="bucket_bytes must be > 0"):
        tessera.Accelerator(cpu=True, bucket_bytes=0)


def test_end_training_twice_is_a_no_op():
    acc = tessera.Accelerator(cpu=True)
    acc.end_training()
    acc.end_training()
