"""The hand-written Qwen3 template (qwen_mini.chat.render_prompt) against two oracles: the
official Jinja template rendered by jinja2 (qwen_mini.tokenizer) and by transformers.

The corpus (tests/data/chat_corpus.json) is written by hand: see the names of its entries. Each
conversation is rendered with enable_thinking True / False / absent and with and without the
generation prompt: six byte-for-byte comparisons per conversation and oracle.
"""

import json
from pathlib import Path

import pytest

from qwen_mini import chat, load_tokenizer
from qwen_mini.tokenizer import VENDORED_QWEN3

CORPUS = json.loads((Path(__file__).parent / "data" / "chat_corpus.json").read_text("utf-8"))
VARIANTS = [(g, t) for g in (True, False) for t in (True, False, None)]


def _options(case, add_generation_prompt, enable_thinking):
    kw = {"add_generation_prompt": add_generation_prompt}
    if case.get("tools") is not None:
        kw["tools"] = case["tools"]
    if enable_thinking is not None:  # absent, not None: the template tests `is defined`
        kw["enable_thinking"] = enable_thinking
    return kw


def test_corpus_covers_the_cases():
    assert len(CORPUS) >= 60
    names = {c["name"] for c in CORPUS}
    assert len(names) == len(CORPUS)
    msgs = [m for c in CORPUS for m in c["messages"]]
    assert any(m.get("reasoning_content") for m in msgs)
    assert any("</think>" in m["content"] for m in msgs if m["role"] == "assistant")
    assert any(m["role"] == "tool" for m in msgs)
    calls = [t for m in msgs for t in m.get("tool_calls") or []]
    args = [(t.get("function") or t)["arguments"] for t in calls]
    assert any(isinstance(a, str) for a in args) and any(isinstance(a, dict) for a in args)
    assert any(m["content"].strip() == "" for m in msgs)
    assert any(not m["content"].isascii() for m in msgs)


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(VENDORED_QWEN3)


@pytest.mark.parametrize("case", CORPUS, ids=[c["name"] for c in CORPUS])
def test_same_bytes_as_jinja(case, tokenizer):
    for gen, think in VARIANTS:
        kw = _options(case, gen, think)
        expected = tokenizer.apply_chat_template(case["messages"], **kw)
        assert chat.render_prompt(case["messages"], **kw) == expected, (gen, think)


@pytest.fixture(scope="module")
def hf_tokenizer():
    transformers = pytest.importorskip("transformers")  # in the dev extra: never skipped there
    return transformers.AutoTokenizer.from_pretrained(str(VENDORED_QWEN3))


def test_same_bytes_as_transformers(hf_tokenizer):
    compared = 0
    for case in CORPUS:
        for gen, think in VARIANTS:
            kw = _options(case, gen, think)
            expected = hf_tokenizer.apply_chat_template(case["messages"], tokenize=False, **kw)
            got = chat.render_prompt(case["messages"], **kw)
            assert got == expected, (case["name"], gen, think)
            compared += 1
    assert compared == 6 * len(CORPUS)


def test_quote_sees_every_piece_of_conversation_text():
    # conversation text marked by quote, template text not: removing the marks gives the prompt
    for case in CORPUS:
        kw = _options(case, True, None)
        marked = chat.render_prompt(case["messages"], quote=lambda s: f"«{s}»", **kw)
        plain = chat.render_prompt(case["messages"], **kw)
        assert marked.replace("«", "").replace("»", "") == plain.replace("«", "").replace("»", "")
        assert marked.count("«") > len(case["messages"]) - 1  # at least one mark per message


@pytest.mark.parametrize(
    "messages, needle",
    [
        ([], "empty"),
        ([{"role": "robot", "content": "x"}], "role"),
        ([{"role": "user", "content": None}], "content"),
        ([{"role": "user"}], "content"),
        (["hello"], "dict"),
    ],
)
def test_bad_messages_are_refused_clearly(messages, needle):
    with pytest.raises(ValueError, match=needle):
        chat.render_prompt(messages)
