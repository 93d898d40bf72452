"""``KFAC`` under the trainers people run, the real packages (the ``[trainers]`` extra), on CPU.

PyTorch Lightning: ``configure_optimizers`` returns ``KFAC`` (and a scheduler); automatic
optimization passes ``step()`` a closure that runs the forward, ``zero_grad`` and the backward;
``accumulate_grad_batches``; its checkpoints (``ModelCheckpoint``) and ``fit(ckpt_path=...)``.
Hugging Face ``Trainer``: ``optimizers=(KFAC(model), scheduler)``, ``gradient_accumulation_steps``
(Accelerate wraps the optimizer and the scheduler), gradient clipping (on by default), its
checkpoints and ``train(resume_from_checkpoint=...)``.

Each run is compared with a control: a plain training loop on the same batches, one large batch
instead of accumulated micro-batches, and the uninterrupted run for a resumed one. The packages
are imported inside the tests (Lightning imports torchvision through torchmetrics), and the
tests skip where they are not installed or torchvision does not work with this torch.
"""

from __future__ import annotations

from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from helpers import seeded_batch, torchvision_problem
from torch import nn

from kfac_optim import KFAC

SAMPLES, BATCH = 64, 8
KFAC_ARGS: dict[str, Any] = dict(lr=0.1, momentum=0.9, factor_update_steps=1, decomposition_update_steps=3)


def trainer_package(name: str) -> ModuleType:
    """``import name``, or skip: not installed, or torchvision (which it may import) is broken here."""
    if torchvision_problem() is not None:
        pytest.skip("torchvision does not work with this torch: tests/project/test_install.py says why and the fix")
    return pytest.importorskip(name)


def classifier() -> nn.Sequential:
    """The same small classifier (seeded) for every run."""
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))


def data() -> tuple[torch.Tensor, torch.Tensor]:
    return seeded_batch((SAMPLES, 8), 3, seed=5)


def same_parameters(a: nn.Module, b: nn.Module) -> bool:
    return all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))


# -- PyTorch Lightning ------------------------------------------------------------------------


def lightning_run(pl: ModuleType, epochs: int, accumulate: int, root: Path, ckpt_path: Path | None = None) -> Any:
    """Fit a LightningModule with ``KFAC`` (+ StepLR per epoch); the module, the optimizer and the
    trainer. Every epoch's checkpoint is kept under ``root``."""

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = classifier()

        def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], index: int) -> torch.Tensor:
            x, y = batch
            return F.cross_entropy(self.net(x), y)

        def configure_optimizers(self) -> dict[str, Any]:
            optimizer = KFAC(self, **KFAC_ARGS)
            return {"optimizer": optimizer, "lr_scheduler": torch.optim.lr_scheduler.StepLR(optimizer, 1, 0.5)}

    module = Module()
    checkpoints = pl.callbacks.ModelCheckpoint(dirpath=root, save_top_k=-1, every_n_epochs=1)
    trainer = pl.Trainer(max_epochs=epochs, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, accumulate_grad_batches=accumulate, callbacks=[checkpoints],
                         default_root_dir=root)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(*data()), batch_size=BATCH)
    trainer.fit(module, loader, ckpt_path=ckpt_path)
    return module, trainer.optimizers[0], trainer


def test_lightning_automatic_optimization_with_accumulation_equals_the_plain_loop_and_resumes_exactly(
    tmp_path: Path,
) -> None:
    pl = trainer_package("pytorch_lightning")
    accumulate, epochs = 2, 2
    module, optimizer, _ = lightning_run(pl, epochs, accumulate, tmp_path / "straight")
    steps_per_epoch = SAMPLES // (BATCH * accumulate)
    assert isinstance(optimizer, KFAC) and optimizer.steps == epochs * steps_per_epoch

    # the control: the plain loop (zero_grad, the micro-batches' mean-loss backward, step) on the same batches
    model = classifier()
    control = KFAC(model, **KFAC_ARGS)
    scheduler = torch.optim.lr_scheduler.StepLR(control, 1, 0.5)
    x, y = data()
    for _ in range(epochs):
        for start in range(0, SAMPLES, BATCH * accumulate):
            control.zero_grad()
            for micro in range(start, start + BATCH * accumulate, BATCH):
                (F.cross_entropy(model(x[micro:micro + BATCH]), y[micro:micro + BATCH]) / accumulate).backward()
            control.step()
        scheduler.step()
    assert same_parameters(module.net, model)
    assert all(torch.equal(a.factors[k].running, b.factors[k].running)
               for a, b in zip(optimizer.blocks, control.blocks, strict=True) for k in ("A", "G"))

    # resume from the first epoch's checkpoint: the same parameters as the uninterrupted run
    (first,) = sorted((tmp_path / "straight").glob("epoch=0-*.ckpt"))
    resumed, resumed_optimizer, _ = lightning_run(pl, epochs, accumulate, tmp_path / "resumed", ckpt_path=first)
    assert resumed_optimizer.steps == optimizer.steps
    assert same_parameters(resumed.net, module.net)


# -- Hugging Face Trainer ---------------------------------------------------------------------


class ClassifierWithLoss(nn.Module):
    """A model as ``transformers.Trainer`` expects: keyword inputs, a dict with the loss."""

    def __init__(self) -> None:
        super().__init__()
        self.net = classifier()

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        logits = self.net(x)
        return {"loss": F.cross_entropy(logits, labels), "logits": logits}


class Samples(torch.utils.data.Dataset):
    def __init__(self) -> None:
        self.x, self.y = data()

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"x": self.x[index], "labels": self.y[index]}


def hf_run(transformers: ModuleType, out: Path, batch: int, accumulate: int, epochs: int,
           resume: Path | None = None) -> tuple[nn.Module, KFAC, Any]:
    """``Trainer(optimizers=(KFAC(model), LambdaLR))``, checkpoints every epoch; model, optimizer, scheduler."""
    model = ClassifierWithLoss()
    optimizer = KFAC(model, **KFAC_ARGS)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1 / (1 + step))
    args = transformers.TrainingArguments(
        output_dir=str(out), per_device_train_batch_size=batch, gradient_accumulation_steps=accumulate,
        num_train_epochs=epochs, save_strategy="epoch", report_to=[], use_cpu=True, seed=0, data_seed=0,
        logging_strategy="no", disable_tqdm=True, dataloader_num_workers=0,
    )
    trainer = transformers.Trainer(model=model, args=args, train_dataset=Samples(), optimizers=(optimizer, scheduler))
    trainer.train(resume_from_checkpoint=str(resume) if resume else None)
    return model, optimizer, scheduler


def test_hf_trainer_accumulation_equals_one_large_batch_steps_the_scheduler_per_step_and_resumes_exactly(
    tmp_path: Path,
) -> None:
    transformers = trainer_package("transformers")
    trainer_package("accelerate")  # Trainer's own dependency
    epochs, accumulate = 2, 2
    model, optimizer, scheduler = hf_run(transformers, tmp_path / "accumulated", BATCH, accumulate, epochs)
    steps = epochs * SAMPLES // (BATCH * accumulate)
    assert optimizer.steps == steps and scheduler.last_epoch == steps  # one scheduler step per optimizer step
    assert optimizer.param_groups[0]["lr"] == pytest.approx(KFAC_ARGS["lr"] / (1 + steps))
    assert all(bool(block.factors["A"].initialized) for block in optimizer.blocks)

    # the control: one batch of BATCH * accumulate samples per step (the same samples: the same seeded sampler)
    large, _, _ = hf_run(transformers, tmp_path / "large", BATCH * accumulate, 1, epochs)
    for p, q in zip(model.parameters(), large.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)

    # resume from the first epoch's checkpoint: the same parameters as the uninterrupted run
    first = tmp_path / "accumulated" / f"checkpoint-{steps // epochs}"
    resumed, resumed_optimizer, _ = hf_run(transformers, tmp_path / "resumed", BATCH, accumulate, epochs, resume=first)
    assert resumed_optimizer.steps == steps
    assert same_parameters(resumed, model)
