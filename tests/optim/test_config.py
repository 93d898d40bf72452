"""``KFAC``'s typed configs (docs/api.md "Configs"): the constructor's size, contradictory settings,
no flat keywords and the read-only ``options``."""

from __future__ import annotations

import dataclasses
import inspect
import warnings

import pytest
import torch
from torch import nn

from kfac_optim import KFAC, AsyncConfig, CurvatureConfig, RuntimeConfig, UpdateConfig
from kfac_optim.config import FLAT_KEYWORDS, KFACOptions
from kfac_optim.layers.linear import LinearBlock


def _config_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2))


def test_the_constructor_has_at_most_18_named_parameters() -> None:
    """Named parameters only: no ``**keywords`` catch-all."""
    signature = inspect.signature(KFAC.__init__).parameters.values()
    parameters = [p.name for p in signature if p.name != "self" and p.kind is not inspect.Parameter.VAR_KEYWORD]
    assert len(parameters) <= 18, parameters
    assert [p.name for p in signature if p.kind is inspect.Parameter.VAR_KEYWORD] == []


@pytest.mark.parametrize(
    ("make", "first", "second"),
    [
        (lambda: CurvatureConfig(fisher="sampled", loss_reduction="mean"), "loss_reduction", "fisher"),
        (lambda: KFACOptions(curvature=CurvatureConfig(stagger=True)), "stagger", "factor_update_steps"),
        (lambda: KFAC(_config_model(), curvature=CurvatureConfig(stagger=True), factor_update_steps=1,
                      decomposition_update_steps=10), "stagger",
         "factor_update_steps"),
        (lambda: KFAC(_config_model(), update=UpdateConfig(grafting="sgd"), factor_update_steps=1,
                      decomposition_update_steps=10),
         "grafting", "kl_clip"),
        (lambda: KFAC(_config_model(), momentum=0.9, nesterov=True, kl_clip=None, update=UpdateConfig(grafting="adam"),
                      factor_update_steps=1, decomposition_update_steps=10),
         "grafting", "momentum"),
        (lambda: UpdateConfig(adam_betas=(0.9, 0.95)), "adam_betas", "grafting"),
    ],
    ids=["loss_reduction under the sampled Fisher",
         "stagger at interval 1 (options)", "stagger at interval 1 (KFAC)", "grafting with the KL clip",
         "adam grafting with SGD momentum (nesterov)", "adam betas without adam grafting"],
)
def test_a_contradictory_combination_is_a_value_error_naming_both(make, first: str, second: str) -> None:
    with pytest.raises(ValueError, match=rf"(?s)({first}.*{second}|{second}.*{first})"):
        make()


def test_an_inverse_interval_off_the_factor_interval_warns() -> None:
    with pytest.warns(UserWarning, match="decomposition_update_steps=3 is not a multiple of factor_update_steps=2"):
        KFAC(_config_model(), factor_update_steps=2, decomposition_update_steps=3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        KFAC(_config_model(), factor_update_steps=2, decomposition_update_steps=4)
        KFAC(_config_model(), factor_update_steps=lambda step: 2,
             decomposition_update_steps=3)  # a schedule: not checked


@pytest.mark.parametrize("config", [CurvatureConfig, AsyncConfig, RuntimeConfig, KFACOptions])
def test_configs_are_frozen(config: type) -> None:
    name = next(iter(config.__dataclass_fields__))
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(config(), name, None)


@pytest.mark.parametrize(
    ("kwargs", "argument"),
    [
        (dict(curvature=CurvatureConfig), "curvature"),
        (dict(runtime=dict(process_group=None)), "runtime"),
        (dict(asynchronous=True), "asynchronous"),
    ],
)
def test_a_config_of_the_wrong_type_is_a_type_error_naming_it(kwargs: dict, argument: str) -> None:
    with pytest.raises(TypeError, match=argument):
        KFAC(_config_model(), **{"factor_update_steps": 1, "decomposition_update_steps": 10, **kwargs})


def test_an_unknown_keyword_is_a_type_error() -> None:
    with pytest.raises(TypeError, match="unexpected keyword argument 'fischer'"):
        KFAC(_config_model(), fischer="sampled", factor_update_steps=1, decomposition_update_steps=10)


@pytest.mark.parametrize("keyword", sorted(FLAT_KEYWORDS))
def test_a_flat_keyword_is_a_type_error(keyword: str) -> None:
    """The configs' fields are given in their config only: ``KFAC(model, fisher=...)`` is no spelling."""
    with pytest.raises(TypeError, match=f"unexpected keyword argument '{keyword}'"):
        KFAC(_config_model(), factor_update_steps=1, decomposition_update_steps=10, **{keyword: None})


def test_options_is_read_only_and_holds_the_configs() -> None:
    curvature = CurvatureConfig(fisher="sampled")
    optimizer = KFAC(_config_model(), damping=0.2, curvature=curvature, asynchronous=AsyncConfig(),
                     factor_update_steps=1, decomposition_update_steps=10)
    assert optimizer.options.damping == 0.2
    assert optimizer.options.curvature is curvature and optimizer.options.asynchronous == AsyncConfig()
    with pytest.raises(AttributeError):
        optimizer.options = KFACOptions()  # type: ignore[misc]


def test_the_rank_check_reads_every_shared_setting_and_no_per_process_one() -> None:
    settings = KFACOptions(asynchronous=AsyncConfig(delay=2)).rank_settings()
    assert settings.keys() == KFACOptions().rank_settings().keys()  # the same names, in order, on every rank
    assert {"damping", "kl_clip", "factor_update_steps", "decomposition_update_steps", "method", "curvature.fisher",
            "curvature.factor_dtype", "asynchronous", "asynchronous.delay"} <= set(settings)
    assert "curvature.skip_layers" not in settings  # compared as the layer list it gives
    assert not any("process_group" in name or "grad_scaler" in name or "statistics" in name for name in settings)


def test_a_per_optimizer_block_override_is_accepted_by_the_config() -> None:
    class MyLinear(nn.Linear):
        pass

    assert CurvatureConfig(blocks={MyLinear: LinearBlock}).blocks == {MyLinear: LinearBlock}
    with pytest.raises(TypeError, match="blocks"):
        CurvatureConfig(blocks={MyLinear: nn.Linear})
