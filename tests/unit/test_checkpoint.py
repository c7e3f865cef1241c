"""A killed learner resumes bit-exactly from its safetensors checkpoint."""

import pytest
import torch

from ftis.client.learner.checkpoint import load_checkpoint, save_checkpoint
from ftis.client.learner.trainer import Learner, LearnerConfig
from ftis.client.rollout.groups import RolloutGroup

GROUP = RolloutGroup([1, 5, 6], [[7, 8, 2], [9, 2]], [[-1.0, -2.0, -0.5], [-3.0, -0.1]],
                     [1.0, 0.0], local=True)


@pytest.mark.parametrize("peft", ["none", "lora"])
def test_resume_continues_identically(tmp_path, tiny_policy_factory, peft):
    a = tiny_policy_factory(peft)
    la = Learner(a.model, LearnerConfig(learning_rate=1e-3), 0)
    la.step([GROUP])
    save_checkpoint(tmp_path, 1, a.model, la.optimizer, {"cursor": 5})
    assert not any(p.suffix == ".pt" or p.suffix == ".bin" for p in tmp_path.rglob("*"))

    b = tiny_policy_factory(peft)  # fresh weights, as after a restart
    lb = Learner(b.model, LearnerConfig(learning_rate=1e-3), 0)
    state = load_checkpoint(tmp_path, b.model, lb.optimizer)
    assert state["round"] == 1 and state["extra"] == {"cursor": 5}
    for pa, pb in zip(a.model.parameters(), b.model.parameters(), strict=True):
        assert torch.equal(pa, pb)
    ma, mb = la.step([GROUP]), lb.step([GROUP])
    assert ma["loss"] == mb["loss"]
    for pa, pb in zip(a.model.parameters(), b.model.parameters(), strict=True):
        torch.testing.assert_close(pa, pb, atol=0, rtol=0)


def test_no_checkpoint_and_mismatched_model(tmp_path, tiny_policy_factory):
    full = tiny_policy_factory("none")
    lf = Learner(full.model, LearnerConfig(), 0)
    assert load_checkpoint(tmp_path, full.model, lf.optimizer) is None
    save_checkpoint(tmp_path, 3, full.model, lf.optimizer, {})
    lora = tiny_policy_factory("lora")
    with pytest.raises(ValueError, match="different model"):
        load_checkpoint(tmp_path, lora.model, Learner(lora.model, LearnerConfig(), 0).optimizer)


def test_only_latest_two_kept(tmp_path, tiny_policy_factory):
    pol = tiny_policy_factory()
    opt = Learner(pol.model, LearnerConfig(), 0).optimizer
    for r in range(1, 5):
        save_checkpoint(tmp_path, r, pol.model, opt, {})
    assert sorted(p.name for p in tmp_path.glob("step-*")) == ["step-000003", "step-000004"]
    assert (tmp_path / "latest").read_text() == "step-000004"
