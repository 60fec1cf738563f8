"""The forward method is a pure function of (capabilities, batch plan): the whole matrix, pinned.

EXPECTTEST_ACCEPT=1 pytest tests/model/test_dispatch.py rewrites the table below after a
deliberate change; any other change to an answer fails here.
"""

import dataclasses
import itertools
import os

import expecttest
import pytest

import random

from mlagraph.model import DeepseekForCausalLM
from mlagraph.model.batch import (
    PAD_SLOT,
    BatchKind,
    BatchPlan,
    ForwardMethod,
    NoForwardMethod,
    build_batch,
    choose_forward_method,
    for_decode_graph,
    plan_batch,
    plan_step,
)
from mlagraph.engine.cuda_graphs import StaticDecodeInputs, decode_plans
from mlagraph.ops import backends
from tests.compile.fake_backend import registered_backend
from tests.model.conftest import hf_config

SWITCHES = ("multi_token_decode", "mha_prefill", "mha_over_prefix", "sparse_mla")
PLANS = [
    BatchPlan(BatchKind.PREFILL, 0, False),
    BatchPlan(BatchKind.CHUNKED_PREFILL, 0, False),
    BatchPlan(BatchKind.DECODE, 1, False),
    BatchPlan(BatchKind.MIXED, 0, False),
    BatchPlan(BatchKind.MULTI_TOKEN_DECODE, 3, False),
    BatchPlan(BatchKind.PREFILL, 0, True),
    BatchPlan(BatchKind.DECODE, 1, True),
    BatchPlan(BatchKind.MIXED, 0, True),
    BatchPlan(BatchKind.PREFILL, 0, True, dsa_dense=True),
    BatchPlan(BatchKind.MIXED, 0, True, dsa_split=True),
    BatchPlan(BatchKind.MULTI_TOKEN_DECODE, 3, True),  # speculative verify steps of V3.2
    BatchPlan(BatchKind.MULTI_TOKEN_DECODE, 3, True, dsa_dense=True),
]


def _render_matrix() -> str:
    base = backends.get("reference").capabilities
    header = "caps(" + ",".join(s[:9] for s in SWITCHES) + ")"
    lines = []
    for bits in itertools.product((0, 1), repeat=len(SWITCHES)):
        caps = dataclasses.replace(base, **{s: bool(b) for s, b in zip(SWITCHES, bits)})
        answers = []
        for plan in PLANS:
            try:
                answers.append(choose_forward_method(caps, plan).value)
            except NoForwardMethod:
                answers.append("-")
        lines.append("".join(map(str, bits)) + ": " + " ".join(f"{a:<10}" for a in answers).rstrip())
    def label(p):
        dsa = "/dense" if p.dsa_dense else "/split" if p.dsa_split else "/dsa" if p.dsa else ""
        return p.kind.value[:6] + dsa

    cols = " ".join(f"{label(p):<10}" for p in PLANS).rstrip()
    return "\n".join([header, "      " + cols, *lines])


class TestDispatchMatrix(expecttest.TestCase):
    def test_matrix(self):
        self.assertExpectedInline(_render_matrix(), """\
caps(multi_tok,mha_prefi,mha_over_,sparse_ml)
      prefil     chunke     decode     mixed      multi_     prefil/dsa decode/dsa mixed/dsa  prefil/dense mixed/split multi_/dsa multi_/dense
0000: -          -          absorbed   -          -          -          -          -          -          -          -          -
0001: -          -          absorbed   -          -          sparse     sparse     sparse     sparse     sparse     sparse     sparse
0010: -          mha_prefix absorbed   mha_prefix mha_prefix -          -          -          -          -          -          mha_prefix
0011: -          mha_prefix absorbed   mha_prefix mha_prefix sparse     sparse     sparse     sparse     dsa_split  sparse     mha_prefix
0100: mha        -          absorbed   -          -          -          -          -          mha        -          -          -
0101: mha        -          absorbed   -          -          sparse     sparse     sparse     mha        sparse     sparse     sparse
0110: mha        mha_prefix absorbed   mha_prefix mha_prefix -          -          -          mha        -          -          mha_prefix
0111: mha        mha_prefix absorbed   mha_prefix mha_prefix sparse     sparse     sparse     mha        dsa_split  sparse     mha_prefix
1000: -          -          absorbed   -          absorbed   -          -          -          -          -          -          absorbed
1001: -          -          absorbed   -          absorbed   sparse     sparse     sparse     sparse     sparse     sparse     absorbed
1010: -          mha_prefix absorbed   mha_prefix absorbed   -          -          -          -          -          -          absorbed
1011: -          mha_prefix absorbed   mha_prefix absorbed   sparse     sparse     sparse     sparse     dsa_split  sparse     absorbed
1100: mha        -          absorbed   -          absorbed   -          -          -          mha        -          -          absorbed
1101: mha        -          absorbed   -          absorbed   sparse     sparse     sparse     mha        sparse     sparse     absorbed
1110: mha        mha_prefix absorbed   mha_prefix absorbed   -          -          -          mha        -          -          absorbed
1111: mha        mha_prefix absorbed   mha_prefix absorbed   sparse     sparse     sparse     mha        dsa_split  sparse     absorbed""")


def test_verify_steps_per_registered_backend():
    """Speculative verify steps (s_q = k + 1): the absorbed decode where the backend's decode
    takes s_q > 1, MHA over the cached prefix where it takes s_q = 1 only (aiter)."""
    got = {}
    for b in backends.registered():
        plan, method = plan_step(b.capabilities, [3, 3], [7, 2], [True, True], dsa=False)
        assert plan.kind is BatchKind.MULTI_TOKEN_DECODE and plan.decode_q_len == 3
        got[b.name] = method
        assert method is (ForwardMethod.ABSORBED if b.capabilities.multi_token_decode else ForwardMethod.MHA_PREFIX)
    assert got["reference"] is ForwardMethod.ABSORBED
    if "aiter" in got:
        assert got["aiter"] is ForwardMethod.MHA_PREFIX


def test_dispatch_ignores_environment(monkeypatch):
    """No environment variable can change an answer (docs/design.md rule 1)."""
    before = _render_matrix()
    for var in ("MLAGRAPH_BACKEND", "SGLANG_USE_AITER", "VLLM_ROCM_USE_AITER", "MLAGRAPH_FORCE_SPARSE"):
        monkeypatch.setenv(var, "1")
    assert _render_matrix() == before


@pytest.mark.parametrize(
    "q_lens, prefix_lens, is_decode, kind",
    [
        ([5, 3], [0, 0], [False, False], BatchKind.PREFILL),
        ([5, 3], [0, 4], [False, False], BatchKind.CHUNKED_PREFILL),
        ([1, 1, 1], [7, 2, 9], [True, True, True], BatchKind.DECODE),
        ([3, 3], [7, 2], [True, True], BatchKind.MULTI_TOKEN_DECODE),
        ([1, 6], [7, 0], [True, False], BatchKind.MIXED),
        ([1], [0], [False], BatchKind.PREFILL),  # a one-token prompt is a prefill, not a decode
    ],
)
def test_plan_batch_kinds(q_lens, prefix_lens, is_decode, kind):
    plan = plan_batch(q_lens, prefix_lens, is_decode, dsa=False)
    assert plan.kind is kind
    assert plan.decode_q_len == (q_lens[0] if kind in (BatchKind.DECODE, BatchKind.MULTI_TOKEN_DECODE) else 0)


@pytest.mark.parametrize(
    "args, match",
    [
        (([], [], []), "non-empty"),
        (([2, 0], [0, 0], [False, False]), "q_lens"),
        (([1, 2], [3, 3], [True, True]), "decode q_lens"),
        (([9], [3], [True]), "decode q_lens"),
    ],
)
def test_plan_batch_rejects(args, match):
    with pytest.raises(ValueError, match=match):
        plan_batch(*args, dsa=False)


def test_build_batch_metadata():
    caps = backends.get("reference").capabilities
    b = build_batch(caps, [[11, 12, 13], [21]], [0, 5], [[4], [7, 2]], page_size=4, is_decode=[False, True])
    assert b.plan.kind is BatchKind.MIXED and b.method is ForwardMethod.MHA_PREFIX
    assert b.input_ids.tolist() == [11, 12, 13, 21]
    assert b.positions.tolist() == [0, 1, 2, 5]
    assert b.slot_mapping.tolist() == [16, 17, 18, 2 * 4 + 1]  # request 1, position 5 -> page 2, offset 1
    assert b.req_ids.tolist() == [0, 0, 0, 1]
    assert b.block_table.tolist() == [[4, -1], [7, 2]]
    assert b.seq_lens.tolist() == [3, 6]
    assert b.cu_seqlens_q.tolist() == [0, 3, 4] and b.cu_seqlens_k.tolist() == [0, 3, 9]
    assert b.num_kv_tokens == 9
    assert b.logits_indices.tolist() == [2, 3]


def test_single_request_prefill_is_marked_and_not_padded():
    """With dense_prefill_sdpa (triton), one request's prefill over no prefix is flagged for the
    dense kernel and not padded (its queries and keys must be the same T tokens); anything else,
    or the reference backend, is the ordinary padded batch."""
    triton_caps = backends.get("triton").capabilities
    one = build_batch(triton_caps, [[1, 2, 3]], [0], [[0]], page_size=4, min_reqs=2)
    assert one.single_request and one.num_reqs == 1 and one.num_tokens == 3
    assert one.method is ForwardMethod.MHA
    for caps, kw in [(backends.get("reference").capabilities, {}),
                     (triton_caps, {"token_ids": [[1, 2], [3]], "prefix_lens": [0, 0], "pages": [[0], [1]]}),
                     (triton_caps, {"prefix_lens": [4], "pages": [[0, 1]]}),
                     (triton_caps, {"is_decode": [True], "token_ids": [[1]], "prefix_lens": [4], "pages": [[0, 1]]})]:
        args = {"token_ids": [[1, 2, 3]], "prefix_lens": [0], "pages": [[0]], **kw}
        b = build_batch(caps, args["token_ids"], args["prefix_lens"], args["pages"], page_size=4, min_reqs=2,
                        is_decode=kw.get("is_decode"))
        assert not b.single_request and b.num_reqs >= 2


def test_backend_registry():
    assert "reference" in backends.names()
    ref = backends.get("reference")
    assert ref.name == "reference"
    with pytest.raises(dataclasses.FrozenInstanceError):
        ref.capabilities.sparse_mla = False
    with pytest.raises(TypeError):
        ref.capabilities.fallbacks["x"] = "y"
    with pytest.raises(ValueError, match="unknown backend 'triton-nope'; known backends: reference"):
        backends.get("triton-nope")
    with pytest.raises(ValueError, match="no op 'flash'"):
        ref.op("flash")


def test_no_environment_reads_in_package():
    """No module of the package reads the environment (lesson 1)."""
    import mlagraph

    root = os.path.dirname(mlagraph.__file__)
    offenders = []
    for dirpath, _, files in os.walk(root):
        for f in files:
            if f.endswith(".py"):
                text = open(os.path.join(dirpath, f)).read()
                if "os.environ" in text or "os.getenv" in text:
                    offenders.append(f)
    assert offenders == []


def test_padding_never_changes_the_plan():
    """The plan comes from the real requests. An all-sparse DSA batch padded to 2 requests stays
    sparse (its padding request is short enough for dense, and joins the sparse group), and a
    split batch pads each group; padding rows are written nowhere."""
    caps = backends.get("reference").capabilities
    sparse = build_batch(caps, [[1] * 20], [0], [[0, 1, 2, 3, 4]], 4, dsa=True, dsa_dense_max_kv_len=12,
                         min_reqs=2)
    assert sparse.plan == plan_batch([20], [0], [False], dsa=True, dsa_dense_max_kv_len=12)
    assert sparse.method is ForwardMethod.SPARSE and sparse.num_reqs == 2
    assert sparse.slot_mapping.tolist()[20:] == [PAD_SLOT]
    split = build_batch(caps, [[1] * 20, [2] * 3], [0, 0], [[0, 1, 2, 3, 4], [5]], 4, dsa=True,
                        dsa_dense_max_kv_len=12, min_reqs=2)
    assert split.method is ForwardMethod.DSA_SPLIT and split.num_reqs == 4
    # rows: the long request 0..19, the short one 20..22, then a dense and a sparse padding row
    assert split.split.dense_rows.tolist() == [20, 21, 22, 23] and split.split.sparse_rows.tolist() == [*range(20), 24]


@pytest.mark.parametrize("backend", ["reference", "aiter"])
def test_graph_replay_and_capture_decide_alike(backend):
    """What a graph-captured decode step replays is what was captured: the engine's choice
    (plan_step with graphed=True) is always one of decode_plans' methods, with the same plan,
    for random DSA batches (all dense, some, none)."""
    caps = backends.registered()[[b.name for b in backends.registered()].index(backend)].capabilities
    captured = decode_plans(caps, dsa=True)
    assert set(captured) == {ForwardMethod.ABSORBED, ForwardMethod.SPARSE}
    rnd = random.Random(0)
    seen = set()
    for _ in range(200):
        n = rnd.randint(1, 8)
        prefix = [rnd.randint(0, 30) for _ in range(n)]
        plan, method = plan_step(caps, [1] * n, prefix, [True] * n, dsa=True, dsa_dense_max_kv_len=12, graphed=True)
        assert captured[method] == plan and not plan.dsa_split
        assert plan == for_decode_graph(plan_batch([1] * n, prefix, [True] * n, dsa=True, dsa_dense_max_kv_len=12))
        seen.add(method)
    assert seen == set(captured)


def test_static_decode_padding_is_build_batch_padding():
    """The CUDA-graph buffers pad a bucket exactly as build_batch pads a batch."""
    caps = backends.get("reference").capabilities
    static = StaticDecodeInputs(4, 3, "cpu")
    static.fill([7, 8], [4, 1], [12, 13], [[2, 3], [3]], [5, 2], bucket=4)
    got = static.batch(4, ForwardMethod.ABSORBED, BatchPlan(BatchKind.DECODE, 1, False))
    want = build_batch(caps, [[7], [8]], [4, 1], [[2, 3], [3]], 4, is_decode=[True, True], min_reqs=4)
    for name in ("input_ids", "positions", "slot_mapping", "seq_lens", "cu_seqlens_k", "req_ids"):
        assert getattr(got, name).tolist() == getattr(want, name).tolist(), name
    assert got.block_table[:, :2].tolist() == want.block_table[:, :2].tolist()  # pages; -1 beyond
    assert (got.block_table[:, 2:] == -1).all() and (want.block_table[:, 2:] == -1).all()


def test_inconsistent_fallback_is_refused():
    """A fallback is declared once: a backend whose op map disagrees with its declaration is
    refused at registration, naming the op."""
    ref = backends.get("reference")
    bad = backends.Backend(  # says rope is triton's, maps the reference rope
        name="bad_fallback", op_names=dict(ref.op_names),
        capabilities=dataclasses.replace(ref.capabilities, fallbacks={"rope": "triton"}),
    )
    with pytest.raises(ValueError, match="fallbacks: 'rope' is declared to run backend 'triton'"):
        backends.register(bad)
    assert "bad_fallback" not in backends.names()
    assert backends.op_names_for("x", ["rope"], {"moe": "reference"}) == {"rope": "x::rope", "moe": "mlagraph::moe"}


def test_indexer_layout_outside_the_table_is_refused():
    """indexer_layouts is enforced: a V3.2 model whose indexer keys a backend cannot hold is
    refused when it is built, naming kv_cache_dtype."""
    with registered_backend("bf16_keys_only", indexer_layouts=frozenset({"bf16"})):
        DeepseekForCausalLM.from_config(hf_config("v32"), backend="bf16_keys_only")  # bf16 keys: fine
        with pytest.raises(ValueError, match="kv_cache_dtype: backend 'bf16_keys_only' supports indexer-key"):
            DeepseekForCausalLM.from_config(hf_config("v32"), backend="bf16_keys_only", kv_cache_dtype="fp8")
        DeepseekForCausalLM.from_config(hf_config("v3"), backend="bf16_keys_only", kv_cache_dtype="fp8")  # no indexer
