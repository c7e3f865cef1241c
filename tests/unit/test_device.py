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


@pytest.mark.parametrize(("requested", "visible", "expected"), [
    ("auto", 0, "cpu"),
    ("auto", 1, "cuda"),
    ("auto", 4, "cuda"),
    ("cpu", 0, "cpu"),
    ("cpu", 2, "cpu"),
    ("cuda", 1, "cuda"),
    ("cuda:0", 1, "cuda:0"),
    ("cuda:3", 4, "cuda:3"),
])
def test_choose_device(requested, visible, expected):
    assert choose_device(requested, visible) == expected


@pytest.mark.parametrize(("requested", "visible", "says"), [
    ("cuda", 0, "no CUDA device is visible"),
    ("cuda:0", 0, "no CUDA device is visible"),
    ("cuda:1", 1, "1 CUDA device(s) visible"),
])
def test_a_cuda_device_that_is_not_there_is_refused(requested, visible, says):
    with pytest.raises(DeviceUnavailableError, match=r"requested but") as err:
        choose_device(requested, visible)
    assert says in str(err.value)


def test_the_setting_accepts_only_the_documented_forms():
    assert ClientConfig().device == "auto"
    assert ClientConfig(device="cuda:2").device == "cuda:2"
    for bad in ("gpu", "cuda:", "cuda:x", "CUDA", "mps"):
        with pytest.raises(ValidationError):
            ClientConfig(device=bad)
    with pytest.raises(ValueError, match="auto, cpu, cuda or cuda:N"):
        choose_device("gpu", 1)


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
