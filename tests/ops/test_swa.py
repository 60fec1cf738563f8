"""DeepSeek-V4 attention ops (swa_cache_write, swa/hca/csa_attention) against a float64 loop.

Every cache row nobody wrote is NaN, so an op that reads past a window, an unclosed entry, a -1
page or a -1 index shows NaN instead of a plausible number.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from mlagraph.ops import v4_layouts
from tests import helpers
from tests.helpers import arg_error, assert_value_error, make_block_table

H, D = 3, 8
WINDOW = 5
RATE = 2
SEQ_LENS = [7, 13, 0, 3]  # request 2: padding, no pages
# (request, position) of each query token; several queries of one request, out of order
TOKENS = [(0, 6), (1, 0), (1, 12), (1, 4), (3, 2), (0, 1), (2, 0), (1, 9)]
SCALE = D**-0.5


def _nan_cache(rows_per_page: int, num_pages: int = 32) -> torch.Tensor:
    return torch.full((num_pages, rows_per_page, D), float("nan"))


def make_setup(page_size: int, rate: int = RATE, seed: int = 0):
    """Paged window and compressed caches written from per-request float64 keys / entries."""
    g = torch.Generator().manual_seed(seed)
    table = make_block_table(SEQ_LENS, page_size, 32, seed=seed)
    keys = [torch.randn(n, D, generator=g, dtype=torch.float64) for n in SEQ_LENS]
    entries = [torch.randn(n // rate, D, generator=g, dtype=torch.float64) for n in SEQ_LENS]
    window = _nan_cache(page_size)
    compressed = _nan_cache(v4_layouts.entries_per_page(page_size, rate))
    for b, n in enumerate(SEQ_LENS):
        for p in range(n):
            window.view(-1, D)[helpers.slots_for(table, page_size, b, [p])[0]] = keys[b][p].float()
        for i in range(n // rate):
            slot = v4_layouts.entry_slots(table, torch.tensor(b), torch.tensor(i), page_size, rate)
            compressed.view(-1, D)[slot] = entries[b][i].float()
    q = torch.randn(len(TOKENS), H, D, generator=g)
    sinks = torch.randn(H, generator=g)
    positions = torch.tensor([p for _, p in TOKENS])
    req_ids = torch.tensor([r for r, _ in TOKENS], dtype=torch.int32)
    return dict(q=q, window=window, compressed=compressed, sinks=sinks, positions=positions, req_ids=req_ids,
                table=table, keys=keys, entries=entries)


def ref_sink_attention(q, keys, sinks):
    """q [H, D] float64, keys [S, D] float64 -> out [H, D], lse [H] (sink in the denominator)."""
    scores = q.double() @ keys.T * SCALE  # [H, S]
    logits = torch.cat([scores, sinks.double()[:, None]], dim=1)
    lse = torch.logsumexp(logits, dim=1)
    return torch.exp(scores - lse[:, None]) @ keys, lse


def ref_keys(s, t, kind, topk=None, rate=RATE):
    req, pos = TOKENS[t]
    if SEQ_LENS[req] == 0:
        return torch.zeros(0, D, dtype=torch.float64)
    rows = [s["keys"][req][p] for p in range(max(0, pos - WINDOW + 1), pos + 1)]
    if kind == "hca":
        rows += [s["entries"][req][i] for i in range((pos + 1) // rate)]
    if kind == "csa":
        rows += [s["entries"][req][i] for i in topk[t].tolist() if 0 <= i and (i + 1) * rate <= pos + 1]
    return torch.stack(rows) if rows else torch.zeros(0, D, dtype=torch.float64)


def make_topk(rate=RATE, k=4, seed=0):
    """[T, k] int32: random distinct entries, some not yet visible (must be ignored), -1 mixed in."""
    rnd = random.Random(seed)
    rows = []
    for req, pos in TOKENS:
        n = SEQ_LENS[req] // rate
        picked = rnd.sample(range(n), min(k - 1, n)) if n else []
        row = picked + [-1] * (k - len(picked))
        rnd.shuffle(row)
        rows.append(row)
    return torch.tensor(rows, dtype=torch.int32)


def call(kind, s, topk=None, rate=RATE):
    common = (s["positions"], s["req_ids"], s["table"], WINDOW)
    if kind == "swa":
        return torch.ops.mlagraph.swa_attention(s["q"], s["window"], s["sinks"], *common, SCALE)
    if kind == "hca":
        return torch.ops.mlagraph.hca_attention(s["q"], s["window"], s["compressed"], s["sinks"], *common, rate, SCALE)
    return torch.ops.mlagraph.csa_attention(s["q"], s["window"], s["compressed"], topk, s["sinks"], *common, rate,
                                            SCALE)


@pytest.mark.parametrize("page_size,rate", [(1, 2), (4, 2), (4, 8), (8, 8)])
@pytest.mark.parametrize("kind", ["swa", "hca", "csa"])
def test_matches_float64_loop(kind, page_size, rate):
    s = make_setup(page_size, rate)
    topk = make_topk(rate)
    out, lse = call(kind, s, topk, rate)
    assert out.shape == (len(TOKENS), H, D) and lse.shape == (len(TOKENS), H)
    for t in range(len(TOKENS)):
        want_out, want_lse = ref_sink_attention(s["q"][t], ref_keys(s, t, kind, topk, rate), s["sinks"])
        torch.testing.assert_close(out[t].double(), want_out, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(lse[t].double(), want_lse, atol=1e-5, rtol=1e-5)


def test_csa_with_every_visible_entry_equals_hca():
    """Selecting every entry a token can see is HCA: the exactness the dense-instead-of-sparse
    plan will rest on."""
    s = make_setup(4)
    every = torch.arange(13 // RATE, dtype=torch.int32).expand(len(TOKENS), -1).contiguous()
    torch.testing.assert_close(call("csa", s, every), call("hca", s))


def test_padding_token_gets_zero_and_sink_lse():
    s = make_setup(4)
    out, lse = call("swa", s)
    t = TOKENS.index((2, 0))
    assert torch.equal(out[t], torch.zeros(H, D))
    torch.testing.assert_close(lse[t], s["sinks"])


def test_swa_cache_write_skips_padding():
    cache = torch.zeros(3, 2, D)
    kv = torch.randn(3, D)
    torch.ops.mlagraph.swa_cache_write(kv, cache, torch.tensor([5, -1, 0]))
    assert torch.equal(cache.view(-1, D)[5], kv[0]) and torch.equal(cache.view(-1, D)[0], kv[2])
    assert torch.count_nonzero(cache.view(-1, D)[1:5]) == 0


@pytest.mark.parametrize("kind", ["swa", "hca", "csa"])
def test_opcheck(kind):
    s = make_setup(4)
    for key in ("window", "compressed"):
        s[key] = torch.nan_to_num(s[key], nan=0.0)  # opcheck compares outputs across runs: no NaN
    topk = make_topk()
    common = (s["positions"], s["req_ids"], s["table"], WINDOW)
    if kind == "swa":
        helpers.opcheck(torch.ops.mlagraph.swa_attention, (s["q"], s["window"], s["sinks"], *common, SCALE))
    elif kind == "hca":
        helpers.opcheck(torch.ops.mlagraph.hca_attention,
                        (s["q"], s["window"], s["compressed"], s["sinks"], *common, RATE, SCALE))
    else:
        helpers.opcheck(torch.ops.mlagraph.csa_attention,
                        (s["q"], s["window"], s["compressed"], topk, s["sinks"], *common, RATE, SCALE))
    helpers.opcheck(torch.ops.mlagraph.swa_cache_write, (torch.randn(3, D), torch.zeros(3, 2, D),
                                                         torch.tensor([5, -1, 0])))


def test_no_host_sync():
    s = make_setup(4)
    with helpers.NoHostSync() as mode:
        call("csa", s, make_topk())
        call("hca", s)
    assert {"mlagraph::csa_attention", "mlagraph::hca_attention"} <= set(mode.ops_seen)


def _hca_args(s, **over):
    args = dict(q=s["q"], kv_cache=s["window"], compressed_cache=s["compressed"], sinks=s["sinks"],
                positions=s["positions"], req_ids=s["req_ids"], block_table=s["table"], window=WINDOW,
                compress_rate=RATE, softmax_scale=SCALE)
    args.update(over)
    return list(args.values())


@pytest.mark.parametrize("arg,bad", [
    ("q", lambda s: s["q"][0]),
    ("kv_cache", lambda s: s["window"][..., :-1]),
    ("sinks", lambda s: s["sinks"][:-1]),
    ("sinks", lambda s: s["sinks"].double()),
    ("positions", lambda s: s["positions"].float()),
    ("req_ids", lambda s: s["req_ids"].long()),
    ("block_table", lambda s: s["table"][0]),
    ("window", lambda s: 0),
    ("compress_rate", lambda s: 3),  # neither a divisor nor a multiple of page size 4
    ("compressed_cache", lambda s: s["compressed"][:, :1]),
    ("softmax_scale", lambda s: -1.0),
])
def test_bad_inputs_raise_eagerly_and_under_fake_tensors(arg, bad):
    s = make_setup(4)
    args = _hca_args(s, **{arg: bad(s)})
    assert_value_error(torch.ops.mlagraph.hca_attention, args, arg_error(arg))


def test_csa_bad_topk_raises():
    s = make_setup(4)
    common = (s["positions"], s["req_ids"], s["table"], WINDOW)
    args = [s["q"], s["window"], s["compressed"], make_topk().long(), s["sinks"], *common, RATE, SCALE]
    assert_value_error(torch.ops.mlagraph.csa_attention, args, arg_error("topk_indices"))


def test_lse_is_natural_log():
    """One key, one head: lse = log(exp(q.k·scale) + exp(sink))."""
    cache = torch.zeros(1, 1, D)
    k = torch.randn(D)
    cache[0, 0] = k
    q = torch.randn(1, 1, D)
    out, lse = torch.ops.mlagraph.swa_attention(q, cache, torch.tensor([0.3]), torch.tensor([0]),
                                                torch.tensor([0], dtype=torch.int32),
                                                torch.tensor([[0]], dtype=torch.int32), 4, SCALE)
    score = float(q[0, 0] @ k) * SCALE
    assert math.isclose(float(lse), math.log(math.exp(score) + math.exp(0.3)), rel_tol=1e-5)
    torch.testing.assert_close(out[0, 0], k * math.exp(score - float(lse)))
