"""tiktoken's side of bench_tokenizer: MB/s of the gpt2 encoding's encode_ordinary on FILE,
single-threaded and over THREADS threads (encode_ordinary_batch over the same chunks Tessera
uses, cut after newlines). Prints one JSON line. Built offline from encoder.json + vocab.bpe."""
import json
import sys
import time

import tiktoken
from tiktoken.load import data_gym_to_mergeable_bpe_ranks
from tiktoken_ext.openai_public import r50k_pat_str


def best_seconds(fn, repeats):
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def main(encoder_json, vocab_bpe, path, threads, repeats):
    ranks = data_gym_to_mergeable_bpe_ranks(vocab_bpe, encoder_json)
    enc = tiktoken.Encoding("gpt2-offline", pat_str=r50k_pat_str, mergeable_ranks=ranks,
                            special_tokens={"<|endoftext|>": 50256})
    with open(path, "rb") as f:
        raw = f.read()
    text = raw.decode("utf-8", errors="replace")
    lines = text.splitlines(keepends=True)
    per = max(1, len(lines) // (threads * 4))
    chunks = ["".join(lines[i:i + per]) for i in range(0, len(lines), per)]
    tokens = len(enc.encode_ordinary(text))
    single = best_seconds(lambda: enc.encode_ordinary(text), repeats)
    batch = best_seconds(lambda: enc.encode_ordinary_batch(chunks, num_threads=threads), repeats)
    mb = len(raw) / 1e6
    print(json.dumps({"tokens": tokens, "single_mb_s": mb / single, "threads_mb_s": mb / batch}))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]))
