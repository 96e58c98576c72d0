"""The engine's figures at a glance (`LLM.get_stats()`), like the gauges and counters of vLLM's
/metrics: what runs and waits now, how full the KV cache is, and totals since the engine started."""


def engine_stats(engine) -> dict:
    scheduler, blocks = engine.scheduler, engine.block_manager
    swap = scheduler.swap
    outputs = engine.output_processor
    return {
        "num_running": len(scheduler.running),
        "num_waiting": len(scheduler.waiting),
        "num_swapped": sum(map(len, swap.swapped)) if swap else 0,
        "kv_blocks_used": blocks.num_blocks - blocks.num_free_blocks,
        "kv_blocks_total": blocks.num_blocks,
        "prefix_cache_hit_rate": outputs.num_cached_tokens / max(1, outputs.num_prompt_tokens),
        "num_preemptions": scheduler.num_preemptions,  # recomputed and swapped out together
        "num_swapped_out": swap.num_swapped_out_groups if swap else 0,
        # admitted prompts, cached tokens included
        "prompt_tokens": outputs.num_prompt_tokens,
        "cached_prompt_tokens": outputs.num_cached_tokens,
        "generation_tokens": outputs.num_generation_tokens,
    }
