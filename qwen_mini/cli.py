"""The `qwen-mini` command: generate text, check the installation, grade notebooks.

    qwen-mini generate Qwen/Qwen3-0.6B "The capital of France is" --max-new-tokens 20
    qwen-mini generate Qwen/Qwen3-0.6B "Why is the sky blue?" --chat --no-thinking
    qwen-mini download Qwen/Qwen3-0.6B   (the real weights, once, on a machine that is online)
    qwen-mini doctor
    qwen-mini grade ...            (see `qwen-mini grade --help`)

Generated text goes to stdout; notices (stand-in model, sampling settings) go to stderr, so
`qwen-mini generate ... > out.txt` keeps only the text.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import warnings
from importlib import metadata

DOCTOR_TEXT = "Hello, 世界! Grüße 👋🏽 — ∑x² = 1\n\tcode:  if x:<|im_end|>"
# The control-token ids of each tokenizer family, as in the published tokenizer files.
# (Qwen2.5's own files have no <think>: only Qwen3.5's thinking ids are checked.)
SPECIAL_IDS = {
    "qwen3": {"<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645},
    "qwen3.5": {"<|endoftext|>": 248044, "<|im_start|>": 248045, "<|im_end|>": 248046,
                "<think>": 248068, "</think>": 248069},
}  # fmt: skip
# Their tokenizers ship with qwen_mini, so they must load offline.
ALWAYS_OFFLINE = ("Qwen/Qwen3-0.6B", "Qwen/Qwen3.5-0.8B")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="qwen-mini", description="Run Qwen3 / Qwen2.5 checkpoints with qwen_mini."
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

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
    g.add_argument("--max-new-tokens", type=int, default=256, metavar="N")
    g.add_argument("--temperature", type=float, help="0 means greedy")
    g.add_argument("--top-k", type=int)
    g.add_argument("--top-p", type=float)
    g.add_argument("--min-p", type=float)
    g.add_argument("--presence-penalty", type=float)
    g.add_argument("--seed", type=int, help="makes sampling reproducible")
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

    d = sub.add_parser(
        "download",
        help="fetch a model's real weights from the Hugging Face hub",
        description="Download MODEL (config, safetensors weights and tokenizer files; never "
        "pickles) into the Hugging Face cache, where load_model and the notebooks find it. "
        "Needs internet and huggingface_hub (pip install -e '.[download]').",
    )
    d.add_argument("model", metavar="MODEL", help="a model name, e.g. Qwen/Qwen3-0.6B")
    add_chat_parser(sub)
    doctor = sub.add_parser("doctor", help="check the installation: versions, models, tokenizer")
    doctor.add_argument(
        "--scan",
        metavar="MODEL",
        help="instead, read every weight of MODEL (a name or a folder) and report the tensors "
        "holding NaN or infinite values",
    )
    sub.add_parser(
        "grade", help="grade submitted notebooks (qwen-mini grade --help)", add_help=False
    )
    return parser


def main(argv: list[str] | None = None) -> int:
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
        kind = "" if isinstance(e, (ValueError, OSError)) else f"{type(e).__name__}: "
        print(f"qwen-mini: error: {kind}{e}", file=sys.stderr)
        return 1


def run(argv: list[str]) -> int:
    if argv[:1] == ["grade"]:  # grading has its own parser: hand it everything after "grade"
        from .course.grading.cli import main as grade_cli

        return grade_cli(argv[1:])
    for arg in argv:
        check_argument(arg)
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:  # --help or a usage error: argparse has printed the message
        return int(e.code or 0)
    if args.command == "generate" and args.no_thinking and not args.chat:
        print(
            "qwen-mini: error: --no-thinking only applies to chat prompts; add --chat.",
            file=sys.stderr,
        )
        return 2
    if getattr(args, "max_new_tokens", 0) < 0:
        print("qwen-mini: error: --max-new-tokens must be >= 0.", file=sys.stderr)
        return 2
    commands = {"generate": cmd_generate, "download": cmd_download, "doctor": cmd_doctor}
    commands["chat"] = cmd_chat
    return commands[args.command](args)


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


# --- chat -------------------------------------------------------------------------------------


def add_chat_parser(sub) -> None:
    c = sub.add_parser(
        "chat",
        help="multi-turn chat in the terminal, thinking shown apart from the answer",
        description="Chat with MODEL. The history is kept as the Qwen3 template expects and the "
        "KV cache is reused across turns. Ctrl-D or Ctrl-C ends the chat.",
    )
    c.add_argument("model", metavar="MODEL", help="a model name (Qwen/Qwen3-0.6B) or a folder")
    mode = c.add_mutually_exclusive_group()
    mode.add_argument("--think", dest="think", action="store_true", default=True,
                      help="thinking mode (default)")  # fmt: skip
    mode.add_argument("--no-think", dest="think", action="store_false", help="answer directly")
    c.add_argument("--budget", type=int, metavar="N", help="at most N thinking tokens per reply")
    c.add_argument("--max-new-tokens", type=int, default=1024, metavar="N")
    c.add_argument("--system", help="a system prompt")
    c.add_argument("--temperature", type=float, help="default: the mode's preset; 0 = greedy")
    c.add_argument("--seed", type=int, help="makes sampling reproducible")


def cmd_chat(args) -> int:
    from .chat import ChatSession
    from .hub import load_model
    from .tokenizer import load_tokenizer

    if args.budget is not None and (args.budget < 0 or not args.think):
        raise ValueError("--budget N needs N >= 0 and thinking mode (not --no-think).")
    model, tokenizer = load_model(args.model), load_tokenizer(args.model)
    session = ChatSession(
        model, tokenizer, thinking=args.think, budget=args.budget, system=args.system,
        max_new_tokens=args.max_new_tokens, seed=args.seed, temperature=args.temperature,
    )  # fmt: skip
    tty = sys.stdout.isatty()
    dim, bold, reset = ("\x1b[2m", "\x1b[1m", "\x1b[0m") if tty else ("", "", "")
    mode = "thinking" if args.think else "no thinking"
    budget = f", budget {args.budget} tokens" if args.budget is not None else ""
    print(f"qwen-mini chat: {args.model} ({mode}{budget}). Ctrl-D or Ctrl-C to leave.")
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
            print(f"{reset}\n{dim}({t['generated']} tokens, {t['thinking']} thinking; "
                  f"{rate:.1f} tokens/s; prompt {t['prompt']} tokens, {t['reused']} reused "
                  f"from the cache){reset}")  # fmt: skip
    except KeyboardInterrupt:
        print(f"{reset}\n(bye)")
        return 0


# --- generate ---------------------------------------------------------------------------------


def cmd_generate(args) -> int:
    from .generation import Sampling, generate
    from .hub import load_model
    from .tokenizer import load_tokenizer

    prompt = read_stdin() if args.prompt == "-" else args.prompt
    import torch

    dtype = getattr(torch, args.dtype) if args.dtype else None
    model = load_model(args.model, dtype, download=args.download)
    # load_model itself says on stderr when it falls back to the stand-in
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
    pieces = generate(
        model,
        tokenizer,
        prompt,
        max_new_tokens=args.max_new_tokens,
        sampling=sampling,
        seed=args.seed,
        stream=True,
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
    from .hub import find_local

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
    from .hub import KNOWN_MODELS, find_local
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
    family = "qwen3.5" if any(v in name.lower() for v in ("qwen3.5", "qwen3.6")) else "qwen3"
    for token, want in SPECIAL_IDS[family].items():
        got = tokenizer.special_tokens.get(token)
        if got != want:
            problems.append(f"{token} has id {got}, expected {want}")
    if ids[-1:] != [SPECIAL_IDS[family]["<|im_end|>"]]:
        problems.append("<|im_end|> in the text did not become its single id")
    return problems
