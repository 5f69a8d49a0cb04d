// Everything in tessera::nn.
#pragma once
#include "tessera/nn/attention.h"
#include "tessera/nn/gpt.h"
#include "tessera/nn/layers.h"
#include "tessera/nn/module.h"
