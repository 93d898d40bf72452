"""The estimator reads as the step: its modes are objects chosen once at construction.

``estimator/estimator.py`` keeps the step's verbs and hands the modes to the statistics pipeline, the fold
schedule, the decomposition steps and the reporter; it never reaches the machinery of a mode itself (the
statistics worker, the background decompositions, the stagger phases, FSDP2's rows, the capture).
"""

from __future__ import annotations

from test_import_graph import SOURCE, import_graph

MODE_OBJECTS = ("estimator/pipeline", "estimator/folds", "estimator/decomposition_steps", "reporter",
                "update/directions")


def test_the_estimator_is_short_and_its_mode_objects_are_modules_of_their_own() -> None:
    lines = {name: len((SOURCE / f"{name}.py").read_text(encoding="utf-8").splitlines())
             for name in ("estimator/estimator", *MODE_OBJECTS)}
    assert lines["estimator/estimator"] <= 400, lines
    assert max(lines.values()) <= 500, lines


def test_the_estimator_reaches_no_mode_machinery_directly() -> None:
    imports = import_graph()["kfac_optim.estimator.estimator"]
    machinery = {"kfac_optim.background.statistics", "kfac_optim.background.decompositions",
                 "kfac_optim.estimator.stagger",
                 "kfac_optim.distributed.fsdp", "kfac_optim.capture.hooks"}
    assert not imports & machinery, sorted(imports & machinery)
    assert {"kfac_optim." + name.replace("/", ".") for name in MODE_OBJECTS} <= imports
