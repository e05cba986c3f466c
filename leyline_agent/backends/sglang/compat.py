"""Every SGLang internal the plugin touches, in one place (pinned: sglang 0.5.23).

``SYMBOLS``: the classes, functions and modules the plugin imports, by the name it uses, each with
where SGLang defines it. Import them from here: ``from leyline_agent.backends.sglang.compat import
RadixKey`` imports ``sglang.srt.mem_cache.radix_cache`` at that moment (module ``__getattr__``), so
a function-level import stays as lazy as it was (``cpu_dev`` patches must run before some SGLang
modules are imported).

``ATTRIBUTES``: the attributes the plugin reads, writes or calls on SGLang objects (scheduler, tree
cache, pools, ``Req``, rotary modules), private ones included, by the class that defines them.

``tests/test_sglang_compat.py`` checks that each one still exists in the installed version: the
canary to run first when the pin moves.
"""

from __future__ import annotations

import importlib
from typing import Any

# name -> "module" (the module itself) or "module:attribute"
SYMBOLS: dict[str, str] = {
    # scheduler, requests, IPC
    "Scheduler": "sglang.srt.managers.scheduler:Scheduler",
    "Req": "sglang.srt.managers.schedule_batch:Req",
    "ReqKvInfo": "sglang.srt.managers.schedule_batch:ReqKvInfo",
    "ScheduleBatch": "sglang.srt.managers.schedule_batch:ScheduleBatch",
    "SamplingParams": "sglang.srt.sampling.sampling_params:SamplingParams",
    "BaseReq": "sglang.srt.managers.io_struct:BaseReq",
    "hook_custom_types": "sglang.srt.managers.io_struct:hook_custom_types",
    "tokenizer_control_mixin": "sglang.srt.managers.tokenizer_control_mixin",
    "TypeBasedDispatcher": "sglang.utils:TypeBasedDispatcher",
    "HookRegistry": "sglang.srt.plugins.hook_registry:HookRegistry",
    "HookType": "sglang.srt.plugins.hook_registry:HookType",
    "get_parallel": "sglang.srt.runtime_context:get_parallel",
    "init_model_parallel_group": (
        "sglang.srt.distributed.parallel_state:init_model_parallel_group"
    ),
    "TokenizerManager": "sglang.srt.managers.tokenizer_manager:TokenizerManager",
    "http_server": "sglang.srt.entrypoints.http_server",
    # radix tree and KV pools
    "RadixCache": "sglang.srt.mem_cache.radix_cache:RadixCache",
    "TreeNode": "sglang.srt.mem_cache.radix_cache:TreeNode",
    "RadixKey": "sglang.srt.mem_cache.radix_cache:RadixKey",
    "MatchPrefixParams": "sglang.srt.mem_cache.base_prefix_cache:MatchPrefixParams",
    "MatchResult": "sglang.srt.mem_cache.base_prefix_cache:MatchResult",
    "InsertParams": "sglang.srt.mem_cache.base_prefix_cache:InsertParams",
    "InsertResult": "sglang.srt.mem_cache.base_prefix_cache:InsertResult",
    "EvictParams": "sglang.srt.mem_cache.base_prefix_cache:EvictParams",
    "register_radix_cache_backend": "sglang.srt.mem_cache.registry:register_radix_cache_backend",
    "registered_radix_cache_backends": (
        "sglang.srt.mem_cache.registry:registered_radix_cache_backends"
    ),
    "TreeCacheBuildContext": "sglang.srt.mem_cache.registry:TreeCacheBuildContext",
    "default_radix_cache_factory": "sglang.srt.mem_cache.registry:default_radix_cache_factory",
    "SpeculativeAlgorithm": "sglang.srt.speculative.spec_info:SpeculativeAlgorithm",
    "alloc_token_slots": "sglang.srt.mem_cache.allocation:alloc_token_slots",
    "TokenToKVPoolAllocator": "sglang.srt.mem_cache.allocator:TokenToKVPoolAllocator",
    "ReqToTokenPool": "sglang.srt.mem_cache.memory_pool:ReqToTokenPool",
    "MLATokenToKVPool": "sglang.srt.mem_cache.memory_pool:MLATokenToKVPool",
    "MHATokenToKVPool": "sglang.srt.mem_cache.memory_pool:MHATokenToKVPool",
    # model, attention, RoPE
    "RadixAttention": "sglang.srt.layers.radix_attention:RadixAttention",
    "LogitsProcessor": "sglang.srt.layers.logits_processor:LogitsProcessor",
    "TorchNativeAttnBackend": (
        "sglang.srt.layers.attention.torch_native_backend:TorchNativeAttnBackend"
    ),
    "ATTENTION_BACKEND_CHOICES": "sglang.srt.arg_groups.choices:ATTENTION_BACKEND_CHOICES",
    "ATTENTION_BACKENDS": "sglang.srt.layers.attention.attention_registry:ATTENTION_BACKENDS",
    "register_attention_backend": (
        "sglang.srt.layers.attention.attention_registry:register_attention_backend"
    ),
    "ModelRunner": "sglang.srt.model_executor.model_runner:ModelRunner",
    # LoRA (lora.py): a LoRA request's radix key is extra_key + lora_id (Req.__init__)
    "LoRAManager": "sglang.srt.lora.lora_manager:LoRAManager",
    "LoRARef": "sglang.srt.lora.lora_registry:LoRARef",
    "AttentionBackendRegistry": (
        "sglang.srt.models.deepseek_common.attention_backend_handler:AttentionBackendRegistry"
    ),
    "AttnForwardMethod": (
        "sglang.srt.models.deepseek_common.attention_forward_methods.forward_methods:"
        "AttnForwardMethod"
    ),
    "rotary_embedding_base": "sglang.srt.layers.rotary_embedding.base",
    "RotaryEmbedding": "sglang.srt.layers.rotary_embedding.base:RotaryEmbedding",
    "LinearScalingRotaryEmbedding": (
        "sglang.srt.layers.rotary_embedding.base:LinearScalingRotaryEmbedding"
    ),
    "DeepseekScalingRotaryEmbedding": (
        "sglang.srt.layers.rotary_embedding.rope_variant:DeepseekScalingRotaryEmbedding"
    ),
    "Llama3RotaryEmbedding": "sglang.srt.layers.rotary_embedding.rope_variant:Llama3RotaryEmbedding",
    "DualChunkRotaryEmbedding": (
        "sglang.srt.layers.rotary_embedding.rope_variant:DualChunkRotaryEmbedding"
    ),
    "FourierRotaryEmbedding": (
        "sglang.srt.layers.rotary_embedding.rope_variant:FourierRotaryEmbedding"
    ),
    "Phi3LongRoPEScaledRotaryEmbedding": (
        "sglang.srt.layers.rotary_embedding.rope_variant:Phi3LongRoPEScaledRotaryEmbedding"
    ),
    "YaRNScalingRotaryEmbedding": (
        "sglang.srt.layers.rotary_embedding.yarn:YaRNScalingRotaryEmbedding"
    ),
}

# SYMBOLS name -> attributes the plugin uses on it or its instances (``_private`` ones are the risk)
ATTRIBUTES: dict[str, tuple[str, ...]] = {
    "Scheduler": (
        "_request_dispatcher", "init_request_dispatcher", "tree_cache", "token_to_kv_pool_allocator",
        "req_to_token_pool", "model_config", "tp_worker", "run_batch", "running_batch",
        "waiting_queue", "spec_algorithm", "get_next_batch_to_run", "max_req_input_len",
        "chunked_req", "last_batch", "enable_overlap", "grammar_manager", "is_fully_idle",
        "enable_hierarchical_cache", "enable_lora",
    ),
    "tokenizer_control_mixin": ("_COMMUNICATOR_SPECS",),
    "http_server": ("app", "get_global_state"),
    "rotary_embedding_base": ("_is_cpu",),
    "RadixCache": (
        "_split_node", "_update_leaf_status", "evictable_size_", "protected_size_",
        "evictable_leaves", "kv_events", "root_node", "page_size", "device",
        "token_to_kv_pool_allocator", "match_prefix", "insert", "inc_lock_ref", "dec_lock_ref",
        "path_device_indices", "prefix_device_indices", "evictable_size", "evict", "reset",
    ),
    "TreeNode": ("children", "parent", "key", "value", "lock_ref"),
    "MatchResult": ("device_prefix_len", "last_device_node"),
    "InsertResult": ("prefix_len",),
    "TreeCacheBuildContext": (
        "params", "is_hybrid_swa", "is_hybrid_ssm", "enable_hierarchical_cache",
    ),
    "Req": (
        "rid", "kv", "prefix_len", "last_node", "extend_end", "cache_salt", "refresh_fill_ids",
        "lora_id", "finished",
    ),
    "ModelRunner": ("lora_manager",),
    "LoRAManager": ("lora_refs", "validate_lora_batch", "fetch_new_loras", "prepare_lora_batch"),
    "LoRARef": ("lora_id", "lora_name"),
    "ReqKvInfo": ("req_pool_idx", "cache_protected_len", "holds_kv", "mark_kv_released"),
    "ScheduleBatch": ("init_new", "prepare_for_extend", "out_cache_loc"),
    "TokenToKVPoolAllocator": (
        "free_pages", "release_pages", "available_size", "free", "size", "get_kvcache",
    ),
    "ReqToTokenPool": ("req_to_token", "available_size", "free"),
    "MLATokenToKVPool": ("kv_buffer", "kv_lora_rank", "qk_rope_head_dim", "dtype", "store_dtype"),
    "MHATokenToKVPool": ("k_buffer", "v_buffer", "dtype", "store_dtype"),
    "RadixAttention": ("sliding_window_size",),
    "LogitsProcessor": ("_get_logits",),
    "RotaryEmbedding": ("_compute_inv_freq", "rotary_dim", "base", "is_neox_style"),
    "LinearScalingRotaryEmbedding": ("scaling_factors",),
    "Llama3RotaryEmbedding": (
        "scaling_factor", "orig_max_position", "low_freq_factor", "high_freq_factor",
    ),
    "YaRNScalingRotaryEmbedding": (
        "scaling_factor", "max_position_embeddings", "beta_fast", "beta_slow", "mscale",
        "extrapolation_factor",
    ),
    "DeepseekScalingRotaryEmbedding": (
        "scaling_factor", "max_position_embeddings", "beta_fast", "beta_slow", "mscale",
        "extrapolation_factor",
    ),
}  # fmt: skip


def resolve(name: str) -> Any:
    """The SGLang object ``SYMBOLS[name]`` names (imports its module)."""
    module, _, attr = SYMBOLS[name].partition(":")
    obj = importlib.import_module(module)
    return getattr(obj, attr) if attr else obj


def __getattr__(name: str) -> Any:
    if name not in SYMBOLS:
        raise AttributeError(f"{__name__} has no SGLang symbol {name!r}; add it to SYMBOLS")
    return resolve(name)
