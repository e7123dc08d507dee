"""Draw the course's diagrams, one or more per chapter, into assets/diagrams/ (SVG).

    python scripts/draw_diagrams.py            # write assets/diagrams/*.svg
    python scripts/draw_diagrams.py --embed    # also put each into its solution notebook
    python scripts/draw_diagrams.py --check    # change nothing; exit 1 naming what differs

Each diagram shows the block its chapter builds, labelled with the names the code and the
checkpoints use (q_proj, k_norm, in_proj_qkv, A_log, ...). The output is deterministic (no date,
fixed ids, text drawn as paths with matplotlib's own DejaVu fonts), so the committed files can be
compared with what this script draws, and a page shows the same picture on any machine.

A notebook shows a diagram as a cell attachment (`![...](attachment:ch01_gqa.svg)`), because
JupyterLab serves only the course folder and a path to ../assets would not load there; `--embed`
copies each file into the attachment of the solution notebook's markdown cell that names it (the
build then copies it into course/), and `--check` also compares those attachments.
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("svg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import FancyBboxPatch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "assets" / "diagrams"
SOLUTIONS = ROOT / "solutions"

# one colour per kind of part, the same in every chapter
NORM = "#fde68a"  # RMSNorm and its variants
LINEAR = "#bfdbfe"  # learned projections
MIXER = "#fecaca"  # attention, DeltaNet: where tokens meet
FFN = "#bbf7d0"  # feed-forward, experts
OP = "#f3f4f6"  # parameter-free operations
STATE = "#ddd6fe"  # what is kept between steps: caches, states
NEW = "#fb923c"  # the edge of what a chapter adds
GREY = "#6b7280"

RC = {
    "svg.hashsalt": "qwen-mini",  # fixed ids: the same file on every run
    "svg.fonttype": "none",  # text kept as text: a fifth of the size of glyphs drawn as paths
    "font.family": "DejaVu Sans",
    "font.size": 10,
    "mathtext.fontset": "dejavusans",
}


class Canvas:
    """A figure in data units: 1 unit = 0.5 inch, y upwards."""

    def __init__(self, width: float, height: float, title: str):
        self.fig = plt.figure(figsize=(width / 2, height / 2))
        self.ax = self.fig.add_axes((0, 0, 1, 1))
        self.ax.set_xlim(0, width)
        self.ax.set_ylim(0, height)
        self.ax.axis("off")
        self.text(0.3, height - 0.45, title, size=12.5, weight="bold", ha="left")

    def box(self, x, y, w, h, label, color=OP, *, mono=True, size=9.5, edge="#374151", lw=1.0):
        """A rounded box centred on (x, y); returns its centre, for arrows."""
        patch = FancyBboxPatch(
            (x - w / 2, y - h / 2),
            w,
            h,
            boxstyle="round,pad=0,rounding_size=0.12",
            facecolor=color,
            edgecolor=edge,
            linewidth=lw,
        )
        self.ax.add_patch(patch)
        if label:
            family = "DejaVu Sans Mono" if mono else "DejaVu Sans"
            self.text(x, y, label, size=size, family=family)
        return (x, y)

    def frame(self, x0, y0, x1, y1, label="", color="#9ca3af", dashed=True, size=9):
        patch = FancyBboxPatch(
            (x0, y0),
            x1 - x0,
            y1 - y0,
            boxstyle="round,pad=0,rounding_size=0.2",
            facecolor="none",
            edgecolor=color,
            linewidth=1.1,
            linestyle=(0, (4, 3)) if dashed else "-",
        )
        self.ax.add_patch(patch)
        if label:
            self.text(x0 + 0.15, y1 - 0.3, label, size=size, ha="left", color="#374151")

    def text(self, x, y, s, *, size=9.5, ha="center", va="center", color="#111827", **kw):
        self.ax.text(x, y, s, fontsize=size, ha=ha, va=va, color=color, **kw)

    def arrow(self, *points, color="#374151", lw=1.1, style="-|>", dashed=False):
        """A polyline through `points`, with an arrow head at the last one."""
        points = list(points)
        ls = (0, (4, 3)) if dashed else "-"
        for a, b in zip(points[:-2], points[1:-1], strict=True):
            self.ax.plot([a[0], b[0]], [a[1], b[1]], color=color, lw=lw, ls=ls)
        self.ax.annotate(
            "",
            xy=points[-1],
            xytext=points[-2],
            arrowprops=dict(arrowstyle=style, color=color, lw=lw, ls=ls, shrinkA=0, shrinkB=0),
        )

    def line(self, *points, color="#374151", lw=1.1, dashed=False):
        ls = (0, (4, 3)) if dashed else "-"
        xs, ys = zip(*points, strict=True)
        self.ax.plot(xs, ys, color=color, lw=lw, ls=ls)

    def plus(self, x, y, r=0.2, sym="+"):
        circle = plt.Circle((x, y), r, facecolor="white", edgecolor="#374151", lw=1.1)
        self.ax.add_patch(circle)
        self.text(x, y, sym, size=11)
        return (x, y)

    def svg(self) -> str:
        buf = io.StringIO()
        self.fig.savefig(buf, format="svg", metadata={"Date": None, "Creator": None})
        plt.close(self.fig)
        text = buf.getvalue()
        head = "<!-- Drawn by scripts/draw_diagrams.py: edit the script, not this file. -->\n"
        first = text.index("\n") + 1  # after the <?xml ...?> line
        return text[:first] + head + text[first:]


# --- chapter 0: the whole model, the decoder layer, SwiGLU ------------------------------------


def ch00_model() -> str:
    c = Canvas(20, 17, "Qwen3: embedding, a stack of decoder layers, norm and head")
    X = 5.2  # the residual stream's column
    c.text(X, 15.75, "input_ids  [B, T]", family="DejaVu Sans Mono")
    c.arrow((X, 15.45), (X, 15.0))
    c.box(X, 14.55, 5.2, 0.8, "embed_tokens  [vocab, hidden]", LINEAR)
    c.arrow((X, 14.15), (X, 13.5))
    # the decoder layer
    c.frame(0.6, 4.2, 11.2, 13.5, "layers.i  (DecoderLayer), × num_hidden_layers (28)", NEW)
    c.line((X, 13.5), (X, 4.2), lw=2.2)  # the stream itself, never normalised
    c.text(X - 0.25, 12.6, "x  [B, T, hidden]\n(the residual stream)", ha="right", size=8.5)
    B = 8.3  # branch column
    c.arrow((X, 12.9), (B, 12.9), (B, 12.45))
    c.box(B, 12.05, 4.4, 0.8, "input_layernorm  (RMSNorm)", NORM)
    c.arrow((B, 11.65), (B, 11.05))
    c.box(B, 10.6, 4.4, 0.9, "self_attn\n(attention: chapter 1)", MIXER)
    c.arrow((B, 10.15), (B, 9.35), (X + 0.2, 9.35))
    c.plus(X, 9.35)
    c.arrow((X, 8.6), (B, 8.6), (B, 8.15))
    c.box(B, 7.75, 4.4, 0.8, "post_attention_layernorm", NORM)
    c.arrow((B, 7.35), (B, 6.75))
    c.box(B, 6.3, 4.4, 0.9, "mlp  (SwiGLU)", FFN)
    c.arrow((B, 5.85), (B, 5.0), (X + 0.2, 5.0))
    c.plus(X, 5.0)
    c.text(
        X + 0.4,
        8.97,
        "x = x + self_attn(input_layernorm(x))",
        ha="left",
        size=8.5,
        family="DejaVu Sans Mono",
    )
    c.text(
        X + 0.4,
        4.6,
        "x = x + mlp(post_attention_layernorm(x))",
        ha="left",
        size=8.5,
        family="DejaVu Sans Mono",
    )
    c.arrow((X, 4.2), (X, 3.55))
    c.box(X, 3.15, 4.4, 0.8, "norm  (RMSNorm)", NORM)
    c.arrow((X, 2.75), (X, 2.15))
    c.box(X, 1.75, 5.2, 0.8, "lm_head  [vocab, hidden]", LINEAR)
    c.arrow((X, 1.35), (X, 0.85))
    c.text(X, 0.55, "logits  [B, T, vocab]", family="DejaVu Sans Mono")
    # tying
    c.arrow(
        (X - 2.6, 1.75),
        (0.35, 1.75),
        (0.35, 14.55),
        (X - 2.6, 14.55),
        dashed=True,
        color=GREY,
        style="<|-|>",
    )
    c.text(0.5, 1.0, "tie_word_embeddings:\nthe same matrix", ha="left", size=8.5, color=GREY)
    # RoPE
    c.box(16.0, 10.6, 6.6, 0.9, "rotary cos, sin of each position\n(RoPE: rope_theta)", OP)
    c.arrow((12.7, 10.6), (B + 2.2, 10.6))
    # SwiGLU, expanded
    c.frame(12.4, 2.6, 19.6, 8.6, "mlp, inside: SwiGLU")
    c.line((B + 2.2, 6.3), (12.4, 6.3), dashed=True, color=GREY)
    c.text(16.0, 8.0, "x  [.., hidden]", family="DejaVu Sans Mono", size=9)
    c.arrow((16.0, 7.75), (16.0, 7.45), (14.3, 7.45), (14.3, 7.1))
    c.arrow((16.0, 7.45), (17.7, 7.45), (17.7, 7.1))
    c.box(14.3, 6.7, 3.0, 0.8, "gate_proj", LINEAR)
    c.box(17.7, 6.7, 3.0, 0.8, "up_proj", LINEAR)
    c.arrow((14.3, 6.3), (14.3, 5.75))
    c.box(14.3, 5.35, 1.8, 0.8, "silu", OP)
    c.arrow((14.3, 4.95), (14.3, 4.45), (15.8, 4.45))
    c.arrow((17.7, 6.3), (17.7, 4.45), (16.2, 4.45))
    c.plus(16.0, 4.45, sym="×")
    c.arrow((16.0, 4.25), (16.0, 3.85))
    c.box(16.0, 3.45, 3.0, 0.8, "down_proj", LINEAR)
    c.text(16.0, 2.85, "[.., intermediate] → [.., hidden]", size=8, family="DejaVu Sans Mono")
    # legend
    for i, (color, name) in enumerate(
        [
            (NORM, "norm"),
            (LINEAR, "linear map"),
            (MIXER, "mixer: tokens meet"),
            (FFN, "feed-forward: each token alone"),
            (OP, "no parameters"),
        ]
    ):
        c.box(12.7, 15.4 - 0.6 * i, 0.5, 0.4, "", color)
        c.text(13.1, 15.4 - 0.6 * i, name, ha="left", size=8.5)
    return c.svg()


# --- chapter 1: GQA's grouping and the KV cache -------------------------------------------------


def _heads(c, n_q, n_kv, x0, x1, yq, ykv, label=None, w=0.42):
    n_rep = n_q // n_kv
    qs = [x0 + (x1 - x0) * (i + 0.5) / n_q for i in range(n_q)]
    kvs = [sum(qs[g * n_rep : (g + 1) * n_rep]) / n_rep for g in range(n_kv)]
    for h, x in enumerate(qs):
        c.line((x, yq - 0.25), (kvs[h // n_rep], ykv + 0.25), color="#6b7280", lw=0.9)
    for h, x in enumerate(qs):
        c.box(x, yq, w, 0.5, str(h), LINEAR, size=7.5)
    for g, x in enumerate(kvs):
        c.box(
            x,
            ykv,
            max(w, 0.7 * (qs[1] - qs[0]) * n_rep if n_q > 1 else w),
            0.5,
            str(g),
            STATE,
            size=7.5,
        )
    if label:
        c.text((x0 + x1) / 2, ykv - 0.6, label, size=8.5)


def ch01_gqa() -> str:
    c = Canvas(20, 13, "GQA: query head h reads KV head h // n_rep (Qwen3-0.6B: 16 → 8, n_rep = 2)")
    c.text(0.4, 11.2, "q_proj →\n16 query heads", ha="left", size=8.5)
    c.text(0.4, 9.5, "k_proj, v_proj →\n8 KV heads", ha="left", size=8.5)
    _heads(c, 16, 8, 3.0, 19.5, 11.2, 9.5, w=0.7)
    c.text(
        11.25,
        8.6,
        "neighbours share: query heads 0, 1 → KV head 0; 2, 3 → KV head 1; …  "
        "(repeat_kv: repeat_interleave, not tile)",
        size=8.5,
    )
    # MHA, GQA, MQA with 4 query heads
    c.text(0.4, 7.5, "H = 4 query heads:", ha="left", size=9, weight="bold")
    for i, (n_kv, name) in enumerate(
        [(4, "MHA: H_kv = H"), (2, "GQA: H_kv = 2, n_rep = 2"), (1, "MQA: H_kv = 1")]
    ):
        x0 = 0.4 + i * 3.6
        _heads(c, 4, n_kv, x0, x0 + 3.0, 6.6, 5.0, label=name)
    # the cache
    c.text(
        11.3, 7.5, "KVCache of one layer: k, v  [B, H_kv, T, D]", ha="left", size=9, weight="bold"
    )
    for row, name in enumerate(["k", "v"]):
        y = 6.5 - row * 1.3
        c.text(11.3, y, name, size=9, family="DejaVu Sans Mono")
        for t in range(7):
            new = t == 6
            c.box(
                12.1 + t * 0.95,
                y,
                0.85,
                0.8,
                f"t{t}",
                NEW if new else STATE,
                size=8,
                edge="#9a3412" if new else "#374151",
            )
    c.text(15.0, 4.45, "past tokens: stored once", size=8.5)
    c.text(17.8, 4.45, "new token:\ncache.update(k, v)", size=8.5)
    c.text(
        11.3,
        3.2,
        "bytes per token = 2 (k and v) × layers × H_kv × D × bytes each",
        ha="left",
        size=8.5,
    )
    c.text(11.3, 2.6, "Qwen3-0.6B, bfloat16: 2 × 28 × 8 × 128 × 2 = 112 KiB", ha="left", size=8.5)
    c.text(11.3, 2.0, "MHA would keep 2×, MQA 1/8 of it", ha="left", size=8.5)
    c.text(
        0.4, 3.2, "Each new query attends to every cached key of its KV head;", ha="left", size=8.5
    )
    c.text(0.4, 2.6, "only the new token's k and v are computed.", ha="left", size=8.5)
    return c.svg()


# --- chapter 2: where QK-Norm sits, against QKV bias --------------------------------------------


def _attention_lanes(c, y0, title, qk_norm: bool):
    c.text(0.4, y0 + 2.2, title, ha="left", size=10, weight="bold")
    c.text(0.9, y0 + 0.9, "x", size=11, family="DejaVu Sans Mono")
    lanes = [("q", y0 + 1.6), ("k", y0 + 0.6), ("v", y0 - 0.4)]
    for name, y in lanes:
        c.arrow((1.2, y0 + 0.9), (1.6, y0 + 0.9), (1.6, y), (2.0, y))
        bias = not qk_norm
        label = f"{name}_proj" + ("  + b" if bias else "")
        c.box(
            3.4,
            y,
            2.8,
            0.7,
            label,
            LINEAR,
            edge="#9a3412" if bias else "#374151",
            lw=2.0 if bias else 1.0,
        )
        c.arrow((4.8, y), (5.4, y))
        c.box(6.75, y, 2.7, 0.7, "split heads", OP, size=8.5)
        x = 8.1
        if name != "v":
            if qk_norm:
                c.arrow((x, y), (8.7, y))
                c.box(10.05, y, 2.7, 0.7, f"{name}_norm", NORM, edge="#9a3412", lw=2.0)
                x = 11.4
            c.arrow((x, y), (12.0, y))
            c.box(13.0, y, 2.0, 0.7, "RoPE", OP)
            x = 14.0
        c.arrow((x, y), (14.9, y))
    c.box(16.2, y0 + 0.6, 2.6, 2.6, "softmax(\nq·kᵀ / √D )\n· v\n(repeat_kv)", MIXER, size=8.5)
    c.arrow((17.5, y0 + 0.6), (18.1, y0 + 0.6))
    c.box(19.1, y0 + 0.6, 1.8, 0.7, "o_proj", LINEAR)


def ch02_qk_norm() -> str:
    c = Canvas(20.4, 10.4, "QKV bias (Qwen2.5) against QK-Norm (Qwen3): the same layer, two diffs")
    _attention_lanes(
        c,
        6.4,
        "Qwen2.5: a bias on q_proj, k_proj, v_proj (none on o_proj), added before RoPE",
        qk_norm=False,
    )
    _attention_lanes(
        c,
        1.6,
        "Qwen3: no biases; q_norm, k_norm after the projection, per head, before RoPE",
        qk_norm=True,
    )
    c.text(
        10.05,
        0.55,
        "RMSNorm over each head's head_dim (128) numbers,\nweight [head_dim] shared by all heads",
        size=8.5,
    )
    return c.svg()


# --- chapter 3: MoE routing -----------------------------------------------------------------------


def ch03_moe() -> str:
    c = Canvas(20, 13.6, "A mixture-of-experts block: route each token to k of E experts")
    c.text(1.3, 11.6, "x  [N, H]\n(N tokens)", size=9, family="DejaVu Sans Mono")
    c.arrow((2.4, 11.6), (3.0, 11.6))
    c.box(4.3, 11.6, 2.6, 0.8, "gate\nLinear(H, E)", LINEAR, size=8.5)
    c.arrow((5.6, 11.6), (6.2, 11.6))
    c.box(7.7, 11.6, 3.0, 0.8, "softmax over E\n(float32)", OP, size=8.5)
    c.arrow((9.2, 11.6), (9.8, 11.6))
    c.box(11.0, 11.6, 2.4, 0.8, "top-k", OP)
    c.arrow((12.2, 11.6), (12.8, 11.6))
    c.box(14.6, 11.6, 3.6, 0.8, "renormalise to 1\n(norm_topk_prob)", OP, size=8.5)
    c.arrow((16.4, 11.6), (17.0, 11.6))
    c.text(18.4, 11.6, "weights [N, k]\nindices [N, k]", size=8.5, family="DejaVu Sans Mono")
    # one token's probabilities
    probs = [0.05, 0.30, 0.04, 0.08, 0.03, 0.38, 0.07, 0.05]
    chosen = {1, 5}
    base, x0 = 8.1, 3.2
    c.text(0.4, 9.6, "one token,\nE = 8, k = 2:", ha="left", size=8.5)
    for e, p in enumerate(probs):
        x = x0 + e * 0.8
        h = p * 6
        patch = FancyBboxPatch(
            (x - 0.25, base),
            0.5,
            h,
            boxstyle="square,pad=0",
            facecolor=NEW if e in chosen else "#d1d5db",
            edgecolor="none",
        )
        c.ax.add_patch(patch)
        c.text(x, base - 0.3, str(e), size=8)
    c.text(x0 + 3.0, base - 0.8, "softmax probabilities; the top 2 kept", size=8.5)
    c.text(11.0, 9.6, "kept: 0.30 and 0.38 → 0.44 and 0.56", ha="left", size=8.5)
    # experts
    y = 5.4
    c.text(
        0.4, y + 0.9, "experts.e  (a SwiGLU each: gate_proj, up_proj, down_proj)", ha="left", size=9
    )
    xs = [1.4 + e * 1.55 for e in range(8)]
    for e, x in enumerate(xs):
        on = e in chosen
        c.box(
            x,
            y,
            1.3,
            0.9,
            f"experts.{e}",
            FFN if on else "#f9fafb",
            size=8,
            edge="#9a3412" if on else "#9ca3af",
            lw=2.0 if on else 1.0,
        )
    c.text(
        7.0,
        2.3,
        "only the chosen experts run for this token (grouped dispatch: "
        "each expert once, on its tokens)",
        size=8.5,
    )
    for e, w in zip(sorted(chosen), ["0.44", "0.56"], strict=True):
        c.arrow((xs[e], y - 0.45), (xs[e], 4.1), (7.1, 4.1), (7.1, 3.55))
        c.text(xs[e] + 0.15, 4.45, f"× {w}", ha="left", size=8.5)
    c.plus(7.1, 3.25, r=0.3, sym="Σ")
    c.arrow((7.4, 3.25), (13.3, 3.25))
    c.plus(13.5, 3.25)
    c.arrow((13.8, 3.25), (14.6, 3.25))
    c.text(14.75, 3.25, "output  [N, H]", size=9, family="DejaVu Sans Mono", ha="left")
    # shared expert
    c.frame(12.8, 4.4, 19.7, 8.2, "Qwen3-Next, Qwen3.5-MoE (chapter 3 §5)", NEW)
    c.box(16.2, 7.0, 3.6, 0.8, "shared_expert  (SwiGLU)", FFN, size=8.5)
    c.box(16.2, 5.6, 3.6, 0.8, "shared_expert_gate\nLinear(H, 1) → sigmoid", LINEAR, size=8.2)
    c.plus(13.5, 5.6, sym="×")
    c.arrow((14.4, 7.0), (13.5, 7.0), (13.5, 5.8))
    c.arrow((14.4, 5.6), (13.7, 5.6))
    c.arrow((13.5, 5.4), (13.5, 3.45))
    c.text(
        1.0,
        1.5,
        "every token goes through the shared expert, scaled by a sigmoid in (0, 1); "
        "the routed experts see only their tokens",
        ha="left",
        size=8.5,
    )
    return c.svg()


# --- chapter 4: the tokens of a thinking conversation ---------------------------------------------


def _tokens(c, y, parts, x=0.5, h=0.7):
    """Draw `parts` [(text, kind)] left to right as a row of token spans."""
    colours = {
        "ctl": "#fca5a5",
        "role": "#e5e7eb",
        "text": "white",
        "think": "#ddd6fe",
        "nl": "#f3f4f6",
        "gen": "#bbf7d0",
    }
    for text, kind in parts:
        w = 0.14 * len(text) + 0.35
        c.box(
            x + w / 2,
            y,
            w,
            h,
            text,
            colours[kind],
            size=8.2,
            edge="#9a3412" if kind == "ctl" else "#6b7280",
        )
        x += w + 0.08
    return x


def ch04_template() -> str:
    c = Canvas(20.4, 12.4, "A Qwen3 conversation as the model reads it (ChatML, thinking)")
    nl = ("\\n", "nl")
    c.text(
        0.5,
        10.9,
        "the history: earlier turns, their reasoning dropped",
        ha="left",
        size=9,
        weight="bold",
    )
    _tokens(
        c,
        10.2,
        [
            ("<|im_start|>", "ctl"),
            ("user", "role"),
            nl,
            ("What is 2+2?", "text"),
            ("<|im_end|>", "ctl"),
            nl,
        ],
    )
    _tokens(
        c,
        9.3,
        [
            ("<|im_start|>", "ctl"),
            ("assistant", "role"),
            nl,
            ("4", "text"),
            ("<|im_end|>", "ctl"),
            nl,
        ],
    )
    c.text(
        10.8,
        9.3,
        "← its <think>…</think> is not written back (before the last user query)",
        ha="left",
        size=8.5,
    )
    _tokens(
        c,
        8.4,
        [
            ("<|im_start|>", "ctl"),
            ("user", "role"),
            nl,
            ("And 3+3?", "text"),
            ("<|im_end|>", "ctl"),
            nl,
        ],
    )
    c.text(
        0.5,
        7.2,
        "the generation prompt, thinking on (enable_thinking left out or True)",
        ha="left",
        size=9,
        weight="bold",
    )
    x = _tokens(c, 6.5, [("<|im_start|>", "ctl"), ("assistant", "role"), nl])
    _tokens(
        c,
        6.5,
        [
            ("<think>", "gen"),
            nl,
            ("Three and three…", "gen"),
            nl,
            ("</think>", "gen"),
            ("\\n\\n", "gen"),
            ("6", "gen"),
            ("<|im_end|>", "gen"),
        ],
        x=x + 0.3,
    )
    c.text(
        0.5,
        5.0,
        "thinking off (enable_thinking=False): the template pre-fills an empty block",
        ha="left",
        size=9,
        weight="bold",
    )
    x = _tokens(
        c,
        4.3,
        [
            ("<|im_start|>", "ctl"),
            ("assistant", "role"),
            nl,
            ("<think>", "think"),
            ("\\n\\n", "think"),
            ("</think>", "think"),
            ("\\n\\n", "think"),
        ],
    )
    _tokens(c, 4.3, [("6", "gen"), ("<|im_end|>", "gen")], x=x + 0.3)
    c.box(0.9, 2.5, 0.6, 0.4, "", "#fca5a5", edge="#9a3412")
    c.text(
        1.35,
        2.5,
        "control token (one id: <|im_start|> 151644, <|im_end|> 151645)",
        ha="left",
        size=8.5,
    )
    c.box(0.9, 1.9, 0.6, 0.4, "", "#ddd6fe")
    c.text(1.35, 1.9, "written by the template", ha="left", size=8.5)
    c.box(0.9, 1.3, 0.6, 0.4, "", "#bbf7d0")
    c.text(
        1.35,
        1.3,
        "written by the model; parse_reply splits reasoning from answer; "
        "a budget closes </think> after N tokens",
        ha="left",
        size=8.5,
    )
    return c.svg()


# --- chapter 5: the hybrid stack and the gated delta rule ----------------------------------------


def ch05_hybrid() -> str:
    c = Canvas(
        20,
        7.6,
        "Qwen3.5-0.8B: 24 layers, three Gated DeltaNet to one attention "
        "(full_attention_interval = 4)",
    )
    for i in range(24):
        full = i % 4 == 3
        x = 0.75 + i * 0.78
        c.box(
            x,
            5.4,
            0.68,
            1.6,
            "",
            MIXER if full else STATE,
            edge="#9a3412" if full else "#374151",
            lw=2.0 if full else 1.0,
        )
        c.text(
            x,
            5.4,
            "self_attn" if full else "linear_attn",
            size=7,
            rotation=90,
            family="DejaVu Sans Mono",
        )
        c.text(x, 4.35, str(i), size=7.5)
    c.text(
        0.4,
        3.6,
        "layer_types: linear_attention × 3, full_attention, … (each layer also has "
        "its mlp and two zero-centred RMSNorms)",
        ha="left",
        size=8.5,
    )
    c.box(0.9, 2.6, 0.6, 0.45, "", STATE)
    c.text(
        1.4,
        2.6,
        "linear_attn (GatedDeltaNet): keeps a fixed state per layer, S [H_v, d_k, "
        "d_v] and the conv state, whatever the length",
        ha="left",
        size=8.5,
    )
    c.box(0.9, 1.8, 0.6, 0.45, "", MIXER, edge="#9a3412", lw=2.0)
    c.text(
        1.4,
        1.8,
        "self_attn (GatedAttention): a KV cache that grows by one k, v per token; "
        "output gate, partial RoPE",
        ha="left",
        size=8.5,
    )
    c.text(1.4, 1.0, "the hybrid cache: 18 fixed states + 6 growing KV caches", ha="left", size=8.5)
    return c.svg()


def ch05_deltanet() -> str:
    c = Canvas(
        20.4, 14.4, "The gated delta rule, one token, and the Gated DeltaNet layer around it"
    )
    # recurrence
    c.text(0.4, 13.1, "per value head, S [d_k, d_v], float32:", ha="left", size=9, weight="bold")
    y = 11.5
    c.box(1.5, y, 1.6, 1.0, r"$S_{t-1}$", STATE, mono=False, size=12)
    c.arrow((2.3, y), (3.2, y))
    c.box(4.6, y, 2.8, 1.0, r"$S \leftarrow e^{g_t} S$" + "\ndecay", OP, mono=False, size=10)
    c.arrow((6.0, y), (6.9, y))
    c.box(
        9.1,
        y,
        4.4,
        1.0,
        r"$u_t = \beta_t\,(v_t - S^\top k_t)$" + "\nthe error only",
        OP,
        mono=False,
        size=10,
    )
    c.arrow((11.3, y), (12.2, y))
    c.box(
        14.0, y, 3.6, 1.0, r"$S \leftarrow S + k_t\,u_t^\top$" + "\nwrite", OP, mono=False, size=10
    )
    c.arrow((15.8, y), (16.7, y))
    c.box(17.6, y, 1.6, 1.0, r"$S_t$", STATE, mono=False, size=12)
    c.arrow((17.6, y - 0.5), (17.6, y - 1.3))
    c.box(17.6, y - 1.75, 3.0, 0.8, r"$o_t = S_t^\top q_t$" + "  read", OP, mono=False, size=10)
    c.text(
        0.4,
        9.75,
        r"$g_t = -e^{A_{\log}}\,\mathrm{softplus}(a_t + \mathrm{dt\_bias}) \leq 0$"
        r",   $\beta_t = \sigma(b_t) \in (0, 1)$,   $q, k$ L2-normalised, $q$ scaled by "
        r"$d_k^{-1/2}$",
        ha="left",
        size=10,
    )
    c.text(
        0.4,
        9.05,
        "decay first, then the write, then the read: the token's own write is "
        "not decayed, and its output already contains it",
        ha="left",
        size=8.5,
    )
    # the layer
    c.frame(0.3, 0.3, 20.1, 8.3, "linear_attn (GatedDeltaNet): checkpoint names", NEW)
    c.text(1.0, 4.6, "x", size=11, family="DejaVu Sans Mono")
    c.arrow((1.2, 4.6), (1.6, 4.6), (1.6, 7.1), (2.1, 7.1))
    c.arrow((1.6, 4.6), (1.6, 5.5), (2.1, 5.5))
    c.arrow((1.6, 4.6), (1.6, 3.9), (2.1, 3.9))
    c.arrow((1.6, 4.6), (1.6, 2.3), (2.1, 2.3))
    c.box(3.6, 7.1, 3.0, 0.8, "in_proj_qkv", LINEAR)
    c.arrow((5.1, 7.1), (5.7, 7.1))
    c.box(7.4, 7.1, 3.4, 0.8, "conv1d (4 taps)\n+ SiLU", OP, size=8.5)
    c.arrow((9.1, 7.1), (9.7, 7.1))
    c.box(11.0, 7.1, 2.6, 0.8, "q, k: l2norm\nv", OP, size=8.5)
    c.box(3.6, 5.5, 3.0, 0.8, "in_proj_b", LINEAR)
    c.arrow((5.1, 5.5), (5.7, 5.5))
    c.box(7.4, 5.5, 3.4, 0.8, r"$\beta = \sigma(\cdot)$", OP, mono=False)
    c.box(3.6, 3.9, 3.0, 0.8, "in_proj_a", LINEAR)
    c.arrow((5.1, 3.9), (5.7, 3.9))
    c.box(7.4, 3.9, 3.4, 0.8, "A_log, dt_bias → g", OP, size=8.5)
    c.box(14.3, 5.5, 2.6, 2.4, "gated\ndelta rule\n(state S)", STATE, size=9)
    c.arrow((12.3, 7.1), (12.6, 7.1), (12.6, 6.2), (13.0, 6.2))
    c.arrow((9.1, 5.5), (13.0, 5.5))
    c.arrow((9.1, 3.9), (12.6, 3.9), (12.6, 4.8), (13.0, 4.8))
    c.box(3.6, 2.3, 3.0, 0.8, "in_proj_z", LINEAR)
    c.arrow((5.1, 2.3), (17.0, 2.3), (17.0, 4.9))
    c.text(11.0, 2.6, "z: the output gate", size=8.5)
    c.arrow((15.6, 5.5), (16.0, 5.5))
    c.box(17.3, 5.5, 2.6, 1.2, "norm\nx̂ · w · silu(z)", NORM, size=8.5)
    c.arrow((17.3, 6.1), (17.3, 7.1), (18.1, 7.1))
    c.box(19.0, 7.1, 1.8, 0.8, "out_proj", LINEAR, size=8.5)
    c.text(
        7.4,
        1.2,
        "conv state: the last 3 inputs of conv1d;  S: one matrix per value head. "
        "Both are the layer's cache.",
        size=8.5,
    )
    return c.svg()


# --- chapter 6: the new blocks of the family ------------------------------------------------------


def ch06_sparse_attention() -> str:
    c = Canvas(20.4, 9.2, "Qwen Sparse Attention: a query reads the best blocks and its tail")
    r, n_tok = 4, 22
    t_q = n_tok - 1
    complete = (t_q + 1) // r  # blocks complete up to the query
    kept = {1, 3}
    x0, w = 0.6, 0.82
    c.text(
        0.4,
        7.6,
        f"cached tokens, cut into blocks of r = indexer_compress_ratio = {r}",
        ha="left",
        size=9,
    )
    for t in range(n_tok):
        b = t // r
        tail = b >= complete
        if tail:
            color = NEW if t == t_q else "#fed7aa"
        else:
            color = MIXER if b in kept else "#f3f4f6"
        c.box(
            x0 + t * w + 0.4,
            6.6,
            0.72,
            0.7,
            str(t),
            color,
            size=7.5,
            edge="#374151" if (tail or b in kept) else "#9ca3af",
        )
    for b in range(complete):
        xa, xb = x0 + b * r * w + 0.06, x0 + (b + 1) * r * w - 0.06
        c.line((xa, 6.0), (xb, 6.0), lw=1.0)
        c.text((xa + xb) / 2, 5.6, f"block {b}: k_b", size=8)
        c.text(
            (xa + xb) / 2,
            5.05,
            ["0.1", "2.3", "0.0", "1.7", "0.4"][b],
            size=8.5,
            weight="bold" if b in kept else "normal",
        )
    c.text(
        0.4,
        4.4,
        "k_b = RoPE(k_layernorm(mean of the block's raw keys)) at its first "
        "position;  score s_b = Σ_h relu(q_h · k_b) / √d",
        ha="left",
        size=8.5,
    )
    c.text(
        0.4,
        3.8,
        "(index_qk_proj gives indexer_n_heads query heads and one key; q_layernorm, k_layernorm)",
        ha="left",
        size=8.5,
    )
    c.text(x0 + t_q * w + 0.4, 7.35, "query", size=8.5)
    c.box(0.9, 2.7, 0.6, 0.4, "", MIXER)
    c.text(
        1.4,
        2.7,
        "kept: the top indexer_budget / r blocks it sees completely (here 2)",
        ha="left",
        size=8.5,
    )
    c.box(0.9, 2.1, 0.6, 0.4, "", "#fed7aa")
    c.text(
        1.4,
        2.1,
        "kept: the tail, every token after the last complete block, up to the query",
        ha="left",
        size=8.5,
    )
    c.box(0.9, 1.5, 0.6, 0.4, "", "#f3f4f6", edge="#9ca3af")
    c.text(
        1.4,
        1.5,
        "masked out: the gated attention (chapter 5) reads only the kept tokens;"
        " at most budget + r − 1 of them",
        ha="left",
        size=8.5,
    )
    return c.svg()


def ch06_streams() -> str:
    c = Canvas(20.4, 11.2, "Gated residual streams: n = hc_count streams around each sublayer")
    n = 4
    ys = [9.4 - 0.75 * s for s in range(n)]
    for s, y in enumerate(ys):
        c.arrow((0.6, y), (19.8, y), lw=1.6)
        c.text(0.4, y + 0.25, f"h_{s + 1}", ha="left", size=9, family="DejaVu Sans Mono")
        c.ax.plot([2.2], [y], "o", color="#374151", ms=3.5)
        c.plus(18.4, y, r=0.2)
    c.line((2.2, ys[0]), (2.2, 5.6))
    c.arrow((2.2, 5.6), (2.2, 5.3))
    c.box(2.4, 4.8, 3.4, 1.0, "norm\nper stream: ĥ_s", NORM, size=8.5)
    c.arrow((4.1, 4.8), (4.9, 4.8))
    c.box(
        7.3,
        4.8,
        4.8,
        1.6,
        "read gate\ninput_mix_weight_down, _up\nx = mean_s(sigmoid(·)_s ⊙ ĥ_s)",
        OP,
        size=8.2,
    )
    c.arrow((9.7, 4.8), (10.5, 4.8))
    c.box(12.1, 4.8, 3.2, 1.0, "sublayer\n(mixer or mlp)", MIXER, size=9)
    c.arrow((13.7, 4.8), (14.5, 4.8))
    c.text(14.1, 5.1, "y", size=10, family="DejaVu Sans Mono")
    c.box(
        16.6,
        4.8,
        4.2,
        1.6,
        "write gate\nblock_inject_weight\n2 sigmoid(·)_s in (0, 2)",
        OP,
        size=8.2,
    )
    c.arrow((2.4, 4.3), (2.4, 3.3), (16.6, 3.3), (16.6, 4.0))
    c.text(9.5, 3.0, "the write gate reads the normalised streams too", size=8.5)
    c.line((18.7, 4.8), (18.4, 4.8), (18.4, 5.6))
    c.arrow((18.4, 5.6), (18.4, ys[-1] - 0.2))
    c.text(18.2, 6.3, "× its weight,\nto each stream", ha="right", size=8)
    c.text(
        0.4,
        2.0,
        "h_s ← h_s + 2 sigmoid(W_inj [ĥ_1 … ĥ_n] / n)_s · y: every stream gets "
        "the output, each with its own weight",
        ha="left",
        size=8.5,
    )
    c.text(
        0.4,
        1.4,
        "the gates replace input_layernorm and post_attention_layernorm; after the "
        "last layer one more read (hyper_connection_mixer)",
        ha="left",
        size=8.5,
    )
    c.text(
        0.4, 0.8, "feeds the head; all streams start as the token's embedding", ha="left", size=8.5
    )
    return c.svg()


# --- chapter 7: one round of speculative decoding ---------------------------------------------


def ch07_speculative() -> str:
    c = Canvas(17, 8.6, "Chapter 7: one round of speculative decoding (greedy, k = 3)")
    xs = [3.2, 5.4, 7.6, 9.8]
    # the draft proposes k tokens after the pending token t
    c.text(0.4, 7.1, "draft", size=9.5, ha="left", weight="bold")
    c.box(xs[0], 7.1, 1.5, 0.7, "t", STATE)
    for i, x in enumerate(xs[1:], 1):
        c.box(x, 7.1, 1.5, 0.7, f"d{i}", LINEAR)
        c.arrow((xs[i - 1] + 0.75, 7.1), (x - 0.75, 7.1), color=GREY)
    c.text(11.0, 7.1, "a cheap guesser: a small model,\nor the model's own MTP head",
           size=8.5, ha="left", color="#374151")  # fmt: skip
    # the model runs once over [t, d1, d2, d3]
    c.box(6.5, 5.4, 9.2, 0.8, "the model: one pass over [t, d1, d2, d3]", MIXER, mono=False)
    for x in xs:
        c.arrow((x, 6.75), (x, 5.8))
    targets = ["y0", "y1", "y2", "y3"]
    for x, y in zip(xs, targets, strict=True):
        c.arrow((x, 5.0), (x, 4.25))
        c.box(x, 3.9, 1.5, 0.7, y, OP)
    c.text(11.0, 3.9, "y_i: the model's argmax after input i", size=8.5, ha="left")
    # compare: d1 == y0, d2 == y1, d3 != y2
    marks = [("d1 = y0", "#15803d"), ("d2 = y1", "#15803d"), ("d3 ≠ y2", "#b91c1c")]
    for (label, colour), x in zip(marks, xs, strict=False):
        c.text(x + 1.1, 2.85, label, size=9, color=colour)
    # the result: kept drafts plus one token of the model's own
    c.text(0.4, 1.5, "kept", size=9.5, ha="left", weight="bold")
    c.box(xs[0], 1.5, 1.5, 0.7, "t", STATE)
    c.box(xs[1], 1.5, 1.5, 0.7, "d1", LINEAR)
    c.box(xs[2], 1.5, 1.5, 0.7, "d2", LINEAR)
    c.box(xs[3], 1.5, 1.5, 0.7, "y2", NEW)
    c.text(11.0, 1.75, "n = 2 drafts kept, then y2, the model's correction", size=8.5, ha="left")
    c.text(11.0, 1.2, "(all kept: y3, the bonus token)", size=8.5, ha="left")
    c.text(11.0, 0.55, "cache: rolled back to before + 1 + n", size=8.5, ha="left",
           color="#9a3412")  # fmt: skip
    return c.svg()


DIAGRAMS = {
    "ch00_model.svg": ch00_model,
    "ch01_gqa.svg": ch01_gqa,
    "ch02_qk_norm.svg": ch02_qk_norm,
    "ch03_moe.svg": ch03_moe,
    "ch04_template.svg": ch04_template,
    "ch05_deltanet.svg": ch05_deltanet,
    "ch05_hybrid.svg": ch05_hybrid,
    "ch06_sparse_attention.svg": ch06_sparse_attention,
    "ch06_streams.svg": ch06_streams,
    "ch07_speculative.svg": ch07_speculative,
}


def drawn() -> dict[str, str]:
    """{file name: SVG text} of every diagram, drawn now."""
    with matplotlib.rc_context(RC):
        return {name: draw() for name, draw in DIAGRAMS.items()}


# --- the notebooks' attachments -------------------------------------------------------------------


def attachment_cells(nb: dict) -> dict[str, dict]:
    """{diagram file name: the markdown cell that shows it} for a notebook."""
    found = {}
    for cell in nb["cells"]:
        if cell.get("cell_type") != "markdown":
            continue
        text = "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]
        for name in DIAGRAMS:
            if f"(attachment:{name})" in text:
                found[name] = cell
    return found


def attachment(svg: str) -> dict:
    return {"image/svg+xml": base64.b64encode(svg.encode("utf-8")).decode("ascii")}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="change nothing; report what differs")
    p.add_argument("--embed", action="store_true", help="also update the notebooks' copies")
    args = p.parse_args(argv)
    svgs = drawn()
    problems = []
    OUT.mkdir(parents=True, exist_ok=True)
    for name, svg in svgs.items():
        path = OUT / name
        current = path.read_text(encoding="utf-8") if path.exists() else None
        if current != svg:
            if args.check:
                problems.append(f"{path.relative_to(ROOT)} differs from what the script draws")
            else:
                path.write_text(svg, encoding="utf-8")
                print(f"wrote {path.relative_to(ROOT)}")
    shown = set()
    for nb_path in sorted(SOLUTIONS.glob("ch*.ipynb")):
        nb = json.loads(nb_path.read_text(encoding="utf-8"))
        changed = False
        for name, cell in attachment_cells(nb).items():
            shown.add(name)
            want = {name: attachment(svgs[name])}
            if cell.get("attachments") != want:
                if args.check or not args.embed:
                    problems.append(
                        f"{nb_path.relative_to(ROOT)}: the attachment {name} is not "
                        "the file's: run python scripts/draw_diagrams.py --embed"
                    )
                else:
                    cell["attachments"], changed = want, True
        if changed:
            text = json.dumps(nb, indent=1, sort_keys=True, ensure_ascii=False) + "\n"
            nb_path.write_text(text, encoding="utf-8")
            print(f"embedded into {nb_path.relative_to(ROOT)}")
    problems += [f"no solution notebook shows {name}" for name in svgs if name not in shown]
    for problem in problems:
        print(problem, file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
