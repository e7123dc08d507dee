"""Speed-ups for running a model, as one explicit step: `convert_for_runtime(model)`.

The blocks build every projection as a plain `nn.Linear`, and a model built by hand stays that
way. The loader (`qwen_mini.checkpoint.build_model`) applies this step to what it returns.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def linear_all_threads(x: torch.Tensor, weight: torch.Tensor, bias=None) -> torch.Tensor:
    """x [..., in] @ weight[out, in].T + bias, as F.linear, with every CPU thread in float32.

    In float32 on some CPUs (measured: a 2-core AMD EPYC), torch hands a product with one row
    (a decoding step) to a BLAS matrix-vector call that runs on one core, so the weights stream
    at half the speed the memory allows. Splitting the weight's rows into one block per thread
    and multiplying the blocks as a batch lets torch run them side by side: up to 2x faster for
    one row there, equal to F.linear up to float32 summation order. On an Intel Xeon, where the
    call already uses every core, it is 5-12 % slower (bench/README.md). bfloat16 already uses
    every thread.
    """
    if torch.compiler.is_compiling():  # a compiled graph picks its own kernels
        return F.linear(x, weight, bias)
    n = torch.get_num_threads()  # (and this call would break the graph)
    worth_it = x.device.type == "cpu" and x.dtype == torch.float32 and n > 1
    if not worth_it or weight.shape[0] % n or not weight.is_contiguous():
        return F.linear(x, weight, bias)
    rows = x.reshape(1, -1, x.shape[-1]).expand(n, -1, -1)  # [n, rows, in], no copy
    blocks = weight.view(n, -1, weight.shape[1])  # [n, out / n, in], no copy
    out = torch.bmm(rows, blocks.transpose(1, 2))  # [n, rows, out / n]
    out = out.transpose(0, 1).reshape(*x.shape[:-1], weight.shape[0])
    return out if bias is None else out + bias


class ThreadedLinear(nn.Linear):
    """nn.Linear multiplying with `linear_all_threads`: same parameters, same state dict."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear_all_threads(x, self.weight, self.bias)


def convert_for_runtime(model: nn.Module) -> nn.Module:
    """Make every plain nn.Linear of `model` a ThreadedLinear, in place; return the model.

    Only the class changes (same parameters, same state dict), so the result still loads,
    saves and compares like the model the blocks built.
    """
    for module in model.modules():
        if type(module) is nn.Linear:
            module.__class__ = ThreadedLinear
    return model
