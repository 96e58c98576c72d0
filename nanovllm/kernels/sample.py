"""Sampling on the GPU: softmax(logits / T) sampled exactly, reading the logits once and making few
random numbers.

The vocabulary is cut into chunks. A first pass computes, per (row, chunk), the chunk's largest
scaled logit m and sum s of exp(logit / T - m) (and its argmax, for greedy rows): the chunk's share
of the row's probability is exp(m) * s / Z. A second pass, one program per row, draws a chunk with
the Gumbel-max trick over those shares (argmax(log share + g), g = -log(-log u), u ~ U[0, 1)), then
a token inside it the same way, so token i is drawn with probability
(Z_chunk / Z) * (exp(logit_i / T) / Z_chunk). The first pass, which reads everything, has no
random numbers to make; the second makes one per chunk and one per token of a single chunk (and
rereads that chunk). Rows with T = 0 take the argmax. On an H200, 256 rows of Qwen3's 151,936
logits: 51 us, where one Gumbel number per logit took 170 us (the random numbers, not the memory,
bounded it).
"""
import torch
import triton
import triton.language as tl


@triton.jit
def _chunk_stats_kernel(logits_ptr, temperatures_ptr, max_ptr, sum_ptr, argmax_ptr, vocab,
                        stride_row, BLOCK: tl.constexpr):
    row, chunk = tl.program_id(0), tl.program_id(1)
    t = tl.load(temperatures_ptr + row)
    tokens = chunk * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(logits_ptr + row.to(tl.int64) * stride_row + tokens, mask=tokens < vocab,
                other=float("-inf")).to(tl.float32)
    x = x * (1 / tl.where(t > 0, t, 1.0))
    m = tl.max(x, 0)
    out = row * tl.num_programs(1) + chunk
    tl.store(max_ptr + out, m)
    tl.store(sum_ptr + out, tl.sum(tl.where(x > float("-inf"), tl.exp(x - m), 0.0), 0))
    tl.store(argmax_ptr + out, chunk * BLOCK + tl.argmax(x, 0))


@triton.jit
def _pick_kernel(logits_ptr, temperatures_ptr, max_ptr, sum_ptr, argmax_ptr, token_ptr, seed_ptr,
                 vocab, chunks, stride_row, BLOCK: tl.constexpr, CHUNKS_PAD: tl.constexpr):
    row = tl.program_id(0)
    t = tl.load(temperatures_ptr + row)
    seed = tl.load(seed_ptr)  # from memory, not an argument: a CUDA graph draws anew each replay
    c = tl.arange(0, CHUNKS_PAD)
    m = tl.load(max_ptr + row * chunks + c, mask=c < chunks, other=float("-inf"))
    # a chunk by its share, then a token inside it (the two draws use disjoint Philox offsets)
    if t > 0:
        philox = row.to(tl.int64) * (CHUNKS_PAD + BLOCK)  # this row's first Philox offset
        u = tl.rand(seed, philox + c)
        s = tl.load(sum_ptr + row * chunks + c, mask=c < chunks, other=1.0)
        chunk = tl.argmax(m + tl.log(s) - tl.log(-tl.log(u)), 0)
        tokens = chunk * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(logits_ptr + row.to(tl.int64) * stride_row + tokens, mask=tokens < vocab,
                    other=float("-inf")).to(tl.float32)
        u = tl.rand(seed, philox + CHUNKS_PAD + tl.arange(0, BLOCK))
        token = chunk * BLOCK + tl.argmax(x * (1 / t) - tl.log(-tl.log(u)), 0)
    else:
        token = tl.load(argmax_ptr + row * chunks + tl.argmax(m, 0))
    tl.store(token_ptr + row, token)


def gumbel_max_sample(logits: torch.Tensor, temperatures: torch.Tensor,
                      seed: int | torch.Tensor | None = None, block: int = 2048,
                      out: torch.Tensor | None = None) -> torch.Tensor:
    """One token per row of logits [B, vocab] (any float dtype) into `out` (int64 [B], or a new
    tensor): sampled at temperatures [B] float32, argmax where the temperature is 0. `seed` keys the
    noise: the same seed draws the same tokens; None draws one on the device (torch's generator),
    which a CUDA graph replays as a new draw each time (worker/cuda_graphs.py samples so); or an
    int64 tensor [1] on the device. With every temperature 0 it is torch.argmax(logits, -1), in
    two kernels that read the logits once (the model runner's greedy steps: on an H200 torch's
    argmax took 32 us for 185 rows of 151,936 logits, and a memset before it)."""
    rows, vocab = logits.shape
    if seed is None:
        seed = torch.randint(2**31 - 1, (1,), device=logits.device)
    elif isinstance(seed, int):
        seed = torch.full((1,), seed, dtype=torch.int64, device=logits.device)
    assert logits.stride(-1) == 1 and temperatures.shape == (rows,)
    chunks = triton.cdiv(vocab, block)
    # each in an allocation of its own: 16-byte aligned for any row count (a slice of one tensor
    # is not, and Triton compiles a kernel per pointer alignment, in the middle of a run)
    maxes = torch.empty(rows, chunks, dtype=torch.float32, device=logits.device)
    sums = torch.empty(rows, chunks, dtype=torch.float32, device=logits.device)
    argmax = torch.empty(rows, chunks, dtype=torch.int32, device=logits.device)
    token = out if out is not None else torch.empty(rows, dtype=torch.int64, device=logits.device)
    _chunk_stats_kernel[(rows, chunks)](logits, temperatures, maxes, sums, argmax, vocab,
                                        logits.stride(0), BLOCK=block)
    _pick_kernel[(rows,)](logits, temperatures, maxes, sums, argmax, token, seed, vocab,
                          chunks, logits.stride(0), BLOCK=block,
                          CHUNKS_PAD=triton.next_power_of_2(chunks))
    return token
