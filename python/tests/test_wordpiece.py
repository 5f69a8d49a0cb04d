"""tessera.data.WordPieceTokenizer called as transformers' tokenizers are: the same dict as
BertTokenizerFast for single texts, pairs, truncation and padding, on a vocabulary written
here (transformers needed for the comparison, skipped without it)."""
import pytest

from tessera import data

VOCAB = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "un", "##aff", "##able", "a", "##b", "b",
         ",", ".", "!", "cafe", "hello", "world", "##s", "\u4e2d", "\u6587", "x", "y", "z"]
TEXTS = ["Hello, world!", "unaffable cafés \u4e2d\u6587 x y z [MASK]", "a b ab " * 10, "zz\u0301 \x01"]


@pytest.fixture
def folder(tmp_path):
    (tmp_path / "vocab.txt").write_text("".join(t + "\n" for t in VOCAB), encoding="utf-8")
    return tmp_path


def test_call_gives_the_dict_transformers_gives(folder):
    transformers = pytest.importorskip("transformers")
    reference = transformers.BertTokenizerFast.from_pretrained(str(folder))
    tok = data.load_tokenizer(str(folder))
    assert isinstance(tok, data.WordPieceTokenizer)
    cases = [(None, {}),
             (TEXTS[::-1], {"truncation": True, "max_length": 9, "padding": True}),
             (["y"] * len(TEXTS), {"truncation": "only_first", "max_length": 12, "padding": "max_length"}),
             (None, {"add_special_tokens": False})]
    for pairs, kwargs in cases:
        theirs = reference(TEXTS, pairs, **kwargs)
        ours = tok(TEXTS, pairs, **kwargs)
        for key in ("input_ids", "token_type_ids", "attention_mask"):
            assert ours[key] == theirs[key], (kwargs, key)
    assert tok(TEXTS[0])["input_ids"] == reference(TEXTS[0])["input_ids"]
    ids = tok.encode(TEXTS[1])
    assert ids == reference.encode(TEXTS[1])
    assert tok.decode(ids, skip_special_tokens=True) == reference.decode(ids, skip_special_tokens=True)


def test_special_tokens_and_saving(folder, tmp_path_factory):
    tok = data.WordPieceTokenizer.from_vocab_file(str(folder / "vocab.txt"))
    assert (tok.cls_token, tok.cls_token_id, tok.sep_token_id, tok.pad_token_id) == ("[CLS]", 2, 3, 0)
    assert tok.mask_token_id == 4 and tok.unk_token_id == 1
    assert tok.token_to_id("##aff") == 6 and tok.token_to_id("nope") is None
    assert tok("unaffable", "b")["token_type_ids"] == [0, 0, 0, 0, 0, 1, 1]
    saved = tmp_path_factory.mktemp("saved")
    tok.save_pretrained(str(saved))
    again = data.load_tokenizer(str(saved))
    assert again(TEXTS) == tok(TEXTS)
    with pytest.raises(Exception, match="only_first"):
        tok("a", "b b b b b b", truncation="only_first", max_length=5)
