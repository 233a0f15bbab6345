"""DeepSpeed's offloads read as-is (fsdp_zero/config/deepspeed.py): offload_optimizer onto
offload.states, offload.path, offload.ratio, offload.prefetch and offload.pin_memory, offload_param
onto parallel.cpu_offload, and aio's keys, each listed with what happens instead. (The ZeRO-3
tutorial's config trains with its states on NVMe: tests/test_deepspeed.py.)

Covers: fsdp_zero/config/deepspeed.py
"""

from __future__ import annotations

from fsdp_zero.config.loader import load_config
from tests.test_deepspeed import NO_SCHEDULER
from tests.test_deepspeed import _read as _read_all


def _read(tmp_path, ds: dict) -> tuple[list[str], list[str]]:  # noqa: ANN001
    """`tests.test_deepspeed._read` without the constant schedule of a ds_config with no scheduler."""
    mapped, notes = _read_all(tmp_path, ds)
    return [m for m in mapped if m not in NO_SCHEDULER], notes


def _offload(offload_optimizer: dict | None = None, offload_param: dict | None = None) -> dict:
    """A ZeRO-3 ds_config with these offload sections."""
    zero: dict = {"stage": 3}
    if offload_optimizer is not None:
        zero["offload_optimizer"] = offload_optimizer
    if offload_param is not None:
        zero["offload_param"] = offload_param
    return {"zero_optimization": zero}


def test_deepspeeds_offloads_map_onto_offload_states_and_cpu_offload(tmp_path):
    """offload_optimizer is offload.states (cpu; nvme: disk under nvme_path) with its ratio,
    buffer_count and pin_memory; offload_param cpu is FSDP2's CPU offload, and with it
    offload_optimizer cpu adds nothing (the states are on the host already)."""
    nvme = str(tmp_path)

    def offload(ds: dict) -> tuple[list[str], tuple, list[str]]:
        """The overrides after parallel.zero_stage=3, where the Config they load puts things
        (cpu_offload, then offload's states, path, ratio, prefetch, pin_memory), and the notes."""
        mapped, notes = _read(tmp_path, ds)
        cfg = load_config(None, mapped)
        o = cfg.offload
        where = (
            cfg.parallel.cpu_offload,
            o.states.value,
            o.path,
            o.ratio,
            o.prefetch,
            o.pin_memory,
        )
        return mapped[1:], where, notes

    assert offload(_offload({"device": "cpu"})) == (
        ["offload.states=cpu"],
        (False, "cpu", None, 1.0, 1, True),
        [],
    )
    # DeepSpeed's buffers hold a tensor each, 4 a sub-group in flight: 12 are 3 groups in flight,
    # 2 read ahead of the one stepping
    settings = {"ratio": 0.25, "buffer_count": 12, "pin_memory": False}
    assert offload(_offload({"device": "cpu", **settings})) == (
        [
            "offload.states=cpu",
            "offload.ratio=0.25",
            "offload.prefetch=2",
            "offload.pin_memory=false",
        ],
        (False, "cpu", None, 0.25, 2, False),
        [],
    )
    assert offload(_offload({"device": "nvme", "nvme_path": nvme, **settings}))[1] == (
        False,
        "disk",
        nvme,
        0.25,
        2,
        False,
    )
    # buffer_count: DeepSpeed's default 4 (one sub-group in flight) and fewer read one group
    # ahead; 8 (pipeline_read's two) too; 16 read three ahead
    for count, prefetch in ((0, 1), (4, 1), (7, 1), (8, 1), (16, 3)):
        ds = _offload({"device": "nvme", "nvme_path": nvme, "buffer_count": count})
        assert offload(ds)[1][4] == prefetch, count
    # offload_param cpu: parallel.cpu_offload; with offload_optimizer cpu nothing more, and the
    # optimizer's settings are noted as without effect; with nvme the states go on to files.
    both = offload(_offload({"device": "cpu", "pin_memory": True}, {"device": "cpu"}))
    assert both[:2] == (["parallel.cpu_offload=true"], (True, "none", None, 1.0, 1, True))
    assert both[2] == [
        "ds_config zero_optimization.offload_optimizer.pin_memory=true: no effect; "
        "zero_optimization.offload_optimizer.device is cpu under "
        "zero_optimization.offload_param.device cpu (parallel.cpu_offload: the states on the host)"
    ]
    assert offload(_offload({"device": "nvme", "nvme_path": nvme}, {"device": "cpu"}))[:2] == (
        ["parallel.cpu_offload=true", "offload.states=disk", f"offload.path={nvme}"],
        (True, "disk", nvme, 1.0, 1, True),
    )
    assert offload(_offload(None, {"device": "cpu"}))[:2] == (
        ["parallel.cpu_offload=true"],
        (True, "none", None, 1.0, 1, True),
    )
    # none (any case) is no offload; the settings then, and a path without nvme, are noted
    for ds, tier in (
        (_offload({"device": "none", "ratio": 0.5}, {"device": "None"}), "none"),
        (_offload({"ratio": 0.5}), "none"),
        (_offload({"device": "cpu", "nvme_path": nvme}), "cpu"),
    ):
        _, where, notes = offload(ds)
        assert where == (False, tier, None, 1.0, 1, True), ds
        assert len(notes) == 1, notes
        assert f": no effect; zero_optimization.offload_optimizer.device is {tier}" in notes[0]
    # sub_group_size is offload's swap unit (optim.step_group_size), whatever the device
    mapped, _ = _read(
        tmp_path,
        {"zero_optimization": {"sub_group_size": 5000, "offload_optimizer": {"device": "cpu"}}},
    )
    assert mapped == ["offload.states=cpu", "optim.step_group_size=5000"]


def test_aio_and_the_offload_keys_that_do_nothing_here_are_each_listed(tmp_path):
    """DeepSpeed's asynchronous I/O (aio) and the NVMe pool's sizes are accepted; each key has a
    line saying what the disk tier does instead."""
    aio = {
        "block_size": 1048576,
        "queue_depth": 8,
        "thread_count": 1,
        "intra_op_parallelism": 1,
        "single_submit": False,
        "overlap_events": True,
        "use_gds": False,
    }
    optimizer = {"fast_init": False, "pipeline_read": True, "pipeline_write": True}
    param = {"pin_memory": True, "buffer_count": 5, "buffer_size": 1e8, "max_in_cpu": 1e9}
    ds = _offload(
        {"device": "nvme", "nvme_path": str(tmp_path), **optimizer},
        {"device": "cpu", "nvme_path": str(tmp_path), **param},
    )
    mapped, notes = _read(tmp_path, ds | {"aio": aio})
    assert mapped[-2:] == ["offload.states=disk", f"offload.path={tmp_path}"]
    keys = [f"aio.{k}" for k in aio] + [
        f"zero_optimization.{section}.{k}"
        for section, settings in (
            ("offload_optimizer", optimizer),
            ("offload_param", param | {"nvme_path": 0}),
        )
        for k in settings
    ]
    assert sorted(n.split("=")[0] for n in notes) == sorted(f"ds_config {k}" for k in keys)
    assert all(": no effect; " in n and "\n" not in n for n in notes)
    assert (
        "ds_config aio.thread_count=1: no effect; one I/O thread per rank (preadv/pwritev, no "
        "libaio), each file synced and dropped from the page cache after its group" in notes
    )
