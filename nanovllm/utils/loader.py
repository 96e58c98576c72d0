"""Loading weights: every safetensors file of the model directory, through each parameter's
weight_loader."""
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch import nn


def load_model(model: nn.Module, path: str):
    """Copy the checkpoint in `path` into model, sharding and packing as the parameters ask; a
    ValueError naming the file and the tensor for a file that does not read, a tensor of the wrong
    shape, or one that holds NaN or inf."""
    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise ValueError(f"model={path!r} has no *.safetensors files")
    params = dict(model.named_parameters())
    loaded = set()
    for file in files:
        try:
            with safe_open(file, "pt", "cpu") as f:
                for name in f.keys():
                    if "rotary_emb.inv_freq" not in name:
                        loaded.add(load_tensor(model, params, name, f.get_tensor(name)))
        except (OSError, SafetensorError) as e:
            raise ValueError(f"{file} does not read as safetensors ({e}): truncated, or not a "
                             "checkpoint?") from None
        except ValueError as e:
            raise ValueError(f"{file}: {e}") from None
    if missing := sorted(set(params) - loaded):
        raise ValueError(f"checkpoint in {path!r} lacks {len(missing)} tensors: {missing[:5]}")


def load_tensor(model: nn.Module, params: dict, name: str, tensor) -> str:
    """Copy one checkpoint tensor into its parameter (or its shard of a packed one); the parameter's
    name."""
    target, shard = name, None
    for ckpt, (ours, shard_id) in getattr(model, "packed_modules", {}).items():
        if f".{ckpt}." in name:
            target, shard = name.replace(f".{ckpt}.", f".{ours}."), shard_id
            break
    param = params.get(target)
    if param is None:
        if name == "lm_head.weight":  # tied: the embedding already holds it
            return target
        raise ValueError(f"tensor {name!r} has no parameter in {type(model).__name__}")
    tensor = tensor.to(param.device)  # checked there: a GPU checks a model in milliseconds
    if tensor.is_floating_point() and not torch.isfinite(tensor).all():
        raise ValueError(f"tensor {name!r} holds NaN or inf")
    loader = getattr(param, "weight_loader", lambda param, loaded: param.data.copy_(loaded))
    try:
        loader(param, tensor) if shard is None else loader(param, tensor, shard)
    except RuntimeError:
        raise ValueError(f"tensor {name!r} of shape {list(tensor.shape)} does not fit {target} "
                         f"of shape {list(param.shape)}") from None
    return target
