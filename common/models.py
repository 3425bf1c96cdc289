"""The models of the real built-in jobs: a byte-level decoder-only transformer (`lm`) and a small
ResNet with BatchNorm (`resnet`). Plain torch modules, built the same on every machine from their
sizes: nothing here is sent or loaded from the network.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F

# Named sizes of the language model: (width, layers, heads). Parameter counts at context 128,
# with the byte embedding tied to the output layer: ~0.8M, ~3.2M, ~12.7M and ~51M.
LM_SIZES = {
    "tiny": (128, 4, 4),
    "small": (256, 4, 4),
    "medium": (384, 7, 6),
    "large": (512, 16, 8),
}


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention, then a 4x MLP, each added back."""

    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.norm2 = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(c, dim=2)
        shape = (b, t, self.heads, c // self.heads)
        q, k, v = (z.view(shape).transpose(1, 2) for z in (q, k, v))
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attended.transpose(1, 2).reshape(b, t, c))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class ByteTransformer(nn.Module):
    """Next-byte prediction over 256 byte values; the output layer shares the embedding's weights."""

    def __init__(self, context: int, width: int, layers: int, heads: int):
        super().__init__()
        if width % heads:
            raise ValueError(f"width {width} is not a multiple of heads {heads}")
        self.context = context
        self.embed = nn.Embedding(256, width)
        self.position = nn.Parameter(torch.zeros(context, width))
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(width)
        self.apply(self._init)
        nn.init.normal_(self.position, std=0.02)
        # GPT-2's scaling: each residual branch's last layer is shrunk by the depth
        for block in self.blocks:
            for last in (block.proj, block.down):
                nn.init.normal_(last.weight, std=0.02 / math.sqrt(2 * layers))

    @staticmethod
    def _init(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        t = tokens.shape[1]
        x = self.embed(tokens) + self.position[:t]
        for block in self.blocks:
            x = block(x)
        return self.norm(x) @ self.embed.weight.t()


def byte_loss(model: nn.Module, windows: torch.Tensor) -> torch.Tensor:
    """Mean next-byte cross-entropy (nats) of windows of context+1 bytes."""
    windows = windows.long()
    logits = model(windows[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), windows[:, 1:].reshape(-1))


class BasicBlock(nn.Module):
    def __init__(self, inputs: int, outputs: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(inputs, outputs, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(outputs)
        self.conv2 = nn.Conv2d(outputs, outputs, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(outputs)
        self.shortcut = nn.Sequential()
        if stride != 1 or inputs != outputs:
            self.shortcut = nn.Sequential(nn.Conv2d(inputs, outputs, 1, stride, bias=False),
                                          nn.BatchNorm2d(outputs))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


class ResNet(nn.Module):
    """A CIFAR-style ResNet: a 3x3 stem, three stages of `depth` basic blocks (widths w, 2w, 4w,
    the last two halving the resolution), global average pooling, a linear classifier."""

    def __init__(self, channels: int, classes: int, width: int = 16, depth: int = 1):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(channels, width, 3, 1, 1, bias=False),
                                  nn.BatchNorm2d(width), nn.ReLU())
        stages, inputs = [], width
        for k, outputs in enumerate((width, 2 * width, 4 * width)):
            for i in range(depth):
                stages.append(BasicBlock(inputs, outputs, 2 if (i == 0 and k > 0) else 1))
                inputs = outputs
        self.stages = nn.Sequential(*stages)
        self.head = nn.Linear(inputs, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stages(self.stem(x))
        return self.head(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))
