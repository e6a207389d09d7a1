"""`TransomCheckpoints` snapshots a real `transformers` Trainer every step, and
`resume_checkpoint` turns a snapshot back into a folder the Trainer resumes from in its own
formats (hf_state.py): a Trainer stopped at step 5 and resumed from its step-5 snapshot ends
with the weights, bit for bit, of one that never stopped. Without a launcher the engine runs its
server inside the test's process (memory, then storage when it closes)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from conftest import skip_unless_installed

skip_unless_installed("transformers")
import torch  # noqa: E402

pytestmark = pytest.mark.integration

STEPS, STOP = 8, 5


def _trainer(out: Path, callbacks: list, nan_step: int = -1, save_steps: int = 0):
    from scripts.hf_parts import Tokens, tiny_gpt2
    from transformers import Trainer, TrainingArguments

    model = tiny_gpt2()

    def blow_up(module, inputs, output):
        if module.training and trainer.state.global_step + 1 == nan_step:
            output["loss"] = output["loss"] * math.nan
        return output

    model.register_forward_hook(blow_up)
    args = TrainingArguments(
        output_dir=str(out),
        max_steps=STEPS,
        per_device_train_batch_size=4,
        learning_rate=1e-3,
        logging_steps=1000,
        save_strategy="steps" if save_steps else "no",
        save_steps=save_steps or 500,
        report_to="none",
        use_cpu=True,
        disable_tqdm=True,
        dataloader_num_workers=0,
        seed=0,
    )
    trainer = Trainer(model=model, args=args, train_dataset=Tokens(), callbacks=callbacks)
    return trainer


def _stop_at(step: int):
    from transformers import TrainerCallback

    class Stop(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == step:
                control.should_training_stop = True

    return Stop()


def _weights(trainer) -> dict:
    return {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}


def test_a_trainer_resumed_from_a_step_snapshot_ends_bit_identical(tmp_path, monkeypatch):
    from transom.common import env
    from transom.integrations import hf

    monkeypatch.setenv(env.CHECKPOINT_DIR, str(tmp_path / "ckpt"))
    reference = _trainer(tmp_path / "ref", [])
    reference.train()
    expected = _weights(reference)

    first = _trainer(
        tmp_path / "out", [hf.TransomCallback(), hf.TransomCheckpoints(), _stop_at(STOP)]
    )
    first.train()  # its end closes the engine: the newest snapshot goes to storage
    assert first.state.global_step == STOP
    monkeypatch.setenv(env.RESTORE_STEP, str(STOP))  # the controller's choice: the newest listed
    folder = hf.resume_checkpoint(tmp_path / "out")
    assert folder is not None and folder.endswith(f"checkpoint-{STOP}")
    names = {p.name for p in Path(folder).iterdir()}
    assert {"pytorch_model.bin", "optimizer.pt", "scheduler.pt", "trainer_state.json"} <= names
    assert "rng_state.pth" in names

    second = _trainer(tmp_path / "out", [hf.TransomCallback(), hf.TransomCheckpoints()])
    second.train(resume_from_checkpoint=folder)
    assert second.state.global_step == STEPS
    got = _weights(second)
    assert got.keys() == expected.keys()
    assert all(torch.equal(got[k], expected[k]) for k in expected)


def test_a_step_whose_loss_is_not_finite_is_not_snapshotted(tmp_path, monkeypatch):
    from transom.common import env
    from transom.integrations import hf

    monkeypatch.setenv(env.CHECKPOINT_DIR, str(tmp_path / "ckpt"))
    saved: list[int] = []
    real_save = hf.engine().save

    def save(step, state, **kwargs):
        saved.append(step)
        return real_save(step, state, **kwargs)

    monkeypatch.setattr(hf.engine(), "save", save)
    trainer = _trainer(
        tmp_path / "out", [hf.TransomCallback(), hf.TransomCheckpoints()], nan_step=3
    )
    trainer.train()
    # Step 3's loss is NaN and so is every later one (the weights are poisoned from step 3 on).
    assert saved == [1, 2]


def test_a_state_that_cannot_be_snapshotted_falls_back_to_the_trainer_s_folders(
    tmp_path, monkeypatch
):
    """A Trainer state the engine cannot hold (here: an object in it) is not a failure: a
    warning, and the checkpoint folders the Trainer saves go through the engine instead."""
    from transom.common import env
    from transom.integrations import hf, hf_state

    monkeypatch.setenv(env.CHECKPOINT_DIR, str(tmp_path / "ckpt"))
    real_snapshot = hf_state.snapshot
    monkeypatch.setattr(hf_state, "snapshot", lambda *a: {**real_snapshot(*a), "custom": object()})
    reference = _trainer(tmp_path / "ref", [])
    reference.train()
    expected = _weights(reference)

    callbacks = [hf.TransomCallback(), hf.TransomCheckpoints(), _stop_at(STOP)]
    first = _trainer(tmp_path / "out", callbacks, save_steps=STOP)
    first.train()
    assert callbacks[1].every_step is False
    monkeypatch.setenv(env.RESTORE_STEP, str(STOP))
    folder = hf.resume_checkpoint(tmp_path / "out")
    assert folder is not None and (Path(folder) / "model.safetensors").is_file()  # the Trainer's
    second = _trainer(tmp_path / "out", [])
    second.train(resume_from_checkpoint=folder)
    got = _weights(second)
    assert all(torch.equal(got[k], expected[k]) for k in expected)
