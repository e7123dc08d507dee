"""`qwen-mini chat` in a pseudo-terminal: two turns on the offline stand-in, the thinking shown
apart from the answer, and a clean exit on Ctrl-D and on Ctrl-C."""

import os
import pty
import re
import select
import signal
import sys
import time
from pathlib import Path

import pytest

from qwen_mini.chat import BUDGET_STOP
from qwen_mini.tokenizer import load_tokenizer

ROOT = Path(__file__).resolve().parent.parent
PROMPT = "you>"


def _spawn(*args):
    env = {k: v for k, v in os.environ.items() if k != "QWEN_MINI_WEIGHTS"}
    env.update(HF_HUB_OFFLINE="1", HF_HUB_CACHE="/tmp/qwen-mini-empty-hf", PYTHONPATH=str(ROOT),
               TERM="xterm")  # fmt: skip
    code = "import sys; from qwen_mini.cli import main; sys.exit(main())"
    pid, fd = pty.fork()
    if pid == 0:  # the child: the pty is its controlling terminal, so Ctrl-C sends SIGINT
        # as in a terminal: a test run started in the background inherits SIGINT ignored, and
        # Python then never turns Ctrl-C into KeyboardInterrupt
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.execve(sys.executable, [sys.executable, "-c", code, "chat", *args], env)
    return pid, fd


def _read_until(fd, pattern, out, timeout=240):
    """Read the terminal until `pattern` has appeared once more; return all output so far."""
    wanted = out.count(pattern) + 1
    deadline = time.monotonic() + timeout
    while out.count(pattern) < wanted:
        if time.monotonic() > deadline:
            raise AssertionError(f"no {pattern!r} within {timeout} s; output so far:\n{out}")
        ready, _, _ = select.select([fd], [], [], 1)
        if ready:
            try:
                out += os.read(fd, 4096).decode("utf-8", "replace")
            except OSError:  # the child has gone
                raise AssertionError(f"the chat exited early; output:\n{out}") from None
    return out


def _exit_status(pid, fd, out, timeout=60):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status), out
        ready, _, _ = select.select([fd], [], [], 0.5)
        if ready:
            try:
                out += os.read(fd, 4096).decode("utf-8", "replace")
            except OSError:
                pass
    os.kill(pid, 9)
    raise AssertionError(f"the chat did not exit; output:\n{out}")


@pytest.mark.parametrize("leave", ["\x04", "\x03"], ids=["ctrl-d", "ctrl-c"])
def test_two_turns_thinking_shown_clean_exit(leave):
    pid, fd = _spawn("Qwen/Qwen3-0.6B", "--think", "--budget", "3", "--max-new-tokens", "40",
                     "--seed", "0")  # fmt: skip
    out = _read_until(fd, PROMPT, "")
    assert "using its stand-in" in out  # no weights here: the random stand-in, and it says so
    for line in ["What is 2+2?", "And 3+3?"]:
        os.write(fd, (line + "\n").encode())
        out = _read_until(fd, PROMPT, out)
    # the prompt is printed just before input() starts reading: a Ctrl-C in between is noted by
    # Python but only acted on once the read returns, so give the read a moment to start
    time.sleep(1)
    os.write(fd, leave.encode())
    code, out = _exit_status(pid, fd, out)
    os.close(fd)
    assert code == 0, out
    plain = re.sub(r"\x1b\[[0-9;]*m", "", out)
    assert plain.count("[thinking] ") == 2
    # the budget of 3 tokens is spent, so the instruction to stop thinking appears, and the answer
    assert plain.count(BUDGET_STOP.strip().removesuffix("</think>").strip()) == 2
    assert plain.count("[answer] ") == 2
    assert "\x1b[2m[thinking]" in out  # thinking is dimmed, apart from the answer
    stats = re.findall(r"(\d+) tokens, (\d+) thinking; ([\d.]+) tokens/s; prompt (\d+) tokens, "
                       r"(\d+) reused", plain)  # fmt: skip
    assert len(stats) == 2
    assert int(stats[0][4]) == 0 and int(stats[1][4]) > 0  # the second turn reuses the cache
    assert "Traceback" not in out


def test_on_the_standin_a_reply_is_short_and_its_answer_starts():
    """No --budget, no --max-new-tokens: a tiny model may think for 1,024 tokens."""
    pid, fd = _spawn("Qwen/Qwen3-0.6B", "--seed", "1")
    out = _read_until(fd, PROMPT, "")
    assert "replies default to 48 tokens and thinking to a budget of 8" in out
    os.write(fd, b"Hi\n")
    out = _read_until(fd, PROMPT, out)
    os.write(fd, b"\x04")
    code, out = _exit_status(pid, fd, out)
    os.close(fd)
    assert code == 0, out
    plain = re.sub(r"\x1b\[[0-9;]*m", "", out)
    instruction = BUDGET_STOP.strip().removesuffix("</think>").strip()
    assert plain.count(instruction) == 1 and plain.count("[answer] ") == 1  # whole, then answered
    generated, thinking = map(int, re.search(r"\((\d+) tokens, (\d+) thinking;", plain).groups())
    tok = load_tokenizer("Qwen/Qwen3-0.6B")
    forced = tok.encode(BUDGET_STOP)
    assert thinking == 8 + forced.index(tok.end_think_id)  # the budget, then the instruction
    # the rest is the answer, which (with this seed) runs to the limit
    assert generated == 48 > 8 + len(forced)


def test_budget_without_thinking_is_refused(capsys):
    from qwen_mini.cli import main

    assert main(["chat", "Qwen/Qwen3-0.6B", "--no-think", "--budget", "3"]) == 1
    assert "--budget" in capsys.readouterr().err


def _chat_lines(lines, capsys, monkeypatch, *args):
    """`qwen-mini chat` in this process, its messages read from a pipe (stdin is not a terminal)
    on the offline stand-in; returns (exit status, what it printed)."""
    import io

    from qwen_mini.cli import main

    monkeypatch.delenv("QWEN_MINI_WEIGHTS", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", "/tmp/qwen-mini-empty-hf")
    monkeypatch.setattr(sys, "stdin", io.StringIO("".join(line + "\n" for line in lines)))
    code = main(["chat", "Qwen/Qwen3-0.6B", "--no-think", "--max-new-tokens", "3", "--seed", "0",
                 *args])  # fmt: skip
    return code, capsys.readouterr().out


def _stats(out):
    return re.findall(r"\((\d+) tokens, \d+ thinking; [\d.]+ tokens/s; prompt (\d+) tokens, "
                      r"(\d+) reused", out)  # fmt: skip


def test_chat_commands_are_not_sent_to_the_model(capsys, monkeypatch):
    lines = ["/help", "/frobnicate now", "Hi", "And you?", "/reset", "Hi", "/quit", "never sent"]
    code, out = _chat_lines(lines, capsys, monkeypatch, "--system", "Be brief.")
    assert code == 0, out
    assert "/help lists the commands" in out  # said when the chat starts
    assert out.count("The chat's commands:") == 2  # /help, and after the unknown command
    assert "(/frobnicate is not a command)" in out
    for command in ("/help", "/reset", "/quit, /exit"):
        assert f"\n  {command} " in out
    stats = _stats(out)
    assert len(stats) == 3, out  # three messages reached the model: no command, nothing after /quit
    # the second message continues the conversation (its prompt starts with the cached first
    # turn); after /reset the same first message is a new conversation: nothing cached, and its
    # prompt is the first one's again (the system prompt kept)
    assert int(stats[1][2]) > 0 and int(stats[1][1]) > int(stats[0][1])
    assert int(stats[2][2]) == 0 and stats[2][1] == stats[0][1]
    assert "conversation cleared" in out and "the system prompt is kept" in out
    assert "Traceback" not in out


@pytest.mark.parametrize("leave", ["/exit", "/QUIT"])
def test_chat_exit_commands_leave_at_once(capsys, monkeypatch, leave):
    code, out = _chat_lines([leave, "never sent"], capsys, monkeypatch)
    assert code == 0 and _stats(out) == [], out


def test_a_double_slash_sends_the_line_with_one_slash(capsys, monkeypatch):
    """A message may begin with "/": written "//", the chat sends it with one slash."""
    from qwen_mini.chat import ChatSession

    sent = []
    original = ChatSession.send

    def send(self, text):
        sent.append(text)
        return original(self, text)

    monkeypatch.setattr(ChatSession, "send", send)
    code, out = _chat_lines(["//usr/bin is a folder", "/quit"], capsys, monkeypatch)
    assert code == 0 and sent == ["/usr/bin is a folder"], out
