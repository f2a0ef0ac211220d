"""A one-trainer pipeline's ranks run on the devices its config names (logical GPUs of the session's Ray)
and give them back when it ends. SFT here; DPO (with its reference worker) and offline distillation (with
its teacher) place their ranks the same way (``TrainerPipeline``), and their configs' checks are in
test_dpo and test_distill."""

from __future__ import annotations

import pytest

from roll.config import load_config
from roll.distributed.placement import DeviceTable
from roll.pipelines.sft import SFTPipeline

pytestmark = pytest.mark.usefixtures("ray_session", "at_repo_root")


@pytest.mark.slow  # a whole SFT pipeline's workers
def test_sft_ranks_run_on_their_mapped_devices_and_give_them_back(tmp_path) -> None:
    """SFT's two trainer ranks see exactly their mapped logical GPUs, and the run gives the devices back
    at shutdown. It starts a whole SFT pipeline's workers."""
    overrides = [f"output_dir={tmp_path / 'run'}", "train.device_mapping=[2,3]", "ray.num_gpus=4"]
    pipeline = SFTPipeline(load_config("examples/sft.yaml", overrides))
    try:
        visible = [ping["cuda_visible_devices"] for ping in pipeline.actor.ping()]
        assert visible == [pipeline.role_set.device_table.slot(index).gpu_id for index in (2, 3)]
    finally:
        pipeline.shutdown()
    # Released: another run can reserve every device again.
    table = DeviceTable.create(timeout_s=60)
    assert table.num_devices == 4
    table.remove()
