"""Which engine and which objective a run's settings ask for. The engines' modules are imported here only
when chosen: an FSDP2 run never imports DeepSpeed."""

from __future__ import annotations

from shardconsole.backends.engine import frozen_copy
from shardconsole.backends.engine.contract import Engine
from shardconsole.backends.objective import kto, preference
from shardconsole.backends.objective.base import Objective
from shardconsole.backends.rank.common import Rank


def objective(r: Rank) -> Objective:
    if r.cfg.train.objective == "kto":
        return kto.Kto(r)
    return frozen_copy.attach(preference.make(r), r)


def engine(r: Rank) -> Engine:
    if r.cfg.parallel.backend == "deepspeed":
        from shardconsole.backends.engine.ds_engine import DeepSpeedEngine
        return DeepSpeedEngine(r, objective(r))
    from shardconsole.backends.engine.fsdp_engine import FsdpEngine
    return FsdpEngine(r, objective(r))
