"""tessera.nn: Module, the layers and GPT (Hugging Face GPT-2 model directories)."""
from ._tessera.nn import (  # noqa: F401
    Module, Linear, Embedding, LayerNorm, GELU, Dropout, GPT, GPTConfig, GPTTransformer,
    language_model_loss, Llama, LlamaConfig,
)
from . import functional  # noqa: F401
