"""autocast per asyncio task (behaviour.md §7): eager modules run under their own task's regions
when tasks interleave them on one thread; a task starts with the regions of the code that
created it; compiled modules, which read the thread's state, refuse to run while several tasks'
regions are active on the thread."""

from __future__ import annotations

import asyncio

import pytest
import quant_recipes as qr
import torch
from quant_recipes import current_frame

A, B = qr.Float8CurrentScaling(), qr.MXFP8BlockScaling()


def _linear_and_outputs():
    """A Linear, its input, and its outputs under ``A`` and under ``B`` (which differ)."""
    torch.manual_seed(0)
    lin = qr.Linear(64, 64, dtype=torch.bfloat16)
    x = torch.randn(32, 64, dtype=torch.bfloat16)
    with torch.no_grad():
        with qr.autocast(recipe=A):
            ya = lin(x)
        with qr.autocast(recipe=B):
            yb = lin(x)
    assert not torch.equal(ya, yb)
    return lin, x, ya, yb


def _interleaved(run_a, run_b):
    """Task A enters ``A`` and waits until task B has entered ``B``; then A runs ``run_a``
    while B's region is active; B runs ``run_b`` after A ran, and exits first."""
    async def task_a(b_in: asyncio.Event, a_ran: asyncio.Event, b_out: asyncio.Event):
        with qr.autocast(recipe=A):
            await b_in.wait()
            out = run_a()
            a_ran.set()
            await b_out.wait()
            return out, current_frame().recipe

    async def task_b(b_in: asyncio.Event, a_ran: asyncio.Event, b_out: asyncio.Event):
        with qr.autocast(recipe=B):
            b_in.set()
            await a_ran.wait()
            out = run_b()
        b_out.set()
        return out, current_frame()

    async def main():
        events = asyncio.Event(), asyncio.Event(), asyncio.Event()
        return await asyncio.gather(task_a(*events), task_b(*events))

    return asyncio.run(main())


def test_a_task_runs_its_modules_under_its_own_region_while_another_tasks_is_active():
    lin, x, ya, yb = _linear_and_outputs()
    with torch.no_grad():
        (got_a, a_after), (got_b, b_after) = _interleaved(lambda: lin(x), lambda: lin(x))
    assert torch.equal(got_a, ya)  # not B's recipe, the region entered last on the thread
    assert torch.equal(got_b, yb)
    assert a_after is A and b_after is None  # B's exit left A's region alone, and its own ended
    assert current_frame() is None


def test_a_task_starts_with_the_regions_of_the_code_that_created_it():
    seen = []

    async def child():
        seen.append(current_frame().recipe)
        with qr.autocast(recipe=B):
            await asyncio.sleep(0)
            seen.append(current_frame().recipe)
        seen.append(current_frame().recipe)

    async def main():
        with qr.autocast(recipe=A):
            await asyncio.gather(child(), child())
            seen.append(current_frame().recipe)
        seen.append(current_frame())

    asyncio.run(main())
    # each child: A; its B region, across the other's; A again. Then main's A, then none.
    assert seen == [A, A, B, A, B, A, A, None]


def test_a_worker_thread_does_not_take_the_tasks_region():
    """``asyncio.to_thread`` runs its function in a copy of the task's context on another
    thread: autocast state is per thread there, as torch.autocast's."""
    async def main():
        with qr.autocast(recipe=A):
            return await asyncio.to_thread(current_frame), current_frame().recipe

    assert asyncio.run(main()) == (None, A)


def test_compiled_modules_refuse_to_run_while_several_tasks_regions_are_active():
    dynamo = pytest.importorskip("quant_dynamo", reason="compile tests need quant-dynamo")
    if not dynamo.compile_supported():
        pytest.skip(f"no opaque-object API on torch {torch.__version__}")
    lin, x, ya, _ = _linear_and_outputs()
    compiled = torch.compile(lin, backend="eager", fullgraph=True)
    with torch.no_grad(), qr.autocast(recipe=A):
        assert torch.equal(compiled(x), ya)  # compiled before the tasks run
    with torch.no_grad(), pytest.raises(RuntimeError, match="several asyncio tasks"):
        _interleaved(lambda: compiled(x), lambda: None)
    with torch.no_grad(), qr.autocast(recipe=A):  # once the tasks are done, it runs again
        assert torch.equal(compiled(x), ya)
    assert current_frame() is None


def test_an_exit_before_a_later_region_of_its_own_task_raises_and_keeps_the_later_one():
    outer, inner = qr.autocast(recipe=A), qr.autocast(recipe=B)
    outer.__enter__()
    inner.__enter__()
    with pytest.raises(RuntimeError, match="exited while a region entered after it"):
        outer.__exit__(None, None, None)
    assert current_frame().recipe is B
    inner.__exit__(None, None, None)
    assert current_frame() is None
