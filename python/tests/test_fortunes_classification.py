"""examples/python/fortunes_classification.py (issue 40's fortunes task from Python): its split
is the CLI's `tessera prepare-fortunes` split row for row, its vocabulary the CLI's, and both
models (BERT-shaped, GPT-2-shaped with a new head from from_pretrained's overrides) train,
evaluate and report on the held-out fortunes; a short run on a reduced model."""
import json
import pathlib
import sys

import pytest

from conftest import EXAMPLES, run, tessera_program

FORTUNES = pathlib.Path("/usr/share/games/fortunes")


def rows(path):
    return [json.loads(line) for line in pathlib.Path(path).read_text().splitlines()]


@pytest.mark.skipif(not (FORTUNES / "computers").is_file(), reason="the fortunes package is not installed")
def test_the_python_fortunes_example_splits_as_the_cli_and_trains_both_models(tmp_path):
    out = run([sys.executable, EXAMPLES / "fortunes_classification.py", "--out", tmp_path / "py", "--max-steps", "6",
               "--hidden", "32", "--layers", "1", "--max-length", "64"])
    cli = tmp_path / "cli"
    run([tessera_program(), "prepare-fortunes", "--val-fraction", "0.15", "--seed", "0", "--vocab-size", "4000",
         "--out", cli])
    # The same held-out fortunes with the same labels (the CLI writes training rows shuffled).
    for name in ("val.jsonl", "train.jsonl"):
        ours, theirs = rows(tmp_path / "py" / name), rows(cli / name)
        assert len(ours) > 500 and len(ours) == len(theirs), name
        key = lambda row: json.dumps(row, sort_keys=True)  # noqa: E731
        assert sorted(map(key, ours)) == sorted(map(key, theirs)), name
    assert (tmp_path / "py" / "tokenizer" / "vocab.txt").read_text() == (cli / "vocab.txt").read_text()

    assert f"data: {len(rows(cli / 'train.jsonl'))} training and {len(rows(cli / 'val.jsonl'))} held-out" in out
    for kind in ("bert", "gpt2"):
        line = next(line for line in out.splitlines() if line.startswith(kind + " held-out:"))
        accuracy, f1 = float(line.split("eval_accuracy ")[1].split()[0]), float(line.split("eval_f1 ")[1].split()[0])
        assert 0 < accuracy <= 1 and 0 < f1 <= 1, line
        assert "after 6 steps" in line, line
    config = json.loads((tmp_path / "py" / "gpt2-run" / "checkpoint-6" / "config.json").read_text())
    assert config["model_type"] == "gpt2" and len(config["id2label"]) == 6 and config["id2label"]["5"] == "zippy"
