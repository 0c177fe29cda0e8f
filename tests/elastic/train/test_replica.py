"""One rank's inner loop and checkpoint phase 1, run in this process as the world drives a rank
(its own TCPStore, a one-rank gloo group, no Ray): compiled and checkpointed blocks train to the
eager losses; an async checkpoint written while training goes on loads back bit-identical; a second
save waits for the first write instead of overwriting its snapshot."""

from __future__ import annotations

import datetime
import os
import threading

import pytest
import torch
import torch.distributed as dist

from elastic.train.replica import RankSpec, RankWorker, Schedule
from tests.conftest import tiny_recipe


@pytest.fixture
def rank(monkeypatch):
    """Start one rank of a one-rank replica in this process: `rank(**recipe overrides)`. One at
    a time (the process has one default group); the previous one is torn down first and at the
    end."""
    threads = torch.get_num_threads()
    stores = []

    def close() -> None:
        if dist.is_initialized():
            dist.destroy_process_group()

    def start(**overrides) -> RankWorker:
        close()
        recipe = tiny_recipe(**overrides)
        store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                              timeout=datetime.timedelta(seconds=60))
        stores.append(store)
        spec = RankSpec(recipe=recipe.model_dump(mode="json"), replica_id=0, rank=0, ranks=1,
                        store_host="127.0.0.1", store_port=store.port, schedule=Schedule.for_recipe(recipe))
        worker = RankWorker(spec)
        worker.setup()
        return worker

    try:
        yield start
    finally:
        close()
        torch.set_num_threads(threads)


def phase(worker: RankWorker, n: int) -> list[float]:
    """Inner phase `n` (its own lease) then the outer step of a world of this one replica."""
    t = worker._recipe.train
    step_tokens = t.batch_size * t.seq_len
    out = worker.inner_phase(n * t.inner_steps * t.batch_size, n * t.inner_steps, n * t.inner_steps * step_tokens,
                             step_tokens)
    assert worker.outer_sync(0, 0, 1)["ok"]
    worker.outer_apply()
    return out["losses"]


def state(worker: RankWorker) -> dict[str, torch.Tensor]:
    """Everything a checkpoint restores, as flat name → tensor copies."""
    out = {f"model.{k}": v for k, v in worker.full_state().items()}
    for i, s in worker._opt.state_dict()["state"].items():
        out.update({f"optim.{i}.{k}": torch.as_tensor(v).clone() for k, v in s.items()})
    out["outer_momentum"] = worker._outer.momentum().clone()
    out["theta"] = worker._outer.theta.data.clone()
    out["inner_step"] = torch.tensor(worker._inner_step)
    return out


def assert_identical(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for k in want:
        assert torch.equal(got[k], want[k]), k


def test_compiled_and_checkpointed_blocks_train_to_the_eager_losses(rank, monkeypatch):
    """`train.compile` (inductor's C++ backend on CPU) and `train.activation_checkpointing` give the
    eager losses; the blocks really were compiled, and really recomputed in the backward pass."""
    from torch._dynamo.utils import counters

    from elastic.models.gpt import Block

    calls = []
    forward = Block.forward
    monkeypatch.setattr(Block, "forward", lambda self, x: calls.append(1) or forward(self, x))

    eager = phase(rank(**{"train.compile": "false"}), 0)
    eager_calls = len(calls)
    assert eager_calls == 4   # one block, four inner steps

    checkpointed = phase(rank(**{"train.compile": "false", "train.activation_checkpointing": "true"}), 0)
    assert len(calls) - eager_calls == 2 * eager_calls   # forward, then again in the backward pass
    assert checkpointed == pytest.approx(eager, rel=1e-5)

    torch._dynamo.reset()
    counters.clear()
    compiled = phase(rank(**{"train.compile": "true"}), 0)
    assert counters["stats"]["unique_graphs"] >= 1
    assert compiled == pytest.approx(eager, rel=1e-4)


def test_an_async_checkpoint_written_while_training_goes_on_loads_back_bit_identical(rank, monkeypatch, tmp_path):
    gate = tmp_path / "gate"
    monkeypatch.setenv("ELASTIC_FAULT_WRITE_GATE", str(gate))
    worker = rank()
    phase(worker, 0)
    saved = state(worker)
    path = tmp_path / "ckpt"
    worker.save_checkpoint(str(path))            # phase 1 returns: the state is in host memory
    assert not (path / ".metadata").exists()     # the write has not happened ...
    phase(worker, 1)                             # ... while training goes on
    assert any(not torch.equal(v, saved[k]) for k, v in state(worker).items())
    gate.touch()
    worker.wait_saved()
    assert (path / ".metadata").exists()
    worker.load_checkpoint(str(path))
    assert_identical(state(worker), saved)


def test_a_second_save_waits_for_the_first_write(rank, monkeypatch, tmp_path):
    """The snapshot buffers are reused from one save to the next: the second save must wait until
    the first write is done, or the first checkpoint would hold the second's state."""
    gate = tmp_path / "gate"
    monkeypatch.setenv("ELASTIC_FAULT_WRITE_GATE", str(gate))
    worker = rank()
    phase(worker, 0)
    first = state(worker)
    worker.save_checkpoint(str(tmp_path / "one"))
    phase(worker, 1)
    second = state(worker)
    thread = threading.Thread(target=worker.save_checkpoint, args=(str(tmp_path / "two"),))
    thread.start()
    thread.join(timeout=0.5)
    assert thread.is_alive()                       # held while the first write is stuck
    assert not (tmp_path / "two").exists()
    gate.touch()
    thread.join(timeout=60)
    assert not thread.is_alive()
    worker.wait_saved()
    worker.load_checkpoint(str(tmp_path / "one"))
    assert_identical(state(worker), first)
    worker.load_checkpoint(str(tmp_path / "two"))
    assert_identical(state(worker), second)


def test_a_rank_pins_by_registering_unless_the_user_said_how_to_pin(monkeypatch):
    from elastic.train.replica import PINNED_BY_REGISTERING, _pin_host_memory_by_registering

    for before, after in ((None, PINNED_BY_REGISTERING),
                          ("expandable_segments:True", f"expandable_segments:True,{PINNED_BY_REGISTERING}"),
                          ("pinned_use_cuda_host_register:False", "pinned_use_cuda_host_register:False")):
        if before is None:
            monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
        else:
            monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", before)
        _pin_host_memory_by_registering()
        assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == after


def test_checkpoint_modules_are_imported_one_thread_at_a_time():
    """A save or load imports torch.distributed.checkpoint's modules through `_checkpoint_modules`,
    which waits while the setup's warm-up imports them (two threads importing that graph at once
    can meet Python's `_DeadlockError`: a restore failed so): while the lock is held, it does not
    finish; once released, it does."""
    import threading

    from elastic.train import replica

    replica._checkpoint_modules()           # imported already: only the lock can hold it up below
    done = threading.Event()
    with replica._CHECKPOINT_IMPORTS:      # the warm-up's imports under way
        t = threading.Thread(target=lambda: (replica._checkpoint_modules(), done.set()), daemon=True)
        t.start()
        assert not done.wait(0.5)          # it waits its turn
    assert done.wait(60)
    t.join()


def test_a_rank_reads_the_resolved_recipe_as_the_recipe_it_was_dumped_from():
    """Ranks read the driver's dump (`Resolved`) without the pydantic model: every field of the
    sections they read is the recipe's own value, a model section dumps as the recipe's does (its
    digest, which checkpoints compare), and a field the recipe lacks is an AttributeError."""
    from elastic.storage.checkpoint import model_digest
    from elastic.train.replica import Resolved

    recipe = tiny_recipe(**{"model.options": {"attn_implementation": "eager"}, "data.corpus_bytes": 12345})
    view = Resolved(recipe.model_dump(mode="json"))
    for name in ("train", "world", "data", "eval", "model", "checkpoint"):
        section = getattr(recipe, name)
        for field in type(section).model_fields:
            assert getattr(getattr(view, name), field) == getattr(section, field), (name, field)
    assert view.model.options == {"attn_implementation": "eager"} and view.train.inner_betas == (0.9, 0.95)
    assert view.model.model_dump() == recipe.model.model_dump(mode="json")
    assert model_digest(view) == model_digest(recipe)
    with pytest.raises(AttributeError, match="no field 'nope'"):
        view.train.nope
