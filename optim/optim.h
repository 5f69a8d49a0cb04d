// Everything in tessera::optim.
#pragma once
#include "tessera/optim/adamw.h"
#include "tessera/optim/clip.h"
#include "tessera/optim/loss_scaler.h"
#include "tessera/optim/optimizer.h"
#include "tessera/optim/schedule.h"
#include "tessera/optim/sgd.h"
#include "tessera/optim/transformers_schedules.h"
