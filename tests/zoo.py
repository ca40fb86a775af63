"""Models and usage patterns nobody here wrote, for the drop-in equivalence tests (`test_zoo.py`).

Language models from Lightning's demos, Hugging Face `transformers` (built from small configs, nothing
downloaded) and `torch.nn`; a BatchNorm ResNet; and the ways Lightning projects call their models:
two forwards per step, a rank-0-only forward in `training_step` and in a callback, a model summary
with `example_input_array`, manual optimization with two optimizers, a dict of inputs, frozen, tied
and outside-forward parameters, trainable code before the planned module, sequence lengths and image
sizes that change from batch to batch. No dropout, SGD everywhere.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import Dataset, TensorDataset, default_collate

from models import CLASSES, MLP, Classifier, ConvNet, images

VOCAB, SEQ = 48, 10


def tokens(n: int, seed: int = 0, length: int = SEQ) -> TensorDataset:
    """`n` sequences of token ids and their next tokens."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (n, length + 1), generator=g)
    return TensorDataset(ids[:, :-1].contiguous(), ids[:, 1:].contiguous())


def masked_tokens(n: int, seed: int = 0) -> TensorDataset:
    """Token ids with a padding mask (random lengths) and per-token labels."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (n, SEQ), generator=g)
    lengths = torch.randint(SEQ // 2, SEQ + 1, (n, 1), generator=g)
    mask = (torch.arange(SEQ) < lengths).long()
    return TensorDataset(ids, mask, torch.randint(0, VOCAB, (n, SEQ), generator=g))


class OneShapePerBatch:
    """A collate function that gives the k-th batch the k-th of `sizes` (cycling) by `resize`: every
    batch its own shape, the same on every rank at each step, as multi-scale training picks an image
    size per step and random-length cropping a sequence length."""

    def __init__(self, resize: Callable[[Any, int], Any], sizes: tuple[int, ...]) -> None:
        self.resize, self.sizes, self.batches = resize, sizes, 0

    def __call__(self, samples: list[Any]) -> Any:
        size = self.sizes[self.batches % len(self.sizes)]
        self.batches += 1
        return self.resize(default_collate(samples), size)


def sequence_lengths() -> OneShapePerBatch:
    """Batches cut to 10, 6, 10, 13 tokens (at most their own length): a length seen before comes
    back, then a new one."""
    return OneShapePerBatch(
        lambda batch, t: [part[:, :t].contiguous() for part in batch], (SEQ, SEQ - 4, SEQ, SEQ + 3)
    )


def image_sizes() -> OneShapePerBatch:
    """Batches of 16x16 images resized to 16, 12, 16 and 20 pixels a side."""

    def resize(batch: list[torch.Tensor], size: int) -> list[torch.Tensor]:
        x, y = batch
        return [F.interpolate(x, size=(size, size), mode="bilinear", align_corners=False), y]

    return OneShapePerBatch(resize, (16, 12, 16, 20))


class LanguageModel(pl.LightningModule):
    """Next-token cross-entropy on (ids, targets) batches; SGD with momentum."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        ids, targets = batch
        return F.cross_entropy(self(ids).reshape(-1, VOCAB), targets.reshape(-1))

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.5, momentum=0.9)


class DemoTransformer(LanguageModel):
    """`lightning.pytorch.demos.Transformer`: encoder-decoder, masks built and cached in forward."""

    def __init__(self) -> None:
        super().__init__()
        from lightning.pytorch.demos import Transformer

        self.model = Transformer(vocab_size=VOCAB, ninp=32, nhead=2, nhid=32, nlayers=1, dropout=0.0)

    def forward(self, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return self.model(ids, targets)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        ids, targets = batch
        return F.nll_loss(self(ids, targets), targets.view(-1))


class GPT2(LanguageModel):
    """Hugging Face GPT-2 computing its own loss (``labels=``) inside forward; tied embedding and head."""

    def __init__(self) -> None:
        super().__init__()
        from transformers import GPT2Config, GPT2LMHeadModel

        config = GPT2Config(
            vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.0,
            embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False, bos_token_id=0, eos_token_id=0,
        )  # fmt: skip
        self.model = GPT2LMHeadModel(config)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> Any:
        return self.model(input_ids=ids, labels=labels)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        ids, _ = batch
        return self(ids, labels=ids).loss


class BERT(pl.LightningModule):
    """Hugging Face BERT masked LM with an attention-mask input."""

    def __init__(self) -> None:
        super().__init__()
        from transformers import BertConfig, BertForMaskedLM

        config = BertConfig(
            vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
            intermediate_size=64, max_position_embeddings=SEQ, hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
        )  # fmt: skip
        self.model = BertForMaskedLM(config)

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=ids, attention_mask=mask).logits

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        ids, mask, labels = batch
        return F.cross_entropy(self(ids, mask).reshape(-1, VOCAB), labels.reshape(-1))

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.5, momentum=0.9)


class Llama(LanguageModel):
    """A Llama-style decoder from Hugging Face: rotary embeddings, RMSNorm, grouped-query attention."""

    def __init__(self) -> None:
        super().__init__()
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2 * SEQ, use_cache=False,
        )  # fmt: skip
        self.model = LlamaForCausalLM(config)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=ids).logits


class CausalEncoder(LanguageModel):
    """`nn.TransformerEncoder` (batch_first) with a causal mask buffer and tied embedding and head."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 32)
        layer = nn.TransformerEncoderLayer(32, 2, 64, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(32, VOCAB, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(SEQ))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embed(ids), mask=self.mask))


def text_pairs(n: int, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """Samples as Hugging Face tokenizers give them: ids, attention mask, token types and a label; the
    first half unpadded (batches whose masks are all ones), the rest padded to random lengths."""
    g = torch.Generator().manual_seed(seed)
    lengths = [SEQ if i < n // 2 else int(torch.randint(SEQ // 2, SEQ, (), generator=g)) for i in range(n)]
    return [
        {
            "input_ids": torch.randint(0, VOCAB, (SEQ,), generator=g),
            "attention_mask": (torch.arange(SEQ) < length).long(),
            "token_type_ids": (torch.arange(SEQ) >= SEQ // 2).long(),
            "labels": torch.randint(0, 3, (), generator=g),
        }
        for length in lengths
    ]


class TextClassifier(pl.LightningModule):
    """Lightning's text-transformers example: a Hugging Face BERT sequence classifier called as
    ``self.model(**batch)`` on dict batches, its loss computed inside forward from ``labels``."""

    def __init__(self) -> None:
        super().__init__()
        from transformers import BertConfig, BertForSequenceClassification

        config = BertConfig(
            vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
            intermediate_size=64, max_position_embeddings=SEQ, hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0, num_labels=3,
        )  # fmt: skip
        self.model = BertForSequenceClassification(config)

    def forward(self, **inputs: torch.Tensor) -> Any:
        return self.model(**inputs)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self(**batch)[0]

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.5, momentum=0.9)


class LSTMLanguageModel(LanguageModel):
    """Embedding, two-layer LSTM, linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 24)
        self.lstm = nn.LSTM(24, 32, num_layers=2, batch_first=True)
        self.head = nn.Linear(32, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        hidden, _ = self.lstm(self.embed(ids))
        return self.head(hidden)


class BatchNormResNet(Classifier):
    """Convolutions with BatchNorm in two residual blocks, a linear head (compared with DDP)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())
        self.block1 = nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8))
        self.block2 = nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8))
        self.head = nn.Linear(8 * 8 * 8, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.stem(x)
        y = torch.relu(y + self.block1(y))
        y = torch.relu(y + self.block2(y))
        return self.head(y.flatten(1))


class SpectralNormMLP(Classifier):
    """A discriminator-style MLP whose hidden layers carry `parametrizations.spectral_norm`."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        norm = nn.utils.parametrizations.spectral_norm
        self.body = nn.Sequential(norm(nn.Linear(192, 32)), nn.ReLU(), norm(nn.Linear(32, 32)), nn.ReLU())
        self.head = nn.Linear(32, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x.flatten(1)))


class SpectralMixing(nn.Module):
    """A Fourier neural operator's spectral convolution: complex weights on the lowest modes of rfft2."""

    def __init__(self, channels: int, modes: int) -> None:
        super().__init__()
        self.modes = modes
        scale = 1 / channels
        self.weight = nn.Parameter(scale * torch.randn(channels, channels, modes, modes, dtype=torch.cfloat))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        f = torch.fft.rfft2(x)
        low = torch.einsum("bixy,ioxy->boxy", f[:, :, : self.modes, : self.modes], self.weight)
        out = torch.zeros_like(f)
        out[:, :, : self.modes, : self.modes] = low
        return torch.fft.irfft2(out, s=x.shape[-2:])


class FourierOperator(Classifier):
    """A lift, one Fourier block (spectral mixing plus a pointwise convolution) and a linear head."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.lift = nn.Conv2d(3, 8, 1)
        self.spectral = SpectralMixing(8, 3)
        self.pointwise = nn.Conv2d(8, 8, 1)
        self.head = nn.Linear(8 * 8 * 8, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lift(x)
        h = F.gelu(self.spectral(h) + self.pointwise(h))
        return self.head(h.flatten(1))


# ------------------------------------------------------------------------------------- patterns
class TwoViews(ConvNet):
    """Two forwards per step, on the input and on a flipped copy (a two-view / siamese loss)."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self(x), y) + 0.5 * F.cross_entropy(self(x.flip(-1)), y)


class RankZeroLogging(ConvNet):
    """Rank 0 alone calls the model in training_step, before and after the loss's forward."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        if self.global_rank == 0:
            with torch.no_grad():
                self.first_logits = self(x[:2])
        loss = F.cross_entropy(self(x), y)
        if self.trainer.is_global_zero:
            self.last_logits = self(x[:1]).detach()
        return loss


def own_longest(samples: list[Any]) -> list[torch.Tensor]:
    """Collate token ids, mask and labels (per token, or one per sequence) cut to the batch's own longest
    sequence, as most NLP loaders pad: the length differs between batches and, in one step, between
    ranks."""
    ids, mask, labels = default_collate(samples)
    length = int(mask.sum(1).max())
    return [part[:, :length].contiguous() if part.dim() > 1 else part for part in (ids, mask, labels)]


def labelled_lengths(n: int, seed: int = 3) -> TensorDataset:
    """For the zoo's `n` (16 per rank): token ids, a padding mask and one class per sequence, three
    samples per rank fewer, so that with batches of four the last batch holds one sample on each rank;
    under Lightning's shuffle (its seed, and this `seed`) the three ranks' last samples differ in
    length."""
    ids, mask, labels = masked_tokens(n - 3 * (n // 16), seed).tensors
    return TensorDataset(ids, mask, labels[:, 0] % CLASSES)


class MaskedMeanClassifier(pl.LightningModule):
    """Embeddings, a projection, the mean over the unpadded tokens and a linear classifier."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 16)
        self.proj = nn.Linear(16, 16)
        self.head = nn.Linear(16, CLASSES)

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        hidden = torch.tanh(self.proj(self.embed(ids))) * mask[..., None]
        return self.head(hidden.sum(1) / mask.sum(1, keepdim=True))

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        ids, mask, labels = batch
        return F.cross_entropy(self(ids, mask), labels)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.5)


def size_by_content(samples: list[Any]) -> list[torch.Tensor]:
    """Collate images resized to 12, 16 or 20 pixels a side by their labels: multi-scale batches whose
    size differs, in one step, between ranks."""
    x, y = default_collate(samples)
    size = 12 + 4 * (int(y.sum()) % 3)
    return [F.interpolate(x, size=(size, size), mode="bilinear", align_corners=False), y]


class BatchShapes(pl.Callback):
    """The per-sample shape of each training batch's first tensor, step by step."""

    def __init__(self) -> None:
        self.shapes: list[tuple[int, ...]] = []

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, *_: Any
    ) -> None:
        self.shapes.append(tuple(batch[0].shape[1:]))


class PredictionLogger(pl.Callback):
    """Logs sample predictions on rank 0 after every training epoch, as many callbacks do."""

    def __init__(self) -> None:
        self.logged: list[torch.Tensor] = []

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.is_global_zero:
            with torch.no_grad():
                self.logged.append(pl_module(images(2, seed=5).tensors[0]))


class WithSummary(ConvNet):
    """`example_input_array` with Lightning's model summary on: rank 0 calls the model at fit start."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.example_input_array = torch.zeros(2, 3, 8, 8)


class GAN(pl.LightningModule):
    """Manual optimization with two optimizers: the planned forward is the generator, the
    discriminator is called directly in training_step (its parameters are reduced over every rank)."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.generator = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 192))
        self.discriminator = nn.Sequential(nn.Linear(192, 32), nn.ReLU(), nn.Linear(32, 1))

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return self.generator(z)

    def training_step(self, batch: Any, batch_idx: int) -> None:
        real = batch[0].flatten(1)
        z = real[:, :8] * 0.5  # noise taken from the data: the same on one device and on many
        ones, zeros = torch.ones(len(real), 1), torch.zeros(len(real), 1)
        opt_g, opt_d = self.optimizers()
        self.toggle_optimizer(opt_g)
        g_loss = F.binary_cross_entropy_with_logits(self.discriminator(self(z)), ones)
        self.manual_backward(g_loss)
        opt_g.step()
        opt_g.zero_grad()
        self.untoggle_optimizer(opt_g)
        self.toggle_optimizer(opt_d)
        fake = self(z).detach()
        real_loss = F.binary_cross_entropy_with_logits(self.discriminator(real), ones)
        fake_loss = F.binary_cross_entropy_with_logits(self.discriminator(fake), zeros)
        self.manual_backward((real_loss + fake_loss) / 2)
        opt_d.step()
        opt_d.zero_grad()
        self.untoggle_optimizer(opt_d)

    def configure_optimizers(self) -> Any:
        return (
            torch.optim.SGD(self.generator.parameters(), lr=0.2, momentum=0.9),
            torch.optim.SGD(self.discriminator.parameters(), lr=0.2, momentum=0.9),
        )


class DictInput(Classifier):
    """forward takes a dict of two inputs (an image and a per-sample scale)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.head = nn.Linear(8 * 8 * 8, CLASSES)

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        features = torch.relu(self.conv(batch["image"])) * batch["scale"][:, None, None, None]
        return self.head(features.flatten(1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self({"image": x, "scale": x.mean((1, 2, 3)).sigmoid()}), y)


class FrozenBody(MLP):
    """The first hidden layer is frozen (fine-tuning)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.body[0].requires_grad_(False)


class PenalizedHead(MLP):
    """training_step uses the head's weight outside forward too (an L2 penalty on it)."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self(x), y) + 1e-2 * self.head.weight.pow(2).sum()


class StemThenBody(Classifier):
    """A trainable stem before the planned submodule (``DeepPoolStrategy(module="body")``)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.body = nn.Sequential(
            nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 8 * 8, CLASSES)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(torch.relu(self.stem(x)))


class ReservedNames(Classifier):
    """Submodules named as a `torch.fx.GraphModule`'s own attributes: ``graph``, ``meta``, ``code``."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.graph = nn.Conv2d(3, 8, 3, padding=1)
        self.meta = nn.Linear(8 * 8 * 8, 32)
        self.code = nn.Linear(32, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.code(torch.relu(self.meta(torch.relu(self.graph(x)).flatten(1))))


@dataclass
class Prediction:
    """A forward's result as a dataclass: logits and the features they came from."""

    logits: torch.Tensor
    features: torch.Tensor
    label: str = "prediction"


class ReturnsDataclass(ConvNet):
    """forward returns a dataclass (`Prediction`)."""

    def forward(self, x: torch.Tensor) -> Prediction:  # type: ignore[override]
        features = self.features(x)
        return Prediction(self.head(features.flatten(1)), features)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        out = self(x)
        return F.cross_entropy(out.logits, y) + 1e-3 * out.features.square().mean()


class ReturnsModelOutput(ConvNet):
    """forward returns Hugging Face's `ModelOutput` itself, built from keywords."""

    def forward(self, x: torch.Tensor) -> Any:
        from transformers.utils import ModelOutput

        return ModelOutput(logits=self.head(self.features(x).flatten(1)))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self(x)["logits"], y)


class ReentrantCheckpoint(ConvNet):
    """The second convolution under `torch.utils.checkpoint.checkpoint(..., use_reentrant=True)`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        hidden = checkpoint(self.features[2:], self.features[:2](x), use_reentrant=True)
        return self.head(hidden.flatten(1))


class PooledHeadCNN(Classifier):
    """The usual CNN ending: a stride-2 block with max pooling (`down`), then adaptive average
    pooling, flatten and a linear head; `down` is pinned split by height."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU())
        self.down = nn.Sequential(nn.Conv2d(8, 8, 3, stride=2, padding=1), nn.ReLU(), nn.MaxPool2d(2))
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.head = nn.Linear(8, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.flatten(self.pool(self.down(self.stem(x))), 1))


class NanoGPT(LanguageModel):
    """nanoGPT's shape handling: `b, t = ids.size()`, positions `arange(t)` and a causal mask for `t`
    made in forward, so every batch's own sequence length runs."""

    def __init__(self) -> None:
        super().__init__()
        self.tokens = nn.Embedding(VOCAB, 32)
        self.positions = nn.Embedding(2 * SEQ, 32)
        layer = nn.TransformerEncoderLayer(32, 2, 64, dropout=0.0, batch_first=True)
        self.blocks = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(32, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        _, t = ids.size()
        x = self.tokens(ids) + self.positions(torch.arange(t, device=ids.device))
        mask = nn.Transformer.generate_square_subsequent_mask(t, device=ids.device)
        return self.head(self.blocks(x, mask=mask, is_causal=True))


class CompiledBody(ConvNet):
    """`torch.compile` applied to a submodule in `__init__` (the eager backend: nothing to build)."""

    def __init__(self) -> None:
        super().__init__()
        self.features = torch.compile(self.features, backend="eager")


def image_text_pairs(n: int, seed: int = 0) -> TensorDataset:
    """`n` 8x8 images, each with a caption of token ids."""
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, 3, 8, 8, generator=g), torch.randint(0, VOCAB, (n, SEQ), generator=g))


class TwoTowers(pl.LightningModule):
    """CLIP-style: an image tower and a text tower, independent up to a contrastive loss over each
    rank's batch (so DDP, not one device, is the reference)."""

    def __init__(self) -> None:
        super().__init__()
        self.image = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 8 * 8, 16)
        )
        self.text = nn.Sequential(nn.Embedding(VOCAB, 16), nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 16))
        self.scale = nn.Parameter(torch.tensor(3.0))

    def forward(self, images: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return F.normalize(self.image(images), dim=-1), F.normalize(self.text(ids).mean(1), dim=-1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        image, text = self(*batch)
        logits = self.scale * image @ text.T
        labels = torch.arange(len(logits), device=logits.device)
        return (F.cross_entropy(logits, labels) + F.cross_entropy(logits.T, labels)) / 2

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


class InceptionNet(Classifier):
    """A stem, then an Inception-style block (1x1, 3x3 and pooled 1x1 branches, concatenated) and a
    linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU())
        self.one = nn.Sequential(nn.Conv2d(8, 4, 1), nn.ReLU())
        self.three = nn.Sequential(nn.Conv2d(8, 4, 1), nn.ReLU(), nn.Conv2d(4, 4, 3, padding=1), nn.ReLU())
        self.pooled = nn.Sequential(nn.AvgPool2d(3, 1, 1), nn.Conv2d(8, 4, 1), nn.ReLU())
        self.head = nn.Linear(12 * 8 * 8, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        return self.head(torch.cat([self.one(x), self.three(x), self.pooled(x)], 1).flatten(1))


class SwitchFFN(nn.Module):
    """A Switch-style mixture of experts: each token goes to the one expert its router scores highest
    (`nonzero()` picks its rows), scaled by that score."""

    def __init__(self, dim: int = 16, experts: int = 3) -> None:
        super().__init__()
        self.router = nn.Linear(dim, experts)
        self.experts = nn.ModuleList(
            nn.Sequential(nn.Linear(dim, 2 * dim), nn.ReLU(), nn.Linear(2 * dim, dim)) for _ in range(experts)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.reshape(-1, x.shape[-1])
        gate, choice = self.router(tokens).softmax(-1).max(-1)
        out = torch.zeros_like(tokens)
        for e, expert in enumerate(self.experts):
            rows = (choice == e).nonzero().squeeze(1)
            out[rows] = expert(tokens[rows]) * gate[rows, None]
        return out.reshape(x.shape)


class SwitchLanguageModel(LanguageModel):
    """Embedding, a residual top-1 mixture of experts, linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 16)
        self.moe = SwitchFFN()
        self.head = nn.Linear(16, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        return self.head(h + self.moe(h))


class PackedEncoder(nn.Module):
    """`pack_padded_sequence` before an LSTM: the last state of each sequence at its own length."""

    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(16, 16, batch_first=True)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        lengths = mask.sum(1).cpu()
        packed = nn.utils.rnn.pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False)
        _, (h, _) = self.lstm(packed)
        return h[-1]


class LongestOnly(nn.Module):
    """Cuts the batch to its longest real sequence (``t = int(mask.sum(1).max())``), then averages the
    projected embeddings over those ``t`` positions, padding included: the result depends on the
    batch's longest sequence, which DDP takes per rank."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        t = int(mask.sum(1).max())
        return torch.tanh(self.proj(x[:, :t])).mean(1)


class LongestPrefix(nn.Module):
    """Cuts the batch to its longest real sequence and returns the cut: its output's length is data."""

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return x[:, : int(mask.sum(1).max())]


class PrefixMean(nn.Module):
    """The mean over `LongestPrefix`'s positions, padding included: a fixed shape again."""

    def __init__(self) -> None:
        super().__init__()
        self.cut = LongestPrefix()

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.cut(x, mask).mean(1)


class SequenceClassifier(pl.LightningModule):
    """Embeddings, a sequence `encoder` given the padding mask, a projection and a classifier."""

    def __init__(self, encoder: nn.Module) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 16)
        self.encoder = encoder
        self.proj = nn.Linear(16, 16)
        self.head = nn.Linear(16, CLASSES)

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.proj(self.encoder(self.embed(ids), mask))))

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        ids, mask, labels = batch
        return F.cross_entropy(self(ids, mask), labels)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.5)


class CutsInForward(SequenceClassifier):
    """Slices the batch to its longest real sequence in its own forward, before anything else."""

    def __init__(self) -> None:
        super().__init__(MaskedMean())

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        t = int(mask.sum(1).max())
        return super().forward(ids[:, :t], mask[:, :t])


class MaskedMean(nn.Module):
    """The mean over the unpadded positions."""

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        weights = mask.unsqueeze(-1).to(x.dtype)
        return (x * weights).sum(1) / weights.sum(1).clamp(min=1.0)


@dataclass(frozen=True)
class Case:
    """One zoo entry: how to build it, its data, and per rank count it trains on (2, and 3 or 4 for
    some) the pins that mix widths."""

    model: Callable[[], pl.LightningModule]
    data: Callable[[int], Dataset]
    pins: dict[int, dict[str, Any]]
    reference: str = "single"  # "single": one device; "ddp": Lightning's DDP (batch statistics)
    trainer: dict[str, Any] = field(default_factory=dict)
    strategy: dict[str, Any] = field(default_factory=dict)
    callbacks: Callable[[], list[pl.Callback]] = list
    local_batch: int = 4
    probe: Callable[[], torch.Tensor] | None = None  # rank 0 alone predicts on it after fit
    compiled: bool = False  # given to fit as `torch.compile(model)`
    collate: Callable[[], Callable[[list[Any]], Any]] | None = None  # makes each loader's collate_fn
    data_parallel: bool = False  # no plan can mix widths (a graph break in forward itself)


def _pins(narrow: str, middle: str | None = None) -> dict[int, dict[str, int]]:
    """`narrow` at width 1, `middle` at width 2 on three ranks, everything else at full width; without
    `middle`, two ranks only (what three ranks add, a width between, the equivalence tests cover)."""
    two = {2: {"": 2, narrow: 1}}
    return two if middle is None else {**two, 3: {"": 3, narrow: 1, middle: 2}}


CASES: dict[str, Case] = {
    "demo-transformer": Case(DemoTransformer, tokens, _pins("model.decoder")),
    "hf-gpt2-loss-in-forward-tied-head": Case(GPT2, tokens, _pins("model.lm_head")),
    "hf-bert-attention-mask": Case(BERT, masked_tokens, _pins("model.cls")),
    "hf-text-classifier-dict-batch-as-keywords": Case(
        TextClassifier, text_pairs, _pins("model.classifier", "model.bert.encoder.layer.1")
    ),
    "hf-llama": Case(Llama, tokens, _pins("model.lm_head")),
    "transformer-encoder-causal-mask-tied": Case(CausalEncoder, tokens, _pins("head", "encoder.layers.1")),
    "lstm-language-model": Case(LSTMLanguageModel, tokens, _pins("head")),
    "resnet-batchnorm-vs-ddp": Case(
        BatchNormResNet,
        images,
        {2: {"": 2, "head": 1, "block2.0": 1}, 3: {"": 3, "head": 1, "block2.0": 2, "block1.0": 1}},
        reference="ddp",
    ),
    "spectral-norm-parametrization": Case(SpectralNormMLP, images, _pins("head", "body.2")),
    "fourier-operator-complex-weights": Case(FourierOperator, images, _pins("head", "spectral")),
    "two-forwards-per-step": Case(TwoViews, images, _pins("head", "features.2")),
    "two-forwards-accumulate": Case(
        TwoViews, images, _pins("head", "features.0"), trainer={"accumulate_grad_batches": 2}
    ),
    "rank-zero-forward-in-training-step": Case(RankZeroLogging, images, _pins("head", "features.2")),
    "rank-zero-callback-after-epoch": Case(
        ConvNet,
        images,
        _pins("head", "features.2"),
        trainer={"max_epochs": 2, "max_steps": -1},
        callbacks=lambda: [PredictionLogger()],
        probe=lambda: images(3, seed=6).tensors[0],
    ),
    "model-summary-example-input": Case(
        WithSummary, images, _pins("head", "features.2"), trainer={"enable_model_summary": True}
    ),
    "manual-optimization-gan": Case(GAN, images, _pins("generator.2", "generator.0")),
    "dict-input-two-tensors": Case(DictInput, images, _pins("head", "conv")),
    "frozen-layer": Case(FrozenBody, images, _pins("head", "body.2")),
    "parameter-used-outside-forward": Case(PenalizedHead, images, _pins("head", "body.2")),
    "forward-returns-a-dataclass": Case(ReturnsDataclass, images, _pins("head", "features.2")),
    "forward-returns-a-model-output": Case(ReturnsModelOutput, images, _pins("head", "features.2")),
    "reentrant-activation-checkpointing": Case(ReentrantCheckpoint, images, _pins("head", "features.2")),
    "cnn-pooled-head-block-split-by-height": Case(
        PooledHeadCNN,
        lambda n: images(n, size=(16, 16)),
        {
            2: {"": 2, "down": {"width": 2, "spatial": 2}, "head": 1},
            3: {"": 3, "stem": 2, "down": {"width": 3, "spatial": 3}, "head": 1},
        },
    ),
    "sequence-length-changes-between-batches": Case(
        NanoGPT,
        lambda n: tokens(n, length=SEQ + 3),
        _pins("head", "blocks.layers.1"),
        trainer={"max_steps": 4},
        collate=sequence_lengths,
    ),
    "hf-bert-sequence-length-changes-between-batches": Case(
        BERT,
        masked_tokens,
        _pins("model.cls", "model.bert.encoder.layer.1"),
        trainer={"max_steps": 4},
        collate=sequence_lengths,
    ),
    "image-size-changes-between-batches-split-by-height": Case(
        PooledHeadCNN,
        lambda n: images(n, size=(16, 16)),
        {
            2: {"": 2, "down": {"width": 2, "spatial": 2}, "head": 1},
            3: {"": 3, "stem": 2, "down": {"width": 3, "spatial": 3}, "head": 1},
        },
        trainer={"max_steps": 4},
        collate=image_sizes,
    ),
    "hf-bert-each-rank-pads-to-its-own-longest": Case(
        BERT,
        masked_tokens,
        _pins("model.cls", "model.bert.encoder.layer.1"),
        reference="ddp",
        callbacks=lambda: [BatchShapes()],
        collate=lambda: own_longest,
    ),
    "each-rank-pads-to-its-own-longest-short-last-batch": Case(
        MaskedMeanClassifier,
        labelled_lengths,
        {2: {"": 2, "head": 1}, 3: {"": 3, "head": 1, "proj": 2}},
        reference="ddp",
        trainer={"max_epochs": 1, "max_steps": -1},
        callbacks=lambda: [BatchShapes()],
        collate=lambda: own_longest,
    ),
    "image-size-differs-between-ranks-split-by-height": Case(
        PooledHeadCNN,
        lambda n: images(n, size=(16, 16)),
        {
            2: {"": 2, "down": {"width": 2, "spatial": 2}, "head": 1},
            3: {"": 3, "stem": 2, "down": {"width": 3, "spatial": 3}, "head": 1},
        },
        reference="ddp",
        callbacks=lambda: [BatchShapes()],
        collate=lambda: size_by_content,
    ),
    "fit-given-a-compiled-model": Case(ConvNet, images, _pins("head", "features.2"), compiled=True),
    "compiled-submodule": Case(CompiledBody, images, _pins("head", "features.2")),
    "submodules-named-like-graph-module-attributes": Case(ReservedNames, images, _pins("code", "meta")),
    "clip-towers-side-by-side-on-disjoint-ranks": Case(
        TwoTowers,
        image_text_pairs,
        {
            2: {"": 2, "image": {"ranks": [0]}, "text": {"ranks": [1]}},
            3: {"": 3, "image": {"ranks": [0, 1]}, "text": {"ranks": [2]}},
            4: {"image": {"ranks": [0, 1]}, "text.0": {"ranks": [2, 3]}, "text.1": {"ranks": [3]}},
        },
        reference="ddp",
    ),
    "inception-branches-side-by-side-on-disjoint-ranks": Case(
        InceptionNet,
        images,
        {
            2: {"": 2, "one": {"ranks": [0]}, "three": {"ranks": [1]}, "pooled": {"ranks": [1]}},
            3: {"": 3, "one": {"ranks": [0]}, "three": {"ranks": [1]}, "pooled": {"ranks": [2]}, "head": 2},
            4: {
                "": 4,
                "one": {"ranks": [0]},
                "three": {"ranks": [1, 2]},
                "pooled": {"ranks": [3]},
                "head": 1,
            },
        },
    ),
    "graph-break-top-1-expert-routing-nonzero": Case(SwitchLanguageModel, tokens, _pins("head", "embed")),
    "graph-break-packed-sequences-before-lstm": Case(
        lambda: SequenceClassifier(PackedEncoder()), labelled_lengths, _pins("head", "proj")
    ),
    "graph-break-slice-to-longest-sequence": Case(
        lambda: SequenceClassifier(LongestOnly()), labelled_lengths, _pins("head", "proj"), reference="ddp"
    ),
    "graph-break-whose-output-length-is-data": Case(
        lambda: SequenceClassifier(PrefixMean()), labelled_lengths, _pins("head", "proj"), reference="ddp"
    ),
    "graph-break-in-forward-itself-trains-data-parallel": Case(
        CutsInForward, labelled_lengths, _pins("head", "proj"), reference="ddp", data_parallel=True
    ),
    "trainable-code-before-planned-module": Case(
        StemThenBody, images, _pins("3", "0"), strategy={"module": "body"}
    ),
}
