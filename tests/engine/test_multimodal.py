"""Image rows in the engine (engine/multimodal.py) on the real model: rows that equal token
embeddings give exactly the text's output, in every scheduling path; the prefix cache tells images
apart by content hash."""
import pytest
import torch

from moebus.engine.llm import LLM
from moebus.engine.multimodal import ImageSpan
from moebus.engine.sampling import SamplingParams

pytestmark = pytest.mark.slow  # the slow tier: ./run test-slow

GREEDY = SamplingParams(temperature=0.0, max_tokens=12)
PLACEHOLDER = 0


@pytest.fixture(scope="module")
def parts(llm):
    tok = llm.tokenizer
    pre = tok.encode("<|im_start|>user\nThe animal in the picture, a")
    word = tok.encode(" giraffe", add_special_tokens=False)
    post = tok.encode(", is eating leaves from a tall tree. Describe what it looks like.<|im_end|>\n"
                      "<|im_start|>assistant\n", add_special_tokens=False)
    return pre, word, post


def _image(llm, ids: list[int], h: int) -> ImageSpan:
    return ImageSpan(0, llm.engine.runner.model.embed_tokens.weight[ids].detach().clone(), h)


def _at(span: ImageSpan, offset: int) -> ImageSpan:
    return ImageSpan(offset, span.embeds, span.content_hash)


def _with_image(parts, llm, h=7):
    pre, word, post = parts
    return pre + [PLACEHOLDER] * len(word) + post, [_at(_image(llm, word, h), len(pre))]


def test_rows_equal_to_token_embeddings_give_the_texts_output(llm, parts):
    pre, word, post = parts
    text = llm.generate([pre + word + post], GREEDY)[0].outputs[0].token_ids
    ids, spans = _with_image(parts, llm)
    assert llm.generate([ids], GREEDY, images=[spans])[0].outputs[0].token_ids == text
    blank = llm.generate([ids], GREEDY)[0].outputs[0].token_ids  # the placeholders alone: another answer
    assert blank != text


def test_batched_chunked_and_preempted_keep_image_output(llm, parts, chat_prompts):
    ids, spans = _with_image(parts, llm)
    alone = llm.generate([ids], GREEDY, images=[spans])[0].outputs[0].token_ids
    batch = llm.generate([chat_prompts[0], ids, chat_prompts[1]], GREEDY, images=[[], spans, []])
    assert batch[1].outputs[0].token_ids == alone
    chunked = LLM(max_num_batched_tokens=8)  # the image straddles prefill chunks
    assert chunked.generate([ids], GREEDY, images=[spans])[0].outputs[0].token_ids == alone
    tiny = LLM(num_kv_blocks=10, block_size=8)  # preempted and recomputed: the rows come back
    sched, preempted = tiny.engine.scheduler, []
    real = sched._preempt
    sched._preempt = lambda req, out: (preempted.append(req.request_id), real(req, out))  # spy only
    out = tiny.generate([ids, chat_prompts[2], ids], GREEDY, images=[spans, [], spans])
    assert preempted, "the tiny cache should have forced a preemption"
    assert out[0].outputs[0].token_ids == alone and out[2].outputs[0].token_ids == alone
    assert tiny.engine.block_manager.num_free_blocks == 10


def test_prefix_cache_reuses_the_same_image_never_another(llm, parts):
    pre, word, post = parts
    ids, spans = _with_image(parts, llm, h=101)
    first = llm.generate([ids], GREEDY, images=[spans])[0]
    again = llm.generate([ids], GREEDY, images=[spans])[0]
    assert again.num_cached_tokens >= 16 and again.outputs[0].token_ids == first.outputs[0].token_ids
    other_word = llm.tokenizer.encode(" penguin", add_special_tokens=False)
    assert len(other_word) == len(word)
    other = [_at(_image(llm, other_word, 202), len(pre))]
    res = llm.generate([ids], GREEDY, images=[other])[0]  # same token ids, another image
    bs = llm.engine.block_manager.block_size
    assert res.num_cached_tokens <= len(pre) // bs * bs  # only blocks wholly before the image
    ref = llm.generate([pre + other_word + post], GREEDY)[0].outputs[0].token_ids
    assert res.outputs[0].token_ids == ref


def test_bad_spans_are_refused(llm, parts):
    ids, spans = _with_image(parts, llm)
    e = llm.engine
    p = SamplingParams(max_tokens=2)
    with pytest.raises(ValueError, match="outside the prompt"):
        e.add_request("x1", ids[:5], p, images=spans)
    with pytest.raises(ValueError, match="must be"):
        e.add_request("x2", ids, p, images=[ImageSpan(spans[0].offset, torch.zeros(2, 3), 1)])
    assert not e.has_unfinished_requests()
