"""Checks for chapter 7 (decoding fast: the bytes a decode step reads, the greedy acceptance of
speculative decoding, the rejection rule for sampling, one draft-and-verify round with its cache
rollback, the MTP head's step).

Expected values come from hand-worked examples, from naive loops written here (a tensor-by-tensor
count that skips repeated storage, greedy decoding recomputed from scratch without a cache) and,
for the rejection rule, from the distribution it must reproduce: thousands of draws with a fixed
generator (torch seeded) compared with the model's p within a stated tolerance.
"""

from __future__ import annotations

import torch

from qwen_mini import acceptance, mtp
from qwen_mini.architectures import ARCHITECTURES, config_from_dict
from qwen_mini.course.checking import between, case, mistake, register, seeded
from qwen_mini.course.lab import ch07 as lab
from qwen_mini.model import CausalLM
from qwen_mini.rope_scaling import rotary_cos_sin

register(
    "ch07.bytes_per_step",
    reference=lab.bytes_per_step,
    points=1,
    title="The bytes of weights one decode step reads",
)
register(
    "ch07.greedy_accept",
    reference=acceptance.greedy_accept,
    points=1,
    title="Greedy acceptance: the kept prefix and the model's own next token",
)
register(
    "ch07.accept_or_resample",
    reference=acceptance.accept_or_resample,
    points=2,
    title="The rejection rule: accept with min(1, p/q), else draw from the residual",
)
register(
    "ch07.verify",
    reference=lab.verify,
    points=2,
    title="One draft-and-verify round, the rejected drafts taken out of the cache",
)
register(
    "ch07.MTP",
    reference=mtp.MTP,
    points=2,
    title="The MTP step: two input norms, fc of [embedding; hidden], the layers at i + 1, the norm",
)


def _tiny(seed: int, tied: bool = True, dtype=torch.float32, hidden: int = 32, vocab: int = 64):
    """A tiny Qwen3-shaped model, weights drawn from N(0, 0.5²): sharp logits, so a greedy token
    is never a near tie."""
    cfg = config_from_dict(
        dict(
            model_type="qwen3", vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
            num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
            max_position_embeddings=256, rope_theta=10000.0, tie_word_embeddings=tied,
        )
    )  # fmt: skip
    model = CausalLM(cfg).eval()
    g = seeded(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    return model.to(dtype)


# --- bytes_per_step ------------------------------------------------------------------------------

BYTES = "ch07.bytes_per_step"


def naive_bytes(model) -> int:
    """Tensor by tensor from the state dict, each storage counted once; an untied input
    embedding counted as the one row a step looks up."""
    seen, total = set(), 0
    embed = model.model.embed_tokens.weight
    tied = embed.data_ptr() == model.lm_head.weight.data_ptr()
    for name, t in model.state_dict().items():
        if t.data_ptr() in seen:
            continue
        seen.add(t.data_ptr())
        if name == "model.embed_tokens.weight" and not tied:
            total += t.shape[1] * t.element_size()  # one row
        else:
            total += t.numel() * t.element_size()
    return total


for _name, _kw in [
    ("a tied model in float32", dict(tied=True)),
    ("an untied model in float32", dict(tied=False)),
    ("a tied model in bfloat16", dict(tied=True, dtype=torch.bfloat16)),
]:
    case(BYTES, _name, lambda g, kw=_kw: (_tiny(0, **kw),), expected=naive_bytes)
case(
    BYTES,
    "an untied model in bfloat16, other sizes",
    lambda g: (_tiny(1, tied=False, dtype=torch.bfloat16, hidden=16 * between(g, 2, 4)),),
    expected=naive_bytes,
    hidden=True,
)


@mistake(
    BYTES,
    "a tied embedding is the head's matrix, one tensor read once: the state dict lists it "
    "under both names, model.parameters() once",
)
def bytes_tied_twice(model):
    total = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    embed = model.model.embed_tokens.weight
    if embed is not model.lm_head.weight:
        total -= (embed.shape[0] - 1) * embed.shape[1] * embed.element_size()
    return total


@mistake(BYTES, "each parameter takes its own dtype's bytes (element_size(): 2 in bfloat16)")
def bytes_four_each(model):
    total = sum(p.numel() * 4 for p in model.parameters())
    embed = model.model.embed_tokens.weight
    if embed is not model.lm_head.weight:
        total -= (embed.shape[0] - 1) * embed.shape[1] * 4
    return total


@mistake(
    BYTES,
    "an untied input embedding is only looked up: a step reads the one row of its token, "
    "not the whole table",
)
def bytes_whole_embedding(model):
    return sum(p.numel() * p.element_size() for p in model.parameters())


@mistake(
    BYTES,
    "an untied embedding's row the step looks up is still read: count one row of it, not none",
)
def bytes_no_embedding(model):
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    embed = model.model.embed_tokens.weight
    if embed is not model.lm_head.weight:
        total -= embed.numel() * embed.element_size()
    return total


# --- greedy_accept -------------------------------------------------------------------------------

GREEDY = "ch07.greedy_accept"

for _name, _drafts, _targets, _want in [
    ("all 3 drafts kept: the bonus token after them", [5, 9, 2], [5, 9, 2, 7], (3, 7)),
    ("the second draft rejected: the model's token instead", [5, 9, 2], [5, 4, 2, 7], (1, 4)),
    ("the first draft rejected", [3, 1], [8, 1, 6], (0, 8)),
    ("a draft after a rejected one matches: not kept", [5, 9, 2, 6], [5, 1, 2, 6, 3], (1, 1)),
    ("no drafts: the model's token after the pending one", [], [4], (0, 4)),
]:  # fmt: skip
    case(
        GREEDY,
        _name,
        lambda g, d=_drafts, t=_targets: (list(d), list(t)),
        expected=lambda d, t, want=_want: want,
    )


def _random_round(g):
    k = between(g, 1, 6)
    targets = torch.randint(0, 5, (k + 1,), generator=g).tolist()
    drafts = [t if torch.rand((), generator=g) < 0.7 else (t + 1) % 5 for t in targets[:k]]
    return drafts, targets


def naive_greedy_accept(drafts, targets):
    for i, d in enumerate(drafts):
        if d != targets[i]:
            return i, targets[i]
    return len(drafts), targets[len(drafts)]


for _i in range(3):
    case(
        GREEDY, f"random rounds {_i + 1}", _random_round, expected=naive_greedy_accept, hidden=True
    )


@mistake(
    GREEDY,
    "position i's target judges draft i + 1 (targets[0] is the model's choice for d_1's "
    "place): comparing drafts[i] with targets[i + 1] is off by one",
)
def greedy_shifted(drafts, targets):
    n = 0
    while n < len(drafts) and drafts[n] == targets[n + 1]:
        n += 1
    return n, targets[min(n + 1, len(targets) - 1)]


@mistake(
    GREEDY,
    "when all k drafts are kept, the model's choice at position k is the bonus token: "
    "return (k, targets[k])",
)
def greedy_no_bonus(drafts, targets):
    for i, d in enumerate(drafts):
        if d != targets[i]:
            return i, targets[i]
    return (len(drafts) - 1, targets[len(drafts) - 1]) if drafts else (0, targets[0])


@mistake(
    GREEDY,
    "only the prefix before the first rejected draft is kept: a later draft was drafted "
    "after a wrong token, even when it happens to match",
)
def greedy_count_matches(drafts, targets):
    n = sum(d == t for d, t in zip(drafts, targets, strict=False))
    return n, targets[n]


@mistake(
    GREEDY,
    "at the first rejected draft the next token is the model's own choice targets[n], not "
    "the rejected draft",
)
def greedy_draft_as_next(drafts, targets):
    n, token = naive_greedy_accept(drafts, targets)
    return n, drafts[n] if n < len(drafts) else token


@mistake(
    GREEDY,
    "n counts the drafts kept, before the first rejected one: the rejected draft is not kept",
)
def greedy_counts_rejected(drafts, targets):
    n, token = naive_greedy_accept(drafts, targets)
    return (n + 1 if n < len(drafts) else n), token


# --- accept_or_resample --------------------------------------------------------------------------

ACCEPT = "ch07.accept_or_resample"
DRAWS = 2000  # standard error of a frequency <= 0.0112: the tolerance 0.05 is over 4 of them


def _statistics(impl, p, q):
    """Draw DRAWS drafts from q (a fixed generator) and pass each through `impl`, which draws
    from torch's global generator (seeded alike for every implementation; a generator object
    cannot cross to the grader's sandbox)."""
    counts, kept = torch.zeros(p.shape[0]), 0
    for d in torch.multinomial(q, DRAWS, replacement=True, generator=seeded(1)).tolist():
        token, ok = impl(p, q, d)
        counts[int(token)] += 1
        kept += bool(ok)
    return {
        f"distribution of the tokens returned ({DRAWS} draws)": counts / DRAWS,
        "share of the drafts accepted": torch.tensor(kept / DRAWS),
    }


def _exact_distribution(p, q):
    return {
        f"distribution of the tokens returned ({DRAWS} draws)": p,
        "share of the drafts accepted": torch.minimum(p, q).sum(),
    }


for _name, _p, _q in [
    (
        "a poor draft (it favours what the model does not)",
        [0.5, 0.3, 0.15, 0.05],
        [0.1, 0.1, 0.4, 0.4],
    ),
    (
        "a draft that puts mass where the model has none",
        [0.0, 0.6, 0.4, 0.0, 0.0],
        [0.3, 0.3, 0.1, 0.2, 0.1],
    ),
]:
    case(
        ACCEPT,
        _name,
        lambda g, p=_p, q=_q: (torch.tensor(p), torch.tensor(q)),
        _statistics,
        _exact_distribution,
        atol=0.05,
    )


def _random_pair(g):
    V = between(g, 3, 6)
    p = torch.rand(V, generator=g) ** 2
    q = torch.rand(V, generator=g) ** 2
    return p / p.sum(), q / q.sum()


case(
    ACCEPT, "random p and q", _random_pair, _statistics, _exact_distribution, atol=0.05, hidden=True
)


def _always_kept(impl):
    """Drafts the model likes at least as much as the draft did: kept every time."""
    p, q = torch.tensor([0.4, 0.4, 0.1, 0.1]), torch.tensor([0.25, 0.25, 0.25, 0.25])
    return [tuple(map(type_free, impl(p, q, t))) for t in (0, 1) for _ in range(20)]


def type_free(x):
    return x.item() if isinstance(x, torch.Tensor) else x


case(
    ACCEPT,
    "a draft with p(token) >= q(token) is always kept",
    lambda g: (),
    _always_kept,
    expected=lambda: [(t, True) for t in (0, 1) for _ in range(20)],
)


def _never_kept(impl):
    """A draft the model gives no probability: never kept, never returned."""
    p, q = torch.tensor([0.0, 0.5, 0.5]), torch.tensor([0.5, 0.25, 0.25])
    out = [impl(p, q, 0) for _ in range(40)]
    return {
        "times the draft was accepted": sum(bool(ok) for _, ok in out),
        "times token 0 (p = 0) was returned": sum(int(t) == 0 for t, _ in out),
    }


case(
    ACCEPT,
    "a draft with p(token) = 0 is never kept",
    lambda g: (),
    _never_kept,
    expected=lambda: {"times the draft was accepted": 0, "times token 0 (p = 0) was returned": 0},
)


def _residual_draw(residual, generator):
    return int(torch.multinomial(residual / residual.sum(), 1, generator=generator))


@mistake(
    ACCEPT,
    "on rejection draw from the residual max(0, p - q), renormalised: drawing from p again "
    "gives the tokens the draft already offered too much weight",
)
def resample_from_p(p, q, token, generator=None):
    if torch.rand((), generator=generator) * q[token] < p[token]:
        return token, True
    return _residual_draw(p, generator), False


@mistake(
    ACCEPT,
    "accept with probability min(1, p(token) / q(token)): the ratio of the model's "
    "probability to the draft's, not p(token) alone",
)
def accept_with_p(p, q, token, generator=None):
    if torch.rand((), generator=generator) < p[token]:
        return token, True
    return _residual_draw((p - q).clamp(min=0), generator), False


@mistake(
    ACCEPT,
    "the residual is max(0, p - q), what the model wants more than the draft offered, "
    "not max(0, q - p)",
)
def residual_reversed(p, q, token, generator=None):
    if torch.rand((), generator=generator) * q[token] < p[token]:
        return token, True
    return _residual_draw((q - p).clamp(min=0), generator), False


@mistake(
    ACCEPT,
    "the residual max(0, p - q) sums to 1 - sum min(p, q), not 1: renormalise it before "
    "drawing from it",
)
def residual_not_renormalised(p, q, token, generator=None):
    if torch.rand((), generator=generator) * q[token] < p[token]:
        return token, True
    residual = (p - q).clamp(min=0)
    u = torch.rand((), generator=generator)  # inverse CDF of an unnormalised residual
    return min(int((residual.cumsum(0) <= u).sum()), p.shape[0] - 1), False


@mistake(
    ACCEPT,
    "on rejection draw from the residual: its most likely token every time is not a sample",
)
def resample_argmax(p, q, token, generator=None):
    if torch.rand((), generator=generator) * q[token] < p[token]:
        return token, True
    return int((p - q).clamp(min=0).argmax()), False


# --- verify --------------------------------------------------------------------------------------

VERIFY = "ch07.verify"


def _plain_greedy(model, ids: list[int], n: int) -> list[int]:
    """n greedy tokens after ids, the whole sequence recomputed each step (no cache)."""
    ids, out = list(ids), []
    with torch.no_grad():
        for _ in range(n):
            out.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
            ids.append(out[-1])
    return out


def _round(seed: int, k: int, wrong_at: int | None):
    """A model, a prompt and its cache after the prompt, the pending token and k drafts: the
    model's own greedy continuation, changed at `wrong_at` (None: all right)."""
    model = _tiny(seed)
    prompt = torch.randint(0, 64, (6,), generator=seeded(seed + 1)).tolist()
    greedy = _plain_greedy(model, prompt, k + 2)
    drafts = greedy[1 : k + 1]
    if wrong_at is not None:
        drafts[wrong_at] = (drafts[wrong_at] + 1) % 64
    return model, prompt, greedy, drafts


def _verify_run(impl, seed, k, wrong_at):
    model, prompt, _, drafts = _round(seed, k, wrong_at)
    with torch.no_grad():
        cache = model.new_cache(1)
        token = int(model(torch.tensor([prompt]), cache=cache)[0, -1].argmax())
        n, following = impl(model, cache, token, list(drafts))
        n, following = int(n), int(following)
        length = cache.length
        # the cache must now describe prompt + token + kept drafts: the next step from it
        # equals a pass over that sequence from scratch
        kept = prompt + [token] + drafts[:n]
        step = model(torch.tensor([[following]]), cache=cache)[0, -1]
        fresh = model(torch.tensor([kept + [following]]))[0, -1]
    return {
        "n (drafts kept)": n,
        "the next token (the model's own)": following,
        f"cache length after the round (prompt {len(prompt)} + 1 + n)": length,
        "the next step from that cache equals a fresh pass over prompt + token + kept": bool(
            torch.allclose(step, fresh, atol=1e-4, rtol=1e-4)
        ),
    }


def _verify_expected(seed, k, wrong_at):
    model, prompt, greedy, drafts = _round(seed, k, wrong_at)
    n = k if wrong_at is None else wrong_at
    return {
        "n (drafts kept)": n,
        "the next token (the model's own)": greedy[n + 1],
        f"cache length after the round (prompt {len(prompt)} + 1 + n)": len(prompt) + 1 + n,
        "the next step from that cache equals a fresh pass over prompt + token + kept": True,
    }


def _verify_case(name, seed, k, wrong_at, hidden=False):
    case(
        VERIFY,
        name,
        lambda g: (),
        lambda impl: _verify_run(impl, seed, k, wrong_at),
        expected=lambda: _verify_expected(seed, k, wrong_at),
        hidden=hidden,
    )


_verify_case("3 drafts, all kept (the bonus token)", 0, 3, None)
_verify_case("4 drafts, the second rejected", 1, 4, 1)
_verify_case("2 drafts, the first rejected", 2, 2, 0)
_verify_case("5 drafts, the last rejected", 3, 5, 4, hidden=True)
_verify_case("1 draft, kept", 4, 1, None, hidden=True)
_verify_case("no drafts", 5, 0, None, hidden=True)


def _pass(model, cache, ids):
    return model(torch.tensor([ids]), cache=cache)[0]  # [len(ids), V]


@mistake(
    VERIFY,
    "the rejected drafts' keys and values stay in the cache, and every later token would "
    "attend to them: truncate it to its length before the round + 1 + n",
)
def verify_no_rollback(model, cache, token, drafts):
    return acceptance.greedy_accept(
        drafts, _pass(model, cache, [token, *drafts]).argmax(-1).tolist()
    )


@mistake(
    VERIFY,
    "the pending token was fed this round and is part of the output: the cache keeps it and "
    "the n kept drafts (its length before + 1 + n)",
)
def verify_rollback_too_far(model, cache, token, drafts):
    start = cache.length
    n, following = acceptance.greedy_accept(
        drafts, _pass(model, cache, [token, *drafts]).argmax(-1).tolist()
    )
    cache.truncate(start + n)
    return n, following


@mistake(
    VERIFY,
    "feed the pending token first, [token] + drafts: position 0's logits judge d_1, and the "
    "pending token belongs in the cache",
)
def verify_drafts_only(model, cache, token, drafts):
    start = cache.length
    logits = _pass(model, cache, drafts)  # [k, V]: position i judges d_{i+2}
    targets = logits.argmax(-1).tolist()
    n, following = acceptance.greedy_accept(drafts[1:], targets)
    cache.truncate(start + n + 1)
    return n, following


# --- MTP -----------------------------------------------------------------------------------------

MTP_ID = "ch07.MTP"


def _mtp_config(model_type="qwen3_5_text", layers=1, **moe):
    """A tiny config of an MTP-carrying family: gated attention with partial rotary (a quarter of
    each head), `layers` MTP layers; `moe`: Qwen3-Next's experts for every layer."""
    return config_from_dict(
        dict(
            model_type=model_type, vocab_size=64, hidden_size=32, intermediate_size=48,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
            partial_rotary_factor=0.5, layer_types=["linear_attention", "full_attention"],
            linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=8,
            linear_value_head_dim=8, linear_conv_kernel_dim=4, max_position_embeddings=128,
            rope_theta=10000.0, mtp_num_hidden_layers=layers, **moe,
        )
    )  # fmt: skip


def _mtp_reference(cfg, seed):
    """The package's MTP with every weight drawn (norms near 1 but each its own, so that two
    norms swapped give other numbers)."""
    head = mtp.MTP(cfg, ARCHITECTURES[cfg.model_type])
    g = seeded(seed)
    with torch.no_grad():
        for name, p in head.named_parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (0.3 if "norm" in name else 0.2))
    return head.eval()


def _mtp_inputs(cfg, B, T, pieces, dtype=torch.float32):
    def inputs(g):
        embeds = torch.randn(B, T, cfg.hidden_size, generator=g).to(dtype)
        hidden = torch.randn(B, T, cfg.hidden_size, generator=g).to(dtype)
        return cfg, embeds, hidden, tuple(pieces)

    return inputs


def _mtp_run(MTP, cfg, embeds, hidden, pieces, seed=0):
    """The learner's MTP (the reference's weights) with no cache, then fed in `pieces` through
    the reference's cache: the outputs and the cache's length after each piece."""
    reference = _mtp_reference(cfg, seed)
    mine = MTP(cfg, ARCHITECTURES[cfg.model_type]).eval()
    mine.load_state_dict(reference.state_dict())
    mine.to(embeds.dtype)
    out = {}
    with torch.no_grad():
        out["output, no cache"] = mine(embeds, hidden)
        cache = reference.to(embeds.dtype).new_cache(embeds.shape[0])
        outs, lengths, start = [], [], 0
        for n in pieces:
            outs.append(mine(embeds[:, start : start + n], hidden[:, start : start + n], cache))
            lengths.append(cache.length)
            start += n
    out[f"fed in pieces {list(pieces)} through a cache: outputs"] = torch.cat(outs, 1)
    out["cache length after each piece (committed)"] = lengths
    return out


def _mtp_written_out(cfg, embeds, hidden, pieces, seed=0):
    """The step written out from the description with the reference's parts: positions 1 .. T,
    no cache (a cache must give what recomputing everything gives)."""
    m = _mtp_reference(cfg, seed).to(embeds.dtype)
    T = embeds.shape[1]
    with torch.no_grad():
        x = m.fc(torch.cat([m.pre_fc_norm_embedding(embeds), m.pre_fc_norm_hidden(hidden)], -1))
        cos, sin = rotary_cos_sin(cfg, torch.arange(1, T + 1), x.dtype)
        for layer in m.layers:
            x = layer(x, cos, sin, None)
        y = m.norm(x)
    return {
        "output, no cache": y,
        f"fed in pieces {list(pieces)} through a cache: outputs": y,
        "cache length after each piece (committed)": torch.tensor(pieces).cumsum(0).tolist(),
    }


for _name, _cfg, _shape, _kw in [
    ("one MTP layer; 2 sequences, fed 3, 1, 2", _mtp_config(), (2, 6, (3, 1, 2)), {}),
    ("two MTP layers; fed 2, 1, 1, 3", _mtp_config(layers=2), (1, 7, (2, 1, 1, 3)), {}),
    (
        "bfloat16: fed 4 then 1, 1",
        _mtp_config(),
        (1, 6, (4, 1, 1)),
        dict(dtype=torch.bfloat16, atol=3e-2, rtol=3e-2),
    ),
]:
    _dtype = _kw.pop("dtype", torch.float32)
    case(
        MTP_ID,
        _name,
        _mtp_inputs(_cfg, *_shape, dtype=_dtype),
        _mtp_run,
        _mtp_written_out,
        **{"atol": 1e-5, "rtol": 1e-4, **_kw},
    )


def _mtp_moe_inputs(g):
    cfg = _mtp_config(
        "qwen3_next", layers=1, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
        shared_expert_intermediate_size=16, decoder_sparse_step=1, norm_topk_prob=True,
    )  # fmt: skip
    T = between(g, 5, 8)
    return _mtp_inputs(cfg, 2, T, (T - 3, 1, 2))(g)


case(
    MTP_ID,
    "Qwen3-Next: the MTP layer with experts",
    _mtp_moe_inputs,
    _mtp_run,
    _mtp_written_out,
    atol=1e-5,
    rtol=1e-4,
    hidden=True,
)


def _mtp_variant(hidden_first=False, swap_norms=False, no_out_norm=False, no_commit=False,
                 no_in_norms=False, restart_positions=False, first_layer_only=False):  # fmt: skip
    class Variant(mtp.MTP):
        def forward(self, embeds, hidden, cache=None):
            start = cache.length if cache is not None and not restart_positions else 0
            e, h = embeds, hidden
            if not no_in_norms:
                e, h = self.pre_fc_norm_embedding(embeds), self.pre_fc_norm_hidden(hidden)
            if swap_norms:
                e, h = self.pre_fc_norm_hidden(embeds), self.pre_fc_norm_embedding(hidden)
            x = self.fc(torch.cat([h, e] if hidden_first else [e, h], dim=-1))
            positions = torch.arange(start + 1, start + 1 + x.shape[1])
            cos, sin = rotary_cos_sin(self.config, positions, x.dtype)
            for i, layer in enumerate(self.layers[:1] if first_layer_only else self.layers):
                x = layer(x, cos, sin, cache.layers[i] if cache is not None else None)
            if cache is not None and not no_commit:
                cache.commit(x.shape[1])
            return x if no_out_norm else self.norm(x)

    return Variant


for _name, _flags, _idea in (
    (
        "mtp_hidden_first",
        dict(hidden_first=True),
        "fc reads [embedding; hidden state], embedding first: its weight's first H columns were "
        "trained on the embedding",
    ),
    (
        "mtp_norms_swapped",
        dict(swap_norms=True),
        "pre_fc_norm_embedding norms the embedding and pre_fc_norm_hidden the hidden state, "
        "each with its own weight",
    ),
    (
        "mtp_no_input_norms",
        dict(no_in_norms=True),
        "both inputs are normed before fc (pre_fc_norm_embedding, pre_fc_norm_hidden)",
    ),
    (
        "mtp_no_output_norm",
        dict(no_out_norm=True),
        "the output goes through mtp.norm: the shared head reads normed states, as it does "
        "after the model's final norm",
    ),
    (
        "mtp_no_commit",
        dict(no_commit=True),
        "with a cache, commit the T new steps (cache.commit(T)) once every layer has run: "
        "the layers only stage them",
    ),
    (
        "mtp_first_layer_only",
        dict(first_layer_only=True),
        "every MTP layer runs, in order (mtp_num_hidden_layers may be more than 1)",
    ),
    (
        "mtp_positions_restart",
        dict(restart_positions=True),
        "with a cache, positions continue after the cached steps (start = cache.length): "
        "restarting at 1 for every piece breaks attention to the cached keys",
    ),
):
    mistake(MTP_ID, _idea, name=_name)(_mtp_variant(**_flags))
