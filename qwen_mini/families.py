"""Model families: what the models sharing a tokenizer and a chat format have in common.

Each row of the architecture table (`qwen_mini.architectures`) names its family; a Hugging Face
repository name is mapped to its family here, by `family_of`, and nowhere else.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class Family:
    """What the models sharing a tokenizer and a chat format have in common."""

    name: str  # "qwen3", "qwen3_5": the vendored tokenizer folder, the template family
    title: str  # how messages name it: "Qwen3"
    repos: str  # regex of the Hugging Face repository names whose tokenizer this is
    special_ids: Mapping[str, int]  # control-token ids, as in the published tokenizer files
    # recommended sampling, from the model cards, by thinking on (True) or off (False)
    sampling: Mapping[bool, Mapping[str, float]]

    # regex of the repositories whose own chat template is the one vendored for the family
    template_repos: str = ""

    def owns(self, repo: str) -> bool:
        """Whether the repository name (with or without "Qwen/") is one of this family's."""
        return _matches(self.repos, repo)

    def template_is_exact_for(self, repo: str) -> bool:
        return _matches(self.template_repos or self.repos, repo)


def _matches(pattern: str, repo: str) -> bool:
    return re.match(rf"^(Qwen/)?({pattern})-", repo, re.IGNORECASE) is not None


QWEN3 = Family(
    "qwen3",
    "Qwen3",
    repos=r"Qwen1\.5|Qwen2|Qwen2\.5|Qwen3",  # one BPE and the same ids since Qwen1.5
    template_repos=r"Qwen3",  # Qwen2.5's own template differs (a default system prompt)
    special_ids={"<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645},
    sampling={
        True: dict(temperature=0.6, top_p=0.95, top_k=20, min_p=0.0),
        False: dict(temperature=0.7, top_p=0.8, top_k=20, min_p=0.0),
    },
)
QWEN3_5 = Family(
    "qwen3_5",
    "Qwen3.5",
    repos=r"Qwen3\.[56]",
    special_ids={
        "<|endoftext|>": 248044,
        "<|im_start|>": 248045,
        "<|im_end|>": 248046,
        "<think>": 248068,
        "</think>": 248069,
    },  # fmt: skip
    sampling={
        True: dict(temperature=1.0, top_p=0.95, top_k=20, presence_penalty=1.5),
        False: dict(temperature=1.0, top_p=1.0, top_k=20, presence_penalty=2.0),
    },
)
FAMILIES = {f.name: f for f in (QWEN3, QWEN3_5)}


def family_of(repo: str) -> Family | None:
    """The family whose tokenizer a Hugging Face repository name ("Qwen/Qwen2.5-7B") uses."""
    return next((f for f in FAMILIES.values() if f.owns(repo)), None)
