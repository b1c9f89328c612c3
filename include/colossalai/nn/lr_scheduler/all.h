#pragma once

/// The learning-rate schedulers of `colossalai.nn.lr_scheduler`.

#include <colossalai/nn/lr_scheduler/cosine.h>
#include <colossalai/nn/lr_scheduler/delayed.h>
#include <colossalai/nn/lr_scheduler/exponential.h>
#include <colossalai/nn/lr_scheduler/lambda.h>
#include <colossalai/nn/lr_scheduler/linear.h>
#include <colossalai/nn/lr_scheduler/lr_scheduler.h>
#include <colossalai/nn/lr_scheduler/multistep.h>
#include <colossalai/nn/lr_scheduler/onecycle.h>
#include <colossalai/nn/lr_scheduler/poly.h>
#include <colossalai/nn/lr_scheduler/step.h>
