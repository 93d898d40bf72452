"""The block registry: which ``KroneckerBlock`` class preconditions which module type, and discovery.

Owns: ``module type → block class`` (looked up along the module type's MRO, so subclasses of a
registered type share its block unless registered themselves or defining their own ``forward``:
:func:`forward_override`), with a per-call override (``blocks``, e.g. one optimizer's own)
consulted first; finding a model's blocks and setting their weight sharing (:func:`find_layers`);
saying for every module with trainable parameters what happens to them, from the state at the
time of asking (:class:`Discovery`).
Must not know: hooks, ranks, the step.

Built-in kinds are registered here the same way a user registers one::

    kfac_optim.register_block(MyLayer, MyBlock)   # MyBlock subclasses kfac_optim.layers.KroneckerBlock

or for one discovery only, leaving the registry alone: ``discover(model, blocks={MyLayer: MyBlock})``.
"""

from __future__ import annotations

import re
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from kfac_optim.diagnostics import warn_user
from kfac_optim.layers.base import KroneckerBlock, WeightSharing
from kfac_optim.layers.conv import ConvBlock
from kfac_optim.layers.conv_statistics import ConvStatistics
from kfac_optim.layers.declined import declined_reason, originals_reason

SkipLayers = Sequence[str | type[nn.Module]]
BlockOverrides = Mapping[type[nn.Module], type[KroneckerBlock]]

_REGISTRY: dict[type[nn.Module], type[KroneckerBlock]] = {}
_REGISTRY_BY_PATH: dict[str, type[KroneckerBlock]] = {}  # "package.module.Class" -> block class


def register_block(module_type: type[nn.Module], block_class: type[KroneckerBlock]) -> None:
    """Precondition modules of ``module_type`` (and its subclasses) with ``block_class``.

    Registering a type again replaces its block class (e.g. a user's block for a built-in type).
    Takes effect for optimizers created afterwards.

    Raises:
        TypeError: ``module_type`` is not an ``nn.Module`` subclass, or ``block_class`` not a
            ``KroneckerBlock`` subclass.
    """
    _check_pair(module_type, block_class, "module_type", "block_class")
    _REGISTRY[module_type] = block_class


def register_block_by_path(path: str, block_class: type[KroneckerBlock]) -> None:
    """Precondition modules of the class named ``path`` (``"package.module.ClassName"``, its
    ``__module__`` and ``__qualname__``) and its subclasses with ``block_class``, without importing
    that package: the name is matched along a module type's MRO at discovery, so a library that is
    not installed costs nothing. A type registered with :func:`register_block` is matched first.

    Raises:
        TypeError: ``path`` is not a dotted name, or ``block_class`` not a ``KroneckerBlock`` subclass.
    """
    if not isinstance(path, str) or "." not in path:
        raise TypeError(f"path must be a dotted 'package.module.ClassName', got {path!r}")
    _check_pair(nn.Module, block_class, "module_type", "block_class")
    _REGISTRY_BY_PATH[path] = block_class


def _registered(klass: type) -> type[KroneckerBlock] | None:
    """The registry's block class for ``klass`` itself: by type, else by its dotted name."""
    found = _REGISTRY.get(klass)
    return found if found is not None else _REGISTRY_BY_PATH.get(f"{klass.__module__}.{klass.__qualname__}")


def _check_pair(module_type: object, block_class: object, module_name: str, block_name: str) -> None:
    """Raise ``TypeError`` naming the argument unless ``module_type`` is an ``nn.Module`` subclass
    and ``block_class`` a ``KroneckerBlock`` subclass."""
    if not (isinstance(module_type, type) and issubclass(module_type, nn.Module)):
        raise TypeError(f"{module_name} must be a subclass of torch.nn.Module, got {module_type!r}")
    if not (isinstance(block_class, type) and issubclass(block_class, KroneckerBlock)):
        raise TypeError(f"{block_name} must be a subclass of kfac_optim.layers.KroneckerBlock, got {block_class!r}")


def check_block_overrides(blocks: BlockOverrides | None) -> None:
    """Raise ``TypeError`` naming the entry unless ``blocks`` is None or maps ``nn.Module``
    subclasses to ``KroneckerBlock`` subclasses."""
    if blocks is None:
        return
    if not isinstance(blocks, Mapping):
        raise TypeError(f"blocks must be a mapping from module types to block classes, got {type(blocks).__name__}")
    for module_type, block_class in blocks.items():
        name = getattr(module_type, "__name__", module_type)
        _check_pair(module_type, block_class, "blocks: a key", f"blocks[{name}]")


def unregister_block(module_type: type[nn.Module]) -> type[KroneckerBlock] | None:
    """Forget ``module_type``'s own registration, by type and by name (:func:`register_block_by_path`;
    its subclasses' and bases' stay); returns the block class it had, or None. Takes effect for
    optimizers created afterwards."""
    by_path = _REGISTRY_BY_PATH.pop(f"{module_type.__module__}.{module_type.__qualname__}", None)
    by_type = _REGISTRY.pop(module_type, None)
    return by_type if by_type is not None else by_path


def registered_blocks() -> dict[type[nn.Module], type[KroneckerBlock]]:
    """A copy of the registry."""
    return dict(_REGISTRY)


def block_kind(module: nn.Module, blocks: BlockOverrides | None = None) -> type[KroneckerBlock] | None:
    """The block class for ``module``: ``blocks``' for its type or nearest base in it, else the
    registry's for its type or nearest registered base; None when neither has one, or when the
    nearest one is a base's and a class in between overrides ``forward`` (:func:`forward_override`)."""
    found = _lookup(type(module), blocks)
    return None if found is None or found[1] is not None else found[0]


def forward_override(module: nn.Module,
                     blocks: BlockOverrides | None = None) -> tuple[type[nn.Module], type[nn.Module]] | None:
    """``(subclass, registered base)`` when ``module``'s type would inherit the block of a
    registered base but a class in between (``subclass``) defines its own ``forward``; None otherwise.

    A block describes what its module's ``forward`` computes from its input (``nn.Linear``'s
    ``x Wᵀ + b``): a subclass that overrides ``forward`` (muP's ``MuReadout`` divides its input by
    ``width_mult`` first) may compute something else, so the inherited block's statistics would be
    of the wrong input. Such a subclass gets a block only when registered itself
    (``register_block(Subclass, Block)`` or ``blocks={Subclass: Block}``)."""
    found = _lookup(type(module), blocks)
    if found is None or found[1] is None:
        return None
    return found[1], found[2]


def _lookup(
    module_type: type[nn.Module], blocks: BlockOverrides | None
) -> tuple[type[KroneckerBlock], type[nn.Module] | None, type[nn.Module]] | None:
    """``(block class, the class that overrides forward on the way to its base or None, that base)``."""
    for table in (blocks or {}, None):
        for klass in module_type.__mro__:
            block_class = table.get(klass) if table is not None else _registered(klass)
            if block_class is not None:
                overriding = next((c for c in module_type.__mro__[: module_type.__mro__.index(klass)]
                                   if "forward" in vars(c)), None)
                return block_class, overriding, klass
    return None


@dataclass(frozen=True)
class ModuleReport:
    """What K-FAC does with one module's own trainable parameters.

    ``block``: the name of the block that preconditions them (None: they take the SGD path);
    ``status``: "kfac", or why not: "skipped" (``skip_layers``), "unsupported" (a registered block
    that declines this instance, or a complex, parametrized or pruned layer: ``layers.declined``),
    "parametrization" (the originals of a parametrized weight), "unregistered" (no block for the
    type, or a subclass of a registered type that overrides ``forward``: :func:`forward_override`),
    "no_weight" (a registered kind whose weight is not among the optimizer's parameters), "added"
    (a module of a registered kind added to the model after the optimizer was built), "silent" (a
    block that received no statistics while others did: :data:`SILENT_REASON`), "outside"
    (the row :data:`OUTSIDE_THE_MODEL` of ``params`` that are not the model's);
    ``detail``: the block's kind and factor shapes, or the reason in words.
    """

    name: str
    kind: str
    params: tuple[tuple[str, tuple[int, ...]], ...]
    block: str | None
    status: str
    detail: str

    def __str__(self) -> str:
        params = ", ".join(f"{p} {'x'.join(map(str, shape)) or 'scalar'}" for p, shape in self.params)
        where = f"K-FAC [{self.block or '<root>'}]" if self.block is not None else "SGD"
        return f"{self.name or '<root>'} ({self.kind}; {params}): {where}: {self.detail}"


SILENT_REASON = ("no statistics recorded: its hooks never fired (its weight used through the parameter rather "
                 "than the module's forward, e.g. F.linear(x, layer.weight), or its output does not reach the loss); "
                 "it takes the SGD path until it records")
"""Why a block that never received statistics takes the SGD path (its report's detail)."""

OUTSIDE_THE_MODEL = "(outside the model)"
"""The report name of the trainable parameters that are not the model's (e.g. a loss's temperature)."""


def _outside_report(model: nn.Module, trainable: set[Tensor]) -> ModuleReport | None:
    """One row for the ``trainable`` parameters that are not ``model``'s (None: there are none)."""
    own = set(model.parameters())
    outside = sorted((p for p in trainable if p not in own), key=lambda p: tuple(p.shape))  # a set: by shape
    if not outside:
        return None
    params = tuple((f"[{i}]", tuple(p.shape)) for i, p in enumerate(outside))
    return ModuleReport(OUTSIDE_THE_MODEL, "Parameter", params, None, "outside",
                        "parameters in params that are not the model's (e.g. a loss's temperature or task "
                        "weights): no layer's statistics describe them; they take the SGD path")


def user_visible_name(name: str) -> str:
    """A module's name as the uncompiled model's ``state_dict()`` spells it (no ``_orig_mod.`` parts
    left by submodules wrapped with ``torch.compile``)."""
    return ".".join(part for part in name.split(".") if part != "_orig_mod")


def _is_skipped(name: str, module: nn.Module, skip_layers: SkipLayers) -> bool:
    for rule in skip_layers:
        if isinstance(rule, str):
            if re.fullmatch(rule, name) or re.fullmatch(rule, type(module).__name__):
                return True
        elif isinstance(module, rule):
            return True
    return False


class Discovery:
    """What :func:`find_layers` decided for a model's modules when the optimizer was built, and the
    report of what happens to every module's trainable parameters *now* (:meth:`reports`).

    ``blocks``: the blocks found (model order). The decisions are kept per module object, so a
    report made later follows the model as it is then: a layer replaced or added since (a new head)
    has no block and says so, a block left to SGD (``KroneckerBlock.sgd_reason``) says why, and the
    parameters listed are the trainable ones then.
    """

    def __init__(self, blocks: BlockOverrides | None) -> None:
        self.blocks: list[KroneckerBlock] = []
        self._overrides = blocks
        self._decisions: dict[nn.Module, tuple[str, str]] = {}  # modules given no block: (status, why)
        self._seen: weakref.WeakSet[nn.Module] = weakref.WeakSet()  # every module of the model then
        self._untied: set[nn.Module] = set()  # their uses of a tied weight are left out of the statistics
        self.forward_overrides: dict[type[nn.Module], type[nn.Module]] = {}  # subclass -> registered base

    def decide(self, module: nn.Module, status: str, detail: str) -> None:
        self._decisions[module] = (status, detail)

    def reports(self, model: nn.Module, trainable: set[Tensor],
                silent: Sequence[KroneckerBlock] = ()) -> list[ModuleReport]:
        """One :class:`ModuleReport` per module of ``model`` with parameters in ``trainable`` (and a
        row :data:`OUTSIDE_THE_MODEL` for those that are not ``model``'s), from the state now;
        ``silent``: blocks that never received statistics (status "silent": they take the SGD path)."""
        owner_of = {param: block for block in self.blocks for param in block.parameters()}
        created_by: dict[nn.Module, list[KroneckerBlock]] = {}
        for block in self.blocks:
            created_by.setdefault(block.module, []).append(block)
        reports = []
        for name, module in model.named_modules():
            own = [(p_name, p) for p_name, p in module.named_parameters(recurse=False) if p in trainable]
            if not own:
                continue
            owners = [owner_of[p] for _, p in own if p in owner_of]
            block: str | None = None
            created = created_by.get(module, [])
            left = next((b.sgd_reason for b in created if b.sgd_reason is not None), None)
            if left is not None:
                status, detail = "unsupported", left
            elif created and all(b in silent for b in created):
                status, detail = "silent", f"{'; '.join(b.describe() for b in created)}; {SILENT_REASON}"
            elif created:
                block, status = created[0].name, "kfac"
                detail = "; ".join(b.describe() for b in created)
            elif owners:  # its parameters belong to a block another module created (or tied)
                block, status = owners[0].name, "kfac"
                detail = f"preconditioned in block {block!r}: {owners[0].describe()}"
                if module in self._untied:
                    detail = (f"preconditioned in block {block!r} with that block's module's statistics only (this "
                              f"module's uses of the weight are left out): {owners[0].describe()}")
            elif module in self._decisions:
                status, detail = self._decisions[module]
            elif originals_reason(module) is not None:
                status, detail = "parametrization", originals_reason(module)
            elif module not in self._seen and _lookup(type(module), self._overrides) is not None:
                status, detail = "added", ("added to the model after KFAC was built (layers are found when it is "
                                           "built): no block, it takes the SGD path; build a new KFAC to "
                                           "precondition it")
            else:
                status, detail = "unregistered", f"no K-FAC block registered for {type(module).__name__}"
            leftover = [p_name for p_name, p in own if p not in owner_of]
            if block is not None and leftover:
                detail += f"; {', '.join(leftover)} take the SGD path"
            params = tuple((p_name, tuple(p.shape)) for p_name, p in own)
            reports.append(ModuleReport(name, type(module).__name__, params, block, status, detail))
        outside = _outside_report(model, trainable)
        if outside is not None:
            reports.append(outside)
        return reports


def find_layers(
    model: nn.Module,
    trainable: set[Tensor] | None = None,
    skip_layers: SkipLayers = (),
    factor_dtype: torch.dtype = torch.float32,
    blocks: BlockOverrides | None = None,
    weight_sharing: WeightSharing = "expand",
    conv_positions: ConvStatistics | None = None,
) -> Discovery:
    """The blocks of ``model`` and the decisions behind them (see :func:`discover`), with warnings:
    tied weights a block declines, weight sharing a block does not implement, and subclasses of
    registered types that override ``forward`` (:func:`forward_override`; one warning naming them).
    ``conv_positions`` (None: as ``weight_sharing`` says) is every convolution block's
    :attr:`ConvBlock.statistics`."""
    check_block_overrides(blocks)
    if trainable is None:
        trainable = {p for p in model.parameters() if p.requires_grad}
    found = Discovery(blocks)
    claimed: set[Tensor] = set()
    owner_of: dict[Tensor, KroneckerBlock] = {}
    untied: list[str] = []
    ignored_sharing: list[str] = []
    for name, module in model.named_modules():
        found._seen.add(module)
        kind = block_kind(module, blocks)
        if kind is None:
            override = forward_override(module, blocks)
            if override is not None and any(p in trainable for p in module.parameters(recurse=False)):
                subclass, base = override
                found.forward_overrides[subclass] = base
                found.decide(module, "unregistered", _override_reason(subclass, base))
            continue
        if _is_skipped(name, module, skip_layers):
            found.decide(module, "skipped", "skipped by skip_layers")
            continue
        reason = declined_reason(module) or kind.unsupported_reason(module)
        if reason is not None:
            found.decide(module, "unsupported", f"{kind.__name__}: {reason}")
            continue
        created = kind.create(user_visible_name(name), module, trainable, claimed, factor_dtype)
        weight = kind.weight_and_bias(module)[0] if not created else None
        owner = owner_of.get(weight) if weight is not None else None
        if owner is not None and owner.module is not module and not owner.tie(user_visible_name(name), module):
            found._untied.add(module)
            untied.append(f"'{user_visible_name(name)}' ({type(module).__name__}) shares the weight of block "
                          f"'{owner.name}' ({type(owner).__name__})")
        for block in created:
            for param in block.parameters():
                owner_of[param] = block
            if not block.set_weight_sharing(weight_sharing):
                ignored_sharing.append(f"'{block.name}' ({type(block).__name__})")
            if conv_positions is not None and isinstance(block, ConvBlock):
                block.statistics = conv_positions
        found.blocks.extend(created)
        if not created and owner is None:
            found.decide(module, "no_weight", "no block: its weight is not among the optimizer's parameters "
                                              "(or another block's); its other parameters take the SGD path")
    if untied:
        warn_user(
            "tied weights: " + "; ".join(untied) + ": the block cannot take the second module's uses into its "
            "statistics, which are its own module's only (an Embedding followed by a Linear head sharing its "
            "weight is supported; docs/numerics.md)"
        )
    if ignored_sharing:
        warn_user(
            f"CurvatureConfig(weight_sharing={weight_sharing!r}) is not implemented by the block(s) of "
            f"{', '.join(ignored_sharing)}: "
            "they make every use of the weight a row ('expand'; KroneckerBlock.supports_weight_sharing)"
        )
    if found.forward_overrides:
        warn_user("; ".join(_override_reason(sub, base) for sub, base in found.forward_overrides.items()))
    return found


def _override_reason(subclass: type[nn.Module], base: type[nn.Module]) -> str:
    """Why a subclass of a registered type that overrides ``forward`` takes the SGD path, and what to do."""
    return (f"{subclass.__qualname__} subclasses {base.__name__} but overrides forward: the block of {base.__name__} "
            f"describes {base.__name__}.forward's input, which may not be the input this forward multiplies the "
            f"weight with (e.g. muP's MuReadout divides it by width_mult), so its parameters take the SGD path. "
            f"If its forward is {base.__name__}.forward of the layer input, register it: "
            f"kfac_optim.register_block({subclass.__qualname__}, <{base.__name__}'s block, e.g. "
            f"kfac_optim.layers.LinearBlock>) or CurvatureConfig(blocks={{{subclass.__qualname__}: ...}}); else "
            f"register a KroneckerBlock of your own (docs/api.md, 'Block registry')")


def discover(
    model: nn.Module,
    trainable: set[Tensor] | None = None,
    skip_layers: SkipLayers = (),
    factor_dtype: torch.dtype = torch.float32,
    blocks: BlockOverrides | None = None,
    weight_sharing: WeightSharing = "expand",
    conv_positions: ConvStatistics | None = None,
) -> tuple[list[KroneckerBlock], list[ModuleReport]]:
    """The blocks of ``model`` (model order) and one report per module with trainable parameters.

    A module gets blocks when its type has a block class (in ``blocks``, else registered: see
    :func:`block_kind`; a subclass that overrides ``forward`` inherits none, :func:`forward_override`)
    that supports the instance, it is not skipped, and its parameters are in
    ``trainable`` (default: those that require grad) and not taken by an earlier block (a parameter
    shared by several modules belongs to the first). A module whose weight an earlier block took
    (tied weights) is offered to that block (:meth:`KroneckerBlock.tie`); if it declines, the
    module's uses of the weight are left out of the statistics, with a warning. Every block gets
    ``weight_sharing`` (:meth:`KroneckerBlock.set_weight_sharing`); blocks that do not implement
    it are named in a warning and in their reports. ``conv_positions`` (None: as ``weight_sharing``
    says) is then every convolution block's :attr:`ConvBlock.statistics`.

    Raises:
        TypeError: ``blocks`` does not map ``nn.Module`` subclasses to ``KroneckerBlock`` subclasses.
    """
    if trainable is None:
        trainable = {p for p in model.parameters() if p.requires_grad}
    found = find_layers(model, trainable, skip_layers, factor_dtype, blocks, weight_sharing, conv_positions)
    return found.blocks, found.reports(model, trainable)


def discover_blocks(
    model: nn.Module,
    trainable: set[Tensor] | None = None,
    skip_layers: SkipLayers = (),
    factor_dtype: torch.dtype = torch.float32,
    blocks: BlockOverrides | None = None,
    weight_sharing: WeightSharing = "expand",
    conv_positions: ConvStatistics | None = None,
) -> list[KroneckerBlock]:
    """One block per supported module whose weight is among ``trainable``, in model order (see :func:`discover`)."""
    return discover(model, trainable, skip_layers, factor_dtype, blocks, weight_sharing, conv_positions)[0]
