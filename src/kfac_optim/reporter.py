"""``Reporter``: what K-FAC tells the user about its layers, once, and what it describes on request.

Owns: the one-time warnings and notes (the layers found: none, declined, too few weights covered,
each weight matrix of over 1% on SGD's path, sequence-first, costly factors; layers silent at the
first factor step, and described as SGD while they are; biases frozen or unfrozen after
construction; steps whose statistics were not recorded: ``torch.func``, ``create_graph`` backwards,
a compiled model traced without the hooks; non-finite directions; discarded batches; failed and
truncated decompositions), ``describe()``'s text and ``memory_usage()``'s count.
Must not know: when any of this happens (the estimator hands it the data at the step's points:
docs/design.md §4), the capture, schedules, ranks, loss scaling. It reads blocks and factors; the
only state it writes besides its own is a block's failure count and a factor's reported discards.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from torch import Tensor, nn

from kfac_optim import layers, linalg
from kfac_optim.diagnostics import warn_user
from kfac_optim.layers import KroneckerBlock, ModuleReport
from kfac_optim.layers.attention import sequence_first_note

if TYPE_CHECKING:
    from kfac_optim.capture.hooks import Recording
    from kfac_optim.layers.factor import Factor
    from kfac_optim.layers.registry import Discovery
    from kfac_optim.methods import Method

logger = logging.getLogger(__name__)

LARGE_FACTOR_DIM = 4096
"""Factors at least this wide take seconds to decompose on a CPU at full rank (``eigh`` is ``O(n³)``;
a rank-``r`` factor is decomposed in ``O(n²r)``, see ``linalg.symmetric_eigen``): noted once."""

FROZEN_NOTE = (" (frozen now, requires_grad=False: records nothing, its hooks tap nothing, and factors never used are "
               "not allocated; once unfrozen, its factors are allocated when it first records and it is preconditioned "
               "from the first decomposition step after its gradient appears, its factors starting empty as a new "
               "layer's, under its param group's settings)")
"""What :meth:`Reporter.describe` adds to the row of a block whose parameters are all frozen now."""

COVERAGE_WARNING = 0.5
"""Below this share of the trainable weight-matrix elements preconditioned, a one-time warning at
construction names the largest modules without a block (docs/api.md, ``describe()``)."""


LARGE_SGD_SHARE = 0.01
"""A weight matrix holding more than this share of the trainable elements that takes the SGD path
is named in a one-time warning at construction, whatever the coverage."""


def _parameter_path(module: str, parameter: str) -> str:
    """``module.parameter`` (just ``parameter`` for the root module)."""
    return f"{module}.{parameter}" if module else parameter


class Reporter:
    """The reports about ``discovery``'s blocks of ``model``, preconditioned by ``method``.

    Construction warns about the layers found among ``trainable`` (once). The other methods are
    called by the estimator with what they report on.
    """

    def __init__(self, model: nn.Module, discovery: Discovery, method: Method, trainable: set[Tensor]) -> None:
        self._model = model
        self._discovery = discovery
        self._blocks = discovery.blocks
        self._method = method
        self._reported_truncations: set[str] = set()
        self._warned = {"nothing sampled": False, "graph backward": False, "nothing recorded": False,
                        "torch.func": False}
        self._gradient_marks: list[tuple[int, int]] = []  # at the last factor step (_current_gradient_marks)
        self.awaiting_statistics = True  # until a factor step recorded statistics (silent_blocks)
        self._warned_bias: set[str] = set()  # blocks warned about a bias frozen or unfrozen after construction
        self._reported_nonfinite = [0] * len(self._blocks)
        self._warn_about_discovery(trainable)

    # -- the layers found (construction) -----------------------------------------------------

    def _warn_about_discovery(self, trainable: set[Tensor]) -> None:
        """The one-time notes about the layers found: none, declined ones, too few weights
        preconditioned (under :data:`COVERAGE_WARNING`), sequence-first, costly factors."""
        note = sequence_first_note(self._blocks)
        if note is not None:
            warn_user(note)
        if not self._blocks:
            kinds = ", ".join(sorted({t.__name__ for t in layers.registered_blocks()}))
            warn_user(
                f"model has no supported layer to precondition (registered kinds: {kinds}; see KFAC.describe()): "
                "KFAC behaves as SGD",
            )
        reports = self.reports(trainable)
        unsupported = [r for r in reports if r.status == "unsupported"]
        if unsupported:
            warn_user(
                f"{len(unsupported)} layer(s) of registered kinds take the SGD path: "
                + "; ".join(f"{r.name}: {r.detail}" for r in unsupported)
            )
        covered, total = self.coverage(trainable)
        if self._blocks and total and covered < COVERAGE_WARNING * total:
            warn_user(self._coverage_note(trainable, reports, covered, total))
        for note in self._large_sgd_notes(trainable, reports):
            warn_user(note)
        large = [f"{block.name}.{name} ({factor.dim})" for block in self._blocks
                 for name, factor in block.factors.items()
                 if factor.dim >= LARGE_FACTOR_DIM and not factor.diagonal  # a diagonal one costs O(n)
                 and not self._method.capped(factor)]  # capped: O(n²·rank)
        if large:
            logger.warning("K-FAC factors of dim >= %d take seconds each to decompose on a CPU at full rank "
                           "(rank-deficient ones, e.g. of convs on small feature maps, far less): %s; see "
                           "decomposition_update_steps, AsyncConfig and skip_layers (docs/design.md §4)",
                           LARGE_FACTOR_DIM, ", ".join(large))

    def _large_sgd_notes(self, trainable: set[Tensor], reports: list[ModuleReport]) -> list[str]:
        """One note per weight matrix (2+ dims, trainable) of more than :data:`LARGE_SGD_SHARE` of the
        trainable elements that takes the SGD path, whatever the coverage: a layer kind without a
        block is easy to miss when a large covered matrix (a tied embedding) carries the share.
        Modules skipped by the user or declined (warned about already) are left out."""
        elements = sum(p.numel() for p in trainable if p.requires_grad)
        modules = dict(self._model.named_modules())
        preconditioned = {p for block in self._blocks for p in block.parameters()}
        notes = []
        for report in reports:
            module = modules.get(report.name)
            if module is None or report.status in ("skipped", "unsupported", "kfac") \
                    or type(module) in self._discovery.forward_overrides:  # those are warned about already
                continue
            for name, param in module.named_parameters(recurse=False):
                share = param.numel() / elements if elements else 0.0
                if param in trainable and param.requires_grad and param.dim() >= 2 and param not in preconditioned \
                        and share > LARGE_SGD_SHARE:
                    notes.append(f"'{_parameter_path(report.name, name)}' ({report.kind}, {param.numel()} elements, "
                                 f"{share:.1%} of the trainable ones) takes SGD's update: {report.detail}. A layer "
                                 "type gets K-FAC with kfac_optim.register_block(LayerType, BlockClass) (docs/api.md, "
                                 "'Block registry'); KFAC.describe() lists every module")
        return notes

    def _coverage_note(self, trainable: set[Tensor], reports: list[ModuleReport], covered: int, total: int) -> str:
        """The coverage warning: the share, the largest modules without a block, how to register one."""
        modules = dict(self._model.named_modules())
        sizes = []
        for report in reports:
            module = modules.get(report.name)
            if report.block is not None or module is None:
                continue
            size = sum(p.numel() for p in module.parameters(recurse=False)
                       if p in trainable and p.requires_grad and p.dim() >= 2)
            if size:
                sizes.append((size, report))
        largest = sorted(sizes, key=lambda item: -item[0])[:3]
        named = "; ".join(f"'{r.name}' ({r.kind}, {size} elements: {r.status})" for size, r in largest)
        return (f"K-FAC preconditions {covered}/{total} ({covered / total:.1%}) of the trainable weight-matrix "
                f"elements, under {COVERAGE_WARNING:.0%}: the rest take SGD's update. "
                f"Largest without a block: {named}. "
                "A layer type gets K-FAC with kfac_optim.register_block(LayerType, BlockClass) (a KroneckerBlock "
                "subclass; docs/api.md, 'Block registry'); KFAC.describe() lists every module")

    def coverage(self, trainable: set[Tensor]) -> tuple[int, int]:
        """``(preconditioned, total)`` elements of the weight matrices (parameters of 2+ dims) among
        ``trainable`` that require grad now; preconditioned: held by a :meth:`preconditioning_blocks` block."""
        preconditioned = {p for block in self.preconditioning_blocks() for p in block.parameters()}
        matrices = [p for p in trainable if p.requires_grad and p.dim() >= 2]
        return sum(p.numel() for p in matrices if p in preconditioned), sum(p.numel() for p in matrices)

    def preconditioning_blocks(self) -> list[KroneckerBlock]:
        """The blocks that precondition now: not left to SGD (``sgd_reason``), not :meth:`silent`,
        their module still in the model."""
        modules = set(self._model.modules())
        silent = set(self.silent())
        return [block for block in self._blocks
                if block.sgd_reason is None and block.module in modules and block not in silent]

    def silent(self) -> list[KroneckerBlock]:
        """Once some block received statistics (not :attr:`awaiting_statistics`), the trainable blocks
        that never did (``KroneckerBlock.has_statistics``): no decomposition, so the SGD path."""
        if self.awaiting_statistics:
            return []
        return [block for block in self._blocks if not block.frozen and not block.has_statistics]

    def reports(self, trainable: set[Tensor]) -> list[ModuleReport]:
        """What happens now to every module's parameters among ``trainable`` (``KFAC.module_reports``):
        from the model and the blocks as they are at the call (``layers.registry.Discovery``)."""
        return self._discovery.reports(self._model, trainable, self.silent())

    # -- what a factor step recorded -----------------------------------------------------------

    def recording(self, seen: Recording, moves: Callable[[], bool] | None = None) -> None:
        """At a factor step, before its fold, handed what the capture ``seen``: warn once when forwards
        ran inside a ``torch.func`` transform (not hooked), once when every backward ran with
        ``create_graph=True`` (not recorded), and once when no output-gradient reached the hooks
        although the layers have gradients and the step ``moves`` a parameter (None: it does). A
        step that moves nothing is no evidence: ``torch.distributed.checkpoint``'s ``get_state_dict``
        builds an optimizer's state with one ``step()`` at lr 0 on gradients it sets to zero, with
        no backward; the check waits for a factor step that moves."""
        if seen.transformed and not self._warned["torch.func"]:
            warn_user(
                "K-FAC layers ran inside a torch.func transform (torch.func.grad, vjp, vmap, ...): its gradients "
                "never reach K-FAC's hooks, so those forwards add no statistics: the factors stay as they are "
                "(none yet: the step is SGD's); compute the gradients with "
                "loss.backward() for K-FAC to precondition them",
                RuntimeWarning,
            )
            self._warned["torch.func"] = True
        marks, self._gradient_marks = self._gradient_marks, self._current_gradient_marks()
        if seen.recorded:
            return
        if seen.graph_backward and not self._warned["graph backward"]:
            warn_user(
                "every backward since the last step ran with create_graph=True: K-FAC records the "
                "output-gradients of the backward that produces .grad without create_graph (e.g. the "
                "final backward of a gradient penalty), so the factors were not updated on this step",
                RuntimeWarning,
            )
            self._warned["graph backward"] = True
        elif not seen.arrivals and not seen.transformed and not self._warned["nothing recorded"] and seen.active and (
            self._gradient_marks and self._gradient_marks != marks  # a backward wrote gradients since
        ) and (moves is None or moves()):
            warn_user(
                "K-FAC recorded no statistics on this factor step: no output-gradient reached its hooks although "
                "its layers have gradients, so the factors were not updated. A model compiled with torch.compile "
                "and run before KFAC was created keeps the graphs traced without K-FAC's hooks (Dynamo does not "
                "guard on module hooks): create KFAC before the first compiled call, or call torch._dynamo.reset() "
                "after creating it (docs/design.md §4, 'Compiled models')",
                RuntimeWarning,
            )
            self._warned["nothing recorded"] = True

    def _current_gradient_marks(self) -> list[tuple[int, int]]:
        """Which gradient tensors the training blocks' weights hold, and their versions (no tensor
        is read): a change between factor steps means a backward wrote gradients in between."""
        return [(id(grad), grad._version) for block in self._blocks if (grad := block.weight.grad) is not None]

    def nothing_sampled(self) -> None:
        """``sample_fisher`` recorded nothing: warn once."""
        if not self._warned["nothing sampled"]:
            warn_user(
                "sample_fisher recorded no statistics: no K-FAC layer's output on the path to `outputs` was "
                "captured (reentrant torch.utils.checkpoint hides its layers from this pass; use "
                "use_reentrant=False); the factors are not updated",
                RuntimeWarning,
            )
            self._warned["nothing sampled"] = True

    def silent_blocks(self, folding: list[KroneckerBlock]) -> None:
        """While :attr:`awaiting_statistics`, at a factor step with the pending statistics settled: once
        some block recorded, warn once about blocks among ``folding`` (those that captured for the
        step: all, or a staggered run's phase) whose hooks never fired (e.g. a layer called
        functionally, or whose output never reached the loss). Frozen blocks (their weight
        ``requires_grad=False``) record nothing by design and are left out."""
        active = [block for block in folding if not block.frozen]
        silent = [block.name for block in active if block.pending_samples == 0]
        if len(silent) == len(active):
            return  # no statistics at all (a skipped backward, a torch.func loop): ask again next time
        self.awaiting_statistics = False
        if silent:
            warn_user(
                f"K-FAC layer(s) {silent} produced no statistics at the first factor step (their hooks never "
                "fired: a layer called through its parameters rather than its forward, or whose output does "
                "not reach the loss); they take the SGD path until they do",
                RuntimeWarning,
            )

    def bias_changes(self) -> None:
        """Once per block: its bias was frozen or unfrozen after construction, which fixed whether the
        block holds it (``KroneckerBlock.create``). Attribute reads only (decomposition steps)."""
        for block in self._blocks:
            if block.name in self._warned_bias:
                continue
            if block.bias is not None and block.weight.requires_grad and not block.bias.requires_grad:
                what = ("its bias was frozen after KFAC was built: the weight is still preconditioned with the joint "
                        "[W | b] factors, not as with bias=False; freeze the bias before building KFAC for that")
            elif block.frozen_bias is not None and block.frozen_bias.requires_grad:
                what = ("its bias, frozen when KFAC was built and so left out of the block (bias=False's), was "
                        "unfrozen: it takes the SGD path; build a new KFAC to precondition it with the weight")
            else:
                continue
            self._warned_bias.add(block.name)
            warn_user(f"K-FAC layer '{block.name}': {what}")

    # -- decomposition steps ---------------------------------------------------------------------

    def discarded(self, block: KroneckerBlock, name: str, factor: Factor, discarded: int) -> None:
        """Warn about the non-finite batches of factor ``name`` discarded since the last report
        (``discarded``: the factor's count so far, read by the decomposition step's one host sync)."""
        if discarded > factor.reported_discards:
            warn_user(
                f"K-FAC layer '{block.name}': {discarded - factor.reported_discards} non-finite "
                f"batch(es) of {name} statistics discarded; the factor keeps its previous value",
                RuntimeWarning,
            )
            factor.reported_discards = discarded

    def nonfinite_directions(self, parameter_counts: list[int]) -> None:
        """Warn about layers whose direction was non-finite since the last report (see the KL clip);
        ``parameter_counts``: per parameter of the blocks, in block order, the steps counted so far."""
        counts = iter(parameter_counts)
        for index, block in enumerate(self._blocks):
            count = max(next(counts) for _ in block.parameters())  # a layer's parameters fail together
            if count > self._reported_nonfinite[index]:
                warn_user(
                    f"K-FAC layer '{block.name}': {count - self._reported_nonfinite[index]} step(s) with a "
                    "non-finite gradient; that layer's update was non-finite and it was left out of the KL "
                    "clip, so the other layers were not affected",
                    RuntimeWarning,
                )
                self._reported_nonfinite[index] = count

    def decomposed(self, block: KroneckerBlock, name: str) -> None:
        """Log (INFO, once per factor) the first decomposition of factor ``name`` of ``block`` that
        the eigenbasis cap truncated (``methods.Eigen``'s ``max_rank``): its rank and ``σ``. One host
        sync per decomposition of a capped factor until then."""
        decomposition = block.factors[name].decomposition
        key = f"{block.name}.{name}"
        if key in self._reported_truncations or not isinstance(decomposition, linalg.Eigen) \
                or decomposition.complement is None:
            return
        sigma = float(decomposition.complement)
        if sigma > 0:
            self._reported_truncations.add(key)
            logger.info("K-FAC layer '%s': %s (dim %d) truncated by the eigenbasis cap to its %d leading eigenpairs, "
                        "the other directions at their mean eigenvalue %.3g", block.name, name,
                        block.factors[name].dim, decomposition.Q.shape[-1], sigma)

    def failed(self, block: KroneckerBlock, name: str) -> None:
        """One warning for a failed decomposition of factor ``name`` of ``block`` (counted in ``block.failures``)."""
        block.failures += 1
        kept = (
            "its last good decomposition is kept"
            if block.factors[name].decomposition is not None
            else "it has no decomposition yet, so the layer takes the SGD direction until one succeeds"
        )
        warn_user(
            f"K-FAC layer '{block.name}': the {self._method.name} decomposition of {name} failed, float64 "
            f"retry included ({block.failures} failure(s) so far); {kept}",
            RuntimeWarning,
        )

    # -- on request ------------------------------------------------------------------------------

    def describe(self, trainable: set[Tensor], schedule: str) -> str:
        """:meth:`KFAC.describe`, given the optimizer's parameters (``trainable``) and the intervals'
        description (``schedule``), from the state now: the share counts the weight matrices that
        require grad, those of blocks left to SGD excluded."""
        covered, total = self.coverage(trainable)
        share = covered / total if total else 1.0
        frozen = {block.name for block in self._blocks if block.frozen}
        lines = [
            f"KFAC ({self._method.name}): {len(self.preconditioning_blocks())} blocks precondition {covered}/{total} "
            f"weight-matrix elements ({share:.1%})",
            *(f"  {report}{FROZEN_NOTE if report.block in frozen else ''}" for report in self.reports(trainable)),
        ]
        approximations = self._method.approximations([(block.name, block.A, block.G) for block in self._blocks])
        if approximations is not None:
            lines.append(approximations)
        lines.append(schedule)
        return "\n".join(lines)


def memory_usage(blocks: Sequence[KroneckerBlock], method: Method, preconditioning_bytes: int) -> dict[str, int]:
    """Bytes of K-FAC state on this rank, by category, and their ``"total"``.

    ``"factors"``: running A and G of every layer as allocated (every rank keeps all of them; a
    layer frozen since construction allocates its factors when it first records, ``Factor.allocated``);
    ``"pending"``: the buffers statistics are captured into (allocated likewise); ``"decompositions"``: the
    eigendecompositions or inverses this rank holds (all layers with ``f = 1``, about
    ``f`` of them otherwise, as ``method`` sizes them); ``"sharded_preconditioning"``:
    ``preconditioning_bytes``, the most this rank holds at once while preconditioning others'
    gradients (under FSDP2: gathered gradient rows and one whole gradient and direction;
    ``DistributionStrategy.preconditioning_bytes``). Momentum buffers are SGD's
    and not counted.
    """
    factors = [factor for block in blocks for factor in block.factors.values()]
    held = [factor.held_bytes() for factor in factors]  # 0 for a frozen layer's factors never used
    usage = {
        "factors": sum(running for running, _ in held),
        "pending": sum(pending for _, pending in held),
        "decompositions": sum(method.decomposer.nbytes(f.decomposition) for f in factors),
        "sharded_preconditioning": preconditioning_bytes,
    }
    usage["total"] = sum(usage.values())
    return usage
