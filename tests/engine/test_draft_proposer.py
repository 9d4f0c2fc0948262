"""The draft-model hook: whatever a drafter proposes, exact verification keeps greedy output."""
import pytest

from moebus.engine.llm_engine import LLMEngine
from moebus.engine.sampling import SamplingParams

pytestmark = pytest.mark.slow  # the slow tier: ./run test-slow


class OracleDrafter:
    """Proposes the known greedy continuation: every draft should be accepted."""

    def __init__(self, prompt: list[int], continuation: list[int]) -> None:
        self.full = prompt + continuation

    def propose(self, batch_token_ids, hidden_states, k):
        return [self.full[len(t):len(t) + k] if self.full[:len(t)] == list(t) else [] for t in batch_token_ids]


class WrongDrafter:
    """Proposes a token that greedy never picks: every draft should be rejected."""

    def propose(self, batch_token_ids, hidden_states, k):
        return [[t[-1]] * k for t in batch_token_ids]


def _run(engine: LLMEngine, prompt: list[int], params: SamplingParams) -> list[int]:
    engine.add_request("q", prompt, params)
    out: list[int] = []
    while engine.has_unfinished_requests():
        for o in engine.step():
            out += o.new_token_ids
    return out


def test_draft_hook_keeps_greedy_output_and_counts_acceptance(llm, chat_prompts):
    prompt = chat_prompts[0]
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    ref = llm.generate([prompt], params)[0].outputs[0].token_ids
    cfg = dict(num_speculative_tokens=4)
    from moebus.engine.config import EngineConfig

    oracle = LLMEngine(EngineConfig(**cfg), tokenizer=llm.tokenizer, draft_proposer=OracleDrafter(prompt, ref))
    assert _run(oracle, prompt, params) == ref
    assert oracle.spec_stats.acceptance_rate > 0.9
    assert oracle.stats_.steps < len(ref)  # several tokens per step
    wrong = LLMEngine(EngineConfig(**cfg), tokenizer=llm.tokenizer, draft_proposer=WrongDrafter())
    assert _run(wrong, prompt, params) == ref
    print(f"acceptance: oracle {oracle.spec_stats.acceptance_rate:.2f}, wrong {wrong.spec_stats.acceptance_rate:.2f}")
