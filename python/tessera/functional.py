"""tessera.nn.functional: the differentiable functions modules are made of."""
from ._tessera import (  # noqa: F401
    linear, layer_norm, rms_norm, embedding, dropout, cross_entropy, scaled_dot_product_attention,
    softmax, log_softmax, gelu, relu, silu, sigmoid, tanh,
)
