"""Reference encodings for tests/data/test_gpt2_tokenizer.cpp, from the tokenizers Tessera
must agree with. Inputs are raw bytes; like a user of these libraries, the text is
bytes.decode("utf-8", errors="replace"). Ids are written as little-endian uint32.

  tiktoken ENCODER_JSON VOCAB_BPE INPUT OUT    tiktoken's gpt2 encoding, encode_ordinary
  gpt2 ENCODER_JSON VOCAB_BPE INPUT OUT        transformers.GPT2Tokenizer from the two files
  file TOKENIZER_JSON INPUT OUT                tokenizers.Tokenizer.from_file(...).encode
  auto DIR INPUT OUT                           transformers.AutoTokenizer.from_pretrained(DIR)
  replace INPUT OUT                            the UTF-8 bytes of the decoded text
  train INPUT VOCAB_SIZE OUT_JSON              a ByteLevelBPETokenizer trained on INPUT
  decode-tiktoken ENCODER_JSON VOCAB_BPE IDS OUT   tiktoken's decode_bytes of the ids

Works offline: tiktoken's Encoding is built from the two files with GPT-2's pattern.
"""
import struct
import sys


def text_of(path):
    with open(path, "rb") as f:
        return f.read().decode("utf-8", errors="replace")


def write_ids(path, ids):
    with open(path, "wb") as f:
        f.write(struct.pack(f"<{len(ids)}I", *ids))


def tiktoken_gpt2(encoder_json, vocab_bpe):
    import tiktoken
    from tiktoken.load import data_gym_to_mergeable_bpe_ranks
    from tiktoken_ext.openai_public import r50k_pat_str

    ranks = data_gym_to_mergeable_bpe_ranks(vocab_bpe, encoder_json)
    return tiktoken.Encoding("gpt2-offline", pat_str=r50k_pat_str, mergeable_ranks=ranks,
                             special_tokens={"<|endoftext|>": 50256})


def main(argv):
    cmd = argv[1]
    if cmd == "tiktoken":
        enc = tiktoken_gpt2(argv[2], argv[3])
        write_ids(argv[5], enc.encode_ordinary(text_of(argv[4])))
    elif cmd == "gpt2":
        import shutil
        import tempfile
        from transformers import GPT2Tokenizer
        with tempfile.TemporaryDirectory() as folder:  # Hugging Face's names for the two files
            shutil.copy(argv[2], f"{folder}/vocab.json")
            shutil.copy(argv[3], f"{folder}/merges.txt")
            tok = GPT2Tokenizer.from_pretrained(folder)
        assert len(tok) == 50257, f"GPT2Tokenizer has {len(tok)} tokens"
        write_ids(argv[5], tok(text_of(argv[4]), add_special_tokens=False)["input_ids"])
    elif cmd == "file":
        from tokenizers import Tokenizer
        tok = Tokenizer.from_file(argv[2])
        write_ids(argv[4], tok.encode(text_of(argv[3]), add_special_tokens=False).ids)
    elif cmd == "auto":
        from transformers import AutoTokenizer
        tok = AutoTokenizer.from_pretrained(argv[2])
        write_ids(argv[4], tok(text_of(argv[3]), add_special_tokens=False)["input_ids"])
    elif cmd == "replace":
        with open(argv[3], "wb") as f:
            f.write(text_of(argv[2]).encode("utf-8"))
    elif cmd == "train":
        from tokenizers import ByteLevelBPETokenizer
        tok = ByteLevelBPETokenizer()
        tok.train_from_iterator([text_of(argv[2])], vocab_size=int(argv[3]), min_frequency=2,
                                show_progress=False)
        tok.save(argv[4])
    elif cmd == "decode-tiktoken":
        enc = tiktoken_gpt2(argv[2], argv[3])
        with open(argv[4], "rb") as f:
            data = f.read()
        ids = list(struct.unpack(f"<{len(data) // 4}I", data))
        with open(argv[5], "wb") as f:
            f.write(enc.decode_bytes(ids))
    else:
        sys.exit(f"unknown command {cmd}")


if __name__ == "__main__":
    main(sys.argv)
