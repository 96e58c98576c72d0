"""The model's forward for steps of a few rows (batch-1 decoding), each layer in 7 kernels
instead of 10.

Each decoder layer of nanovllm/models/llama.py, step for step, with each norm and the SwiGLU gate
moved into the prologue of the projection after it (nanovllm/kernels/gemv.py): RMSNorm + residual
add + qkv, rotary + KV store, attention, o_proj, RMSNorm + residual add + gate_up, silu(gate) * up +
down. The model runner takes this path on CUDA for steps of at most MAX_STEP_ROWS tokens
(ModelRunner.forward), where every kernel launches with PDL (kernels/pdl.py). On an H200 a layer
of Qwen3-0.6B took 29 us instead of 43 at 1 row, 34 instead of 45 at 2 (the GEMVs alone with PDL);
at 4 rows it is no faster and at 8 slower (each program holds M times the accumulators). Its
logits are the plain layer's within bf16 noise: both are 4e-2 of the largest logit from a float32
run.
"""
import torch
import torch.distributed as dist

from nanovllm.kernels.gemv import MAX_ROWS, NORM, SILU, gemv

MAX_STEP_ROWS = 2  # the rows up to which this path is faster (at most the kernels' MAX_ROWS)
assert MAX_STEP_ROWS <= MAX_ROWS


def project(linear, x, **prologue):
    """linear(a) for a made from x by the gemv prologue; a row-parallel shard all-reduces."""
    y, residual = gemv(x, linear.weight, linear.bias, **prologue)
    if hasattr(linear, "group"):  # RowParallel (layers/tensor_parallel.py): partial sums
        dist.all_reduce(y, group=linear.group)
    return y, residual


def decode_layer(layer, positions: torch.Tensor, x: torch.Tensor, residual, meta):
    """DecoderLayer.forward (x [M <= MAX_ROWS, hidden]) with fused GEMVs: (output, new residual)."""
    attn, mlp = layer.self_attn, layer.mlp
    norm = layer.input_layernorm
    qkv, residual = project(attn.qkv_proj, x, prologue=NORM, residual=residual,
                            norm_weight=norm.weight, eps=norm.eps)
    qkv = qkv.view(-1, attn.num_heads + 2 * attn.num_kv_heads, attn.head_dim)
    q = attn.attn.write(qkv, positions, meta.slot_mapping, attn.q_norm, attn.k_norm)
    x, _ = project(attn.o_proj, attn.attn.read(q, meta).flatten(1))
    norm = layer.post_attention_layernorm
    gate_up, residual = project(mlp.gate_up_proj, x, prologue=NORM, residual=residual,
                                norm_weight=norm.weight, eps=norm.eps)
    return project(mlp.down_proj, gate_up, prologue=SILU)[0], residual


def forward(model, input_ids: torch.Tensor, positions: torch.Tensor, meta):
    """LlamaForCausalLM.forward for a step of at most MAX_STEP_ROWS tokens, layer by layer."""
    x, residual = model.model.embed_tokens(input_ids), None
    for layer in model.model.layers:
        x, residual = decode_layer(layer, positions, x, residual, meta)
    return model.model.norm(x, residual)[0]
