"""Batch-1 decode on a GPU: the plain decoder layer against the fused GEMV one (kernels/gemv.py).

`python benchmarks/gemv_decode.py [--sweep]`, random Qwen3-0.6B (bf16), everything in CUDA graphs:
1. (--sweep) each projection at M=1: cuBLAS against the GEMV's tile configs, 28 distinct weights
   (so L2 holds none) launched in one graph, time per launch;
2. the LM head at M=1: cuBLAS and the GEMV, against reading its 311 MB at the copy bandwidth;
3. the 28 layers of the model (no LM head) at M rows, context 768, one graph: the plain layer,
   the fused one without and with programmatic dependent launch, and fewer decode splits; with
   the max relative error of the fused hidden states and logits against the plain ones.
"""
import argparse
import json
import os
import statistics
from types import SimpleNamespace

import torch
import torch.nn.functional as F

import nanovllm.layers.fused_decode as fused_decode
from nanovllm.attention import AttentionMetadata
from nanovllm.attention.triton import TritonBackend
from nanovllm.kernels import gemv as gemv_module
from nanovllm.kernels.gemv import NORM, PLAIN, SILU, gemv
from nanovllm.models.llama import DecoderLayer, LlamaForCausalLM

ARCH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "Qwen3-0.6B", "config.json")
COPIES = 28


def graph_time(fn, replays: int = 30, repeats: int = 7) -> float:
    """Median us of one replay of a CUDA graph of fn (after warm-up runs outside it)."""
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    for _ in range(3):
        graph.replay()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1000 / replays)
    del graph
    return statistics.median(times)


def projection_sweep():
    """Each projection's time per launch at M=1: cuBLAS and the GEMV's configs, PDL off and on."""
    shapes = {"qkv": (4096, 1024, NORM), "o": (1024, 2048, PLAIN), "gate_up": (6144, 1024, NORM),
              "down": (1024, 3072, SILU)}
    configs = [dict(BLOCK_N=n, BLOCK_K=k, num_warps=w) for n in (4, 8, 16)
               for k in (512, 1024) for w in (4, 8)]
    best = {}
    for name, (n, k, prologue) in shapes.items():
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(COPIES)]
        x = torch.randn(1, 2 * k if prologue == SILU else k, device="cuda", dtype=torch.bfloat16)
        res = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        nw = torch.rand(k, device="cuda", dtype=torch.bfloat16) + 0.5
        xin = x[:, :k]
        t_cublas = graph_time(lambda: [F.linear(xin, w) for w in ws]) / COPIES
        results = []
        for cfg in configs:
            if cfg["BLOCK_K"] > max(256, triton_next_pow2(k)):
                continue
            opts = dict(prologue=prologue, residual=res if prologue == NORM else None,
                        norm_weight=nw, eps=1e-6, config=cfg)
            try:
                t = graph_time(lambda: [gemv(x, w, **opts) for w in ws]) / COPIES
            except Exception as e:  # out of registers or shared memory: skip the config
                print(f"  {name} {cfg}: {type(e).__name__}", flush=True)
                continue
            results.append((t, tuple(cfg.values())))
        results.sort()
        t_best, cfg_best = results[0]
        cfg = dict(zip(("BLOCK_N", "BLOCK_K", "num_warps"), cfg_best))
        opts = dict(prologue=prologue, residual=res if prologue == NORM else None,
                    norm_weight=nw, eps=1e-6, config=cfg, pdl=True)
        try:
            t_pdl = graph_time(lambda: [gemv(x, w, **opts) for w in ws]) / COPIES
        except Exception as e:
            print(f"  PDL failed: {e!r}", flush=True)
            t_pdl = float("nan")
        mib = n * k * 2 / 2**20
        gbps = n * k * 2 / t_pdl / 1e3
        print(f"{name} [{n} x {k}] {mib:.0f} MiB: cuBLAS (no prologue) {t_cublas:.2f} us; gemv "
              f"best {t_best:.2f} us {cfg}, with PDL {t_pdl:.2f} us ({gbps:.0f} GB/s); next: "
              + ", ".join(f"{t:.2f} {c}" for t, c in results[1:5]), flush=True)
        best[name] = cfg
    return best


def triton_next_pow2(k: int) -> int:
    return 1 << (k - 1).bit_length()


def lm_head():
    """The LM head at M=1: cuBLAS and the GEMV against a copy's bandwidth."""
    w = torch.randn(151936, 1024, device="cuda", dtype=torch.bfloat16) * 0.02
    x = torch.randn(1, 1024, device="cuda", dtype=torch.bfloat16)
    src = torch.empty(w.numel() * 2, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    t_copy = graph_time(lambda: dst.copy_(src), replays=10)
    gbps = w.numel() * 2 / 1e3
    t_cublas = graph_time(lambda: F.linear(x, w), replays=10)
    line = f"lm_head [151936 x 1024] 297 MiB: copy (read + write) {t_copy:.1f} us, cuBLAS " \
           f"{t_cublas:.1f} us ({gbps / t_cublas:.0f} GB/s)"
    for cfg in (dict(BLOCK_N=8, BLOCK_K=1024, num_warps=4), dict(BLOCK_N=16, BLOCK_K=1024,
                                                                  num_warps=8),
                dict(BLOCK_N=4, BLOCK_K=1024, num_warps=4)):
        t = graph_time(lambda: gemv(x, w, config=cfg), replays=10)
        line += f", gemv {cfg} {t:.1f} us ({gbps / t:.0f} GB/s)"
    err = ((gemv(x, w)[0].double() - F.linear(x, w).double()).norm() / F.linear(x, w).double()
           .norm()).item()
    print(line + f"; rel err vs cuBLAS {err:.1e}", flush=True)


def build_model(rows: int, context: int):
    """Random Qwen3-0.6B in bf16 with a KV cache holding `context` keys of each of `rows` decodes,
    and the inputs of one decode step."""
    cfg = json.load(open(ARCH))
    conf = SimpleNamespace(max_num_seqs=8, max_model_len=4096, kvcache_block_size=256,
                           device="cuda")
    backend = TritonBackend(16, 8, 128, conf)
    torch.manual_seed(0)
    with torch.device("cuda"):
        torch.set_default_dtype(torch.bfloat16)
        model = LlamaForCausalLM(cfg, backend, qk_norm=True)
        torch.set_default_dtype(torch.float32)
        for name, p in model.named_parameters():
            p.data.normal_(0, 0.02) if p.dim() > 1 else p.data.uniform_(0.5, 1.5)
        blocks = -(-(context + 1) // 256)
        for layer in model.model.layers:
            shape = (rows * blocks, 256, 8, 128)
            layer.self_attn.attn.k_cache = torch.randn(shape, dtype=torch.bfloat16)
            layer.self_attn.attn.v_cache = torch.randn(shape, dtype=torch.bfloat16)
        i32 = dict(dtype=torch.int32)
        block_tables = torch.arange(rows * blocks, **i32).view(rows, blocks)
        slots = block_tables[:, context // 256] * 256 + context % 256
        meta = AttentionMetadata(
            slot_mapping=slots.contiguous(), cu_seqlens_q=torch.arange(rows + 1, **i32),
            cu_seqlens_k=torch.arange(rows + 1, **i32) * (context + 1),
            context_lens=torch.full((rows,), context + 1, **i32), block_tables=block_tables,
            query_tiles=torch.zeros(0, 2, **i32), num_decodes=rows,
            cu_seqlens_q_host=list(range(rows + 1)), context_lens_host=[context + 1] * rows)
        ids = torch.randint(0, 10000, (rows,))
        positions = torch.full((rows,), context)
    return model, ids, positions, meta


def plain_layer(layer, positions, x, residual, meta):
    """DecoderLayer.forward's plain path."""
    x, residual = layer.input_layernorm(x, residual)
    x = layer.self_attn(positions, x, meta)
    x, residual = layer.post_attention_layernorm(x, residual)
    return layer.mlp(x), residual


def any_rows(self, positions, x, residual, meta):
    """DecoderLayer.forward whatever the rows: the variant set in fused_decode.decode_layer."""
    return fused_decode.decode_layer(self, positions, x, residual, meta)


def model_variants(best: dict | None, rows_list=(1, 2, 4, 8), context: int = 768):
    """The 28 layers (one graph) per variant, and the error of the fused path against the plain."""
    fused_layer = fused_decode.decode_layer
    DecoderLayer.forward = any_rows  # the fused layer at any M, not only up to the hook's
    default_config = gemv_module.gemv_config
    import nanovllm.attention.triton as triton_backend
    default_splits = triton_backend.num_decode_splits
    shape_names = {(4096, 1024): "qkv", (1024, 2048): "o", (6144, 1024): "gate_up",
                   (1024, 3072): "down"}

    def tuned_config(n, k):
        return best[shape_names[(n, k)]] if best and (n, k) in shape_names else default_config(n, k)

    def set_variant(layer_fn, pdl, config, splits):
        fused_decode.decode_layer = layer_fn
        fused_decode.use_pdl = lambda device: pdl
        gemv_module.gemv_config = config
        triton_backend.num_decode_splits = (default_splits if splits is None else
                                            lambda *a: splits)

    variants = {"plain": (plain_layer, False, default_config, None),
                "fused": (fused_layer, False, default_config, None),
                "fused+pdl": (fused_layer, True, default_config, None),
                "fused+pdl+tuned": (fused_layer, True, tuned_config, None),
                "plain splits=16": (plain_layer, False, default_config, 16),
                "fused+pdl+tuned splits=16": (fused_layer, True, tuned_config, 16),
                "fused+pdl+tuned splits=8": (fused_layer, True, tuned_config, 8),
                "fused+pdl+tuned splits=1": (fused_layer, True, tuned_config, 1)}
    for rows in rows_list:
        model, ids, positions, meta = build_model(rows, context)
        outs = {}
        line = f"M={rows} context {context + 1}, 28 layers + final norm, us per layer:"
        with torch.inference_mode():
            for name, variant in variants.items():
                if rows > 1 and "splits" in name:
                    continue
                set_variant(*variant)
                try:
                    t = graph_time(lambda: model(ids, positions, meta))
                except Exception as e:
                    print(f"  {name} failed: {e!r}", flush=True)
                    continue
                hidden = model(ids, positions, meta)
                outs[name] = (hidden.double(), model.compute_logits(hidden).double())
                line += f" {name} {t / 28:.2f};"
            set_variant(*variants["plain"])
            errs = []
            for name, (hidden, logits) in outs.items():
                ph, pl = outs["plain"]
                same = torch.equal(logits.argmax(-1), pl.argmax(-1))
                errs.append(f"{name}: hidden {((hidden - ph).abs().max() / ph.abs().max()):.1e}"
                            f" logits {((logits - pl).abs().max() / pl.abs().max()):.1e} argmax "
                            f"{'same' if same else 'DIFF'}")
        print(line, flush=True)
        print("  max |fused - plain| / max |plain|: " + "; ".join(errs[1:]), flush=True)
        try:  # bf16 noise: each against the plain layer in float32 (same weights, bf16 KV cache)
            with torch.inference_mode():
                model.float()
                ref = model.compute_logits(model(ids, positions, meta)).double()
            print("  logits against float32: " + "; ".join(
                f"{name} {((out[1] - ref).abs().max() / ref.abs().max()):.1e} argmax "
                f"{'same' if torch.equal(out[1].argmax(-1), ref.argmax(-1)) else 'DIFF'}"
                for name, out in outs.items()), flush=True)
        except Exception as e:
            print(f"  float32 reference failed: {e!r}", flush=True)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--no-lm-head", action="store_true")
    args = parser.parse_args()
    print(torch.cuda.get_device_name(), "torch", torch.__version__, flush=True)
    best = projection_sweep() if args.sweep else None
    if not args.no_lm_head:
        lm_head()
    model_variants(best, args.rows)


if __name__ == "__main__":
    main()
