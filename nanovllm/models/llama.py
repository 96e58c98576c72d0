"""The Llama-family decoder (Llama 2/3, SmolLM2, Qwen2, Qwen3) in plain PyTorch.

Qwen2 adds a bias to the qkv projection, Qwen3 an RMSNorm on each query and key head; the rest is
the same pre-norm transformer. Attention is PagedAttention's two halves: `write` (rotary, then each
new token's K/V into the paged cache) and `read` (the pluggable backend, over the cache). On CUDA
the norms, the SwiGLU gate and the write are one Triton kernel each (nanovllm/kernels/).
"""
import torch
import torch.nn.functional as F
from torch import nn

from nanovllm.attention import AttentionBackend, AttentionMetadata
from nanovllm.attention.paged_attention import PagedAttention
from nanovllm.layers.linear import Embedding, Linear
from nanovllm.layers.norm import RMSNorm
from nanovllm.layers.rotary import RotaryEmbedding, rope_config


class Attention(nn.Module):
    def __init__(self, cfg: dict, backend: AttentionBackend, rotary: RotaryEmbedding,
                 qkv_bias: bool, qk_norm: bool):
        super().__init__()
        self.num_heads, self.num_kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
        self.head_dim = d = cfg["head_dim"]
        self.qkv_proj = Linear(cfg["hidden_size"], [self.num_heads * d, self.num_kv_heads * d,
                                                    self.num_kv_heads * d], bias=qkv_bias)
        self.o_proj = Linear(self.num_heads * d, cfg["hidden_size"])
        self.q_norm = RMSNorm(d, cfg["rms_norm_eps"]) if qk_norm else None
        self.k_norm = RMSNorm(d, cfg["rms_norm_eps"]) if qk_norm else None
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, rotary, backend)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, meta: AttentionMetadata):
        qkv = self.qkv_proj(x).view(-1, self.num_heads + 2 * self.num_kv_heads, self.head_dim)
        q = self.attn.write(qkv, positions, meta.slot_mapping, self.q_norm, self.k_norm)
        return self.o_proj(self.attn.read(q, meta).flatten(1))


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """SwiGLU's gate: silu(gate) * up on a packed [gate | up] tensor."""
    gate, up = x.chunk(2, -1)
    return F.silu(gate) * up


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_up_proj = Linear(hidden, [intermediate, intermediate])
        self.down_proj = Linear(intermediate, hidden)
        self.silu_and_mul = silu_and_mul
        if self.down_proj.weight.is_cuda:  # built on the GPU: one Triton kernel for the gate
            from nanovllm.kernels.elementwise import silu_and_mul as kernel
            self.silu_and_mul = kernel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.silu_and_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: dict, backend: AttentionBackend, rotary: RotaryEmbedding,
                 qkv_bias: bool, qk_norm: bool):
        super().__init__()
        self.self_attn = Attention(cfg, backend, rotary, qkv_bias, qk_norm)
        self.mlp = MLP(cfg["hidden_size"], cfg["intermediate_size"])
        self.input_layernorm = RMSNorm(cfg["hidden_size"], cfg["rms_norm_eps"])
        self.post_attention_layernorm = RMSNorm(cfg["hidden_size"], cfg["rms_norm_eps"])

    def forward(self, positions, x, residual, meta):
        x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(positions, x, meta)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class LlamaForCausalLM(nn.Module):
    # checkpoint name -> (parameter here, projection packed in it)
    packed_modules = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1),
                      "v_proj": ("qkv_proj", 2), "gate_proj": ("gate_up_proj", 0),
                      "up_proj": ("gate_up_proj", 1)}

    def __init__(self, cfg: dict, backend: AttentionBackend, qkv_bias: bool | None = None,
                 qk_norm: bool = False):
        super().__init__()
        qkv_bias = cfg.get("attention_bias", False) if qkv_bias is None else qkv_bias
        rotary = RotaryEmbedding(cfg["head_dim"], cfg["max_position_embeddings"], *rope_config(cfg))
        layers = [DecoderLayer(cfg, backend, rotary, qkv_bias, qk_norm)
                  for _ in range(cfg["num_hidden_layers"])]  # one rotary table for all
        self.model = nn.ModuleDict(dict(  # the checkpoint's names: model.layers.<i>.mlp, ...
            embed_tokens=Embedding(cfg["hidden_size"], cfg["vocab_size"]),
            layers=nn.ModuleList(layers),
            norm=RMSNorm(cfg["hidden_size"], cfg["rms_norm_eps"])))
        self.lm_head = Linear(cfg["hidden_size"], cfg["vocab_size"])
        if cfg.get("tie_word_embeddings", False):
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata):
        """Hidden states [num_tokens, hidden] of the new tokens; K/V go to the cache on the way."""
        x, residual = self.model.embed_tokens(input_ids), None
        for layer in self.model.layers:
            x, residual = layer(positions, x, residual, meta)
        return self.model.norm(x, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Logits [N, vocab] (None on tensor-parallel ranks other than 0)."""
        return self.lm_head(hidden)
