"""The optimizers compared, each built from (model, lr, weight decay), and their lr grids.

Every optimizer gets the same grid shape: ``points`` learning rates spaced by sqrt(10),
``centre * 10 ** (k / 2)`` for k = -points//2 ... points - points//2 - 1 (4 points: centre/10,
centre/3.16, centre, 3.16 centre); only the centre differs per family (`CENTRES`). While the chosen lr
sits at an edge, the search adds the next rate beyond it, at most `MAX_EXTENSIONS` times
(`extend_at_edge`, the rule of every search here).

- ``sgd``: `torch.optim.SGD`, momentum 0.9 (weight decay coupled, as L2).
- ``adamw``: `torch.optim.AdamW`, torch's defaults (betas 0.9/0.999) but where the task's model sets
  its own (``Task.adam_betas``: nanoGPT's 0.9/0.95 on ``nanogpt``).
- ``muon``: `torch.optim.Muon` (momentum 0.95, Nesterov, 5 Newton-Schulz steps) on the hidden 2-D
  weight matrices, the weights of the ``nn.Linear`` layers that are not the task's output head;
  `torch.optim.AdamW` on everything else: embeddings (and the tied head), the output head,
  biases, LayerNorms and conv filters (not flattened into Muon). Both share one lr:
  ``adjust_lr_fn="match_rms_adamw"`` scales Muon's update to AdamW's RMS (Liu et al. 2025), so one
  lr means the same for both parts and the tuning budget is one lr, like everyone's.
- ``kfac``: `kfac_optim.KFAC` with ONE configuration on every task (`KFAC_SETTINGS`: the README's
  AdamW swap, the "eigen_adam" method, the automatic intervals), only lr tuned.
- ``soap``: heavyball's SOAP (Vyas et al. 2024), eager mode (no torch.compile), its defaults;
  optional: skipped with a note when heavyball is not installed (``pip install .[peers]``).

K-FAC variants, not run unless named in ``--optimizers`` (`KFAC_VARIANTS`), to measure an option
against the configuration it changes: ``kfac_eigen``, the eigen method with constant damping 0.1
and ``kl_clip`` 1e-3 (the configuration ``KFAC_SETTINGS`` replaced; lr centre 0.3), and
``kfac_eigen_lm``, the same with ``damping=AdaptiveDamping(initial=0.1, every=5)``
(Levenberg–Marquardt, docs/design.md §4.2), stepped with a closure (`needs_closure`): its extra
forward every 5 steps is in the timed training time. ``kfac_eigen_noclip`` and
``kfac_eigen_lm_noclip``: the same two with ``kl_clip=None``, λ then the only trust region, as in
Martens & Grosse (lr centre 0.03: at 0.3 and above both diverge on all three tasks within 60 steps).
``kfac_eigen_uncapped``: ``kfac_eigen`` with full eigenbases (``Eigen(max_rank=None)``), to measure
the default eigenbasis cap (docs/api.md "Eigenbasis cap") against it. The ``kfac_eigen*`` variants
keep the trust region of their time (``UpdateConfig(trust_region="base_lr")``, where lr cancels while
the clip binds). ``kfac_dropin``: ``KFAC(model, lr, momentum=0.9)`` with every other default (the
eigen method, the ``"lr_squared"`` trust region: the lr sets the step, the automatic intervals), on
SGD's grid; ``kfac_dropin_graft``: the same with ``UpdateConfig(grafting="sgd")`` and
``kl_clip=None`` (the lr sets the length as SGD's, per tensor), the design it was measured against
(benchmarks/RESULTS.md "The lr is the knob"). What the drop-in and EigenAdam need at large batches
(``python -m benchmarks.large_batch``, docs/large_batch.md): ``kfac_dropin_damping001`` (λ 0.01), ``kfac_dropin_lm``
(``AdaptiveDamping``), ``kfac_dropin_sampled`` (the sampled Fisher: the loop calls
``sample_fisher``) and ``kfac_beta2_099`` (EigenAdam with ``beta2=0.99``, Adam's usual, for 0.95). ``kfac_ema``:
``KFAC_SETTINGS`` with ``dampening=0.9``, so the momentum buffer is Adam's first moment (an EMA,
``m ← 0.9 m + 0.1 d``) instead of SGD's sum (``m ← 0.9 m + d``, up to 10× the direction): the
update of the preconditioned layers then has AdamW's RMS at equal lr (on AdamW's grid;
``python -m benchmarks.peers.update_rms``, docs/tuning.md "Replacing AdamW"): EigenAdam's documented
transformer recipe (README, docs/tuning.md: ``momentum=0.9, dampening=0.9, method="eigen_adam", kl_clip=None``).
EigenAdam against SOAP, one of SOAP's choices at a time (benchmarks/results/eigen_adam_ablation/):
``kfac_soap_m``, SOAP's first moment (``EigenAdam(beta1=0.9)``, Adam's m of the gradient rotated
over the root, momentum 0); ``kfac_stats1``, the factors folded every step (SOAP's statistics
frequency, decay 0.95 per step as SOAP's); ``kfac_refresh10``, the bases refreshed every 10 steps
(the SOAP paper's frequency); ``kfac_soap_freq``, statistics every step and bases every 2 steps
(heavyball SOAP's default frequency); ``kfac_soap_m_freq``, the first moment and those frequencies.
``kfac_soap_m_qr1``, ``kfac_soap_m_qr2``, ``kfac_soap_m_qr5``: the first moment, statistics every step
and SOAP's warm-started refresh (``EigenAdam(beta1=0.9, refresh="power")``) every 1, 2, 5 steps.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer

import kfac_optim
from benchmarks.peers.tasks import Task

OPTIMIZERS = ("sgd", "adamw", "muon", "kfac", "soap")
"""The default comparison."""
# The one K-FAC configuration, the README's AdamW swap: method "eigen_adam" (Adam's second moment in
# K-FAC's eigenbasis, docs/numerics.md, "Eigen-Adam"; Adam-scale lr, so the grid is centred as AdamW's), no KL
# clip (the step has Adam's scale), SGD's momentum, and the library's automatic intervals (as users
# get them). It replaced the eigen method with damping 0.1 and kl_clip 1e-3 (lr centre 0.3): on gpt
# its final loss was 0.01 nats above AdamW's in one run, against 0.14 for the eigen method in
# another (seed 0, 4 lrs each).
KFAC_SETTINGS = {"momentum": 0.9, "kl_clip": None, "method": "eigen_adam"}
_EIGEN_SETTINGS = {"momentum": 0.9, "damping": 0.1, "kl_clip": 1e-3, "factor_update_steps": 5,
                   "decomposition_update_steps": 50,
                   "method": "eigen", "update": kfac_optim.UpdateConfig(trust_region="base_lr")}
_DROP_IN = {"momentum": 0.9}
_ADAPTIVE = {"damping": kfac_optim.AdaptiveDamping(initial=0.1, every=5)}
KFAC_VARIANTS = {"kfac_eigen": _EIGEN_SETTINGS,
                 "kfac_eigen_lm": {**_EIGEN_SETTINGS, **_ADAPTIVE},
                 "kfac_eigen_noclip": {**_EIGEN_SETTINGS, "kl_clip": None},
                 "kfac_eigen_lm_noclip": {**_EIGEN_SETTINGS, **_ADAPTIVE, "kl_clip": None},
                 "kfac_eigen_uncapped": {**_EIGEN_SETTINGS, "method": kfac_optim.Eigen(max_rank=None)},
                 "kfac_dropin": _DROP_IN,
                 "kfac_dropin_graft": {**_DROP_IN, "kl_clip": None, "update": kfac_optim.UpdateConfig(grafting="sgd")},
                 "kfac_dropin_damping001": {**_DROP_IN, "damping": 0.01},
                 "kfac_dropin_lm": {**_DROP_IN, **_ADAPTIVE},
                 "kfac_dropin_sampled": {**_DROP_IN, "curvature": kfac_optim.CurvatureConfig(fisher="sampled")},
                 "kfac_beta2_099": {**KFAC_SETTINGS, "method": kfac_optim.EigenAdam(beta2=0.99)},
                 "kfac_ema": {**KFAC_SETTINGS, "dampening": 0.9},
                 "kfac_stats1": {**KFAC_SETTINGS, "factor_update_steps": 1},
                 "kfac_refresh10": {**KFAC_SETTINGS, "decomposition_update_steps": 10},
                 "kfac_soap_m": {**KFAC_SETTINGS, "momentum": 0.0, "method": kfac_optim.EigenAdam(beta1=0.9)},
                 "kfac_soap_freq": {**KFAC_SETTINGS, "factor_update_steps": 1, "decomposition_update_steps": 2},
                 "kfac_soap_m_freq": {**KFAC_SETTINGS, "momentum": 0.0, "method": kfac_optim.EigenAdam(beta1=0.9),
                                      "factor_update_steps": 1, "decomposition_update_steps": 2},
                 **{f"kfac_soap_m_qr{every}": {**KFAC_SETTINGS, "momentum": 0.0,
                                              "method": kfac_optim.EigenAdam(beta1=0.9, refresh="power"),
                                              "factor_update_steps": 1, "decomposition_update_steps": every}
                    for every in (1, 2, 5)}}
"""K-FAC configurations measured against each other on request (module docstring)."""
CHOICES = (*OPTIMIZERS, *KFAC_VARIANTS)
"""Every name ``--optimizers`` accepts."""
CENTRES = {"sgd": 0.3, "adamw": 3e-3, "muon": 1e-2, "kfac": 3e-3, "soap": 3e-3, "kfac_eigen": 0.3,
           "kfac_eigen_lm": 0.3, "kfac_eigen_noclip": 0.03, "kfac_eigen_lm_noclip": 0.03, "kfac_eigen_uncapped": 0.3,
           "kfac_dropin": 0.3, "kfac_dropin_graft": 0.3, "kfac_dropin_damping001": 0.3,
           "kfac_dropin_lm": 0.3, "kfac_dropin_sampled": 0.3, "kfac_beta2_099": 3e-3, "kfac_ema": 3e-3,
           "kfac_stats1": 3e-3, "kfac_refresh10": 3e-3,
           "kfac_soap_m": 3e-3, "kfac_soap_freq": 3e-3,
           "kfac_soap_m_freq": 3e-3, "kfac_soap_m_qr1": 3e-3, "kfac_soap_m_qr2": 3e-3, "kfac_soap_m_qr5": 3e-3}


def grid_rate(centre: float, k: int) -> float:
    """Point ``k`` of the grid around ``centre``: ``centre·10^(k/2)`` to 3 significant digits."""
    return float(f"{centre * 10 ** (k / 2):.3g}")


def grid_points(points: int) -> list[int]:
    """The point indices ``k`` of a ``points``-rate grid, ascending (see the module docstring)."""
    return list(range(-(points // 2), points - points // 2))


def rate(name: str, k: int) -> float:
    """Point ``k`` of optimizer ``name``'s grid."""
    return grid_rate(CENTRES[name], k)


def lr_grid(name: str, points: int) -> list[float]:
    """The ``points`` learning rates of optimizer ``name`` (see the module docstring)."""
    return [rate(name, k) for k in grid_points(points)]


MAX_EXTENSIONS = 2
"""How many rates a grid may grow by while its chosen lr sits at an edge (``extend_at_edge``)."""


def extend_at_edge(ks: list[int], best: int) -> bool:
    """The edge rule of every lr search: when ``best`` is the first or last of the grid ``ks`` (consecutive
    point indices, ascending, more than one), add the next point beyond it; whether ``ks`` grew."""
    if len(ks) < 2:
        return False
    if best == ks[0]:
        ks.insert(0, ks[0] - 1)
        return True
    if best == ks[-1]:
        ks.append(ks[-1] + 1)
        return True
    return False


def available(name: str) -> bool:
    """Whether optimizer ``name`` can be built here (SOAP needs heavyball)."""
    return name != "soap" or importlib.util.find_spec("heavyball") is not None


def build_kfac(model: nn.Module, lr: float, weight_decay: float, settings: dict[str, Any] = KFAC_SETTINGS) -> Optimizer:
    """Every K-FAC optimizer of the benchmark is made here (re-point it when the constructor changes)."""
    return kfac_optim.KFAC(model, lr=lr, weight_decay=weight_decay, **settings)


def needs_closure(name: str) -> bool:
    """Whether optimizer ``name`` is stepped as ``step(closure)`` (``AdaptiveDamping`` measures the loss again)."""
    return isinstance(KFAC_VARIANTS.get(name, {}).get("damping"), kfac_optim.AdaptiveDamping)


class OptimizerPair:
    """Two optimizers over disjoint parameters, stepped together (Muon on matrices, AdamW on the rest)."""

    def __init__(self, *optimizers: Optimizer) -> None:
        self.optimizers = optimizers

    def zero_grad(self, set_to_none: bool = True) -> None:
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none=set_to_none)

    def step(self) -> None:
        for optimizer in self.optimizers:
            optimizer.step()


def hidden_matrices(model: nn.Module, heads: Iterable[str]) -> list[nn.Parameter]:
    """Weights of the ``nn.Linear`` layers other than the heads, excluding weights tied to an embedding."""
    embedded = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    heads = set(heads)
    return [m.weight for name, m in model.named_modules()
            if isinstance(m, nn.Linear) and name not in heads and id(m.weight) not in embedded]


def _muon(model: nn.Module, lr: float, weight_decay: float, task: Task) -> OptimizerPair:
    matrices = hidden_matrices(model, task.heads)
    chosen = {id(p) for p in matrices}
    rest = [p for p in model.parameters() if id(p) not in chosen]
    return OptimizerPair(
        torch.optim.Muon(matrices, lr=lr, weight_decay=weight_decay, adjust_lr_fn="match_rms_adamw"),
        torch.optim.AdamW(rest, lr=lr, betas=task.adam_betas, weight_decay=weight_decay),
    )


def _soap(model: nn.Module, lr: float, weight_decay: float) -> Optimizer:
    import heavyball
    import heavyball.utils

    heavyball.utils.compile_mode = None  # eager: torch.compile on CPU would charge its compile time
    return heavyball.SOAP(model.parameters(), lr=lr, weight_decay=weight_decay)


def build(name: str, model: nn.Module, lr: float, task: Task) -> Optimizer | OptimizerPair:
    """Optimizer ``name`` over ``model`` at learning rate ``lr`` and the task's weight decay."""
    wd = task.weight_decay
    if name == "sgd":
        return torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=wd)
    if name == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=lr, betas=task.adam_betas, weight_decay=wd)
    if name == "muon":
        return _muon(model, lr, wd, task)
    if name == "kfac":
        return build_kfac(model, lr, wd)
    if name == "soap":
        return _soap(model, lr, wd)
    if name in KFAC_VARIANTS:
        return build_kfac(model, lr, wd, KFAC_VARIANTS[name])
    raise ValueError(f"optimizer must be one of {CHOICES}; got {name!r}")
