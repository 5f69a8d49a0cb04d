"""Hugging Face names from Python: transformers' schedules under their own names (the lr at
every step equals transformers' when it is importable; warmup starts at lr 0 either way),
the seed TrainingArguments JSON as keyword arguments, and the three seed DeepSpeed files
(tests/data/configs) training a tiny GPT through TrainingArguments(deepspeed=...)."""
import json

import pytest

import tessera
from tessera import optim
from conftest import REPO

CONFIGS = REPO / "tests" / "data" / "configs"


def _optimizer(lr):
    return optim.AdamW([tessera.zeros(2, 2, requires_grad=True)], lr=lr)


def _lrs(opt, schedule, steps):
    out = []
    for _ in range(steps):
        out.append(opt.lr)
        schedule.step()
    return out


def test_linear_schedule_with_warmup_starts_at_zero():
    opt = _optimizer(2e-4)
    sched = optim.get_linear_schedule_with_warmup(opt, num_warmup_steps=10, num_training_steps=100)
    lrs = _lrs(opt, sched, 101)
    assert lrs[0] == 0.0
    assert lrs[10] == pytest.approx(2e-4, rel=1e-15)
    assert lrs[100] == 0.0
    with pytest.raises(ValueError, match="num_cycles"):
        optim.get_scheduler("linear", opt, 1, 10, scheduler_specific_kwargs={"num_cycles": 2})


CASES = [
    ("linear", 3, 20, {}),
    ("cosine", 4, 25, {}),
    ("cosine_with_min_lr", 2, 18, {"min_lr": 1e-5}),
    ("constant_with_warmup", 5, 12, {}),
    ("polynomial", 3, 15, {"power": 3.0, "lr_end": 1e-6}),
]


@pytest.mark.parametrize("name,warmup,total,kwargs", CASES)
def test_get_scheduler_matches_transformers(name, warmup, total, kwargs):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    weight = torch.nn.Parameter(torch.zeros(1))
    topt = torch.optim.AdamW([weight], lr=5e-4)
    theirs = transformers.get_scheduler(name, topt, num_warmup_steps=warmup, num_training_steps=total,
                                        scheduler_specific_kwargs=kwargs)
    want = []
    for _ in range(total + 3):
        want.append(topt.param_groups[0]["lr"])
        topt.step()
        theirs.step()
    opt = _optimizer(5e-4)
    got = _lrs(opt, optim.get_scheduler(name, opt, num_warmup_steps=warmup, num_training_steps=total,
                                        scheduler_specific_kwargs=kwargs), total + 3)
    assert got == pytest.approx(want, rel=1e-14, abs=1e-300)


def test_seed_training_arguments_json_as_keyword_arguments():
    settings = json.loads((CONFIGS / "training_arguments.json").read_text())
    args = tessera.TrainingArguments(**settings)
    assert args.lr_scheduler_type == "cosine" and args.warmup_ratio == 0.1
    assert args.metric_for_best_model == "eval_accuracy" and args.greater_is_better is True
    assert args.push_to_hub is False and args.report_to == ["tensorboard"]
    with pytest.raises(ValueError, match="network"):
        tessera.TrainingArguments(**{**settings, "push_to_hub": True})
    with pytest.raises(ValueError, match="wandb"):
        tessera.TrainingArguments(**{**settings, "report_to": "wandb"})
    assert tessera.TrainingArguments(resume_from_checkpoint=True).resume_from_checkpoint == "latest"


@pytest.fixture(scope="module")
def tokens(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "tokens.bin"
    tessera.data.write_token_file(str(path), [(i * 7 + i // 5) % 64 for i in range(6000)], vocab_size=256)
    return str(path)


@pytest.mark.parametrize("name,stage,dtype", [("deepspeed_zero2.json", 2, "fp16"),
                                              ("deepspeed_zero3.json", 3, "fp16"),
                                              ("ds_config_trainer.json", 2, "bf16")])
def test_seed_deepspeed_files_train_unchanged(tokens, tmp_path, name, stage, dtype):
    args = tessera.TrainingArguments(output_dir=str(tmp_path / "run"), max_steps=2, seq=16, n_layer=1,
                                     n_head=2, n_embd=16, eval_strategy="no", report_to="none",
                                     deepspeed=str(CONFIGS / name))
    assert args.zero_stage == stage and getattr(args, dtype) is True
    model = tessera.nn.GPT(tessera.nn.GPTConfig(vocab_size=256, block_size=16, n_layer=1, n_head=2, n_embd=16))
    trainer = tessera.Trainer(args, model, tokens)
    trainer.train()
    assert trainer.state["global_step"] == 2
    assert (tmp_path / "run" / "checkpoint-2" / "model.safetensors").exists()


def test_seed_training_arguments_file_trains(tokens, tmp_path):
    settings = json.loads((CONFIGS / "training_arguments.json").read_text())
    settings.update(output_dir=str(tmp_path / "run"), max_steps=2, seq=16, n_layer=1, n_head=2, n_embd=16,
                    eval_batches=1)
    model = tessera.nn.GPT(tessera.nn.GPTConfig(vocab_size=256, block_size=16, n_layer=1, n_head=2, n_embd=16))
    trainer = tessera.Trainer(tessera.TrainingArguments(**settings), model, tokens, eval_dataset=tokens)
    trainer.train()
    assert trainer.state["global_step"] == 2
    assert (tmp_path / "run" / "tensorboard").is_dir()
