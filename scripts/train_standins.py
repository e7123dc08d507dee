"""Train the stand-ins' weights: tiny models of the real architectures that write simple English.

The stand-ins (`qwen_mini.standin.STANDINS`: 2 layers of width 64, Qwen3.5 4) keep their shapes;
this script trains them on `assets/data/kjv_narratives.txt`, narrative books of the
King James Bible (public domain; from Debian's `bible-kjv-text` package, see `extract_corpus` and
the README beside the text), with the real tokenizers, and writes per model
`assets/standins/<name>.safetensors` and `<name>.json` (the log: loss every
LOG_EVERY steps, the seed, the hashes of the text and of the token ids).

The vocabulary trick. The embedding has 151,936 rows (Qwen3.5: 248,320) and the head is tied to
it, but the text uses about 8,000 ids. Training runs on those rows alone: the softmax is taken
over the used ids plus ONE more class that stands for all N unused ids, with logit log(N). That is
exactly the full-vocabulary softmax when the unused rows are zero (each then has logit 0), at the
cost of a vocabulary of 8,000. The file stores only the used rows and their ids;
`qwen_mini.standin.load_standin` fills the other rows with tiny fixed noise (logits ~ 0, as
trained) and loads the result as a checkpoint.

Run from the repository root (about 5 minutes per model on one core of a 2-core AMD EPYC):

    python scripts/train_standins.py                      # every model in TRAINED
    python scripts/train_standins.py Qwen/Qwen3-0.6B      # one

tests/test_standin_trained.py re-runs the first steps and compares the losses with the log.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import re
import subprocess
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from qwen_mini.architectures import config_from_dict
from qwen_mini.checkpoint import build_model, checkpoint_name, meta_model
from qwen_mini.course.experiments.ch07 import CORPUS, HELD_OUT, books, kept_shares
from qwen_mini.runtime import ThreadedLinear
from qwen_mini.speculative import hidden_states
from qwen_mini.standin import STANDINS, TRAINED, load_standin, standin_file
from qwen_mini.standin import _random_weights as random_weights
from qwen_mini.tokenizer import load_tokenizer

ROOT = Path(__file__).resolve().parent.parent
# the books of the corpus and their verse ranges, as `bible -f` reads them (all of each book)
BOOKS = {
    "Genesis": "gen1:1-50:26",
    "Ruth": "ruth1:1-4:22",
    "Esther": "esther1:1-10:3",
    "Luke": "luke1:1-24:53",
    "Acts": "acts1:1-28:31",
    "Jonah": "jonah1:1-4:11",
}

SEED = 0
STEPS = 1500
BATCH, LENGTH = 16, 128  # sequences of LENGTH tokens per step
LR, WARMUP, WEIGHT_DECAY = 1e-2, 100, 0.01
LOG_EVERY = 50
# the MTP head (Qwen3.5's `mtp.*`), trained afterwards on the frozen, stored main model
MTP_STEPS, MTP_LR, MTP_WARMUP = 600, 1e-2, 50
CHAT_SHARE = 0.125  # the share of sequences that are chat turns (Qwen3's template)


# --- the text ------------------------------------------------------------------------------


def extract_corpus(bible: str, data_dir: str) -> str:
    """The corpus from Debian's packages, as it was made (bible-kjv 4.38, bible-kjv-text 4.38):

        apt-get download bible-kjv bible-kjv-text
        dpkg -x bible-kjv_*.deb x && dpkg -x bible-kjv-text_*.deb x
        python scripts/train_standins.py --extract x/usr/bin/bible x/usr/lib

    Each chapter becomes one paragraph (its verses joined, the references dropped); each book
    starts with a line `=== <Book> ===`."""
    parts = []
    for book, verses in BOOKS.items():
        out = subprocess.run(
            [bible, "-p", data_dir, "-f", "-l", "100000", verses],
            check=True,
            capture_output=True,
            text=True,
        ).stdout
        chapters: dict[str, list[str]] = {}
        for line in out.splitlines():
            m = re.match(r"^[1-3]?[A-Za-z]+(\d+):\d+ (.*)$", line)
            if m:
                chapters.setdefault(m.group(1), []).append(m.group(2).strip())
        parts.append(f"=== {book} ===\n\n" + "\n\n".join(" ".join(v) for v in chapters.values()))
    return "\n\n".join(parts) + "\n"


def chapters_of(text: str) -> list[str]:
    return [c for c in text.split("\n\n") if c.strip()]


def training_text(name: str) -> tuple[list[list[int]], list[list[int]]]:
    """(documents, chat turns) as token ids: each chapter of the training books is a document
    ending with <|endoftext|>; for a chat model, each pair of neighbouring verses-sentences is a
    user turn and an assistant reply (with Qwen3's empty thinking block around a sentence)."""
    tok = load_tokenizer(name)
    eot = tok.token_to_id("<|endoftext|>")
    train_books = {b: t for b, t in books().items() if b != HELD_OUT}
    docs, chats = [], []
    for book_text in train_books.values():
        for chapter in chapters_of(book_text):
            docs.append(tok.encode(chapter) + [eot])
            if STANDINS[name].get("chat"):
                sentences = [s for s in re.split(r"(?<=[.?!:;])\s+", chapter) if len(s) > 10]
                for a, b, c in zip(sentences[0::3], sentences[1::3], sentences[2::3], strict=False):
                    turn = (
                        f"<|im_start|>user\n{a}<|im_end|>\n<|im_start|>assistant\n"
                        f"<think>\n{b}\n</think>\n\n{c}<|im_end|>\n"
                    )
                    chats.append(tok.encode(turn))
    return docs, chats


def held_out_ids(name: str) -> list[int]:
    """The held-out book as token ids."""
    tok = load_tokenizer(name)
    return tok.encode(books()[HELD_OUT])


# --- the model -------------------------------------------------------------------------------


class UsedHead(torch.nn.Module):
    """The tied head over the used rows plus one class for the N unused ids, logit log(N)."""

    def __init__(self, embedding: torch.nn.Parameter, n_unused: int):
        super().__init__()
        self.embedding, self.log_unused = embedding, math.log(n_unused)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = x @ self.embedding.t()
        rest = torch.full((*logits.shape[:-1], 1), self.log_unused, dtype=logits.dtype)
        return torch.cat([logits, rest], dim=-1)


def compact_model(name: str, n_used: int, seed: int):
    """The stand-in's architecture with a vocabulary of the n_used ids, in float32, initialised
    as the random stand-in is (uniform noise, norms neutral), with the UsedHead."""
    spec = dict(STANDINS[name]["config"], vocab_size=n_used)
    cfg = config_from_dict(spec, f"compact stand-in {name}")
    model = meta_model(cfg)
    model = build_model(cfg, random_weights(model, seed), torch.float32, model).train()
    for module in model.modules():  # the loader's one-row speed-up only slows batches down
        if isinstance(module, ThreadedLinear):
            module.__class__ = torch.nn.Linear
    full = STANDINS[name]["config"]["vocab_size"]
    model.lm_head = UsedHead(model.model.embed_tokens.weight, full - n_used)
    return model, cfg


def used_ids(docs, chats) -> torch.Tensor:
    return torch.tensor(sorted({i for d in docs + chats for i in d}), dtype=torch.long)


def sequences(docs, chats, remap: torch.Tensor):
    """Two long streams of compact ids: the documents, and the chat turns."""
    doc = remap[torch.tensor([i for d in docs for i in d])]
    chat = remap[torch.tensor([i for c in chats for i in c])] if chats else None
    return doc, chat


def batch(stream, chat, g: torch.Generator) -> torch.Tensor:
    """BATCH windows of LENGTH + 1 tokens at random offsets (CHAT_SHARE of them from the chats)."""
    n_chat = round(BATCH * CHAT_SHARE) if chat is not None else 0
    rows = []
    for s, n in ((stream, BATCH - n_chat), (chat, n_chat)):
        if n:
            starts = torch.randint(0, len(s) - LENGTH - 1, (n,), generator=g)
            rows += [s[i : i + LENGTH + 1] for i in starts.tolist()]
    return torch.stack(rows)


def lr_at(step: int, steps: int, lr: float, warmup: int) -> float:
    """Linear warm-up, then cosine to a tenth."""
    if step < warmup:
        return lr * (step + 1) / warmup
    t = (step - warmup) / max(1, steps - warmup)
    return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))


def train(name: str, steps: int = STEPS, seed: int = SEED, log=print, stop_after=None, record=None):
    """Train `name`'s stand-in for `steps` steps from `seed`: (model, config, used ids, log).

    The log's losses are means since the previous record (step 1 alone, then steps 2-50, ...).
    stop_after: stop after that many steps of the `steps`-step schedule (the test's shortcut);
    record: a list that gets each [step, mean loss] as it is logged."""
    torch.manual_seed(seed)
    docs, chats = training_text(name)
    ids = used_ids(docs, chats)
    remap = torch.full((STANDINS[name]["config"]["vocab_size"],), -1, dtype=torch.long)
    remap[ids] = torch.arange(len(ids))
    stream, chat = sequences(docs, chats, remap)
    model, cfg = compact_model(name, len(ids), seed)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    rest = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": WEIGHT_DECAY}, {"params": rest, "weight_decay": 0.0}],
        lr=LR,
        betas=(0.9, 0.95),
    )

    g = torch.Generator().manual_seed(seed)
    losses, t0, running = [], time.time(), []
    for step in range(steps if stop_after is None else stop_after):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, steps, LR, WARMUP)
        x = batch(stream, chat, g)
        logits = model(x[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        running.append(loss.item())
        if (step + 1) % LOG_EVERY == 0 or step == 0:
            losses.append([step + 1, sum(running) / len(running)])
            if record is not None:
                record.append(losses[-1])
            log(f"{name} step {step + 1}: loss {losses[-1][1]:.3f} ({time.time() - t0:.0f} s)")
            running = []
    corpus_bytes = CORPUS.read_bytes()
    record = {
        "model": name,
        "seed": seed,
        "steps": steps,
        "batch": BATCH,
        "length": LENGTH,
        "lr": LR,
        "log_every": LOG_EVERY,
        "chat_share": CHAT_SHARE if chat is not None else 0.0,
        "corpus": CORPUS.name,
        "corpus_sha256": hashlib.sha256(corpus_bytes).hexdigest(),
        "token_ids_sha256": hashlib.sha256(stream.numpy().tobytes()).hexdigest(),
        "used_ids": len(ids),
        "training_tokens": len(stream) + (len(chat) if chat is not None else 0),
        "seconds": round(time.time() - t0),
        "torch": torch.__version__,
        "loss_mean_per_steps": [[s, round(v, 4)] for s, v in losses],
    }
    return model.eval(), cfg, ids, record


def weights_to_store(model, cfg, ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """The file's tensors by checkpoint name, in bfloat16: the used rows of the embedding, their
    ids (`used_ids`), every other weight (the tied head is not stored; the MTP head, which the
    main training leaves untouched, is trained and stored by `add_mtp`)."""
    out = {}
    for key, value in model.state_dict().items():
        if key.startswith(("lm_head.", "mtp.")):
            continue
        out[checkpoint_name(key, cfg, model.arch)] = value.detach().to(torch.bfloat16).clone()
    out["used_ids"] = ids.to(torch.int64)
    return out


# --- the MTP head ----------------------------------------------------------------------------


def stored_compact_model(name: str):
    """The compact model (float32) holding the weights of standin_file(name) as stored (rounded
    to bfloat16): the main model exactly as shipped. Returns (model, config, used ids, the
    stored tensors by checkpoint name)."""
    stored = load_file(str(standin_file(name)))
    ids = stored["used_ids"]
    model, cfg = compact_model(name, len(ids), SEED)
    with torch.no_grad():
        for key, value in model.state_dict().items():
            stored_name = checkpoint_name(key, cfg, model.arch)
            if key.startswith("mtp."):  # the MTP head starts from its random initialisation
                continue
            if stored_name in stored:
                value.copy_(stored[stored_name])
            elif not key.startswith("lm_head."):  # the tied head is the embedding
                raise KeyError(f"{standin_file(name)} has no {stored_name}: train {name} first")
    return model, cfg, ids, stored


def mtp_inputs(model, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """From windows x [B, L + 1]: the MTP's inputs and targets, as it drafts (qwen_mini.mtp):
    the main model's last hidden state h_t after its final norm [B, L - 1, H], the embedding of
    token t + 1 [B, L - 1, H], and token t + 2 [B, L - 1], for t = 0 .. L - 2."""
    with torch.no_grad(), hidden_states(model) as box:
        model(x[:, :-1])
    return box["h"][:, :-1], model.model.embed_tokens(x[:, 1:-1]).detach(), x[:, 2:]


def train_mtp(name: str, steps: int = MTP_STEPS, seed: int = SEED, log=print):
    """Train the MTP head (`mtp.*`) of `name`'s stand-in on top of its stored main model, which
    stays frozen (its weights and their log do not change), on the main model's training text:
    from h_t and the embedding of t + 1, predict t + 2 through the tied head. Returns (the
    trained mtp.* tensors by checkpoint name, in bfloat16; the log)."""
    torch.manual_seed(seed)
    model, cfg, ids, _ = stored_compact_model(name)
    docs, chats = training_text(name)
    remap = torch.full((STANDINS[name]["config"]["vocab_size"],), -1, dtype=torch.long)
    remap[ids] = torch.arange(len(ids))
    stream, chat = sequences(docs, chats, remap)
    model.eval()  # no dropout anywhere; the frozen main model only reads
    params = dict(model.mtp.named_parameters())
    for p in model.parameters():
        p.requires_grad_(False)
    for p in params.values():
        p.requires_grad_(True)
    decay = [p for p in params.values() if p.dim() >= 2]
    rest = [p for p in params.values() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": WEIGHT_DECAY}, {"params": rest, "weight_decay": 0.0}],
        lr=MTP_LR,
        betas=(0.9, 0.95),
    )
    g = torch.Generator().manual_seed(seed)
    losses, t0, running = [], time.time(), []
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, steps, MTP_LR, MTP_WARMUP)
        h, e, target = mtp_inputs(model, batch(stream, chat, g))
        logits = model.lm_head(model.mtp(e, h))  # [B, L - 1, used + 1]
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params.values(), 1.0)
        opt.step()
        running.append(loss.item())
        if (step + 1) % LOG_EVERY == 0 or step == 0:
            losses.append([step + 1, sum(running) / len(running)])
            log(f"{name} MTP step {step + 1}: loss {losses[-1][1]:.3f} ({time.time() - t0:.0f} s)")
            running = []
    tensors = {
        checkpoint_name(f"mtp.{k}", cfg, model.arch): p.detach().to(torch.bfloat16).clone()
        for k, p in params.items()
    }
    record = {
        "objective": "token t+2 from the main model's normed last hidden state h_t and the "
        "embedding of token t+1, through the tied head; main model frozen (as stored)",
        "seed": seed,
        "steps": steps,
        "batch": BATCH,
        "length": LENGTH,
        "lr": MTP_LR,
        "seconds": round(time.time() - t0),
        "loss_mean_per_steps": [[s, round(v, 4)] for s, v in losses],
    }
    return tensors, record


def mtp_acceptance(
    name: str, draft_tokens: int = 3, prompts: int = 8, new: int = 48, tensors=None
) -> dict:
    """How well the shipped stand-in's MTP head (or `tensors`, mtp.* by name) drafts, on the
    held-out book: greedy speculative decoding from `prompts` windows of 16 tokens of it
    (spread over the book), `new` tokens each; the share of drafts accepted, with
    draft_tokens = 1 and `draft_tokens`. And on the book itself (its first 1024 tokens): how
    often the head's guess for token t + 2 is the model's own greedy choice there."""
    model, ids = load_standin(name), held_out_ids(name)
    if tensors is not None:
        model.load_state_dict({**model.state_dict(), **tensors})
    x = torch.tensor([ids[:1024]])
    with torch.inference_mode(), hidden_states(model) as box:
        main = model(x).argmax(-1)[0]  # [T]: the model's choice for token t + 1
        guess = model.lm_head(model.mtp(model.model.embed_tokens(x[:, 1:]), box["h"][:, :-1]))
    agree = (guess.argmax(-1)[0] == main[1:]).float().mean().item()
    out = {"text": f"{HELD_OUT} (held out), {prompts} prompts of 16 tokens, {new} new tokens"}
    out["agreement_on_the_text"] = round(agree, 3)
    shares = kept_shares(
        model, model.mtp, load_tokenizer(name), sorted({1, draft_tokens}), prompts, new
    )
    out.update({f"acceptance_k{k}": round(share, 3) for k, share in shares.items()})
    return out


def add_mtp(name: str, steps: int = MTP_STEPS) -> None:
    """Train the MTP head on the stored main model, add it to the stored file and its log, with
    its acceptance on the held-out book."""
    tensors, record = train_mtp(name, steps)
    path = standin_file(name)
    stored = {k: v for k, v in load_file(str(path)).items() if not k.startswith("mtp.")}
    save_file({**stored, **tensors}, str(path), metadata={"model": name})
    record["held_out"] = mtp_acceptance(name)
    print(f"{name} MTP: {record['held_out']}")
    log_path = path.with_suffix(".json")
    log = json.loads(log_path.read_text())
    log["mtp"] = record
    log_path.write_text(json.dumps(log, indent=1) + "\n")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("models", nargs="*", default=list(TRAINED))
    p.add_argument("--steps", type=int, default=STEPS)
    p.add_argument("--mtp-steps", type=int, default=MTP_STEPS)
    p.add_argument(
        "--mtp-only",
        action="store_true",
        help="train only the MTP head, on the stored main model (which does not change)",
    )
    p.add_argument("--extract", nargs=2, metavar=("BIBLE", "DATA_DIR"))
    args = p.parse_args(argv)
    if args.extract:
        CORPUS.write_text(extract_corpus(*args.extract), encoding="utf-8")
        print(f"wrote {CORPUS}")
        return 0
    torch.set_num_threads(
        1
    )  # one thread: the same sums on every machine, and no wait for a busy core
    for name in args.models:
        path = standin_file(name)
        if not args.mtp_only:
            model, cfg, ids, record = train(name, args.steps)
            path.parent.mkdir(parents=True, exist_ok=True)
            save_file(weights_to_store(model, cfg, ids), str(path), metadata={"model": name})
            path.with_suffix(".json").write_text(json.dumps(record, indent=1) + "\n")
        if STANDINS[name]["config"].get("mtp_num_hidden_layers"):
            add_mtp(name, args.mtp_steps)
        print(f"wrote {path} ({path.stat().st_size / 1e6:.1f} MB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
