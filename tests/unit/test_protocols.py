"""The loop's seams are typed: the real trainer, its multi-rank driver and both routers implement the protocols the
controller, the publishers, the checkpointer and the strategies call (megarl/trainer/base.py, megarl/rollout/base.py),
so nothing needs to probe them with getattr/hasattr."""
import asyncio

import pytest
from recovery_scorer import HFScorerForTests, tiny_checkpoint

from megarl.loop.spmd import ControlChannel, DrivingTrainer
from megarl.rollout.base import RouterProtocol
from megarl.rollout.client import EngineClient
from megarl.rollout.router import EngineRouter
from megarl.rollout.supervisor import EngineSupervisor
from megarl.trainer.base import ScoringTrainer, TrainerProtocol
from megarl.trainer.megatron_trainer import MegatronTrainer
from megarl.trainer.parallel import init_distributed


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "ckpt")


def test_both_routers_are_router_protocols():
    client = EngineClient("http://127.0.0.1:9")  # nothing is sent: only the objects' interfaces are checked
    router = EngineRouter([client])
    assert isinstance(router, RouterProtocol) and router.failure is None and router.stats() == {"n_engines_live": 1}
    asyncio.run(router.wait_available())  # returns at once: nothing is ever lost without supervision
    supervisor = EngineSupervisor([(None, client)], launch=None, weights=("/nowhere", 0))
    assert isinstance(supervisor, RouterProtocol) and supervisor.failure is None
    # a bare engine is not a router: the loop could not wait for it or report on it
    assert not isinstance(client, RouterProtocol)


def test_megatron_trainer_is_both_protocols_and_the_driver_only_the_loop_one(ckpt):
    trainer = MegatronTrainer(str(ckpt), micro_batch_tokens=64)
    assert isinstance(trainer, TrainerProtocol) and isinstance(trainer, ScoringTrainer)
    assert (trainer.version, trainer.last_skip_reason, trainer.dtype, trainer.temperature) == (0, None, "float32", 1.0)
    init_distributed()
    driver = DrivingTrainer(trainer, ControlChannel())
    assert isinstance(driver, TrainerProtocol) and not isinstance(driver, ScoringTrainer)
    assert (driver.version, driver.last_skip_reason) == (0, None)
    assert driver.exported_hf_config() == trainer.exported_hf_config()


def test_the_test_stand_in_is_a_scoring_trainer(ckpt):
    assert isinstance(HFScorerForTests(ckpt), ScoringTrainer)
