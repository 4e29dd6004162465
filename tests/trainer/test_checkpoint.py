"""Policy-version checkpoints: atomic folders, pruning, and a resumed PolicyTrainer that continues
exactly where the first one stopped (weights, AdamW state, version)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from rollstream.exceptions import RollstreamError
from rollstream.policy.model import load_weights_into
from rollstream.trainer.batch import build_batch
from rollstream.trainer.checkpoint import OPTIMIZER_FILE, SPARE_OPTIMIZER, STATE_FILE, CheckpointStore, snapshot
from rollstream.trainer.corrections import TrainInferCorrectionConfig
from rollstream.trainer.policy_trainer import PolicyTrainer, TrainSettings

from . import records
from tests.tiny_models import tiny_model


def group(key: str, offset: int, version: int = 0) -> dict:
    prompt = [1, 2 + offset, 3]
    return records.rlvr_group(key, [
        records.rewarded(records.response_payload(key, i, prompt, [10 + i + offset, 20 + offset, 30 + i],
                                                  [-4.1, -4.2, -4.0], version=version), float(i == 0))
        for i in range(2)])


def batch(step: int, version: int = 0):
    return build_batch([group(f"g{step}a", step, version), group(f"g{step}b", step + 5, version)], step=step,
                       pad_token_id=0)


def trainer(store: CheckpointStore | None) -> PolicyTrainer:
    return PolicyTrainer(TrainSettings(lr=1e-2, micro_batch_size=2), TrainInferCorrectionConfig(),
                         model=tiny_model(), checkpoints=store)


def weights(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_a_resumed_trainer_continues_bit_for_bit(tmp_path):
    """One trainer taking steps 0 and 1 == a trainer taking step 0, dying, and a new one resuming
    from the checkpoint to take step 1 (same weights, same AdamW moments, version 2)."""
    straight = trainer(None)
    straight.train(batch(0))
    straight.train(batch(1))

    store = CheckpointStore(tmp_path / "ckpt")
    first = trainer(store)
    report = first.train(batch(0))
    assert report["policy_version"] == 1 and report["checkpoint"] == str(store.path_of(1))
    resumed = trainer(store)
    assert resumed.policy_version == 1 and resumed.resumed["step"] == 0
    assert resumed.resumed["group_keys"] == ["g0a", "g0b"]
    assert resumed.resumed["report"]["loss"] == report["loss"]
    assert resumed.train(batch(1))["policy_version"] == 2
    expected, got = weights(straight.model), weights(resumed.model)
    assert all(torch.equal(expected[k], got[k]) for k in expected)



def test_a_deferred_save_writes_the_version_trained_not_the_weights_the_model_has_by_then(tmp_path):
    """``train(defer_save=True)`` copies the version; ``save_deferred`` writes that copy even
    though the next step changes the model first; a trainer resumed from it continues exactly as
    one resumed from a checkpoint written before the step returned (weights and AdamW moments)."""
    synchronous = CheckpointStore(tmp_path / "sync")
    reference = trainer(synchronous)
    reference.train(batch(0))
    deferred_store = CheckpointStore(tmp_path / "deferred")
    deferred = trainer(deferred_store)
    report = deferred.train(batch(0), defer_save=True)
    assert report["checkpoint"] == str(deferred_store.path_of(1)) and deferred_store.versions() == []
    moved_on = weights(deferred.model)
    pending = deferred.save_deferred()
    deferred.train(batch(1), defer_save=True)  # the live weights move on while v1 is written
    assert pending.result() == deferred_store.path_of(1)
    deferred.close()
    with pytest.raises(ValueError, match="no deferred checkpoint"):
        trainer(None).save_deferred()
    for store in (synchronous, deferred_store):
        resumed = trainer(store)
        assert resumed.policy_version == 1 and resumed.resumed["group_keys"] == ["g0a", "g0b"]
        assert all(torch.equal(moved_on[k], v) for k, v in resumed.model.state_dict().items())
        resumed.train(batch(1))
    first, second = (weights(trainer(store).model) for store in (synchronous, deferred_store))
    assert all(torch.equal(first[k], second[k]) for k in first)
    files = {store: sorted(p.name for p in store.path_of(2).iterdir()) for store in (synchronous, deferred_store)}
    assert files[synchronous] == files[deferred_store]
    # the copy keeps the tied lm_head one tensor with the embedding, so it is written once, as
    # from the live model
    snap = snapshot(1, tiny_model(), None, {})
    assert snap.weights["lm_head.weight"] is snap.weights["model.embed_tokens.weight"]
    for store in (synchronous, deferred_store):
        with safe_open(store.path_of(2) / "model.safetensors", "pt") as fh:
            assert "lm_head.weight" not in fh.keys() and "model.embed_tokens.weight" in fh.keys()


def test_the_report_carries_mask_means_per_agg_type_and_the_policy_lag(tmp_path):
    t = trainer(None)
    t.policy_version = 3
    report = t.train(batch(0, version=1))
    assert report["policy_lag_max"] == 2 and report["generator_versions"] == [1]
    assert set(report["ratio_means"]) == set(report["diff_means"]) == {"token", "segment", "geometric", "sequence"}
    assert report["policy_version"] == 4 and report["checkpoint"] == ""


def test_a_pruned_folders_optimizer_state_is_written_over_in_place_by_the_next_checkpoint(tmp_path):
    """The spare keeps its file (inode, so its cached pages) and every kept version restores its
    own AdamW state exactly, also when the spare was longer than the state written over it."""
    store = CheckpointStore(tmp_path, keep_last=2)
    model = tiny_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    saved, spare = {}, tmp_path / SPARE_OPTIMIZER
    for version in (1, 2, 3, 4):
        model(torch.tensor([[1, 2, 3 + version]])).logits.sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        if version == 4:  # v1's file, made longer than any state
            with spare.open("ab") as fh:
                fh.write(b"x" * 100_000)
            inode = spare.stat().st_ino
        store.save(version, model, optimizer, {"step": version - 1})
        saved[version] = {k: {n: t.clone() for n, t in v.items()} for k, v in optimizer.state_dict()["state"].items()}
        assert spare.exists() == (version >= 3)  # v1's after v3, then v2's after v4
    assert store.versions() == [3, 4]
    written = store.path_of(4) / OPTIMIZER_FILE
    assert written.stat().st_ino == inode and written.stat().st_size == (store.path_of(3) / OPTIMIZER_FILE).stat().st_size
    for version in (3, 4):
        restored = torch.optim.AdamW(tiny_model().parameters(), lr=0.1)
        store.restore(store.path_of(version), tiny_model(), restored)
        state = restored.state_dict()["state"]
        assert state.keys() == saved[version].keys()
        assert all(torch.equal(state[k][n], t) for k, v in saved[version].items() for n, t in v.items())


def test_store_keeps_the_newest_and_ignores_a_torn_save(tmp_path):
    store = CheckpointStore(tmp_path, keep_last=2)
    model = tiny_model()
    for version in (1, 2, 3):
        store.save(version, model, None, {"step": version - 1, "group_keys": []})
    assert store.versions() == [2, 3]
    # a crash mid-save leaves a hidden temporary folder and a folder without its state file
    (tmp_path / ".v000004.tmp-99999").mkdir()
    (tmp_path / "v000005").mkdir()
    path, state = store.latest()
    assert path == store.path_of(3) and state == {"step": 2, "group_keys": [], "version": 3}
    assert json.loads((path / STATE_FILE).read_text())["version"] == 3
    assert (path / "model.safetensors").is_file() and (path / "config.json").is_file()
    store.save(4, model, None, {"step": 3, "group_keys": []})
    assert not (tmp_path / ".v000004.tmp-99999").exists()  # cleaned on the next save


def test_keep_every_keeps_those_versions_weights_without_their_optimizer_state(tmp_path):
    store = CheckpointStore(tmp_path, keep_last=2, keep_every=4)
    model = tiny_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    for version in range(1, 10):
        store.save(version, model, optimizer, {"step": version - 1})
    assert store.versions() == [4, 8, 9]  # the newest two (8, 9) and every 4th
    assert store.latest()[1]["version"] == 9
    assert not (store.path_of(4) / OPTIMIZER_FILE).exists() and (store.path_of(9) / OPTIMIZER_FILE).is_file()
    assert (store.path_of(8) / OPTIMIZER_FILE).is_file()  # still one of the newest: a restart may need it
    restored = tiny_model(seed=1)
    store.restore(store.path_of(4), restored, torch.optim.AdamW(restored.parameters(), lr=0.1))
    assert all(torch.equal(a, b) for a, b in zip(restored.state_dict().values(), model.state_dict().values()))
    with pytest.raises(ValueError, match="keep_every"):
        CheckpointStore(tmp_path, keep_every=0)


def test_weights_that_do_not_fit_are_refused_and_leave_the_model_untouched(tmp_path):
    store = CheckpointStore(tmp_path)
    path = store.save(1, tiny_model(seed=1), None, {"step": 0, "group_keys": []})
    other = tiny_model(hidden=32)
    before = weights(other)
    with pytest.raises(RollstreamError, match="shape_mismatch"):
        load_weights_into(other, path)
    assert all(torch.equal(before[k], v) for k, v in other.state_dict().items())
    with pytest.raises(FileNotFoundError, match="weights not found: .*missing"):
        load_weights_into(other, tmp_path / "missing")


def test_keep_last_must_be_positive(tmp_path):
    with pytest.raises(ValueError, match="keep_last"):
        CheckpointStore(tmp_path, keep_last=0)


SAVE_UNDER_A_FILE_SIZE_LIMIT = """
import resource, signal, sys
from rollstream.exceptions import RollstreamError
from rollstream.trainer.checkpoint import CheckpointStore
from tests.tiny_models import tiny_model

store, model = CheckpointStore(sys.argv[1]), tiny_model()
store.save(1, model, None, {"step": 0, "group_keys": []})
# from here a write past 4 KiB fails with EFBIG, as a write to a full disk fails with ENOSPC
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (4096, resource.RLIM_INFINITY))
try:
    store.save(2, model, None, {"step": 1, "group_keys": []})
except RollstreamError as err:
    print(err)
"""


def test_a_save_that_cannot_write_raises_clearly_and_leaves_no_partial_folder(tmp_path):
    """The writes fail for real (a file-size limit in a child process): the error names the
    folder, the free space and the cause; the partial folder is gone and version 1 is intact."""
    out = subprocess.run([sys.executable, "-c", SAVE_UNDER_A_FILE_SIZE_LIMIT, str(tmp_path)],
                         cwd=Path(__file__).parents[2], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.startswith(f"checkpoint_not_written: {tmp_path / 'v000002'} (")
    assert "GiB free on its disk): " in out.stdout and "File too large" in out.stdout
    assert [p.name for p in tmp_path.iterdir()] == ["v000001"]
    assert CheckpointStore(tmp_path).latest()[1] == {"step": 0, "group_keys": [], "version": 1}
