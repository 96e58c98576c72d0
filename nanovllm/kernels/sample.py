"""Sampling on the GPU in one read of the logits: the Gumbel-max trick, one program per (row, chunk).

argmax(logits / T + g), with g = -log(-log u) and u ~ U[0, 1) drawn independently per token, picks token i
with probability softmax(logits / T)_i. Each program draws the noise of its chunk of the vocabulary (Philox,
keyed by a per-call seed and the element's index: the random numbers, not the memory, bound its time) and
keeps the chunk's best score and token; a second, tiny pass picks each row's best chunk. Rows with T = 0 take the plain argmax. The chunks give every SM work even
for a batch of one row, which a reduction with one program per row would not.
"""
import torch
import triton
import triton.language as tl


@triton.jit(do_not_specialize=["seed"])
def _gumbel_max_kernel(logits_ptr, temperatures_ptr, best_ptr, token_ptr, seed, vocab, stride_row,
                       BLOCK: tl.constexpr):
    row, chunk = tl.program_id(0), tl.program_id(1)
    t = tl.load(temperatures_ptr + row)
    lanes = tl.arange(0, BLOCK // 4)
    # Philox makes 4 numbers per call: the chunk is 4 quarters, each taking one of them (a different number for
    # every element of the batch)
    u = tl.rand4x(seed, (row.to(tl.int64) * tl.num_programs(1) + chunk) * (BLOCK // 4) + lanes)
    best, token = float("-inf"), 0
    for quarter in tl.static_range(4):
        tokens = chunk * BLOCK + quarter * (BLOCK // 4) + lanes
        x = tl.load(logits_ptr + row.to(tl.int64) * stride_row + tokens, mask=tokens < vocab,
                    other=float("-inf")).to(tl.float32)
        if t > 0:
            x = x / t - tl.log(-tl.log(u[quarter]))
        top = tl.max(x, 0)
        token = tl.where(top > best, chunk * BLOCK + quarter * (BLOCK // 4) + tl.argmax(x, 0), token)
        best = tl.maximum(top, best)
    out = row * tl.num_programs(1) + chunk
    tl.store(best_ptr + out, best)
    tl.store(token_ptr + out, token)


def gumbel_max_sample(logits: torch.Tensor, temperatures: torch.Tensor, seed: int, block: int = 2048) -> torch.Tensor:
    """One token per row of logits [B, vocab] (any float dtype): sampled at temperatures [B] float32, argmax
    where the temperature is 0. `seed` keys the noise: the same seed draws the same tokens."""
    rows, vocab = logits.shape
    assert logits.stride(-1) == 1 and temperatures.shape == (rows,)
    chunks = triton.cdiv(vocab, block)
    best = torch.empty(rows, chunks, dtype=torch.float32, device=logits.device)
    token = torch.empty(rows, chunks, dtype=torch.int64, device=logits.device)
    _gumbel_max_kernel[(rows, chunks)](logits, temperatures, best, token, seed, vocab, logits.stride(0), BLOCK=block)
    return token.gather(1, best.argmax(1, keepdim=True)).squeeze(1)
