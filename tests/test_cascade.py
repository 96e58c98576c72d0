"""Cascade attention (kernels/cascade.py, attention/cascade.py): decode rows that share leading KV
blocks read them once. The kernel against a float64 reference over the same paged cache, the plan
chooser (who shares what, the rule), and the engine's greedy tokens with cascade on and off for
prefix hits, n > 1 and beam search (the triton backend, in Triton's interpreter on CPU)."""
import os
import random

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

from nanovllm import SamplingParams  # noqa: E402
from nanovllm.attention import cascade as cascade_module  # noqa: E402
from nanovllm.attention.cascade import (  # noqa: E402
    MIN_SAVED_FRACTION, BlockCopies, pays, plan_tiles, prefix_splits)
from nanovllm.worker.step_inputs import StepInputs  # noqa: E402
from nanovllm.kernels.cascade import cascade_attention, members_per_tile  # noqa: E402
import triton  # noqa: E402
from tests.helpers import make_llm, random_prompts, token_ids  # noqa: E402
from tests.test_triton_kernels import (  # noqa: E402
    DEVICE, FP32_TOL, cu_seqlens, make_paged_cache, ref_attention, rel_err)

pytestmark = pytest.mark.slow  # the quick subset, -m "not slow", leaves it out

# ---------- the plan ----------


def test_plan_groups_rows_by_their_leading_blocks():
    bs = 16
    tables = [[1, 2, 3, 9], [1, 2, 3, 8], [1, 2, 7], [5, 6], [4, 2, 3, 10]]
    lens = [60, 50, 40, 30, 60]
    key_starts, tiles, saved = plan_tiles(tables, lens, 5, bs, members=4)
    # rows 0-2 share blocks 1, 2 (row 2 leaves block 3); rows 3 and 4 share nothing with anyone
    assert tiles == [[0, 32, 0, 1, 2, -1]]
    assert key_starts == [32, 32, 32, 0, 0] and saved == 2 * 32


def test_plan_keeps_each_rows_newest_key_its_own():
    """A row whose context ends on a block boundary writes its newest key into its last block: that
    block is never part of the shared prefix, even where the tables agree."""
    key_starts, tiles, _ = plan_tiles([[1, 2], [1, 2]], [32, 40], 2, 16, members=4)
    assert tiles == [[0, 16, 0, 1, -1, -1]] and key_starts == [16, 16]
    assert plan_tiles([[1], [1]], [16, 16], 2, 16, members=4)[1] == []  # nothing left to share


def test_plan_cuts_big_groups_into_near_equal_tiles_and_skips_prefill_rows():
    tables = [[1, 2, 3]] * 11 + [[1, 2, 3]]  # the last row is a prefill chunk (not a decode)
    key_starts, tiles, saved = plan_tiles(tables, [40] * 12, 11, 16, members=4)
    assert [t[2:] for t in tiles] == [[0, 1, 2, -1], [3, 4, 5, 6], [7, 8, 9, 10]]
    assert len(key_starts) == 11 and saved == (2 + 3 + 3) * 32


def test_prefix_splits_aim_at_two_programs_per_sm():
    """132 SMs (an H200), 8 KV heads: the H200's sweep (results/h200_cascade.log)
    found 2 splits best for 16 and 32 tiles, more for fewer tiles; never past a key tile each."""
    assert prefix_splits(16, 8, 132, 1024) == 2  # 264 // 128: shared-prefix at batch 256
    assert prefix_splits(32, 8, 132, 2000) == 2  # at least 2
    assert prefix_splits(4, 8, 132, 2000) == 8
    assert prefix_splits(1, 8, 132, 2048) == 16  # at most MAX_PREFIX_SPLITS
    assert prefix_splits(1, 8, 132, 100) == 2  # 100 keys: two 64-key tiles, no more


def step_writing(tables, context_lens, q_lens, copies=(), swap_in=()):
    """A StepInputs that writes the last q_lens[s] keys of each row (the rest left empty)."""
    cu = [0]
    for n in q_lens:
        cu.append(cu[-1] + n)
    return StepInputs([], [], [], cu, list(context_lens), [list(t) for t in tables],
                      sum(n == 1 for n in q_lens), [], list(copies), list(swap_in))


def test_block_copies_equal_their_source_below_the_first_write():
    """n = 3 samples of a 20-token prompt, 16-token blocks: block 2 is the prompt's partial last
    block; the first decode copies it for two samples (blocks 3, 4) and each writes slot 4."""
    copies = BlockCopies(16)
    tables = [[1, 2], [1, 3], [1, 4]]
    copies.update(step_writing(tables, [21] * 3, [1] * 3, copies=[(2, 3), (2, 4)]))
    assert copies.equal_slots([2, 3, 4]) == 4 and copies.equal_slots([3, 4]) == 4
    assert copies.equal_slots([2, 5]) == 0  # not a copy
    tiles = plan_tiles(tables, [22] * 3, 3, 16, members=4, copies=copies)[1]
    assert tiles == [[0, 20, 0, 1, 2, -1]]  # 16 keys of block 1, and 4 of the copies
    assert plan_tiles(tables, [22] * 3, 3, 16, members=4)[1] == [[0, 16, 0, 1, 2, -1]]
    # a later prefill into block 4 from slot 0 (it was freed and given to another sequence)
    copies.update(step_writing([[7, 4]], [20], [20]))
    assert copies.equal_slots([2, 3]) == 4 and copies.equal_slots([2, 4]) == 0
    # a chain: block 5 copies block 3, which copies block 2
    copies.update(step_writing([[1, 5]], [23], [1], copies=[(3, 5)]))
    assert copies.equal_slots([2, 3, 5]) == 4
    copies.update(step_writing([], [], [], swap_in=[(0, 3)]))  # block 3 swapped in: new keys
    assert copies.equal_slots([2, 3]) == 0 and copies.equal_slots([5, 3]) == 0
    copies.update(step_writing([[1, 6]], [17], [1], copies=[(2, 6)]))
    assert copies.equal_slots([2, 6]) == 0  # written at slot 0 in the step that copied it
    copies.update(step_writing([], [], [], copies=[(9, 2)]))  # block 2 copies another block
    assert copies.equal_slots([9, 2]) == 16 and 2 not in [src for src, _ in copies.source.values()
                                                           if src != 9]


def test_the_rule_needs_a_share_of_the_keys():
    lens = [100] * 4
    assert pays(int(MIN_SAVED_FRACTION * 400), lens, 4)
    assert not pays(int(MIN_SAVED_FRACTION * 400) - 1, lens, 4)
    assert not pays(0, [0], 0)


# ---------- the kernel ----------

def ints(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32, device=DEVICE)


def shared_cache(groups, own_lens, shared_blocks, num_kv_heads, head_dim, block_size):
    """A paged cache where the rows of each group share their first `shared_blocks` blocks (those of
    the group's first row); the blocks a row gave up are poisoned with NaN."""
    lens = [shared_blocks * block_size + n for n in own_lens]
    k_cache, v_cache, tables = make_paged_cache(lens, num_kv_heads, head_dim, block_size,
                                                torch.float32, DEVICE)
    for rows in groups:
        for r in rows[1:]:
            dropped = tables[r, :shared_blocks].long()
            k_cache[dropped] = v_cache[dropped] = float("nan")
            tables[r, :shared_blocks] = tables[rows[0], :shared_blocks]
    return k_cache, v_cache, tables, lens


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 2), (8, 1), (3, 1)])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("num_splits,prefix_splits", [(1, 1), (3, 4)])
def test_cascade_attention_equals_the_reference(num_heads, num_kv_heads, block_size, num_splits,
                                                prefix_splits):
    """Two groups (one larger than a tile) and a row of its own, then a prefill chunk's row and a
    padding row that must stay unwritten."""
    random.seed(0)
    head_dim, shared_blocks = 64, 3
    members = members_per_tile(num_heads // num_kv_heads)
    big = members + 3
    groups = [list(range(big)), [big, big + 1]]
    num_rows = big + 3
    own = [random.randint(1, 2 * block_size) for _ in range(num_rows)] + [40]
    k_cache, v_cache, tables, lens = shared_cache(groups, own, shared_blocks, num_kv_heads,
                                                  head_dim, block_size)
    context_lens = lens[:num_rows] + [0] + [lens[-1]]  # a padding row, then the prefill chunk
    tables = torch.cat([tables[:num_rows], tables[:1], tables[-1:]])
    q_lens = [1] * num_rows + [0, 3]
    host_tables = tables.tolist()
    key_starts, tiles, saved = plan_tiles(host_tables, context_lens, num_rows, block_size, members)
    assert len(tiles) == 3 and saved > 0  # the big group is two tiles
    q = torch.randn(sum(q_lens), num_heads, head_dim, device=DEVICE)
    cu = cu_seqlens(q_lens, DEVICE)
    out = torch.full_like(q, float("nan"))
    d = len(context_lens)  # the kernels run every row; the data says which are decodes
    key_starts += [0, 0]
    cascade_attention(q, k_cache, v_cache, cu, ints(context_lens), tables, ints(key_starts[:d]),
                      ints(tiles), head_dim ** -0.5, num_splits, prefix_splits, out=out)
    for i in range(num_rows):
        ref = ref_attention(q[i:i + 1], k_cache, v_cache, tables[i], context_lens[i],
                            head_dim ** -0.5)
        err = rel_err(out[i:i + 1], ref)
        assert err < FP32_TOL, f"row {i} (context {context_lens[i]}): rel err {err}"
    assert out[num_rows:].isnan().all(), "the prefill chunk's rows were written"


def test_unused_tiles_write_nothing():
    """A CUDA graph launches a fixed number of tiles: those with shared_len 0 are skipped."""
    k_cache, v_cache, tables, lens = shared_cache([[0, 1]], [5, 9], 2, 2, 64, 16)
    q = torch.randn(2, 4, 64, device=DEVICE)
    key_starts, tiles, _ = plan_tiles(tables.tolist(), lens, 2, 16, members_per_tile(2))
    tiles += [[0] * len(tiles[0])] * 3
    out = cascade_attention(q, k_cache, v_cache, cu_seqlens([1, 1], DEVICE), ints(lens), tables,
                            ints(key_starts), ints(tiles), 0.125, 2, 2)
    for i in range(2):
        assert rel_err(out[i:i + 1], ref_attention(q[i:i + 1], k_cache, v_cache, tables[i],
                                                   lens[i], 0.125)) < FP32_TOL


def chunks(start, end, n, block_n):
    """kernels/decode.py's _split_range in Python: [start, end) cut into n whole-tile chunks."""
    chunk = -(-(-(-(end - start) // n)) // block_n) * block_n
    return [(start + i * chunk, min(start + (i + 1) * chunk, end)) for i in range(n)]


@pytest.mark.parametrize("heads", [1, 4])
def test_the_merge_combines_live_splits_by_log_sum_exp(heads):
    """The merge with `heads` query heads a program (6 heads: with 4, the second program's last
    two are padding) against float64: the live splits of each row weighted by 2^lse, its own keys'
    splits then its prefix's; stale scratch ignored, prefill rows untouched."""
    from nanovllm.kernels.decode import _merge_splits_kernel
    splits, psplits, block_n, num_heads, dim = 2, 3, 16, 6, 32
    q_lens, ctx, starts = [1, 1, 3, 1, 1], [40, 90, 12, 33, 100], [32, 0, 0, 16, 64]
    partial = torch.randn(5, splits + psplits, num_heads, dim, device=DEVICE)
    lse = torch.randn(5, splits + psplits, num_heads, 1, device=DEVICE) * 4
    out = torch.zeros(7, num_heads, dim, device=DEVICE)
    _merge_splits_kernel[(5, triton.cdiv(num_heads, heads))](
        partial, lse, out, cu_seqlens(q_lens, DEVICE), ints(ctx), ints(starts), splits, psplits,
        partial.stride(0), partial.stride(1), partial.stride(2), lse.stride(0), lse.stride(1),
        out.stride(0), out.stride(1), NUM_HEADS=num_heads, HEADS=heads, HEAD_DIM=dim,
        BLOCK_N=block_n, CASCADE=True, PREFIX_BLOCK_N=block_n, SPLITS_PAD=8)
    token = 0
    for row in range(5):
        if q_lens[row] == 1:
            ranges = chunks(starts[row], ctx[row], splits, block_n) + chunks(0, starts[row],
                                                                             psplits, block_n)
            live = [i for i, (a, b) in enumerate(ranges) if a < b]
            w = torch.exp2(lse[row, live].double() - lse[row, live].max().double())
            expected = (w * partial[row, live].double()).sum(0) / w.sum(0)
            assert torch.allclose(out[token].double(), expected, atol=1e-5), f"row {row}"
        else:
            assert not out[token:token + q_lens[row]].any()  # the prefill row's tokens
        token += q_lens[row]


def test_cascade_reads_an_fp8_cache():
    """kv_cache_dtype="fp8": the prefix kernel widens K and V as the decode kernel does, with the
    scales (against float64 over the dequantized cache)."""
    from nanovllm.attention.fp8 import dequantize, quantize
    k_cache, v_cache, tables, lens = shared_cache([[0, 1, 2]], [3, 20, 9], 2, 2, 64, 16)
    k8, v8 = quantize(k_cache * 3, 2.0), quantize(v_cache, 0.5)
    k_ref, v_ref = dequantize(k8, torch.float32, 2.0), dequantize(v8, torch.float32, 0.5)
    q = torch.randn(3, 4, 64, device=DEVICE)
    key_starts, tiles, _ = plan_tiles(tables.tolist(), lens, 3, 16, members_per_tile(2))
    out = cascade_attention(q, k8, v8, cu_seqlens([1, 1, 1], DEVICE), ints(lens), tables,
                            ints(key_starts), ints(tiles), 0.125, 1, 2, k_scale=2.0, v_scale=0.5)
    for i in range(3):
        ref = ref_attention(q[i:i + 1], k_ref, v_ref, tables[i], lens[i], 0.125)
        assert rel_err(out[i:i + 1], ref) < FP32_TOL, f"row {i}"


# ---------- the engine ----------

PARAMS = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def engines(tiny_path):
    return {on: make_llm(tiny_path, attn_backend="triton", dtype="float32",
                         disable_cascade_attn=not on) for on in (True, False)}


def cascade_steps(llm) -> int:
    return llm.model_runner.backend.cascade.num_steps


@pytest.fixture(scope="module")
def triton_llms(tiny_path):
    return engines(tiny_path)


def test_prefix_hits_equal_plain_and_alone(triton_llms):
    """Requests behind one system prompt of 3 blocks (a prefix-cache hit each): the same greedy
    tokens with cascade on, off, and each request alone."""
    system = random_prompts(1, (48, 48), seed=5)[0]
    requests = [system + p for p in random_prompts(4, (2, 20), seed=6)]
    llm_on, llm_off = triton_llms[True], triton_llms[False]
    results, before = {}, cascade_steps(llm_on)
    for on, llm in triton_llms.items():
        llm.generate([system + [1]], PARAMS, use_tqdm=False)  # caches the system prompt
        results[on] = token_ids(llm.generate(requests, PARAMS, use_tqdm=False))
    assert cascade_steps(llm_on) > before, "cascade never ran"
    alone = [token_ids(llm_off.generate([r], PARAMS, use_tqdm=False))[0] for r in requests]
    assert results[True] == results[False] == alone


def test_parallel_samples_equal_plain(triton_llms):
    """n = 3 samples of each of two prompts share the prompts' blocks (forks)."""
    prompts = random_prompts(2, (40, 60), seed=7)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, n=3)
    results, before = {}, cascade_steps(triton_llms[True])
    for on, llm in triton_llms.items():
        out = llm.generate(prompts, params, use_tqdm=False)
        results[on] = [[c.token_ids for c in o.outputs] for o in out]
    assert cascade_steps(triton_llms[True]) > before, "cascade never ran"
    assert results[True] == results[False]


def test_samples_share_their_prompts_last_block(triton_llms, monkeypatch):
    """n = 4 samples of a prompt that ends inside a block: the copies of that block (one per
    sample) share its prompt keys, so the tiles' shared prefix ends inside a block; the tokens
    equal cascade off's."""
    shared = []

    def recording_plan(*args, **kwargs):
        plan = plan_tiles(*args, **kwargs)
        shared.extend(tile[1] for tile in plan[1])
        return plan
    monkeypatch.setattr(cascade_module, "plan_tiles", recording_plan)
    prompts = random_prompts(2, (41, 41), seed=9)  # 2 whole blocks of 16, and 9 tokens
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, n=4)
    results = {}
    for on, llm in triton_llms.items():
        out = llm.generate(prompts, params, use_tqdm=False)
        results[on] = [[c.token_ids for c in o.outputs] for o in out]
    assert 41 in shared, f"no tile shared the whole prompt: {sorted(set(shared))}"
    assert results[True] == results[False]


def test_swap_mode_shares_whole_blocks_only(tiny_path, triton_llms):
    """A step of swaps alone never reaches the backend, so the copies' bookkeeping would miss its
    swaps in: with swap preemption, rows share whole blocks only (and still equal plain)."""
    llm = make_llm(tiny_path, attn_backend="triton", dtype="float32", preemption_mode="swap",
                   swap_space=0.001)
    assert llm.model_runner.backend.cascade.copies is None
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, n=3)
    prompts = random_prompts(2, (40, 60), seed=7)
    results = [[[c.token_ids for c in o.outputs] for o in engine.generate(prompts, params,
                                                                            use_tqdm=False)]
               for engine in (llm, triton_llms[False])]
    assert cascade_steps(llm) > 0, "cascade never ran"
    assert results[0] == results[1]


def test_beam_search_equals_plain(triton_llms):
    prompts = random_prompts(2, (35, 50), seed=8)
    results, before = {}, cascade_steps(triton_llms[True])
    for on, llm in triton_llms.items():
        beams = llm.beam_search(prompts, beam_width=3, max_tokens=5)
        results[on] = [[(b["token_ids"], b["score"]) for b in bs] for bs in beams]
    assert cascade_steps(triton_llms[True]) > before, "cascade never ran"
    for on, off in zip(results[True], results[False]):
        assert [t for t, _ in on] == [t for t, _ in off]
        # float tolerance: a GPU's float32 dots are tf32, summed in another order
        assert [s for _, s in on] == pytest.approx([s for _, s in off], rel=1e-3, abs=1e-4)


@pytest.mark.gpu
def test_twins_are_captured_at_start_and_a_step_past_their_room_runs_plain(tiny_path):
    """Every decode graph of 2 rows or more has its cascade twin from the start, with room for a
    quarter as many tiles as rows: 8 rows that are one prompt's 8 samples (1 tile) run cascade; 4
    prompts' 2 samples each (4 tiles, room for 2) run plain decode. No twin is captured later, and
    the tokens equal plain decode's."""
    llms = engines(tiny_path)
    cascade = llms[True].model_runner.backend.cascade
    graphs = llms[True].model_runner.graphs
    decode_sizes = [size for kind, size in graphs.graphs if kind == "decode" and size >= 2]
    assert sorted(cascade.twins) == sorted(decode_sizes) and cascade.twins[8][3] == 2
    twins = {size: twin[0] for size, twin in cascade.twins.items()}
    results, steps = {}, []
    for on, llm in llms.items():
        results[on] = []
        for k in (1, 4):
            before = cascade_steps(llms[True])
            outputs = llm.generate(random_prompts(k, (40, 40), seed=10 + k), SamplingParams(
                temperature=0, max_tokens=6, ignore_eos=True, n=8 // k), use_tqdm=False)
            results[on].append([[c.token_ids for c in o.outputs] for o in outputs])
            steps.append(cascade_steps(llms[True]) - before)
    assert steps[0] > 0 and steps[1] == 0, steps  # (steps[2:]: the engine without cascade)
    assert {size: twin[0] for size, twin in cascade.twins.items()} == twins
    assert results[True] == results[False]
