"""The estimator reads as the step (issue 27): its modes are objects chosen once at construction.

``estimator.py`` keeps the step's verbs and hands the modes to the statistics pipeline, the fold
schedule, the decomposition steps and the reporter; it never reaches the machinery of a mode itself (the
statistics worker, the background decompositions, the stagger phases, FSDP2's rows, the capture).
"""

from __future__ import annotations

from test_import_graph import SOURCE, import_graph

MODE_OBJECTS = ("statistics_pipeline", "fold_schedule", "decomposition_steps", "reporter", "directions")


def test_the_estimator_is_short_and_its_mode_objects_are_modules_of_their_own() -> None:
    lines = {name: len((SOURCE / f"{name}.py").read_text(encoding="utf-8").splitlines())
             for name in ("estimator", *MODE_OBJECTS)}
    assert lines["estimator"] <= 400, lines
    assert max(lines.values()) <= 500, lines


def test_the_estimator_reaches_no_mode_machinery_directly() -> None:
    imports = import_graph()["kfac_optim.estimator"]
    machinery = {"kfac_optim.statistics_worker", "kfac_optim.background", "kfac_optim.stagger",
                 "kfac_optim.distributed.fsdp", "kfac_optim.capture"}
    assert not imports & machinery, sorted(imports & machinery)
    assert {f"kfac_optim.{name}" for name in MODE_OBJECTS} <= imports
