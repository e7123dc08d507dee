"""Typical wrong answers to the chapter 4 exercises: each must fail, with a message that names
the idea it gets wrong (public checks where the notebook warns about the mistake)."""

import pytest

from qwen_mini import chat
from qwen_mini.course.checking import run_checks


def turn_no_newline(role, content):
    return "<|im_start|>" + role + content + "<|im_end|>\n"


def turn_no_final_newline(role, content):
    return "<|im_start|>" + role + "\n" + content + "<|im_end|>"


def gen_not_false(enable_thinking=None):  # `not enable_thinking`: None pre-fills too
    return chat.generation_prompt(False if not enable_thinking else True)


def gen_opens_think(enable_thinking=None):  # Qwen3.5's behaviour
    if enable_thinking is False:
        return "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    return "<|im_start|>assistant\n<think>\n"


def gen_compact(enable_thinking=None):
    if enable_thinking is False:
        return "<|im_start|>assistant\n<think></think>"
    return "<|im_start|>assistant\n"


def lqi_first(messages):
    return next(i for i, m in enumerate(messages) if m["role"] == "user")


def lqi_counts_wrapped(messages):
    users = [i for i, m in enumerate(messages) if m["role"] == "user"]
    return users[-1] if users else len(messages) - 1


def lqi_startswith_only(messages):
    for i in range(len(messages) - 1, -1, -1):
        m = messages[i]
        if m["role"] == "user" and not m["content"].startswith("<tool_response>"):
            return i
    return len(messages) - 1


def lqi_minus_one(messages):
    for i in range(len(messages) - 1, -1, -1):
        if messages[i]["role"] == "user" and not chat.is_tool_response(messages[i]["content"]):
            return i
    return -1


def split_truthy(message):
    if message.get("reasoning_content"):
        return message["reasoning_content"], message["content"]
    return chat.split_reasoning({"role": "assistant", "content": message["content"]})


def split_no_strip(message):
    if message.get("reasoning_content") is not None:
        return message["reasoning_content"], message["content"]
    c = message["content"]
    if "</think>" not in c:
        return "", c
    return c.split("</think>")[0].split("<think>")[-1], c.split("</think>")[-1]


def split_ignores_field(message):
    return chat.split_reasoning({"role": "assistant", "content": message["content"]})


def split_last_close(message):
    if message.get("reasoning_content") is not None:
        return message["reasoning_content"], message["content"]
    c = message["content"]
    if "</think>" not in c:
        return "", c
    before, _, after = c.rpartition("</think>")
    return before.rstrip("\n").split("<think>")[-1].lstrip("\n"), after.lstrip("\n")


def _render_variant(keep_all_reasoning=False, no_empty_block=False, separate_tools=False,
                    system_twice=False, escape_unicode=False, no_quote=False,
                    always_newline=False):  # fmt: skip
    """render_prompt with one rule broken."""

    def render(messages, *, tools=None, add_generation_prompt=True, enable_thinking=None,
               quote=chat._same):  # fmt: skip
        q = chat._same if no_quote else quote
        out = chat.render_header(messages, tools, q)
        last, n = chat.last_query_index(messages), len(messages)
        if keep_all_reasoning:
            last = -1
        for i, m in enumerate(messages):
            role = m["role"]
            if role == "user" or (role == "system" and (i > 0 or system_twice)):
                out += chat.render_turn(role, q(m["content"]))
            elif role == "assistant":
                r, c = chat.split_reasoning(m)
                last_rule = i == n - 1 and not no_empty_block
                if i > last and (last_rule or r):
                    out += "<|im_start|>assistant\n<think>\n" + q(r.strip("\n"))
                    out += "\n</think>\n\n" + q(c.lstrip("\n"))
                else:
                    out += "<|im_start|>assistant\n" + q(c)
                for j, call in enumerate(m.get("tool_calls") or []):
                    out += "\n" if (j > 0 or c or always_newline) else ""
                    text = chat.render_tool_call(call, q)
                    if escape_unicode:
                        text = text.encode("ascii", "backslashreplace").decode().replace(
                            "\\xfc", "\\u00fc")  # fmt: skip
                    out += text
                out += "<|im_end|>\n"
            elif role == "tool":
                first = i == 0 or messages[i - 1]["role"] != "tool" or separate_tools
                out += "<|im_start|>user" if first else ""
                out += "\n<tool_response>\n" + q(m["content"]) + "\n</tool_response>"
                end = i == n - 1 or messages[i + 1]["role"] != "tool" or separate_tools
                out += "<|im_end|>\n" if end else ""
        if add_generation_prompt:
            out += chat.generation_prompt(enable_thinking)
        return out

    return render


def parse_rfind(text, *, thinking=False):
    if not thinking:
        if not text.startswith("<think>"):
            return "", text
        text = text[len("<think>") :]
    reasoning, closed, answer = text.rpartition("</think>")
    if not closed:
        return answer.strip("\n"), ""
    return reasoning.strip("\n"), answer.lstrip("\n")


def parse_unterminated_as_answer(text, *, thinking=False):
    if "</think>" not in text:
        return "", text
    return chat.parse_reply(text, thinking=thinking)


def parse_anywhere(text, *, thinking=False):
    if "<think>" in text and not thinking:
        text = text.split("<think>", 1)[1]
        thinking = True
    return chat.parse_reply(text, thinking=thinking)


class StreamAtClose:
    """Buffers everything and routes it only in close()."""

    def __init__(self, thinking=False):
        self.thinking, self.text = thinking, ""

    def feed(self, piece):
        self.text += piece
        return []

    def close(self):
        r, a = chat.parse_reply(self.text, thinking=self.thinking)
        return [e for e in (("thinking", r), ("answer", a)) if e[1]]


class StreamNoHoldBack:
    """Routes each piece at once, looking for whole tags only inside the piece."""

    def __init__(self, thinking=False):
        self.state = "thinking" if thinking else "start"

    def feed(self, piece):
        if self.state == "start":
            self.state = "thinking" if piece.startswith("<think>") else "answer"
            piece = piece.removeprefix("<think>")
        if self.state == "thinking" and "</think>" in piece:
            r, _, a = piece.partition("</think>")
            self.state = "answer"
            return [e for e in (("thinking", r.strip("\n")), ("answer", a.lstrip("\n"))) if e[1]]
        return [(self.state, piece)] if piece else []

    def close(self):
        return []


def _budget_variant(kind):
    def budgeted(step, prompt_ids, *, budget, forced_ids, think_id, end_think_id, stop_ids,
                 max_new_tokens, thinking=False):  # fmt: skip
        feed, inside, spent, forced, n = list(prompt_ids), thinking, 0, False, 0
        while n < max_new_tokens:
            room = max_new_tokens - n
            limit = budget + 1 if kind == "off by one" else budget
            early = room == len(forced_ids) and kind not in ("cut", "not counted")
            if inside and budget is not None and (spent >= limit or early) and not forced:
                if room < len(forced_ids) and kind == "past the budget":
                    forced = True  # keeps thinking instead of ending the reply
                    continue
                if room < len(forced_ids) and kind not in ("cut", "not counted"):
                    return
                insert = forced_ids[:room] if kind == "cut" else forced_ids
                if kind != "not yielded":
                    yield from insert
                n += 0 if kind == "not counted" else len(insert)
                feed = feed if kind == "not fed" else feed + insert
                inside, forced = False, True
                continue
            token = step(feed)
            feed, n = [token], n + 1
            yield token
            if token in stop_ids:
                return
            if token == think_id and not inside:
                inside = True
                spent += 1 if kind == "counts the tag" else 0
            elif token == end_think_id:
                inside = False
            elif inside:
                spent += 1

    return budgeted


def encode_each_piece(tokenizer, pieces):
    ids = []
    for text, from_conversation in pieces:
        ids += chat.encode_plain(tokenizer, text) if from_conversation else tokenizer.encode(text)
    return ids


def encode_default(tokenizer, pieces):
    return tokenizer.encode("".join(p for p, _ in pieces))


WRONG = [
    ("ch04.render_turn", turn_no_newline, "newline separates the role"),
    ("ch04.render_turn", turn_no_final_newline, "AND a newline"),
    ("ch04.generation_prompt", gen_not_false, "not passed"),
    ("ch04.generation_prompt", gen_opens_think, "Qwen3.5"),
    ("ch04.generation_prompt", gen_compact, "written exactly"),
    ("ch04.last_query_index", lqi_first, "LAST real query"),
    ("ch04.last_query_index", lqi_counts_wrapped, "not a query"),
    ("ch04.last_query_index", lqi_startswith_only, "AND ends"),
    ("ch04.last_query_index", lqi_minus_one, "len(messages) - 1"),
    ("ch04.split_reasoning", split_truthy, "not truthiness"),
    ("ch04.split_reasoning", split_no_strip, "newlines"),
    ("ch04.split_reasoning", split_ignores_field, "reasoning_content field wins"),
    ("ch04.split_reasoning", split_last_close, "FIRST </think>"),
    ("ch04.render_prompt", _render_variant(keep_all_reasoning=True), "history rule"),
    ("ch04.render_prompt", _render_variant(no_empty_block=True), "empty one"),
    ("ch04.render_prompt", _render_variant(separate_tools=True), "share ONE user turn"),
    ("ch04.render_prompt", _render_variant(system_twice=True), "written once"),
    ("ch04.render_prompt", _render_variant(escape_unicode=True), "non-ASCII kept"),
    ("ch04.render_prompt", _render_variant(no_quote=True), "quote"),
    ("ch04.render_prompt", _render_variant(always_newline=True), "except the first one"),
    ("ch04.parse_reply", parse_rfind, "FIRST </think>"),
    ("ch04.parse_reply", parse_unterminated_as_answer, "unterminated"),
    ("ch04.parse_reply", parse_anywhere, "very start"),
    ("ch04.ThinkingStream", StreamAtClose, "as it arrives"),
    ("ch04.ThinkingStream", StreamNoHoldBack, "tags cut across pieces"),
    ("ch04.budgeted_tokens", _budget_variant("off by one"), "exactly 3"),
    ("ch04.budgeted_tokens", _budget_variant("not fed"), "fed to the model"),
    ("ch04.budgeted_tokens", _budget_variant("not yielded"), "yield them"),
    ("ch04.budgeted_tokens", _budget_variant("counts the tag"), "<think> tag itself"),
    ("ch04.budgeted_tokens", _budget_variant("not counted"), "count towards max_new_tokens"),
    ("ch04.budgeted_tokens", _budget_variant("cut"), "never cut"),
    ("ch04.budgeted_tokens", _budget_variant("past the budget"), "not think past the budget"),
    ("ch04.encode_pieces", encode_each_piece, "ONE run"),
    ("ch04.encode_pieces", encode_default, "never become a control token"),
]


def test_corpus_size():
    assert len(WRONG) >= 15
    assert {w[0] for w in WRONG} == {
        f"ch04.{n}"
        for n in (
            "render_turn generation_prompt last_query_index split_reasoning render_prompt "
            "parse_reply ThinkingStream budgeted_tokens encode_pieces"
        ).split()
    }


@pytest.mark.parametrize("exercise, wrong, idea", WRONG, ids=[w[1].__name__ for w in WRONG])
def test_wrong_answer_fails_with_the_idea(exercise, wrong, idea):
    public = run_checks(exercise, wrong)
    assert public.status == "failed", public.line()
    assert idea in public.message, public.message
    assert run_checks(exercise, wrong, hidden=True).status == "failed"
