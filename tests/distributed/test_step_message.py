"""The step message rank 0 sends to the other ranks (rimuru/distributed/replica.py): every step the receiver rebuilds
exactly rank 0's batch (requests, positions, tokens), and a steady decode step travels compact."""

import pickle

from rimuru.distributed.replica import BatchReceiver, BatchSender
from rimuru.engine.request import Request
from rimuru.engine.sampling_params import SamplingParams
from rimuru.engine.scheduler import ScheduledChunk, SchedulerOutput


def _out(chunks):
    return SchedulerOutput(tuple(ScheduledChunk(r, s, n) for r, s, n in chunks), 0, ())


def test_receiver_rebuilds_every_step_and_steady_decode_is_compact():
    live: set[str] = set()
    sender, receiver = BatchSender([], live.__contains__), BatchReceiver()
    a, b, c = (Request(rid, list(range(10 + i)), SamplingParams(), 0.0) for i, rid in enumerate("abc"))
    compact = []

    def step(chunks, sample=()):
        out = _out(chunks)
        message = pickle.loads(pickle.dumps(sender.message(out)))  # what the pipe carries
        _, ops, dropped, tokens, chunk_list = message
        compact.append(chunk_list is None)
        got = receiver.output(dropped, tokens, chunk_list)
        assert [(x.request.request_id, x.start, x.num_tokens) for x in got.chunks] == \
            [(x.request.request_id, x.start, x.num_tokens) for x in out.chunks]
        for mine, theirs in zip(out.chunks, got.chunks):  # the mirror holds every token up to the chunk's end
            assert theirs.request.prompt_token_ids[:mine.start + mine.num_tokens] == \
                mine.request.all_token_ids[:mine.start + mine.num_tokens]
            assert theirs.samples == mine.samples
        for r in sample:  # the step's sampled tokens
            r.output_token_ids.append(100 + len(r.output_token_ids))

    live.update("ab")
    step([(a, 0, 6), (b, 0, 11)], sample=[b])  # a chunked prefill, b's whole prompt
    step([(a, 6, 4), (b, 11, 1)], sample=[a, b])  # mixed: a's last chunk, b decodes
    step([(a, 10, 1), (b, 12, 1)], sample=[a, b])  # decode, the requests of the step before
    step([(a, 11, 1), (b, 13, 1)], sample=[a, b])  # steady
    live.add("c")
    step([(a, 12, 1), (b, 14, 1), (c, 0, 12)], sample=[a, b, c])  # c joins: full message
    step([(a, 13, 1), (b, 15, 1), (c, 12, 1)], sample=[a, b, c])
    live.discard("b")
    step([(a, 14, 1), (c, 13, 1)], sample=[a, c])  # b finished: dropped, the batch changed
    step([(a, 15, 1), (c, 14, 1)], sample=[a, c])
    step([(c, 15, 1), (a, 16, 1)], sample=[a, c])  # same requests, another order: full message
    a2 = Request("a", list(a.all_token_ids), SamplingParams(), 0.0)  # a preempted and re-admitted: a new object
    n = a2.num_tokens
    step([(c, 16, 1), (a2, 0, n)], sample=[a2, c])
    step([(c, 17, 1), (a2, n, 1)], sample=[a2, c])
    assert compact == [False, False, True, True, False, True, False, True, False, False, True]


def test_async_launches_carry_only_known_tokens_and_mark_the_pending_ones():
    """Async scheduling: rank 0's newest token of a request is pending on the device; the message carries the tokens
    on rank 0's host only (one step late), the receiver marks the chunk whose token is pending, and a steady
    pipelined decode still travels compact."""
    live = {"a", "b"}
    sender, receiver = BatchSender([], live.__contains__), BatchReceiver()
    a, b = (Request(rid, list(range(5 + i)), SamplingParams(), 0.0) for i, rid in enumerate("ab"))
    compact, pending = [], []

    def step(chunks, kind="launch"):
        out = _out(chunks)
        message = pickle.loads(pickle.dumps(sender.message(out, kind)))
        assert message[0] == kind
        got = receiver.output(*message[2:5])
        compact.append(message[4] is None)
        pending.append([x.request.num_pending for x in got.chunks])
        for mine, theirs in zip(out.chunks, got.chunks):
            assert (theirs.request.request_id, theirs.start, theirs.num_tokens, theirs.samples) == \
                (mine.request.request_id, mine.start, mine.num_tokens, mine.samples)
            known = mine.request.num_known_tokens  # the mirror holds exactly rank 0's host tokens
            assert theirs.request.prompt_token_ids == mine.request.all_token_ids[:known]
        return out

    def launch(out):  # Scheduler.advance: the sampled token stays on the device
        for c in out.chunks:
            c.request.num_pending += 1

    def commit(out):  # Scheduler.commit
        for c in out.chunks:
            c.request.num_pending -= 1
            c.request.output_token_ids.append(100 + len(c.request.output_token_ids))

    first = step([(a, 0, 5), (b, 0, 6)], kind="step")
    for r in (a, b):  # the synchronous prefill's tokens
        r.output_token_ids.append(7)
    s1 = step([(a, 5, 1), (b, 6, 1)])  # first launch: every token known
    launch(s1)
    s2 = step([(a, 6, 1), (b, 7, 1)])  # step 1 in flight: both pending, no new known token
    launch(s2)
    commit(s1)
    s3 = step([(a, 7, 1), (b, 8, 1)])  # step 1's tokens travel now, step 2's are pending
    launch(s3)
    commit(s2)
    live.discard("b")
    b.status = None
    s4 = step([(a, 8, 1)])  # the batch changed: a full message, a still pending
    launch(s4)
    commit(s3)
    step([(a, 9, 1)])
    assert first.chunks and compact == [False, True, True, True, False, True]
    assert pending == [[0, 0], [0, 0], [1, 1], [1, 1], [1], [1]]
