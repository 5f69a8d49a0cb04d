"""tessera.data: token files (llm.c's layout), tokenizers and the DataLoader."""
from ._tessera.data import (  # noqa: F401
    Tokenizer, ByteTokenizer, BpeTokenizer, WordPieceTokenizer, load_tokenizer, TokenFile,
    write_token_file, DataLoader,
)
