#pragma once

/// Umbrella header: the whole public API.

#include <colossalai/amp/grad_scaler.h>
#include <colossalai/amp/shared_cast.h>
#include <colossalai/booster/booster.h>
#include <colossalai/booster/graphed_step.h>
#include <colossalai/booster/mixed_precision/bf16.h>
#include <colossalai/booster/mixed_precision/fp16_torch.h>
#include <colossalai/booster/plugin/gemini_plugin.h>
#include <colossalai/booster/plugin/hybrid_parallel_plugin.h>
#include <colossalai/booster/plugin/low_level_zero_plugin.h>
#include <colossalai/booster/plugin/moe_hybrid_parallel_plugin.h>
#include <colossalai/booster/plugin/torch_ddp_model.h>
#include <colossalai/booster/plugin/torch_ddp_plugin.h>
#include <colossalai/booster/plugin/torch_fsdp_plugin.h>
#include <colossalai/booster/preemption.h>
#include <colossalai/cluster/process_group_mesh.h>
#include <colossalai/data/dataloader.h>
#include <colossalai/distributed/collectives.h>
#include <colossalai/distributed/error.h>
#include <colossalai/distributed/functional.h>
#include <colossalai/initialize.h>
#include <colossalai/launcher.h>
#include <colossalai/nn/hookable_module.h>
#include <colossalai/nn/lr_scheduler/all.h>
#include <colossalai/nn/optimizer/fused_adam.h>
#include <colossalai/nn/optimizer/hybrid_adam.h>
#include <colossalai/record.h>
#include <colossalai/shardformer/layer/embedding.h>
#include <colossalai/shardformer/layer/linear.h>
#include <colossalai/shardformer/layer/normalization.h>
#include <colossalai/shardformer/layer/parallel_module.h>
#include <colossalai/shardformer/policy.h>
#include <colossalai/shardformer/shard_config.h>
