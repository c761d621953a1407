"""`kvserve perplexity` (llama-perplexity's protocol) on stories260K and the shipped text equals a
perplexity computed independently with transformers over the same chunks (BOS first, second
half scored) within 1e-4 relative, error bar included; the KL-divergence files hold the
reference distributions, a run compared with itself has KL 0, and the KL arithmetic (whole
vocabulary and top k + rest) matches torch's."""
from __future__ import annotations

import math
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from kvserve.quality import kl_divergence as kl
from kvserve.cli import main as cli_main
from tests.conftest import STORIES_HF
from tests.reference.hf_reference import load_hf

TEXT = Path(__file__).resolve().parents[2] / "docs" / "sample-story.txt"
CTX, CHUNKS = 128, 6
ARGS = ["perplexity", "--model", str(STORIES_HF), "--file", str(TEXT), "--ctx", str(CTX),
        "--chunks", str(CHUNKS), "--batch", "300", "--block-size", "16"]


def reference() -> tuple[float, float, list[list[int]], list[torch.Tensor]]:
    """(PPL, its error, the chunks, log_softmax rows of each chunk) with transformers alone."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(STORIES_HF))
    ids = tok(TEXT.read_text(encoding="utf-8"))["input_ids"]
    assert ids[0] == tok.bos_token_id
    model = load_hf(str(STORIES_HF))
    nll, chunks, rows = [], [], []
    for i in range(min(CHUNKS, len(ids) // CTX)):
        chunk = list(ids[i * CTX:(i + 1) * CTX])
        chunk[0] = tok.bos_token_id
        with torch.inference_mode():
            lp = torch.log_softmax(model(torch.tensor([chunk])).logits[0].float(), dim=-1)
        first = CTX // 2
        nll += [-float(lp[j - 1, chunk[j]]) for j in range(first + 1, CTX)]
        chunks.append(chunk)
        rows.append(lp[first:CTX - 1])
    x = np.array(nll)
    ppl = math.exp(x.mean())
    return ppl, ppl * math.sqrt(((x * x).mean() - x.mean() ** 2) / (len(x) - 1)), chunks, rows


def run(capsys, *extra: str) -> str:
    assert cli_main(ARGS + list(extra)) == 0
    return capsys.readouterr().out


def test_perplexity_equals_transformers(capsys, tmp_path):
    want, want_err, chunks, rows = reference()
    out = run(capsys, "--kl-divergence-base", str(tmp_path / "base.npz"))
    m = re.search(r"Final estimate: PPL = ([\d.]+) \+/- ([\d.]+)", out)
    ppl, err = float(m.group(1)), float(m.group(2))
    assert abs(ppl - want) / want < 1e-4 and abs(err - want_err) / want_err < 1e-3
    assert len(re.findall(r"\[\d+\][\d.]+,", out)) == CHUNKS          # a running value per chunk
    base = kl.load_base(str(tmp_path / "base.npz"))
    assert base.tokens.tolist() == chunks
    assert np.abs(base.lp - torch.stack(rows).numpy()).max() < 1e-4  # the whole distributions


def test_kl_divergence_of_a_run_with_itself_is_zero(capsys, tmp_path):
    base = str(tmp_path / "base.npz")
    run(capsys, "--kl-divergence-base", base)
    out = run(capsys, "--kl-divergence-base", base, "--kl-divergence", "--block-size", "4",
              "--max-num-seqs", "3")
    mean = float(re.search(r"mean KLD\s+(-?[\d.e-]+)", out).group(1))
    assert abs(mean) < 1e-6 and "same top token: 100.000" in out
    out = run(capsys, "--kl-divergence-base", base, "--kl-divergence", "--dtype", "bfloat16")
    assert float(re.search(r"mean KLD\s+(-?[\d.e-]+)", out).group(1)) > 1e-5


@pytest.mark.parametrize("top_k", [0, 5])
def test_kl_arithmetic(top_k):
    """Comparison's KL against torch's, for a whole-vocabulary base and for a top-k base (KL of
    the k + 1 outcomes "each top token, or the rest")."""
    g = torch.Generator().manual_seed(0)
    ctx, first, V = 12, 6, 40
    p_logits = torch.randn(ctx - 1 - first, V, generator=g) * 3       # [n, V]
    q_logits = torch.randn(ctx - 1 - first, V, generator=g) * 3
    chunks = [[1] + list(range(2, ctx + 1))]
    rec = kl.Recorder(chunks, first, top_k)
    rec(0, 3, torch.cat([torch.zeros(first - 3, V), p_logits[:2]]))   # rows arrive in pieces
    rec(0, first + 2, p_logits[2:])
    cmp = kl.Comparison(kl.Base(rec.tokens, first, rec.lp, rec.ids, rec.nll), 1, first)
    cmp(0, first, q_logits)
    got = cmp.summary().kl
    p, q = torch.log_softmax(p_logits.double(), -1), torch.log_softmax(q_logits.double(), -1)
    if top_k:
        ids = p.topk(top_k, -1).indices
        pk, qk = p.gather(1, ids).exp(), q.gather(1, ids).exp()
        p = torch.cat([pk, 1 - pk.sum(-1, keepdim=True)], -1).log()
        q = torch.cat([qk, 1 - qk.sum(-1, keepdim=True)], -1).log()
    want = torch.nn.functional.kl_div(q, p, log_target=True, reduction="none").sum(-1)
    assert np.allclose(got, want.numpy(), atol=1e-5)
