from moebus.engine.block_manager import BlockManager
from moebus.engine.request import Request, RequestStatus
from moebus.engine.sampling import SamplingParams
from moebus.engine.scheduler import Scheduler, SchedulerConfig


def _sched(blocks=64, bs=4, seqs=8, budget=32):
    return Scheduler(SchedulerConfig(seqs, budget), BlockManager(blocks, bs))


def _advance(out):
    for s in out.scheduled:
        s.request.num_computed_tokens = s.start + s.num_tokens
        if s.sample:
            s.request.output_token_ids.append(1)


def test_chunked_prefill_respects_token_budget():
    s = _sched(budget=16)
    r = Request("a", list(range(40)), SamplingParams())
    s.add(r)
    chunks = []
    while r.is_prefill:
        out = s.schedule()
        chunks.append(out.num_tokens)
        _advance(out)
    assert chunks == [16, 16, 8]
    assert s.schedule().scheduled[0].num_tokens == 1  # then decode, one token per step


def test_decode_first_then_new_prefill_in_same_step():
    s = _sched(budget=10)
    a = Request("a", list(range(5)), SamplingParams())
    s.add(a)
    _advance(s.schedule())
    b = Request("b", list(range(20)), SamplingParams())
    s.add(b)
    out = s.schedule()
    assert [(e.request.request_id, e.num_tokens) for e in out.scheduled] == [("a", 1), ("b", 9)]


def test_max_num_seqs_and_priority():
    s = _sched(seqs=2)
    reqs = [Request(f"r{i}", [i] * 3, SamplingParams(), priority=p) for i, p in enumerate([5, 0, 1])]
    for r in reqs:
        s.add(r)
    out = s.schedule()
    assert {e.request.request_id for e in out.scheduled} == {"r1", "r2"}  # lower value = higher priority


def test_preemption_when_blocks_run_out_then_recompute():
    s = _sched(blocks=4, bs=4, budget=64)
    a = Request("a", list(range(7)), SamplingParams(), priority=0)
    b = Request("b", list(range(100, 107)), SamplingParams(), priority=1)
    s.add(a)
    s.add(b)
    _advance(s.schedule())  # both prefilled: 2 blocks each, memory full
    for _ in range(2):
        out = s.schedule()
        _advance(out)
    assert b.status is RequestStatus.WAITING and b.num_preemptions >= 1 and b.num_computed_tokens == 0
    assert a.status is RequestStatus.RUNNING
    s.finish(a, RequestStatus.FINISHED_STOPPED)
    out = s.schedule()
    assert out.scheduled[0].request is b and out.scheduled[0].start == 0  # recompute from scratch


def test_abort_frees_blocks():
    s = _sched()
    r = Request("a", list(range(9)), SamplingParams())
    s.add(r)
    s.schedule()
    assert s.bm.num_free_blocks < 64
    s.abort("a")
    assert s.bm.num_free_blocks == 64 and not s.has_unfinished()


def test_prefilled_kv_is_reserved_then_admitted():
    """KV from elsewhere (a prefill engine): blocks reserved past the cached prefix, filled by the
    caller, then counted computed and run (or left waiting with its KV when there is no room)."""
    s = _sched(blocks=8, bs=4, seqs=1)
    prompt = list(range(10))
    a = Request("a", prompt, SamplingParams())
    s.add(a)
    fresh = s.reserve_prefilled(a, 10)
    assert fresh == a.block_ids and len(fresh) == 3 and a.status is RequestStatus.WAITING
    s.admit_prefilled(a, 10)
    assert a.num_computed_tokens == 10 and a.status is RequestStatus.RUNNING and s.running == [a]
    assert s.holding_kv() == [a]
    b = Request("b", prompt + [7], SamplingParams())  # shares a's two full blocks
    s.add(b)
    hits = s.bm.match_prefix(b)
    fresh = s.reserve_prefilled(b, 11, hits)
    assert len(hits) == 2 and fresh == b.block_ids[2:] and len(fresh) == 1
    s.admit_prefilled(b, 11)
    assert b.status is RequestStatus.WAITING and s.holding_kv() == [a, b]  # max_num_seqs 1: it waits
    c = Request("c", list(range(100, 140)), SamplingParams())
    s.add(c)
    assert s.reserve_prefilled(c, 40) is None and c.block_ids == []  # does not fit: nothing changes



def _steps(s, n):
    """The first n steps as [(request id, tokens)] lists."""
    steps = []
    for _ in range(n):
        out = s.schedule()
        steps.append([(e.request.request_id, e.num_tokens) for e in out.scheduled])
        _advance(out)
    return steps


def _burst_sched(chunked=True):
    return Scheduler(SchedulerConfig(8, 64, chunked, burst_step_tokens=16), BlockManager(64, 4))


def test_a_burst_of_prompts_prefills_over_smaller_steps():
    """Prompts that arrive together prefill a few a step (their first tokens go out early); the
    started requests' decode rows share the burst budget."""
    s = _burst_sched()
    for i in range(5):
        s.add(Request(f"r{i}", list(range(10 * i, 10 * i + 8)), SamplingParams()))
    assert _steps(s, 4) == [
        [("r0", 8), ("r1", 8)],
        [("r0", 1), ("r1", 1), ("r2", 8)],  # r3 would not finish here: it waits, r2's token is not delayed
        [("r0", 1), ("r1", 1), ("r2", 1), ("r3", 8)],
        [("r0", 1), ("r1", 1), ("r2", 1), ("r3", 1), ("r4", 8)],
    ]


def test_a_burst_still_chunks_a_prompt_that_fits_no_step():
    """Whole prompts only once the step computes prompt tokens: a prompt longer than the budget
    is chunked when it comes first (decode rows beside it do not count), and a step's first prompt
    may be a partial one."""
    s = _burst_sched()
    s.add(Request("d", list(range(4)), SamplingParams()))
    assert _steps(s, 1) == [[("d", 4)]]
    s.add(Request("long", list(range(100, 130)), SamplingParams()))
    s.add(Request("short", list(range(200, 206)), SamplingParams()))
    assert _steps(s, 3) == [
        [("d", 1), ("long", 15)],  # long first: chunked; short would not finish beside it
        [("d", 1), ("long", 15)],
        [("d", 1), ("long", 1), ("short", 6)],  # long decodes; short starts once it can finish
    ]


def test_a_lone_prompt_keeps_the_whole_step_budget():
    """Decode rows beside a lone prompt do not make a burst; a second arrival does (and then
    waits for a step where its prompt finishes)."""
    s = _burst_sched()
    s.add(Request("d", list(range(4)), SamplingParams()))
    s.add(Request("long", list(range(100, 200)), SamplingParams()))
    assert _steps(s, 2) == [[("d", 4)], [("d", 1), ("long", 63)]]
    s.add(Request("new", list(range(200, 210)), SamplingParams()))
    assert _steps(s, 4) == [[("d", 1), ("long", 15)], [("d", 1), ("long", 15)], [("d", 1), ("long", 7)],
                            [("d", 1), ("long", 1), ("new", 10)]]


def test_without_chunked_prefill_the_burst_budget_does_not_apply():
    """Whole prompts must fit: a 30-token prompt in a burst still runs (budget 64, not 16)."""
    s = _burst_sched(chunked=False)
    s.add(Request("a", list(range(12)), SamplingParams()))
    s.add(Request("big", list(range(100, 130)), SamplingParams()))
    assert _steps(s, 1) == [[("a", 12), ("big", 30)]]


def test_burst_step_tokens_is_validated():
    try:
        SchedulerConfig(8, 64, burst_step_tokens=0)
    except ValueError:
        pass
    else:
        raise AssertionError("burst_step_tokens=0 accepted")


def _owned(owner: str, i: int, prompt: int = 3) -> Request:
    return Request(f"{owner}{i}", [i + 1] * prompt, SamplingParams(), owner=owner)


def test_an_owner_alone_fills_the_batch_but_others_get_their_share():
    s = Scheduler(SchedulerConfig(8, 256, max_owner_share=0.5), BlockManager(256, 4))
    for i in range(16):
        s.add(_owned("big", i))
    out = s.schedule()
    assert len(out.scheduled) == 8  # alone: the whole batch
    _advance(out)
    for i in range(3):
        s.add(_owned("small", i))
    out = s.schedule()  # full: big gives back its latest 3 (above its share of 4), small starts now
    assert sorted(r.request_id for r in out.preempted) == ["big5", "big6", "big7"]
    started = {e.request.request_id for e in out.scheduled if e.request.owner == "small"}
    assert started == {"small0", "small1", "small2"}
    assert sum(r.owner == "big" for r in s.running) == 5 and len(s.running) == 8
    _advance(out)
    for r in [r for r in s.running if r.owner == "small"]:
        s.finish(r, RequestStatus.FINISHED_STOPPED)
    out = s.schedule()  # nobody else waits: big takes the batch again
    assert len(s.running) == 8 and all(r.owner == "big" for r in s.running)


def test_an_owner_over_its_share_queues_behind_others_at_admission():
    s = Scheduler(SchedulerConfig(4, 256, max_owner_share=0.5), BlockManager(256, 4))
    for i in range(6):
        s.add(_owned("big", i))
    s.add(_owned("small", 0))
    out = s.schedule()
    ids = [e.request.request_id for e in out.scheduled]
    assert ids == ["big0", "big1", "small0", "big2"], ids  # big's third waits until small is in
    assert not out.preempted


def test_share_one_means_no_cap():
    s = Scheduler(SchedulerConfig(4, 256, max_owner_share=1.0), BlockManager(256, 4))
    for i in range(6):
        s.add(_owned("big", i))
    s.add(_owned("small", 0))
    assert [e.request.request_id for e in s.schedule().scheduled] == ["big0", "big1", "big2", "big3"]
