"""Whatever a handler returns, raises or prints, its attempt ends with a readable record, and one
attempt's bad end never touches another's (SPEC section 12), on both stores."""

import asyncio

import pytest
from conftest import QUIET, inject, run, wait_for

import anarchon_lite as al
from anarchon_lite import Scheduler


class SlicingRaises(str):
    def __getitem__(self, key):
        raise RuntimeError("no slicing")


class StrRaises(Exception):
    def __str__(self):
        raise RuntimeError("no str")

    def __repr__(self):
        raise RuntimeError("no repr")


class OutputRaises(Exception):
    @property
    def output(self):
        raise RuntimeError("no output")


async def raise_surrogate(ctx):
    raise ValueError("cannot parse caf\udce9.txt")  # os.listdir() of a name that is not UTF-8


async def return_surrogate(ctx):
    return "read caf\udce9.txt"


async def return_slicing_raises(ctx):
    return SlicingRaises("hello")


async def raise_str_raises(ctx):
    raise StrRaises()


def raise_output_raises(ctx):  # a plain function, in a worker thread
    raise OutputRaises("bad output")


async def return_nul(ctx):
    return "a\x00b"


async def return_fine(ctx):
    return "fine"


HANDLERS = {
    "surrogate-raised": (raise_surrogate, "failed", "ValueError: cannot parse caf\\udce9.txt"),
    "surrogate-returned": (return_surrogate, "succeeded", None),
    "slicing-raises": (return_slicing_raises, "succeeded", None),
    "str-raises": (raise_str_raises, "failed", "StrRaises: <StrRaises whose str() raised>"),
    "output-raises": (raise_output_raises, "failed", "OutputRaises: bad output"),
    "nul": (return_nul, "succeeded", None),
    "neighbour": (return_fine, "succeeded", None),
}


async def ended(s, names):
    records = await s.history(limit=1000)
    return {r.job: r for r in records if r.status != "running" and r.job in names}


def test_odd_text_from_handlers_ends_every_attempt_readably(store):
    """Each handler's attempt ends (none stays ``running``, so none wedges the job's later
    occurrences), the error says what the handler raised, starting with the handler's own frame,
    and the job's next occurrence runs."""

    async def main():
        s = Scheduler(store, poll=0.02)
        for name, (handler, _, _) in HANDLERS.items():
            s.every(name, "24h", handler, offset=QUIET)
        async with s:
            for name in HANDLERS:  # one after another in one turn: their ends share a batch
                await s.trigger(name)
            await wait_for(lambda: _all_ended(s, set(HANDLERS)), message="every attempt's end")
            records = await ended(s, set(HANDLERS))
            for name, (_, status, error) in HANDLERS.items():
                assert records[name].status == status, (name, records[name])
                if error is not None:
                    assert records[name].error.endswith(error), (name, records[name].error)
                    assert records[name].error.lstrip().startswith(f'File "{__file__}"'), records[name].error
            assert records["surrogate-returned"].output == "read caf\\udce9.txt"
            assert records["nul"].output == "a\\x00b"
            assert records["slicing-raises"].output == "hello"
            for name in HANDLERS:  # not wedged: the next run of each job runs and ends too
                await s.trigger(name)
            await wait_for(lambda: _all_ended(s, set(HANDLERS), count=2), message="every second attempt's end")

    run(main())


async def _all_ended(s, names, count=1):
    records = await s.history(limit=1000)
    done = [r.job for r in records if r.status != "running"]
    return all(done.count(name) >= count for name in names)


def test_one_ends_fault_never_fails_its_neighbours_in_the_batch(store):
    """An end that the store cannot write for a reason of its own (not the store's: a
    ``StoreError`` would be retried for the whole batch) is written again alone, bare, and the end
    written beside it lands."""
    batches = []

    def finish_many(original, owner, ends):
        batches.append(sorted(e.claim.job for e in ends))
        if any(e.claim.job == "bad" and "could not be stored" not in (e.error or "") for e in ends):
            raise UnicodeEncodeError("utf-8", "x", 0, 1, "as if its text could not be encoded")
        return original(owner, ends)

    started = []
    both = asyncio.Event()

    async def together(ctx):  # the two attempts end in the same turn of the loop: one batch
        started.append(ctx.job)
        if len(started) == 2:
            both.set()
        await both.wait()
        if ctx.job == "bad":
            raise ValueError("bad")

    async def main():
        s = inject(Scheduler(store, poll=0.02), finish_many=finish_many)
        s.every("bad", "24h", together, offset=QUIET)
        s.every("good", "24h", together, offset=QUIET)
        async with s:
            await s.trigger("bad")
            await s.trigger("good")
            await wait_for(lambda: _all_ended(s, {"bad", "good"}), message="both ends")
            records = await ended(s, {"bad", "good"})
        assert batches[0] == ["bad", "good"], batches
        assert records["good"].status == "succeeded"
        assert records["bad"].status == "failed"
        assert "could not be stored" in records["bad"].error and "UnicodeEncodeError" in records["bad"].error

    run(main())


@pytest.mark.parametrize(
    "value, expected",
    [
        ("plain", "plain"),
        ("caf\udce9", "caf\\udce9"),
        ("a\x00b", "a\\x00b"),
        (SlicingRaises("abc"), "abc"),
        (StrRaises(), "<StrRaises whose str() raised>"),
        ("é" * 10, "é" * 4),
    ],
)
def test_safe_text_is_total(value, expected):
    text = al._safe_text(value, 4 if expected == "é" * 4 else None)
    assert text == expected and type(text) is str
    text.encode("utf-8")  # never raises
