"""Experiment trackers through tessera.Accelerator (Accelerate's log_with, init_trackers, log,
get_tracker, end_training) and the Python Trainer's report_to."""
import csv
import json
import random
import textwrap

import pytest
import tessera
from tessera.tracking import GeneralTracker
from conftest import launch


class RecordingTracker(GeneralTracker):
    """A user's own tracker: remembers everything the Accelerator hands it."""
    name = "recording"

    def __init__(self):
        self.configs, self.logs, self.finished = [], [], 0

    def store_init_configuration(self, values):
        self.configs.append(values)

    def log(self, values, step=None, **kwargs):
        self.logs.append((values, step))

    def finish(self):
        self.finished += 1


class DuckTracker:  # no base class: only Accelerate's interface
    name = "duck"
    requires_logging_directory = False

    def __init__(self):
        self.calls = []

    def store_init_configuration(self, values):
        self.calls.append(("config", values))

    def log(self, values, step=None):
        self.calls.append(("log", values, step))

    def finish(self):
        self.calls.append(("finish",))


def test_a_custom_tracker_receives_the_config_every_log_and_finish(tmp_path):
    mine, duck = RecordingTracker(), DuckTracker()
    acc = tessera.Accelerator(cpu=True, log_with=[mine, "csv", duck], project_dir=str(tmp_path))
    config = {"lr": 3e-4, "layers": 2, "name": "gpt"}
    acc.init_trackers("proj", config=config)
    rng = random.Random(5)
    sent = [({"loss": rng.random(), "lr": rng.random() * 1e-3}, step) for step in range(1, 8)]
    for values, step in sent:
        acc.log(values, step=step)
    acc.log({"loss": 0.5})
    assert acc.get_tracker("recording") is mine
    assert acc.get_tracker("csv").name == "csv"
    assert mine.finished == 0
    acc.end_training()
    assert mine.configs == [config]
    assert mine.logs == sent + [({"loss": 0.5}, None)]
    assert mine.finished == 1
    assert duck.calls[0] == ("config", config) and duck.calls[-1] == ("finish",)
    assert [c[1:] for c in duck.calls[1:-1]] == [(v, s) for v, s in sent] + [({"loss": 0.5}, None)]
    with open(tmp_path / "proj" / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    assert [int(r["step"]) for r in rows] == [s for _, s in sent] + [0]
    for row, (values, _) in zip(rows, sent):
        assert float(row["loss"]) == values["loss"] and float(row["lr"]) == values["lr"]


def test_unknown_log_with_name_is_refused_naming_it_and_the_known_ones(tmp_path):
    with pytest.raises(ValueError, match=r'"wandb".*known: tensorboard, csv, mlflow, all'):
        tessera.Accelerator(cpu=True, log_with=["csv", "wandb"], project_dir=str(tmp_path / "p"))
    assert not (tmp_path / "p").exists()
    with pytest.raises(TypeError, match="lacks"):
        tessera.Accelerator(cpu=True, log_with=[object()])
    with pytest.raises(TypeError, match="not the class"):
        tessera.Accelerator(cpu=True, log_with=[RecordingTracker])


def test_get_tracker_names_what_there_is(tmp_path):
    acc = tessera.Accelerator(cpu=True, log_with=[RecordingTracker()])
    acc.init_trackers("proj")
    with pytest.raises(ValueError, match=r'"mlflow".*recording'):
        acc.get_tracker("mlflow")
    acc.end_training()


def test_the_python_trainers_report_to_reaches_csv(tmp_path):
    path = tmp_path / "tokens.bin"
    tessera.data.write_token_file(str(path), [(i * 7 + i // 5) % 64 for i in range(6000)], vocab_size=256)
    args = tessera.TrainingArguments(output_dir=str(tmp_path / "run"), max_steps=6, seq=16, n_layer=1,
                                     n_head=2, n_embd=16, eval_steps=3, eval_batches=1,
                                     report_to=["jsonl", "csv"])
    model = tessera.nn.GPT(tessera.nn.GPTConfig(vocab_size=256, block_size=16, n_layer=1, n_head=2,
                                                n_embd=16))
    tessera.Trainer(model=model, args=args, train_dataset=str(path), eval_dataset=str(path)).train()
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    with open(tmp_path / "run" / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == len(records) >= 6
    for row, record in zip(rows, records):
        assert int(row["step"]) == record["step"]
        for key, value in record.items():
            if key not in ("step", "time") and isinstance(value, (int, float)):
                assert float(row[key]) == value, key


def test_a_subclass_of_accelerates_general_tracker_is_accepted(tmp_path):
    tracking = pytest.importorskip("accelerate.tracking")

    class Mine(tracking.GeneralTracker):
        name = "mine"
        requires_logging_directory = False

        def __init__(self):
            super().__init__()
            self.seen = []

        @property
        def tracker(self):
            return self.seen

        def store_init_configuration(self, values):
            self.seen.append(("config", values))

        def log(self, values, step=None, **kwargs):
            self.seen.append(("log", values, step))

        def finish(self):
            self.seen.append(("finish",))

    mine = Mine()
    acc = tessera.Accelerator(cpu=True, log_with=mine)
    acc.init_trackers("p", config={"a": 1})
    acc.log({"loss": 1.5}, step=2)
    assert acc.get_tracker("mine", unwrap=True) is mine.seen
    acc.end_training()
    assert mine.seen == [("config", {"a": 1}), ("log", {"loss": 1.5}, 2), ("finish",)]


def test_only_the_main_process_writes_on_two_processes(tmp_path):
    # Each rank logs its own rank as the value; only rank 0's rows may reach the table, and a
    # tracker object with main_process_only = False is called on both ranks.
    script = tmp_path / "two.py"
    script.write_text(textwrap.dedent(f"""
        import tessera
        from tessera.tracking import GeneralTracker

        class Everywhere(GeneralTracker):
            name = "everywhere"
            main_process_only = False

            def log(self, values, step=None, **kwargs):
                print(f"rank {{values['rank']}} logged at {{step}}", flush=True)

        acc = tessera.Accelerator(cpu=True, log_with=["csv", Everywhere()], project_dir={str(tmp_path)!r})
        acc.init_trackers("proj", config={{"world": acc.num_processes}})
        for step in range(3):
            acc.log({{"rank": acc.process_index}}, step=step)
        assert acc.get_tracker("csv").name == ("csv" if acc.is_main_process else "")
        acc.end_training()
    """))
    out = launch(2, str(script))
    assert sum(f"rank {r} logged at {s}" in out for r in (0, 1) for s in range(3)) == 6, out
    with open(tmp_path / "proj" / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    assert [(r["step"], r["rank"]) for r in rows] == [("0", "0"), ("1", "0"), ("2", "0")]
