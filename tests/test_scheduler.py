"""The scheduler on its own: a real BlockManager, real Request / Sequence objects and no model. `compute` plays
the engine's part of a step (a chunk that completes its sequence samples a token) and hands the step back to the
scheduler (`update_from_output`: the scheduled tokens get K/V)."""
from __future__ import annotations

from pagedlm.config import EngineConfig
from pagedlm.engine.scheduler import FinishedSeq, Scheduler, SchedulerOutput
from pagedlm.engine.sequence import Request, Sequence, SequenceStatus
from pagedlm.kvcache.block_manager import BlockManager
from pagedlm.sampling.params import SamplingParams

BLOCK = 4


def make_scheduler(num_blocks: int = 64, num_cpu_blocks: int = 0, **config) -> Scheduler:
    config = EngineConfig(block_size=BLOCK, **config)
    return Scheduler(config, BlockManager(num_blocks, BLOCK, num_cpu_blocks, watermark=0.0))


def make_request(rid: str, prompt_len: int, priority: int = 0, arrival: float = 0.0, n: int = 1) -> Request:
    prompt = [10 + i for i in range(prompt_len)]
    params = SamplingParams(n=n, temperature=1.0, max_tokens=32)
    req = Request(rid, None, prompt, params, arrival_time=arrival, priority=priority)
    req.seqs.append(Sequence(list(prompt)))
    return req


def compute(sch: Scheduler, out: SchedulerOutput, token: int = 7) -> None:
    generated = 0
    for s in out.scheduled:
        if s.completes:
            s.seq.output_token_ids.append(token)
            generated += 1
    sch.update_from_output(out, [], generated)


def scheduled(out: SchedulerOutput) -> list[tuple[str, int]]:
    return [(s.request.request_id, s.num_new_tokens) for s in out.scheduled]


def test_token_budget_chunks_prefills_and_serves_running_first():
    sch = make_scheduler(max_num_batched_tokens=8)
    a, b = make_request("a", 10), make_request("b", 5)
    sch.add_request(a)
    sch.add_request(b)
    out = sch.schedule()
    assert scheduled(out) == [("a", 8)] and out.num_batched_tokens == 8
    assert not out.scheduled[0].completes  # no token is sampled after a partial prefill
    compute(sch, out)
    out = sch.schedule()  # a's last two prompt tokens first, then b's whole prompt in what is left
    assert scheduled(out) == [("a", 2), ("b", 5)]
    assert all(s.completes for s in out.scheduled)
    compute(sch, out)
    out = sch.schedule()  # decode: one token each
    assert scheduled(out) == [("a", 1), ("b", 1)]
    assert [len(sch.block_manager.get_block_table(r.seqs[0])) for r in (a, b)] == [3, 2]
    # update_from_output's accounting: each prompt counted once, each sampled token, every computed chunk
    assert (sch.num_prompt_tokens, sch.num_generation_tokens) == (15, 2)
    assert [r.seqs[0].num_computed_tokens for r in (a, b)] == [10, 5]
    compute(sch, out)
    assert (sch.num_prompt_tokens, sch.num_generation_tokens) == (15, 4)
    assert [r.seqs[0].num_computed_tokens for r in (a, b)] == [11, 6]


def test_without_chunked_prefill_a_prompt_waits_for_a_budget_that_holds_it():
    sch = make_scheduler(max_num_batched_tokens=8, enable_chunked_prefill=False)
    sch.add_request(make_request("a", 6))
    sch.add_request(make_request("b", 5))
    out = sch.schedule()
    assert scheduled(out) == [("a", 6)]  # b's 5 tokens do not fit in the 2 left, and are not split
    compute(sch, out)
    assert scheduled(sch.schedule()) == [("a", 1), ("b", 5)]


def test_max_num_seqs_counts_the_samples_of_a_request_before_it_forks():
    sch = make_scheduler(max_num_seqs=3)
    for i, n in enumerate([2, 1, 1]):
        sch.add_request(make_request(f"r{i}", 4, arrival=float(i), n=n))
    out = sch.schedule()
    assert scheduled(out) == [("r0", 4), ("r1", 4)]  # r0 reserves 2 of the 3 seats
    assert sch.num_running_seqs == 3 and [r.request_id for r in sch.waiting] == ["r2"]
    compute(sch, out)
    sch.finish([FinishedSeq(sch.running[1].seqs[0], SequenceStatus.FINISHED_STOPPED)])
    assert scheduled(sch.schedule()) == [("r0", 1), ("r2", 4)]


def _two_full_requests(mode: str) -> tuple[Scheduler, Request, Request]:
    """Two 8-token prompts fill all 4 blocks; their first decode tokens need a fifth block each."""
    sch = make_scheduler(num_blocks=4, num_cpu_blocks=8 if mode == "swap" else 0, preemption_mode=mode)
    a, b = make_request("a", 8, arrival=0.0), make_request("b", 8, arrival=1.0)
    sch.add_request(a)
    sch.add_request(b)
    out = sch.schedule()
    assert scheduled(out) == [("a", 8), ("b", 8)] and sch.block_manager.num_free_blocks == 0
    compute(sch, out)
    return sch, a, b


def test_recompute_preemption_frees_the_victim_and_prefills_it_again():
    sch, a, b = _two_full_requests("recompute")
    bm = sch.block_manager
    out = sch.schedule()
    assert out.preempted == [b] and scheduled(out) == [("a", 1)]  # the later request makes room
    assert sch.num_preemptions == 1 and b.metrics.num_preemptions == 1
    assert list(sch.waiting) == [b] and sch.running == [a]
    assert b.seqs[0].status is SequenceStatus.WAITING and b.seqs[0].num_computed_tokens == 0
    assert bm.get_block_table(b.seqs[0]) == [] and len(bm.get_block_table(a.seqs[0])) == 3
    compute(sch, out)
    sch.finish([FinishedSeq(a.seqs[0], SequenceStatus.FINISHED_LENGTH)])
    assert bm.num_free_blocks == 4
    out = sch.schedule()  # b resumes: its prompt and its sampled token are computed again
    assert scheduled(out) == [("b", 9)] and out.scheduled[0].completes
    assert b.seqs[0].status is SequenceStatus.RUNNING and len(bm.get_block_table(b.seqs[0])) == 3


def test_swap_preemption_moves_the_victim_to_host_blocks_and_back():
    sch, a, b = _two_full_requests("swap")
    bm = sch.block_manager
    b_blocks = list(bm.get_block_table(b.seqs[0]))
    out = sch.schedule()
    assert out.preempted == [b] and sch.swapped == [b] and b.seqs[0].status is SequenceStatus.SWAPPED
    assert [src for src, _ in out.blocks_to_swap_out] == b_blocks and bm.cpu.num_free == 8 - 2
    host_blocks = [dst for _, dst in out.blocks_to_swap_out]
    assert bm.get_block_table(b.seqs[0]) == host_blocks
    assert b.seqs[0].num_computed_tokens == 8  # its K/V is kept, on the host
    compute(sch, out)
    out = sch.schedule()
    assert scheduled(out) == [("a", 1)] and not out.blocks_to_swap_in  # still no room to swap b in
    compute(sch, out)
    sch.finish([FinishedSeq(a.seqs[0], SequenceStatus.FINISHED_STOPPED)])
    out = sch.schedule()
    assert [src for src, _ in out.blocks_to_swap_in] == host_blocks and scheduled(out) == [("b", 1)]
    assert b.seqs[0].status is SequenceStatus.RUNNING and sch.running == [b] and not sch.swapped
    assert bm.cpu.num_free == 8 and len(bm.get_block_table(b.seqs[0])) == 3


def test_fcfs_admits_in_arrival_order():
    sch = make_scheduler(max_num_seqs=1)
    for rid, prio in [("x", 2), ("y", 0), ("z", 1)]:
        sch.add_request(make_request(rid, 4, priority=prio))
    assert scheduled(sch.schedule()) == [("x", 4)]


def test_priority_admits_the_most_urgent_and_preempts_the_least():
    sch = make_scheduler(max_num_seqs=1, scheduling_policy="priority")
    for i, (rid, prio) in enumerate([("x", 2), ("y", 0), ("z", 1)]):
        sch.add_request(make_request(rid, 4, priority=prio, arrival=float(i)))
    out = sch.schedule()
    assert scheduled(out) == [("y", 4)]
    compute(sch, out)
    sch.finish([FinishedSeq(out.scheduled[0].seq, SequenceStatus.FINISHED_STOPPED)])
    assert scheduled(sch.schedule()) == [("z", 4)]

    # out of blocks: the lowest-priority running request is the victim, whatever its arrival
    sch = make_scheduler(num_blocks=4, scheduling_policy="priority")
    urgent, low = make_request("urgent", 8, priority=0, arrival=1.0), make_request("low", 8, priority=5, arrival=0.0)
    sch.add_request(low)
    sch.add_request(urgent)
    out = sch.schedule()
    assert scheduled(out) == [("urgent", 8), ("low", 8)]
    compute(sch, out)
    out = sch.schedule()
    assert out.preempted == [low] and scheduled(out) == [("urgent", 1)]


def test_update_from_output_finishes_and_frees():
    sch = make_scheduler(num_blocks=16)
    req = make_request("r", 6, n=2)
    sch.add_request(req)
    bm = sch.block_manager
    compute(sch, sch.schedule())
    parent = req.seqs[0]
    child = Sequence(list(req.prompt_token_ids), index=1, output_token_ids=[8],
                     num_computed_tokens=parent.num_computed_tokens, status=SequenceStatus.RUNNING)
    bm.fork(parent, child)  # the engine's n > 1 fork: all blocks shared
    req.seqs.append(child)
    req.forked = True
    assert bm.num_free_blocks == 16 - 2

    sch.finish([FinishedSeq(parent, SequenceStatus.FINISHED_STOPPED)])
    assert parent.status is SequenceStatus.FINISHED_STOPPED and bm.get_block_table(parent) == []
    assert bm.num_free_blocks == 16 - 2  # the child still holds the shared blocks
    assert sch.running == [req]  # one sample still runs
    assert scheduled(sch.schedule()) == [("r", 1)]

    sch.finish([FinishedSeq(child, SequenceStatus.FINISHED_LENGTH),
                            FinishedSeq(child, SequenceStatus.FINISHED_STOPPED)])  # listed twice: the first wins
    assert child.status is SequenceStatus.FINISHED_LENGTH
    assert bm.num_free_blocks == 16 and sch.running == [] and not sch.has_unfinished()
    assert [s.status.finish_reason for s in (parent, child)] == ["stop", "length"]


def test_update_from_output_leaves_an_aborted_sequence_alone():
    sch = make_scheduler(num_blocks=16)
    req = make_request("r", 6)
    sch.add_request(req)
    compute(sch, sch.schedule())
    assert sch.abort_request("r") is req and sch.block_manager.num_free_blocks == 16
    sch.finish([FinishedSeq(req.seqs[0], SequenceStatus.FINISHED_STOPPED)])  # no double free
    assert req.seqs[0].status is SequenceStatus.FINISHED_ABORTED and sch.block_manager.num_free_blocks == 16
    assert sch.abort_request("r") is None
