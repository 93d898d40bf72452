"""One training run: build its parts, train epoch by epoch, evaluate, record, checkpoint, resume.

The loop is the plain one every optimizer here supports: `zero_grad()`, forward under the
run's autocast, `backward()` (per micro-batch, DDP gradient sync only on the last one), `step()`
(through the GradScaler for fp16), LR scheduler step. A K-FAC run with `fisher: sampled` also
calls `sample_fisher` between each forward and backward (MSE for the autoencoder, cross-entropy
for classifiers). Losses are means over the micro-batch,
divided by `accum_steps`, so a step's gradient is the mean over the global batch.

Rank 0 writes `run_dir/metrics.jsonl` (one record per epoch, see `report`), `run_dir/config.yaml`
(the resolved run) and `run_dir/checkpoint.pt` (after every epoch); every rank trains.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Iterator
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
import yaml
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel
from torch.optim.lr_scheduler import LRScheduler
from tqdm import tqdm

from examples.training import data as data_lib
from examples.training.config import RunConfig, SetupError, TrainConfig
from examples.training.mixed_precision import Precision, check_supported
from examples.training.models import build_network, is_reconstruction
from examples.training.optimizers import build_lr_scheduler, build_optimizer, kfac_kwargs
from examples.training.process_group import DistEnv, all_reduce_max, all_reduce_sum, barrier
from examples.training.report import Record, append_record, write_records
from kfac_optim import KFAC

CHECKPOINT = "checkpoint.pt"
METRICS = "metrics.jsonl"
# Settings a resumed run may change; anything else must match the checkpoint's run.
RESUMABLE_CHANGES = frozenset({"epochs", "time_budget_s", "device", "threads", "checkpoint", "eval_batch_size"})


def micro_batch_size(train: TrainConfig, world_size: int) -> int:
    """Per-rank micro-batch: the global batch split over ranks and accumulation steps."""
    parts = world_size * train.accum_steps
    if train.batch_size % parts:
        raise SetupError(f"train.batch_size={train.batch_size} must be divisible by world size ({world_size}) "
                         f"x train.accum_steps ({train.accum_steps})")
    return train.batch_size // parts


def preflight(run: RunConfig, env: DistEnv) -> None:
    """Fail before any training for what would fail later: batch split, AMP mode, K-FAC options."""
    micro_batch_size(run.train, env.world_size)
    check_supported(run.train.amp, env.device)
    if run.optim.name == "kfac":
        kfac_kwargs(run.optim.kfac, steps_per_epoch=1)


@dataclass
class _Progress:
    """What a checkpoint restores: epochs done, their records, the training time so far."""

    epoch: int = 0
    time_s: float = 0.0
    history: list[Record] = dataclasses.field(default_factory=list)


class Trainer:
    """Trains one run on this rank; `run()` returns its per-epoch records."""

    def __init__(self, run: RunConfig, env: DistEnv, run_dir: Path) -> None:
        self.cfg, self.env, self.run_dir = run, env, run_dir
        tc = run.train
        if tc.threads:
            torch.set_num_threads(tc.threads)
        torch.manual_seed(tc.seed)
        self.reconstruction = is_reconstruction(run.model)
        datasets = data_lib.load_datasets(run.data)
        pin = env.device.type == "cuda"
        self.train_loader = data_lib.train_loader(datasets, micro_batch_size(tc, env.world_size), env.rank,
                                                  env.world_size, tc.seed, run.data.workers, pin)
        eval_batch = max(1, tc.eval_batch_size // env.world_size)
        eval_sets = {"train": datasets.train, "test": datasets.test} if self.reconstruction else {"test": datasets.test}
        self.eval_loaders = {
            split: data_lib.eval_loader(dataset, datasets.in_memory, eval_batch, env.rank, env.world_size,
                                        run.data.workers, pin)
            for split, dataset in eval_sets.items()
        }
        self.steps_per_epoch = len(self.train_loader) // tc.accum_steps
        if self.steps_per_epoch == 0:
            raise SetupError(f"run {run.name!r}: train.batch_size={tc.batch_size} is larger than the "
                             f"training set ({len(datasets.train)} examples)")
        self.model: nn.Module = build_network(run.model, datasets.input_shape, datasets.num_classes).to(env.device)
        self.precision = Precision(tc.amp, env.device)
        self._warm_up()
        optimizer = build_optimizer(run.optim, self.model, self.steps_per_epoch)
        self.model, self.optimizer = self.precision.initialize(self.model, optimizer)
        self.ddp: nn.Module = self.model
        if env.world_size > 1:
            device_ids = [env.device.index] if env.device.type == "cuda" else None
            self.ddp = DistributedDataParallel(self.model, device_ids=device_ids)
        self.likelihood = "mse" if self.reconstruction else "cross_entropy"
        self.samples_fisher = run.optim.name == "kfac" and run.optim.kfac.get("fisher") == "sampled"
        self.scheduler: LRScheduler = build_lr_scheduler(run.schedule, self.optimizer, self.steps_per_epoch,
                                                         tc.epochs)

    def _warm_up(self) -> None:
        """One untimed forward/backward (eval mode: no BN statistics change; gradients dropped).

        Pays torch's one-time costs (thread pools, kernel selection) outside the timed epochs,
        so that the first of several runs in one process is not charged for them.
        """
        x, y = next(self._micro_batches())
        self.model.eval()
        with self.precision.autocast():
            out = self.model(x)
        self._loss(out, x, y).backward()
        self.model.zero_grad(set_to_none=True)
        self.model.train()

    # ---- one epoch ---------------------------------------------------------------------------

    def _micro_batches(self) -> Iterator[tuple[Tensor, Tensor]]:
        device = self.env.device
        for x, y in self.train_loader:
            yield x.to(device, non_blocking=True), y.to(device, non_blocking=True)

    def _loss(self, out: Tensor, x: Tensor, y: Tensor) -> Tensor:
        if self.reconstruction:
            return F.mse_loss(out.float(), x.flatten(1))
        return F.cross_entropy(out.float(), y, label_smoothing=self.cfg.train.label_smoothing)

    def _train_epoch(self, epoch: int, bar: tqdm) -> tuple[dict[str, float], float]:
        """Train one epoch; returns its training metrics and its duration on the slowest rank."""
        tc, env = self.cfg.train, self.env
        self.ddp.train()
        data_lib.set_epoch(self.train_loader, epoch)
        sums = torch.zeros(3, device=env.device)  # loss * n, correct, n
        batches = self._micro_batches()
        clock = time.process_time if tc.clock == "cpu" else time.perf_counter
        self._synchronize()
        start = clock()
        for _ in range(self.steps_per_epoch):
            self.optimizer.zero_grad(set_to_none=True)
            for micro in range(tc.accum_steps):
                x, y = next(batches)
                last = micro == tc.accum_steps - 1
                sync = nullcontext() if last or env.world_size == 1 else self.ddp.no_sync()
                with sync:
                    with self.precision.autocast():
                        out = self.ddp(x)
                    if self.samples_fisher:
                        self.optimizer.sample_fisher(out, self.likelihood)
                    loss = self._loss(out, x, y)
                    self.precision.backward(loss / tc.accum_steps, self.optimizer, last)
                sums[0] += loss.detach() * len(x)
                if not self.reconstruction:
                    sums[1] += (out.argmax(1) == y).sum()
                sums[2] += len(x)
            self.precision.step(self.optimizer)
            self.scheduler.step()
            bar.update()
        self._synchronize()
        seconds = all_reduce_max(clock() - start, env)
        loss_sum, correct, count = all_reduce_sum(sums, env).tolist()
        metrics = {"train_loss": loss_sum / count}
        if not self.reconstruction:
            metrics["train_acc"] = correct / count
        return metrics, seconds

    @torch.no_grad()
    def _evaluate(self) -> dict[str, float]:
        """Loss and accuracy on the test set (classifiers); MSE on the train and test sets (autoencoder)."""
        self.model.eval()
        metrics: dict[str, float] = {}
        for split, loader in self.eval_loaders.items():
            sums = torch.zeros(3, device=self.env.device)  # loss sum, correct, n
            for x, y in loader:
                x, y = x.to(self.env.device, non_blocking=True), y.to(self.env.device, non_blocking=True)
                with self.precision.autocast():
                    out = self.model(x).float()
                if self.reconstruction:
                    loss = F.mse_loss(out, x.flatten(1), reduction="none").mean(1).sum()
                    correct = torch.zeros((), device=self.env.device)
                else:
                    loss = F.cross_entropy(out, y, reduction="sum")
                    correct = (out.argmax(1) == y).sum().float()
                sums += torch.stack([loss, correct, torch.tensor(float(len(x)), device=self.env.device)])
            loss_sum, correct_sum, count = all_reduce_sum(sums, self.env).tolist()
            if self.reconstruction:
                metrics[f"{split}_mse"] = loss_sum / count
            else:
                metrics.update({f"{split}_loss": loss_sum / count, f"{split}_acc": correct_sum / count})
        return metrics

    def _synchronize(self) -> None:
        if self.env.device.type == "cuda":
            torch.cuda.synchronize(self.env.device)

    # ---- checkpoints -------------------------------------------------------------------------

    def _save(self, progress: _Progress) -> None:
        """Every rank builds the state, rank 0 writes it atomically. ``state_dict()`` never
        communicates; K-FAC's factors are made global first (every rank is here), so the
        checkpoint holds every rank's statistics since the last decomposition step too."""
        if isinstance(self.optimizer, KFAC):
            self.optimizer.synchronize_factors()
        state = {
            "run": self.cfg.to_dict(),
            "progress": dataclasses.asdict(progress),
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "precision": self.precision.state_dict(),
        }
        if self.env.is_main:
            path = self.run_dir / CHECKPOINT
            tmp = path.with_suffix(".tmp")
            torch.save(state, tmp)
            os.replace(tmp, path)
        barrier(self.env)

    def _load(self) -> _Progress:
        path = self.run_dir / CHECKPOINT
        if not path.is_file():
            return _Progress()
        state = torch.load(path, map_location=self.env.device, weights_only=False)  # our own file
        self._check_same_run(state["run"])
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.precision.load_state_dict(state["precision"])
        return _Progress(**state["progress"])

    def _check_same_run(self, saved: dict[str, Any]) -> None:
        current = self.cfg.to_dict()
        changed = sorted(f"{section}.{key}" for section, values in current.items() if isinstance(values, dict)
                         for key, value in values.items()
                         if value != saved.get(section, {}).get(key)
                         and not (section == "train" and key in RESUMABLE_CHANGES))
        if changed:
            raise SetupError(f"--resume: {self.run_dir / CHECKPOINT} was written by a different run "
                             f"(changed: {', '.join(changed)}); delete it or run without --resume")

    # ---- the run -----------------------------------------------------------------------------

    def _over_budget(self, progress: _Progress) -> bool:
        """Time budget spent? (`time_s` sums slowest-rank epochs, so every rank agrees.)"""
        budget = self.cfg.train.time_budget_s
        return budget is not None and progress.time_s >= budget

    def run(self, resume: bool) -> list[Record]:
        """Train to `train.epochs` (or the time budget), starting from the checkpoint when resuming."""
        tc, env = self.cfg.train, self.env
        progress = self._load() if resume else _Progress()
        metrics_path = self.run_dir / METRICS
        if env.is_main:
            write_records(metrics_path, progress.history)
            (self.run_dir / "config.yaml").write_text(yaml.safe_dump(self.cfg.to_dict(), sort_keys=False))
        bar = tqdm(total=tc.epochs * self.steps_per_epoch, initial=progress.epoch * self.steps_per_epoch,
                   desc=self.cfg.name, unit="step", disable=True if not env.is_main else None, dynamic_ncols=True)
        with bar:
            while progress.epoch < tc.epochs and not self._over_budget(progress):
                train_metrics, seconds = self._train_epoch(progress.epoch, bar)
                progress.time_s += seconds
                progress.epoch += 1
                steps = progress.epoch * self.steps_per_epoch
                record: Record = {
                    "epoch": progress.epoch, "step": steps, "lr": self.optimizer.param_groups[0]["lr"],
                    **train_metrics, **self._evaluate(),
                    "time_s": progress.time_s, "epoch_s": seconds, "step_s": seconds / self.steps_per_epoch,
                    "images_per_s": self.steps_per_epoch * tc.batch_size / seconds,
                }
                progress.history.append(record)
                if env.is_main:
                    append_record(metrics_path, record)
                    bar.set_postfix({tc.metric: f"{record[tc.metric]:.4f}", "loss": f"{record['train_loss']:.4f}"})
                if tc.checkpoint:
                    self._save(progress)
        return progress.history
