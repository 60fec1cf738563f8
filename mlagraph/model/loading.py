"""Loading Hugging Face DeepSeek checkpoints (config.json + safetensors, sharded or not).

On-disk names are the Hugging Face ones. Three things differ from our parameters:

- routed experts are stored one per expert (``mlp.experts.{e}.{gate,up,down}_proj.weight``);
  we stack them into ``mlp.experts.gate_up_proj [E, 2I, D]`` and ``down_proj [E, D, I]``
  (already-stacked checkpoints load too);
- DeepSeek's own fp8 checkpoints store ``W`` as e4m3 with ``W.weight_scale_inv`` per 128x128
  block; we dequantize on load;
- multi-token-prediction layers (``model.layers.{n}`` with n >= num_hidden_layers) and rotary
  ``inv_freq`` buffers are not part of the model and are skipped.

Anything else missing, unexpected or mis-shaped raises one ValueError naming every offender.
"""

from __future__ import annotations

import os
import re

import torch
from safetensors import SafetensorError, safe_open
from tqdm.auto import tqdm

from .config import read_json

_EXPERT = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
_FP8_BLOCK = 128
_MAX_LISTED = 20


_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def checkpoint_dir(path) -> str:
    """``path`` as a local checkpoint directory with a config.json, or a ValueError that says
    what it is instead (only local directories load: nothing is downloaded)."""
    if not isinstance(path, (str, os.PathLike)):
        raise ValueError(f"from_pretrained: path: expected a local directory (str or os.PathLike), got {path!r}")
    path = os.fspath(path)
    if os.path.isfile(path):
        raise ValueError(
            f"from_pretrained: path: expected a checkpoint directory, got the file {path!r}; "
            f"pass the directory that holds it ({os.path.dirname(os.path.abspath(path))!r})"
        )
    if not os.path.isdir(path):
        hint = ""
        if _HUB_ID.match(path):
            hint = (" It looks like a Hugging Face Hub id: only local directories load (nothing is downloaded);"
                    " download it first, for example with huggingface_hub.snapshot_download, and pass that directory.")
        raise ValueError(f"from_pretrained: path: expected a local checkpoint directory, got {path!r}, which does not exist.{hint}")
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ValueError(f"from_pretrained: path: expected a checkpoint directory with a config.json, got {path!r} without one")
    return path


def checkpoint_files(path: str | os.PathLike) -> list[str]:
    """The safetensors files of a checkpoint directory, from its index when sharded."""
    path = os.fspath(path)
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        contents = read_json(index)
        weight_map = contents.get("weight_map") if isinstance(contents, dict) else None
        if not isinstance(weight_map, dict):
            raise ValueError(f"from_pretrained: {index!r}: expected a 'weight_map' object, got {weight_map!r:.80}")
        names = sorted(set(weight_map.values()))
        absent = [n for n in names if not os.path.isfile(os.path.join(path, n))]
        if absent:
            raise ValueError(f"from_pretrained: {index!r} names shard(s) that are not in the directory: {absent}")
    else:
        names = sorted(n for n in os.listdir(path) if n.endswith(".safetensors"))
    if not names:
        raise ValueError(f"from_pretrained: path: expected a directory with *.safetensors files, got {path!r}")
    return [os.path.join(path, n) for n in names]


def check_shards(files: list[str]) -> None:
    """Opens every shard's header before any weight is read, so a truncated or corrupt file is
    named up front (safetensors' own error names no file)."""
    for file in files:
        try:
            with safe_open(file, framework="pt"):
                pass
        except (SafetensorError, OSError) as e:
            raise ValueError(f"from_pretrained: {file!r}: expected a complete safetensors file, got: {e} "
                             f"(truncated or interrupted download?)") from None


def _dequant_fp8(w: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """DeepSeek fp8 weights: e4m3 [out, in] times a float32 scale per 128x128 block."""
    out_f, in_f = w.shape
    s = scale_inv.float().repeat_interleave(_FP8_BLOCK, 0)[:out_f].repeat_interleave(_FP8_BLOCK, 1)[:, :in_f]
    return w.float() * s


def load_checkpoint(model: torch.nn.Module, path: str | os.PathLike, *, progress: bool = True) -> None:
    """Copies every tensor of the checkpoint into ``model`` (in place, in the params' dtype)."""
    num_layers = model.config.num_hidden_layers
    params = dict(model.named_parameters())
    params.update({n: b for n, b in model.named_buffers() if n.endswith("e_score_correction_bias")})
    tied = model.config.tie_word_embeddings
    expected = set(params) - ({"lm_head.weight"} if tied else set())
    loaded: set[str] = set()
    experts_seen: dict[str, set[tuple[int, str]]] = {}
    unexpected, misshaped = [], []

    files = checkpoint_files(path)
    # A weight's fp8 scale may sit in another shard than the weight itself.
    scale_files: dict[str, str] = {}
    for file in files:
        with safe_open(file, framework="pt") as f:
            scale_files.update((k, file) for k in f.keys() if k.endswith("_scale_inv"))
    with tqdm(total=len(files), desc="loading checkpoint", unit="file", disable=not progress) as bar:
        for file in files:
            with safe_open(file, framework="pt") as f:
                keys = set(f.keys())
                for key in sorted(keys):
                    if key.endswith("weight_scale_inv") or key.endswith("rotary_emb.inv_freq"):
                        continue
                    m = _LAYER.match(key)
                    if m and int(m.group(1)) >= num_layers:
                        continue  # multi-token-prediction layers
                    tensor = f.get_tensor(key)
                    if tensor.dtype == torch.float8_e4m3fn:
                        scale_key = key + "_scale_inv"
                        if scale_key in keys:
                            scale = f.get_tensor(scale_key)
                        elif scale_key in scale_files:
                            with safe_open(scale_files[scale_key], framework="pt") as g:
                                scale = g.get_tensor(scale_key)
                        else:
                            raise ValueError(f"from_pretrained: fp8 weight {key!r} has no {scale_key!r} in {path!r}")
                        tensor = _dequant_fp8(tensor, scale)
                    em = _EXPERT.match(key)
                    if em:
                        prefix, e, which = em.group(1), int(em.group(2)), em.group(3)
                        if _copy_expert(params, prefix, e, which, tensor, key, misshaped, unexpected):
                            experts_seen.setdefault(prefix, set()).add((e, which))
                        continue
                    if key not in params:
                        unexpected.append(key)
                        continue
                    if tuple(tensor.shape) != tuple(params[key].shape):
                        misshaped.append(f"{key}: expected {list(params[key].shape)}, got {list(tensor.shape)}")
                        loaded.add(key)  # reported as mis-shaped, not again as missing
                        continue
                    with torch.no_grad():
                        params[key].copy_(tensor)
                    loaded.add(key)
            bar.update(1)

    # A stacked expert tensor counts as loaded once every expert's pieces arrived.
    for prefix, seen in experts_seen.items():
        E = params[f"{prefix}.gate_up_proj"].shape[0]
        for name, parts in (("gate_up_proj", ("gate_proj", "up_proj")), ("down_proj", ("down_proj",))):
            if all((e, p) in seen for e in range(E) for p in parts):
                loaded.add(f"{prefix}.{name}")
            else:
                gaps = [f"{prefix}.{e}.{p}.weight" for e in range(E) for p in parts if (e, p) not in seen]
                misshaped.append(f"{prefix}.{name}: missing experts {gaps[:4]}{' ...' if len(gaps) > 4 else ''}")
                loaded.add(f"{prefix}.{name}")  # reported above, not again as missing
    missing = sorted(expected - loaded)
    problems = []
    for title, items in (("missing", missing), ("unexpected", sorted(unexpected)), ("mis-shaped", misshaped)):
        if items:
            listed = "\n    ".join(items[:_MAX_LISTED])
            more = f"\n    ... and {len(items) - _MAX_LISTED} more" if len(items) > _MAX_LISTED else ""
            problems.append(f"  {len(items)} {title} weight(s):\n    {listed}{more}")
    if problems:
        raise ValueError(f"from_pretrained: checkpoint {os.fspath(path)!r} does not match the model:\n" + "\n".join(problems))


def _copy_expert(params, prefix, e, which, tensor, key, misshaped, unexpected) -> bool:
    gate_up, down = params.get(f"{prefix}.gate_up_proj"), params.get(f"{prefix}.down_proj")
    if gate_up is None or e >= gate_up.shape[0]:
        unexpected.append(key)
        return False
    inter = down.shape[2]
    dst = {"gate_proj": gate_up[e, :inter], "up_proj": gate_up[e, inter:], "down_proj": down[e]}[which]
    if tuple(tensor.shape) != tuple(dst.shape):
        misshaped.append(f"{key}: expected {list(dst.shape)}, got {list(tensor.shape)}")
        return True  # seen (and reported), so not reported again as a missing expert
    with torch.no_grad():
        dst.copy_(tensor)
    return True
