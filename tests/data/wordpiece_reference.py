"""Reference WordPiece tokenizers for tests/data/test_wordpiece.cpp: Hugging Face
`tokenizers` trains them, transformers.BertTokenizerFast encodes and decodes with them.
Works offline.

  train CORPUS VOCAB_SIZE LOWERCASE(0|1) OUT_DIR
      a WordPiece trained by tokenizers' WordPieceTrainer on CORPUS with BERT's normalizer
      (lowercase, accents stripped when lowercasing), pre-tokenizer, template and decoder,
      saved as tokenizer.json + vocab.txt + tokenizer_config.json
  cases DIR CASES_JSON OUT_JSON
      BertTokenizerFast.from_pretrained(DIR) on each case of CASES_JSON:
        {"texts": [...], "pairs": [...] or null, "kwargs": {...}, "sides": {...}}
          -> {"input_ids", "token_type_ids", "attention_mask"} (kwargs go to __call__,
             sides sets truncation_side / padding_side on the tokenizer first)
        {"decode": [[ids], ...], "skip_special_tokens": bool} -> {"texts": [...]}
"""
import json
import sys

SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


def train(corpus, vocab_size, lowercase, out_dir):
    import os
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
    from tokenizers.trainers import WordPieceTrainer

    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=lowercase)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    with open(corpus, encoding="utf-8") as f:
        lines = f.read().split("\n")
    tok.train_from_iterator(lines, WordPieceTrainer(vocab_size=vocab_size, special_tokens=SPECIALS,
                                                    show_progress=False))
    cls, sep = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", cls), ("[SEP]", sep)])
    os.makedirs(out_dir, exist_ok=True)
    tok.save(f"{out_dir}/tokenizer.json")
    vocab = sorted(tok.get_vocab().items(), key=lambda item: item[1])
    with open(f"{out_dir}/vocab.txt", "w", encoding="utf-8") as f:
        f.writelines(token + "\n" for token, _ in vocab)
    with open(f"{out_dir}/tokenizer_config.json", "w") as f:
        json.dump({"tokenizer_class": "BertTokenizer", "do_lower_case": lowercase,
                   "clean_up_tokenization_spaces": False}, f)


def run_cases(folder, cases_path, out_path):
    from transformers import BertTokenizerFast

    tok = BertTokenizerFast.from_pretrained(folder)
    with open(cases_path, encoding="utf-8") as f:
        cases = json.load(f)
    out = []
    for case in cases:
        if "decode" in case:
            skip = case["skip_special_tokens"]
            out.append({"texts": [tok.decode(ids, skip_special_tokens=skip) for ids in case["decode"]]})
            continue
        tok.truncation_side = case.get("sides", {}).get("truncation_side", "right")
        tok.padding_side = case.get("sides", {}).get("padding_side", "right")
        enc = tok(case["texts"], case["pairs"], **case["kwargs"])
        out.append({key: enc[key] for key in ("input_ids", "token_type_ids", "attention_mask")})
    with open(out_path, "w") as f:
        json.dump(out, f)


def main(argv):
    if argv[1] == "train":
        train(argv[2], int(argv[3]), argv[4] == "1", argv[5])
    elif argv[1] == "cases":
        run_cases(argv[2], argv[3], argv[4])
    else:
        sys.exit(f"unknown command {argv[1]}")


if __name__ == "__main__":
    main(sys.argv)
