"""K-FAC in a script shaped like PyTorch's ImageNet example (pytorch/examples, ``imagenet/main.py``).

    python -m examples.recipes.imagenet --world-size 2 --epochs 3             # 2 CPU ranks (gloo), spawned
    python -m examples.recipes.imagenet --world-size 2 --epochs 6 --resume runs/imagenet/checkpoint.pth.tar
    python -m examples.recipes.imagenet --device cuda --world-size 4 --amp fp16 --arch resnet18 --image-size 224

What that script does, with the optimizer line changed to ``KFAC(model, ...)``: one process per
rank started by ``torch.multiprocessing.spawn``, ``DistributedDataParallel`` and a
``DistributedSampler``, a ``StepLR`` schedule stepped per epoch, validation every epoch (top-1
summed over the ranks), and a checkpoint written by rank 0 alone at the end of every epoch into
``--checkpoint-dir`` (runs/imagenet, git-ignored, by default), ``torch.save({'epoch', 'arch',
'state_dict', 'best_acc1', 'optimizer': optimizer.state_dict(), 'scheduler', 'scaler'})``,
copied to ``model_best.pth.tar`` when the accuracy is the best so far;
``--resume`` restores all of it. Mixed precision with ``torch.amp``: bf16 autocast, or fp16
autocast with a ``GradScaler`` (``scaler.step(optimizer)``, no change for K-FAC).

The data are synthetic images (``--train-size`` of them, a class-dependent pattern plus noise,
the same on every rank for ``--seed``) and the default model is a tiny CNN with BatchNorm
(``--arch tiny``; any ``torchvision.models`` name works too), so it runs in seconds on a laptop.
At the end every rank compares its parameters with rank 0's and rank 0 prints whether they are
bit-identical; the exit status is non-zero when they are not.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
from contextlib import nullcontext
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import kfac_optim

AMP_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
CHECKPOINT_DIR = Path("runs") / "imagenet"  # git-ignored, as examples.train's runs/<config name>


def interval(value: str) -> int | str:
    """``--factor-update-steps`` / ``--decomposition-update-steps``: an int >= 1, or "auto"."""
    return value if value == "auto" else int(value)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m examples.recipes.imagenet", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--arch", default="tiny", help="'tiny' (a small CNN) or a torchvision.models name")
    parser.add_argument("--epochs", type=int, default=3, help="total epochs (a resumed run continues to this)")
    parser.add_argument("-b", "--batch-size", type=int, default=32, help="global batch, split over the ranks")
    parser.add_argument("--lr", type=float, default=0.1, help="initial learning rate (StepLR: ×0.1 every 30 epochs)")
    parser.add_argument("--momentum", type=float, default=0.9, help="SGD's momentum")
    parser.add_argument("--wd", "--weight-decay", dest="weight_decay", type=float, default=1e-4,
                        help="weight decay (coupled, as SGD's)")
    parser.add_argument("--factor-update-steps", type=interval, default="auto", help="K-FAC's factor interval")
    parser.add_argument("--decomposition-update-steps", type=interval, default="auto",
                        help="K-FAC's decomposition interval")
    parser.add_argument("--amp", choices=["none", "bf16", "fp16"], default="none",
                        help="autocast dtype (fp16: with a GradScaler)")
    parser.add_argument("--resume", type=Path, help="a checkpoint.pth.tar to continue from")
    parser.add_argument("--checkpoint-dir", type=Path, default=CHECKPOINT_DIR,
                        help="where rank 0 writes checkpoints (runs/ is git-ignored)")
    parser.add_argument("--keep-checkpoints", action="store_true",
                        help="also keep every epoch's checkpoint as checkpoint-epoch<N>.pth.tar")
    parser.add_argument("--world-size", type=int, default=1, help="processes to spawn (ranks)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="cuda: NCCL, one GPU per rank")
    parser.add_argument("--dist-url", help="the ranks' rendezvous, as main.py's; when not given, a free TCP port here; "
                        "a file:// URL (a path that does not exist yet) needs no port")
    parser.add_argument("--dist-timeout", type=float, default=1800.0, help="process group timeout (seconds)")
    parser.add_argument("--seed", type=int, default=0, help="seed for the weights and the data")
    parser.add_argument("--image-size", type=int, default=16, help="image height and width (px)")
    parser.add_argument("--classes", type=int, default=4, help="classes of the synthetic images")
    parser.add_argument("--train-size", type=int, default=256, help="training images")
    parser.add_argument("--val-size", type=int, default=64, help="validation images")
    args = parser.parse_args(argv)
    if args.batch_size % args.world_size or args.val_size % args.world_size:
        parser.error(f"--batch-size and --val-size must be divisible by --world-size {args.world_size}")
    return args


def main(argv: list[str] | None = None) -> int:
    """Spawn ``--world-size`` ranks (or run in this process); 0 when every rank ends with rank 0's parameters."""
    args = parse_args(argv)
    if args.world_size == 1:
        return main_worker(0, args)
    if args.dist_url is None:
        with socket.socket() as free:  # a free port on this machine for the ranks' rendezvous
            free.bind(("127.0.0.1", 0))
            args.dist_url = f"tcp://127.0.0.1:{free.getsockname()[1]}"
    try:
        mp.spawn(spawned_worker, nprocs=args.world_size, args=(args,))
    except mp.ProcessExitedException:  # a rank's own check failed (rank 0 printed which)
        return 1
    return 0


def spawned_worker(rank: int, args: argparse.Namespace) -> None:
    """``main_worker`` as ``mp.spawn`` runs it: a non-zero status becomes the process's exit code."""
    status = main_worker(rank, args)
    if status:
        raise SystemExit(status)


def tiny_cnn(classes: int) -> nn.Module:
    """Conv-BN-ReLU twice, global pooling, a linear head: three K-FAC layers, BatchNorm on SGD's path."""
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(inplace=True),
        nn.Conv2d(8, 16, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU(inplace=True),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, classes),
    )


def build_model(arch: str, classes: int) -> nn.Module:
    if arch == "tiny":
        return tiny_cnn(classes)
    from torchvision import models  # only for torchvision architectures

    return models.__dict__[arch](num_classes=classes)


def synthetic_images(size: int, args: argparse.Namespace, seed: int) -> TensorDataset:
    """``size`` images ``(3, s, s)`` and labels: each class's fixed pattern plus unit noise (the same
    for the same ``args.seed`` and ``seed``, on every rank)."""
    generator = torch.Generator().manual_seed(args.seed)
    patterns = torch.randn(args.classes, 3, args.image_size, args.image_size, generator=generator)
    generator.manual_seed(args.seed * 1000 + seed)
    labels = torch.randint(0, args.classes, (size,), generator=generator)
    images = patterns[labels] + torch.randn(size, 3, args.image_size, args.image_size, generator=generator)
    return TensorDataset(images, labels)


def main_worker(rank: int, args: argparse.Namespace) -> int:
    """One rank's whole run: model, optimizer, data, ``--resume``, then train/validate/checkpoint per epoch."""
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // args.world_size))
    distributed = args.world_size > 1
    device = torch.device("cuda", rank) if args.device == "cuda" else torch.device("cpu")
    if args.device == "cuda":
        torch.cuda.set_device(device)
    if distributed:
        dist.init_process_group("nccl" if args.device == "cuda" else "gloo", init_method=args.dist_url,
                                world_size=args.world_size, rank=rank, timeout=timedelta(seconds=args.dist_timeout))
    torch.manual_seed(args.seed)
    model = build_model(args.arch, args.classes).to(device)
    if distributed:
        model = DistributedDataParallel(model, device_ids=[rank] if args.device == "cuda" else None)
    # optimizer = torch.optim.SGD(model.parameters(), args.lr, momentum=args.momentum, weight_decay=args.weight_decay)
    optimizer = kfac_optim.KFAC(model, args.lr, momentum=args.momentum, weight_decay=args.weight_decay,
                                factor_update_steps=args.factor_update_steps,
                                decomposition_update_steps=args.decomposition_update_steps)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=30, gamma=0.1)
    scaler = torch.amp.GradScaler(device.type, enabled=args.amp == "fp16")

    start_epoch, best_acc1 = 0, 0.0
    if args.resume:
        checkpoint = torch.load(args.resume, map_location=device)
        start_epoch, best_acc1 = checkpoint["epoch"], checkpoint["best_acc1"]
        (model.module if distributed else model).load_state_dict(checkpoint["state_dict"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        scheduler.load_state_dict(checkpoint["scheduler"])
        scaler.load_state_dict(checkpoint["scaler"])
        if rank == 0:
            print(f"=> loaded checkpoint '{args.resume}' (epoch {start_epoch})")

    train_set, val_set = synthetic_images(args.train_size, args, 1), synthetic_images(args.val_size, args, 2)
    train_sampler = DistributedSampler(train_set, seed=args.seed) if distributed else None
    val_sampler = DistributedSampler(val_set, shuffle=False) if distributed else None
    per_rank = args.batch_size // args.world_size
    train_loader = DataLoader(train_set, per_rank, shuffle=train_sampler is None, sampler=train_sampler,
                              generator=torch.Generator().manual_seed(args.seed), drop_last=True)
    val_loader = DataLoader(val_set, per_rank, sampler=val_sampler)

    for epoch in range(start_epoch, args.epochs):
        if train_sampler is not None:
            train_sampler.set_epoch(epoch)
        loss = train(train_loader, model, optimizer, scaler, device, args)
        acc1 = validate(val_loader, model, device, args)
        scheduler.step()
        is_best, best_acc1 = acc1 > best_acc1, max(acc1, best_acc1)
        if rank == 0:
            print(f"epoch {epoch + 1}/{args.epochs}  train loss (rank 0) {loss:.4f}  val acc@1 {acc1:.2f}%  "
                  f"K-FAC steps {optimizer.steps}")
            save_checkpoint({
                "epoch": epoch + 1,
                "arch": args.arch,
                "state_dict": (model.module if distributed else model).state_dict(),
                "best_acc1": best_acc1,
                "optimizer": optimizer.state_dict(),   # on rank 0 only, as in main.py
                "scheduler": scheduler.state_dict(),
                "scaler": scaler.state_dict(),
            }, is_best, args.checkpoint_dir, keep_epoch=epoch + 1 if args.keep_checkpoints else None)

    status = 0 if not distributed else ranks_agree(model, rank, args.world_size, device)
    if distributed:
        dist.barrier()  # every rank done with its collectives before any tears gloo down
        dist.destroy_process_group()  # the group itself goes with the DDP model at return
    return status


def train(loader: DataLoader, model: nn.Module, optimizer: kfac_optim.KFAC, scaler: torch.amp.GradScaler,
          device: torch.device, args: argparse.Namespace) -> float:
    """One epoch; the mean training loss of this rank's batches."""
    model.train()
    autocast = (torch.autocast(device.type, dtype=AMP_DTYPES[args.amp]) if args.amp != "none" else nullcontext())
    total, batches = torch.zeros((), device=device), 0
    for images, target in loader:
        images, target = images.to(device), target.to(device)
        with autocast:
            loss = F.cross_entropy(model(images), target)
        optimizer.zero_grad()
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        total += loss.detach().float()
        batches += 1
    return total.item() / max(batches, 1)


@torch.no_grad()
def validate(loader: DataLoader, model: nn.Module, device: torch.device, args: argparse.Namespace) -> float:
    """Top-1 accuracy (%) over the whole validation set, summed over the ranks."""
    model.eval()
    counts = torch.zeros(2, device=device)  # correct, seen
    for images, target in loader:
        images, target = images.to(device), target.to(device)
        counts += torch.stack([(model(images).argmax(1) == target).sum(), torch.tensor(len(target), device=device)])
    if args.world_size > 1:
        dist.all_reduce(counts)
    return 100.0 * counts[0].item() / max(counts[1].item(), 1.0)


def save_checkpoint(state: dict[str, Any], is_best: bool, directory: Path, keep_epoch: int | None) -> None:
    """``checkpoint.pth.tar`` (and ``model_best.pth.tar`` when best; ``checkpoint-epoch<N>.pth.tar`` to keep)."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "checkpoint.pth.tar"
    torch.save(state, path)
    if is_best:
        shutil.copyfile(path, directory / "model_best.pth.tar")
    if keep_epoch is not None:
        shutil.copyfile(path, directory / f"checkpoint-epoch{keep_epoch}.pth.tar")


def ranks_agree(model: nn.Module, rank: int, world_size: int, device: torch.device) -> int:
    """0 when every rank's parameters equal rank 0's bit for bit (rank 0 prints it), else 1."""
    params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    reference = params.clone()
    dist.broadcast(reference, src=0)
    agree = torch.tensor([int(torch.equal(params, reference))], device=device)
    dist.all_reduce(agree)
    if rank == 0:
        print(f"{world_size} ranks, parameters bit-identical on every rank: {int(agree) == world_size}")
    return 0 if int(agree) == world_size else 1


if __name__ == "__main__":
    raise SystemExit(main())
