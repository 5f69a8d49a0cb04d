// Umbrella header: everything a Tessera user needs.
#pragma once
#include "core/allocator.h"
#include "core/dispatch.h"
#include "core/dtype.h"
#include "core/random.h"
#include "core/tensor.h"
