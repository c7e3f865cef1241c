"""Where the client's model runs (``--device``): the choice, the batches' move, the refusal."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError
from typer.testing import CliRunner

from ftis.client.learner.batch import Sample, pack
from ftis.client.node.config import ClientConfig
from ftis.client.node.runtime import DeviceUnavailableError, choose_device
from ftis.protocol.exit_codes import ExitCode

GiB = 2**30


@pytest.mark.parametrize(("requested", "memory", "expected"), [
    ("auto", [], "cpu"),
    ("auto", [8 * GiB], "cuda"),
    ("auto", [8 * GiB] * 4, "cuda"),
    ("cpu", [], "cpu"),
    ("cpu", [8 * GiB] * 2, "cpu"),
    ("cuda", [8 * GiB], "cuda"),
    ("cuda:0", [8 * GiB], "cuda:0"),
    ("cuda:3", [8 * GiB] * 4, "cuda:3"),
])
def test_choose_device(requested, memory, expected):
    assert choose_device(requested, memory) == (expected, "")
    # a round that fits changes nothing
    assert choose_device(requested, memory, needed=GiB) == (expected, "")


def test_auto_keeps_a_round_that_does_not_fit_the_gpu_on_the_cpu():
    device, note = choose_device("auto", [4 * GiB], needed=6 * GiB)
    assert device == "cpu"
    assert note.startswith("a round needs about 6.0 GiB, more than the GPU's 4.0 GiB")
    assert choose_device("auto", [4 * GiB], needed=4 * GiB) == ("cuda", "")  # exactly fits
    # asked for by name, the GPU is used whatever the estimate says
    assert choose_device("cuda", [4 * GiB], needed=6 * GiB) == ("cuda", "")


@pytest.mark.parametrize(("requested", "memory", "says"), [
    ("cuda", [], "no CUDA device is visible"),
    ("cuda:0", [], "no CUDA device is visible"),
    ("cuda:1", [8 * GiB], "1 CUDA device(s) visible"),
])
def test_a_cuda_device_that_is_not_there_is_refused(requested, memory, says):
    with pytest.raises(DeviceUnavailableError, match=r"requested but") as err:
        choose_device(requested, memory)
    assert says in str(err.value)


def test_the_device_need_leaves_the_host_baseline_out():
    from ftis.client.node.memory import MemoryEstimate, device_round_peak

    estimate = MemoryEstimate(phases={
        "load": {"baseline": 500, "weights": 9000},
        "generation": {"baseline": 500, "weights": 1000, "kv_cache": 300},
        "learning": {"baseline": 500, "weights": 1000, "optimizer": 3000, "logits": 700},
    }, phase="load")
    # the larger round phase is learning (5200 bytes), less its 500 bytes of baseline;
    # loading (once, before the first round) does not count
    assert device_round_peak(estimate) == 4700


def test_the_setting_accepts_only_the_documented_forms():
    assert ClientConfig().device == "auto"
    assert ClientConfig(device="cuda:2").device == "cuda:2"
    for bad in ("gpu", "cuda:", "cuda:x", "CUDA", "mps"):
        with pytest.raises(ValidationError):
            ClientConfig(device=bad)
    with pytest.raises(ValueError, match="auto, cpu, cuda or cuda:N"):
        choose_device("gpu", [GiB])


def test_a_packed_batch_moves_every_tensor_and_keeps_its_shape():
    samples = [Sample([1, 2, 3], [4, 5], [-0.5, -1.0], 1.0, True),
               Sample([1, 2, 3], [6], [-2.0], -1.0, True)]
    batch = pack(samples, 0)
    moved = batch.to("meta")
    for name in ("input_ids", "attention_mask", "position_ids", "targets",
                 "completion_mask", "gen_logprobs", "advantages"):
        before, after = getattr(batch, name), getattr(moved, name)
        assert after.device.type == "meta", name
        assert after.shape == before.shape and after.dtype == before.dtype, name
    assert moved.gen_sequence_logprobs is None  # an absent tensor stays absent
    assert (moved.logits_to_keep, moved.shared_prompt_len) == (3, 3)
    assert batch.input_ids.device.type == "cpu"  # the original is untouched
    same = batch.to("cpu")
    assert same.input_ids is batch.input_ids  # already there: no copy


def test_start_refuses_a_cuda_device_that_is_not_there(tmp_path, tiny_model_dir,
                                                       monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device")
    from ftis.client.cli.main import app
    from ftis.client.swarm import connection

    def boom(*a: object, **k: object) -> None:
        raise AssertionError("tried to connect")

    monkeypatch.setattr(connection.SwarmConnection, "__init__", boom)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    key = tmp_path / "key.pem"
    result = CliRunner().invoke(app, [
        "start", "--device", "cuda", "--model", str(tiny_model_dir), "--coordinator",
        "127.0.0.1:9", "--key-file", str(key), "--out", str(tmp_path / "o")])
    assert result.exit_code == ExitCode.CLIENT_DEVICE_UNAVAILABLE == 57, result.output
    assert "no CUDA device is visible" in " ".join(result.output.split())
    assert not key.exists()  # refused before the identity, the model or the connection
