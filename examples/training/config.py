"""Run configuration: the schema of a run, YAML files, and command-line overrides.

A config file holds the five sections of a run (`data`, `model`, `optim`, `schedule`, `train`),
optionally `name`, `extends` (another config file, relative to this one, merged underneath) and
`runs` (run name -> section overrides, for several runs compared in one job). Each run is the
file's sections with the run's overrides merged on top, then the command-line overrides.

This module knows nothing of torch, so `--help` and config validation stay fast.
"""

from __future__ import annotations

import copy
import dataclasses
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Union, get_args, get_origin, get_type_hints

import yaml


class SetupError(RuntimeError):
    """A run cannot be set up as configured (missing data, package or device); the message says why."""


def _opt(default: Any, help: str) -> Any:
    """A dataclass field with a help text (shown by `train.py --help`)."""
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: copy.deepcopy(default), metadata={"help": help})
    return field(default=default, metadata={"help": help})


def _check_choice(section: str, name: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{section}.{name} must be one of {', '.join(choices)}; got {value!r}")


DATASETS = ("digits", "cifar10", "imagenet", "synthetic")
MODELS = ("digits_cnn", "digits_gapcnn", "digits_autoencoder", "digits_vit", "resnet20", "resnet32", "resnet18",
          "resnet50")
OPTIMIZERS = ("sgd", "adamw", "kfac")
LR_SCHEDULES = ("constant", "step", "cosine")
AMP_MODES = ("none", "fp16", "bf16", "apex-O1", "apex-O2")
METRICS = ("test_acc", "test_loss", "train_mse", "test_mse")
DEVICES = ("auto", "cpu", "cuda")
CLOCKS = ("wall", "cpu")


@dataclass(frozen=True)
class DataConfig:
    """Where the examples come from."""

    name: str = _opt("digits", "digits | cifar10 | imagenet | synthetic")
    root: str = _opt("data", "cifar10: folder holding cifar-10-batches-py/; imagenet: folder holding train/ and val/")
    normalize: bool = _opt(True, "digits: standardize pixels with the training set's mean/std (else scale to [0, 1])")
    test_fraction: float = _opt(0.2, "digits: share of the fixed stratified test split")
    shape: str = _opt("imagenet", "synthetic: imagenet (3x224x224, 1000 classes) | cifar (3x32x32, 10 classes)")
    image_size: int = _opt(0, "synthetic: image side in pixels (0: the shape's own)")
    train_size: int = _opt(1024, "synthetic: number of training images (held in memory)")
    test_size: int = _opt(256, "synthetic: number of test images")
    workers: int = _opt(4, "cifar10/imagenet: DataLoader worker processes per rank")

    def __post_init__(self) -> None:
        _check_choice("data", "name", self.name, DATASETS)
        _check_choice("data", "shape", self.shape, ("imagenet", "cifar"))
        if not 0.0 < self.test_fraction < 1.0:
            raise ValueError(f"data.test_fraction must be in (0, 1); got {self.test_fraction}")


@dataclass(frozen=True)
class ModelConfig:
    """Which network is trained."""

    name: str = _opt("digits_cnn", " | ".join(MODELS))

    def __post_init__(self) -> None:
        _check_choice("model", "name", self.name, MODELS)


@dataclass(frozen=True)
class OptimConfig:
    """The optimizer and its hyper-parameters."""

    name: str = _opt("sgd", "sgd | adamw | kfac")
    lr: float = _opt(0.1, "peak learning rate (after warmup)")
    momentum: float = _opt(0.9, "sgd, kfac: momentum")
    dampening: float = _opt(0.0, "sgd, kfac: momentum dampening")
    nesterov: bool = _opt(False, "sgd, kfac: Nesterov momentum")
    weight_decay: float = _opt(0.0, "weight decay (decoupled for adamw)")
    betas: list[float] = _opt([0.9, 0.999], "adamw: (beta1, beta2)")
    eps: float = _opt(1e-8, "adamw: epsilon")
    kfac: dict[str, Any] = _opt(
        {},
        "kfac: keyword arguments of kfac_optim.KFAC (damping, kl_clip, factor_decay, "
        "factor_update_steps, decomposition_update_steps, method, fisher, ...; fisher: sampled makes the trainer call "
        "sample_fisher; update: {trust_region: lr_squared, ...} is an UpdateConfig); a value {initial: x, "
        "epochs: [e1, ...], gamma: g} is a schedule: x, multiplied by g at each epoch e_i (ints stay ints)",
    )

    def __post_init__(self) -> None:
        _check_choice("optim", "name", self.name, OPTIMIZERS)
        if self.lr < 0:
            raise ValueError(f"optim.lr must be >= 0; got {self.lr}")


@dataclass(frozen=True)
class ScheduleConfig:
    """The learning-rate schedule, stepped once per optimizer step."""

    kind: str = _opt("constant", "constant | step | cosine (after warmup)")
    warmup_epochs: float = _opt(0.0, "linear warmup length in epochs")
    warmup_start: float = _opt(0.0, "LR factor warmup starts from (0: lr/warmup_steps at the first step)")
    milestones: list[float] = _opt([], "step: epochs at which the LR is multiplied by gamma")
    gamma: float = _opt(0.1, "step: LR multiplier at each milestone")
    min_factor: float = _opt(0.0, "cosine: final LR as a fraction of lr")

    def __post_init__(self) -> None:
        _check_choice("schedule", "kind", self.kind, LR_SCHEDULES)
        if self.warmup_epochs < 0:
            raise ValueError(f"schedule.warmup_epochs must be >= 0; got {self.warmup_epochs}")


@dataclass(frozen=True)
class TrainConfig:
    """How long and how the run trains, and what counts as success."""

    epochs: int = _opt(10, "number of epochs")
    batch_size: int = _opt(64, "global batch per optimizer step (all ranks and accumulation steps together)")
    eval_batch_size: int = _opt(512, "global evaluation batch")
    accum_steps: int = _opt(1, "micro-batches accumulated per optimizer step")
    amp: str = _opt("none", " | ".join(AMP_MODES))
    label_smoothing: float = _opt(0.0, "cross-entropy label smoothing (classification)")
    seed: int = _opt(0, "seed for the initial weights and the data order (same for every run)")
    metric: str = _opt("test_acc", " | ".join(METRICS) + " (the one the table and plot report)")
    target: float | None = _opt(None, "metric value that counts as reached (time/epochs to it are reported)")
    time_budget_s: float | None = _opt(None, "stop after the epoch in which training time reaches this")
    device: str = _opt("auto", "auto (cuda when available) | cpu | cuda")
    threads: int = _opt(0, "torch intra-op threads per process (0: leave torch's default)")
    clock: str = _opt("wall", "training-time clock: wall | cpu (this process's CPU time: what an idle machine's "
                      "wall clock would show, robust to other jobs on a shared one; one process, threads=1)")
    checkpoint: bool = _opt(True, "save a checkpoint after every epoch (needed by --resume)")

    def __post_init__(self) -> None:
        _check_choice("train", "amp", self.amp, AMP_MODES)
        _check_choice("train", "metric", self.metric, METRICS)
        _check_choice("train", "device", self.device, DEVICES)
        _check_choice("train", "clock", self.clock, CLOCKS)
        for name in ("epochs", "batch_size", "eval_batch_size", "accum_steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"train.{name} must be >= 1; got {getattr(self, name)}")

    @property
    def higher_is_better(self) -> bool:
        """Whether the reported metric improves upward (accuracy) or downward (losses)."""
        return self.metric.endswith("_acc")


SECTIONS: dict[str, type] = {
    "data": DataConfig,
    "model": ModelConfig,
    "optim": OptimConfig,
    "schedule": ScheduleConfig,
    "train": TrainConfig,
}
_TOP_LEVEL = {"name", "extends", "runs", *SECTIONS}


@dataclass(frozen=True)
class RunConfig:
    """One training run: a name and its five sections."""

    name: str
    data: DataConfig
    model: ModelConfig
    optim: OptimConfig
    schedule: ScheduleConfig
    train: TrainConfig

    def to_dict(self) -> dict[str, Any]:
        """The run as plain data (for checkpoints and the resolved-config file)."""
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class Experiment:
    """A config file resolved into its runs."""

    name: str
    runs: tuple[RunConfig, ...]


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """Deep merge: mappings merge key by key, anything else in `over` replaces."""
    out = copy.deepcopy(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def _read(path: Path, seen: tuple[Path, ...] = ()) -> dict[str, Any]:
    """A config file's mapping with its `extends` chain merged underneath."""
    path = path.resolve()
    if path in seen:
        raise ValueError(f"config {path} extends itself (via {' -> '.join(map(str, seen))})")
    if not path.is_file():
        raise FileNotFoundError(f"config file not found: {path}")
    raw = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: a config must be a mapping, got {type(raw).__name__}")
    unknown = set(raw) - _TOP_LEVEL
    if unknown:
        raise ValueError(f"{path}: unknown top-level keys {sorted(unknown)}; allowed: {sorted(_TOP_LEVEL)}")
    parent = raw.pop("extends", None)
    if parent is None:
        return raw
    base = _read(path.parent / parent, (*seen, path))
    base.pop("name", None)
    return _merge(base, raw)


def parse_override(text: str) -> tuple[list[str], Any]:
    """`a.b.c=value` -> (["a", "b", "c"], value parsed as YAML)."""
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise ValueError(f"override {text!r} is not KEY=VALUE (e.g. optim.lr=0.05)")
    return key.strip().split("."), yaml.safe_load(value)


def _set(tree: dict[str, Any], path: list[str], value: Any) -> None:
    for key in path[:-1]:
        node = tree.setdefault(key, {})
        if not isinstance(node, dict):
            raise ValueError(f"cannot set {'.'.join(path)}: {key} is not a mapping")
        tree = node
    tree[path[-1]] = value


def _section(run: str, section: str, values: Any) -> Any:
    cls = SECTIONS[section]
    if values is None:
        values = {}
    if not isinstance(values, dict):
        raise ValueError(f"run {run!r}: section {section} must be a mapping, got {values!r}")
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = set(values) - names
    if unknown:
        raise ValueError(f"run {run!r}: unknown key(s) {section}.{', '.join(sorted(unknown))}; "
                         f"allowed: {', '.join(sorted(names))}")
    hints = get_type_hints(cls)
    return cls(**{key: _coerce(f"{section}.{key}", hints[key], value) for key, value in values.items()})


def _coerce(key: str, hint: Any, value: Any) -> Any:
    """Check a YAML value against a field's type; ints are accepted where floats are expected."""
    if get_origin(hint) in (Union, types.UnionType):
        if value is None and type(None) in get_args(hint):
            return None
        hint = next(arg for arg in get_args(hint) if arg is not type(None))
    base = get_origin(hint) or hint
    if base is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if base is float and isinstance(value, str):
        try:
            return float(value)  # YAML reads 5e-4 (no dot) as a string
        except ValueError:
            pass
    if not isinstance(value, base) or (base is int and isinstance(value, bool)):
        raise ValueError(f"{key} must be {getattr(base, '__name__', base)}; got {value!r}")
    return value


def load_experiment(path: str | Path, overrides: list[str] = (), only: list[str] | None = None) -> Experiment:
    """Resolve a config file into its runs.

    `overrides` are `KEY=VALUE` strings: `section.key=v` applies to every run, `run.section.key=v`
    to the run of that name only. `only` keeps the named runs, in that order.
    """
    path = Path(path)
    raw = _read(path)
    name = raw.pop("name", None) or path.stem
    run_specs = raw.pop("runs", None) or {raw.get("optim", {}).get("name", "sgd"): {}}
    if not isinstance(run_specs, dict):
        raise ValueError(f"{path}: runs must map run names to section overrides")
    for run_name in run_specs:
        if run_name in SECTIONS:
            raise ValueError(f"{path}: a run may not be named like a section ({run_name!r})")
    merged = {run: _merge(raw, spec or {}) for run, spec in run_specs.items()}
    for text in overrides:
        keys, value = parse_override(text)
        targets = list(merged) if keys[0] in SECTIONS else [keys[0]]
        if keys[0] not in SECTIONS:
            if keys[0] not in merged:
                raise ValueError(f"override {text!r}: {keys[0]!r} is neither a section "
                                 f"({', '.join(SECTIONS)}) nor a run ({', '.join(merged)})")
            keys = keys[1:]
        if len(keys) < 2 or keys[0] not in SECTIONS:
            raise ValueError(f"override {text!r} must name section.key (sections: {', '.join(SECTIONS)})")
        for run in targets:
            _set(merged[run], keys, value)
    if only:
        missing = [run for run in only if run not in merged]
        if missing:
            raise ValueError(f"{path}: no run named {', '.join(missing)}; runs: {', '.join(merged)}")
        merged = {run: merged[run] for run in only}
    runs = tuple(
        RunConfig(name=run, **{s: _section(run, s, spec.get(s)) for s in SECTIONS})
        for run, spec in merged.items()
    )
    return Experiment(name=name, runs=runs)


def describe_keys() -> str:
    """Every config key with its default and help text, for `--help`."""
    lines = []
    for section, cls in SECTIONS.items():
        for f in dataclasses.fields(cls):
            default = f.default_factory() if f.default is dataclasses.MISSING else f.default
            lines.append(f"  {section}.{f.name} = {default!r}\n      {f.metadata['help']}")
    return "\n".join(lines)
