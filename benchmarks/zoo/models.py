"""The zoo: tiny configs of real-library models (random weights, no downloads) and their data.

One place builds every real-library model the project measures or tests: ``python -m
benchmarks.zoo`` (the performance table) and ``tests/models/`` (coverage, padding, exact resume)
both read :data:`ZOO`. An entry builds its model from a config (never a checkpoint), draws a
synthetic batch of the right shape from a ``torch.Generator`` and scores it with a mean-reduced
scalar loss. Targets come from a fixed *teacher* (a constant rule seeded apart from the batch
generator), so every batch follows the same rule and a loss can fall:

- tokens: a fixed permutation of the vocabulary gives each token's successor;
- images (``IMAGE``² pixels unless an entry needs more, :data:`CHANNELS` channels,
  :data:`IMAGE_CLASSES` classes): one random colour per image (a level per channel from N(0, 1))
  plus pixel noise of std :data:`PIXEL_NOISE`; the label is the argmax of a fixed random linear map
  of the image's channel means (``C → classes``). A linear rule in 3 numbers that every pixel
  carries, and blind to position (a convnet's global pooling sees it as well as a ViT's tokens):
  a task the image models learn in a few dozen steps at batch 16, where a random projection of all
  pixels to 10 classes (the rule before) left every image model near chance in 20 steps. Small
  images keep the step cheap.
- diffusion: the noise added to a fixed smooth pattern of random amplitude.

A library that does not import leaves its entries out of :func:`available` (never an error); the
libraries are imported inside the builders only, so importing this module costs nothing.

Conventions: images are ``(B, C, H, W)`` float32 in ``[-1, 1]``-ish (standard normal); token ids
are ``(B, T)`` int64 with an all-ones ``attention_mask`` (what ``Trainer`` passes); every loss is a
mean over the batch (and over tokens or pixels where it has them). Dropout is off: a loss is a
function of the parameters and the batch, so runs compare bit for bit.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, SEQ, CLASSES, IMAGE, CHANNELS = 96, 16, 10, 16, 3
IMAGE_CLASSES, PIXEL_NOISE = 4, 0.5  # the image teacher's classes and the std of its pixel noise
TEACHER_SEED = 1234  # the teacher's rule is the same for every batch and every generator


@dataclass(frozen=True)
class ZooBatch:
    """One synthetic batch: ``model(*args, **kwargs)`` and the target its loss compares with.

    ``target``: class labels ``(B,)`` int64, next-token labels ``(B, T)`` int64, or a regression
    target shaped like the model's output.
    """

    args: tuple[torch.Tensor, ...]
    kwargs: dict[str, torch.Tensor] = field(default_factory=dict)
    target: torch.Tensor | None = None


@dataclass(frozen=True)
class ZooModel:
    """A zoo entry.

    ``name``: the registry key; ``family``: what kind of model (``"decoder"``, ``"encoder"``,
    ``"convnet"``, ``"vit"``, ``"unet"``, ``"dit"``, ``"ssm"``, ``"lora"``, ...); ``library``: the
    module whose import the entry needs; ``build()``: a fresh model with random weights (seed it
    yourself: builders draw from torch's global generator); ``batch(B, generator)``: a
    :class:`ZooBatch`; ``loss(model, batch)``: the mean-reduced scalar loss.
    """

    name: str
    family: str
    library: str
    build: Callable[[], nn.Module]
    batch: Callable[[int, torch.Generator], ZooBatch]
    loss: Callable[[nn.Module, ZooBatch], torch.Tensor]


# -- teachers and batches -----------------------------------------------------------------------


@functools.cache
def _transition_table(vocab: int) -> torch.Tensor:
    """The teacher of token data: ``next = table[prev]``, a fixed permutation of ``vocab`` ids."""
    return torch.randperm(vocab, generator=torch.Generator().manual_seed(TEACHER_SEED))


@functools.cache
def _projection(features: int, classes: int) -> torch.Tensor:
    """The teacher of image labels: ``label = argmax(x.flatten(1) @ P)``, ``P: (features, classes)``."""
    return torch.randn(features, classes, generator=torch.Generator().manual_seed(TEACHER_SEED))


def token_batch(batch_size: int, generator: torch.Generator, vocab: int = VOCAB, seq: int = SEQ) -> ZooBatch:
    """``input_ids (B, T)`` following the teacher's transitions from a random first token, an all-ones
    ``attention_mask``; the target is ``input_ids`` (Hugging Face shifts causal-LM labels itself)."""
    table = _transition_table(vocab)
    ids = torch.empty(batch_size, seq, dtype=torch.long)
    ids[:, 0] = torch.randint(vocab, (batch_size,), generator=generator)
    for t in range(1, seq):
        ids[:, t] = table[ids[:, t - 1]]
    return ZooBatch((), {"input_ids": ids, "attention_mask": torch.ones_like(ids)}, ids)


def token_class_batch(batch_size: int, generator: torch.Generator) -> ZooBatch:
    """Random ``input_ids (B, T)``; the label is the teacher's class of the second token."""
    ids = torch.randint(VOCAB, (batch_size, SEQ), generator=generator)
    return ZooBatch((), {"input_ids": ids, "attention_mask": torch.ones_like(ids)}, ids[:, 1] % CLASSES)


def image_batch(batch_size: int, generator: torch.Generator, size: int = IMAGE, channels: int = CHANNELS) -> ZooBatch:
    """Images ``(B, C, size, size)`` and the teacher's labels ``(B,)`` in ``range(IMAGE_CLASSES)``: a
    random colour plus pixel noise, labelled by a linear map of the channel means (module docstring)."""
    colour = torch.randn(batch_size, channels, 1, 1, generator=generator)
    x = colour + PIXEL_NOISE * torch.randn(batch_size, channels, size, size, generator=generator)
    return ZooBatch((x,), {}, (x.mean((2, 3)) @ _projection(channels, IMAGE_CLASSES)).argmax(-1))


def pixel_batch(batch_size: int, generator: torch.Generator) -> ZooBatch:
    """The same images as :func:`image_batch`, passed as ``pixel_values=`` (Hugging Face vision)."""
    images = image_batch(batch_size, generator)
    return ZooBatch((), {"pixel_values": images.args[0]}, images.target)


def denoising_batch(batch_size: int, generator: torch.Generator, size: int = 16, channels: int = CHANNELS,
                    class_labels: bool = False) -> ZooBatch:
    """A diffusion training batch: ``(noisy (B, C, S, S), timestep (B,))`` and the noise as target.

    The clean samples are the teacher's smooth pattern times a random amplitude, so the noise is
    predictable from the noisy sample; ``class_labels``: also ``class_labels (B,)`` (a DiT's condition).
    """
    pattern = _projection(channels * size * size, 1).reshape(1, channels, size, size)
    clean = pattern * torch.randn(batch_size, 1, 1, 1, generator=generator)
    noise = torch.randn(batch_size, channels, size, size, generator=generator)
    t = torch.randint(1000, (batch_size,), generator=generator)
    alpha = (1 - t.float() / 1000).reshape(-1, 1, 1, 1)
    kwargs = {"class_labels": torch.randint(CLASSES, (batch_size,), generator=generator)} if class_labels else {}
    return ZooBatch((alpha.sqrt() * clean + (1 - alpha).sqrt() * noise, t), kwargs, noise)


# -- losses -----------------------------------------------------------------------------------------


def _logits(output: Any) -> torch.Tensor:
    """A classifier's logits: a tensor, or a Hugging Face output's ``logits``."""
    return output if isinstance(output, torch.Tensor) else output.logits


def classification_loss(model: nn.Module, batch: ZooBatch) -> torch.Tensor:
    """Mean cross-entropy of the model's logits ``(B, classes)`` against ``batch.target (B,)``."""
    return F.cross_entropy(_logits(model(*batch.args, **batch.kwargs)), batch.target)


def causal_lm_loss(model: nn.Module, batch: ZooBatch) -> torch.Tensor:
    """Mean next-token cross-entropy over ``B·(T-1)`` positions: logits ``(B, T, V)``, position t predicts t+1."""
    logits = _logits(model(*batch.args, **batch.kwargs))
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), batch.target[:, 1:].flatten())


def seq2seq_loss(model: nn.Module, batch: ZooBatch) -> torch.Tensor:
    """A T5-style model reading the tokens and writing them again, shifted: the mean token cross-entropy."""
    logits = model(**batch.kwargs, decoder_input_ids=batch.target[:, :-1]).logits
    return F.cross_entropy(logits.flatten(0, 1), batch.target[:, 1:].flatten())


def denoising_loss(model: nn.Module, batch: ZooBatch) -> torch.Tensor:
    """Mean squared error of the predicted noise ``(B, C, S, S)`` (diffusers' ``.sample``)."""
    out = model(*batch.args, **batch.kwargs)
    return F.mse_loss(out if isinstance(out, torch.Tensor) else out.sample, batch.target)


# -- builders ------------------------------------------------------------------------------------


def _transformers_text(config_name: str, model_name: str, **config: Any) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        transformers = importlib.import_module("transformers")
        return getattr(transformers, model_name)(getattr(transformers, config_name)(**config))
    return build


_LLAMA = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)


def _peft_lora(base: Callable[[], nn.Module], targets: list[str], **config: Any) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        peft = importlib.import_module("peft")
        lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets, lora_dropout=0.0, **config)
        return peft.get_peft_model(base(), lora)
    return build


def _timm(name: str, **kwargs: Any) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        return importlib.import_module("timm").create_model(name, pretrained=False, num_classes=IMAGE_CLASSES,
                                                            drop_rate=0.0, drop_path_rate=0.0, **kwargs)
    return build


def _torchvision(name: str, **kwargs: Any) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        models = importlib.import_module("torchvision.models")
        return getattr(models, name)(weights=None, num_classes=IMAGE_CLASSES, **kwargs)
    return build


def _torchvision_vit() -> nn.Module:
    models = importlib.import_module("torchvision.models")
    return models.VisionTransformer(image_size=IMAGE, patch_size=4, num_layers=2, num_heads=2, hidden_dim=32,
                                    mlp_dim=64, num_classes=IMAGE_CLASSES)


def _torchvision_regnet() -> nn.Module:
    models = importlib.import_module("torchvision.models")
    widths = models.regnet.BlockParams.from_init_params(depth=4, w_0=8, w_a=8.0, w_m=2.0, group_width=8)
    return models.RegNet(widths, num_classes=IMAGE_CLASSES, stem_width=8)


def _unet() -> nn.Module:
    diffusers = importlib.import_module("diffusers")
    return diffusers.UNet2DModel(sample_size=8, in_channels=CHANNELS, out_channels=CHANNELS, layers_per_block=1,
                                 block_out_channels=(8, 16), norm_num_groups=4, attention_head_dim=4,
                                 down_block_types=("DownBlock2D", "AttnDownBlock2D"),
                                 up_block_types=("AttnUpBlock2D", "UpBlock2D"))


def _dit() -> nn.Module:
    diffusers = importlib.import_module("diffusers")
    model = diffusers.DiTTransformer2DModel(num_attention_heads=2, attention_head_dim=8, in_channels=CHANNELS,
                                           out_channels=CHANNELS, num_layers=2, sample_size=16, patch_size=4,
                                           norm_num_groups=1, num_embeds_ada_norm=CLASSES)
    for module in model.modules():  # classifier-free guidance's label dropout (10%, not in the config): off
        if hasattr(module, "dropout_prob"):
            module.dropout_prob = 0.0
    return model


def _entries() -> list[ZooModel]:
    lm, vision = causal_lm_loss, classification_loss
    text = _transformers_text
    gpt2 = text("GPT2Config", "GPT2LMHeadModel", vocab_size=VOCAB, n_positions=64, bos_token_id=0, eos_token_id=0,
                n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    llama = text("LlamaConfig", "LlamaForCausalLM", **_LLAMA)
    return [
        # transformers: decoders, encoders, vision, state space
        ZooModel("gpt2", "decoder", "transformers", gpt2, token_batch, lm),
        ZooModel("llama", "decoder", "transformers", llama, token_batch, lm),
        ZooModel("mistral", "decoder", "transformers", text("MistralConfig", "MistralForCausalLM", **_LLAMA),
                 token_batch, lm),
        ZooModel("gpt_neox", "decoder", "transformers",
                 text("GPTNeoXConfig", "GPTNeoXForCausalLM", vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                      num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=64),
                 token_batch, lm),
        ZooModel("bert", "encoder", "transformers",
                 text("BertConfig", "BertForSequenceClassification", vocab_size=VOCAB, hidden_size=32,
                      intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, max_position_embeddings=64,
                      num_labels=CLASSES, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0),
                 token_class_batch, vision),
        ZooModel("t5", "encoder-decoder", "transformers",
                 text("T5Config", "T5ForConditionalGeneration", vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64,
                      num_layers=1, num_decoder_layers=1, num_heads=2, decoder_start_token_id=0, dropout_rate=0.0),
                 token_batch, seq2seq_loss),
        ZooModel("hf_vit", "vit", "transformers",
                 text("ViTConfig", "ViTForImageClassification", image_size=IMAGE, patch_size=4, hidden_size=32,
                      intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, num_labels=IMAGE_CLASSES),
                 pixel_batch, vision),
        ZooModel("hf_swin", "vit", "transformers",
                 text("SwinConfig", "SwinForImageClassification", image_size=IMAGE, patch_size=2, embed_dim=16,
                      depths=[1, 1], num_heads=[1, 2], window_size=4, num_labels=IMAGE_CLASSES, drop_path_rate=0.0),
                 pixel_batch, vision),
        ZooModel("mamba", "ssm", "transformers",
                 text("MambaConfig", "MambaForCausalLM", vocab_size=VOCAB, hidden_size=32, state_size=8,
                      num_hidden_layers=2, expand=2, conv_kernel=4),
                 token_batch, lm),
        # timm
        ZooModel("timm_resnet18", "convnet", "timm", _timm("resnet18", layers=(1, 1, 1, 1), channels=(16, 32, 64, 128)),
                 image_batch, vision),
        ZooModel("timm_mobilenetv3", "convnet", "timm", _timm("mobilenetv3_small_050"), image_batch, vision),
        ZooModel("timm_convnext", "convnet", "timm",
                 _timm("convnext_atto", depths=(1, 1, 1, 1), dims=(16, 32, 64, 128)),
                 functools.partial(image_batch, size=32), vision),  # its stem and 3 downsamples divide by 32
        ZooModel("timm_efficientnet", "convnet", "timm", _timm("test_efficientnet"), image_batch, vision),
        ZooModel("timm_vit", "vit", "timm", _timm("vit_tiny_patch16_224", img_size=IMAGE, patch_size=4, depth=2,
                                                   embed_dim=32, num_heads=2), image_batch, vision),
        ZooModel("timm_swin", "vit", "timm",
                 _timm("swin_tiny_patch4_window7_224", img_size=IMAGE, patch_size=2, embed_dim=16, depths=(1, 1),
                       num_heads=(1, 2), window_size=4), image_batch, vision),
        # diffusers
        ZooModel("unet2d", "unet", "diffusers", _unet, functools.partial(denoising_batch, size=8), denoising_loss),
        ZooModel("dit", "dit", "diffusers", _dit, functools.partial(denoising_batch, class_labels=True),
                 denoising_loss),
        # torchvision
        ZooModel("tv_resnet18", "convnet", "torchvision", _torchvision("resnet18"), image_batch, vision),
        ZooModel("tv_mobilenet_v3_small", "convnet", "torchvision", _torchvision("mobilenet_v3_small", width_mult=0.25,
                                                                                   dropout=0.0),
                 image_batch, vision),
        ZooModel("tv_regnet", "convnet", "torchvision", _torchvision_regnet, image_batch, vision),
        ZooModel("tv_vit", "vit", "torchvision", _torchvision_vit, image_batch, vision),
        # peft
        ZooModel("lora_llama", "lora", "peft", _peft_lora(llama, ["q_proj", "v_proj"]), token_batch, lm),
        ZooModel("lora_gpt2", "lora", "peft", _peft_lora(gpt2, ["c_attn"], fan_in_fan_out=True), token_batch, lm),
    ]


ZOO: dict[str, ZooModel] = {entry.name: entry for entry in _entries()}

_REQUIRES = {"peft": ("peft", "transformers")}  # a library whose entries also build another's models


@functools.cache
def _imports(library: str) -> bool:
    try:
        importlib.import_module(library)
    except Exception:  # noqa: BLE001 (missing, or broken against this torch: either way not available)
        return False
    return True


def available(names: Collection[str] | None = None) -> list[str]:
    """The names of the entries whose libraries import here, in :data:`ZOO`'s order: of ``names``
    (None: every entry), importing only their libraries (timm, diffusers and peft take seconds)."""
    return [name for name, entry in ZOO.items() if (names is None or name in names)
            and all(_imports(library) for library in _REQUIRES.get(entry.library, (entry.library,)))]
