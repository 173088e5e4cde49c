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
