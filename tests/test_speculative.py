"""Speculative decoding (qwen_mini.speculative): greedy output equal to plain greedy on every
family, with the MTP head or a draft model; sampled output distributed as the model's own.

Facts used (from vLLM's qwen3_next_mtp.py / qwen3_5_mtp.py; transformers has no MTP): the MTP
head of Qwen3-Next / Qwen3.5 / Qwen3.8 has config field mtp_num_hidden_layers (Qwen3-Next's
file may say num_nextn_predict_layers), and one step is
x = fc(cat([norm_e(embed(t_{i+1})), norm_h(h_i)])) -> one full-attention decoder layer ->
mtp.norm -> the shared lm_head.
"""

import copy
import functools
import math

import helpers
import pytest
import torch

from qwen_mini import speculative
from qwen_mini.generation import generate, generate_tokens
from qwen_mini.speculative import accept_or_resample

PROMPT = [1, 5, 9, 3, 7, 2, 11]
HAS_MTP = ("qwen3_5_text", "qwen3_next", "qwen3_5_moe_text", "qwen4_exp_text", "qwen3_5")
FAMILIES = ("qwen3", "qwen2", "qwen3_moe", "qwen2_moe") + HAS_MTP


def tiny(model_type, seed=0, **overrides):
    mtp = {"mtp_num_hidden_layers": 1} if model_type in HAS_MTP else {}
    # large weights: sharp logits, so a wrong token cannot pass as a near tie
    return helpers.tiny_model(model_type, seed=seed, std=0.5, **mtp, **overrides)


def nearby(model, scale=0.02, seed=1):
    """A draft model whose top tokens are mostly the model's, with other probabilities: the
    rejection rule then keeps some drafts, rejects others and resamples from p - q (a draft of
    other weights altogether shares no top token with the model, and every draft is refused)."""
    other = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for w in other.parameters():
            w.add_(torch.randn(w.shape, generator=g) * scale)
    return other


def greedy(model, n=12, **kwargs):
    return list(
        generate_tokens(model, PROMPT, max_new_tokens=n, temperature=0, eos_token_ids=[], **kwargs)
    )


@pytest.mark.parametrize("model_type", FAMILIES)
def test_greedy_speculative_equals_plain_greedy(model_type, monkeypatch):
    model = tiny(model_type)
    plain = greedy(model)
    other = tiny(model_type, seed=1)  # a draft that is often wrong: many rejections
    # the model drafting for itself: every draft accepted (the bonus token every round); drafts
    # near the model: rounds that keep some drafts and refuse the rest (where an off-by-one in
    # the kept prefix or the rollback shows)
    runs = [(other, 3), (model, 2), (nearby(model, 0.01), 3), (nearby(model, 0.03), 3)]
    runs += [("mtp", 1), ("mtp", 3)] if model_type in HAS_MTP else []
    rounds = []  # (drafts kept, drafts proposed) of every round
    monkeypatch.setattr(speculative, "greedy_accept", _noting(speculative.greedy_accept, rounds))
    for draft, k in runs:
        got = greedy(model, draft=draft, draft_tokens=k)
        name = draft if isinstance(draft, str) else "model"
        assert got == plain, f"{model_type}, draft {name}, k={k}"
    assert any(0 < kept < proposed for kept, proposed in rounds), "no round kept some drafts"


def _noting(accept, rounds):
    def noted(drafts, targets):
        kept, chosen = accept(drafts, targets)
        rounds.append((kept, len(drafts)))
        return kept, chosen

    return noted


def test_greedy_speculative_stops_at_eos_and_max_new_tokens():
    model, draft = tiny("qwen3_5_text"), tiny("qwen3_5_text", seed=1)
    plain = greedy(model, n=10)
    eos = plain[4]  # a token the output reaches: it must stop right there, and yield it
    want = plain[: plain.index(eos) + 1]
    for d in ("mtp", draft):
        got = list(
            generate_tokens(
                model, PROMPT, max_new_tokens=10, temperature=0, eos_token_ids=[eos], draft=d,
                draft_tokens=4,
            )
        )  # fmt: skip
        assert got == want
        assert greedy(model, n=5, draft=d, draft_tokens=4) == plain[:5]
        assert greedy(model, n=1, draft=d) == plain[:1]
        assert greedy(model, n=0, draft=d) == []


def test_greedy_speculative_keeps_the_penalties():
    model = tiny("qwen3")
    kw = dict(repetition_penalty=1.5, presence_penalty=1.0)
    assert greedy(model, **kw, draft=tiny("qwen3", seed=1), draft_tokens=3) == greedy(model, **kw)


generate_tokens_ = generate_tokens


def test_bad_draft_arguments_are_refused_by_name():
    model = tiny("qwen3")
    generate_tokens = functools.partial(generate_tokens_, max_new_tokens=8)
    with pytest.raises(ValueError, match="no multi-token-prediction head"):
        generate_tokens(model, PROMPT, draft="mtp")
    with pytest.raises(ValueError, match="draft_tokens"):
        generate_tokens(model, PROMPT, draft=model, draft_tokens=0)
    with pytest.raises(ValueError, match="another tokenizer"):
        generate_tokens(model, PROMPT, draft=tiny("qwen3_5_text"))
    with pytest.raises(TypeError, match="draft must be"):
        generate_tokens(model, PROMPT, draft=object())


def test_rejection_rule_gives_the_target_distribution():
    """One step: d ~ q, then accept_or_resample(p, q, d) must be distributed as p. p and q
    differ a lot (q puts mass where p has none, and the reverse); 20,000 draws, each
    frequency within 5 standard errors of p."""
    p = torch.tensor([0.5, 0.3, 0.2, 0.0, 0.0])
    q = torch.tensor([0.1, 0.1, 0.2, 0.3, 0.3])
    g = torch.Generator().manual_seed(0)
    n = 20_000
    drafts = torch.multinomial(q, n, replacement=True, generator=g).tolist()
    counts = torch.zeros(5)
    for d in drafts:
        token, _ = accept_or_resample(p, q, d, g)
        counts[token] += 1
    freq = counts / n
    for x in range(5):
        se = math.sqrt(float(p[x] * (1 - p[x])) / n)
        assert abs(float(freq[x] - p[x])) <= 5 * se + 1e-9, (x, freq.tolist())


# thousands of tiny passes: measured 4x slower on 2 threads while another test runs beside it
@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("draft_name", ["model", "mtp"])
def test_speculative_sampling_follows_the_model_distribution(draft_name):
    """The first three sampled tokens (top_k=2: 8 sequences) with 2 drafts a round, against
    their exact probabilities from the model's own forward passes; 1,200 seeds, each
    sequence's frequency within 5 standard errors. The hybrid has one layer of each kind (a
    Gated DeltaNet state to restore after a rejection, a cache to cut back): half the cost of
    the tiny config's four. The draft model is `nearby`, so drafts are kept as well as refused
    (the random MTP head's drafts are refused: its rejections and rollbacks are tested)."""
    hybrid = dict(num_hidden_layers=2, layer_types=["linear_attention", "full_attention"])
    model = tiny("qwen3_5_text", **hybrid)
    draft = nearby(model) if draft_name == "model" else "mtp"
    settings = dict(temperature=1.0, top_k=2, top_p=1.0, min_p=0.0, eos_token_ids=[])

    def probs(prefix):  # the model's top-2 distribution after prefix
        with torch.no_grad():
            logits = model(torch.tensor([PROMPT + prefix]))[0, -1]
        top = torch.topk(logits, 2)
        return dict(zip(top.indices.tolist(), torch.softmax(top.values, -1).tolist(), strict=True))

    exact = {}
    for a, pa in probs([]).items():
        for b, pb in probs([a]).items():
            for c, pc in probs([a, b]).items():
                exact[(a, b, c)] = pa * pb * pc
    n = 1200
    counts = dict.fromkeys(exact, 0)
    for seed in range(n):
        got = list(
            generate_tokens(
                model, PROMPT, max_new_tokens=4, seed=seed, draft=draft, draft_tokens=2,
                **settings,
            )
        )  # fmt: skip
        counts[tuple(got[:3])] += 1  # a sequence outside the exact ones: KeyError
    for seq, p in exact.items():
        se = math.sqrt(p * (1 - p) / n)
        assert abs(counts[seq] / n - p) <= 5 * se + 1e-9, (seq, counts[seq] / n, p)


def test_generate_with_a_draft_returns_the_same_text():
    class Chars:  # a tokenizer of one character per id
        def encode(self, text):
            return [ord(c) % 128 for c in text]

        def decode(self, ids):
            return "".join(chr(i) for i in ids)

    model = tiny("qwen3_5_text")
    plain = generate(model, Chars(), "hello", 8, temperature=0, eos_token_ids=[])
    assert (
        generate(model, Chars(), "hello", 8, temperature=0, eos_token_ids=[], draft="mtp") == plain
    )
