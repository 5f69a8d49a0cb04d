// Everything in tessera::nn.
#pragma once
#include "nn/attention.h"
#include "nn/gpt.h"
#include "nn/layers.h"
#include "nn/llama.h"
#include "nn/module.h"
