"""References for tests/data/test_example_dataset.cpp and test_collator.cpp: Python's csv
and json modules read the tables, transformers' collators collate. Works offline.

  read FORMAT FILE COLUMNS_JSON OUT_JSON
      the requested columns of every row, as csv.DictReader (CSV/TSV, the file opened with
      newline="" and encoding="utf-8-sig") or json.loads of each line (JSON Lines) gives them
  collate TOKENIZER_DIR CASES_JSON OUT_JSON
      each case {"collator": "padding" | "lm", "features": [{...}], "kwargs": {...},
      "padding_side": "right" | "left"} through transformers' DataCollatorWithPadding or
      DataCollatorForLanguageModeling(mlm=False) with BertTokenizerFast.from_pretrained(DIR)
      and return_tensors="np"; the batch's arrays as lists
"""
import csv
import json
import sys


def read(fmt, path, columns, out_path):
    rows = []
    if fmt == "jsonl":
        with open(path, encoding="utf-8-sig") as f:
            for line in f.read().split("\n"):
                if line.strip(" \t\r"):
                    obj = json.loads(line)
                    rows.append({c: obj[c] for c in columns})
    else:
        with open(path, newline="", encoding="utf-8-sig") as f:
            for row in csv.DictReader(f, delimiter="," if fmt == "csv" else "\t"):
                rows.append({c: row[c] for c in columns})
    with open(out_path, "w", encoding="utf-8") as f:
        json.dump(rows, f)


def collate(folder, cases_path, out_path):
    from transformers import (BertTokenizerFast, DataCollatorForLanguageModeling,
                              DataCollatorWithPadding)

    tok = BertTokenizerFast.from_pretrained(folder)
    with open(cases_path, encoding="utf-8") as f:
        cases = json.load(f)
    out = []
    for case in cases:
        tok.padding_side = case.get("padding_side", "right")
        if case["collator"] == "lm":
            collator = DataCollatorForLanguageModeling(tok, mlm=False, return_tensors="np",
                                                       **case["kwargs"])
        else:
            collator = DataCollatorWithPadding(tok, return_tensors="np", **case["kwargs"])
        batch = collator(case["features"])
        out.append({key: value.tolist() for key, value in batch.items()})
    with open(out_path, "w") as f:
        json.dump(out, f)


def main(argv):
    if argv[1] == "read":
        read(argv[2], argv[3], json.loads(argv[4]), argv[5])
    elif argv[1] == "collate":
        collate(argv[2], argv[3], argv[4])
    else:
        sys.exit(f"unknown command {argv[1]}")


if __name__ == "__main__":
    main(sys.argv)
