"""from_pretrained / from_config reject what they cannot load at once, with errors that name
the argument or file, what was expected and what was got; and they read the checkpoint's
tokenizer and end-of-sequence ids."""

from __future__ import annotations

import json
import os
import re
import shutil

import pytest
import torch

from mlagraph.model import DeepseekForCausalLM

from .conftest import hf_config
from .tiny_tokenizer import write_tokenizer


def _load(path, **kw):
    return DeepseekForCausalLM.from_pretrained(path, progress=False, **kw)


@pytest.fixture
def ckpt(hf_checkpoint, tmp_path):
    """A private copy of the v3 checkpoint, free to damage."""
    _, path = hf_checkpoint("v3")
    return shutil.copytree(path, tmp_path / "ckpt")


def test_hub_id_says_only_local_directories_load():
    with pytest.raises(ValueError, match=r"path: expected a local checkpoint directory, got 'deepseek-ai/DeepSeek-V3',"
                                         r" which does not exist\. It looks like a Hugging Face Hub id: only local"):
        _load("deepseek-ai/DeepSeek-V3")


def test_missing_directory_is_named(tmp_path):
    with pytest.raises(ValueError, match=re.escape(f"got {str(tmp_path / 'nope')!r}, which does not exist.") + "$"):
        _load(tmp_path / "nope")


def test_path_to_config_json_names_its_directory(ckpt):
    with pytest.raises(ValueError, match=rf"expected a checkpoint directory, got the file .*config.json'; pass the "
                                         rf"directory that holds it \({re.escape(repr(str(ckpt)))}\)"):
        _load(ckpt / "config.json")


def test_directory_without_config_json(tmp_path):
    with pytest.raises(ValueError, match=r"expected a checkpoint directory with a config.json, got .* without one"):
        _load(tmp_path)


def test_invalid_config_json_names_the_file_and_line(ckpt):
    (ckpt / "config.json").write_text('{\n  "model_type": "deepseek_v3",\n  oops\n}')
    with pytest.raises(ValueError, match=r"config.json': expected valid JSON, got a parse error at line 3 column 3"):
        _load(ckpt)


def test_truncated_shard_is_named_before_any_weight_is_read(ckpt):
    shard = ckpt / "model.safetensors"
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match=rf"{re.escape(repr(str(shard)))}: expected a complete safetensors file, got: "
                                         r".*\(truncated or interrupted download\?\)"):
        _load(ckpt)


def test_index_naming_an_absent_shard(hf_checkpoint, tmp_path):
    hf, _ = hf_checkpoint("v3")
    hf.save_pretrained(tmp_path, max_shard_size="40KB")
    shards = sorted(n for n in os.listdir(tmp_path) if n.endswith(".safetensors"))
    os.remove(tmp_path / shards[1])
    with pytest.raises(ValueError, match=rf"index.json' names shard\(s\) that are not in the directory: \['{shards[1]}'\]"):
        _load(tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text("[1, 2")
    with pytest.raises(ValueError, match=r"index.json': expected valid JSON"):
        _load(tmp_path)


def test_dtype_by_name(ckpt):
    model = _load(ckpt, dtype="bfloat16")
    assert model.lm_head.weight.dtype == torch.bfloat16 and model.dtype == torch.bfloat16
    assert DeepseekForCausalLM.from_config(hf_config("v3"), dtype="torch.float16").dtype == torch.float16


@pytest.mark.parametrize("dtype", ["bfloat", "int8", torch.int32, 3])
def test_bad_dtype_is_named(ckpt, dtype):
    with pytest.raises(ValueError, match=rf"dtype: expected a torch floating dtype or one of \[.*\], got {re.escape(repr(dtype))}"):
        _load(ckpt, dtype=dtype)
    with pytest.raises(ValueError, match=r"dtype: expected"):
        DeepseekForCausalLM.from_config(hf_config("v3"), dtype=dtype)


def test_bad_device_is_named(ckpt):
    with pytest.raises(ValueError, match=r"device: expected a torch device or its name .*, got 'gpu0'"):
        _load(ckpt, device="gpu0")


def test_fp8_ds_needs_kv_lora_rank_multiple_of_128_at_load(ckpt):
    assert hf_config("v3").kv_lora_rank == 32
    with pytest.raises(ValueError, match=r"kv_cache_dtype: 'fp8_ds' .* expects kv_lora_rank a multiple of 128 \(512 for "
                                         r"DeepSeek\), got kv_lora_rank=32"):
        _load(ckpt, kv_cache_dtype="fp8_ds")
    model = DeepseekForCausalLM.from_config({**hf_config("v3").to_dict(), "kv_lora_rank": 128}, kv_cache_dtype="fp8_ds")
    assert model.cache_layout == "fp8_ds"


def test_tokenizer_and_eos_are_read(ckpt):
    model = _load(ckpt)
    assert model.tokenizer is None
    assert model.eos_token_ids == (1,)  # transformers' DeepseekV3Config default, from config.json
    write_tokenizer(ckpt)
    (ckpt / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 7]}))
    model = _load(ckpt)
    assert model.tokenizer.encode("hello") == [0, 5]
    assert model.eos_token_ids == (1, 7)
    assert DeepseekForCausalLM.from_config({**hf_config("v3").to_dict(), "eos_token_id": [2, 3]}).eos_token_ids == (2, 3)
