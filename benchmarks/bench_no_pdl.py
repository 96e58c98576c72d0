"""bench.py with the fused decode GEMVs launched without programmatic dependent launch."""
import runpy
import sys

import nanovllm.layers.fused_decode as fused_decode

fused_decode.use_pdl = lambda device: False
sys.argv = ["bench.py", *sys.argv[1:]]
runpy.run_path("bench.py", run_name="__main__")
