"""Linear layers whose weights oneDNN has laid out ahead of time for this CPU (PyTorch's `mkldnn`
operators, which torch.compile's freezing pass also packs CPU weights with). On a 2-core AMD EPYC this makes a
float32 SmolLM2-135M forward of 1 new token 1.4x faster and one of 9 tokens 1.8x faster, so that a
verify of 9 tokens costs 1.2 decode steps instead of 1.5 (docs/benchmarks.md, "Packed weights"):
the default path's matrix products at 2-17 rows are what made speculation expensive on CPUs. A loaded
drafter is packed too: one draft of the default drafter costs 0.08 of a decode step instead of 0.19
(docs/benchmarks.md, "The drafter on packed weights").
"""

from __future__ import annotations

import platform
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn


ONEDNN_ON_X86 = torch.backends.mkldnn.is_available() and platform.machine().lower() in ("x86_64", "amd64")


def can_pack(weight: torch.Tensor) -> bool:
    """Float32 weights on an x86 CPU: what was measured here (not bfloat16, not ARM)."""
    return ONEDNN_ON_X86 and weight.device.type == "cpu" and weight.dtype == torch.float32


def runs_packed(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `F.linear(x, weight)` may run through a packed copy of `weight`: not while autograd records
    (the packed operator has no backward), and only in float32 on an x86 CPU."""
    recording = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)
    return not recording and x.dtype == torch.float32 and can_pack(weight)


def pack(weight: torch.Tensor) -> torch.Tensor:
    """`weight` (out, in) laid out for oneDNN on this CPU (check `can_pack` first)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach())


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`F.linear` of float32 `x` through a `pack`ed weight."""
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, None if bias is None else bias.detach(),
                                              "none", [], "")


class PackedLinear(nn.Module):
    """`linear`'s forward through its packed weight. The dense weight stays as `weight` (tied input
    embeddings, the drafter's reduced LM head and `Drafter.start_from_target` read it) and runs the
    forward whenever the packed copy cannot: while autograd records (the packed operator has no
    backward) and once the model is cast to another dtype. A weight changed in place is packed again."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.weight, self.bias = linear.weight, linear.bias
        self.in_features, self.out_features = linear.in_features, linear.out_features  # as nn.Linear reads
        self.pack()

    def pack(self) -> None:
        self.packed = pack(self.weight)  # not a buffer: never saved or moved
        self.packed_from = (self.weight.data_ptr(), self.weight._version)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not runs_packed(x, self.weight):
            return F.linear(x, self.weight, self.bias)
        if self.packed_from != (self.weight.data_ptr(), self.weight._version):
            self.pack()
        return packed_linear(x, self.packed, self.bias)

    def dense(self) -> nn.Linear:
        """A plain `nn.Linear` over the same weight and bias."""
        linear = nn.Linear(self.weight.shape[1], self.weight.shape[0], bias=self.bias is not None, device="meta")
        linear.weight, linear.bias = self.weight, self.bias
        return linear

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, packed for oneDNN"


def replace_layers(model: nn.Module, wanted: Callable[[nn.Module], bool],
                   build: Callable[[nn.Module], nn.Module]) -> int:
    """Replace every module inside `model` that is `wanted` by `build(module)`; returns how many."""
    swaps = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
             if wanted(child)]
    for parent, name, child in swaps:
        setattr(parent, name, build(child))
    return len(swaps)


def pack_linear_layers(model: nn.Module) -> int:
    """Replace every plain `nn.Linear` inside `model` whose weight oneDNN can pack; returns how many."""
    return replace_layers(model, lambda m: type(m) is nn.Linear and can_pack(m.weight), PackedLinear)


def unpack_linear_layers(model: nn.Module) -> int:
    """Undo `pack_linear_layers`, back to `nn.Linear`s over the same weights (to time both paths)."""
    return replace_layers(model, lambda m: isinstance(m, PackedLinear), PackedLinear.dense)
