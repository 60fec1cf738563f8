"""Golden graph of a tensor-parallel rank (world 2, gloo): rank 0's compiled decode step of a
one-layer V3 model, after the passes, with its collectives. Shows what TP adds to a layer: an
all-reduce after o_proj, one after the MLP, the vocab-parallel embedding's all-reduce and the
lm_head's all-gather; the fused front and the decode op are those of world 1 with half the heads.

After a deliberate change: ``EXPECTTEST_ACCEPT=1 python -m pytest tests/compile/test_tp_golden.py``.
"""

from __future__ import annotations

import os
import tempfile

import expecttest

from tests.ranks import gloo_group, spawn_ranks



def _worker(rank: int, world: int, init_method: str, out: str) -> None:
    with gloo_group(rank, world, init_method):
        import mlagraph
        from mlagraph.model import DeepseekForCausalLM
        from mlagraph.model.batch import build_batch
        from tests.model.conftest import hf_config

        cfg = hf_config("v3").to_dict() | {"num_hidden_layers": 1}
        model = DeepseekForCausalLM.from_config(cfg, init_std=0.2, tensor_parallel_size=world)
        caps, ps = model.backend.capabilities, 4
        caches = model.allocate_caches(32, ps)
        batch = build_batch(caps, [[1], [6]], [5, 2], [[0, 1], [2]], ps, is_decode=[True, True])
        compiled = mlagraph.compile(model, backend="mlagraph_eager", fullgraph=True, dynamic=True, strict=True)
        compiled(batch, caches)
        if rank == 0:
            with open(out, "w") as f:
                f.write(mlagraph.passes.last_compile().after)


class TestTensorParallelGolden(expecttest.TestCase):
    def test_tp2_rank0_decode_layer(self):
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "graph.txt")
            spawn_ranks(_worker, 2, out, timeout=300)
            after = open(out).read()
        self.assertExpectedInline(after, """\
# embed
inputs: 2 tensors
v0 = _c10d_functional.all_reduce(input=_, reduce_op='sum', group_name='0')
# attention (mla): layer 0
inputs: 14 tensors
v0 = mlagraph.fused_rope_concat_cache_write(q_nope=_, q_pe=_, kv_c=_, k_pe=_, positions=in7, cos_sin_cache=in8, kv_cache=in9!, slot_mapping=in10, scale=None, layout='bf16', interleaved=True)
v1 = mlagraph.mla_decode(q_nope=_, q_pe=v0.0~, kv_cache=in9', block_table=in11, seq_lens=in12, scale=None, layout='bf16', softmax_scale=0.264642)
v2 = _c10d_functional.all_reduce(input=_, reduce_op='sum', group_name='0')
# mlp (dense): layer 0
inputs: 5 tensors
v0 = _c10d_functional.all_reduce(input=_, reduce_op='sum', group_name='0')
# head
inputs: 4 tensors
v0 = _c10d_functional.all_gather_into_tensor(input=_, group_size=2, group_name='0')
v1 = aten.cat([v0~, v0~], 1)""")
