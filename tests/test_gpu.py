"""GPU correctness (skipped without CUDA): teacher-forced logits of every backend against
transformers.

Random bf16 weights give near-flat logits, so greedy tokens of two correct bf16 implementations
often differ. Instead, nanovllm's logits must stay within 1.5x the relative error that
transformers' own bf16 model has against a float32 transformers reference, in the same run.
"""
import gc
import importlib.util
import random
import types

import pytest
import torch

from nanovllm import LLM, SamplingParams
from tests.teacher_forcing import engine_logits, hf_logits, rel_error

pytestmark = pytest.mark.gpu
BACKENDS = ["triton", "sdpa"] + (["flash"] if importlib.util.find_spec("flash_attn") else [])


@pytest.fixture(autouse=True)
def free_gpu_memory():
    """Each engine sizes its KV cache from free memory: drop the previous test's engine first."""
    yield
    gc.collect()
    torch.cuda.empty_cache()


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    """Random weights with the Qwen3-0.6B architecture, saved as a transformers checkpoint."""
    from transformers import Qwen3Config, Qwen3ForCausalLM
    cfg = Qwen3Config(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                      num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                      vocab_size=151936, max_position_embeddings=40960,
                      rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(cfg)
    path = tmp_path_factory.mktemp("qwen3")
    model.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def workload():
    """Mixed lengths, some over a 256-token block; the prefix of the last two is shared."""
    rng = random.Random(0)
    lens = [(5, 24), (100, 16), (255, 20), (257, 12), (600, 24), (1000, 16)]
    seqs = [[rng.randrange(151936) for _ in range(p + d)] for p, d in lens]
    # shares 700 tokens (2 blocks)
    seqs.append(seqs[-1][:700] + [rng.randrange(151936) for _ in range(320)])
    return seqs, [p for p, _ in lens] + [1000]


@pytest.fixture(scope="module")
def references(qwen3_dir, workload):
    from transformers import AutoModelForCausalLM
    out = {}
    for name, dtype in [("fp32", torch.float32), ("bf16", torch.bfloat16)]:
        model = AutoModelForCausalLM.from_pretrained(qwen3_dir, dtype=dtype,
                                                     attn_implementation="sdpa").cuda()
        out[name] = hf_logits(model, *workload)
        del model
        torch.cuda.empty_cache()
    out["hf_bf16_error"] = rel_error(out["bf16"], out["fp32"])
    return out


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode", ["plain", "prefix_hit", "chunked"])
def test_teacher_forced_logits_bf16(qwen3_dir, workload, references, backend, mode):
    options = dict(max_num_batched_tokens=300) if mode == "chunked" else {}
    llm = LLM(qwen3_dir, attn_backend=backend, dtype="bfloat16", skip_tokenizer_init=True,
              gpu_memory_utilization=0.5, max_num_seqs=16, max_model_len=2048, **options)
    if mode == "prefix_hit":  # run once to fill the prefix cache, then measure the cached run
        engine_logits(llm, *workload)
    logits = engine_logits(llm, *workload)
    error, bound = rel_error(logits, references["fp32"]), 1.5 * references["hf_bf16_error"]
    print(f"{backend} {mode}: nanovllm {error:.5f}, "
          f"transformers bf16 {references['hf_bf16_error']:.5f}")
    assert error <= bound, (f"{backend} {mode}: relative error {error:.5f} > 1.5 x transformers "
                            f"bf16 {bound / 1.5:.5f}")
    if mode == "prefix_hit":
        assert llm.block_manager.cached_blocks, "the second run should have found cached blocks"


@pytest.mark.parametrize("backend", ["triton", "sdpa"])
@pytest.mark.parametrize("batch", [4, 1])  # 1: decode steps of one row, kernels/pdl.py's
def test_greedy_float32_matches_transformers(qwen3_dir, workload, backend, batch):
    from transformers import AutoModelForCausalLM
    prompts = [s[:p] for s, p in zip(*workload)][:batch]
    model = AutoModelForCausalLM.from_pretrained(qwen3_dir, dtype=torch.float32).cuda()
    expected = [model.generate(torch.tensor([p], device="cuda"), max_new_tokens=16,
                               do_sample=False)[0, len(p):].tolist()
                for p in prompts]
    del model
    llm = LLM(qwen3_dir, attn_backend=backend, dtype="float32", skip_tokenizer_init=True,
              gpu_memory_utilization=0.5, max_num_seqs=8, max_model_len=2048)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
                        use_tqdm=False)
    assert [o["token_ids"] for o in outs] == expected


def test_kv_cache_respects_memory_fraction(qwen3_dir):
    llm = LLM(qwen3_dir, attn_backend="triton", skip_tokenizer_init=True,
              gpu_memory_utilization=0.5, max_model_len=4096)
    llm.generate([[1] * 1000] * 64, SamplingParams(max_tokens=64, ignore_eos=True), use_tqdm=False)
    free, total = torch.cuda.mem_get_info()
    assert llm.model_runner.kv_cache.shape[2] > 0
    assert total - free <= 0.5 * total * 1.02, \
        f"{(total - free) / 2**30:.1f} GiB used of {total / 2**30:.1f}"


def test_shutdown_frees_the_gpu_for_the_next_engine(qwen3_dir):
    """bench.py builds one engine per backend in one process: after shutdown() the KV cache and the
    CUDA graphs of the first must be gone, so the next one sizes its cache from the same memory."""
    blocks = []
    for backend in ["triton"] + BACKENDS[2:] + ["triton"]:  # flash (piecewise graphs) if installed
        llm = LLM(qwen3_dir, attn_backend=backend, skip_tokenizer_init=True, max_model_len=2048,
                  gpu_memory_utilization=0.5, dtype="bfloat16")
        llm.generate([[1] * 300] * 8, SamplingParams(max_tokens=16, ignore_eos=True),
                     use_tqdm=False)
        blocks.append(llm.model_runner.kv_cache.shape[2])
        llm.shutdown()
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    assert blocks[-1] >= 0.95 * blocks[0], blocks


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_tensor_parallel_engine_shuts_down(qwen3_dir):
    """tensor_parallel_size=2 on the default configuration (CUDA graphs, cascade's twins, all of
    them holding NCCL collectives): shutdown() returns on every rank. Run in a process of its own
    with a time limit, so that a hang fails the test instead of stopping the suite."""
    import subprocess
    import sys
    script = ("import sys\nfrom nanovllm import LLM, SamplingParams\n"
              "llm = LLM(sys.argv[1], tensor_parallel_size=2, skip_tokenizer_init=True, "
              "max_model_len=2048, gpu_memory_utilization=0.5)\n"
              "llm.generate([[1] * 300] * 8, SamplingParams(max_tokens=16), use_tqdm=False)\n"
              "llm.shutdown()\nprint('shut down')\n")
    out = subprocess.run([sys.executable, "-c", script, qwen3_dir], capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0 and "shut down" in out.stdout, out.stderr[-2000:]


def test_penalties_in_cuda_graph_steps_equal_eager_steps(qwen3_dir):
    """Penalties and min_tokens act on the logits a CUDA graph returns, with the tokens of the step
    in flight filled in on the device: the same greedy tokens as eager steps, and not those of the
    same requests without penalties."""
    random.seed(3)
    prompts = [[random.randrange(1000, 20000) for _ in range(n)] for n in (40, 300, 7, 120)]
    penalized = SamplingParams(temperature=0, max_tokens=24, repetition_penalty=1.3,
                               presence_penalty=0.5, frequency_penalty=0.3, min_tokens=8)
    tokens = {}
    for eager, params in ((False, penalized), (True, penalized), (False, SamplingParams(
            temperature=0, max_tokens=24))):
        llm = LLM(qwen3_dir, attn_backend="triton", skip_tokenizer_init=True, dtype="float32",
                  enforce_eager=eager, max_model_len=1024, gpu_memory_utilization=0.3)
        outs = llm.generate(prompts, params, use_tqdm=False)
        tokens[eager, params.repetition_penalty] = [o.outputs[0].token_ids for o in outs]
        llm.shutdown()
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    assert tokens[False, 1.3] == tokens[True, 1.3]
    assert tokens[False, 1.3] != tokens[False, 1.0]


def count_graph_draws(graphs) -> list:
    """Wrap graphs.sample: the list grows by one for each step its sampler graphs draw."""
    draws, sample = [], graphs.sample

    def counted(logits, t, slot):
        tokens = sample(logits, t, slot)
        if tokens is not None:
            draws.append(len(tokens))
        return tokens
    graphs.sample = counted
    return draws


def test_decode_graphs_sample_as_eager_steps(qwen3_dir):
    """A decode graph fills its placeholders and ends with the logits, and plain sampling runs in a
    graph of its own (worker/cuda_graphs.py). At a temperature so low that sampling takes the
    argmax, graph steps give eager greedy steps' tokens: with every row plain (sampled by the
    sampler graphs) and with a seeded row among them (sampled eagerly from the graph's logits).
    (SAMPLING_EPS is the lowest temperature that samples; below it a request is greedy.)"""
    from nanovllm.sampling_params import SAMPLING_EPS
    random.seed(4)
    prompts = [[random.randrange(1000, 20000) for _ in range(n)] for n in (40, 300, 7, 120)]
    greedy, cold = (SamplingParams(temperature=t, max_tokens=24, ignore_eos=True)
                    for t in (0, SAMPLING_EPS))
    seeded = SamplingParams(temperature=SAMPLING_EPS, max_tokens=24, ignore_eos=True, seed=3)
    tokens, samplers = [], []
    for eager, params in ((True, [greedy] * 4), (False, [cold] * 4), (False, [cold, seeded] * 2)):
        llm = LLM(qwen3_dir, attn_backend="triton", skip_tokenizer_init=True, dtype="float32",
                  enforce_eager=eager, max_model_len=1024, gpu_memory_utilization=0.3)
        draws = None if eager else count_graph_draws(llm.model_runner.graphs)
        outs = llm.generate(prompts, params, use_tqdm=False)
        tokens.append([o.outputs[0].token_ids for o in outs])
        samplers.append(None if eager else len(draws))
        llm.shutdown()
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    assert tokens[1] == tokens[0] and tokens[2] == tokens[0]
    assert samplers[1] > 0 and samplers[2] == 0


def test_sampler_graph_draws_anew_and_by_the_distribution(qwen3_dir):
    """The captured sampler draws new noise at every replay (its seed comes from torch's generator
    on the device, not from the capture) and follows softmax(logits / T); T = 0 rows take the
    argmax."""
    from nanovllm.layers.sampler import SamplingTensors
    llm = LLM(qwen3_dir, attn_backend="triton", skip_tokenizer_init=True, max_model_len=1024,
              gpu_memory_utilization=0.3)
    graphs = llm.model_runner.graphs
    n, probs = 16, torch.tensor([0.5, 0.3, 0.2], device="cuda")
    logits = graphs.logits[:n]
    logits.fill_(-float("inf"))
    logits[:, 7:10] = probs.log().to(logits.dtype)
    logits[0, 5] = 1.0  # row 0 is greedy: always token 5
    graphs.sampleable = logits
    t = SamplingTensors(torch.tensor([0.0] + [1.0] * (n - 1), device="cuda"), [], False)
    draws = torch.stack([graphs.sample(logits, t).clone() for _ in range(2000)])
    assert set(graphs.samplers) == set(graphs.decode_sizes)  # all captured at start
    assert (draws[:, 0] == 5).all()
    assert (draws[1:, 1:] != draws[:-1, 1:]).any(1).all()  # no two replays alike
    freq = torch.bincount(draws[:, 1:].flatten() - 7, minlength=3).float() / draws[:, 1:].numel()
    assert torch.allclose(freq, probs, atol=0.01), freq
    llm.shutdown()


def test_reading_path_counts_the_modules_a_cuda_request_loads():
    """benchmarks/reading_path.py counts the CUDA path statically, as CI has no GPU: its modules
    are exactly those that a greedy request on the default CUDA configuration loads."""
    from benchmarks.reading_path import cuda_modules, loaded_modules
    loaded = set(loaded_modules())
    assert set(cuda_modules()) == loaded


def test_nothing_is_built_after_start(qwen3_dir):
    """Once LLM() returns, serving what the configuration allows compiles no kernel, traces no
    torch.compile graph and captures no CUDA graph: shared prefixes (cascade), parallel samples,
    beams, penalties, truncation, log-probabilities, seeds, batch sizes up to max_num_seqs, steps
    up to max_num_batched_tokens, with a bf16 and an FP8 cache."""
    from torch._dynamo.utils import counters
    from triton import knobs
    built = []
    capture_begin = torch.cuda.CUDAGraph.capture_begin

    def count_capture(graph, *args, **kwargs):
        built.append("CUDA graph")
        return capture_begin(graph, *args, **kwargs)
    rng = random.Random(1)
    prefix = [rng.randrange(151936) for _ in range(300)]
    shared = [prefix + [rng.randrange(151936) for _ in range(rng.randrange(1, 40))]
              for _ in range(24)]
    alone = [[rng.randrange(151936) for _ in range(rng.randrange(1, 900))] for _ in range(40)]
    params = [SamplingParams(temperature=0, max_tokens=12), SamplingParams(n=3, max_tokens=9),
              SamplingParams(top_k=20, top_p=0.9, min_p=0.05, max_tokens=7),
              SamplingParams(presence_penalty=0.5, repetition_penalty=1.2, max_tokens=8),
              SamplingParams(logprobs=2, max_tokens=5), SamplingParams(seed=3, max_tokens=6)]
    for kv_cache_dtype in ("auto", "fp8"):
        llm = LLM(qwen3_dir, max_num_seqs=48, max_num_batched_tokens=2048, max_model_len=2048,
                  kvcache_block_size=16, kv_cache_dtype=kv_cache_dtype, skip_tokenizer_init=True,
                  gpu_memory_utilization=0.5)
        graphs, compiles = dict(counters["stats"]), []
        knobs.runtime.jit_post_compile_hook = lambda *args, **kwargs: compiles.append(kwargs)
        torch.cuda.CUDAGraph.capture_begin = count_capture
        try:
            llm.generate(shared, SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)
            llm.generate(alone, [params[i % len(params)] for i in range(len(alone))],
                         use_tqdm=False)
            llm.beam_search(shared[:2], beam_width=3, max_tokens=4)
            for batch in (1, 2, 3, 17, 48):  # decode batches of every kind of size
                llm.generate(alone[:batch], SamplingParams(max_tokens=3), use_tqdm=False)
        finally:
            knobs.runtime.jit_post_compile_hook = None
            torch.cuda.CUDAGraph.capture_begin = capture_begin
        assert llm.model_runner.backend.cascade.num_steps > 0  # the shared prefix was read once
        assert built == [] and compiles == [], (kv_cache_dtype, built, compiles)
        assert dict(counters["stats"]) == graphs, kv_cache_dtype  # no torch.compile graph either
        llm.shutdown()


def test_compile_ahead_compiles_and_runs_nothing():
    """Within compile_ahead a launch compiles its kernel and runs nothing; afterwards the same
    launch runs at once, compiling nothing more."""
    import triton
    import triton.language as tl
    from triton import knobs

    from nanovllm.kernels.compile_ahead import compile_ahead

    @triton.jit
    def fill(out_ptr, value, BLOCK: tl.constexpr):
        tl.store(out_ptr + tl.arange(0, BLOCK), tl.full([BLOCK], value, tl.float32))

    out, compiles = torch.zeros(64, device="cuda"), []
    model = types.SimpleNamespace(model=types.SimpleNamespace(layers=[1, 2, 3]))
    knobs.runtime.jit_post_compile_hook = lambda *args, **kwargs: compiles.append(kwargs["repr"])
    try:
        with compile_ahead(model):
            assert model.model.layers == [1]  # the model keeps its first layer meanwhile
            for block in (16, 32, 64, 64):
                fill[(1,)](out, 1.0, BLOCK=block)
        assert len(compiles) == 3 and out.sum().item() == 0  # three compiled, none ran
        assert model.model.layers == [1, 2, 3]
        fill[(1,)](out, 1.0, BLOCK=64)
        assert len(compiles) == 3 and out.sum().item() == 64
    finally:
        knobs.runtime.jit_post_compile_hook = None
