"""K-FAC on models sharded by FSDP2 (``fully_shard``) and HSDP, on real gloo ranks
(docs/design.md §5, "FSDP2 and HSDP").

One spawn of 2 and one of 4 CPU ranks (tests/distributed_helpers.py: file:// rendezvous, one
thread each, a deadline that fails the test instead of hanging) run every scenario and save what
they ended with; the tests compare it, in this process, with one process training the unsharded
model on the concatenated batch.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from kfac_optim import KFAC, CurvatureConfig, RuntimeConfig
from kfac_optim.distributed.fsdp import MeshLayout, assign_routes, mesh_layout, service_groups
from kfac_optim.distributed.plan import make_plan
from kfac_optim.distributed.work import work_items
from tests.distributed_helpers import assert_same_tensors, spawn

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed unavailable")

GLOBAL_BATCH = 8
STEPS = 5
SAVE_AT = 3  # right after a decomposition step (decomposition_update_steps=2: steps 0, 2, 4)
DEADLINE_S = 150.0
OPTIONS: dict[str, Any] = dict(
    lr=0.1, momentum=0.9, weight_decay=1e-3, damping=0.1, kl_clip=1e-2,
    curvature=CurvatureConfig(factor_decay=0.9), decomposition_update_steps=2
)
SGD_OPTIONS: dict[str, Any] = dict(lr=0.1, momentum=0.9, weight_decay=1e-3, nesterov=True)
TOLERANCE = dict(rtol=1e-5, atol=1e-5)
assert_same = partial(assert_same_tensors, **TOLERANCE)  # rtol=0, atol=0 for bit-identity


class FsdpNet(nn.Module):
    """Conv → tanh → three Linear layers; output sizes 3, 8, 5, 3 leave some ranks of 2 and 4
    with fewer rows than others, or none."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 3, 3, padding=1)
        self.fc1 = nn.Linear(48, 8)
        self.fc2 = nn.Linear(8, 5, bias=False)
        self.head = nn.Linear(5, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.fc2(torch.tanh(self.fc1(torch.tanh(self.conv(x)).flatten(1)))))
        return self.head(h)


def make_fsdp_net() -> FsdpNet:
    torch.manual_seed(0)
    return FsdpNet()


class TokenNet(nn.Module):
    """The newer block kinds: an Embedding (diagonal A, weight transposed), a grouped Conv1d whose
    3 groups of 2 output channels the 2 shards cut inside the middle one, and an attention layer
    (packed q/k/v in-projection and out_proj, own capture); rows 10, 6, 12 (q, k, v), 4, 3."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(10, 6)
        self.conv = nn.Conv1d(6, 6, 3, padding=1, groups=3)
        self.attention = nn.MultiheadAttention(4, 2, batch_first=True)
        self.head = nn.Linear(4 * 4, 3)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.conv(self.embedding(tokens).transpose(1, 2)))  # (N, 6, L=4)
        h = h.transpose(1, 2)[..., :4]  # (N, 4 positions, 4 features)
        h = h + self.attention(h, h, h, need_weights=False)[0]
        return self.head(h.flatten(1))


def make_token_model() -> TokenNet:
    torch.manual_seed(0)
    return TokenNet()


class Transposed(nn.Module):
    """``x @ W + b`` with ``W: (in, out)``: its bias runs along W's columns, not its rows."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 2))
        self.bias = nn.Parameter(torch.zeros(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight + self.bias


def token_shard(step: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s part of the global batch of tokens ``(N, 4)`` of ``step``."""
    generator = torch.Generator().manual_seed(2000 + step)
    x = torch.randint(0, 10, (GLOBAL_BATCH, 4), generator=generator)
    y = torch.randint(0, 3, (GLOBAL_BATCH,), generator=generator)
    size = GLOBAL_BATCH // world
    return x[rank * size : (rank + 1) * size], y[rank * size : (rank + 1) * size]


def fsdp_shard(step: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s part of the global batch of ``step``."""
    generator = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(GLOBAL_BATCH, 1, 4, 4, generator=generator)
    y = torch.randint(0, 3, (GLOBAL_BATCH,), generator=generator)
    size = GLOBAL_BATCH // world
    return x[rank * size : (rank + 1) * size], y[rank * size : (rank + 1) * size]


def fsdp_train(
    model: nn.Module, optimizer: torch.optim.Optimizer, steps: range, rank: int = 0, world: int = 1,
    data: Callable = fsdp_shard
) -> None:
    for step in steps:
        x, y = data(step, rank, world)
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()


def train_sampled(model: nn.Module, optimizer: KFAC, steps: range, rank: int = 0, world: int = 1,
                  micro_batches: int = 1, scaler: torch.amp.GradScaler | None = None) -> None:
    """Sampled-Fisher steps: this rank's shard as ``micro_batches`` parts (one process: every rank's
    shard in turn), each with its own draws, so one process can replay what the ranks drew."""
    for step in steps:
        optimizer.zero_grad()
        for part in range(micro_batches):
            shard_rank = rank * micro_batches + part
            x, y = fsdp_shard(step, shard_rank, world * micro_batches)
            out = model(x)
            optimizer.sample_fisher(out, "cross_entropy",
                                    generator=torch.Generator().manual_seed(100 * step + shard_rank))
            loss = F.cross_entropy(out, y) / micro_batches
            (scaler.scale(loss) if scaler is not None else loss).backward()
        if scaler is not None:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()


def full_parameters(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter whole (an all-gather of sharded ones: a collective under FSDP)."""
    return {
        name: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().float().clone()
        for name, p in model.named_parameters()
    }


# -- routes: who preconditions which block for whom (pure, no ranks) ---------------------------


@pytest.mark.parametrize("shards", [1, 2, 3, 4])
def test_mesh_layout_rows_follow_torch_chunk_as_fully_shard_does(shards: int) -> None:
    layout = MeshLayout((tuple(range(shards)),), 0)
    for out in range(1, 10):
        chunks = torch.arange(out).chunk(shards)
        for rank in range(shards):
            first, count = layout.rows(out, rank)
            expected = chunks[rank].tolist() if rank < len(chunks) else []
            assert list(range(first, first + count)) == expected


def routes_for(world: int, fraction: float, shard_groups: tuple[tuple[int, ...], ...]):
    dims = {f"layer{i}": (10 + i, 12 + i) for i in range(8)}  # (dim_A, dim_G)
    plan = make_plan(work_items(dims), world, fraction)
    shapes = {name: (g, a) for name, (a, g) in dims.items()}
    workers = {name: plan.block(name).grad_workers for name in dims}
    return plan, workers, assign_routes(shapes, workers, plan.receiver_groups, MeshLayout(shard_groups, 0))


def test_fsdp_at_f_1_spreads_preconditioning_over_the_shard_group() -> None:
    _, _, routes = routes_for(4, 1.0, ((0, 1, 2, 3),))
    assert all(len(r) == 1 and r[0].service_group == (0, 1, 2, 3) for r in routes.values())
    per_rank = [sum(r[0].preconditioner == rank for r in routes.values()) for rank in range(4)]
    assert per_rank == [2, 2, 2, 2]


def test_fsdp_at_mem_opt_preconditions_each_block_on_its_owner() -> None:
    plan, _, routes = routes_for(4, 0.25, ((0, 1, 2, 3),))
    for name, (route,) in routes.items():
        assert route.preconditioner == plan.block(name).owner("A") == plan.block(name).owner("G")


def test_hsdp_gradient_workers_serve_their_own_shard_group() -> None:
    """2 x 2 mesh, f = 1/2: one gradient worker per block in each shard group, serving it."""
    _, workers, routes = routes_for(4, 0.5, ((0, 1), (2, 3)))
    for name, block_routes in routes.items():
        assert sorted(r.service_group for r in block_routes) == [(0, 1), (2, 3)]
        for route in block_routes:
            assert route.preconditioner in workers[name] and route.preconditioner in route.service_group
            assert route.gather_group == route.service_group


def test_hsdp_at_mem_opt_gathers_from_one_shard_group_and_serves_every_rank() -> None:
    plan, _, routes = routes_for(4, 0.25, ((0, 1), (2, 3)))
    for name, (route,) in routes.items():
        assert route.service_group == (0, 1, 2, 3)
        assert route.preconditioner == plan.block(name).owner("A") and route.preconditioner in route.gather_group
        assert len(route.gather_group) == 2


def test_plan_rows_that_cut_across_shard_groups_are_rejected() -> None:
    layout = MeshLayout(((0, 1, 2), (3, 4, 5)), 0)
    with pytest.raises(ValueError, match="grad_worker_fraction"):
        service_groups(((0, 1), (2, 3), (4, 5)), layout)


# -- what the ranks do --------------------------------------------------------------------------


def sharded_model(mesh: Any = None, root_only: bool = False, **fsdp_kwargs: Any) -> FsdpNet:
    """``fully_shard`` on every K-FAC layer (unless ``root_only``) and on the root."""
    from torch.distributed.fsdp import fully_shard

    model = make_fsdp_net()
    for layer in () if root_only else (model.conv, model.fc1, model.fc2, model.head):
        fully_shard(layer, mesh=mesh, **fsdp_kwargs)
    fully_shard(model, mesh=mesh, **fsdp_kwargs)
    return model


def kfac_run(
    rank: int, world: int, fraction: float, mesh: Any = None, root_only: bool = False, **fsdp_kwargs: Any
) -> dict[str, torch.Tensor]:
    model = sharded_model(mesh, root_only, **fsdp_kwargs)
    optimizer = KFAC(model, runtime=RuntimeConfig(grad_worker_fraction=fraction),
                     **{"factor_update_steps": 1, "decomposition_update_steps": 10, **OPTIONS})
    fsdp_train(model, optimizer, range(STEPS), rank, world)
    SENT[fraction] = optimizer.estimator.strategy.comm.bytes_sent["fsdp_rows"]
    return full_parameters(model)


SENT: dict[float, int] = {}
"""Bytes of gradient and direction rows this rank sent in its last run at each fraction."""


def sgd_runs(rank: int, world: int) -> dict[str, dict[str, torch.Tensor]]:
    """The same FSDP model under torch.optim.SGD and under KFAC with every layer skipped."""
    results = {}
    for name, build in (
        ("torch sgd", lambda m: torch.optim.SGD(m.parameters(), **SGD_OPTIONS)),
        ("kfac off", lambda m: KFAC(m, curvature=CurvatureConfig(skip_layers=[nn.Linear, nn.Conv2d]),
                                    **{"factor_update_steps": 1, "decomposition_update_steps": 10, **SGD_OPTIONS})),
    ):
        model = sharded_model()
        fsdp_train(model, build(model), range(STEPS), rank, world)
        results[name] = full_parameters(model)
    return results


def save_checkpoint(model: nn.Module, optimizer: KFAC, path: Path) -> None:
    """Model, SGD state (by parameter name) and K-FAC state through DCP, on every rank."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optimizer_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optim": optimizer_state, "kfac": optimizer.kfac_state()}, checkpoint_id=path)


def resume_from_checkpoint(model: nn.Module, path: Path, rank: int = 0, world: int = 1,
                           **kwargs: Any) -> dict[str, torch.Tensor]:
    """Load the DCP checkpoint into ``model`` and a fresh KFAC, train to ``STEPS``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    optimizer = KFAC(model, **{"factor_update_steps": 1, "decomposition_update_steps": 10, **{**OPTIONS, **kwargs}})
    model_state, optimizer_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optim": optimizer_state, "kfac": optimizer.kfac_state()}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    assert optimizer.steps == SAVE_AT
    fsdp_train(model, optimizer, range(SAVE_AT, STEPS), rank, world)
    return full_parameters(model)


def fsdp_scenario_two_ranks(rank: int, world: int, directory: Path) -> dict[str, Any]:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    results: dict[str, Any] = {}
    for fraction in (1.0, 0.5):
        results[f"params {fraction}"] = kfac_run(rank, world, fraction)
        results[f"rows sent {fraction}"] = SENT[fraction]
    results["params keep unsharded"] = kfac_run(rank, world, 1.0, reshard_after_forward=False)
    results["params root only"] = kfac_run(rank, world, 0.5, root_only=True)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    results["params bf16"] = kfac_run(rank, world, 0.5, mp_policy=policy)
    results.update(sgd_runs(rank, world))
    model = sharded_model()
    train_sampled(model,
                  KFAC(model, runtime=RuntimeConfig(grad_worker_fraction=0.5),
                       **{"factor_update_steps": 1, "decomposition_update_steps": 10, **OPTIONS,
                          "curvature": CurvatureConfig(factor_decay=0.9, fisher="sampled")}), range(STEPS), rank, world)
    results["params sampled"] = full_parameters(model)
    model = sharded_model()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    train_sampled(model,
                  KFAC(model, runtime=RuntimeConfig(grad_worker_fraction=0.5),
                       **{"factor_update_steps": 1, "decomposition_update_steps": 10, **OPTIONS,
                          "curvature": CurvatureConfig(factor_decay=0.9, fisher="sampled")}), range(STEPS), rank, world,
                  scaler=scaler)
    results["params sampled grad scaler"] = full_parameters(model)
    model = sharded_model()
    optimizer = KFAC(model, **{"factor_update_steps": 1, "decomposition_update_steps": 10, **OPTIONS})
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    for step in range(STEPS):
        x, y = fsdp_shard(step, rank, world)
        optimizer.zero_grad()
        scaler.scale(F.cross_entropy(model(x), y)).backward()
        scaler.step(optimizer)
        scaler.update()
    results["params grad scaler"] = full_parameters(model)
    from torch.distributed.fsdp import fully_shard

    model = make_token_model()
    fully_shard(model)
    optimizer = KFAC(model, runtime=RuntimeConfig(grad_worker_fraction=0.5),
                     **{"factor_update_steps": 1, "decomposition_update_steps": 10, **OPTIONS})
    results["new blocks"] = sorted(type(block).__name__ for block in optimizer.blocks)
    fsdp_train(model, optimizer, range(STEPS), rank, world, data=token_shard)
    results["params new blocks"] = full_parameters(model)

    from kfac_optim.layers import LinearBlock

    blocks = {Transposed: type("TransposedBlock", (LinearBlock,), {})}
    options = {key: value for key, value in OPTIONS.items() if key != "curvature"}
    curvature = CurvatureConfig(factor_decay=OPTIONS["curvature"].factor_decay, blocks=blocks)
    try:
        KFAC(fully_shard(nn.Sequential(Transposed())), curvature=curvature,
             **{"factor_update_steps": 1, "decomposition_update_steps": 10, **options})
    except ValueError as error:
        results["rows of different lengths error"] = str(error)

    model = sharded_model()
    optimizer = KFAC(model, runtime=RuntimeConfig(grad_worker_fraction=0.5),
                     **{"factor_update_steps": 1, "decomposition_update_steps": 10, **OPTIONS})
    fsdp_train(model, optimizer, range(SAVE_AT), rank, world)
    save_checkpoint(model, optimizer, directory / "dcp")
    plain = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}  # DTensor shards, per rank
    model = sharded_model()
    optimizer = KFAC(model, runtime=RuntimeConfig(grad_worker_fraction=0.5),
                     **{"factor_update_steps": 1, "decomposition_update_steps": 10, **OPTIONS})
    model.load_state_dict(plain["model"])
    optimizer.load_state_dict(plain["optimizer"])
    fsdp_train(model, optimizer, range(SAVE_AT, STEPS), rank, world)
    results["params plain resumed"] = full_parameters(model)

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    column_sharded = distribute_tensor(torch.zeros(4, 4), init_device_mesh("cpu", (world,)), [Shard(1)])
    try:
        mesh_layout(column_sharded)
    except ValueError as error:
        results["column sharding error"] = str(error)
    return results


def fsdp_scenario_four_ranks(rank: int, world: int, directory: Path) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    results: dict[str, Any] = {}
    for fraction in (1.0, 0.5, 0.25):
        results[f"params {fraction}"] = kfac_run(rank, world, fraction)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    for fraction in (0.5, 0.25):
        results[f"params hsdp {fraction}"] = kfac_run(rank, world, fraction, mesh=mesh)
    results["params dcp resumed"] = resume_from_checkpoint(sharded_model(), directory / "dcp", rank, world)
    return results


# -- the control runs and the ranks' results ----------------------------------------------------


@pytest.fixture(scope="module")
def fsdp_two_ranks(module_tmp_path: Path) -> list[dict[str, Any]]:
    return spawn(fsdp_scenario_two_ranks, 2, module_tmp_path, deadline_s=DEADLINE_S)


@pytest.fixture(scope="module")
def fsdp_four_ranks(module_tmp_path: Path, fsdp_two_ranks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    # resumes from the 2-rank DCP checkpoint
    return spawn(fsdp_scenario_four_ranks, 4, module_tmp_path, deadline_s=DEADLINE_S)


@pytest.fixture(scope="module")
def fsdp_reference() -> dict[str, torch.Tensor]:
    """One process, the unsharded model, the concatenated batch."""
    torch.set_num_threads(1)
    model = make_fsdp_net()
    fsdp_train(model, KFAC(model, **{"factor_update_steps": 1, "decomposition_update_steps": 10, **OPTIONS}),
               range(STEPS))
    return full_parameters(model)


@pytest.mark.parametrize("key", ["params 1.0", "params 0.5", "params keep unsharded", "params root only",
                                 "params grad scaler"])
def test_two_fsdp_ranks_equal_one_process_on_the_concatenated_batch(fsdp_two_ranks, fsdp_reference, key: str) -> None:
    for results in fsdp_two_ranks:
        assert_same(results[key], fsdp_reference)


@pytest.mark.parametrize("key", ["params 1.0", "params 0.5", "params 0.25"])
def test_four_fsdp_ranks_equal_one_process_on_the_concatenated_batch(fsdp_four_ranks, fsdp_reference, key: str) -> None:
    for results in fsdp_four_ranks:
        assert_same(results[key], fsdp_reference)


@pytest.mark.parametrize("key", ["params hsdp 0.5", "params hsdp 0.25"])
def test_hsdp_on_a_two_by_two_mesh_equals_one_process(fsdp_four_ranks, fsdp_reference, key: str) -> None:
    for results in fsdp_four_ranks:
        assert_same(results[key], fsdp_reference)


@pytest.mark.parametrize("key", ["params sampled", "params sampled grad scaler"])
def test_sampled_fisher_on_two_fsdp_ranks_equals_one_process_with_the_shards_as_micro_batches(
    fsdp_two_ranks, key
) -> None:
    """``sample_fisher`` back-propagates to the hooked layer outputs, so it records under FSDP2 too
    (differentiating w.r.t. the sharded parameters reached no layer: no statistics at all)."""
    model = make_fsdp_net()
    optimizer = KFAC(model, **{"factor_update_steps": 1, "decomposition_update_steps": 10, **OPTIONS,
                               "curvature": CurvatureConfig(factor_decay=0.9, fisher="sampled")})
    train_sampled(model, optimizer, range(STEPS), micro_batches=2)
    assert all(f.running.abs().sum() > 0 for b in optimizer.blocks for f in b.factors.values())
    for results in fsdp_two_ranks:
        assert_same(results[key], full_parameters(model))


def test_new_block_kinds_on_two_fsdp_ranks_equal_one_process(fsdp_two_ranks) -> None:
    """Embedding, a grouped Conv1d cut inside a group, MultiheadAttention's blocks: each is
    preconditioned whole from its gathered gradient rows, as in one process."""
    torch.set_num_threads(1)
    model = make_token_model()
    optimizer = KFAC(model, **{"factor_update_steps": 1, "decomposition_update_steps": 10, **OPTIONS})
    fsdp_train(model, optimizer, range(STEPS), data=token_shard)
    expected = full_parameters(model)
    kinds = sorted(type(block).__name__ for block in optimizer.blocks)
    assert {"EmbeddingBlock", "ConvBlock", "InProjectionBlock", "OutProjectionBlock"} <= set(kinds)
    sgd_only = make_token_model()
    fsdp_train(sgd_only, torch.optim.SGD(sgd_only.parameters(), **SGD_OPTIONS), range(STEPS), data=token_shard)
    assert any(not torch.allclose(sgd_only.state_dict()[k], expected[k], **TOLERANCE) for k in expected)
    for results in fsdp_two_ranks:
        assert results["new blocks"] == kinds
        assert_same(results["params new blocks"], expected)


def test_a_block_whose_parameters_differ_in_rows_is_rejected_under_fsdp_naming_it(fsdp_two_ranks) -> None:
    """FSDP2 moves rows (dim 0) of a layer's parameters together: a block whose bias is not
    row-aligned with its weight cannot be gathered that way, and says so at construction."""
    for results in fsdp_two_ranks:
        message = results["rows of different lengths error"]
        assert "'0'" in message and "TransposedBlock" in message and "FSDP2" in message and "(4, 2)" in message


def test_bf16_parameters_with_fp32_reduction_stay_close_to_fp32(fsdp_two_ranks, fsdp_reference) -> None:
    """MixedPrecisionPolicy computes forward and backward in bf16: close to fp32, not equal."""
    sgd_only = make_fsdp_net()
    fsdp_train(sgd_only, torch.optim.SGD(sgd_only.parameters(), **SGD_OPTIONS), range(STEPS))
    for results in fsdp_two_ranks:
        assert_same(results["params bf16"], fsdp_reference, rtol=0.0, atol=2e-2)
        drift = max((results["params bf16"][k] - fsdp_reference[k]).abs().max() for k in fsdp_reference)
        assert drift < max((sgd_only.state_dict()[k] - fsdp_reference[k]).abs().max() for k in fsdp_reference)


def test_kfac_without_preconditioning_is_bit_identical_to_sgd_on_the_same_fsdp_model(fsdp_two_ranks) -> None:
    for results in fsdp_two_ranks:
        assert_same(results["kfac off"], results["torch sgd"], rtol=0, atol=0)


def test_plain_state_dict_of_sharded_kfac_resumes_on_the_same_ranks(fsdp_two_ranks, fsdp_reference) -> None:
    for results in fsdp_two_ranks:
        assert_same(results["params plain resumed"], fsdp_reference)


def test_dcp_checkpoint_from_two_fsdp_ranks_resumes_on_four(fsdp_four_ranks, fsdp_reference) -> None:
    for results in fsdp_four_ranks:
        assert_same(results["params dcp resumed"], fsdp_reference)


SINGLE_PROCESS_DCP = "ignore:torch.distributed is disabled:UserWarning"  # DCP's note that it loads in one process


@pytest.mark.filterwarnings(SINGLE_PROCESS_DCP)
def test_dcp_checkpoint_from_two_fsdp_ranks_loads_in_one_process(
    fsdp_two_ranks, module_tmp_path, fsdp_reference
) -> None:
    assert_same(resume_from_checkpoint(make_fsdp_net(), module_tmp_path / "dcp"), fsdp_reference)


@pytest.mark.filterwarnings(SINGLE_PROCESS_DCP)
def test_dcp_checkpoint_holds_global_factors_by_module_name(fsdp_two_ranks, module_tmp_path) -> None:
    """What DCP wrote: one copy of each layer's global factors, keyed by its name; no decompositions."""
    import torch.distributed.checkpoint as dcp

    model = make_fsdp_net()
    optimizer = KFAC(model, **{"factor_update_steps": 1, "decomposition_update_steps": 10, **OPTIONS})
    fsdp_train(model, optimizer, range(SAVE_AT))
    expected = optimizer.kfac_state_dict()
    metadata = dcp.FileSystemReader(str(module_tmp_path / "dcp")).read_metadata()
    kfac_keys = {key for key in metadata.state_dict_metadata if key.startswith("kfac.")}
    assert "kfac.blocks.fc1.factors.G.running" in kfac_keys
    assert not any("decomposition" in key for key in kfac_keys)
    state = {"kfac": optimizer.kfac_state()}
    for block in optimizer.blocks:  # load into zeroed factors: everything comes from the file
        for factor in block.factors.values():
            factor.running.zero_()
    dcp.load(state, checkpoint_id=module_tmp_path / "dcp")
    for block in optimizer.blocks:
        for name, factor in block.factors.items():
            saved = expected["blocks"][block.name]["factors"][name]["running"]  # packed
            torch.testing.assert_close(factor.packed_running(), saved, **TOLERANCE)


def test_parameters_sharded_other_than_by_rows_are_rejected_naming_the_placements(fsdp_two_ranks) -> None:
    """Tensor parallelism's column sharding (Shard(1)) is not FSDP2's layout: a clear error."""
    for results in fsdp_two_ranks:
        assert "Shard(0)" in results["column sharding error"] and "Shard(dim=1)" in results["column sharding error"]


@pytest.mark.parametrize("fraction", [1.0, 0.5])
def test_rows_sent_match_the_bytes_comm_bytes_counts(fsdp_two_ranks, fraction: float) -> None:
    """What the ranks handed to gather/scatter equals benchmarks.comm_bytes' count, every step."""
    from benchmarks.comm_bytes import fsdp_bytes
    from kfac_optim.optimizer import block_dims

    per_step = fsdp_bytes(block_dims(make_fsdp_net()), param_bytes=0, world=2, fraction=fraction)
    sent = sum(results[f"rows sent {fraction}"] for results in fsdp_two_ranks)
    assert sent == STEPS * 2 * per_step["kfac_rows_per_step_mean"] > 0


# -- Join: refused with sharded layers ----------------------------------------------------------

JOIN_DEADLINE_S = 60.0  # the scenario runs no step: nothing can wait on a rank that joined


def fsdp_join_scenario(rank: int, world: int, directory: Path) -> dict[str, Any]:
    """``Join([optimizer])`` on the sharded model at grad-worker fractions 1 and 1/2: what the
    construction raises (None: nothing). No step runs, so a missing refusal cannot hang."""
    from torch.distributed.algorithms.join import Join

    results: dict[str, Any] = {}
    for fraction in (1.0, 0.5):
        model = sharded_model()
        optimizer = KFAC(model, runtime=RuntimeConfig(grad_worker_fraction=fraction),
                         **{"factor_update_steps": 1, "decomposition_update_steps": 10, **OPTIONS})
        results[f"strategy {fraction}"] = type(optimizer.estimator.strategy).__name__
        try:
            Join([optimizer])
            results[f"refused {fraction}"] = None
        except ValueError as error:
            results[f"refused {fraction}"] = str(error)
    return results


@pytest.fixture(scope="module")
def fsdp_join(module_tmp_path: Path) -> list[dict[str, Any]]:
    return spawn(fsdp_join_scenario, 2, module_tmp_path, deadline_s=JOIN_DEADLINE_S)


@pytest.mark.parametrize("fraction", [1.0, 0.5])
def test_join_with_fsdp2_sharded_layers_is_refused_when_built_naming_fsdp2(fsdp_join, fraction: float) -> None:
    """A rank that joined could not take part in the row path's gathers and sums over shards (nor
    FSDP2 in its own collectives): ``Join`` is refused on every rank before any step, naming FSDP2,
    also where the grad-worker fraction alone would be refused."""
    for rank in fsdp_join:
        assert rank[f"strategy {fraction}"] == "RowSharded"
        message = rank[f"refused {fraction}"]
        assert message is not None, "Join([optimizer]) on an FSDP2-sharded model was accepted"
        assert message.startswith("KFAC under Join needs whole parameters on every rank"), message
        assert "FSDP2" in message, message
