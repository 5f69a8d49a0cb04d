"""Accelerate's DeepSpeedPlugin and FullyShardedDataParallelPlugin, with Accelerate's argument
names, turned into the C++ Accelerator's options (ZeRO stage, offload, a DeepSpeed JSON file).

An argument Tessera has no counterpart for is refused when it is given (rather than
accepted and ignored); its default (None) is always fine.
"""
from __future__ import annotations

import json
import os
import tempfile

# torch's ShardingStrategy numbers; the hybrid two shard within a node and replicate across nodes.
_FSDP_STRATEGIES = {1: "FULL_SHARD", 2: "SHARD_GRAD_OP", 3: "NO_SHARD", 4: "HYBRID_SHARD", 5: "_HYBRID_SHARD_ZERO2"}
_FSDP_KNOWN = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "_HYBRID_SHARD_ZERO2")


def _refuse_unsupported(plugin, values):
    given = [name for name, value in values.items() if value is not None]
    if given:
        raise ValueError(f"{plugin}: {', '.join(given)} {'is' if len(given) == 1 else 'are'} not supported "
                         "by Tessera (leave them at None)")


class DeepSpeedPlugin:
    """DeepSpeed's ZeRO through Tessera's own ZeRO stages. ``hf_ds_config`` is a DeepSpeed
    JSON file or a dict of one (its zero_optimization, fp16/bf16, gradient_clipping and batch
    settings are read, "auto" values filled from the Accelerator); the other arguments
    override the stage and the offload devices ("cpu" or "none")."""

    def __init__(self, hf_ds_config=None, gradient_accumulation_steps=None, gradient_clipping=None,
                 zero_stage=None, is_train_batch_min=True, offload_optimizer_device=None,
                 offload_param_device=None, offload_optimizer_nvme_path=None, offload_param_nvme_path=None,
                 zero3_init_flag=None, zero3_save_16bit_model=None, transformer_moe_cls_names=None,
                 enable_msamp=None, msamp_opt_level=None):
        _refuse_unsupported("DeepSpeedPlugin", {
            "offload_optimizer_nvme_path": offload_optimizer_nvme_path,
            "offload_param_nvme_path": offload_param_nvme_path,
            "transformer_moe_cls_names": transformer_moe_cls_names,
            "enable_msamp": enable_msamp or None, "msamp_opt_level": msamp_opt_level,
            # DeepSpeed's engine clips; here Accelerator.clip_grad_norm_ does.
            "gradient_clipping": gradient_clipping})
        if zero_stage is not None and zero_stage not in (0, 1, 2, 3):
            raise ValueError(f"DeepSpeedPlugin: zero_stage must be 0, 1, 2 or 3, got {zero_stage!r}")
        for name, device in (("offload_optimizer_device", offload_optimizer_device),
                             ("offload_param_device", offload_param_device)):
            if device not in (None, "none", "cpu"):
                raise ValueError(f"DeepSpeedPlugin: {name} must be 'none' or 'cpu', got {device!r}")
        if hf_ds_config is not None and not isinstance(hf_ds_config, (str, os.PathLike, dict)):
            raise TypeError("DeepSpeedPlugin: hf_ds_config must be a path to a DeepSpeed JSON file or a "
                            f"dict, not {type(hf_ds_config).__name__}")
        self.hf_ds_config = hf_ds_config
        self.gradient_accumulation_steps = gradient_accumulation_steps
        self.gradient_clipping = gradient_clipping
        self.zero_stage = zero_stage
        self.is_train_batch_min = is_train_batch_min
        self.offload_optimizer_device = offload_optimizer_device
        self.offload_param_device = offload_param_device
        self.zero3_init_flag = zero3_init_flag
        self.zero3_save_16bit_model = zero3_save_16bit_model

    def accelerator_options(self):
        """The C++ Accelerator's options this plugin sets."""
        options = {}
        if self.hf_ds_config is not None:
            options["deepspeed_config"] = self._config_file()
        if self.zero_stage is not None:
            options["zero_stage"] = self.zero_stage
        if self.offload_optimizer_device == "cpu":
            options["offload_optimizer"] = True
        if self.offload_param_device == "cpu":
            options["offload_param"] = True
        if self.gradient_accumulation_steps is not None:
            options["gradient_accumulation_steps"] = self.gradient_accumulation_steps
        return options

    def _config_file(self):
        if not isinstance(self.hf_ds_config, dict):
            return os.fspath(self.hf_ds_config)
        # The C++ reader takes a file; the dict is written once, beside the other temporaries.
        handle, path = tempfile.mkstemp(prefix="tessera_ds_", suffix=".json")
        with os.fdopen(handle, "w") as f:
            json.dump(self.hf_ds_config, f)
        return path

    def __repr__(self):
        return (f"DeepSpeedPlugin(zero_stage={self.zero_stage}, hf_ds_config={self.hf_ds_config!r}, "
                f"offload_optimizer_device={self.offload_optimizer_device!r}, "
                f"offload_param_device={self.offload_param_device!r})")


class FullyShardedDataParallelPlugin:
    """PyTorch FSDP's sharding through Tessera's ZeRO stages: sharding_strategy FULL_SHARD
    (ZeRO-3), SHARD_GRAD_OP (ZeRO-2), NO_SHARD (DDP), HYBRID_SHARD (ZeRO-3 within each node,
    replicated across nodes) or _HYBRID_SHARD_ZERO2 (ZeRO-2 likewise), by name or by FSDP's
    number (1-5); cpu_offload=True keeps the parameter shards and optimizer state on the host."""

    def __init__(self, sharding_strategy=None, backward_prefetch=None, mixed_precision_policy=None,
                 auto_wrap_policy=None, cpu_offload=None, ignored_modules=None, state_dict_type=None,
                 state_dict_config=None, optim_state_dict_config=None, limit_all_gathers=True,
                 use_orig_params=None, param_init_fn=None, sync_module_states=None, forward_prefetch=None,
                 activation_checkpointing=None, cpu_ram_efficient_loading=None,
                 transformer_cls_names_to_wrap=None, min_num_params=None):
        _refuse_unsupported("FullyShardedDataParallelPlugin", {
            "backward_prefetch": backward_prefetch, "mixed_precision_policy": mixed_precision_policy,
            "auto_wrap_policy": auto_wrap_policy, "ignored_modules": ignored_modules,
            "state_dict_config": state_dict_config, "optim_state_dict_config": optim_state_dict_config,
            "param_init_fn": param_init_fn, "forward_prefetch": forward_prefetch or None,
            "transformer_cls_names_to_wrap": transformer_cls_names_to_wrap, "min_num_params": min_num_params,
            # The model's gradient_checkpointing_enable() is how Tessera recomputes layers.
            "activation_checkpointing": activation_checkpointing or None})
        if state_dict_type not in (None, "FULL_STATE_DICT"):
            raise ValueError("FullyShardedDataParallelPlugin: state_dict_type must be FULL_STATE_DICT "
                             f"(Tessera saves whole tensors), got {state_dict_type!r}")
        self.sharding_strategy = self._strategy_name(sharding_strategy)
        self.cpu_offload = bool(cpu_offload)
        self.state_dict_type = state_dict_type or "FULL_STATE_DICT"
        self.limit_all_gathers = limit_all_gathers
        self.use_orig_params = use_orig_params
        self.sync_module_states = sync_module_states
        self.cpu_ram_efficient_loading = cpu_ram_efficient_loading

    @staticmethod
    def _strategy_name(strategy):
        if strategy is None:
            return "FULL_SHARD"
        if isinstance(strategy, int) and not isinstance(strategy, bool):
            if strategy not in _FSDP_STRATEGIES:
                raise ValueError(f"FullyShardedDataParallelPlugin: sharding_strategy {strategy} must be 1 "
                                 "(FULL_SHARD), 2 (SHARD_GRAD_OP), 3 (NO_SHARD), 4 (HYBRID_SHARD) or 5 "
                                 "(_HYBRID_SHARD_ZERO2)")
            return _FSDP_STRATEGIES[strategy]
        name = getattr(strategy, "name", strategy)  # torch's ShardingStrategy enum too
        if not isinstance(name, str) or name.upper() not in _FSDP_KNOWN:
            raise ValueError(f"FullyShardedDataParallelPlugin: sharding_strategy must be one of "
                             f"{', '.join(_FSDP_KNOWN)}, got {strategy!r}")
        return name.upper()

    def accelerator_options(self):
        options = {"fsdp_sharding_strategy": self.sharding_strategy}
        if self.cpu_offload:
            if self.sharding_strategy != "FULL_SHARD":
                raise ValueError("FullyShardedDataParallelPlugin: cpu_offload needs sharding_strategy "
                                 f"FULL_SHARD (the parameters are offloaded), got {self.sharding_strategy}")
            options.update(offload_optimizer=True, offload_param=True)
        return options

    def __repr__(self):
        return (f"FullyShardedDataParallelPlugin(sharding_strategy={self.sharding_strategy!r}, "
                f"cpu_offload={self.cpu_offload})")
