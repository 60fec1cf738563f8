"""Loading Hugging Face DeepSeek checkpoints (config.json + safetensors, sharded or not).

On-disk names are the Hugging Face ones. Three things differ from our parameters:

- routed experts are stored one per expert (``mlp.experts.{e}.{gate,up,down}_proj.weight``);
  we stack them into ``mlp.experts.gate_up_proj [E, 2I, D]`` and ``down_proj [E, D, I]``
  (already-stacked checkpoints load too);
- DeepSeek's own fp8 checkpoints store ``W`` as e4m3 with ``W.weight_scale_inv`` per 128x128
  block; those stay e4m3 (fp8_weights.py says which layers, and when) or are dequantized on load;
- the multi-token-prediction layer ``model.layers.{n}`` (n = num_hidden_layers) loads as
  ``mtp.*`` when the model has one (mlagraph.model.mtp), without its ``embed_tokens`` and
  ``shared_head.head``: DeepSeek stores copies of the main model's there, and the layer uses
  the main model's. Further MTP layers (n + 1, ...; DeepSeek ships one) and rotary
  ``inv_freq`` buffers are skipped;
- a model may rename on-disk keys: if it has a ``checkpoint_key(key)`` method, every key is
  passed through it first (None: skip the tensor). DeepSeek-V4's checkpoints use DeepSeek's
  own names (``layers.{i}.attn.wq_a.weight``, ...), see mlagraph.model.deepseek_v4;
- a tensor-parallel model (``model.parallel.world`` > 1) gets its rank's slice of each split
  weight, read as a slice from the file (safetensors' ``get_slice``), and only its own experts.

Anything else missing, unexpected or mis-shaped raises one ValueError naming every offender.
"""

from __future__ import annotations

import os
import re

import torch
from safetensors import SafetensorError, safe_open
from torch import nn
from tqdm.auto import tqdm

from ..ops.fp8 import FP8_BLOCK, FP8_DTYPE, dequantize_blockwise
from .config import read_config_file, read_json
from .fp8_weights import (DEQUANTIZED_AT_LOAD, fp8_linear_for, keep_experts_fp8, keeps_fp8, slice_keeps_blocks,
                          slice_scales)
from .parallel import SINGLE, local_slice

_EXPERT = re.compile(r"^((?:model\.layers\.\d+|mtp)\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
_MAX_LISTED = 20
_CHECKPOINT_BUFFERS = ("e_score_correction_bias", "tid2eid")  # buffers a checkpoint holds (V4: hash routing)
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


def has_mtp_weights(files: list[str], num_layers: int) -> bool:
    """Whether the checkpoint holds the multi-token-prediction layer ``model.layers.{num_layers}``
    (transformers' save_pretrained drops it but keeps ``num_nextn_predict_layers``)."""
    prefix = f"model.layers.{num_layers}."
    for file in files:
        with safe_open(file, framework="pt") as f:
            if any(k.startswith(prefix) for k in f.keys()):
                return True
    return False


def _our_key(key: str, num_layers: int, mtp: bool) -> str | None:
    """Our name for a checkpoint key (after the model's own renaming); None: not loaded."""
    m = _LAYER.match(key)
    if not m or int(m.group(1)) < num_layers:
        return key
    if not mtp or int(m.group(1)) > num_layers:
        return None  # an MTP layer the model does not run
    rest = key[m.end():]
    if rest.startswith(("embed_tokens.", "shared_head.head.")):
        return None  # copies of the main model's embedding and head, which the MTP layer uses
    return "mtp." + rest


def _dequantized_at_load(key: str) -> bool:
    """Whether the linear layer holding weight ``key`` stays in the model dtype (its weight is
    read directly by the model, see fp8_weights.DEQUANTIZED_AT_LOAD)."""
    return key.removesuffix(".weight").rsplit(".", 1)[-1] in DEQUANTIZED_AT_LOAD


def _keep_fp8_layers(model: nn.Module, fp8_keys: set[str]) -> set[str]:
    """Turns the layers holding these fp8 checkpoint weights into fp8 ones (Fp8Linear, fp8
    experts); returns the checkpoint keys that now load as e4m3. Keys naming no layer of the
    model are left to the loader to report."""
    kept = set()
    for key in sorted(fp8_keys):
        em = _EXPERT.match(key)
        owner = em.group(1) if em else key.removesuffix(".weight")
        try:
            module = model.get_submodule(owner)
        except AttributeError:
            continue
        if em and hasattr(module, "gate_up_proj"):
            if isinstance(module.gate_up_proj, nn.Parameter):  # the layer's first fp8 expert
                keep_experts_fp8(module)
            kept.add(key)
        elif not em and isinstance(module, nn.Linear) and not _dequantized_at_load(key):
            parent, _, child = owner.rpartition(".")
            setattr(model.get_submodule(parent), child, fp8_linear_for(module))
            kept.add(key)
    return kept


def _split_off_blocks(files: list[str], fp8_names: dict[str, str | None], ps) -> set[str]:
    """Our keys of the fp8 weights whose slices are not whole scale blocks (tensor parallel;
    experts are never sliced): those cannot stay fp8. The same set on every rank.
    ``fp8_names``: each fp8 weight's disk key -> our key (None: not ours)."""
    if ps.world == 1:
        return set()
    out = set()
    for file in files:
        with safe_open(file, framework="pt") as f:
            for disk_key in f.keys():
                key = fp8_names.get(disk_key)
                if key is None or _EXPERT.match(key) or _dequantized_at_load(key):
                    continue  # experts are never sliced; those layers are dequantized anyway
                if not slice_keeps_blocks(local_slice(key, f.get_slice(disk_key).get_shape(), ps)):
                    out.add(key)
    return out


def load_checkpoint(
    model: nn.Module, path: str | os.PathLike, *, progress: bool = True, fp8_weights: str = "auto",
    dtype: torch.dtype = torch.float32,
) -> None:
    """Copies every tensor of the checkpoint into ``model`` (in place, in the params' dtype;
    fp8 weights as e4m3 when ``fp8_weights`` keeps them, see fp8_weights.keeps_fp8)."""
    num_layers = model.config.num_hidden_layers
    files = checkpoint_files(path)
    # A weight's fp8 scale may sit in another shard than the weight itself.
    scale_files: dict[str, str] = {}
    for file in files:
        with safe_open(file, framework="pt") as f:
            scale_files.update((k, file) for k in f.keys() if k.endswith("_scale_inv"))
    rename = getattr(model, "checkpoint_key", None) or (lambda key: key)
    has_mtp = getattr(model, "mtp", None) is not None

    def ours(disk_key: str) -> str | None:
        key = rename(disk_key)
        return None if key is None else _our_key(key, num_layers, has_mtp)

    # (the model's own renaming is not applied here: as before, fp8 layers are found by disk name)
    fp8_names = {k.removesuffix("_scale_inv"): _our_key(k.removesuffix("_scale_inv"), num_layers, has_mtp)
                 for k in scale_files}
    fp8_keys = set(fp8_names.values()) - {None}
    kept: set[str] = set()
    ps = getattr(model, "parallel", SINGLE)
    if keeps_fp8(fp8_weights, read_config_file(path), bool(fp8_keys), dtype):
        split = _split_off_blocks(files, fp8_names, ps)
        if split and fp8_weights == "keep":
            raise ValueError(
                f"from_pretrained: fp8_weights='keep' with tensor_parallel_size={ps.world}: the slices of "
                f"{sorted(split)[:4]}{' ...' if len(split) > 4 else ''} are not whole {FP8_BLOCK}x{FP8_BLOCK} "
                f"blocks (each rank's rows or columns must be a multiple of {FP8_BLOCK}), so their scales cannot "
                "be split with them; pass fp8_weights='auto' (those are dequantized at load, the rest stay fp8) "
                "or another tensor_parallel_size"
            )
        kept = _keep_fp8_layers(model, fp8_keys - split)

    params = dict(model.named_parameters())
    params.update(
        {n: b for n, b in model.named_buffers()
         if n.endswith(_CHECKPOINT_BUFFERS) or n.endswith("_scale_inv") or b.dtype == FP8_DTYPE}
    )
    # expert parallel: each MoE layer's first local expert and how many it holds
    first_expert = {f"{n}.experts": m.first_expert for n, m in model.named_modules()
                    if getattr(m, "first_expert", None) is not None}
    local_experts = {n.removesuffix(".gate_up_proj"): p.shape[0] for n, p in params.items()
                     if n.endswith("experts.gate_up_proj")}
    tied = model.config.tie_word_embeddings
    expected = set(params) - ({"lm_head.weight"} if tied else set())
    loaded: set[str] = set()
    experts_seen: dict[str, set[tuple[int, str]]] = {}
    unexpected, misshaped = [], []
    with tqdm(total=len(files), desc="loading checkpoint", unit="file", disable=not progress) as bar:
        for file in files:
            with safe_open(file, framework="pt") as f:
                keys = set(f.keys())
                for disk_key in sorted(keys):
                    if disk_key.endswith("weight_scale_inv") or disk_key.endswith("rotary_emb.inv_freq"):
                        continue
                    key = ours(disk_key)
                    if key is None:
                        continue
                    em = _EXPERT.match(key)
                    if em and ps.world > 1:
                        e = int(em.group(2)) - first_expert.get(em.group(1), 0)
                        if not 0 <= e < local_experts.get(em.group(1), 0):
                            continue  # another rank's expert: not read
                        key = f"{em.group(1)}.{e}.{em.group(3)}.weight"
                        em = _EXPERT.match(key)  # with the local index
                    tensor, scale = _read(f, disk_key, key, ps), None
                    if tensor.dtype == FP8_DTYPE:
                        scale_key = disk_key + "_scale_inv"
                        if scale_key in keys:
                            scale = f.get_tensor(scale_key)
                        elif scale_key in scale_files:
                            with safe_open(scale_files[scale_key], framework="pt") as g:
                                scale = g.get_tensor(scale_key)
                        else:
                            raise ValueError(f"from_pretrained: fp8 weight {key!r} has no {scale_key!r} in {path!r}")
                        sl = None if em else local_slice(key, tensor.shape, ps)  # read whole: its scales tile it
                        if key not in kept:
                            tensor, scale = dequantize_blockwise(tensor, scale.float(), torch.float32), None
                            tensor = tensor if sl is None else tensor.narrow(*sl)
                        elif sl is not None:  # this rank's rows or columns, and their blocks' scales
                            tensor, scale = tensor.narrow(*sl), slice_scales(scale, sl)
                    if tensor.dtype != FP8_DTYPE and key in kept:  # its scale said fp8: its layer was made fp8
                        misshaped.append(
                            f"{key}: expected dtype float8_e4m3fn (it has a weight_scale_inv), got {tensor.dtype}"
                        )
                        if em:  # reported here, not again as a missing expert
                            experts_seen.setdefault(em.group(1), set()).add((int(em.group(2)), em.group(3)))
                        else:
                            loaded.update((key, key + "_scale_inv"))
                        continue
                    if em:
                        prefix, e, which = em.group(1), int(em.group(2)), em.group(3)
                        if _copy_expert(params, prefix, e, which, tensor, scale, key, misshaped, unexpected):
                            experts_seen.setdefault(prefix, set()).add((e, which))
                        continue
                    if key not in params:
                        unexpected.append(key)
                        continue
                    targets = [(key, tensor)] + ([(key + "_scale_inv", scale)] if scale is not None else [])
                    loaded.update(k for k, _ in targets)  # a mis-shaped one is not reported again as missing
                    bad = [f"{k}: expected {list(params[k].shape)}, got {list(t.shape)}"
                           for k, t in targets if tuple(t.shape) != tuple(params[k].shape)]
                    if bad:
                        misshaped.extend(bad)
                        continue
                    with torch.no_grad():
                        for k, t in targets:
                            params[k].copy_(t)
            bar.update(1)

    # A stacked expert tensor counts as loaded once every expert's pieces arrived.
    for prefix, seen in experts_seen.items():
        E = params[f"{prefix}.gate_up_proj"].shape[0]
        for name, parts in (("gate_up_proj", ("gate_proj", "up_proj")), ("down_proj", ("down_proj",))):
            # reported below if incomplete, not again as missing; fp8 scales arrive with their weights
            loaded.update(k for k in (f"{prefix}.{name}", f"{prefix}.{name}_scale_inv") if k in params)
            if not all((e, p) in seen for e in range(E) for p in parts):
                gaps = [f"{prefix}.{e}.{p}.weight" for e in range(E) for p in parts if (e, p) not in seen]
                misshaped.append(f"{prefix}.{name}: missing experts {gaps[:4]}{' ...' if len(gaps) > 4 else ''}")
    missing = sorted(expected - loaded)
    problems = []
    for title, items in (("missing", missing), ("unexpected", sorted(unexpected)), ("mis-shaped", misshaped)):
        if items:
            listed = "\n    ".join(items[:_MAX_LISTED])
            more = f"\n    ... and {len(items) - _MAX_LISTED} more" if len(items) > _MAX_LISTED else ""
            problems.append(f"  {len(items)} {title} weight(s):\n    {listed}{more}")
    if problems:
        raise ValueError(f"from_pretrained: checkpoint {os.fspath(path)!r} does not match the model:\n" + "\n".join(problems))


def _read(f, disk_key: str, key: str, ps) -> torch.Tensor:
    """The tensor at ``disk_key``, or this rank's slice of it when ``key`` is split across
    ranks (only that slice is read). fp8 weights are read whole: their block scales tile them."""
    if ps.world == 1 or _EXPERT.match(key):  # one expert's weight is read whole by the rank that holds it
        return f.get_tensor(disk_key)
    sliced = f.get_slice(disk_key)
    sl = local_slice(key, sliced.get_shape(), ps) if sliced.get_dtype() not in ("F8_E4M3", "float8_e4m3fn") else None
    if sl is None:
        return f.get_tensor(disk_key)
    dim, start, n = sl
    return sliced[tuple([slice(None)] * dim + [slice(start, start + n)])]


def _copy_expert(params, prefix, e, which, tensor, scale, key, misshaped, unexpected) -> bool:
    """One expert's gate/up/down weight (and, for fp8 experts, its block scales) into the stack."""
    gate_up, down = params.get(f"{prefix}.gate_up_proj"), params.get(f"{prefix}.down_proj")
    if gate_up is None or e >= gate_up.shape[0]:
        unexpected.append(key)
        return False
    inter = down.shape[2]
    dst = {"gate_proj": gate_up[e, :inter], "up_proj": gate_up[e, inter:], "down_proj": down[e]}[which]
    targets = [(dst, tensor)]
    if scale is not None:  # fp8 experts: inter is a multiple of 128 (keep_experts_fp8 checked)
        gs, ds = params[f"{prefix}.gate_up_proj_scale_inv"], params[f"{prefix}.down_proj_scale_inv"]
        blocks = inter // FP8_BLOCK
        targets.append(({"gate_proj": gs[e, :blocks], "up_proj": gs[e, blocks:], "down_proj": ds[e]}[which], scale))
    for d, t in targets:
        if tuple(t.shape) != tuple(d.shape):
            misshaped.append(f"{key}{'' if d is dst else '_scale_inv'}: expected {list(d.shape)}, got {list(t.shape)}")
            return True  # seen (and reported), so not reported again as a missing expert
    with torch.no_grad():
        for d, t in targets:
            d.copy_(t)
    return True
