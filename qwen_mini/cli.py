"""The `qwen-mini` command: generate text, chat, fetch the real weights, check the installation.

    qwen-mini generate Qwen/Qwen3-0.6B "The capital of France is" --max-new-tokens 20
    qwen-mini generate Qwen/Qwen3-0.6B "Why is the sky blue?" --chat --no-thinking
    qwen-mini chat Qwen/Qwen3-0.6B --think --budget 256 --device cuda
    qwen-mini download Qwen/Qwen3-0.6B   (the real weights, once, on a machine that is online)
    qwen-mini doctor

The course's commands (reset, progress, `--mine`, grade, export) are those of
`qwen-mini-course` (qwen_mini/course/cli.py, installed with `pip install "qwen-mini[course]"`),
which has these too; this module never imports the course.

Generated text goes to stdout; notices (stand-in model, sampling settings) go to stderr, so
`qwen-mini generate ... > out.txt` keeps only the text.
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import shlex
import sys
import warnings
from importlib import metadata

from .families import QWEN3, family_of

DOCTOR_TEXT = "Hello, 世界! Grüße 👋🏽 — ∑x² = 1\n\tcode:  if x:<|im_end|>"
# Their tokenizers ship with qwen_mini, so they must load offline.
ALWAYS_OFFLINE = ("Qwen/Qwen3-0.6B", "Qwen/Qwen3.5-0.8B")
DESCRIPTION = (
    "Run Qwen checkpoints (Qwen3, Qwen3.5, Qwen2.5 and the Qwen3-MoE format) with qwen_mini, the "
    "package the qwen-mini course builds: generate text, chat, fetch the real weights, check the "
    "installation. Without real weights on disk, a known model name runs on its stand-in (a "
    "tiny model of the same architecture)."
)
# What the course's command (qwen-mini-course) adds: named here only to point there.
COURSE_COMMANDS = ("reset", "progress", "grade", "export")  # and generate's and chat's --mine
EPILOG = (
    "The course's commands (reset, progress, generate and chat --mine on your own pieces, "
    "grade, export) are those of qwen-mini-course, which has these too; it comes with "
    'pip install "qwen-mini[course]".'
)
# The stand-in is tiny: it writes simple English (Qwen2.5's, random, gibberish) and may think
# on and on. Short replies show the mechanics in a moment; the budget leaves room for an answer.
STANDIN_MAX_NEW_TOKENS, STANDIN_BUDGET = 48, 8
DEVICE_HELP = "where the model runs: cpu (default), cuda, cuda:1, mps"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="qwen-mini", description=DESCRIPTION, epilog=EPILOG)
    sub = parser.add_subparsers(
        dest="command", required=True, metavar="COMMAND", help="what to do (COMMAND --help)"
    )
    add_commands(sub)
    return parser


def add_commands(sub) -> dict[str, argparse.ArgumentParser]:
    """Add the model's commands to `sub` (here and in qwen-mini-course); return their parsers
    by name, for the course's command to add its options to."""
    g = sub.add_parser(
        "generate",
        help="continue a prompt, streaming the text",
        description="Continue PROMPT with MODEL and stream the new text to stdout. "
        "Sampling options left out come from the checkpoint's "
        "generation_config.json; without one, decoding is greedy.",
    )
    g.add_argument(
        "model", metavar="MODEL", help="a model name (Qwen/Qwen3-0.6B) or a checkpoint folder"
    )
    g.add_argument("prompt", metavar="PROMPT", help="the prompt text; '-' reads it from stdin")
    g.add_argument(
        "--max-new-tokens",
        type=int,
        metavar="N",
        help=f"at most N new tokens (default 256; {STANDIN_MAX_NEW_TOKENS} on the stand-in)",
    )
    g.add_argument("--temperature", type=float, help="0 means greedy")
    g.add_argument("--top-k", type=int, help="sample from the K most likely tokens only")
    g.add_argument(
        "--top-p", type=float, help="sample from the likeliest tokens whose probabilities sum to P"
    )
    g.add_argument(
        "--min-p", type=float, help="drop tokens less likely than P times the most likely one"
    )
    g.add_argument(
        "--presence-penalty",
        type=float,
        help="subtract this from the logits of tokens already generated (against repetition)",
    )
    g.add_argument("--seed", type=int, help="makes sampling reproducible")
    g.add_argument("--device", default="cpu", help=DEVICE_HELP)
    g.add_argument(
        "--dtype",
        choices=["float32", "bfloat16"],
        help="weights dtype (default: as stored in the checkpoint)",
    )
    g.add_argument(
        "--chat", action="store_true", help="wrap PROMPT as one user message with the chat template"
    )
    g.add_argument(
        "--no-thinking",
        action="store_true",
        help="with --chat: enable_thinking=False (Qwen3 answers without <think>)",
    )
    g.add_argument(
        "--download",
        action="store_true",
        help="download the weights from the Hugging Face hub if not found locally",
    )
    add_fast_options(g)

    d = sub.add_parser(
        "download",
        help="fetch a model's real weights from the Hugging Face hub",
        description="Download MODEL (config, safetensors weights and tokenizer files; never "
        "pickles) into the Hugging Face cache, where load_model and the notebooks find it. "
        "Needs internet and huggingface_hub (pip install -e '.[download]').",
    )
    d.add_argument("model", metavar="MODEL", help="a model name, e.g. Qwen/Qwen3-0.6B")
    c = add_chat_parser(sub)
    doctor = sub.add_parser("doctor", help="check the installation: versions, models, tokenizer")
    doctor.add_argument(
        "--scan",
        metavar="MODEL",
        help="instead, read every weight of MODEL (a name or a folder) and report the tensors "
        "holding NaN or infinite values",
    )
    return {"generate": g, "chat": c, "download": d, "doctor": doctor}


def main(argv: list[str] | None = None) -> int:
    return guarded(run, argv, "qwen-mini")


def guarded(run, argv: list[str] | None, prog: str) -> int:
    """`run(argv)` with the errors a learner can meet as one line each, never a traceback (the
    course's command runs through it too)."""
    _tolerate_any_locale()
    try:
        return run(sys.argv[1:] if argv is None else list(argv))
    except KeyboardInterrupt:  # Ctrl-C, also while the libraries are still being imported
        print(file=sys.stderr)
        return 130
    except BrokenPipeError:  # `qwen-mini generate ... | head`: the reader left, nothing is wrong
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except Exception as e:  # a learner gets the message, not a traceback
        text = str(e)
        if not isinstance(e, (ValueError, OSError)) or not text.strip():
            # the kind where it says something, or is all there is ("MemoryError", not ": ")
            text = f"{type(e).__name__}: {text}" if text.strip() else type(e).__name__
        print(f"{prog}: error: {text}", file=sys.stderr)
        return 1


def run(argv: list[str], parser: argparse.ArgumentParser | None = None, commands=None) -> int:
    """Parse `argv` and run its command: the model's, or with the course's `parser` and
    `commands` (name -> function of the parsed arguments), qwen-mini-course's."""
    if parser is None:
        parser, commands = build_parser(), COMMANDS
        named = [a for a in argv[:1] if a in COURSE_COMMANDS] + [a for a in argv if a == "--mine"]
        if named:  # a learner used to the course's command: say which one runs it
            print(f"qwen-mini: error: {named[0]} belongs to the course's command: "
                  f"qwen-mini-course {shlex.join(argv)} (it comes with "
                  f"pip install \"qwen-mini[course]\")", file=sys.stderr)  # fmt: skip
            return 2
    prog = parser.prog
    if not argv:  # a bare command: the command list, and the status of a usage error
        parser.print_help()
        return 2
    for arg in argv:
        check_argument(arg)
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help or a usage error: argparse has printed the message
        return int(e.code or 0)
    if args.command == "generate" and args.no_thinking and not args.chat:
        print(
            f"{prog}: error: --no-thinking only applies to chat prompts; add --chat.",
            file=sys.stderr,
        )
        return 2
    if (getattr(args, "max_new_tokens", None) or 0) < 0:  # None: the default, filled in later
        print(f"{prog}: error: --max-new-tokens must be >= 0.", file=sys.stderr)
        return 2
    import_torch_whole()
    return commands[args.command](args)


def import_torch_whole() -> None:
    """Import torch with Ctrl-C held until the import is done: an interrupt inside its native
    start-up aborts the process (SIGABRT, no exit code of ours); after it, it is a plain
    KeyboardInterrupt, which main turns into exit code 130."""
    import signal

    pressed = []
    try:
        previous = signal.signal(signal.SIGINT, lambda *_: pressed.append(True))
    except ValueError:  # not the main thread: signals cannot be held here
        previous = None
    try:
        import torch  # noqa: F401
    finally:
        if previous is not None:
            signal.signal(signal.SIGINT, previous)
    if pressed:
        raise KeyboardInterrupt


def _tolerate_any_locale() -> None:
    """Under a non-UTF-8 locale (LANG=C on an old system, a Latin-1 terminal) printing a Chinese
    or emoji token would raise UnicodeEncodeError: what the terminal cannot show is replaced."""
    for stream in (sys.stdout, sys.stderr):
        if stream is not None and hasattr(stream, "reconfigure"):
            stream.reconfigure(errors="replace")


def check_argument(text: str) -> None:
    """Python keeps the bytes of an argument or a typed line that are not valid in the
    terminal's encoding as lone surrogates; say so instead of failing in the tokenizer."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError(
            f"{text.encode('utf-8', 'backslashreplace').decode()!r} is not valid text in this "
            f"terminal's encoding ({sys.getfilesystemencoding()}); pass UTF-8 text, or give the "
            f"prompt on stdin with '-'."
        ) from None


def read_stdin() -> str:
    """All of stdin as text, for PROMPT '-': a clear error if stdin is closed or not text."""
    if sys.stdin is None or sys.stdin.closed:
        raise ValueError("PROMPT is '-' but stdin is closed; pipe the prompt in or pass it.")
    data = sys.stdin.buffer.read() if hasattr(sys.stdin, "buffer") else sys.stdin.read()
    if isinstance(data, str):
        return data
    encoding = sys.stdin.encoding or "utf-8"
    try:
        return data.decode(encoding)
    except UnicodeDecodeError as e:
        raise ValueError(
            f"stdin is not valid {encoding} text (byte {e.start}: {data[e.start : e.start + 1]!r}"
            f"); convert the prompt file to UTF-8, e.g. iconv -t UTF-8."
        ) from None


# --- download ---------------------------------------------------------------------------------


def cmd_download(args) -> int:
    from .hub import resolve

    found = resolve(args.model, download=True)  # a folder already here is not fetched again
    how = "downloaded to" if found.source == "download" else "already on this machine:"
    print(f"{args.model}: {how} {found.path}")
    return 0


# --- the stand-in -----------------------------------------------------------------------------


def fill_defaults(args, model, max_new_tokens: int) -> None:
    """Fill in --max-new-tokens (and chat's --budget) where left out; on the stand-in, short
    ones, saying why on stderr after how to get the real weights."""
    unbudgeted = getattr(args, "think", False) and args.budget is None
    if model.is_standin:
        from .hub import standin_help

        print(standin_help(args.model), file=sys.stderr)
    if model.is_standin and (args.max_new_tokens is None or unbudgeted):
        budget = f" and thinking to a budget of {STANDIN_BUDGET}" if unbudgeted else ""
        print(
            f"qwen-mini: on the stand-in, replies default to {STANDIN_MAX_NEW_TOKENS} tokens"
            f"{budget}: a tiny model soon repeats itself and may think on and on "
            "(--max-new-tokens, --budget).",
            file=sys.stderr,
        )
        max_new_tokens = STANDIN_MAX_NEW_TOKENS
        if unbudgeted:
            args.budget = STANDIN_BUDGET
    if args.max_new_tokens is None:
        args.max_new_tokens = max_new_tokens


# --- chat -------------------------------------------------------------------------------------

# A line that starts with "/" and a word is a command of the chat, not a message.
CHAT_COMMAND = re.compile(r"/([A-Za-z]+)(?:\s|$)")
CHAT_HELP = """The chat's commands:
  /help          this list
  /reset         clear the conversation and start a new one (the model stays loaded)
  /quit, /exit   leave the chat (so do Ctrl-D and Ctrl-C)
Any other line is sent to the model; start it with // to send a line that begins with /."""


def add_fast_options(parser) -> None:
    """generate's and chat's --compile, --draft and --draft-tokens."""
    parser.add_argument(
        "--compile",
        nargs="?",
        const=True,
        default=False,
        choices=["max-autotune"],
        metavar="max-autotune",
        help="decode with a preallocated cache and a step compiled by torch.compile (the first "
        "run compiles: slow to start); the same tokens, except that in bfloat16 a token can "
        "differ where two logits tie within rounding. --compile max-autotune: also a tuned "
        "kernel per projection and a repacked copy of the weights: faster, such near-ties "
        "more often broken the other way",
    )
    parser.add_argument(
        "--draft",
        metavar="mtp|MODEL",
        help="speculative decoding: draft with the model's own MTP head (mtp) or a smaller "
        "model of the same tokenizer (a name or folder); greedy output is unchanged",
    )
    parser.add_argument(
        "--draft-tokens", type=int, default=3, metavar="K", help="drafts a round (default 3)"
    )


def load_draft(args, dtype=None):
    """--draft: "mtp", None, or the draft model it names, loaded as the model is."""
    if args.draft is None or args.draft == "mtp":
        return args.draft
    from .hub import load_model

    download = getattr(args, "download", False)
    return load_model(args.draft, dtype, download=download, device=args.device)


def add_chat_parser(sub) -> argparse.ArgumentParser:
    c = sub.add_parser(
        "chat",
        help="multi-turn chat in the terminal, thinking shown apart from the answer",
        description="Chat with MODEL. The history is kept as the Qwen3 template expects and the "
        "KV cache is reused across turns. In the chat, /help lists its commands (/reset "
        "clears the conversation); /quit, Ctrl-D or Ctrl-C ends it.",
    )
    c.add_argument("model", metavar="MODEL", help="a model name (Qwen/Qwen3-0.6B) or a folder")
    mode = c.add_mutually_exclusive_group()
    mode.add_argument("--think", dest="think", action="store_true", default=True,
                      help="thinking mode (default)")  # fmt: skip
    mode.add_argument("--no-think", dest="think", action="store_false", help="answer directly")
    c.add_argument(
        "--budget",
        type=int,
        metavar="N",
        help=f"at most N thinking tokens per reply (default: none; {STANDIN_BUDGET} on the "
        "stand-in)",
    )
    c.add_argument(
        "--max-new-tokens",
        type=int,
        metavar="N",
        help="at most N tokens per reply, the budget's closing instruction included (default "
        f"1024; {STANDIN_MAX_NEW_TOKENS} on the stand-in)",
    )
    c.add_argument("--system", help="a system prompt")
    c.add_argument("--temperature", type=float, help="default: the mode's preset; 0 = greedy")
    c.add_argument("--seed", type=int, help="makes sampling reproducible")
    c.add_argument("--device", default="cpu", help=DEVICE_HELP)
    add_fast_options(c)
    return c


def cmd_chat(args, arch=None) -> int:
    """`arch`: a row of the table to build the model from (the course's --mine), else the
    package's."""
    from .chat import ChatSession
    from .fast_chat import FastChatSession
    from .hub import load_model
    from .tokenizer import load_tokenizer

    if args.budget is not None and (args.budget < 0 or not args.think):
        raise ValueError("--budget N needs N >= 0 and thinking mode (not --no-think).")
    model = load_model(args.model, device=args.device, arch=arch)
    tokenizer = load_tokenizer(args.model)
    fill_defaults(args, model, max_new_tokens=1024)
    draft = load_draft(args)
    fast = dict(compile=args.compile, draft=draft, draft_tokens=args.draft_tokens)

    def new_session():
        options = dict(
            thinking=args.think, budget=args.budget, system=args.system,
            max_new_tokens=args.max_new_tokens, seed=args.seed, temperature=args.temperature,
        )  # fmt: skip
        if args.compile or draft is not None:
            return FastChatSession(model, tokenizer, **fast, **options)
        return ChatSession(model, tokenizer, **options)

    session = new_session()
    tty = sys.stdout.isatty()
    dim, bold, reset = ("\x1b[2m", "\x1b[1m", "\x1b[0m") if tty else ("", "", "")
    mode = "thinking" if args.think else "no thinking"
    budget = f", budget {args.budget} tokens" if args.budget is not None else ""
    print(f"qwen-mini chat: {args.model} ({mode}{budget}). /help lists the commands; /quit, "
          "Ctrl-D or Ctrl-C leaves.")  # fmt: skip
    if sys.stdin is None or sys.stdin.closed:
        raise ValueError("chat reads your messages from stdin, which is closed.")
    try:
        while True:
            try:
                text = input(f"{bold}you>{reset} ")
            except EOFError:
                print()
                return 0
            except UnicodeDecodeError:
                print(f"(that line is not valid {sys.stdin.encoding} text; type it again)")
                continue
            if not text.strip():
                continue
            try:
                check_argument(text)
            except ValueError as e:
                print(f"({e})")
                continue
            command = CHAT_COMMAND.match(text.strip())
            if command:  # a command for the chat, never sent to the model
                word = command.group(1).lower()
                if word in ("quit", "exit"):
                    return 0
                if word == "reset":
                    session = new_session()
                    kept = "; the system prompt is kept" if args.system is not None else ""
                    print(f"(conversation cleared: the next message starts a new one{kept})")
                    continue
                if word != "help":
                    print(f"(/{command.group(1)} is not a command)")
                print(CHAT_HELP)
                continue
            if text.lstrip().startswith("//"):  # "//x" sends "/x"
                text = text.lstrip()[1:]
            channel = None
            for kind, piece in session.send(text):
                if kind != channel:  # a label each time the stream changes channel
                    label = "[thinking] " if kind == "thinking" else "[answer] "
                    print(("\n" if channel else "") + (dim if kind == "thinking" else reset)
                          + label, end="")  # fmt: skip
                    channel = kind
                print(piece, end="", flush=True)
            t = session.turns[-1]
            rate = t["generated"] / t["seconds"] if t["seconds"] > 0 else float("inf")
            drafts = (f"; {t['accepted']} of {t['proposed']} drafts accepted"
                      if t.get("proposed") else "")  # fmt: skip
            print(f"{reset}\n{dim}({t['generated']} tokens, {t['thinking']} thinking; "
                  f"{rate:.1f} tokens/s; prompt {t['prompt']} tokens, {t['reused']} reused "
                  f"from the cache{drafts}){reset}")  # fmt: skip
    except KeyboardInterrupt:
        print(f"{reset}\n(bye)")
        return 0


# --- generate ---------------------------------------------------------------------------------


def cmd_generate(args, arch=None) -> int:
    """`arch`: as for cmd_chat."""
    from .generation import Sampling, generate
    from .hub import load_model
    from .tokenizer import load_tokenizer

    prompt = read_stdin() if args.prompt == "-" else args.prompt
    import torch

    dtype = getattr(torch, args.dtype) if args.dtype else None
    model = load_model(args.model, dtype, download=args.download, device=args.device, arch=arch)
    fill_defaults(args, model, max_new_tokens=256)
    tokenizer = load_tokenizer(args.model)
    if args.chat:
        prompt = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}],
            add_generation_prompt=True,
            enable_thinking=not args.no_thinking,
        )
    options = dict(
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        min_p=args.min_p,
        presence_penalty=args.presence_penalty,
    )
    sampling = Sampling.for_model(model, **options)
    print(f"sampling: {sampling.describe()}", file=sys.stderr)
    draft = load_draft(args, dtype)
    pieces = generate(
        model,
        tokenizer,
        prompt,
        max_new_tokens=args.max_new_tokens,
        sampling=sampling,
        seed=args.seed,
        stream=True,
        draft=draft,
        draft_tokens=args.draft_tokens,
        compile=args.compile,
    )
    for piece in pieces:
        sys.stdout.write(piece)
        sys.stdout.flush()  # show each piece as soon as it exists
    sys.stdout.write("\n")
    sys.stdout.flush()
    return 0


# --- doctor -----------------------------------------------------------------------------------


def cmd_doctor(args) -> int:
    if args.scan:
        return scan_weights(args.scan)
    ok = check_versions()
    ok &= check_models()
    ok &= check_tokenizers()
    print("\nOK: qwen_mini is ready." if ok else "\nFAIL: see the lines marked FAIL above.")
    return 0 if ok else 1


def scan_weights(name: str) -> int:
    from .checkpoint import scan_nonfinite
    from .locate import find_local

    folder = find_local(name)
    if folder is None:
        raise ValueError(f"{name}: no checkpoint folder found on this machine to scan.")
    print(f"scanning the weights in {folder} for NaN and infinite values")
    found = scan_nonfinite(folder)
    for path, tensor, bad, total in found:
        print(f"  FAIL {path.name}: {tensor}: {bad:,} of {total:,} values are NaN or infinite")
    if found:
        print(f"\nFAIL: {len(found)} tensors hold non-finite values: the files are corrupt; "
              f"download or convert them again.")  # fmt: skip
        return 1
    print("\nOK: every weight is finite.")
    return 0


def check_versions() -> bool:
    import torch

    print("versions")
    print(f"  python        {platform.python_version()}")
    ok = True
    for dist in ("torch", "safetensors", "tokenizers", "jinja2", "qwen-mini", "transformers"):
        try:
            version = metadata.version(dist)
        except metadata.PackageNotFoundError:
            optional = dist == "transformers"  # only the tests need it
            version = "not installed" + ("" if optional else "  FAIL")
            ok &= optional
        print(f"  {dist:<13} {version}")
    print(f"  {'accelerator':<13} {'cuda' if torch.cuda.is_available() else 'none (CPU)'}")
    return ok


def check_models() -> bool:
    from .hub import KNOWN_MODELS, describe

    print("models")
    ok = True
    for name in KNOWN_MODELS:
        try:
            print(f"  {describe(name)}")
        except Exception as e:  # one broken entry should not hide the others
            print(f"  {name}: FAIL {e}")
            ok = False
    return ok


def check_tokenizers() -> bool:
    from .locate import KNOWN_MODELS, find_local
    from .tokenizer import load_tokenizer

    print("tokenizers (encode -> decode round trip, control-token ids)")
    ok = True
    for name in dict.fromkeys([*KNOWN_MODELS, *ALWAYS_OFFLINE]):
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                tokenizer = load_tokenizer(name)
        except Exception as e:
            if name in ALWAYS_OFFLINE or find_local(name) is not None:
                print(f"  {name}: FAIL {e}")
                ok = False
            else:
                print(f"  {name}: skipped (no tokenizer files offline)")
            continue
        problems = tokenizer_problems(name, tokenizer)
        ok &= not problems
        print(f"  {name}: " + ("OK" if not problems else "FAIL " + "; ".join(problems)))
        for w in caught:  # e.g. a vendored stand-in for the model's own files
            print(f"    note: {w.message}")
        print(f"    from {tokenizer.path}")
        if tokenizer.chat_template is None:
            print("    note: no chat template (chat prompts need the checkpoint's own files)")
    return ok


def tokenizer_problems(name: str, tokenizer) -> list[str]:
    problems = []
    ids = tokenizer.encode(DOCTOR_TEXT)
    if tokenizer.decode(ids) != DOCTOR_TEXT:
        problems.append(f"decode(encode(text)) gives {tokenizer.decode(ids)!r}")
    family = family_of(name) or QWEN3  # the control-token ids of its family's tokenizer files
    for token, want in family.special_ids.items():
        got = tokenizer.special_tokens.get(token)
        if got != want:
            problems.append(f"{token} has id {got}, expected {want}")
    if ids[-1:] != [family.special_ids["<|im_end|>"]]:
        problems.append("<|im_end|> in the text did not become its single id")
    return problems


COMMANDS = {"generate": cmd_generate, "chat": cmd_chat, "download": cmd_download,
            "doctor": cmd_doctor}  # fmt: skip

if __name__ == "__main__":  # python -m qwen_mini.cli
    sys.exit(main())
