"""Hand-made seeds for the fuzz targets: each format's edge cases (every dtype, empty and
zero-sized tensors, metadata, both token-file versions, JSON and YAML configs)."""
import json
import os
import struct
import sys

corpus = sys.argv[1]


def put(reader, name, data):
    with open(os.path.join(corpus, reader, name), "wb") as f:
        f.write(data if isinstance(data, bytes) else data.encode())


def safetensors(tensors, metadata=None):
    header, body = {}, b""
    for name, (dtype, shape, data) in tensors.items():
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [len(body), len(body) + len(data)]}
        body += data
    if metadata:
        header["__metadata__"] = metadata
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + body


put("safetensors", "dtypes.safetensors", safetensors({
    "f32": ("F32", [2, 3], struct.pack("<6f", 1, -2, 3.5, 0, 1e-3, 7)),
    "f16": ("F16", [3], bytes(range(6))),
    "bf16": ("BF16", [1, 2], bytes(range(4))),
    "f64": ("F64", [1], struct.pack("<d", 2.5)),
    "i32": ("I32", [2], struct.pack("<2i", -1, 5)),
    "i64": ("I64", [1, 1], struct.pack("<q", 1 << 40)),
    "u8": ("U8", [3], b"abc"),
    "bool": ("BOOL", [2], b"\x00\x01"),
}, {"format": "pt"}))
put("safetensors", "empty.safetensors", safetensors({}))
put("safetensors", "zero_sized.safetensors", safetensors({"z": ("F32", [0, 4], b""), "s": ("F32", [], b"\0\0\x80?")}))

def token_file(version, tokens):
    fmt = "<%dH" if version == 1 else "<%dI"
    return struct.pack("<256i", 20240520, version, len(tokens), *([0] * 253)) + struct.pack(fmt % len(tokens), *tokens)

put("token_file", "v2.bin", token_file(2, [0, 70000, 5, 123456, 65535]))
put("token_file", "empty.bin", token_file(1, []))

config = {"data": "train.bin", "n_layer": 2, "n_head": 2, "n_embd": 32, "batch": 4, "seq": 16,
          "steps": 10, "lr": 3e-4, "schedule": "cosine", "shuffle": True, "device": "cpu",
          "dtype": "bf16", "eval_every": 5, "out": "runs/x"}
put("train_config", "config.json", json.dumps(config))
put("train_config", "config.yaml", "".join("%s: %s\n" % (k, json.dumps(v) if isinstance(v, str) else str(v).lower() if isinstance(v, bool) else v) for k, v in config.items()) + "# comment\n\nn-head: 4\n")

# The same kind of run under Hugging Face TrainingArguments names.
hf = {"output_dir": "runs/hf", "per_device_train_batch_size": 4, "learning_rate": 3e-4,
      "max_steps": 10, "lr_scheduler_type": "linear", "warmup_ratio": 0.1, "eval_strategy": "steps",
      "eval_steps": 5, "save_strategy": "steps", "save_steps": 5, "save_total_limit": 2,
      "load_best_model_at_end": True, "metric_for_best_model": "val_loss", "greater_is_better": False,
      "bf16": True, "data": "train.bin", "n_layer": 2, "n_head": 2, "n_embd": 32, "seq": 16}
put("train_config", "hugging_face.json", json.dumps(dict(hf, report_to=["jsonl"])))
put("train_config", "hugging_face.yaml", "".join(
    "%s: %s\n" % (k, str(v).lower() if isinstance(v, bool) else v) for k, v in hf.items()))


def byte_level_alphabet():
    """GPT-2's byte -> printable character map (the byte-level BPE vocabulary's alphabet)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


# A Hugging Face tokenizer.json: byte-level BPE over the 256 bytes with a few merges and an
# added special token (the layout `tessera prepare` writes and GPT-2's file uses).
alphabet = byte_level_alphabet()
vocab = {alphabet[b]: b for b in range(256)}
merges = ["t h", "th e", "\u0120 th"]
for m in merges:
    vocab[m.replace(" ", "")] = len(vocab)
vocab["<|endoftext|>"] = len(vocab)
put("tokenizer", "hugging_face.json", json.dumps({
    "version": "1.0",
    "added_tokens": [{"id": vocab["<|endoftext|>"], "content": "<|endoftext|>", "special": True}],
    "normalizer": None,
    "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "use_regex": True},
    "decoder": {"type": "ByteLevel"},
    "model": {"type": "BPE", "dropout": None, "vocab": vocab, "merges": merges},
}, ensure_ascii=False))

# Tables of labelled examples (fuzz/fuzz_text_table.cpp: the first byte picks JSON Lines (0),
# CSV (1) or TSV (2)): quoting, line breaks inside quotes, a BOM, unicode, blank lines.
put("text_table", "jsonl.txt", b"\x00" + "\ufeff{\"text\": \"caf\\u00e9 \\\"q\\\"\", \"label\": 1}\n\n"
    "{\"label\": 2.5, \"text\": \"\u65e5\u672c\", \"x\": [1, {}]}\r\n{\"text\": null, \"label\": \"a\"}".encode())
put("text_table", "csv.txt", b"\x01" + "text,label\r\n\"a,\"\"b\"\"\nc\",1\nx\"y\"z,\"2\"\r\r\n,\u2615\n\"open".encode())
put("text_table", "tsv.txt", b"\x02" + "label\ttext\n0\t\"tab\there\"\n1\tplain \"quote\"\n\n2\t\"\"\"\"".encode())
put("text_table", "number_overflow.txt", b"\x00" + b'{"text": "a", "label": 2e313}\n')  # a finding once
