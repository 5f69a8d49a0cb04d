// Everything in tessera::nn.
#pragma once
#include "tessera/nn/attention.h"
#include "tessera/nn/bert.h"
#include "tessera/nn/causal_lm.h"
#include "tessera/nn/classification.h"
#include "tessera/nn/distilbert.h"
#include "tessera/nn/encoder.h"
#include "tessera/nn/gpt.h"
#include "tessera/nn/gpt_fast.h"
#include "tessera/nn/layers.h"
#include "tessera/nn/llama.h"
#include "tessera/nn/llama_fast.h"
#include "tessera/nn/module.h"
