"""The Qwen tokenizer, offline: byte-level BPE from `tokenizer.json` and the official chat template.

Text becomes ids in three steps, all described by `tokenizer.json`:

1. NFC normalisation (so "e" + combining accent and the single character "é" tokenise alike),
2. a regex splits the text into pieces (words with their leading space, single digits, runs of
   punctuation, runs of whitespace),
3. each piece, as UTF-8 bytes, is merged by BPE into tokens.

Control tokens such as `<|im_start|>` are matched in the text first and become one id each.
The Hugging Face `tokenizers` library does the work; this module adds names for the ids the
course needs and renders the chat template exactly as `transformers` does.

The vendored files (`assets/tokenizers/qwen3/`) are those of Qwen/Qwen3-0.6B. Qwen2.5 uses the
same BPE and the same ids up to 151664, but its files lack the four tokens `<tool_response>`,
`</tool_response>`, `<think>`, `</think>` (151665-151668), and its chat template differs (a
default system prompt, no thinking). For exact Qwen2.5 chat prompts, load its own files.
"""

from __future__ import annotations

import json
import re
import warnings
from datetime import datetime
from pathlib import Path

import tokenizers

from .config import ASSETS

VENDORED_QWEN3 = ASSETS / "tokenizers" / "qwen3"

# Model names whose tokenizer the vendored files reproduce (Qwen3.5 has a different, larger vocab).
_SAME_BPE_AS_VENDORED = re.compile(r"^(Qwen/)?Qwen(2|2\.5|3)-", re.IGNORECASE)


class Tokenizer:
    """A Qwen tokenizer: text <-> ids, named control tokens, and the chat template.

    `eos_token_id` is `<|im_end|>` (151645) for Qwen3: the end of a chat turn, which is where a
    chat model stops, and the `eos_token` of the official tokenizer_config.json. The checkpoint's
    generation config stops on both `<|im_end|>` and `<|endoftext|>` (151643); that pair is
    `eos_token_ids`, the set a generation loop should stop on.
    """

    def __init__(self, tokenizer_json: str | Path, chat_template: str | None = None, config=None):
        self.path = Path(tokenizer_json)
        self._tok = tokenizers.Tokenizer.from_file(str(self.path))
        self.chat_template = chat_template
        self.config = dict(config or {})

        # Every added token is a control token: <|im_start|> and friends are marked "special"
        # (dropped by decode(..., skip_special_tokens=True)); <think>, <tool_call>, ... are not,
        # so they survive that decode and reasoning and tool calls can still be parsed.
        added = self._tok.get_added_tokens_decoder()
        self.special_tokens: dict[str, int] = {t.content: i for i, t in sorted(added.items())}

        self.endoftext_id = self._require("<|endoftext|>")
        self.im_start_id = self._require("<|im_start|>")
        self.im_end_id = self._require("<|im_end|>")
        # Qwen2.5 has no thinking tokens: None there.
        self.think_id = self.token_to_id("<think>")
        self.end_think_id = self.token_to_id("</think>")

        eos = _token_text(self.config.get("eos_token")) or "<|im_end|>"
        self.eos_token_id = self._require(eos)
        stops = [self.eos_token_id, self.im_end_id, self.endoftext_id]
        self.eos_token_ids = tuple(dict.fromkeys(stops))  # without duplicates, in order
        self.pad_token_id = self.token_to_id(_token_text(self.config.get("pad_token")) or "")

    def _require(self, token: str) -> int:
        i = self.token_to_id(token)
        if i is None:
            raise ValueError(f"{self.path} has no token {token!r}: is this a Qwen tokenizer?")
        return i

    @property
    def vocab_size(self) -> int:
        """Number of ids, control tokens included (151,669 for Qwen3). The model's embedding has
        more rows (151,936): the extra rows are padding that no token uses."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        """Ids of `text`. Control tokens written in the text (`<|im_start|>`) become their ids,
        as in transformers; no BOS/EOS is added (Qwen uses none)."""
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        """Text of `ids`. Ids that end inside a multi-byte character decode to U+FFFD."""
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        """Id of one token string (byte-level form: a leading space is written 'Ġ'), else None."""
        return self._tok.token_to_id(token)

    def id_to_token(self, i: int) -> str | None:
        return self._tok.id_to_token(int(i))

    def __len__(self) -> int:
        return self.vocab_size

    def __repr__(self) -> str:
        return f"Tokenizer({str(self.path)!r}, vocab_size={self.vocab_size})"

    def apply_chat_template(
        self,
        messages: list[dict],
        add_generation_prompt: bool = False,
        enable_thinking: bool | None = True,
        tools: list[dict] | None = None,
        **kwargs,
    ) -> str:
        """Render a conversation into the prompt text the model was trained on.

        `messages` are dicts with "role" ("system", "user", "assistant", "tool") and "content";
        assistant turns may carry "reasoning_content" and "tool_calls". With
        `add_generation_prompt` the text ends where the assistant's answer begins; with
        `enable_thinking=False` the Qwen3 template also writes an empty think block there
        (`None` leaves the variable undefined, as transformers does when it is not passed).
        The result is byte-identical to transformers' `apply_chat_template(..., tokenize=False)`.
        Extra keyword arguments are passed to the template as variables.
        """
        if self.chat_template is None:
            raise ValueError(
                f"No chat template next to {self.path}: expected tokenizer_config.json with a "
                "'chat_template' entry, or chat_template.jinja."
            )
        if not messages:
            raise ValueError("Cannot render an empty conversation: pass at least one message.")
        # Like transformers: the template also sees the special tokens by name (eos_token, ...).
        variables = {k: _token_text(v) for k, v in self.config.items() if k.endswith("_token")}
        variables = {k: v for k, v in variables.items() if v is not None}
        variables.update(kwargs)
        if enable_thinking is not None:
            variables["enable_thinking"] = enable_thinking
        return _compile(self.chat_template).render(
            messages=[_prepare_message(m) for m in messages],
            tools=_plain(tools),
            documents=None,
            add_generation_prompt=add_generation_prompt,
            **_plain(variables),
        )


def _prepare_message(message: dict) -> dict:
    """A plain copy of one message, normalised as transformers does before rendering."""
    if not isinstance(message, dict):
        raise TypeError(f"A chat message must be a dict with 'role' and 'content', got {message!r}")
    # Keys set to None (as OpenAI-style APIs return) are treated as absent.
    message = {k: _plain(v) for k, v in message.items() if v is not None}
    # Older names for the reasoning are accepted and copied to the one templates read.
    for key in ("reasoning_content", "thinking", "reasoning"):
        if key in message:
            reasoning = message[key]
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
            break
    return message


def _plain(value):
    """A deep copy made of plain JSON types, so the template never touches the caller's objects."""
    if isinstance(value, dict):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    return value


def _token_text(value) -> str | None:
    # tokenizer_config.json writes a token either as a string or as {"content": ...}.
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


_TEMPLATES: dict[str, object] = {}


def _compile(source: str):
    """Compile a chat template in a jinja2 sandbox set up as transformers sets it up."""
    if source not in _TEMPLATES:
        import jinja2
        import jinja2.ext
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise jinja2.exceptions.TemplateError(message)

        def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
            # Jinja's own tojson escapes HTML characters and non-ASCII; templates expect neither.
            options = dict(indent=indent, separators=separators, sort_keys=sort_keys)
            return json.dumps(x, ensure_ascii=ensure_ascii, **options)

        # trim_blocks/lstrip_blocks: a line holding only a {% tag %} leaves no blank line behind.
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
        )
        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        _TEMPLATES[source] = env.from_string(source)
    return _TEMPLATES[source]


def _read_chat_template(folder: Path) -> str | None:
    # Newer checkpoints keep the template in its own file; older ones inside tokenizer_config.json.
    jinja_file = folder / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = _read_config(folder).get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
        named = {t["name"]: t["template"] for t in template}
        template = named.get("default")
    return template


def _read_config(folder: Path) -> dict:
    path = folder / "tokenizer_config.json"
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def _from_folder(folder: Path) -> Tokenizer:
    return Tokenizer(folder / "tokenizer.json", _read_chat_template(folder), _read_config(folder))


def load_tokenizer(name_or_path: str | Path = "Qwen/Qwen3-0.6B") -> Tokenizer:
    """Load a Qwen tokenizer from a folder or a model name, without the network.

    - A folder (or a tokenizer.json file): its tokenizer.json, plus the chat template from
      tokenizer_config.json / chat_template.jinja beside it.
    - A model name such as "Qwen/Qwen3-0.6B": its downloaded files if `qwen_mini.hub.find_local`
      finds them ($QWEN_MINI_WEIGHTS, the Hugging Face cache); otherwise the vendored Qwen3
      files, which hold the same BPE for Qwen3 and Qwen2.5 (see the module docstring).
    """
    path = Path(name_or_path).expanduser()
    if path.is_file() and path.name == "tokenizer.json":
        path = path.parent
    if path.is_dir():
        if not (path / "tokenizer.json").is_file():
            raise FileNotFoundError(
                f"The folder {path} has no tokenizer.json. Copy the tokenizer files of the "
                "checkpoint there, or pass a model name such as 'Qwen/Qwen3-0.6B'."
            )
        return _from_folder(path)

    name = str(name_or_path)
    try:
        from .hub import find_local
    except ModuleNotFoundError as err:  # tolerate a checkout without the hub module, nothing else
        if err.name != f"{__package__}.hub":
            raise
        find_local = None
    if find_local is not None:
        local = find_local(name)
        if local is not None and (Path(local) / "tokenizer.json").is_file():
            return _from_folder(Path(local))

    if not _SAME_BPE_AS_VENDORED.match(name):
        raise ValueError(
            f"{name!r} is neither a folder nor a model whose tokenizer ships with qwen_mini. "
            "Pass a folder holding tokenizer.json, or a Qwen3 / Qwen2.5 name such as "
            "'Qwen/Qwen3-0.6B'."
        )
    if not (VENDORED_QWEN3 / "tokenizer.json").is_file():
        raise FileNotFoundError(
            f"The vendored tokenizer files are missing from {VENDORED_QWEN3}. qwen_mini reads "
            "them from the repository: install it from a clone with `pip install -e .`."
        )
    if not name.split("/")[-1].lower().startswith("qwen3-"):
        warnings.warn(
            f"Using the vendored Qwen3 tokenizer for {name}: same BPE and ids, but Qwen3's chat "
            "template. For that model's own chat format, point load_tokenizer at its files.",
            stacklevel=2,
        )
    return _from_folder(VENDORED_QWEN3)
