"""The FP8 KV cache (kv_cache_dtype="fp8", nanovllm/attention/fp8.py).

Kernels: the store kernel writes what the plain PyTorch quantizer writes, and the decode and prefill
kernels reading an FP8 cache (with scales other than 1) equal float64 attention over the dequantized
cache. Engine: the sdpa and triton backends agree on an FP8 cache, block copies and swaps move it
intact, and on real SmolLM2 weights the FP8 cache's teacher-forced logits stay close to the float32
cache's (the agreement is printed; run with -s to see it).
"""
import random
from types import SimpleNamespace

import pytest
import torch
import triton.language as tl

from nanovllm import LLM, SamplingParams
from nanovllm.attention.fp8 import FP8, dequantize, quantize, store_quantized
from nanovllm.attention.paged_attention import store_kv
from nanovllm.worker.kv_cache import KVCache
from nanovllm.kernels import decode_attention, prefill_attention, rope_store
from nanovllm.kernels.paged import widen_config
from nanovllm.layers.rotary import RotaryEmbedding, norm_rope
from tests.helpers import FRANCE, FRANCE_ANSWER, GREEDY, chat, make_llm, random_prompts
from tests.teacher_forcing import engine_logits, rel_error
from tests.test_triton_kernels import (
    DEVICE,
    FP32_TOL,
    QUERY_TILE,
    cu_seqlens,
    make_paged_cache,
    ragged_lengths,
    ref_attention,
    rel_err,
    tiles_of,
)

pytestmark = pytest.mark.slow  # the quick subset, -m "not slow", leaves it out

# keys ~ N(0, 9) are stored up to ~240; values ~ N(0, 1) down into e4m3's subnormals
K_SCALE, V_SCALE = 0.05, 4.0


# ---------- the quantizer ----------

def test_quantize_saturates_and_rounds_to_e4m3():
    x = torch.tensor([1000.0, -1000.0, 448.0, 1.0, 0.3, 2.0**-9, 0.0])
    q = quantize(x, 1.0)
    assert q.dtype == FP8 and not q.float().isnan().any()
    assert q.float().tolist()[:4] == [448.0, -448.0, 448.0, 1.0]
    assert abs(q.float()[4].item() - 0.3) <= 0.3 * 2**-4  # 3 mantissa bits: half a step of 2^-3
    assert dequantize(quantize(x, 0.5), torch.float32, 0.5)[3].item() == 1.0  # 2 stored, 1 read


# ---------- kernels against float64 over the dequantized cache ----------

def fp8_paged_cache(k_lens, num_kv_heads, head_dim, block_size):
    """make_paged_cache's NaN-poisoned pool and tables, quantized (NaN stays NaN), and its float32
    dequantization for the reference."""
    k, v, tables = make_paged_cache(k_lens, num_kv_heads, head_dim, block_size, torch.float32,
                                    DEVICE)
    k8, v8 = quantize(k * 3, K_SCALE), quantize(v, V_SCALE)
    k_ref, v_ref = dequantize(k8, torch.float32, K_SCALE), dequantize(v8, torch.float32, V_SCALE)
    return k8, v8, k_ref, v_ref, tables


# a 16-bit model's dots over an FP8 cache run in float16 (kernels/paged.py widen_config): its output
# is rounded to bfloat16 (2^-9), the softmax weights to float16
BF16_TOL = 1e-2


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(4, 2, 64), (3, 1, 128)])
@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_reads_an_fp8_cache(num_heads, num_kv_heads, head_dim, num_splits, dtype):
    block_size = 16
    context_lens = [1, 15, 16, 17, 33, 0, 100]
    random.shuffle(context_lens)
    lens = [max(n, 1) for n in context_lens] + [40]
    k8, v8, k_ref, v_ref, tables = fp8_paged_cache(lens, num_kv_heads, head_dim, block_size)
    q_lens = [1 if n else 0 for n in context_lens] + [3]  # padding rows and a chunk: not written
    q = torch.randn(sum(q_lens), num_heads, head_dim, device=DEVICE).to(dtype)
    cu, scale = cu_seqlens(q_lens, DEVICE), head_dim ** -0.5
    out = torch.full_like(q, float("nan"))
    lens = torch.tensor(context_lens + [40], dtype=torch.int32, device=DEVICE)
    decode_attention(q, k8, v8, cu, lens, tables, scale, num_splits, out=out, k_scale=K_SCALE,
                     v_scale=V_SCALE)
    for i, n in enumerate(context_lens):
        if n:
            row = int(cu[i])
            ref = ref_attention(q[row:row + 1], k_ref, v_ref, tables[i], n, scale)
            tol = FP32_TOL if dtype == torch.float32 else BF16_TOL
            assert rel_err(out[row:row + 1], ref) < tol, f"row {i} (context {n})"
    assert out[-3:].isnan().all()


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(4, 2, 64), (3, 1, 128)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_reads_an_fp8_cache(num_heads, num_kv_heads, head_dim, dtype):
    block_size = 16
    lens = ragged_lengths(block_size) + [(130, 200)]  # prefix hits, chunks, several query tiles
    random.shuffle(lens)
    k8, v8, k_ref, v_ref, tables = fp8_paged_cache([k for _, k in lens], num_kv_heads, head_dim,
                                                   block_size)
    q_lens = [q for q, _ in lens]
    q = torch.randn(sum(q_lens), num_heads, head_dim, device=DEVICE).to(dtype)
    scale = head_dim ** -0.5
    out = torch.full_like(q, float("nan"))
    k_lens = torch.tensor([k for _, k in lens], dtype=torch.int32, device=DEVICE)
    prefill_attention(q, k8, v8, cu_seqlens(q_lens, DEVICE), k_lens, tables,
                      tiles_of(q_lens, DEVICE), QUERY_TILE, scale, out, K_SCALE, V_SCALE)
    start = 0
    for i, (q_len, k_len) in enumerate(lens):
        ref = ref_attention(q[start:start + q_len], k_ref, v_ref, tables[i], k_len, scale)
        tol = FP32_TOL if dtype == torch.float32 else BF16_TOL
        assert rel_err(out[start:start + q_len], ref) < tol, f"sequence {i} ({q_len}, {k_len})"
        start += q_len


def test_widen_config_dots_in_float16_only_for_a_16_bit_model_over_fp8():
    assert widen_config(torch.bfloat16, FP8)["DOT_DTYPE"] == tl.float16
    assert widen_config(torch.float16, FP8)["DOT_DTYPE"] == tl.float16
    assert widen_config(torch.float32, FP8) == dict(DOT_DTYPE=tl.float32, FP8_ASM=False)
    assert widen_config(torch.bfloat16, torch.bfloat16) == dict(DOT_DTYPE=tl.bfloat16,
                                                                FP8_ASM=False)


def test_fp8_attention_error_against_the_unquantized_cache():
    """What the cache costs: decode over the FP8 cache vs over the float32 keys and values."""
    k, v, tables = make_paged_cache([300, 77], 2, 64, 16, torch.float32, DEVICE)
    k8, v8 = quantize(k, 1.0), quantize(v, 1.0)
    q = torch.randn(2, 4, 64, device=DEVICE)
    cu, lens = cu_seqlens([1, 1], DEVICE), torch.tensor([300, 77], dtype=torch.int32, device=DEVICE)
    out = decode_attention(q, k8, v8, cu, lens, tables, 0.125, 2)
    for i, n in enumerate([300, 77]):
        ref = ref_attention(q[i:i + 1], k, v, tables[i], n, 0.125)
        assert 1e-3 < rel_err(out[i:i + 1], ref) < 0.05  # e4m3 rounds each element by up to 2^-4


@pytest.mark.parametrize("qk_norm,v_scale", [(False, V_SCALE), (True, V_SCALE), (False, 1.3)])
def test_rope_store_quantizes_like_the_plain_store(qk_norm, v_scale):
    """Keys and values stored by the kernel are those of fp8.store_quantized (within one e4m3 step
    for keys, whose float32 rotation differs in the last bits; values exactly, also for a scale
    that is not a power of two: a GPU's rounding must be torch's); slot -1 writes nothing."""
    num_heads, num_kv_heads, head_dim, num_blocks, block_size, num_tokens = 4, 2, 64, 4, 16, 37
    with torch.device(DEVICE):
        qkv = torch.randn(num_tokens, num_heads + 2 * num_kv_heads, head_dim) * 3
        positions = torch.randint(0, 500, (num_tokens,), dtype=torch.int32)
        cos_sin = RotaryEmbedding(head_dim, 512, 10000.0).cos_sin
        norm = (torch.rand(head_dim) + 0.5, torch.rand(head_dim) + 0.5, 1e-6)
        weights = norm if qk_norm else (None, None, 0.0)
        slots = torch.randperm(num_blocks * block_size)[:num_tokens].to(torch.int32)
        slots[::5] = -1
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        caches = [quantize(torch.full(shape, float("nan")), 1.0) for _ in range(4)]
    rope_store(qkv, positions, cos_sin, num_heads, caches[0], caches[1], slots, *weights, K_SCALE,
               v_scale)
    num_qk = num_heads + num_kv_heads
    ref_k = norm_rope(qkv[:, :num_qk], positions, cos_sin, num_heads, *weights)[:, num_heads:]
    store_kv(ref_k, qkv[:, num_qk:], caches[2], caches[3], slots, K_SCALE, v_scale)
    k, v, k_ref, v_ref = (c.float() for c in caches)
    assert torch.equal(k.isnan(), k_ref.isnan()) and torch.equal(v.isnan(), v_ref.isnan())
    assert torch.allclose(k.nan_to_num(), k_ref.nan_to_num(), rtol=2 ** -3, atol=2 ** -9)
    assert torch.equal(v.nan_to_num(), v_ref.nan_to_num())


def test_store_quantized_writes_bytes_at_the_slots():
    k, v = torch.randn(5, 2, 8), torch.randn(5, 2, 8)
    k_cache, v_cache = (torch.zeros(2, 4, 2, 8, dtype=FP8) for _ in "kv")
    slots = torch.tensor([7, -1, 0, 3, 6], dtype=torch.int32)
    store_quantized(k, v, k_cache, v_cache, slots, 0.5, 2.0)
    flat = k_cache.view(-1, 2, 8)
    assert torch.equal(flat[[7, 0, 3, 6]].float(), quantize(k[[0, 2, 3, 4]], 0.5).float())
    assert torch.equal(v_cache.view(-1, 2, 8)[6].float(), quantize(v[4], 2.0).float())
    assert flat[[1, 2, 4, 5]].float().eq(0).all()


# ---------- the engine ----------

@pytest.fixture(scope="module")
def tiny_fp8(tiny_path):
    return make_llm(tiny_path, kv_cache_dtype="fp8", device="cpu")


def test_fp8_cache_holds_twice_the_blocks_of_bfloat16(tiny_fp8):
    """The same bytes hold twice the blocks (memory_profile.py and the CPU budget divide by
    block_bytes)."""
    runner = tiny_fp8.model_runner
    assert runner.kv_cache.dtype == FP8 and runner.kv_cache.tensor.dtype == torch.uint8
    assert runner.kv_cache.attns[0].k_cache.dtype == FP8
    config = SimpleNamespace(kvcache_block_size=16, hf_config=tiny_fp8.config.hf_config)
    bf16, fp8 = (KVCache(runner.model, SimpleNamespace(**vars(config), kv_cache_dtype=kind,
                                                       torch_dtype=torch.bfloat16), runner.device)
                 for kind in ("auto", "fp8"))
    assert bf16.block_bytes == 2 * fp8.block_bytes


@pytest.mark.skipif(torch.cuda.is_available(), reason="triton on the CPU, in its interpreter")
def test_sdpa_and_triton_agree_on_an_fp8_cache(tiny_path, tiny_fp8):
    """Teacher-forced logits of both backends over one FP8 cache: prefix hits, chunks, decodes."""
    seqs = random_prompts(4, (20, 60), seed=3)
    seqs.append(seqs[1][:40] + seqs[0][:10])  # shares blocks of seqs[1]: a prefix-cache hit
    prompt_lens = [len(s) // 2 for s in seqs]
    triton = make_llm(tiny_path, kv_cache_dtype="fp8", device="cpu", attn_backend="triton",
                      max_num_batched_tokens=32)
    sdpa_logits = engine_logits(tiny_fp8, seqs, prompt_lens)
    err = rel_error(engine_logits(triton, seqs, prompt_lens), sdpa_logits)
    print(f"\nsdpa vs triton on an FP8 cache: logit rel error {err:.1e}")
    assert err < 1e-4


@pytest.mark.gpu
def test_fp8_on_the_gpu_triton_with_cuda_graphs_matches_sdpa(tiny_path):
    """On a GPU the store kernel writes the FP8 cache for both backends; triton's kernels, replayed
    in CUDA graphs, read it as sdpa's gather does (float32 model; triton's dots take tf32)."""
    seqs = random_prompts(6, (20, 300), seed=4)
    seqs.append(seqs[5][:200] + seqs[0][:20])  # a prefix-cache hit
    prompt_lens = [max(1, len(s) - 12) for s in seqs]
    logits = {}
    for backend in ("sdpa", "triton"):
        llm = LLM(tiny_path, skip_tokenizer_init=True, dtype="float32", kv_cache_dtype="fp8",
                  attn_backend=backend, kvcache_block_size=16, num_kvcache_blocks=256,
                  max_model_len=1024, max_num_seqs=16, max_num_batched_tokens=1024)
        assert (llm.model_runner.graphs is not None) and llm.model_runner.kv_cache.dtype == FP8
        logits[backend] = engine_logits(llm, seqs, prompt_lens)
        llm.shutdown()
    assert rel_error(logits["triton"], logits["sdpa"]) < 1e-2


def test_swap_and_copy_on_write_move_an_fp8_cache_intact(tiny_path, tiny_fp8):
    """n = 3 samples (shared blocks, copies on write) under swap preemption in a tiny cache give the
    tokens and log-probabilities of the same requests without memory pressure."""
    batch = random_prompts(3, (20, 40), seed=2)
    params = SamplingParams(n=3, temperature=1.0, seed=9, max_tokens=30, ignore_eos=True,
                            logprobs=2)
    expected = tiny_fp8.generate(batch, params, use_tqdm=False)
    tight = make_llm(tiny_path, kv_cache_dtype="fp8", device="cpu", num_kvcache_blocks=15,
                     preemption_mode="swap", swap_space=0.001)
    outputs = tight.generate(batch, params, use_tqdm=False)
    assert tight.scheduler.swap.num_swapped_out_blocks > 0
    for out, ref in zip(outputs, expected):
        for o, r in zip(out["outputs"], ref["outputs"]):
            assert o["token_ids"] == r["token_ids"]
            assert o["cumulative_logprob"] == pytest.approx(r["cumulative_logprob"], abs=1e-3)


def test_fp8_cache_on_real_weights(smol_llm, smollm2_dir):
    """SmolLM2-135M-Instruct, teacher-forced on the float32 cache's greedy continuations of 6 chat
    prompts: top-1 agreement measured 95.5% (275 of 288 tokens) and a relative logit error of 5.7%;
    the floors leave room for other CPUs' rounding. The France question is still answered right."""
    fp8 = make_llm(smollm2_dir, max_model_len=1024, num_kvcache_blocks=512, kv_cache_dtype="fp8")
    questions = [FRANCE, "Write a haiku about the sea.", "Explain gravity to a child.",
                 "List three prime numbers.", "What is 12 times 7?", "Name a famous painter."]
    prompts = [smol_llm.tokenizer.encode(chat(smol_llm.tokenizer, q)) for q in questions]
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    continuations = [o["token_ids"] for o in smol_llm.generate(prompts, params, use_tqdm=False)]
    greedy = [o["token_ids"] for o in fp8.generate(prompts, params, use_tqdm=False)]
    seqs = [p + c for p, c in zip(prompts, continuations)]
    lens = list(map(len, prompts))
    ref, got = engine_logits(smol_llm, seqs, lens), engine_logits(fp8, seqs, lens)
    matches = sum((a.argmax(-1) == b.argmax(-1)).sum().item() for a, b in zip(got, ref))
    agree = matches / sum(map(len, ref))
    common = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), len(x))
              for x, y in zip(greedy, continuations)]
    print(f"\nFP8 vs float32 cache, SmolLM2: teacher-forced top-1 agreement {agree:.1%}, "
          f"logit rel error {rel_error(got, ref):.3f}, "
          f"greedy tokens before the first difference {common}")
    assert agree >= 0.9 and rel_error(got, ref) < 0.1
    out, = fp8.generate([prompts[0]], GREEDY, use_tqdm=False)
    assert out["text"] == FRANCE_ANSWER


# ---------- options ----------

def test_flash_with_fp8_is_refused(tiny_path):
    with pytest.raises(ValueError, match="kv_cache_dtype='fp8' needs attn_backend 'triton' or "):
        LLM(tiny_path, skip_tokenizer_init=True, attn_backend="flash", kv_cache_dtype="fp8")


@pytest.mark.parametrize("value", ["fp16", "float8", "FP8", ""])
def test_bad_kv_cache_dtype(tiny_path, value):
    with pytest.raises(ValueError, match=r"^kv_cache_dtype=.*\('auto', 'fp8'\)"):
        LLM(tiny_path, skip_tokenizer_init=True, kv_cache_dtype=value)
