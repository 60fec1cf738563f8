"""Loading Hugging Face DeepSeek checkpoints (config.json + safetensors, sharded or not).

On-disk names are the Hugging Face ones. Three things differ from our parameters:

- routed experts are stored one per expert (``mlp.experts.{e}.{gate,up,down}_proj.weight``);
  we stack them into ``mlp.experts.gate_up_proj [E, 2I, D]`` and ``down_proj [E, D, I]``
  (already-stacked checkpoints load too);
- DeepSeek's own fp8 checkpoints store ``W`` as e4m3 with ``W.weight_scale_inv`` per 128x128
  block; we dequantize on load;
- multi-token-prediction layers (``model.layers.{n}`` with n >= num_hidden_layers) and rotary
  ``inv_freq`` buffers are not part of the model and are skipped;
- a model may rename on-disk keys: if it has a ``checkpoint_key(key)`` method, every key is
  passed through it first (None: skip the tensor). DeepSeek-V4's checkpoints use DeepSeek's
  own names (``layers.{i}.attn.wq_a.weight``, ...), see mlagraph.model.deepseek_v4.

Anything else missing, unexpected or mis-shaped raises one ValueError naming every offender.
"""

from __future__ import annotations

import json
import os
import re

import torch
from safetensors import safe_open
from tqdm.auto import tqdm

_EXPERT = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
_FP8_BLOCK = 128
_MAX_LISTED = 20
_CHECKPOINT_BUFFERS = ("e_score_correction_bias", "tid2eid")  # buffers a checkpoint holds (V4: hash routing)


def checkpoint_files(path: str | os.PathLike) -> list[str]:
    """The safetensors files of a checkpoint directory, from its index when sharded."""
    path = os.fspath(path)
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
    else:
        names = sorted(n for n in os.listdir(path) if n.endswith(".safetensors"))
    if not names:
        raise ValueError(f"from_pretrained: path: expected a directory with *.safetensors files, got {path!r}")
    return [os.path.join(path, n) for n in names]


def _dequant_fp8(w: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """DeepSeek fp8 weights: e4m3 [out, in] times a float32 scale per 128x128 block."""
    out_f, in_f = w.shape
    s = scale_inv.float().repeat_interleave(_FP8_BLOCK, 0)[:out_f].repeat_interleave(_FP8_BLOCK, 1)[:, :in_f]
    return w.float() * s


def load_checkpoint(model: torch.nn.Module, path: str | os.PathLike, *, progress: bool = True) -> None:
    """Copies every tensor of the checkpoint into ``model`` (in place, in the params' dtype)."""
    num_layers = model.config.num_hidden_layers
    params = dict(model.named_parameters())
    params.update({n: b for n, b in model.named_buffers() if n.endswith(_CHECKPOINT_BUFFERS)})
    rename = getattr(model, "checkpoint_key", None) or (lambda key: key)
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
                for disk_key in sorted(keys):
                    if disk_key.endswith("weight_scale_inv") or disk_key.endswith("rotary_emb.inv_freq"):
                        continue
                    key = rename(disk_key)
                    if key is None:
                        continue
                    m = _LAYER.match(key)
                    if m and int(m.group(1)) >= num_layers:
                        continue  # multi-token-prediction layers
                    tensor = f.get_tensor(disk_key)
                    if tensor.dtype == torch.float8_e4m3fn:
                        scale_key = disk_key + "_scale_inv"
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
