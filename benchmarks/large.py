"""Full-size models for the GPU check, written here so nothing beyond torch and transformers is
needed (no torchvision): a ResNet-50 and a GPT-2 small. Their constructor arguments shrink them for
the check's CPU rehearsal (`scripts/gpu_check.py --rehearse`).

    deeppool plan benchmarks/large.py:ResNet50 --input-shape 3,224,224 ...
    deeppool plan benchmarks/large.py:GPT2Small --input-shape 128 --input-dtype int64 ...
"""

from __future__ import annotations

import torch
from torch import nn


class Bottleneck(nn.Module):
    """1x1, 3x3 (with the stride), 1x1 convolutions, each with BatchNorm; a projected skip where the
    shape changes (ResNet v1.5: the stride sits on the 3x3)."""

    def __init__(self, inputs: int, width: int, stride: int) -> None:
        super().__init__()
        outputs = 4 * width
        self.conv1 = nn.Conv2d(inputs, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, outputs, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(outputs)
        self.skip = (
            nn.Sequential(nn.Conv2d(inputs, outputs, 1, stride=stride, bias=False), nn.BatchNorm2d(outputs))
            if stride != 1 or inputs != outputs
            else nn.Identity()
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.bn1(self.conv1(x)))
        y = torch.relu(self.bn2(self.conv2(y)))
        return torch.relu(self.bn3(self.conv3(y)) + self.skip(x))


class ResNet50(nn.Module):
    """ResNet-50 (25.6M parameters at the defaults) for `classes` classes."""

    def __init__(self, width: int = 64, blocks: tuple[int, ...] = (3, 4, 6, 3), classes: int = 1000) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, width, 7, stride=2, padding=3, bias=False),
            nn.BatchNorm2d(width),
            nn.ReLU(),
            nn.MaxPool2d(3, stride=2, padding=1),
        )
        stages: list[nn.Module] = []
        inputs = width
        for index, count in enumerate(blocks):
            planes = width * 2**index
            for block in range(count):
                stages.append(Bottleneck(inputs, planes, stride=2 if block == 0 and index > 0 else 1))
                inputs = 4 * planes
        self.stages = nn.Sequential(*stages)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(inputs, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(self.pool(self.stages(self.stem(x))), 1))


class GPT2Small(nn.Module):
    """Hugging Face GPT-2 (124M parameters at the defaults, embedding tied to the head), randomly
    initialised from its config; forward takes token ids and returns logits."""

    def __init__(
        self, layers: int = 12, hidden: int = 768, heads: int = 12, vocab: int = 50257, positions: int = 1024
    ) -> None:
        super().__init__()
        from transformers import GPT2Config, GPT2LMHeadModel

        config = GPT2Config(
            n_layer=layers,
            n_embd=hidden,
            n_head=heads,
            vocab_size=vocab,
            n_positions=positions,
            bos_token_id=vocab - 1,
            eos_token_id=vocab - 1,
            use_cache=False,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
        )
        self.model = GPT2LMHeadModel(config)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids).logits
