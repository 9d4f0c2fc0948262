"""The API fields the engine itself honours (docs/api.md), on the real small model: logit_bias,
stop_reason, json_object and an EBNF grammar."""
import json
import re

from moebus.engine.sampling import SamplingParams, StructuredOutputParams

CHAT = [{"role": "user", "content": "Reply with the JSON object {\"ok\": true} and nothing else."}]


def run(llm, prompt: list[int], params: SamplingParams, rid: str):
    """(token ids, text, the finishing RequestOutput) of one request driven through the engine."""
    llm.engine.add_request(rid, prompt, params)
    ids, text = [], ""
    while True:
        for out in llm.engine.step():
            if out.request_id == rid:
                ids += out.new_token_ids
                text += out.new_text
                if out.finished:
                    return ids, text, out


def test_logit_bias_steers_the_greedy_choice(llm, chat_prompts) -> None:
    ref, _, _ = run(llm, chat_prompts[0], SamplingParams(temperature=0.0, max_tokens=4), "lb-ref")
    forced = llm.tokenizer.encode(" banana")[0]
    ids, _, _ = run(llm, chat_prompts[0], SamplingParams(temperature=0.0, max_tokens=4, logit_bias={forced: 100.0}),
                    "lb-force")
    assert ids == [forced] * 4
    ids, _, _ = run(llm, chat_prompts[0], SamplingParams(temperature=0.0, max_tokens=4,
                                                         logit_bias={ref[0]: -100.0}), "lb-ban")
    assert ids[0] != ref[0]


def test_stop_reason_names_the_stop_token_or_string(llm, chat_prompts) -> None:
    greedy = SamplingParams(temperature=0.0, max_tokens=12)
    ref, text, out = run(llm, chat_prompts[0], greedy, "sr-ref")
    assert out.stop_reason is None  # length, or eos
    _, _, out = run(llm, chat_prompts[0], SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=[ref[3]]),
                    "sr-id")
    assert out.finish_reason == "stop" and out.stop_reason == ref[3]
    word = text.split()[2]
    _, cut, out = run(llm, chat_prompts[0], SamplingParams(temperature=0.0, max_tokens=12, stop=[word]), "sr-str")
    assert out.finish_reason == "stop" and out.stop_reason == word and word not in cut


def test_json_object_is_a_closed_object(llm) -> None:
    prompt = llm.tokenizer.encode(llm.tokenizer.apply_chat_template(CHAT))
    params = SamplingParams(temperature=0.0, max_tokens=40, structured=StructuredOutputParams(json_object=True),
                            logit_bias={llm.tokenizer.encode("}")[0]: 5.0})
    _, text, out = run(llm, prompt, params, "json-object")
    assert out.finish_reason == "stop", text
    assert isinstance(json.loads(text), dict)


def test_grammar_constrains_the_text(llm, chat_prompts) -> None:
    grammar = 'root ::= ("yes" | "no") ", because " [a-z ]{1,20} "."'
    params = SamplingParams(temperature=0.0, max_tokens=30, structured=StructuredOutputParams(grammar=grammar))
    _, text, out = run(llm, chat_prompts[0], params, "grammar")
    assert out.finish_reason == "stop" and re.fullmatch(r"(yes|no), because [a-z ]{1,20}\.", text), text
