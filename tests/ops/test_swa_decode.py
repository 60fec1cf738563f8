"""The decode forms (swa/hca/csa_decode) against a float64 loop, and equal to the token-major ops."""

from __future__ import annotations

import pytest
import torch

from tests import helpers
from tests.helpers import arg_error, assert_value_error
from tests.ops.test_swa import D, H, RATE, SCALE, SEQ_LENS, WINDOW, make_setup, ref_sink_attention

S_Q = 2  # request 3 (3 tokens) verifies 2; request 2 is padding (seq_len 0)


def _decode_inputs(s, k=4, seed=1):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(len(SEQ_LENS), S_Q, H, D, generator=g)
    seq_lens = torch.tensor(SEQ_LENS, dtype=torch.int32)
    topk = torch.randint(-1, 7, (len(SEQ_LENS), S_Q, k), generator=g, dtype=torch.int32)
    for b in range(len(SEQ_LENS)):  # distinct entries per query (duplicates would count twice)
        for i in range(S_Q):
            row, seen = [], set()
            for e in topk[b, i].tolist():
                row.append(-1 if e in seen else e)
                seen.add(e)
            topk[b, i] = torch.tensor(row)
    return q, seq_lens, topk


def _call(kind, s, q, seq_lens, topk):
    if kind == "swa":
        return torch.ops.mlagraph.swa_decode(q, s["window"], s["sinks"], s["table"], seq_lens, WINDOW, SCALE)
    if kind == "hca":
        return torch.ops.mlagraph.hca_decode(q, s["window"], s["compressed"], s["sinks"], s["table"], seq_lens, WINDOW,
                                             RATE, SCALE)
    return torch.ops.mlagraph.csa_decode(q, s["window"], s["compressed"], topk, s["sinks"], s["table"], seq_lens,
                                         WINDOW, RATE, SCALE)


@pytest.mark.parametrize("kind", ["swa", "hca", "csa"])
def test_matches_float64_loop(kind):
    s = make_setup(4)
    q, seq_lens, topk = _decode_inputs(s)
    out, lse = _call(kind, s, q, seq_lens, topk)
    assert out.shape == q.shape and lse.shape == q.shape[:3]
    for b, n in enumerate(SEQ_LENS):
        for i in range(S_Q):
            pos = n - S_Q + i
            if n == 0:  # padding: nothing seen
                assert torch.equal(out[b, i], torch.zeros(H, D))
                continue
            rows = [s["keys"][b][p] for p in range(max(0, pos - WINDOW + 1), pos + 1)]
            if kind == "hca":
                rows += [s["entries"][b][e] for e in range((pos + 1) // RATE)]
            if kind == "csa":
                rows += [s["entries"][b][e] for e in topk[b, i].tolist() if e >= 0 and (e + 1) * RATE <= pos + 1]
            want_out, want_lse = ref_sink_attention(q[b, i], torch.stack(rows), s["sinks"])
            torch.testing.assert_close(out[b, i].double(), want_out, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(lse[b, i].double(), want_lse, atol=1e-5, rtol=1e-5)


def test_opcheck_and_no_host_sync():
    s = make_setup(4)
    for key in ("window", "compressed"):
        s[key] = torch.nan_to_num(s[key], nan=0.0)
    q, seq_lens, topk = _decode_inputs(s)
    helpers.opcheck(torch.ops.mlagraph.swa_decode, (q, s["window"], s["sinks"], s["table"], seq_lens, WINDOW, SCALE))
    helpers.opcheck(torch.ops.mlagraph.hca_decode, (q, s["window"], s["compressed"], s["sinks"], s["table"], seq_lens,
                                                    WINDOW, RATE, SCALE))
    helpers.opcheck(torch.ops.mlagraph.csa_decode, (q, s["window"], s["compressed"], topk, s["sinks"], s["table"],
                                                    seq_lens, WINDOW, RATE, SCALE))
    with helpers.NoHostSync() as mode:
        _call("csa", s, q, seq_lens, topk)
    assert "mlagraph::csa_decode" in mode.ops_seen


@pytest.mark.parametrize("index,arg,bad", [
    (0, "q", lambda q, s, sl, tk: q[0]),
    (3, "topk_indices", lambda q, s, sl, tk: tk[:, 0]),
    (4, "sinks", lambda q, s, sl, tk: s["sinks"][:1]),
    (5, "block_table", lambda q, s, sl, tk: s["table"][:1]),
    (6, "seq_lens", lambda q, s, sl, tk: sl.long()),
    (8, "compress_rate", lambda q, s, sl, tk: 3),
])
def test_bad_inputs(index, arg, bad):
    s = make_setup(4)
    q, seq_lens, topk = _decode_inputs(s)
    args = [q, s["window"], s["compressed"], topk, s["sinks"], s["table"], seq_lens, WINDOW, RATE, SCALE]
    args[index] = bad(q, s, seq_lens, topk)
    assert_value_error(torch.ops.mlagraph.csa_decode, args, arg_error(arg))
