"""Piecewise CUDA graphs (vLLM v1's piecewise mode), for attention backends that a graph cannot
capture whole (AttentionBackend.cudagraph_support "decode" or "never": flash-attn's varlen kernel
and sdpa take a step's shapes from the host).

The forward pass is cut at its attention calls: the layers between two attention calls are one
graph each, and attention runs eagerly between the replays. While capturing, the graph stands in for
every layer's backend: it ends the piece, notes the layer's cache, and begins the next one.
"""
import torch

from nanovllm.kernels.compile_ahead import first_layer_only


class PiecewiseGraph:
    """A forward pass cut at its attention calls: one graph per piece, attention between them."""
    eager_attention = True  # CUDAGraphs.run hands it the step's metadata

    def __init__(self, runner, inputs: tuple, q: torch.Tensor, out: torch.Tensor, pool):
        """runner.forward(*inputs): the model, or its fused small-batch path. It stands in for the
        backend of each of the model's attention layers while capturing."""
        self.q, self.out, self.pool = q, out, pool
        # layers: (attention layer, its backend) after each graph but the last
        self.graphs, self.layers = [], []
        attns, forward = runner.kv_cache.attns, runner.forward
        backends = [attn.backend for attn in attns]
        for attn in attns:
            attn.backend = self  # the stand-in that cuts (see forward)
        try:
            self.capturing = False
            with first_layer_only(runner.model):  # warm up (kernels/compile_ahead.py)
                forward(*inputs)
            self.capturing = True
            torch.cuda.synchronize()
            with torch.cuda.stream(torch.cuda.Stream()):
                self._begin()
                self.hidden = forward(*inputs)
                self.graphs[-1].capture_end()
        finally:
            for attn, backend in zip(attns, backends):
                attn.backend = backend
        self.layers = [(k, v, backend) for (k, v), backend in zip(self.layers, backends)]

    def _begin(self):
        self.graphs.append(torch.cuda.CUDAGraph())
        self.graphs[-1].capture_begin(pool=self.pool)

    def forward(self, q, k_cache, v_cache, meta) -> torch.Tensor:
        """Stands in for the attention backend while capturing: end this piece, begin the next."""
        if self.capturing:
            self.q[:len(q)] = q
            self.graphs[-1].capture_end()
            self.layers.append((k_cache, v_cache))
            self._begin()
        return self.out[:len(q)]

    def replay(self, meta) -> torch.Tensor:
        n = meta.slot_mapping.shape[0]
        for graph, (k_cache, v_cache, backend) in zip(self.graphs, self.layers):
            graph.replay()
            self.out[:n] = backend.forward(self.q[:n], k_cache, v_cache, meta)
        self.graphs[-1].replay()
        return self.hidden
