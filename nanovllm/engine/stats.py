"""The engine's figures at a glance (`LLM.get_stats()`), like the gauges and counters of vLLM's
/metrics: what runs and waits now, how full the KV cache is, and (with log_stats=True: their counts
are engine/metrics.py's) token totals since the engine started."""


def engine_stats(engine) -> dict:
    scheduler, blocks = engine.scheduler, engine.block_manager
    swap = scheduler.swap
    stats = {
        "num_running": len(scheduler.running),
        "num_waiting": len(scheduler.waiting),
        "num_swapped": sum(map(len, swap.swapped)) if swap else 0,
        "kv_blocks_used": len(blocks.blocks) - blocks.num_free_blocks,
        "kv_blocks_total": len(blocks.blocks),
        "num_preemptions": scheduler.num_preemptions,  # recomputed and swapped out together
        "num_swapped_out": swap.num_swapped_out_groups if swap else 0,
    }
    from nanovllm.engine.metrics import engine_counts
    counts = engine_counts(engine)
    if counts is not None:
        stats.update({
            "prefix_cache_hit_rate": counts.num_cached_tokens / max(1, counts.num_prompt_tokens),
            # admitted prompts, cached tokens included
            "prompt_tokens": counts.num_prompt_tokens,
            "cached_prompt_tokens": counts.num_cached_tokens,
            "generation_tokens": counts.num_generation_tokens,
        })
    return stats
