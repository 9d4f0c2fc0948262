"""The engine loop: add_request / step / abort over scheduler + model runner.

step() = schedule -> execute -> postprocess. With async scheduling step N+1 is scheduled before
step N's outputs are post-processed, and the two then overlap: the model runs on the caller's
thread while a host thread post-processes step N. Tokens not yet known are placeholders the runner
fills in; a step after one that sampled for a structured-output request post-processes first
instead (its grammar mask needs that token). The model stays on the caller's thread because CPU
kernels run on that thread's OpenMP team: a second computing thread would start a second team,
oversubscribe the cores and make libgomp throttle its spin-waits (async ran well below sync on 2
cores when the model ran elsewhere: docs/benchmarks/history-engine.md, "Async scheduling").
"""
from __future__ import annotations

import concurrent.futures
import logging
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import torch

from moebus import platforms
from moebus.engine.config import EngineConfig
from moebus.engine.isolation import RequestFailed, isolate
from moebus.engine.model_runner import (
    PLACEHOLDER,
    ModelInput,
    ModelRunner,
    StepResult,
)
from moebus.engine.models import load_model
from moebus.engine.multimodal import ImageSpan, check_spans
from moebus.engine.outputs import EngineStats, RequestOutput
from moebus.engine.request import Request, RequestStatus
from moebus.engine.request_table import RequestTable, Tracked, choice_ids
from moebus.engine.resume import ChoiceFinished, check_resume, prime
from moebus.engine.sampling import SamplingParams, StructuredOutputConfig
from moebus.engine.sampling.spec_decode import DraftModelProposer, NgramProposer, SpecDecodeStats
from moebus.engine.scheduler import Scheduler, SchedulerOutput
from moebus.engine.structured_state import GrammarHub
from moebus.kv.groups import KVLayout, PoolSizing, allocate_caches, build_block_manager, pool_sizes
from moebus.kv.hashing import BlockHashes
from moebus.text.stop_strings import StopStringMatcher
from moebus.text.tokenizer import Tokenizer, load_tokenizer

if TYPE_CHECKING:
    from moebus.engine.block_manager import BlockManager
    from moebus.engine.target_streams import TargetStreams
    from moebus.kv.connector import KVConnector

log = logging.getLogger(__name__)


class _StepFailed(Exception):
    """A step raised after it changed state: what it had produced, and what it had scheduled."""

    def __init__(self, cause: Exception, sched: SchedulerOutput | None, outputs: list[RequestOutput]) -> None:
        super().__init__(repr(cause))
        self.cause, self.sched, self.outputs = cause, sched, outputs


class LLMEngine:
    """Satisfies moebus.engine.port.EnginePort, and moebus.kv.host.KVHost / PrefillHost (what the
    KV code asks of it)."""

    lockstep = False
    tokenizer: Tokenizer
    failed_steps_in_a_row: int
    config: EngineConfig
    kv_layout: KVLayout
    block_manager: BlockManager
    scheduler: Scheduler

    def __init__(self, config: EngineConfig, tokenizer: Tokenizer | None = None,
                 draft_proposer: DraftModelProposer | None = None) -> None:
        """draft_proposer: an MTP head / draft model used for speculative decoding instead of
        n-gram lookup (config.num_speculative_tokens sets how many tokens it may propose)."""
        self.config = config
        torch.manual_seed(config.seed)
        if config.tune_malloc:  # on CPU with glibc: fixed malloc thresholds (platforms/cpu/malloc.py)
            platforms.current(config.device).tune_malloc()
        loaded = load_model(config.model, config.torch_dtype, config.device, config.weight_format,
                            config.gguf_activation_bits)
        self.model = loaded.model
        self.hf_config = loaded.hf_config
        self.tokenizer = tokenizer or load_tokenizer(config.tokenizer or config.model)
        specs = self.model.kv_cache_specs()
        self.kv_layout = layout = KVLayout.plan(specs, config.bound_sliding_window)
        num_blocks = pool_sizes(specs, layout, PoolSizing(
            config.block_size, config.kv_cache_bytes, config.num_kv_blocks, config.max_num_seqs,
            config.max_num_batched_tokens, config.max_model_len), config.torch_dtype)
        device = torch.device(config.device)
        caches = allocate_caches(specs, layout, num_blocks, config.block_size, config.torch_dtype, device)
        self.block_manager = build_block_manager(layout, num_blocks, config.block_size,
                                                 config.enable_prefix_caching)
        self.scheduler = Scheduler(config.scheduler_config(), self.block_manager)
        self.vocab_size = vocab = int(self.hf_config["vocab_size"])
        self.runner = ModelRunner(self.model, caches, config.block_size, device,
                                  list(self.tokenizer.eos_token_ids), batch_invariant=config.deterministic,
                                  windowed=layout.grouped)
        self.grammars = GrammarHub(self.tokenizer, vocab, StructuredOutputConfig(
            compile_timeout_s=config.grammar_compile_timeout_s, mask_budget_s=config.grammar_mask_budget_s,
            mask_window=config.grammar_mask_window))
        if draft_proposer is not None and not config.num_speculative_tokens:
            raise ValueError("a draft proposer needs num_speculative_tokens >= 1")
        self.target_streams: TargetStreams | None = None  # what an MTP drafter reads
        if config.speculative_method == "mtp" and config.num_speculative_tokens and draft_proposer is None:
            from moebus.engine.mtp_proposer import build_mtp  # DeepSeek-V4 only: import on demand

            draft_proposer, self.target_streams = build_mtp(self.model, self.hf_config, config.block_size,
                                                            self.runner.head.greedy)
        self.ngram = NgramProposer(num_speculative_tokens=config.num_speculative_tokens) \
            if config.num_speculative_tokens and draft_proposer is None else None
        self.draft_proposer = draft_proposer
        self.spec_stats = SpecDecodeStats()
        self.stats_ = EngineStats()
        self.tracked = RequestTable()  # by engine request id (one per choice)
        self._kv: KVConnector | None = None
        self.failed_steps_in_a_row = 0  # steps that failed with nobody to blame; the owner may rebuild us
        self._host = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="moebus-host") \
            if config.async_scheduling else None
        self._inflight: tuple[SchedulerOutput, StepResult] | None = None  # executed, not post-processed

    # --- public API ------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    priority: int = 0, resume: Mapping[int, Sequence[int]] | None = None,
                    images: Sequence[ImageSpan] = (), owner: str = "",
                    block_hashes: BlockHashes | None = None) -> None:
        """Queue a request. owner: the API call it is part of (its fair share of the batch,
        scheduler.py); "": the request itself. params.n > 1 fans out into n choices (choice i seeded params.seed + i);
        the later ones wait for the first one's prefill, so all share the prompt's KV blocks.
        resume: a migrated request (engine/resume.py): for each choice still to run, the tokens it
        had produced elsewhere; choices left out had finished. images: encoder rows that replace
        placeholder tokens of the prompt (engine/multimodal.py). block_hashes: the prompt's stable
        block hashes as its frontend computed them (each choice starts from them). Raises ValueError for a request it
        refuses; a request that raises leaves nothing behind."""
        ids = choice_ids(request_id, params.n)
        if self.tracked.taken(request_id, ids):
            raise ValueError(f"duplicate request id {request_id}")
        if not prompt_token_ids:
            raise ValueError("prompt must have at least one token")
        if len(prompt_token_ids) >= self.config.max_model_len:
            raise ValueError(f"prompt has {len(prompt_token_ids)} tokens; max_model_len is "
                             f"{self.config.max_model_len}")
        if max(prompt_token_ids) >= self.vocab_size or min(prompt_token_ids) < 0:
            raise ValueError("prompt token id out of the vocabulary")
        prior = check_resume(resume, params.n, self.vocab_size)
        images = list(images)
        if images:
            if not getattr(self.runner.model, "accepts_image_embeds", False):
                raise ValueError(f"{self.config.model} cannot take images")
            check_spans(images, len(prompt_token_ids), self.runner.model.embed_tokens.embedding_dim)
        choices = []
        for k in sorted(prior):
            tr = self._track(ids[k], request_id, k, prompt_token_ids, params.for_choice(k), priority,
                             owner or request_id)
            tr.req.images = images
            if block_hashes is not None:
                tr.req.stable_space, tr.req.stable_hashes = block_hashes.space, list(block_hashes.hashes)
            prime(tr, prior[k])
            choices.append(tr)
        for tr in choices[1:]:
            tr.req.wait_for = choices[0].req  # let the first one fill the shared prompt blocks
        self.tracked.add(choices)  # last: a request that raised above leaves nothing behind
        for tr in choices:
            if tr.req.output_token_ids:
                self.runner.set_last_sampled(tr.req.request_id, tr.req.output_token_ids[-1])
            self.scheduler.add(tr.req)

    def _track(self, rid: str, group: str, index: int, prompt_token_ids: list[int], params: SamplingParams,
               priority: int, owner: str) -> Tracked:
        grammar = self.grammars.state_for(params.structured) if params.structured else None
        eos = [] if params.ignore_eos else list(self.tokenizer.eos_token_ids)
        req = Request(rid, list(prompt_token_ids), params, eos, priority, owner=owner,
                      max_model_len=self.config.max_model_len, grammar=grammar)
        if self.config.deterministic and req.generator is None and not params.greedy:
            # Batch-invariant sampling needs a per-request stream; unseeded requests share the engine seed.
            req.generator = torch.Generator().manual_seed(self.config.seed)
        return Tracked(req, self.tokenizer.detokenizer(prompt_token_ids),
                       StopStringMatcher(list(params.stop), params.include_stop_str_in_output), group, index)

    def prepare(self, params: SamplingParams) -> concurrent.futures.Future[None] | None:
        """The request's grammar compiled off this thread, under a deadline (EnginePort.prepare)."""
        return self.grammars.prepare(params.structured) if params.structured else None

    def abort_request(self, request_id: str) -> bool:
        """End every live choice of the request and free its KV; False: none was live."""
        choices = self.tracked.choices(request_id)
        for tr in choices:
            self.tracked.pop(tr.req.request_id)
            self._finish(tr.req, RequestStatus.FINISHED_ABORTED)
        return bool(choices)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or self._inflight is not None

    def stats(self) -> dict[str, float | int]:
        bm = self.block_manager
        return {"num_running": len(self.scheduler.running), "num_waiting": len(self.scheduler.waiting),
                "kv_blocks_free": bm.num_free_blocks, "kv_blocks_total": len(bm.blocks),
                "kv_usage": round(bm.usage, 4), "prefix_cache_queries": bm.queries,
                "prefix_cache_hits": bm.hits, "kv_blocks_allocated": bm.allocated,
                "spec_acceptance_rate": self.spec_stats.acceptance_rate,
                "steps": self.stats_.steps}

    # --- public verbs for KV movement (the KV connector, kv/connector.py) ------------------------
    @property
    def kv(self) -> KVConnector:
        if self._kv is None:
            from moebus.kv.connector import KVConnector  # the torch-side KV code, loaded on first use

            self._kv = KVConnector(self)
        return self._kv

    @property
    def kv_caches(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """For KV movement (kv.transfer, kv.tiers): each tensor indexed by its group's block ids
        (kv_layout.groups; kv.groups.group_block_ids)."""
        return self.runner.kv_caches

    def get_request(self, request_id: str, index: int = 0) -> Request:
        """The live engine request of a caller's request (its choice `index`); KeyError if none."""
        for tr in self.tracked.choices(request_id):
            if tr.index == index:
                return tr.req
        raise KeyError(f"no live request {request_id!r}" + (f" (choice {index})" if index else ""))

    def settled_tokens(self, req: Request) -> int:
        """Tokens of req whose KV is written. Under async scheduling the step in flight (run, its
        outputs not yet applied) already counts as computed; its tokens are left out until they land."""
        n = req.num_computed_tokens
        if self._inflight is not None:
            for s in self._inflight[0].scheduled:
                if s.request is req:
                    n = min(n, s.start)
        return n

    def add_prefilled(self, request_id: str, prompt_token_ids: list[int], first_token: int,
                      params: SamplingParams, priority: int = 0, generator_state: torch.Tensor | None = None,
                      images: Sequence[ImageSpan] = ()) -> Request:
        """Add a request whose first output token was sampled elsewhere (a prefill engine streamed
        it): recorded, not emitted again; the next step decodes the second token. Its prompt's KV is
        attached through the scheduler (reserve_prefilled / admit_prefilled) or recomputed. Raises
        ValueError, leaving nothing behind, when first_token already ends it."""
        if params.n != 1:
            raise ValueError("a prefilled request has one choice (n == 1)")
        try:
            self.add_request(request_id, prompt_token_ids, params, priority, resume={0: [first_token]},
                             images=images)
        except ChoiceFinished as e:
            raise ChoiceFinished(f"{request_id} finished at its first token: nothing to decode ({e})") from None
        req = self.tracked[request_id].req
        if generator_state is not None and req.generator is not None:
            req.generator.set_state(generator_state)
        return req

    def step(self) -> list[RequestOutput]:
        """One engine step. A request whose own state raises fails alone (its output has
        finish_reason "error"); a step that fails with nobody to blame fails the requests it held,
        retryably. Either way the engine goes on serving the others. A request whose grammar
        cost past its budget in the last step fails first (structured_state.py)."""
        outs = self._fail_costly_grammars()
        try:
            outs += self._step_async() if self._host is not None else self._step_sync()
        except _StepFailed as f:
            outs += f.outputs + self._recover(f.cause, f.sched)
        except Exception as e:  # raised before the step changed anything it would need undone
            outs += self._recover(e, None)
        else:
            self.failed_steps_in_a_row = 0
        if outs and self._kv is not None:
            self._kv.after_step()  # its prefix-cache events and new blocks, while requests are live
        return outs

    # --- internals -------------------------------------------------------------------------
    def _step_sync(self) -> list[RequestOutput]:
        sched = self.scheduler.schedule()
        outs = self._fail_scheduled(sched)
        if not sched.scheduled:
            return outs
        try:
            inp = self.runner.prepare(sched, self._grammar_masks(sched))
            self._advance(sched, placeholders=False)
            result = self._timed_execute(inp)
        except Exception as e:
            raise _StepFailed(e, sched, outs) from e
        return outs + self._postprocess(sched, result)

    def _step_async(self) -> list[RequestOutput]:
        # Schedule and prepare step N+1 before post-processing step N (prepare snapshots the
        # placeholders that post-processing fills), then run N+1 here while the host thread
        # post-processes N.
        todo, self._inflight = self._inflight, None  # step N: executed, not post-processed
        outs: list[RequestOutput] = []
        sched = post = None
        try:
            if todo is not None and self._grammar_waits_on(todo[0]):
                # A grammar's next mask needs the token in flight: no overlap for this step.
                prev, todo = todo, None
                outs = self._postprocess(*prev)
            sched = self.scheduler.schedule()
            outs += self._fail_scheduled(sched)
            inp = None
            if sched.scheduled:
                inp = self.runner.prepare(sched, self._grammar_masks(sched))
                self._advance(sched, placeholders=True)
            if todo is not None:
                post, todo = self._host.submit(self._postprocess, *todo), None
            if inp is not None:
                self._inflight = (sched, self._timed_execute(inp))
        except Exception as e:
            # Step N ran fine: its tokens still go out (recovery drops only N+1's placeholders).
            if post is not None:
                outs += post.result()
            elif todo is not None:
                outs += self._postprocess(*todo)
            raise _StepFailed(e, sched, outs) from e
        if post is not None:
            outs += post.result()
        return outs

    def _fail_scheduled(self, sched: SchedulerOutput) -> list[RequestOutput]:
        """Requests the scheduler dropped because their own state raised."""
        outs = []
        for req, e in sched.failed:
            out = self._fail(req.request_id, f"request failed in the engine (scheduling): {type(e).__name__}: {e}")
            if out is not None:
                outs.append(out)
        return outs

    def _fail_costly_grammars(self) -> list[RequestOutput]:
        outs = []
        for rid, (message, param) in self.grammars.take_over_budget().items():
            log.warning("failing %s: %s", rid, message)
            if (out := self._fail(rid, message, error_param=param)) is not None:
                outs.append(out)
        return outs

    def _recover(self, exc: Exception, sched: SchedulerOutput | None) -> list[RequestOutput]:
        """After a failed step: its KV writes and placeholder tokens cannot be trusted, so every
        running request recomputes from the tokens it has emitted (preemption) and no cached
        prefix block outlives the step. The requests to blame fail alone; with nobody to blame,
        the requests the step held fail retryably (another engine may run them)."""
        self._inflight = None
        for r in self.scheduler.running:
            del r.output_token_ids[_num_real(r.output_token_ids):]
        self.scheduler.preempt_all()
        self.block_manager.reset_prefix_cache()
        if isinstance(exc, RequestFailed):
            blamed = {rid: exc.message(rid) for rid in exc.failures}
            retryable = False
        else:
            log.error("engine step failed with no request to blame", exc_info=exc)
            self.failed_steps_in_a_row += 1
            held = [s.request.request_id for s in sched.scheduled] if sched is not None else list(self.tracked)
            blamed = dict.fromkeys(held, f"engine step failed: {type(exc).__name__}: {exc}")
            retryable = True
        outs = [self._fail(rid, msg, retryable) for rid, msg in blamed.items()]
        return [o for o in outs if o is not None]

    def _fail(self, request_id: str, message: str, retryable: bool = False,
              error_param: str | None = None) -> RequestOutput | None:
        """End a request with an error output (None: it had already finished); error_param: the
        request's own field is at fault (a 400)."""
        tr = self.tracked.pop(request_id)
        if tr is None:
            return None
        r = tr.req
        self._finish(r, RequestStatus.FINISHED_ABORTED)
        return RequestOutput(tr.group, [], "", True, "error", None, r.num_prompt_tokens, r.num_cached_tokens,
                             self._num_real_outputs(r), error=message, retryable=retryable, index=tr.index,
                             error_param=error_param)

    @staticmethod
    def _grammar_waits_on(sched: SchedulerOutput) -> bool:
        return any(s.sample and s.request.grammar is not None and not s.request.status.finished
                   for s in sched.scheduled)

    @staticmethod
    def _advance(sched: SchedulerOutput, placeholders: bool) -> None:
        """Count this step's tokens as computed when it is launched, so the next schedule() can
        run before this step finishes; drafts are credited once verified."""
        for s in sched.scheduled:
            r = s.request
            r.num_computed_tokens = s.start + s.num_tokens - s.num_draft
            if s.sample and placeholders:
                r.output_token_ids.append(PLACEHOLDER)

    def _timed_execute(self, inp: ModelInput) -> StepResult:
        sched = inp.sched
        t0 = time.perf_counter()
        res = self.runner.execute(inp)
        self.stats_.steps += 1
        self.stats_.tokens_computed += sched.num_tokens
        self.stats_.step_seconds.append(time.perf_counter() - t0)
        return res

    def _grammar_masks(self, sched: SchedulerOutput) -> torch.Tensor | None:
        reqs = [s.request for s in sched.scheduled if s.sample]
        return isolate("grammar mask", [r.request_id for r in reqs], lambda: self.grammars.batch_mask(reqs),
                       lambda k: self.grammars.batch_mask([reqs[k]]))

    def _postprocess(self, sched: SchedulerOutput, result: StepResult) -> list[RequestOutput]:
        outs: list[RequestOutput] = []
        if self.target_streams is not None:
            self.target_streams.record(sched, result)
        for s, toks, lps, n_acc in zip(sched.scheduled, result.tokens, result.logprobs,
                                       result.num_accepted_drafts, strict=True):
            r = s.request
            if r.status.finished:
                continue  # aborted or stopped while this step ran; its tokens are dropped
            if not s.sample:  # a prefill chunk short of the prompt's end
                self.block_manager.cache_blocks(r)
                continue
            if s.num_draft:
                r.num_computed_tokens += n_acc
                r.draft_token_ids = []
                self.spec_stats.observe([s.num_draft], [toks])
            try:
                outs.append(self._append_tokens(r, toks, lps))
            except Exception as e:  # grammar, detokenizer, stop checks: this request's own state
                log.warning("post-processing %s failed", r.request_id, exc_info=True)
                failed = self._fail(r.request_id, f"request failed in the engine (post-processing): "
                                                  f"{type(e).__name__}: {e}")
                if failed is not None:
                    outs.append(failed)
        try:
            self._propose_drafts()
        except Exception:  # drafts only save time: go on without them this step
            log.warning("draft proposal failed", exc_info=True)
            for r in self.scheduler.running:
                r.draft_token_ids = []
        return outs

    def _propose_drafts(self) -> None:
        if self.ngram is None and self.draft_proposer is None:
            return
        reqs = [r for r in self.scheduler.running if not r.is_prefill and r.grammar is None]
        if not reqs:
            return
        k = self.config.num_speculative_tokens
        batch = [r.all_token_ids for r in reqs]
        hidden = None if self.target_streams is None else \
            self.target_streams.windows([r.request_id for r in reqs], [len(t) for t in batch])
        drafts = self.ngram.propose_batch(batch, None, k) if self.ngram is not None \
            else self.draft_proposer.propose(batch, hidden, k)
        for r, d in zip(reqs, drafts, strict=True):
            room = r.max_tokens - len(r.output_token_ids) - 1  # never draft past max_tokens
            r.draft_token_ids = list(d[: max(min(room, k), 0)])

    def _append_tokens(self, r: Request, toks: list[int], lps: list[dict[int, float]] | None) -> RequestOutput:
        tr = self.tracked[r.request_id]
        emitted: list[int] = []
        status = None
        out_ids = r.output_token_ids
        for t in toks:
            k = _num_real(out_ids)
            if k < len(out_ids):  # async scheduling reserved a slot for this token at launch
                out_ids[k] = t
            else:
                out_ids.append(t)
            emitted.append(t)
            if r.grammar is not None:
                r.grammar.accept_token(t)
            status = self._check_stop(r, t)
            if status is not None:
                break
        text = tr.stops.feed(tr.detok.push(emitted))
        if tr.stops.stopped and status is None:
            status = RequestStatus.FINISHED_STOPPED
            r.stop_reason = tr.stops.matched
        if status is not None:
            text += tr.stops.flush()
            del out_ids[_num_real(out_ids):]  # slots of steps still in flight for it
        elif r.status is RequestStatus.RUNNING:
            self.block_manager.cache_blocks(r)
        out = RequestOutput(tr.group, emitted, text, status is not None,
                            status.value if status is not None else None, lps, r.num_prompt_tokens,
                            r.num_cached_tokens, self._num_real_outputs(r), index=tr.index,
                            stop_reason=r.stop_reason if status is not None else None)
        if status is not None:
            self.tracked.pop(r.request_id)
            self._finish(r, status)
        return out

    @staticmethod
    def _num_real_outputs(r: Request) -> int:
        return _num_real(r.output_token_ids)

    def _check_stop(self, r: Request, token: int) -> RequestStatus | None:
        n_out = self._num_real_outputs(r)
        if n_out >= r.params.min_tokens and (token in r.eos_token_ids or token in r.params.stop_token_ids):
            r.stop_reason = token if token in r.params.stop_token_ids else None  # eos: None, as vLLM
            return RequestStatus.FINISHED_STOPPED
        if r.grammar is not None and r.grammar.is_terminated():
            return RequestStatus.FINISHED_STOPPED
        if n_out >= r.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        return None

    def _finish(self, req: Request, status: RequestStatus) -> None:
        self.scheduler.finish(req, status)
        self.runner.forget(req.request_id)
        if self.target_streams is not None:
            self.target_streams.forget(req.request_id)

    def close(self) -> None:
        if self._host is not None:
            self._host.shutdown(wait=True)
        self.grammars.close()


def _num_real(out_ids: list[int]) -> int:
    """Output tokens before the placeholders, which async scheduling appends at launch and fills
    in order: they are always a run at the tail, so scan from the end (not the whole list)."""
    k = len(out_ids)
    while k and out_ids[k - 1] == PLACEHOLDER:
        k -= 1
    return k
