# Generated from solutions/ch04_thinking.ipynb by python -m qwen_mini.course.build —
# edit the notebook, not this file.

"""The Qwen3 chat template written by hand, reasoning parsing, the thinking budget,
injection-safe encoding and a chat session that reuses its KV cache across turns.
"""

import json
import re
import secrets
import time
import warnings
from collections.abc import Callable, Iterator

import torch

from qwen_mini.families import FAMILIES
from qwen_mini.generation import (
    Sampling,
    eos_ids_for,
    next_token,
    seeded_generator,
    stream_text,
)
from qwen_mini.tokenizer import check_conversation, check_text, is_whole_number


def render_turn(role: str, content: str) -> str:
    """One turn of the conversation as Qwen3 was trained on it (ChatML)."""
    return "<|im_start|>" + role + "\n" + content + "<|im_end|>\n"


def generation_prompt(enable_thinking: bool | None = None) -> str:
    """What ends the prompt so that the model writes the assistant's reply."""
    if enable_thinking is False:  # only an explicit False: None means "not passed"
        return "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    return "<|im_start|>assistant\n"


def is_tool_response(content: str) -> bool:
    """A user turn that only wraps a tool's output (how some clients send tool results)."""
    return content.startswith("<tool_response>") and content.endswith("</tool_response>")


def last_query_index(messages: list[dict]) -> int:
    """Index of the last real user query: a user turn that is not a wrapped tool response.
    Without one, the index of the last message."""
    for i in range(len(messages) - 1, -1, -1):
        m = messages[i]
        if m["role"] == "user" and not is_tool_response(m["content"]):
            return i
    return len(messages) - 1


def split_reasoning(message: dict) -> tuple[str, str]:
    """(reasoning, content) of an assistant message, as the template reads them."""
    content = message["content"]
    if message.get("reasoning_content") is not None:  # an explicit field wins, even ""
        return message["reasoning_content"], content
    if "</think>" not in content:
        return "", content
    before, after = content.split("</think>")[0], content.split("</think>")[-1]
    return before.rstrip("\n").split("<think>")[-1].lstrip("\n"), after.lstrip("\n")


TOOLS_INTRO = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
TOOLS_OUTRO = (
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
)


def to_json(value) -> str:
    """JSON as the template's `tojson` writes it: ", " and ": " separators, non-ASCII kept."""
    return json.dumps(value, ensure_ascii=False)


def _same(text: str) -> str:
    return text


def render_header(messages: list[dict], tools: list[dict] | None, quote=_same) -> str:
    """The system turn: the first message if it is a system message, plus the tools if any."""
    system = messages[0]["content"] if messages[0]["role"] == "system" else None
    if not tools:
        return "" if system is None else render_turn("system", quote(system))
    out = "<|im_start|>system\n" + ("" if system is None else quote(system) + "\n\n")
    out += TOOLS_INTRO + "".join("\n" + quote(to_json(tool)) for tool in tools)
    return out + TOOLS_OUTRO


def render_tool_call(call: dict, quote=_same) -> str:
    """One tool call: {"function": {"name", "arguments"}} or {"name", "arguments"}."""
    call = call.get("function") or call
    arguments = call["arguments"]
    if not isinstance(arguments, str):  # an object is written as JSON, a string as it is
        arguments = to_json(arguments)
    return (
        '<tool_call>\n{"name": "'
        + quote(call["name"])
        + '", "arguments": '
        + quote(arguments)
        + "}\n</tool_call>"
    )


def _validate(messages: list[dict], tools: list[dict] | None) -> None:
    """What the official template would silently drop or crash on (an unknown role, a
    malformed tool call, tools given as one string) is refused, as the tokenizer refuses it."""
    try:
        check_conversation(messages, tools)
    except (TypeError, ValueError) as e:
        raise type(e)(f"render_prompt: {e}") from None
    for i, m in enumerate(messages):
        if not isinstance(m.get("content"), str):
            raise ValueError(
                f"render_prompt: message {i} ({m['role']}) needs 'content' as a string "
                f"(use '' for none), got {m.get('content')!r}"
            )


def render_prompt(
    messages: list[dict],
    *,
    tools: list[dict] | None = None,
    add_generation_prompt: bool = True,
    enable_thinking: bool | None = None,
    quote: Callable[[str], str] = _same,
) -> str:
    """The Qwen3 chat template in plain Python: the same string, byte for byte.

    quote: applied to every piece of text that comes from the conversation (contents, reasoning,
        tool definitions, names and arguments) just before it is written; the template's own
        text never passes through it. `encode_messages` uses it to keep the two apart.
    """
    _validate(messages, tools)
    out = render_header(messages, tools, quote)
    last_query, n = last_query_index(messages), len(messages)
    for i, m in enumerate(messages):
        role = m["role"]
        if role == "user" or (role == "system" and i > 0):
            out += render_turn(role, quote(m["content"]))
        elif role == "assistant":
            reasoning, content = split_reasoning(m)
            if i > last_query and (i == n - 1 or reasoning):
                out += "<|im_start|>assistant\n<think>\n" + quote(reasoning.strip("\n"))
                out += "\n</think>\n\n" + quote(content.lstrip("\n"))
            else:
                out += "<|im_start|>assistant\n" + quote(content)
            for j, call in enumerate(m.get("tool_calls") or []):
                out += "\n" if (j > 0 or content) else ""
                out += render_tool_call(call, quote)
            out += "<|im_end|>\n"
        elif role == "tool":
            if i == 0 or messages[i - 1]["role"] != "tool":
                out += "<|im_start|>user"
            out += "\n<tool_response>\n" + quote(m["content"]) + "\n</tool_response>"
            if i == n - 1 or messages[i + 1]["role"] != "tool":
                out += "<|im_end|>\n"
    if add_generation_prompt:
        out += generation_prompt(enable_thinking)
    return out


def parse_reply(text: str, *, thinking: bool = False) -> tuple[str, str]:
    """Split generated text into (reasoning, answer).

    thinking: the prompt already opened the think block, so `text` starts inside it. Otherwise
    a think block exists only if `text` starts with `<think>`. Newlines around the reasoning and
    at the start of the answer are dropped, as the template drops them. An unterminated block
    is all reasoning and no answer.
    """
    if not thinking:
        if not text.startswith("<think>"):
            return "", text
        text = text[len("<think>") :]
    reasoning, closed, answer = text.partition("</think>")  # the FIRST </think> ends it
    return reasoning.strip("\n"), answer.lstrip("\n") if closed else ""


def _partial_tag(text: str, tag: str) -> int:
    """Length of the longest end of `text` that could be the start of `tag`."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class ThinkingStream:
    """Routes streamed text to "thinking" or "answer" as it arrives.

    feed(piece) and close() return lists of (channel, text) events. Joined per channel, the events
    equal `parse_reply` of the whole text, however the text was cut into pieces.
    """

    def __init__(self, thinking: bool = False):
        self.state = "thinking" if thinking else "start"  # "start" | "thinking" | "answer"
        self.pending = ""  # received but not routed yet
        self.fresh = True  # nothing emitted in this channel yet: leading newlines are dropped

    def feed(self, piece: str) -> list[tuple[str, str]]:
        self.pending += piece
        return self._route(final=False)

    def close(self) -> list[tuple[str, str]]:
        return self._route(final=True)

    def _route(self, final: bool) -> list[tuple[str, str]]:
        events = []
        while True:
            if self.state == "start":
                if self.pending.startswith("<think>"):
                    self.pending, self.state = self.pending[len("<think>") :], "thinking"
                    continue
                if "<think>".startswith(self.pending) and not final:
                    return events  # could still become <think>: wait
                self.state, self.fresh = "answer", False  # no think block: text as it is
                continue
            if self.fresh:
                self.pending = self.pending.lstrip("\n")
            if self.state == "answer":
                text, self.pending = self.pending, ""
            else:
                end = self.pending.find("</think>")
                if end >= 0:
                    text = self.pending[:end].rstrip("\n")
                    self.pending = self.pending[end + len("</think>") :]
                    if text:
                        events.append(("thinking", text))
                    self.state, self.fresh = "answer", True
                    continue
                # hold back what could be the start of </think> and trailing newlines
                keep = len(self.pending) - _partial_tag(self.pending, "</think>")
                text = self.pending[:keep] if not final else self.pending
                text = text.rstrip("\n")
                self.pending = self.pending[len(text) :] if not final else ""
            if text:
                events.append((self.state, text))
                self.fresh = False
            return events


# The instruction of the Qwen3 technical report (section 4.3), then the block closed as the
# template closes one.
BUDGET_STOP = (
    "\n\nConsidering the limited time by the user, I have to give the solution based on the "
    "thinking directly now.\n</think>\n\n"
)


def budgeted_tokens(
    step: Callable[[list[int]], int],
    prompt_ids: list[int],
    *,
    budget: int | None,
    forced_ids: list[int],
    think_id: int,
    end_think_id: int,
    stop_ids: set[int],
    max_new_tokens: int,
    thinking: bool = False,
) -> Iterator[int]:
    """Yield the reply's tokens; after `budget` thinking tokens, force the end of thinking.

    step(ids): appends ids to the model's context and returns the next token it chooses.
    forced_ids: what is inserted when the budget is spent (it ends with </think>).
    thinking: the prompt already opened the think block. The forced tokens are yielded like
    generated ones and count towards max_new_tokens, whole or not at all: they come early when
    only they still fit, and a budget spent with less room ends the reply. A stop id is yielded
    last.
    """
    feed, inside, spent, forced, n = list(prompt_ids), thinking, 0, False, 0
    while n < max_new_tokens:
        room = max_new_tokens - n
        due = budget is not None and (spent >= budget or room == len(forced_ids))
        if inside and due and not forced:
            if room < len(forced_ids):
                return  # a cut instruction would leave the think block open anyway
            yield from forced_ids
            n, feed, inside, forced = n + len(forced_ids), feed + forced_ids, False, True
            continue
        token = step(feed)
        feed, n = [token], n + 1
        yield token
        if token in stop_ids:
            return
        if token == think_id and not inside:
            inside = True
        elif token == end_think_id:
            inside = False
        elif inside:
            spent += 1  # the budget counts tokens of thinking, not the tags


def sampling_preset(thinking: bool, family: str = "qwen3", **overrides) -> dict:
    """The recommended sampling settings for a mode (each family's `sampling`, from
    generation_config.json and the model cards); explicit values win. Warns about greedy
    decoding in thinking mode, which the model cards advise against (endless repetition)."""
    if family not in FAMILIES:
        raise ValueError(f"no sampling preset for family {family!r}; known: {sorted(FAMILIES)}")
    settings = dict(FAMILIES[family].sampling[thinking])
    settings.update({k: v for k, v in overrides.items() if v is not None})
    if thinking and settings.get("temperature") == 0:
        warnings.warn(
            "greedy decoding (temperature 0) in thinking mode: the Qwen3 model card advises "
            "against it, as it can make the model repeat itself endlessly; use the thinking "
            "preset (temperature 0.6, top_p 0.95, top_k 20).",
            stacklevel=2,
        )
    return settings


_PLAIN: dict[str, object] = {}


def plain_tokenizer(tokenizer):
    """The same BPE without its added tokens: `<|im_end|>` in the text stays text."""
    key = str(tokenizer.path)
    if key not in _PLAIN:
        import tokenizers

        from qwen_mini.tokenizer import read_tokenizer_json

        spec = read_tokenizer_json(tokenizer.path)  # the Qwen3.5 file is gzipped
        spec["added_tokens"] = []
        _PLAIN[key] = tokenizers.Tokenizer.from_str(json.dumps(spec))
    return _PLAIN[key]


def encode_plain(tokenizer, text: str) -> list[int]:
    """Ids of `text` as plain text: no control tokens, whatever the text contains."""
    return plain_tokenizer(tokenizer).encode(text, add_special_tokens=False).ids


def encode_pieces(tokenizer, pieces: list[tuple[str, bool]]) -> list[int]:
    """Ids of a prompt given as (text, from_conversation) pieces.

    Control tokens are recognised only in the template's own text. Text between two control
    tokens is encoded as one run, across piece boundaries, as the default encoding does.
    """
    control = re.compile("|".join(map(re.escape, sorted(tokenizer.special_tokens, key=len)[::-1])))
    ids, run = [], ""
    for text, from_conversation in pieces:
        if from_conversation:
            run += text
            continue
        start = 0
        for match in control.finditer(text):
            run += text[start : match.start()]
            ids += encode_plain(tokenizer, run) + [tokenizer.special_tokens[match.group()]]
            run, start = "", match.end()
        run += text[start:]
    return ids + encode_plain(tokenizer, run)


def prompt_pieces(messages: list[dict], **options) -> list[tuple[str, bool]]:
    """`render_prompt` cut into (text, from_conversation) pieces, using its `quote` hook."""
    nonce, texts = secrets.token_hex(8), []

    def quote(text: str) -> str:
        texts.append(text)
        return f"\ue000{nonce}:{len(texts) - 1}\ue001"

    marked = render_prompt(messages, quote=quote, **options)
    parts = re.split(f"\ue000{nonce}:(\\d+)\ue001", marked)
    pieces = [(p, i % 2 == 1) for i, p in enumerate(parts)]
    pieces = [(texts[int(p)], True) if conv else (p, False) for p, conv in pieces]
    if "".join(p for p, _ in pieces) != render_prompt(messages, **options):
        raise RuntimeError("render_prompt must pass conversation text through `quote` unchanged")
    return pieces


def encode_messages(
    tokenizer,
    messages: list[dict],
    *,
    tools: list[dict] | None = None,
    add_generation_prompt: bool = True,
    enable_thinking: bool | None = None,
    contents_as_text: bool = True,
) -> list[int]:
    """Token ids of the prompt. With contents_as_text (the default) nothing a user, a tool or
    a document wrote can become a control token; False encodes the rendered string as a whole,
    as `tokenizer.encode(render_prompt(...))` does."""
    options = dict(
        tools=tools, add_generation_prompt=add_generation_prompt, enable_thinking=enable_thinking
    )
    if not contents_as_text:
        return tokenizer.encode(render_prompt(messages, **options))
    return encode_pieces(tokenizer, prompt_pieces(messages, **options))


def common_prefix_length(a: list[int], b: list[int]) -> int:
    """Number of leading tokens two id lists share."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def prefill(model, cache, cached: list[int], ids: list[int]) -> tuple[torch.Tensor, int]:
    """Logits [vocab] (float32) after the prompt `ids`, reusing what `cache` holds of the tokens
    `cached`; returns (logits, tokens reused). Afterwards the cache holds exactly `ids`."""
    reused = min(common_prefix_length(cached, ids), len(ids) - 1)  # compute >= 1: its logits
    cache.truncate(reused)  # the old reply (with its reasoning) is not in the new prompt
    x = torch.tensor([ids[reused:]], device=next(model.parameters()).device)  # [1, T_new]
    with torch.inference_mode():
        logits = model(x, cache=cache, last_only=True)[0, -1]  # [V]
    return logits.float(), reused


def reply_message(text: str, thinking: bool) -> dict:
    """The assistant turn the history keeps for the generated `text`. thinking: the prompt
    opened the think block, so `text` starts inside it."""
    reasoning, answer = parse_reply(text, thinking=thinking)
    return {"role": "assistant", "content": answer, "reasoning_content": reasoning}


class ChatSession:
    """A multi-turn chat that keeps the history as the template expects and reuses the KV cache.

    Each turn renders the whole conversation, keeps the cached tokens it shares with the new
    prompt and computes only the rest. `turns` records, per turn, the prompt length, the tokens
    reused and computed, the tokens generated and spent thinking, and the time.
    """

    def __init__(
        self,
        model,
        tokenizer,
        *,
        thinking: bool = True,
        budget: int | None = None,
        system: str | None = None,
        max_new_tokens: int = 512,
        seed: int | None = None,
        **sampling,
    ):
        if not isinstance(thinking, bool):  # "no" is truthy: it would silently mean True
            raise ValueError(f"ChatSession: thinking must be True or False, got {thinking!r}")
        if budget is not None and (not is_whole_number(budget) or budget < 0):
            raise ValueError(
                f"ChatSession: budget must be a whole number of thinking tokens >= 0 (None: no "
                f"budget), got {budget!r}"
            )
        self.model, self.tokenizer, self.thinking, self.budget = model, tokenizer, thinking, budget
        if not is_whole_number(max_new_tokens) or max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be a whole number >= 0, got {max_new_tokens!r}")
        self.max_new_tokens = max_new_tokens
        self.messages = [] if system is None else [{"role": "system", "content": system}]
        family = model.arch.family.name  # the row of the architecture table says
        self.settings = Sampling.for_model(model, **sampling_preset(thinking, family, **sampling))
        self.stop_ids = eos_ids_for(model)
        self.device = next(model.parameters()).device  # the logits, and so the sampling, are there
        self.generator = seeded_generator(seed, self.device)  # None: torch's global generator
        self.cache, self.cached = model.new_cache(batch_size=1), []
        self.turns: list[dict] = []

    def prompt_ids(self) -> list[int]:
        """The prompt for the next reply. In thinking mode the think block is opened here, so
        the reply is sure to start inside it."""
        ids = encode_messages(
            self.tokenizer, self.messages, enable_thinking=self.thinking, add_generation_prompt=True
        )
        return ids + self.tokenizer.encode("<think>\n") if self.thinking else ids

    @torch.inference_mode()
    def forward(self, ids: list[int]) -> torch.Tensor:
        """Run `ids` after the cached tokens; logits [V] of the last one."""
        x = torch.tensor([ids], device=self.device)
        logits = self.model(x, cache=self.cache, last_only=True)[0, -1].float()
        self.cached += ids
        return logits

    def prefill(self, ids: list[int]) -> tuple[torch.Tensor, int]:
        """Logits after `ids`, reusing the cached prefix; returns (logits, tokens reused)."""
        try:
            logits, reused = prefill(self.model, self.cache, self.cached, ids)
        except ValueError:  # a recurrent layer (Qwen3.5) cannot go back: start a new cache
            self.cache = self.model.new_cache(batch_size=1)
            logits, reused = prefill(self.model, self.cache, [], ids)
        self.cached = list(ids)
        return logits, reused

    def send(self, text: str) -> Iterator[tuple[str, str]]:
        """Add a user turn and stream the reply as ("thinking" | "answer", text) events.

        A turn is all or nothing: if it fails (a prompt too long for the context) or the
        stream is abandoned, the history is as before it and the cache is cut back to what it
        held before (where a recurrent layer cannot go back, it holds a consistent longer state)."""
        check_text(text, "send: text")
        before, cached_before = self.messages, list(self.cached)
        self.messages = before + [{"role": "user", "content": text}]
        done = False
        try:
            yield from self._reply()
            done = True
        finally:
            if not done:
                self.messages = before
                self.rewind(cached_before)

    def rewind(self, cached: list[int]) -> None:
        """Cut the cache back to the longest prefix it shares with the tokens `cached`."""
        keep = common_prefix_length(self.cached, cached)
        try:
            self.cache.truncate(keep)
        except ValueError:  # a recurrent state cannot go back; it still matches self.cached
            return
        self.cached = self.cached[:keep]

    def _reply(self) -> Iterator[tuple[str, str]]:
        """The reply to the conversation so far; the assistant turn is added at its end."""
        ids, start = self.prompt_ids(), time.perf_counter()
        limit = self.model.config.max_position_embeddings
        if len(ids) > limit:  # refused before the cache is touched
            raise ValueError(
                f"the conversation is {len(ids)} tokens, more than this model's context of "
                f"{limit} positions (max_position_embeddings): send a shorter message or start "
                f"a new session"
            )
        seen = torch.zeros(self.model.config.vocab_size, dtype=torch.bool, device=self.device)
        in_context = seen.clone()  # the prompt's and the reply's tokens: the repetition penalty
        stats = dict(prompt=len(ids), reused=0, generated=0, thinking=0)
        first, inside = True, self.thinking

        def step(feed: list[int]) -> int:
            nonlocal first
            if first:  # the prompt: reuse what the cache shares with it
                logits, stats["reused"] = self.prefill(feed)
                first = False
            else:
                logits = self.forward(feed)
            in_context[torch.tensor(feed, dtype=torch.long, device=self.device)] = True
            token = next_token(logits, seen, self.settings, self.generator, in_context)
            seen[token] = in_context[token] = True
            return token

        tok = self.tokenizer
        tokens = budgeted_tokens(
            step, ids, budget=self.budget if self.thinking else None,
            forced_ids=tok.encode(BUDGET_STOP), think_id=tok.think_id,
            end_think_id=tok.end_think_id, stop_ids=self.stop_ids,
            max_new_tokens=self.max_new_tokens, thinking=self.thinking,
        )  # fmt: skip
        reply, router = [], ThinkingStream(self.thinking)

        def content():
            nonlocal inside
            for t in tokens:
                stats["generated"] += 1
                if t in (tok.think_id, tok.end_think_id):
                    inside = t == tok.think_id
                elif inside:
                    stats["thinking"] += 1  # the forced instruction included
                if t not in self.stop_ids:
                    reply.append(t)
                    yield t

        for piece in stream_text(tok, content()):
            yield from router.feed(piece)
        yield from router.close()
        self.messages = self.messages + [reply_message(tok.decode(reply), self.thinking)]
        stats["computed"] = stats["prompt"] - stats["reused"]
        stats["seconds"] = time.perf_counter() - start
        self.turns.append(stats)
